"""The engine: the one place a tensor is compressed and exchanged.

An :class:`Engine` holds what an exchange through a codec keeps between calls: the codec, the
error-feedback residuals (:mod:`pycomm.codec.residuals`), the send and receive buffers, the
process groups of its two phases (a :class:`~pycomm.codec.groups.Stage`), and the codec's byte
counters. Its three collectives are the ones every caller runs:

- :meth:`Engine.all_reduce`, the two-phase exchange (or one all-reduce of the codes for a
  ``two_phase=False`` codec): every DDP bucket of a codec hook (flat, or the node
  hierarchy's cross-node shard) and every ``pycomm.Exchange.all_reduce``;
- :meth:`Engine.reduce_scatter`, phase 1 alone: ``pycomm.Exchange.reduce_scatter``, and so
  every FSDP2 reduce-scatter of ``pycomm.fsdp``;
- :meth:`Engine.all_gather`: ``pycomm.Exchange.all_gather``.

Two-phase all-reduce: every rank encodes its whole tensor (pre-scaled by 1/N, plus its
error-feedback residual) and sends chunk j to rank j (phase 1, all-to-all, a reduce-scatter
of compressed chunks); each rank decodes and sums its N chunks in fp32, re-encodes that sum
with its own residual and sends it to every rank (phase 2, a gather). Bytes per rank are
2(N-1)/N of the compressed tensor, flat in N.

Collective order: phase 1 is issued by the caller, in its order (DDP's bucket order, an
Exchange's call order), on its own process group; phase 2 on a second group, from a callback
that also waits until the previous exchange's phase 2 was issued. So every rank issues the
same collectives in the same order on each group, however its phase 1s happen to complete
(the trap that aborts torch's PowerSGD on gloo).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from pycomm.codec.codecs import Codec
from pycomm.codec.residuals import PHASE_1, ResidualStore

__all__ = [
    "Count", "Engine", "Workspace", "add_call", "completed", "exact_mean", "future_on",
    "ring_bytes", "summed_numel",
]  # fmt: skip

# count(bytes_sent, collectives): how a caller accounts one exchange in its own totals
Count = Callable[[int, int], None]


def completed(t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding ``t``: what a hook returns when it does not communicate.

    Example:
        >>> completed(torch.zeros(1)).value()
        tensor([0.])
    """
    fut = future_on(t.device)
    fut.set_result(t)
    return fut


def future_on(device: torch.device) -> torch.futures.Future:
    """A new future for a result on ``device``: on a GPU one that knows it (its result is
    ready on the stream that waits for it, not only on the one that set it), else a plain one.

    Example:
        >>> fut = future_on(x.device); fut.set_result(x)
    """
    if device.type == "cuda":
        return torch.futures.Future(devices=[device])
    return torch.futures.Future()


def ring_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: 2(N-1)/N of the payload."""
    return 2 * (world_size - 1) * nbytes // world_size


def add_call(
    stats: dict[str, Any],
    world_size: int,
    numel: int,
    bytes_sent: int,
    collectives: int = 1,
    bytes_fp32: Optional[int] = None,
    last: bool = True,
    **levels: int,
) -> None:
    """Account in ``stats`` (``steps``, ``buckets``: calls, ``collectives``, ``bytes_sent``,
    ``bytes_fp32``, ``compression``) one call on ``numel`` elements that put ``bytes_sent`` on
    the wire in ``collectives`` collectives (``levels``: a split of them, added to those
    counters); ``last``: it ends a step. DDP's hook states and the Exchange count with it."""
    for name, value in levels.items():
        stats[name] = stats.get(name, 0) + value
    stats["buckets"] += 1
    stats["collectives"] += collectives
    stats["bytes_sent"] += bytes_sent
    if bytes_fp32 is None:
        bytes_fp32 = ring_bytes(numel * 4, world_size)
    stats["bytes_fp32"] += bytes_fp32
    stats["compression"] = stats["bytes_fp32"] / stats["bytes_sent"] if stats["bytes_sent"] else 1.0
    if last:
        stats["steps"] += 1


