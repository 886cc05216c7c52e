"""How an :class:`~pycomm.exchange.Exchange` issues its calls: one thread, in call order.

A call returns a :class:`Work` at once; the Exchange's :class:`Issuer` thread takes the calls
queued so far, has the ranks compare them (``check_order``), and issues those that passed,
on the Exchange's own process groups, while the caller goes on. Every rank thus issues the
same collectives in the same order however its exchanges progress, and none of them meets
the caller's own collectives on the caller's group.

The comparison (``check_order="every"``): one all-reduce (MAX) of a fixed-size tensor holding
how many calls this rank queued and the 56-bit digest of each (and their negations, so that
one MAX gives every rank the largest and the smallest value of each slot). The calls every
rank had queued are compared: where a digest differs, that call is compared in full (one
object gather, :func:`pycomm.codec.agree.agree`), which raises the ValueError naming each
rank's call on every rank; the calls past what every rank queued are compared again with the
next ones. So the batches, and the collectives issued for them, are the same on every rank.

A call its caller waits for at once (``async_op=False``: FSDP2's reduce-scatter and
all-gather) runs on the caller's thread instead, once every call queued before it is issued:
no hop to the thread and back, the same order on every rank.

On a GPU a call works on the caller's stream as it was when the call was made: a queued call
records an event on the caller's current stream and the issuing thread's side stream waits
for it before the call's first kernel (the caller may have queued work on its tensors on a
stream of its own, as FSDP2 does, right before the call); an inline call runs on the
caller's current stream itself. Its result is ready on the stream that waits for it
(``Work.wait()``, ``get_future().wait()``): the futures know their device.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import queue
import threading
import time
from collections.abc import Hashable, Iterator
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from pycomm.codec.agree import agree, error_field
from pycomm.codec.groups import new_groups

__all__ = ["SLOTS", "Call", "Issued", "Issuer", "Stream", "Work"]

# calls one comparison covers at most
SLOTS = 16


class Work:
    """An issued call of an :class:`~pycomm.exchange.Exchange`: ``wait()`` blocks until the
    result is in the caller's tensor (or list of tensors) and returns it; ``get_future()`` is
    the ``torch.futures.Future`` of it.

    Attributes (read-only, known once the call is issued, with no wait for its data):
        bytes_sent: the bytes this rank puts on the wire for the call (what ``stats``
            adds to its ``bytes_sent``).
        bytes_fp32: what the exact fp32 collective of the same tensors sends (what ``stats``
            adds to its ``bytes_fp32``).

    Example:
        >>> work = ex.all_reduce(t, key="t")
        >>> work.wait() is t
        True
        >>> work.bytes_sent, work.bytes_fp32  # this call's bytes, and an fp32 collective's
    """

    def __init__(
        self,
        future: Optional[torch.futures.Future] = None,
        result: Any = None,
        bytes_sent: int = 0,
        bytes_fp32: int = 0,
    ) -> None:
        self.observed = False  # wait() raised, or would have, to its caller
        self._ready = threading.Event()  # issued: the future and the bytes are known
        if future is not None:
            self.set(future, result, bytes_sent, bytes_fp32)

    def set(self, future: torch.futures.Future, result: Any, sent: int, fp32: int) -> None:
        """The call is issued: its future, its result and its bytes."""
        self._future, self._result, self._bytes = future, result, (sent, fp32)
        self._ready.set()

    def fail(self, exc: BaseException, observed: bool = False) -> None:
        """The call failed with ``exc`` (``observed``: its caller has it already)."""
        future: torch.futures.Future = torch.futures.Future()
        future.set_exception(exc)
        self.observed = self.observed or observed
        self.set(future, None, 0, 0)

    @property
    def issued(self) -> bool:
        return self._ready.is_set()

    @property
    def bytes_sent(self) -> int:
        self._ready.wait()
        return self._bytes[0]

    @property
    def bytes_fp32(self) -> int:
        self._ready.wait()
        return self._bytes[1]

    def wait(self) -> Any:
        self.observed = True
        self._ready.wait()
        self._future.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        self._ready.wait()
        return self._future

    def is_completed(self) -> bool:
        return self._ready.is_set() and self._future.done()


class Issued(NamedTuple):
    """What a call's body issued: the future of its result, its result, and its bytes."""

    future: torch.futures.Future
    result: Any
    bytes_sent: int
    bytes_fp32: int


