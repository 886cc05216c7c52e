"""``launch``: run a function on N local ranks the way torchrun would (the parent hosts the
rendezvous store and supervises the ranks), for tests and single-machine runs; and the
``LaunchError`` it raises when a rank fails, dies or times out.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback as _traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from pycomm.dist import Timeout, init, resolve_backend, shutdown, to_timedelta

__all__ = ["FORKSERVER_PRELOAD", "START_METHODS", "LaunchError", "LaunchTimeoutError", "launch"]

logger = logging.getLogger(__name__)

# How launch() starts its ranks: a fresh interpreter each (spawn), or forked from a server
# process that imported FORKSERVER_PRELOAD once (forkserver; torch._dynamo: DDP imports it).
# A program that starts the forkserver itself before its first launch sets this preload too
# (multiprocessing.set_forkserver_preload), or its ranks import torch each.
START_METHODS = ("spawn", "forkserver")
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "pycomm"]
START_METHOD_ENV = "PYCOMM_START_METHOD"

# Keeps the file that faulthandler dumps a launched rank's stacks into open for the
# lifetime of the rank (faulthandler holds only the file descriptor).
_stack_file: Any = None


class LaunchError(RuntimeError):
    """A rank of :func:`launch` failed: it raised, exited non-zero, died, or timed out.

    Attributes:
        rank: the failing rank (the first unfinished one for a timeout), or None.
        exitcode: the rank's exit code when it died without reporting (negative: killed by
            that signal), else None.
        traceback: the failing rank's formatted traceback (stack dumps for a timeout).

    Example:
        >>> try:
        ...     pycomm.launch(train, 2)
        ... except pycomm.LaunchError as e:
        ...     print(e.rank, e.traceback)
    """

    def __init__(
        self,
        message: str,
        *,
        rank: Optional[int] = None,
        exitcode: Optional[int] = None,
        traceback: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.traceback = traceback


class LaunchTimeoutError(LaunchError, TimeoutError):
    """:func:`launch` passed its ``timeout`` before every rank finished.

    ``unfinished`` lists the ranks that had not finished.
    """

    def __init__(self, message: str, *, unfinished: tuple = (), **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.unfinished = tuple(unfinished)


class _ParentStdio:
    """The launching process's stdout and stderr, and its environment, for a rank forked from
    the forkserver: without them it would write where the server's went, and read the
    environment the server started with. Pickled with the rank's arguments, the descriptors
    travel as multiprocessing sends any descriptor to a child; one that is closed here is
    left as the server's."""

    def __init__(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        self.environ = dict(os.environ)
        self.fds = [fd for fd in (1, 2) if _is_open(fd)]

    def __reduce__(self):
        dups = tuple(multiprocessing.reduction.DupFd(fd) for fd in self.fds)
        return (_ParentStdio._rebuild, (self.environ, self.fds, dups))

    @staticmethod
    def _rebuild(environ: dict, targets: list, dups: tuple) -> dict:
        return {"environ": environ, "fds": {t: d.detach() for t, d in zip(targets, dups)}}


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _adopt_parent(parent: dict) -> None:
    """In a forked rank: the launching process's environment, stdout and stderr."""
    os.environ.clear()
    os.environ.update(parent["environ"])
    for target, fd in parent["fds"].items():
        os.dup2(fd, target)
        os.close(fd)


def _start_method(start_method: Optional[str]) -> str:
    """launch()'s ``start_method``, or the environment's default, checked."""
    if start_method is None:
        value = os.environ.get(START_METHOD_ENV) or None
        if value is None:
            return "spawn"
        what = f"{START_METHOD_ENV}={value!r} (environment)"
    else:
        value, what = start_method, f"start_method={start_method!r} (argument)"
    if value not in START_METHODS:
        raise ValueError(f"{what} is invalid; expected one of {', '.join(START_METHODS)}")
    available = [m for m in START_METHODS if m in multiprocessing.get_all_start_methods()]
    if value not in available:
        raise ValueError(
            f"{what} is not available on this platform; expected one of {', '.join(available)}"
        )
    return value


def _job(fn: Callable[..., Any], args: tuple, setup: Optional[Callable[[int], Any]]) -> Any:
    """What a rank runs, as plain-pickled bytes that the rank unpickles where a failure is
    reported (a value that pickles here but cannot be rebuilt there is named in the
    LaunchError, not only in the rank's stderr); or, for what only multiprocessing's pickler
    carries (its queues and pipes, passed on at the start), the objects themselves."""
    try:
        return pickle.dumps((fn, args, setup))
    except Exception:  # noqa: BLE001 - multiprocessing's pickler names what it cannot send
        return (fn, args, setup)


def _worker(
    job: Any,
    rank: int,
    nprocs: int,
    port: int,
    backend: str,
    timeout: Optional[float],
    conn: multiprocessing.connection.Connection,
    stack_path: str,
    parent: Optional[dict] = None,
) -> None:
    global _stack_file
    if parent is not None:
        _adopt_parent(parent)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    if hasattr(signal, "SIGUSR1"):
        try:
            _stack_file = open(stack_path, "w")
            faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
        except (OSError, RuntimeError, ValueError):
            _stack_file = None
    try:
        fn, args, setup = pickle.loads(job) if isinstance(job, bytes) else job
        if setup is not None:
            setup(rank)
        # A rank forked from the forkserver rounds its first multi-threaded matmul differently
        # now and then (about 3 in 100 ranks: the thread pool starts inside that call), so two
        # identical models in one rank disagreed at the first step. One small matmul first.
        torch.mm(torch.ones(64, 64), torch.ones(64, 64))
        # backend is already resolved ('tcp' -> 'gloo'): launch() warned once, in the parent.
        init(backend, timeout=timeout)
        result = fn(*args)
        shutdown()
        message: tuple = ("ok", result)
    except BaseException as exc:  # report everything, SystemExit and KeyboardInterrupt too
        # The wall-clock time lets the parent tell the first failure from its knock-on errors.
        message = ("error", _traceback.format_exc(), repr(exc), time.time())
    # Plain pickle, not the connection's ForkingPickler: that one shares tensors through
    # shared-memory handles that die with this process, before the parent reads them.
    try:
        conn.send_bytes(pickle.dumps(message))
    except Exception as exc:
        conn.send_bytes(
            pickle.dumps(
                (
                    "error",
                    f"rank {rank}: could not send fn's result to the parent "
                    f"(it must be picklable):\n{_traceback.format_exc()}",
                    repr(exc),
                    time.time(),
                )
            )
        )
    finally:
        conn.close()
    if message[0] == "ok":
        # Reported and shut down: nothing is left to do, and finalizing the interpreter with
        # torch's C++ threads still around only risks an abort after a good run (seen with
        # gloo: "terminate called without an active exception").
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0)


