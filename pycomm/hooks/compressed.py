"""The engine behind pycomm's compression hooks (fp16, bf16, int8, onebit).

Two-phase all-reduce: every rank encodes its whole bucket (pre-scaled by 1/N, plus
its error-feedback residual) and sends chunk j to rank j (phase 1, all-to-all, a
reduce-scatter of compressed chunks); each rank decodes and sums its N chunks in fp32,
re-encodes that sum with its own residual and sends it to every rank (phase 2, a gather). Bytes
per rank are 2(N-1)/N of the compressed bucket, flat in N.

Collective order: phase 1 is issued from the hook, in DDP's bucket order, on its own process
group; phase 2 on a second group, from a callback that also waits until the previous bucket's
phase 2 was issued. So every rank issues the same collectives in the same order on each group,
however its phase 1s happen to complete (the trap that aborts torch's PowerSGD on gloo).
"""

import datetime
import logging
import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from pycomm import ops
from pycomm._validate import check_bool, check_int
from pycomm.hooks import advice
from pycomm.hooks import hierarchy as hier
from pycomm.hooks.allreduce import exact_allreduce
from pycomm.hooks.layout import BucketLayout
from pycomm.hooks.residuals import ResidualStore
from pycomm.hooks.state import HookState, check_bucket, completed, ring_bytes

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

logger = logging.getLogger(__name__)