class Call:
    """A call handed to the issuing thread: the stream it belongs to (its Exchange's
    :class:`Stream`), its ``(call, key)``, what the ranks compare (``mark``, by its digest;
    ``fields``, in full), whether it is compared, this rank's refusal of its arguments, the
    body that issues it, what fuses it with the calls beside it (an all-reduce's), and its
    :class:`Work`."""

    def __init__(
        self,
        stream: Stream,
        pair: tuple,
        mark: str,
        fields: dict,
        compared: bool,
        err: Optional[Exception],
        body: Callable[[], Issued],
        fuse: Any = None,
        ready: Optional[tuple[Any, Any]] = None,
    ) -> None:
        self.stream, self.pair, self.mark, self.fields = stream, pair, mark, fields
        self.compared, self.err, self.body, self.fuse = compared, err, body, fuse
        self.ready = ready  # on a GPU, queued: (device, the caller's stream's event)
        self.work = Work()
        self.checked = threading.Event()  # its comparison is done (passed or failed)
        self.failed: Optional[BaseException] = None

    def fail(self, exc: BaseException) -> None:
        self.failed = exc
        self.work.fail(exc, observed=self.err is not None)
        self.checked.set()


def digest(mark: str) -> int:
    """A call's 56-bit digest: what the ranks compare for it."""
    return int.from_bytes(hashlib.blake2b(mark.encode(), digest_size=7).digest(), "little")


class Stream:
    """One Exchange's calls: how they are compared (``mode``: ``check_order``), what issues
    them (``runner``: ``runs(calls)`` cuts passed calls into runs to issue together,
    ``run_fused(fuses)`` issues a run of several, each call's ``body()`` one alone), the calls
    in flight (a key's next call is issued once its last one is done; every last call with
    ``serial``, ``strict_skip``'s step commit), the keys compared and each call's place."""

    def __init__(self, runner: Any, mode: str, where: str, serial: bool) -> None:
        self.runner, self.mode, self.where, self.serial = runner, mode, where, serial
        self.inflight: dict[Hashable, Work] = {}
        self.compared: set = set()  # (call, key) pairs compared since built or loaded
        self.seq = 0  # calls made (refused ones too): each call's place, compared

    def settle(self, pair: Optional[Hashable] = None) -> None:
        """Wait for the last call of ``pair`` (None: of every key); what it raised is raised
        here once, unless its ``wait()`` gave it to the caller already."""
        if pair is None:
            works, self.inflight = list(self.inflight.values()), {}
        else:
            works = [w for w in (self.inflight.pop(pair, None),) if w is not None]
        for work in works:
            try:
                work.get_future().wait()
            except Exception:
                if not work.observed:
                    work.observed = True
                    raise