def _make_store(nprocs: int) -> dist.TCPStore:
    for attempt in range(5):
        try:
            # Port 0: the OS picks a free port at bind time, so nothing can take it between
            # choosing and binding.
            return dist.TCPStore(
                "127.0.0.1",
                0,
                nprocs,
                is_master=True,
                wait_for_workers=False,
            )
        except RuntimeError as exc:
            text = str(exc).lower()
            if ("address already in use" not in text and "eaddrinuse" not in text) or attempt == 4:
                raise
            logger.warning("rendezvous store: address in use, retrying (%s)", exc)
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _dump_stacks(procs: list, ranks: list, stack_dir: str) -> str:
    """Ask hung ranks to dump their Python stacks (faulthandler on SIGUSR1) and collect them."""
    if not hasattr(signal, "SIGUSR1"):
        return ""
    for r in ranks:
        if procs[r].is_alive() and procs[r].pid is not None:
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
    paths = {r: os.path.join(stack_dir, f"rank{r}.txt") for r in ranks}
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if all(os.path.exists(p) and os.path.getsize(p) > 0 for p in paths.values()):
            break
        time.sleep(0.05)
    time.sleep(0.05)  # a dump of several threads may still be being written
    parts = []
    for r, path in paths.items():
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if text:
            parts.append(f"--- rank {r} stack at timeout ---\n{text}")
    return "\n".join(parts)


