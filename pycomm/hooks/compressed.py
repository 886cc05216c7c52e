"""The engine behind pycomm's compression hooks (fp16, bf16, int8, onebit).

Two-phase all-reduce (DESIGN.md): every rank encodes its whole bucket (pre-scaled by 1/N, plus
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
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

from pycomm import ops
from pycomm.hooks import advice
from pycomm.hooks import hierarchy as hier
from pycomm.hooks.allreduce import exact_allreduce
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


class Float16Codec(Codec):
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
        timeout = _group_timeout(world)
        self.groups = tuple(
            dist.new_group(ranks, timeout=timeout, use_local_synchronization=True) for _ in range(2)
        )
        self.nccl = dist.get_backend(self.groups[1]) == "nccl"
        self.issued: torch.futures.Future = completed(torch.empty(0))


def _group_timeout(group: dist.ProcessGroup) -> Optional[datetime.timedelta]:
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


def _check_int(hook: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"pycomm {hook} hook: {name}={value!r}, expected an int >= {minimum}")
    return value


_RESIDUAL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _check_residual_dtype(hook: str, value: Any) -> torch.dtype:
    for dtype, name in _RESIDUAL_DTYPES.items():
        if value is dtype or (isinstance(value, str) and value == name):
            return dtype
    raise ValueError(
        f"pycomm {hook} hook: residual_dtype={value!r}, expected 'float32' or 'bfloat16'"
    )


def _check_bool(hook: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"pycomm {hook} hook: {name}={value!r}, expected True or False")
    return value


class CompressedState(HookState):
    """State of a compression hook: config, the two process groups, residuals, counters.

    Options (all hooks): ``start_iter`` (default 2, onebit 20; >= 2: the first iterations use
    the exact fp32 all-reduce, because DDP rebuilds its buckets after the first one),
    ``error_feedback``, ``local_feedback`` (default True, onebit False; two-phase exchange
    only: False keeps no residual for the encoding of each rank's own gradient in phase 1, only
    for the re-encoded reduced chunk of phase 2; see the README's "Which hook with which
    optimizer"),
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
        self.start_iter = _check_int(
            hook, "start_iter", options.get("start_iter", self.default_start_iter), 2
        )
        self.error_feedback = _check_bool(
            hook, "error_feedback", options.get("error_feedback", self.default_error_feedback)
        )
        self.local_feedback = _check_bool(
            hook, "local_feedback", options.get("local_feedback", self.default_local_feedback)
        )
        self.residual_dtype = _check_residual_dtype(hook, options.get("residual_dtype", "float32"))
        self.codec = self.make_codec(options)
        self.iter = 0
        # (bucket index, numel, dtype) -> {"r1": phase-1 residual, "r2": phase-2 residual}, as
        # of the last finite step. A step writes its new residuals into _next and they are
        # committed (swapped in) once every bucket of the step decoded finite, on every rank
        # alike: a step with a NaN or Inf anywhere leaves the residuals bitwise as they were.
        self.residuals: dict[tuple, dict[str, torch.Tensor]] = {}
        self._next: dict[tuple, dict[str, torch.Tensor]] = {}
        self._touched: set[tuple] = set()  # buckets whose _next holds the current step's
        self._bad_steps: set[int] = set()
        self._pending: Optional[dict[tuple, dict[str, torch.Tensor]]] = None
        self._buffers: dict[tuple, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()  # decode callbacks of different buckets may race
        # (step, [squared norm, non-finite values], False) per decode, or, once a step is
        # committed on an accelerator, (step, [squared norm, non-finite buckets], True)
        self._decoded: list[tuple[int, torch.Tensor, bool]] = []
        self._sqnorm: dict[int, float] = {}
        self._fold_next = False
        self._commit_on_device: Optional[bool] = None  # None: on an accelerator (see commit)
        self._stats.update(nonfinite_buckets=0, residual_bytes=0, rebucketed_steps=0)
        self.last_sqnorm = 0.0
        self.device = torch.device("cpu")  # of the buckets; set by the hook
        # With the model's parameters bound (pycomm.wrap does), the hook keeps its own bucket
        # layout: DDP's buckets as they were at the first compressed step, as parameter
        # positions. Residuals, blocks and chunks follow it, so a freshly built DDP that
        # buckets its first iteration differently (a resume) is re-bucketed into it and
        # reduces bit for bit as the uninterrupted run would.
        self._params: Optional[list[torch.Tensor]] = None
        self._param_index: dict[int, int] = {}
        self.layout: Optional[list[tuple[int, ...]]] = None
        self._layout_index: dict[tuple[int, ...], int] = {}
        self._recording = False
        self._rebucket: Optional[_Rebucket] = None
        # DDP buckets whose parameters were handed to the optimizer check (pycomm.hooks.advice)
        # when no parameters were bound: a state registered with plain register_comm_hook
        self._advice_buckets: set[int] = set()

    _phases: Optional[_PhaseGroups] = None  # set when the state binds to its group
    _hier: Optional[hier.NodePlan] = None  # the node hierarchy, when hierarchy resolves to it

    def _bound(self) -> None:
        if self.world_size > 1:
            self._hier = hier.resolve(self.hook_name, self.process_group, self.hierarchy)
            # with the node hierarchy the exchange runs across nodes only, on its own groups
            self._phases = _phase_groups(self.process_group) if self._hier is None else None
            if self._hier is not None:
                self._phases = self._hier.cross

    @property
    def exchange_size(self) -> int:
        """Ranks in the compressed exchange: the group's, or the nodes' with the hierarchy."""
        return self.world_size if self._hier is None else self._hier.nodes

    def _count_exchange(self, bucket: dist.GradBucket, nbytes: int, collectives: int) -> None:
        if self._hier is None:  # the node hierarchy counts all its stages itself
            self.count(bucket, nbytes, collectives=collectives)

    def bind_parameters(self, params: list[torch.Tensor]) -> None:
        """The model's trainable parameters in ``module.parameters()`` order: names buckets
        by their parameters' positions (see :attr:`layout`). ``pycomm.wrap`` calls it.

        Example:
            >>> state.bind_parameters([p for p in model.parameters() if p.requires_grad])
        """
        self._params = list(params)
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        if advice.gives_advice(self):
            advice.watch(self, self._params)

    def fingerprint(self) -> dict[str, Any]:
        fp = super().fingerprint()
        fp["topology"] = hier.fingerprint(self._hier)
        if self._params is not None:
            fp["parameters"] = [list(p.shape) for p in self._params]
        return fp

    def _bucket_key(self, bucket: dist.GradBucket) -> tuple[int, ...]:
        try:
            return tuple(self._param_index[id(p)] for p in bucket.parameters())
        except KeyError:
            raise ValueError(
                f"pycomm {self.hook_name} hook: bucket {bucket.index()} holds a parameter that "
                "is not among the bound parameters (bind_parameters)"
            ) from None

    def _set_layout(self, layout: list[tuple[int, ...]]) -> None:
        self.layout = [tuple(k) for k in layout]
        self._layout_index = {k: i for i, k in enumerate(self.layout)}

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

    def _residual(self, key: tuple, n: int) -> tuple:
        """(r1, r2, r1_out, r2_out): the committed residuals of bucket ``key`` to read and the
        buffers this step's new ones go to (all None without error feedback)."""
        if not self.error_feedback:
            return None, None, None, None
        res = self.residuals.get(key)
        if res is None:
            if self._pending is not None:
                if key not in self._pending:
                    raise ValueError(
                        f"pycomm {self.hook_name} hook: bucket {key[0]} ({key[1]} elements, "
                        f"{key[2]}) has no residual in the loaded state, which holds buckets "
                        f"{sorted(self._pending)}: the model or its bucketing changed"
                    )
                res = self._pending.pop(key)
            else:
                res = {
                    name: torch.zeros(numel, dtype=self.residual_dtype, device=self.device)
                    for name, numel in self.residual_sizes(n).items()
                }
            self.residuals[key] = res
            self._next[key] = {name: torch.empty_like(t) for name, t in res.items()}
            self._stats["residual_bytes"] = 2 * sum(
                t.numel() * t.element_size() for r in self.residuals.values() for t in r.values()
            )
        nxt = self._next[key]
        self._touched.add(key)
        return res.get("r1"), res.get("r2"), nxt.get("r1"), nxt.get("r2")

    def commit(self) -> None:
        """End of a step (all its buckets decoded): keep its new residuals, unless some bucket
        came out non-finite, in which case the step's residual updates are dropped.

        On the CPU the decision reads the decodes' flags. On an accelerator it is taken on the
        device (a select between the kept and the new residuals, one pass over them), so the
        hook never waits for the device: the flags reach the host only when stats are read."""
        step = self.iter - 1
        on_device = self._commit_on_device
        if on_device is None:
            on_device = self.device.type != "cpu"
        if not on_device:
            self.fold()
            if step not in self._bad_steps:
                for key in self._touched:
                    self.residuals[key], self._next[key] = self._next[key], self.residuals[key]
        elif step not in self._bad_steps:  # (a stats read may have folded it already)
            finite = self._step_finite_on_device(step)
            for key in self._touched:
                new, kept = self._next[key], self.residuals[key]
                if finite is not None:
                    for name, t in new.items():
                        torch.where(finite, t, kept[name], out=t)
                self.residuals[key], self._next[key] = new, kept
        self._touched = set()
        self._bad_steps = {s for s in self._bad_steps if s > step}

    def _step_finite_on_device(self, step: int) -> Optional[torch.Tensor]:
        """A device bool, true when every decode of ``step`` was finite (None: no decode, as
        in a warm-up step). The step's decode results are summed into one entry on the device,
        [squared norm, non-finite buckets], so that they do not pile up between reads."""
        with self._lock:
            mine = [st for s, st, _ in self._decoded if s == step]
            if not mine:
                return None
            rows = torch.stack(mine)
            summary = torch.stack([rows[:, 0].sum(), (rows[:, 1] > 0).sum().to(rows.dtype)])
            self._decoded = [e for e in self._decoded if e[0] != step] + [(step, summary, True)]
        return summary[1] == 0

    def _workspace(self, key: tuple, w: int, row_bytes: int, device) -> dict:
        """The send and receive buffers of one bucket's exchange, allocated once: fresh ones
        every step cost more in page faults than the codecs themselves. Phase 2 reuses them
        (it runs once phase 1 has completed and its rows are decoded), which keeps the step's
        memory, and so its cache misses, down: gradients, residuals and buffers of both ranks
        already exceed this kind of machine's share of the last-level cache."""
        ws = self._buffers.get(key)
        if ws is None:
            u8 = dict(dtype=torch.uint8, device=device)
            ws = self._buffers[key] = {
                "send": torch.empty(w, row_bytes, **u8),
                "recv": torch.empty(w, row_bytes, **u8),
            }
        return ws

    def _chunk_sum(self, key: tuple, c: int, device) -> torch.Tensor:
        """The fp32 buffer phase 2 sums this rank's chunk into. On the CPU one serves every
        bucket: phase 2 of a bucket starts only once the previous bucket's phase 2 has issued
        its gather (the order chain of _two_phase), so no two use it at once. On an
        accelerator, where work is only enqueued, each bucket keeps its own."""
        name = ("chunk_sum",) if device.type == "cpu" else ("chunk_sum", key)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < c or buf.device != device:
            buf = self._buffers[name] = torch.empty(c, dtype=torch.float32, device=device)
        return buf[:c]

    # --- stats -------------------------------------------------------------------------

    def note_decode(self, st: torch.Tensor, step: int) -> None:
        """Keep a decode's [squared norm, non-finite count] (from a callback thread) until
        :meth:`fold`, which runs when the stats are read (and, on the CPU, at the start of every
        step): no callback reads a device value."""
        with self._lock:
            self._decoded.append((step, st, False))

    def fold(self) -> None:
        """Fold the kept decode results into ``stats`` and ``last_sqnorm``, the squared norm of
        the latest step's reduced gradients (complete once DDP's backward has returned)."""
        with self._lock:
            pending, self._decoded = self._decoded, []
        for step, st, summed in pending:
            sq, bad = st.tolist()
            self._sqnorm[step] = self._sqnorm.get(step, 0.0) + sq
            self._stats["nonfinite_buckets"] += int(bad) if summed else int(bad > 0)
            if bad > 0:  # the norm of a gradient holding NaN or Inf is not finite
                self._bad_steps.add(step)
                self._sqnorm[step] = float("nan")
        if self._sqnorm:
            latest = max(self._sqnorm)
            self.last_sqnorm = self._sqnorm[latest]
            self._sqnorm = {latest: self.last_sqnorm}

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
        if self.world_size == 1 or last < self.start_iter or self._hier is not None:
            return None
        return self._sqnorm.get(last)

    # --- checkpoint --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self._touched and not self._fold_next:
            raise RuntimeError(
                f"pycomm {self.hook_name} hook: state_dict() in the middle of a step; call it "
                "after backward() has returned"
            )
        if self._touched:
            self.commit()
        return {
            **super().state_dict(),
            "iter": self.iter,
            "residuals": {
                k: {n: t.clone() for n, t in r.items()} for k, r in self.residuals.items()
            },
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
        if layout is not None and self._params is not None:
            seen = sorted(i for k in layout for i in k)
            if seen != list(range(len(self._params))):
                raise ValueError(
                    f"pycomm {self.hook_name} hook: the checkpoint's bucket layout covers "
                    f"parameters {seen[:8]}..., expected each of the {len(self._params)} "
                    "bound parameters once"
                )
        self.iter = int(state["iter"])
        if layout is not None:
            self._set_layout(layout)
        self._recording, self._rebucket = False, None
        self.residuals, self._next, self._touched = {}, {}, set()
        self._pending = {k: {n: t.clone() for n, t in r.items()} for k, r in loaded.items()}


def _two_phase(
    state: CompressedState, bucket: dist.GradBucket, x: torch.Tensor, index: Optional[int] = None
):
    """The two-phase exchange of ``x`` as the hook's bucket ``index`` (default DDP's)."""
    codec, w = state.codec, state.exchange_size
    index = bucket.index() if index is None else index
    n, step = x.numel(), state.iter
    c = state.chunk(n)
    state.device = x.device
    r1, r2, r1_out, r2_out = state._residual((index, n, str(x.dtype)), n)
    codes, scales = codec.encode(x, r1, 1.0 / w, w * c, r1_out)
    row_bytes = codec.code_bytes(c) + codec.scale_bytes(c)
    key = (index, n, str(x.dtype))
    ws = state._workspace(key, w, row_bytes, x.device)
    # phase 2 sends from phase 1's send buffer and gathers into its receive buffer
    send, recv = ws["send"], ws["recv"]
    gathered = recv
    codec.pack(codes, scales, w, out=send)
    state._count_exchange(bucket, 2 * (w - 1) * row_bytes, collectives=2)
    phases = state._phases
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
            mine = state._chunk_sum(key, c, x.device)
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


class _Rebucket:
    """One step of DDP buckets that differ from the hook's layout: each DDP bucket is copied
    into the hook buckets holding its parameters; a hook bucket whose parameters have all
    arrived is reduced (in the order they complete, the same on every rank); a DDP bucket's
    future completes once all its parameters came back."""

    def __init__(self, state: CompressedState, dtype: torch.dtype, device: torch.device) -> None:
        params = state._params
        self.lock = threading.Lock()
        self.where: dict[int, tuple[int, int]] = {}  # parameter -> (hook bucket, offset)
        self.sizes: list[int] = []
        self.buffers: dict[int, torch.Tensor] = {}  # allocated when a parameter arrives
        self.missing: list[set[int]] = []
        self.dtype, self.device = dtype, device
        for r, key in enumerate(state.layout):
            off = 0
            for i in key:
                self.where[i] = (r, off)
                off += params[i].numel()
            self.sizes.append(off)
            self.missing.append(set(key))
        # parameter -> (DDP bucket tensor, offset, that bucket's pending set, its future)
        self.owner: dict[int, tuple[torch.Tensor, int, set[int], torch.futures.Future]] = {}


class _HookBucket:
    """A hook bucket as the two-phase path sees it (index, buffer, is_last)."""

    def __init__(self, index: int, buffer: torch.Tensor, last: bool) -> None:
        self._index, self._buffer, self._last = index, buffer, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def is_last(self) -> bool:
        return self._last


def _laid_out(state: CompressedState, bucket: dist.GradBucket, x: torch.Tensor, reduce):
    """``reduce`` (the two-phase or the 16-bit path) on the hook's own layout (see
    CompressedState.bind_parameters)."""
    key = state._bucket_key(bucket)
    if state.layout is None or state._recording:  # the first compressed step defines it
        if state.layout is None:
            state._set_layout([])
            state._recording = True
        state.layout.append(key)
        state._layout_index[key] = len(state.layout) - 1
        if bucket.is_last():
            state._recording = False
        return reduce(state, bucket, x, len(state.layout) - 1)
    r = state._layout_index.get(key)
    if r is not None:
        return reduce(state, bucket, x, r)
    rb = state._rebucket
    if rb is None:
        logger.info(
            "pycomm %s hook: DDP's buckets differ from the hook's layout; re-bucketing",
            state.hook_name,
        )
        rb = state._rebucket = _Rebucket(state, x.dtype, x.device)
        state._stats["rebucketed_steps"] += 1
    params = state._params
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    pending = set(key)
    off, complete = 0, []
    for i in key:
        n = params[i].numel()
        r, o = rb.where[i]
        if r not in rb.buffers:
            rb.buffers[r] = torch.empty(rb.sizes[r], dtype=rb.dtype, device=rb.device)
        rb.buffers[r][o : o + n].copy_(x[off : off + n])
        rb.owner[i] = (x, off, pending, fut)
        rb.missing[r].discard(i)
        if not rb.missing[r]:
            complete.append(r)
        off += n
    if off != x.numel():
        raise RuntimeError(
            f"pycomm {state.hook_name} hook: bucket {bucket.index()} has {x.numel()} elements "
            f"but its parameters {off}"
        )
    complete.sort()
    for r in complete:
        # the step is counted once: on DDP's last bucket, by the last hook bucket it completes
        last = bucket.is_last() and r == complete[-1]
        reduced = reduce(state, _HookBucket(r, rb.buffers[r], last), rb.buffers[r], r)
        reduced.then(lambda f, r=r: _scatter(rb, state, r, f))
    if bucket.is_last():
        state._rebucket = None
    return fut


def _scatter(rb: _Rebucket, state: CompressedState, r: int, f: torch.futures.Future) -> None:
    """Copy a reduced hook bucket back into the DDP buckets it came from; complete those whose
    parameters are all back."""
    params = state._params
    try:
        out = f.value()
    except BaseException as e:  # noqa: BLE001 - handed to every waiting DDP bucket
        for i in state.layout[r]:
            _x, _o, _pending, fut = rb.owner[i]
            if not fut.done():
                fut.set_exception(e)
        return
    done = []
    for i in state.layout[r]:
        x, off, pending, fut = rb.owner[i]
        n = params[i].numel()
        o = rb.where[i][1]
        x[off : off + n].copy_(out[o : o + n])
        with rb.lock:
            pending.discard(i)
            if not pending:
                done.append((x, fut))
    for x, fut in done:
        fut.set_result(x)


def _plain16(
    state: CompressedState, bucket: dist.GradBucket, x: torch.Tensor, index: Optional[int] = None
):
    """16-bit all-reduce: encode (pre-scaled, optional residual), sum in 16 bits, decode."""
    n, w, step = x.numel(), state.exchange_size, state.iter
    index = bucket.index() if index is None else index
    state.device = x.device
    r1, _, r1_out, _ = state._residual((index, n, str(x.dtype)), n)
    enc = ops.encode16(x, r1, 1.0 / w, state.codec.code_dtype, n, r1_out)
    state._count_exchange(bucket, ring_bytes(2 * n, w), collectives=1)
    work = dist.all_reduce(enc, group=state._phases.groups[0], async_op=True)

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

    Example:
        >>> state = pycomm.hooks.Int8State(process_group=None, block=256)
        >>> ddp.register_comm_hook(state, pycomm.hooks.compressed_hook)
    """
    x = check_bucket(state.hook_name, bucket)
    if x.dtype not in _FLOATS:
        raise TypeError(
            f"pycomm {state.hook_name} hook: bucket {bucket.index()} has dtype {x.dtype}, "
            f"expected float32, bfloat16 or float16"
        )
    if state._params is None and bucket.index() not in state._advice_buckets:
        state._advice_buckets.add(bucket.index())
        if advice.gives_advice(state):
            advice.watch(state, bucket.parameters())
    if state._fold_next:  # a new step: the previous one's decodes are all done
        state.commit()
        state._fold_next = False
        state._rebucket = None
    try:
        if state.world_size == 1:
            state.count(bucket, 0, collectives=0)
            return completed(x)
        if state._hier is not None:
            return _node(state, bucket, x)
        if state.iter < state.start_iter:
            return exact_allreduce(state, bucket, x, state._phases.groups[0])
        reduce = _two_phase if getattr(state, "two_phase", True) else _plain16
        if state._params is not None:
            return _laid_out(state, bucket, x, reduce)
        return reduce(state, bucket, x)
    finally:
        if bucket.is_last():
            state.iter += 1
            state._fold_next = True


def _node(state: CompressedState, bucket: dist.GradBucket, x: torch.Tensor):
    """The hook on the node hierarchy (pycomm.hooks.hierarchy): exact inside the node, this
    hook's exchange across nodes on the rank's shard; the exact one while warming up."""
    plan = state._hier
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
            None,
            1.0 / L,
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

        def cross(shard_bucket, shard: torch.Tensor):
            return path(state, shard_bucket, shard, index)

        return hier.node_reduce(state, plan, bucket, x, index, cross, nbytes, calls, None, 1.0 / L)

    if state._params is not None:
        return _laid_out(state, bucket, x, reduce)
    return reduce(state, bucket, x, bucket.index())