class Issuer:
    """The thread that issues the calls of every Exchange over one process group, in call
    order (see the module docstring), on a group of its own over the same ranks (and the
    codecs' phase groups over that one), made once: Exchanges come and go without making
    groups or threads. :meth:`of` gives the group's.

    Args:
        group: the Issuer's own group. world: its ranks.
    """

    def __init__(self, group: Any, world: int) -> None:
        self.group, self.world = group, world
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()
        # held while calls are compared and issued, by the thread or an inline caller
        self._lock = threading.Lock()
        self._queued = 0  # calls put in the queue and not yet issued or failed
        self._streams: dict[Any, Any] = {}  # the side stream of each GPU

    @classmethod
    def of(cls, parent: Any) -> Issuer:
        """The Issuer of ``parent`` (None: the default group), made at its first Exchange on
        every rank of it (a collective: a group of its own over the same ranks)."""
        world = parent or dist.group.WORLD
        entry = _ISSUERS.get(id(world))
        if entry is None or entry[0] is not world:
            ranks = dist.get_process_group_ranks(world)
            (group,) = new_groups(world, [ranks], count=1)
            entry = _ISSUERS[id(world)] = (world, cls(group, len(ranks)))
        return entry[1]

    def submit(
        self,
        stream: Stream,
        pair: tuple,
        t: Optional[torch.Tensor],
        how: str,
        err: Optional[Exception],
        shape: str,
        body: Callable[[], Issued],
        fuse: Any = None,
        inline: bool = False,
    ) -> Work:
        """Queue a call of ``stream`` and return its :class:`Work`. ``err``: this rank's
        refusal of its arguments, raised here; the ranks compare it like the call, so each
        raises the first error any of them met. A key's first call (and a refused one) waits
        for its comparison, so a difference raises here on every rank; a later call's
        difference fails its ``wait()``. ``inline``: compared and issued on this thread, once
        the calls queued before it are issued."""
        call, key = pair
        try:
            first = pair not in stream.compared
        except TypeError:
            first = True
            err = err or TypeError(
                f"{stream.where}.{call}: key={key!r} is not hashable; expected a str, int or tuple"
            )
        seq, stream.seq = stream.seq, stream.seq + 1
        mode = stream.mode
        compared = self.world > 1 and (mode == "every" or (mode == "first" and first))
        if err is not None and not compared:
            raise err
        if err is None:
            stream.compared.add(pair)
        what = f"call {seq}: {call}(key={key!r}, {'refused input' if t is None else shape}, {how})"
        fields = {"the order of calls": what} if compared else {}  # (and the error: agreed)
        mark = what if err is None else f"{what} {err}"
        ready = None
        if not inline and t is not None and t.device.type == "cuda":
            ready = (t.device, torch.cuda.current_stream(t.device).record_event())
            t.record_stream(self.side_stream(t.device))  # in use there until the call is done
        item = Call(stream, pair, mark, fields, compared, err, body, fuse, ready)
        if inline:
            self._inline(item)
        else:
            self._put(item)
        if err is None and not (compared and first) and not inline:
            return item.work
        item.checked.wait()
        if item.failed is not None:
            raise item.failed
        if err is not None:
            raise err
        return item.work

    def _inline(self, item: Call) -> None:
        """Compare and issue ``item`` on this thread, once nothing queued is left to issue."""
        self._forked()
        while not item.checked.is_set():
            with self._lock:
                if self._queued == 0:
                    try:
                        passed, _ = self.checks([item])
                    except Exception as e:  # noqa: BLE001 - the comparison's collective failed
                        item.fail(e)
                        return
                    self.issue(passed, fuse=False)
                    continue
            self.drain()

    def _forked(self) -> None:
        """In a forked child, the parent's thread and queue are not here: start afresh."""
        if self._pid != os.getpid():
            self._queue, self._thread, self._pid = queue.SimpleQueue(), None, os.getpid()
            self._lock, self._queued = threading.Lock(), 0

    def side_stream(self, device: Any) -> Any:
        """The stream the issuing thread issues the calls of ``device`` (a GPU) on."""
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    def _put(self, item: Any) -> None:
        self._forked()
        if self._thread is None:
            self._thread = threading.Thread(
                target=_serve, args=(self, self._queue), name="pycomm-exchange", daemon=True
            )
            self._thread.start()
        if isinstance(item, Call):
            with self._lock:
                self._queued += 1
        self._queue.put(item)

    def drain(self) -> None:
        """Wait until every queued call is issued (or failed)."""
        if self._thread is not None and self._pid == os.getpid():
            done = threading.Event()
            self._queue.put(done)
            done.wait()

    def checks(self, calls: list[Call]) -> tuple[list[Call], list[Call]]:
        """On the issuing thread: the calls whose comparison passed, in order, and those to
        compare again (past a difference, or past what every rank had queued). A batch of
        ``check_order="every"`` calls is compared by digests; in another, each call compared
        (a key's first, with ``"first"``) is compared in full."""
        if self.world == 1:
            return calls, []
        if calls[0].stream.mode != "every":
            return [c for c in calls if not c.compared or self._agreed(c)], []
        k, n = SLOTS, len(calls)
        digests = [digest(c.mark) for c in calls]
        v = torch.zeros(2 + 2 * k, dtype=torch.int64)
        v[0], v[1] = n, -n
        v[2 : 2 + n] = torch.tensor(digests)
        v[2 + k : 2 + k + n] = -v[2 : 2 + n]
        got = v.to(self.device)
        dist.all_reduce(got, op=dist.ReduceOp.MAX, group=self.group)
        got = got.tolist()
        queued = -got[1]  # the fewest calls a rank had queued
        for i in range(queued):
            if got[2 + i] != digests[i] or got[2 + k + i] != -digests[i]:
                ok = self._agreed(calls[i])
                return calls[: i + ok], calls[i + 1 :]
        return calls[:queued], calls[queued:]

    def _agreed(self, c: Call) -> bool:
        """Compare ``c`` in full (a collective): False, the call failed with the error
        every rank raises, where the ranks differ."""
        where = c.stream.where
        try:
            agree(
                f"{where}.{c.pair[0]}", {**error_field(c.err), **c.fields}, self.group, call=where
            )
        except Exception as e:  # noqa: BLE001 - the same error on every rank
            c.fail(e)
            return False
        return True

    def issue(self, calls: list[Call], fuse: bool) -> None:
        """On the issuing thread: issue the calls that passed, run by run (``fuse``: the
        ranks compared them as one batch, so they may cut runs of several alike)."""
        for run in _runs(calls, fuse):
            stream = run[0].stream
            try:
                for c in run:
                    c.checked.set()
                    stream.settle(None if stream.serial else c.pair)
                if run[0].err is not None:  # every rank refused it alike: each raised it
                    run[0].work.fail(run[0].err, observed=True)
                    continue
                with self.on_callers_stream(run):
                    if len(run) > 1:
                        issued = stream.runner.run_fused([c.fuse for c in run])
                    else:
                        issued = [run[0].body()]
            except Exception as e:  # noqa: BLE001 - handed to the callers' wait()
                for c in run:
                    if not c.work.issued:
                        c.work.fail(e)
                continue
            for c, done in zip(run, issued):
                c.work.set(*done)
                stream.inflight[c.pair] = c.work

    @contextlib.contextmanager
    def on_callers_stream(self, run: list[Call]) -> Iterator[None]:
        """On a GPU, the calls of ``run`` issued on the side stream, after the work their
        callers had queued when they made them (each call's event); else as they are."""
        ready = [c.ready for c in run if c.ready is not None]
        if not ready:
            yield
            return
        side = self.side_stream(ready[0][0])
        for _, event in ready:
            side.wait_event(event)
        with torch.cuda.stream(side):
            yield