def _stop(procs: list, grace: float = 2.0) -> None:
    """SIGTERM every live process, SIGKILL whatever is left after ``grace`` s, join all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout: Timeout = None,
    setup: Optional[Callable[[int], Any]] = None,
    start_method: Optional[str] = None,
) -> list:
    """Run ``fn(*args)`` on ``nprocs`` local ranks and return their results in rank order.

    Each rank is a spawned process that calls :func:`init` (as under torchrun, with the
    parent hosting the rendezvous store), then ``fn(*args)``, then :func:`shutdown`. ``fn``
    and ``args`` must be picklable (``fn`` defined at module level), as must the results.
    They travel by value (a rank's changes to a tensor argument stay in the rank), except
    multiprocessing's own queues and pipes, which are passed on as multiprocessing passes
    them; a value that cannot be rebuilt in a rank is a :class:`LaunchError` naming it.

    If a rank raises, exits non-zero or dies, the other ranks are terminated and
    :class:`LaunchError` is raised naming the rank, with its traceback. If ``timeout``
    seconds pass before every rank finishes, every rank is killed and
    :class:`LaunchTimeoutError` (a LaunchError and a TimeoutError) names the unfinished
    ranks; the same timeout bounds the process group's collectives. No rank outlives the call.

    ``setup`` (picklable), if given, runs as ``setup(rank)`` in each rank before :func:`init`:
    the place to change a rank's environment (``pycomm.bench`` puts ranks into simulated
    nodes' network namespaces with torchrun's multi-node variables).

    ``start_method`` (default: the ``PYCOMM_START_METHOD`` environment variable, else
    ``"spawn"``): ``"spawn"`` starts each rank as a fresh interpreter, which imports torch
    (seconds of CPU per rank). ``"forkserver"`` forks each rank from one server process that
    imported torch and pycomm once, at this process's first such launch: later launches start
    their ranks in a fraction of a second (for programs that launch many times: tests,
    sweeps). A forked rank gets this process's environment, working directory, ``sys.path``,
    stdout and stderr as at the call, as a spawned one does; modules imported by the server
    (torch, pycomm) have read their environment once, when the server started.

    Example:
        >>> def work(x):
        ...     t = torch.tensor([float(x)])
        ...     torch.distributed.all_reduce(t)
        ...     return t.item()
        >>> pycomm.launch(work, 2, 1.5)
        [3.0, 3.0]
    """
    if not callable(fn):
        raise ValueError(f"fn={fn!r} (argument) is invalid; expected a callable")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} (argument) is invalid; expected an integer >= 1")
    if setup is not None and not callable(setup):
        raise ValueError(
            f"setup={setup!r} (argument) is invalid; expected a callable setup(rank) or None"
        )
    name, _ = resolve_backend(backend)  # warns for 'tcp' here, once, in the caller's process
    if name == "nccl" and nprocs > torch.cuda.device_count():
        raise ValueError(
            f"nprocs={nprocs} (argument) is invalid for nccl; expected at most "
            f"{torch.cuda.device_count()} (one rank per visible GPU)"
        )
    method = _start_method(start_method)
    td = to_timedelta(timeout)
    seconds = td.total_seconds() if td is not None else None

    job = _job(fn, args, setup)
    ctx = multiprocessing.get_context(method)
    parent = None
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts
        parent = _ParentStdio()
    store = _make_store(nprocs)
    port = store.port
    procs: list = []
    readers: list = []
    stack_dir = tempfile.mkdtemp(prefix="pycomm-launch-")
    logger.info("launching %d ranks (%s), rendezvous 127.0.0.1:%d", nprocs, name, port)
    try:
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            readers.append(reader)
            # Not daemonic: a rank may start its own workers (a DataLoader with num_workers).
            p = ctx.Process(
                target=_worker,
                args=(
                    job,
                    rank,
                    nprocs,
                    port,
                    name,
                    seconds,
                    writer,
                    os.path.join(stack_dir, f"rank{rank}.txt"),
                    parent,
                ),
                name=f"pycomm-rank{rank}",
            )
            try:
                p.start()
            finally:
                writer.close()  # the child holds the only write end: EOF means it is gone
            procs.append(p)
        return _collect(procs, readers, seconds, stack_dir)
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()
        shutil.rmtree(stack_dir, ignore_errors=True)
        del store  # TCPStore has no close(); dropping the last reference stops its server


def _collect(procs: list, readers: list, seconds: Optional[float], stack_dir: str) -> list:
    """Wait for every rank's report; raise LaunchError on the first failure or the deadline."""
    nprocs = len(procs)
    results: list = [None] * nprocs
    reported: dict = {}  # rank -> "ok" | "eof"
    errors: list = []  # (time, rank, traceback, exception repr) from ranks that raised
    deaths: list = []  # (rank, exitcode, reported) of ranks without a result or exiting non-zero
    unfinished = set(range(nprocs))
    deadline = None if seconds is None else time.monotonic() + seconds

    def receive(rank: int) -> None:
        try:
            message = pickle.loads(readers[rank].recv_bytes())
        except EOFError:
            reported[rank] = "eof"
            return
        except Exception as exc:
            reported[rank] = "eof"
            tb = _traceback.format_exc()
            errors.append((time.time(), rank, tb, f"an unreadable result ({exc!r})"))
            return
        if message[0] == "ok":
            results[rank] = message[1]
            reported[rank] = "ok"
        else:
            reported[rank] = "error"
            _, tb, exc_repr, when = message
            errors.append((when, rank, tb, exc_repr))

    def exited(rank: int) -> None:
        p = procs[rank]
        p.join()
        if rank not in reported and readers[rank].poll():
            receive(rank)
        if reported.get(rank) == "ok" and p.exitcode == 0:
            unfinished.discard(rank)
        elif reported.get(rank) != "error":
            deaths.append((rank, p.exitcode, reported.get(rank) == "ok"))
            unfinished.discard(rank)

    while unfinished:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            late = sorted(unfinished)
            stacks = _dump_stacks(procs, late, stack_dir)
            raise LaunchTimeoutError(
                f"rank(s) {late} of {nprocs} had not finished after {seconds:g} s "
                f"(launch timeout); all ranks were killed" + (f"\n{stacks}" if stacks else ""),
                rank=late[0],
                traceback=stacks,
                unfinished=tuple(late),
            )
        waiting = {}
        for rank in sorted(unfinished):
            if rank not in reported:
                waiting[readers[rank]] = ("pipe", rank)
            waiting[procs[rank].sentinel] = ("exit", rank)
        ready = multiprocessing.connection.wait(list(waiting), timeout=remaining)
        # Reports before exits: a rank's report may arrive in the same batch as its exit.
        for kind, rank in sorted((waiting[obj] for obj in ready), key=lambda e: e[0] != "pipe"):
            if kind == "pipe":
                if rank not in reported:
                    receive(rank)
            elif rank in unfinished:
                exited(rank)
        if errors or deaths:
            # Take in what arrives during a short grace (a rank's death is seen a moment
            # after the errors it causes in the others), then blame the root cause.
            pending = {r for r in unfinished if reported.get(r) in (None, "eof")}
            grace_end = time.monotonic() + _BLAME_GRACE_S
            while pending and time.monotonic() < grace_end:
                waiting = {readers[r]: ("pipe", r) for r in pending if r not in reported}
                waiting.update({procs[r].sentinel: ("exit", r) for r in pending})
                left = grace_end - time.monotonic()
                ready = multiprocessing.connection.wait(list(waiting), timeout=max(0.0, left))
                for kind, rank in sorted((waiting[o] for o in ready), key=lambda e: e[0] != "pipe"):
                    if rank not in pending:
                        continue
                    if kind == "pipe":
                        receive(rank)
                    if kind == "exit" or reported.get(rank) == "eof":
                        # No report: the pipe closed because the rank is exiting; its exit
                        # code tells a death from an error.
                        procs[rank].join(max(0.0, grace_end - time.monotonic()))
                        if procs[rank].is_alive():
                            continue
                        exited(rank)
                    pending.discard(rank)
            stalled = _stalled(errors, deaths, sorted(pending))
            if stalled:
                stacks = _dump_stacks(procs, stalled, stack_dir)
                _, first, _, exc = min(errors)
                raise LaunchTimeoutError(
                    f"rank(s) {stalled} of {nprocs} stalled: rank {first} timed out waiting for "
                    f"them in a collective ({exc}) while they were still running; all ranks "
                    "were killed" + (f"\n{stacks}" if stacks else ""),
                    rank=stalled[0],
                    traceback=stacks,
                    unfinished=tuple(stalled),
                )
            raise _failure(errors, deaths)
    return results