class Codec:
    """How one format encodes a flat fp32 sequence and decodes-and-sums rows of it.

    ``block``: elements per scale (and the unit every chunk is padded to); codes and scales of
    ``m`` elements take ``code_bytes(m)`` and ``scale_bytes(m)`` bytes.
    """

    code_dtype: torch.dtype
    scale_dtype: Optional[torch.dtype] = None

    def __init__(self, block: int) -> None:
        self.block = block

    def code_bytes(self, m: int) -> int:
        raise NotImplementedError

    def scale_bytes(self, m: int) -> int:
        return 0

    def encode(self, x, residual, scale, numel, residual_out=None):
        raise NotImplementedError

    def decode_sum(self, codes, scales, scale, out):
        raise NotImplementedError

    def pack(
        self,
        codes: torch.Tensor,
        scales: Optional[torch.Tensor],
        rows: int,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Codes and scales of ``rows`` equal chunks as one [rows, bytes] uint8 tensor (written
        into ``out`` when given)."""
        cb = codes.numel() * codes.element_size() // rows
        if out is None:
            out = torch.empty(
                rows,
                cb + (0 if scales is None else scales.numel() * scales.element_size() // rows),
                dtype=torch.uint8,
                device=codes.device,
            )
        out[:, :cb] = codes.view(torch.uint8).view(rows, cb)
        if scales is not None:
            out[:, cb:] = scales.view(torch.uint8).view(rows, -1)
        return out

    def split(self, rows: torch.Tensor, m: int):
        """The inverse of :meth:`pack` for chunks of ``m`` elements: ([R, m] codes, scales)."""
        cb = self.code_bytes(m)
        # row slices, read in place by the decoders (CPU and CUDA): no copy
        codes, scales = rows[:, :cb], None if self.scale_dtype is None else rows[:, cb:]
        codes = codes.view(self.code_dtype)
        return codes, None if scales is None else scales.view(self.scale_dtype)


class HalfCodec(Codec):
    """16-bit codes, fp16 or bf16 (``dtype``), without scales: the fp16 and bf16 hooks'."""

    scale_dtype = None

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__(block=8)  # 16-byte aligned chunks
        self.code_dtype = dtype

    def code_bytes(self, m: int) -> int:
        return 2 * m

    def encode(self, x, residual, scale, numel, residual_out=None):
        return ops.encode16(x, residual, scale, self.code_dtype, numel, residual_out), None

    def decode_sum(self, codes, scales, scale, out):
        return ops.decode16_sum(codes, scale, out)


class Int8Codec(Codec):
    code_dtype, scale_dtype = torch.int8, torch.float32

    def code_bytes(self, m: int) -> int:
        return m

    def scale_bytes(self, m: int) -> int:
        return 4 * (m // self.block)

    def encode(self, x, residual, scale, numel, residual_out=None):
        return ops.quantize_int8(x, residual, scale, self.block, numel, residual_out)

    def decode_sum(self, codes, scales, scale, out):
        return ops.dequantize_int8_sum(codes, scales, self.block, scale, out)


class OneBitCodec(Codec):
    code_dtype, scale_dtype = torch.uint8, torch.bfloat16

    def code_bytes(self, m: int) -> int:
        return m // 8

    def scale_bytes(self, m: int) -> int:
        return 2 * (m // self.block)

    def encode(self, x, residual, scale, numel, residual_out=None):
        return ops.quantize_onebit(x, residual, scale, self.block, numel, residual_out)

    def decode_sum(self, codes, scales, scale, out):
        return ops.dequantize_onebit_sum(codes, scales, self.block, scale, out)


class _PhaseGroups:
    """The two process groups of the two-phase exchange over one parent group, and the chain
    that keeps phase 2 issued in bucket order.

    Shared by every state over the same parent group and kept for the life of that group: a
    process group must never be released from inside one of its own callbacks (gloo would
    join its own worker thread and abort), so no hook state owns one.
    """

    def __init__(self, parent: Optional[dist.ProcessGroup]) -> None:
        self.parent = parent
        world = parent or dist.group.WORLD
        ranks = dist.get_process_group_ranks(world)
        # new_group() would give them torch's default timeout (30 minutes), not the one the
        # user set on the group the hook reduces over: a stalled peer must fail phase 1 or 2
        # within that group's timeout, as it fails DDP's own all-reduce.
        timeout = group_timeout(world)
        self.groups = tuple(
            dist.new_group(ranks, timeout=timeout, use_local_synchronization=True) for _ in range(2)
        )
        self.nccl = dist.get_backend(self.groups[1]) == "nccl"
        self.issued: torch.futures.Future = completed(torch.empty(0))


def group_timeout(group: dist.ProcessGroup) -> Optional[datetime.timedelta]:
    """The timeout ``group`` was created with (None: unknown, torch's default applies)."""
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:  # torch keeps it only in the backend's options (private, checked by a test)
        timeout = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


_PHASE_GROUPS: dict[int, _PhaseGroups] = {}


def _phase_groups(parent: Optional[dist.ProcessGroup]) -> _PhaseGroups:
    # Keyed by the parent object (held by the entry, so its id cannot be reused); a new
    # default group after destroy_process_group() gets new phase groups.
    world = parent or dist.group.WORLD
    entry = _PHASE_GROUPS.get(id(world))
    if entry is None or (entry.parent or dist.group.WORLD) is not world:
        entry = _PHASE_GROUPS[id(world)] = _PhaseGroups(parent)
        entry.parent = world
    return entry


_RESIDUAL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _check_residual_dtype(hook: str, value: Any) -> torch.dtype:
    for dtype, name in _RESIDUAL_DTYPES.items():
        if value is dtype or (isinstance(value, str) and value == name):
            return dtype
    raise ValueError(
        f"pycomm {hook} hook: residual_dtype={value!r}, expected 'float32' or 'bfloat16'"
    )


class Workspace:
    """The buffers of each bucket's exchange, allocated once: fresh ones every step cost more
    in page faults than the codecs themselves."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, Any] = {}

    def exchange(self, key: tuple, w: int, row_bytes: int, device) -> dict:
        """The send and receive buffers of bucket ``key``: ``w`` rows of ``row_bytes``. Phase 2
        reuses them (it runs once phase 1 has completed and its rows are decoded), which keeps
        the step's memory, and so its cache misses, down: gradients, residuals and buffers of
        both ranks already exceed this kind of machine's share of the last-level cache."""
        ws = self.buffers.get(key)
        if ws is None:
            u8 = dict(dtype=torch.uint8, device=device)
            ws = self.buffers[key] = {
                "send": torch.empty(w, row_bytes, **u8),
                "recv": torch.empty(w, row_bytes, **u8),
            }
        return ws

    def chunk_sum(self, key: tuple, c: int, device) -> torch.Tensor:
        """The fp32 buffer phase 2 sums this rank's chunk into. On the CPU one serves every
        bucket: phase 2 of a bucket starts only once the previous bucket's phase 2 has issued
        its gather (the order chain of _two_phase), so no two use it at once. On an
        accelerator, where work is only enqueued, each bucket keeps its own."""
        name = ("chunk_sum",) if device.type == "cpu" else ("chunk_sum", key)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < c or buf.device != device:
            buf = self.buffers[name] = torch.empty(c, dtype=torch.float32, device=device)
        return buf[:c]


class CompressedState(HookState):
    """State of a compression hook: config, the two process groups, residuals, counters.

    Options (all hooks): ``start_iter`` (default 2, onebit 20; >= 2: the first iterations use
    the exact fp32 all-reduce, because DDP rebuilds its buckets after the first one),
    ``error_feedback``, ``local_feedback`` (default True, onebit False; two-phase exchange
    only: False keeps no residual for the encoding of each rank's own gradient in phase 1, only
    for the re-encoded reduced chunk of phase 2; see the README's "Choosing a hook"),
    and ``residual_dtype``: ``"float32"`` (default) or ``"bfloat16"``, the error-feedback
    residuals' storage. bf16 halves their memory (the hooks keep two copies, a step's new
    residuals apart until it is known finite: 8 bytes per parameter in fp32) and the memory
    traffic of encoding; y is still computed in fp32, and each new residual is rounded to bf16
    (a relative 2^-9 of the error it carries).
    """

    default_error_feedback = True
    default_local_feedback = True
    default_start_iter = 2
    option_names: tuple = (
        "start_iter", "error_feedback", "local_feedback", "residual_dtype", "hierarchy",
    )  # fmt: skip

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, **options: Any):
        hook = self.hook_name
        unknown = sorted(set(options) - set(self.option_names))
        if unknown:
            raise ValueError(
                f"pycomm {hook} hook: unknown option {unknown[0]!r}; valid options: "
                f"{', '.join(self.option_names)}"
            )
        # before binding, which resolves it
        self.hierarchy = hier.check_hierarchy(hook, options.get("hierarchy", "auto"))
        super().__init__(process_group)
        self.start_iter = check_int(
            self.where, "start_iter", options.get("start_iter", self.default_start_iter), 2
        )
        self.error_feedback = check_bool(
            self.where, "error_feedback", options.get("error_feedback", self.default_error_feedback)
        )
        self.local_feedback = check_bool(
            self.where, "local_feedback", options.get("local_feedback", self.default_local_feedback)
        )
        self.residual_dtype = _check_residual_dtype(hook, options.get("residual_dtype", "float32"))
        self.codec = self.make_codec(options)
        self.iter = 0
        self._fold_next = False  # the next hook call starts a new step: commit the last one
        self._stats.update(nonfinite_buckets=0, residual_bytes=0, rebucketed_steps=0)
        self.device = torch.device("cpu")  # of the buckets; set by the hook
        # the three parts: residuals (kept per bucket, committed once a step is finite), the
        # hook's own bucket layout over the bound parameters, and the exchange's buffers
        self.store = ResidualStore(self.where, self._stats, self.residual_dtype)
        self.bucket_layout = BucketLayout(self.where, self._stats)
        self.workspace = Workspace()
        # DDP buckets whose parameters were handed to the optimizer check (pycomm.hooks.advice)
        # when no parameters were bound: a state registered with plain register_comm_hook
        self._advice_buckets: set[int] = set()

    phases: Optional[_PhaseGroups] = None  # set when the state binds to its group
    node_plan: Optional[hier.NodePlan] = None  # the node hierarchy, when it resolves to it

    @property
    def residuals(self) -> dict[tuple, dict[str, torch.Tensor]]:
        """Bucket key -> {"r1", "r2"}: the error-feedback residuals as of the last finite step."""
        return self.store.residuals

    @property
    def layout(self) -> Optional[list[tuple[int, ...]]]:
        """The hook's buckets as parameter positions (None before the first compressed step
        or without bound parameters)."""
        return self.bucket_layout.buckets

    @property
    def last_sqnorm(self) -> float:
        return self.store.last_sqnorm

    def _bound(self) -> None:
        if self.world_size > 1:
            self.node_plan = hier.resolve(self.hook_name, self.process_group, self.hierarchy)
            # with the node hierarchy the exchange runs across nodes only, on its own groups
            plan = self.node_plan
            self.phases = _phase_groups(self.process_group) if plan is None else plan.cross

    @property
    def exchange_size(self) -> int:
        """Ranks in the compressed exchange: the group's, or the nodes' with the hierarchy."""
        return self.world_size if self.node_plan is None else self.node_plan.nodes

    def count_exchange(self, bucket: dist.GradBucket, nbytes: int, collectives: int) -> None:
        if self.node_plan is None:  # the node hierarchy counts all its stages itself
            self.count(bucket, nbytes, collectives=collectives)

    def bind_parameters(self, params: list[torch.Tensor]) -> None:
        """The model's trainable parameters in ``module.parameters()`` order: names buckets
        by their parameters' positions (see :attr:`layout`). ``pycomm.wrap`` calls it.

        Example:
            >>> state.bind_parameters([p for p in model.parameters() if p.requires_grad])
        """
        self.bucket_layout.bind(params)
        if advice.gives_advice(self):
            advice.watch(self, self.bucket_layout.params)

    def watch_bucket(self, bucket: dist.GradBucket) -> None:
        """Without bound parameters (a plain ``register_comm_hook``), hand each bucket's
        parameters to the optimizer check (:mod:`pycomm.hooks.advice`) once."""
        if self.bucket_layout.bound or bucket.index() in self._advice_buckets:
            return
        self._advice_buckets.add(bucket.index())
        if advice.gives_advice(self):
            advice.watch(self, bucket.parameters())

    def fingerprint(self) -> dict[str, Any]:
        fp = super().fingerprint()
        fp["topology"] = hier.fingerprint(self.node_plan)
        if self.bucket_layout.bound:
            fp["parameters"] = [list(p.shape) for p in self.bucket_layout.params]
        return fp

    def make_codec(self, options: dict[str, Any]) -> Codec:
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        return {
            "start_iter": self.start_iter,
            "error_feedback": self.error_feedback,
            "local_feedback": self.local_feedback,
            "residual_dtype": _RESIDUAL_DTYPES[self.residual_dtype],
            "hierarchy": self.hierarchy,
        }

    # --- layout ------------------------------------------------------------------------

    def chunk(self, n: int) -> int:
        """Elements per rank's chunk for a bucket of ``n``: a whole number of blocks."""
        b, w = self.codec.block, self.exchange_size
        return max(1, math.ceil(n / (w * b))) * b

    def residual_sizes(self, n: int) -> dict[str, int]:
        """Residual elements kept for a bucket of ``n``: r1 on the whole padded bucket (phase 1;
        none with ``local_feedback=False``), r2 on this rank's chunk (phase 2)."""
        if not getattr(self, "two_phase", True):
            return {"r1": n}
        c = self.chunk(n)
        if not self.local_feedback:
            return {"r2": c}
        return {"r1": self.exchange_size * c, "r2": c}

    def residual(self, key: tuple, n: int) -> tuple:
        """(r1, r2, r1_out, r2_out): the kept residuals of bucket ``key`` (n elements) to read
        and the buffers this step's new ones go to (all None without error feedback)."""
        if not self.error_feedback:
            return None, None, None, None
        return self.store.get(key, self.residual_sizes(n), self.device)

    def new_step(self) -> bool:
        """Called at every hook call: at the first of a step, commit the previous step (its
        decodes are all done by then) and return True."""
        if not self._fold_next:
            return False
        self.commit()
        self._fold_next = False
        self.bucket_layout.end_step()
        return True

    def end_step(self) -> None:
        """Called after DDP's last bucket of a step."""
        self.iter += 1
        self._fold_next = True

    def commit(self) -> None:
        """End of a step (all its buckets decoded): keep its new residuals unless some bucket
        came out non-finite (see :class:`ResidualStore`)."""
        self.store.commit(self.iter - 1, self.device)

    # --- stats -------------------------------------------------------------------------

    def note_decode(self, st: torch.Tensor, step: int) -> None:
        """Keep a decode's [squared norm, non-finite count] for ``step`` (see
        :meth:`ResidualStore.note_decode`)."""
        self.store.note_decode(st, step)

    def fold(self) -> None:
        self.store.fold()

    @property
    def stats(self) -> dict[str, Any]:
        self.fold()
        return self._stats

    def reduced_sqnorm(self) -> Optional[float]:
        """The squared norm of the latest step's reduced gradients, summed over its buckets'
        decode passes; None after a warm-up (exact all-reduce) step, on one rank, or with the
        node hierarchy (each rank decodes only its shard)."""
        self.fold()
        last = self.iter - 1
        if self.world_size == 1 or last < self.start_iter or self.node_plan is not None:
            return None
        return self.store.sqnorm.get(last)

    # --- checkpoint --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self.store.touched and not self._fold_next:
            raise RuntimeError(
                f"pycomm {self.hook_name} hook: state_dict() in the middle of a step; call it "
                "after backward() has returned"
            )
        if self.store.touched:
            self.commit()
        return {
            **super().state_dict(),
            "iter": self.iter,
            "residuals": self.store.snapshot(),
            "layout": None if self.layout is None else [list(k) for k in self.layout],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        loaded = state.get("residuals", {})
        for key, res in loaded.items():
            for name, numel in self.residual_sizes(key[1]).items():
                got = res[name].numel() if name in res else 0
                if got != numel:
                    raise ValueError(
                        f"pycomm {self.hook_name} hook: cannot load the residual of bucket "
                        f"{key[0]} ({key[1]} elements): {name} has {got} elements, expected "
                        f"{numel} for this world size and block"
                    )
                if res[name].dtype != self.residual_dtype:
                    raise ValueError(
                        f"pycomm {self.hook_name} hook: cannot load the residual of bucket "
                        f"{key[0]} ({key[1]} elements): {name} has dtype {res[name].dtype}, "
                        f"expected {self.residual_dtype} (residual_dtype)"
                    )
        layout = state.get("layout")
        params = self.bucket_layout.params
        if layout is not None and params is not None:
            seen = sorted(i for k in layout for i in k)
            if seen != list(range(len(params))):
                raise ValueError(
                    f"pycomm {self.hook_name} hook: the checkpoint's bucket layout covers "
                    f"parameters {seen[:8]}..., expected each of the {len(params)} "
                    "bound parameters once"
                )
        self.iter = int(state["iter"])
        if layout is not None:
            self.bucket_layout.set(layout)
        self.bucket_layout.end_step()
        self.store.load(loaded)


def _two_phase(
    state: CompressedState,
    bucket: dist.GradBucket,
    x: torch.Tensor,
    index: Optional[int] = None,
    step: Optional[int] = None,
):
    """The two-phase exchange of ``x`` as the hook's bucket ``index`` (default DDP's), for
    the hook's ``step`` (default: the current one; the node hierarchy issues it from a
    callback, possibly once the hook has moved on to the next step, so it passes the step)."""
    codec, w = state.codec, state.exchange_size
    index = bucket.index() if index is None else index
    n, step = x.numel(), state.iter if step is None else step
    c = state.chunk(n)
    state.device = x.device
    r1, r2, r1_out, r2_out = state.residual((index, n, str(x.dtype)), n)
    codes, scales = codec.encode(x, r1, 1.0 / w, w * c, r1_out)
    row_bytes = codec.code_bytes(c) + codec.scale_bytes(c)
    key = (index, n, str(x.dtype))
    ws = state.workspace.exchange(key, w, row_bytes, x.device)
    # phase 2 sends from phase 1's send buffer and gathers into its receive buffer
    send, recv = ws["send"], ws["recv"]
    gathered = recv
    codec.pack(codes, scales, w, out=send)
    state.count_exchange(bucket, 2 * (w - 1) * row_bytes, collectives=2)
    phases = state.phases
    g1, g2 = phases.groups
    phase1 = dist.all_to_all_single(recv, send, group=g1, async_op=True).get_future()

    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    prev, issued = phases.issued, torch.futures.Future()
    phases.issued = issued

    def finish(fut: torch.futures.Future) -> None:
        try:
            fut.value()
            codes2, scales2 = codec.split(gathered, c)
            st = None
            for j in range(w):  # rank j's reduced chunk: elements [j * c, (j + 1) * c) of x
                part = codec.decode_sum(
                    codes2[j : j + 1],
                    None if scales2 is None else scales2[j : j + 1],
                    1.0,
                    x[min(n, j * c) : min(n, (j + 1) * c)],
                )
                st = part if st is None else st + part
            state.note_decode(st, step)
            result.set_result(x)
        except BaseException as e:  # noqa: BLE001 - handed to DDP through the future
            result.set_exception(e)

    def phase2(fut: torch.futures.Future) -> None:
        try:
            for sub in fut.value():
                sub.value()
            codes1, scales1 = codec.split(recv, c)
            mine = state.workspace.chunk_sum(key, c, x.device)
            codec.decode_sum(codes1, scales1, 1.0, mine)
            if phases.nccl:
                row = codec.pack(*codec.encode(mine, r2, 1.0, c, r2_out), 1)
                work = dist.all_gather_into_tensor(gathered, row, group=g2, async_op=True)
            else:  # gloo: all_to_all_single measured 3-7x faster than all_gather
                rows = send
                codec.pack(*codec.encode(mine, r2, 1.0, c, r2_out), 1, out=rows[:1])
                rows[1:] = rows[:1]
                work = dist.all_to_all_single(gathered, rows, group=g2, async_op=True)
        except BaseException as e:  # noqa: BLE001
            issued.set_result(torch.empty(0))
            result.set_exception(e)
            return
        issued.set_result(torch.empty(0))
        work.get_future().then(finish)

    torch.futures.collect_all([phase1, prev]).then(phase2)
    return result


def _plain16(
    state: CompressedState,
    bucket: dist.GradBucket,
    x: torch.Tensor,
    index: Optional[int] = None,
    step: Optional[int] = None,
):
    """16-bit all-reduce: encode (pre-scaled, optional residual), sum in 16 bits, decode."""
    n, w = x.numel(), state.exchange_size
    step = state.iter if step is None else step
    index = bucket.index() if index is None else index
    state.device = x.device
    r1, _, r1_out, _ = state.residual((index, n, str(x.dtype)), n)
    enc = ops.encode16(x, r1, 1.0 / w, state.codec.code_dtype, n, r1_out)
    state.count_exchange(bucket, ring_bytes(2 * n, w), collectives=1)
    work = dist.all_reduce(enc, group=state.phases.groups[0], async_op=True)

    def decode(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()
        state.note_decode(ops.decode16_sum(enc.view(1, -1), 1.0, x), step)
        return x

    return work.get_future().then(decode)


def compressed_hook(
    state: CompressedState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group in a compressed format (fp16, bf16, int8, onebit:
    the state's). The first ``state.start_iter`` iterations use the exact fp32 all-reduce.

    Args:
        state: a :class:`CompressedState` subclass (Fp16State, Bf16State, Int8State,
            OneBitState): codec, options, residuals, counters.
        bucket: the DDP bucket that is ready: its flat buffer and the parameters it holds.

    Returns:
        A future of the reduced bucket buffer (same shape and dtype), which DDP copies into
        the parameters' gradients;
        identical on every rank.

    Example:
        >>> state = pycomm.hooks.Int8State(process_group=None, block=64)
        >>> ddp.register_comm_hook(state, pycomm.hooks.compressed_hook)
    """
    x = check_bucket(state.hook_name, bucket)
    if x.dtype not in _FLOATS:
        raise TypeError(
            f"pycomm {state.hook_name} hook: bucket {bucket.index()} has dtype {x.dtype}, "
            f"expected float32, bfloat16 or float16"
        )
    state.watch_bucket(bucket)
    state.new_step()  # at a step's first bucket: the previous step is committed
    try:
        if state.world_size == 1:
            state.count(bucket, 0, collectives=0)
            return completed(x)
        if state.node_plan is not None:
            return _node(state, bucket, x)
        if state.iter < state.start_iter:
            return exact_allreduce(state, bucket, x, state.phases.groups[0])
        reduce = _two_phase if getattr(state, "two_phase", True) else _plain16
        if state.bucket_layout.bound:
            return state.bucket_layout.run(bucket, x, lambda b, t, i: reduce(state, b, t, i))
        return reduce(state, bucket, x)
    finally:
        if bucket.is_last():
            state.end_step()


def _node(state: CompressedState, bucket: dist.GradBucket, x: torch.Tensor):
    """The hook on the node hierarchy (pycomm.hooks.hierarchy): exact inside the node, this
    hook's exchange across nodes on the rank's shard; the exact one while warming up."""
    plan = state.node_plan
    L, m = plan.local_size, plan.nodes
    if state.iter < state.start_iter:
        n = x.numel()
        cross = hier.exact_cross(plan, 1.0 / m)
        return hier.node_reduce(
            state,
            plan,
            bucket,
            x,
            bucket.index(),
            cross,
            hier.exact_bytes(plan, n),
            1,
            postscale=1.0 / L,
        )

    def reduce(state: CompressedState, bucket, x: torch.Tensor, index: int):
        s = hier.shard_size(x.numel(), L)
        if getattr(state, "two_phase", True):
            c = state.chunk(s)
            row = state.codec.code_bytes(c) + state.codec.scale_bytes(c)
            nbytes, calls = 2 * (m - 1) * row, 2
            path = _two_phase
        else:
            nbytes, calls, path = ring_bytes(2 * s, m), 1, _plain16

        step = state.iter  # now, in the hook: stage 2 runs later, from a callback

        def cross(shard_bucket, shard: torch.Tensor):
            return path(state, shard_bucket, shard, index, step)

        return hier.node_reduce(
            state, plan, bucket, x, index, cross, nbytes, calls, postscale=1.0 / L, finite_step=step
        )

    if state.bucket_layout.bound:
        return state.bucket_layout.run(bucket, x, lambda b, t, i: reduce(state, b, t, i))
    return reduce(state, bucket, x, bucket.index())