def _runs(calls: list[Call], fuse: bool) -> list[list[Call]]:
    """``calls`` cut into runs: each stream's consecutive calls cut by its runner (``fuse``),
    else one a run."""
    if not fuse:
        return [[c] for c in calls]
    runs: list[list[Call]] = []
    i = 0
    while i < len(calls):
        j = i
        while j < len(calls) and calls[j].stream is calls[i].stream:
            j += 1
        runs += calls[i].stream.runner.runs(calls[i:j])
        i = j
    return runs


# the Issuer of each process group, with the group (held, so its id is not reused)
_ISSUERS: dict[int, tuple[Any, Issuer]] = {}


def _serve(issuer: Issuer, q: queue.SimpleQueue) -> None:
    """The issuing thread's loop: take the queued calls (up to a drain mark), compare them,
    issue those that passed, and put the rest back first in line."""
    pending: collections.deque = collections.deque()
    while True:
        if not pending:
            pending.append(q.get())
            time.sleep(0)  # the caller, issuing calls in a row, queues the rest of them
        while True:
            try:
                pending.append(q.get_nowait())
            except queue.Empty:
                break
        head = pending[0]
        if not isinstance(head, Call):
            pending.popleft()
            head.set()  # a drain mark
            continue
        # a batch holds calls compared alike (by digests, or not): a rank's batch may hold
        # fewer calls than another's, never calls compared otherwise
        digests = head.stream.mode == "every"
        calls: list[Call] = []
        while (
            pending
            and isinstance(pending[0], Call)
            and (pending[0].stream.mode == "every") == digests
            and len(calls) < SLOTS
        ):
            calls.append(pending.popleft())
        with issuer._lock:
            try:
                passed, again = issuer.checks(calls)
            except Exception as e:  # noqa: BLE001 - the comparison's collective failed
                for c in calls:
                    c.fail(e)
                passed, again = [], []
            pending.extendleft(reversed(again))
            issuer.issue(passed, fuse=digests and issuer.world > 1)
            issuer._queued -= len(calls) - len(again)