def exact_mean(
    x: torch.Tensor, world_size: int, group: Optional[dist.ProcessGroup]
) -> torch.futures.Future[torch.Tensor]:
    """The exact mean as DDP takes it: ``x`` scaled by 1/N (DDP's own rounding), then one
    asynchronous all-reduce on ``group``; the future of ``x``, reduced in place (or of what
    the collective raised)."""
    x.mul_(1.0 / world_size)
    work = dist.all_reduce(x, group=group, async_op=True)

    def done(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # raises what the collective raised
        return x

    return work.get_future().then(done)


class Workspace:
    """The buffers of each exchange, allocated once: fresh ones every step cost more in page
    faults than the codecs themselves."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, Any] = {}
        self.scratch: dict[torch.dtype, torch.Tensor] = {}  # the CPU's, per residual dtype
        self.lock = threading.Lock()  # held while a scratch buffer is written and read

    def exchange(self, key: tuple, w: int, row_bytes: int, device) -> dict:
        """The send and receive buffers of exchange ``key``: ``w`` rows of ``row_bytes``.
        Phase 2 reuses them (it runs once phase 1 has completed and its rows are decoded),
        which keeps the step's memory, and so its cache misses, down: gradients, residuals and
        buffers of both ranks already exceed this kind of machine's share of the last-level
        cache."""
        ws = self.buffers.get(key)
        if ws is not None and ws["send"].shape != (w, row_bytes):  # another world size
            ws = None
        if ws is None:  # one key per index, as the residuals: another size replaces it
            for old in [k for k in self.buffers if k[0] == key[0] and len(k) == len(key)]:
                del self.buffers[old]
            u8 = dict(dtype=torch.uint8, device=device)
            ws = self.buffers[key] = {
                "send": torch.empty(w, row_bytes, **u8),
                "recv": torch.empty(w, row_bytes, **u8),
            }
        return ws

    def chunk_sum(self, key: tuple, c: int, device) -> torch.Tensor:
        """The fp32 buffer phase 2 sums this rank's chunk into. On the CPU one serves every
        exchange: phase 2 of one starts only once the previous one's phase 2 has issued its
        gather (the order chain of :meth:`Engine.all_reduce`), so no two use it at once. On an
        accelerator, where work is only enqueued, each keeps its own."""
        name = ("chunk_sum",) if device.type == "cpu" else ("chunk_sum", key)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < c or buf.device != device:
            for old in [k for k in self.buffers if len(k) == 2 and k[0] == "chunk_sum"]:
                if old != name and old[1][0] == key[0]:  # the key's index at another size
                    del self.buffers[old]
            buf = self.buffers[name] = torch.empty(c, dtype=torch.float32, device=device)
        return buf[:c]

    def encode(
        self,
        codec: Codec,
        x: torch.Tensor,
        r: Optional[torch.Tensor],
        scale: float,
        numel: int,
        r_out: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``codec.encode(x, r, scale, numel, r_out)``. In place (``r`` given, ``r_out``
        None), a codec that does not declare ``keeps_residual_on_nonfinite`` writes its new
        residual to a scratch buffer instead, and ``r`` takes it where it is finite and keeps
        its old value elsewhere: one more pass over ``r``, on the device, no host read."""
        if r is None or r_out is not None or getattr(codec, "keeps_residual_on_nonfinite", False):
            return codec.encode(x, r, scale, numel, r_out)
        with self.lock:
            new = self.scratch_like(r)
            encoded = codec.encode(x, r, scale, numel, new)
            torch.where(torch.isfinite(new), new, r, out=r)
        return encoded

    def scratch_like(self, r: torch.Tensor) -> torch.Tensor:
        """A buffer shaped as the residual ``r`` for a codec's new residual (see
        :meth:`Workspace.encode`). On the CPU one per dtype, the size of the largest encode,
        written and read under :attr:`lock` (phase 1 runs in the caller's thread, phase 2 in a
        callback's). On an accelerator, where work is only enqueued and phase 2 runs on a
        callback's own stream, a fresh one: the caching allocator hands its memory back in
        stream order, with no page fault."""
        if r.device.type != "cpu":
            return torch.empty_like(r)
        buf = self.scratch.get(r.dtype)
        if buf is None or buf.numel() < r.numel():
            buf = self.scratch[r.dtype] = torch.empty(r.numel(), dtype=r.dtype)
        return buf[: r.numel()]


def summed_numel(codec: Codec, n: int) -> int:
    """Elements a ``two_phase=False`` codec encodes for a tensor of ``n``: n rounded up to
    whole blocks (what the exchange sums, and the size of its residual)."""
    return max(1, math.ceil(n / codec.block)) * codec.block


class Engine:
    """A codec's exchange across ``size`` ranks, with its residuals, buffers and counters.

    Args:
        where: how its messages start (``pycomm int8 hook``).
        codec: the :class:`~pycomm.hooks.Codec`.
        stats: the caller's live counters; the engine adds ``codec_bytes_sent``,
            ``codec_bytes_fp32``, ``codec_compression`` and (its residual store)
            ``residual_bytes`` and the non-finite decodes (under ``nonfinite``).
        error_feedback, local_feedback, residual_dtype, strict_skip: the residuals' options
            (see :class:`pycomm.hooks.CompressedState`).

    Example:
        >>> engine = Engine("mine", Int8Codec(64), {}, error_feedback=True)
        >>> engine.bind(phase_groups(None), dist.get_world_size())
        >>> engine.all_reduce(x, (0, x.numel(), str(x.dtype)), step=0, count=my_count)
    """

    def __init__(
        self,
        where: str,
        codec: Codec,
        stats: dict[str, Any],
        *,
        error_feedback: bool = True,
        local_feedback: bool = True,
        residual_dtype: torch.dtype = torch.float32,
        strict_skip: bool = False,
        nonfinite: str = "nonfinite",
    ) -> None:
        self.where, self.codec, self.stats = where, codec, stats
        self.size = 1  # ranks in the exchange: one until bound
        self.error_feedback, self.local_feedback = error_feedback, local_feedback
        self.residual_dtype = residual_dtype
        self.store = ResidualStore(where, stats, residual_dtype, strict_skip, nonfinite)
        self.workspace = Workspace()
        self.phases: Any = None  # the two phases' groups, once bound
        self.device = torch.device("cpu")  # of the last exchange's tensor
        for name, zero in (
            ("codec_bytes_sent", 0), ("codec_bytes_fp32", 0), ("codec_compression", 1.0),
        ):  # fmt: skip
            stats.setdefault(name, zero)

    def bind(self, phases: Any, size: int) -> None:
        """The process groups of the two phases (phase 1 on the first, phase 2 on the
        second) and the ranks in the exchange (each group's size)."""
        self.phases, self.size = phases, size

    # --- sizes and residuals ------------------------------------------------------------

    def chunk(self, n: int) -> int:
        """Elements per rank's chunk for a tensor of ``n``: a whole number of blocks."""
        b = self.codec.block
        return max(1, math.ceil(n / (self.size * b))) * b

    def residual_sizes(self, n: int) -> dict[str, int]:
        """Residual elements kept for an all-reduce of ``n``: r1 on the whole padded tensor
        (phase 1; none with ``local_feedback=False``), r2 on this rank's chunk (phase 2)."""
        if not self.codec.two_phase:
            return {"r1": summed_numel(self.codec, n)}
        c = self.chunk(n)
        if not self.local_feedback:
            return {"r2": c}
        return {"r1": self.size * c, "r2": c}

    def key_sizes(self, key: tuple) -> dict[str, int]:
        """The residuals kept under ``key``: an all-reduce's, ``(index, n, dtype)``, those of
        :meth:`residual_sizes`; a reduce-scatter's, ``(index, n, PHASE_1)``, r1 alone (its
        exchange is phase 1, so its input's residual is its error feedback, whatever
        ``local_feedback``, which chooses between an all-reduce's two)."""
        if key[2] == PHASE_1 and self.codec.two_phase:
            return {"r1": key[1]}  # the input, its N chunks padded to whole blocks
        sizes = self.residual_sizes(key[1])
        if key[2] == PHASE_1:
            return {name: numel for name, numel in sizes.items() if name == "r1"}
        return sizes

    def residual(self, key: tuple, n: int) -> tuple:
        """(r1, r2, r1_out, r2_out): the kept residuals of ``key`` (n elements, its second
        field) to read and the buffers this call's new ones go to (all None without error
        feedback; see :meth:`key_sizes`)."""
        if not self.error_feedback:
            return None, None, None, None
        return self.store.get(key, self.key_sizes((key[0], n, *key[2:])), self.device)

    def count_codec(self, numel: int, nbytes: int, bytes_fp32: Optional[int] = None) -> None:
        """Account one compressed exchange of ``numel`` elements that sends ``nbytes``:
        the codec's own ratio over its exchanges alone. ``bytes_fp32``: what the exact fp32
        collective sends, where it is not a ring all-reduce of ``numel`` elements."""
        s = self.stats
        s["codec_bytes_sent"] += nbytes
        if bytes_fp32 is None:
            bytes_fp32 = ring_bytes(numel * 4, self.size)
        s["codec_bytes_fp32"] += bytes_fp32
        s["codec_compression"] = s["codec_bytes_fp32"] / max(s["codec_bytes_sent"], 1)

    def note_decode(self, st: torch.Tensor, step: int) -> None:
        """Keep a decode's [squared norm, non-finite count] for ``step``."""
        self.store.note_decode(st, step)

    # --- the collectives ----------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, key: tuple, step: int, count: Count):
        """Replace ``x`` by its mean over the ranks through the codec, with the residuals of
        ``key`` (``(index, x.numel(), dtype)``), the decode's statistics kept for ``step``;
        ``count(bytes_sent, collectives)`` is called once, as it is issued. Returns the
        future of ``x``."""
        if self.codec.two_phase:
            return self.all_reduce_many([(x, key, step, count)])[0]
        return self._summed(x, key, step, count)

    def all_reduce_many(self, items: list[tuple[torch.Tensor, tuple, int, Count]]) -> list:
        """:meth:`all_reduce` of several tensors of a two-phase codec in one exchange: each
        item ``(x, key, step, count)`` keeps its own chunks, residuals and decode, the bits of
        its exchange alone, and the rows each rank sends are the items' rows side by side, so
        two collectives carry them all. Returns each item's future of its ``x``."""
        codec, w = self.codec, self.size
        parts = []  # per item: x, n, c, its residuals, its bytes' columns
        width = 0
        for x, key, step, count in items:
            n = x.numel()
            c = self.chunk(n)
            self.device = x.device
            r1, r2, r1_out, r2_out = self.residual(key, n)
            codes, scales = self.workspace.encode(codec, x, r1, 1.0 / w, w * c, r1_out)
            row_bytes = codec.code_bytes(c) + codec.scale_bytes(c)
            parts.append((x, key, step, n, c, r2, r2_out, slice(width, width + row_bytes)))
            # the next item's row starts 16-byte aligned, so its codes and scales are read in
            # place (a part at an offset its dtype cannot be read at is copied first)
            width += row_bytes if len(items) == 1 else -(-row_bytes // 16) * 16
            self.count_codec(n, 2 * (w - 1) * row_bytes)
            count(2 * (w - 1) * row_bytes, 2 if len(parts) == 1 else 0)
            # packed below, once the buffers of the whole width are known
            parts[-1] = (*parts[-1], codes, scales)
        # one item: its key's buffers; several: one pair for the set (another set replaces it)
        wkey = items[0][1] if len(items) == 1 else ("many", tuple(i[1] for i in items))
        ws = self.workspace.exchange(wkey, w, width, items[0][0].device)
        # phase 2 sends from phase 1's send buffer and gathers into its receive buffer
        send, recv = ws["send"], ws["recv"]
        gathered = recv
        for *_, cols, codes, scales in parts:
            codec.pack(codes, scales, w, out=send[:, cols])
        phases = self.phases
        g1, g2 = phases.groups
        phase1 = dist.all_to_all_single(recv, send, group=g1, async_op=True).get_future()

        results = [future_on(x.device) for x, *_ in items]
        prev, issued = phases.issued, torch.futures.Future()
        phases.issued = issued

        def fail(e: BaseException) -> None:
            for r in results:
                if not r.done():
                    r.set_exception(e)

        def finish(fut: torch.futures.Future) -> None:
            try:
                fut.value()
                for (x, _, step, n, c, _, _, cols, _, _), result in zip(parts, results):
                    codes2, scales2 = codec.split(gathered[:, cols], c)
                    st = None
                    for j in range(w):  # rank j's reduced chunk: elements [j * c, (j + 1) * c)
                        part = codec.decode_sum(
                            codes2[j : j + 1],
                            None if scales2 is None else scales2[j : j + 1],
                            1.0,
                            x[min(n, j * c) : min(n, (j + 1) * c)],
                        )
                        st = part if st is None else st + part
                    self.note_decode(st, step)
                    result.set_result(x)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's future
                fail(e)

        def phase2(fut: torch.futures.Future) -> None:
            try:
                for sub in fut.value():
                    sub.value()
                for x, key, _, _, c, r2, r2_out, cols, _, _ in parts:
                    codes1, scales1 = codec.split(recv[:, cols], c)
                    mine = self.workspace.chunk_sum(key, c, x.device)
                    codec.decode_sum(codes1, scales1, 1.0, mine)
                    encoded = self.workspace.encode(codec, mine, r2, 1.0, c, r2_out)
                    codec.pack(*encoded, 1, out=send[:1, cols])
                if phases.nccl:
                    row = send[0]
                    work = dist.all_gather_into_tensor(gathered, row, group=g2, async_op=True)
                else:  # gloo: all_to_all_single, once timed faster than all_gather (not kept)
                    send[1:] = send[:1]
                    work = dist.all_to_all_single(gathered, send, group=g2, async_op=True)
            except BaseException as e:  # noqa: BLE001
                issued.set_result(torch.empty(0))
                fail(e)
                return
            issued.set_result(torch.empty(0))
            work.get_future().then(finish)

        torch.futures.collect_all([phase1, prev]).then(phase2)
        return results

    def _summed(self, x: torch.Tensor, key: tuple, step: int, count: Count):
        """A ``two_phase=False`` codec's exchange: encode (pre-scaled, optional residual),
        sum the codes in their own dtype with one all-reduce, decode once."""
        codec, n, w = self.codec, x.numel(), self.size
        self.device = x.device
        numel = summed_numel(codec, n)
        r1, _, r1_out, _ = self.residual(key, n)
        enc, _ = self.workspace.encode(codec, x, r1, 1.0 / w, numel, r1_out)
        nbytes = ring_bytes(codec.code_bytes(numel), w)
        self.count_codec(n, nbytes)
        count(nbytes, 1)
        work = dist.all_reduce(enc, group=self.phases.groups[0], async_op=True)

        def decode(fut: torch.futures.Future) -> torch.Tensor:
            fut.value()
            self.note_decode(codec.decode_sum(enc.view(1, -1), None, 1.0, x), step)
            return x

        return work.get_future().then(decode)

    def reduce_scatter(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        index: int,
        scale: float,
        step: int,
        group: Optional[dist.ProcessGroup],
        size: Optional[int] = None,
    ) -> tuple[torch.futures.Future, int]:
        """``out`` (s elements) becomes this rank's chunk of the sum over the ranks of
        ``scale`` times ``x`` (N chunks of s), through the codec: phase 1 alone, with the
        phase-1 residual of ``index`` (``(index, N * c, PHASE_1)``, each chunk padded to c, a
        whole number of blocks), on ``group`` of ``size`` ranks (default the bound exchange's).
        Returns (the future of ``out``, bytes sent)."""
        codec, n, s = self.codec, self.size if size is None else size, out.numel()
        c = -(-s // codec.block) * codec.block  # each chunk padded to whole blocks
        if c != s:
            padded = torch.zeros(n * c, dtype=x.dtype, device=x.device)
            padded.view(n, c)[:, :s].copy_(x.view(n, s))
            x = padded
        self.device = x.device
        # the residual of the padded input: phase 1's alone (r1), the key's whatever its dtype
        r1, _, r1_out, _ = self.residual((index, n * c, PHASE_1), n * c)
        codes, scales = self.workspace.encode(codec, x, r1, scale, n * c, r1_out)
        send = codec.pack(codes, scales, n)
        recv = torch.empty_like(send)
        nbytes = (n - 1) * send.shape[1]
        self.count_codec(n * s, nbytes, (n - 1) * s * 4)
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)

        def decode(f: torch.futures.Future) -> torch.Tensor:
            f.value()
            rcodes, rscales = codec.split(recv, c)
            self.note_decode(codec.decode_sum(rcodes, rscales, 1.0, out), step)
            return out

        return work.get_future().then(decode), nbytes

    def all_gather(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        step: int,
        gather: Callable[[torch.Tensor, torch.Tensor], torch.futures.Future],
        size: Optional[int] = None,
    ) -> tuple[torch.futures.Future, int]:
        """``out`` (N chunks of ``x.numel()``) becomes every rank's ``x``, rank j's at chunk
        j, each encoded (no residual) and decoded, this rank's own too, so that every rank
        holds the same bits; ``gather(rows, row)`` gathers every rank's packed row from the
        ``size`` ranks (default the bound exchange's). Returns (the future of ``out``, bytes
        sent)."""
        codec, n, m = self.codec, self.size if size is None else size, x.numel()
        c = -(-m // codec.block) * codec.block
        codes, scales = codec.encode(x, None, 1.0, c)
        row = codec.pack(codes, scales, 1)
        rows = torch.empty(n, row.shape[1], dtype=torch.uint8, device=x.device)
        nbytes = (n - 1) * row.shape[1]
        self.count_codec(m, nbytes, (n - 1) * m * 4)
        self.device = x.device
        work = gather(rows, row)

        def decode(f: torch.futures.Future) -> torch.Tensor:
            f.value()
            rcodes, rscales = codec.split(rows, c)
            flat = out.view(n, m)
            st = None
            for j in range(n):
                part = codec.decode_sum(
                    rcodes[j : j + 1], None if rscales is None else rscales[j : j + 1], 1.0,
                    flat[j],
                )  # fmt: skip
                st = part if st is None else st + part
            self.note_decode(st, step)
            return out

        return work.then(decode), nbytes