# How long launch keeps listening after the first failure before it names the root cause.
_BLAME_GRACE_S = 1.0


def _stalled(errors: list, deaths: list, running: list) -> list:
    """The ranks to blame when the first error is a collective timeout and nobody died: those
    still running without a report (a rank stuck in a hook, a sleep or a deadlock)."""
    if deaths or not errors or not running:
        return []
    _, _, _, exc = min(errors)
    text = exc.lower()
    return running if "timed out" in text or "timeout" in text else []


def _failure(errors: list, deaths: list) -> LaunchError:
    """The LaunchError for the most likely root cause among the failures seen so far.

    A rank that died takes the others down with it (their collectives fail a moment later),
    so a death comes first; among ranks that raised, the earliest exception.
    """
    others = []
    if deaths:
        rank, code, reported = min(deaths)
        how = f"exited with code {code}" + (f" (signal {-code})" if code and code < 0 else "")
        how += " after reporting its result" if reported else " without reporting a result"
        error = LaunchError(f"rank {rank} {how}", rank=rank, exitcode=code)
        others += [f"rank {r}: exit code {c}" for r, c, _ in deaths if r != rank]
        others += [f"rank {r}: {exc}" for _, r, _, exc in errors]
    else:
        errors = sorted(errors)
        _, rank, tb, exc = errors[0]
        error = LaunchError(
            f"rank {rank} raised {exc}\n--- rank {rank} traceback ---\n{tb.rstrip()}",
            rank=rank,
            traceback=tb,
        )
        others += [f"rank {r}: {e}" for _, r, _, e in errors[1:]]
    if others:
        error.args = (f"{error.args[0]}\nother failures (likely knock-on): " + "; ".join(others),)
    return error
