"""The engine behind pycomm's compression hooks (fp16, bf16, int8, fp8, int4, onebit).

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

import inspect
import logging
import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from pycomm._validate import check_bool, check_dtype, check_int
from pycomm.hooks import advice
from pycomm.hooks import hierarchy as hier
from pycomm.hooks.allreduce import exact_allreduce, per_bucket
from pycomm.hooks.codec import Codec, check_codec
from pycomm.hooks.groups import Stage, phase_groups
from pycomm.hooks.layout import BucketLayout
from pycomm.hooks.residuals import ResidualStore
from pycomm.hooks.state import (
    HookState,
    is_sparse,
    ring_bytes,
)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

logger = logging.getLogger(__name__)


_RESIDUAL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

# The third field of a residual key that holds phase 1's residual alone: a reduce-scatter's
# (pycomm.Exchange, pycomm.fsdp), ``(index, n, PHASE_1)``; a bucket's is its dtype.
PHASE_1 = "phase 1"


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
    ``residual_dtype``: ``"float32"`` (default) or ``"bfloat16"``, the error-feedback
    residuals' storage. bf16 halves their memory (4 bytes a parameter for the local residual
    and 4/N for the reduced chunk's in fp32) and the memory traffic of encoding; y is still
    computed in fp32, and each new residual is rounded to bf16 (a relative 2^-9 of the error
    it carries). ``strict_skip`` (default False): True keeps a second copy of the residuals so
    that a step with a NaN or Inf anywhere leaves them bitwise as they were on every rank;
    False (one copy) updates them in place, a non-finite block keeping its residual and the
    blocks finite on a rank taking the step's update (:mod:`pycomm.hooks.residuals`).

    ``stats`` adds to :class:`HookState`'s: ``nonfinite_buckets``, ``residual_bytes``,
    ``rebucketed_steps``, and the codec's own figures over its compressed exchanges alone:
    ``codec_bytes_sent``, ``codec_bytes_fp32`` (an fp32 ring all-reduce of the same elements
    across the same ranks) and ``codec_compression``, their ratio. ``compression`` is the
    running total over every step instead: the exact warm-up before ``start_iter`` counts in
    it, and under ``hierarchy="node"`` the exact in-node stages too, where
    ``codec_compression`` counts the cross-node exchange of each shard only.
    """

    grad_dtypes = _FLOATS  # the engine encodes from fp32, bf16 or fp16 buckets
    default_error_feedback = True
    default_local_feedback = True
    default_start_iter = 2
    option_names: tuple = (
        "start_iter", "error_feedback", "local_feedback", "residual_dtype", "strict_skip",
        "hierarchy",
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
        self.residual_dtype = check_dtype(
            self.where, "residual_dtype", options.get("residual_dtype", "float32"),
            tuple(_RESIDUAL_DTYPES),
        )  # fmt: skip
        self.codec = self.make_codec(options)
        self.iter = 0
        self._fold_next = False  # the next hook call starts a new step: commit the last one
        self._stats.update(
            nonfinite_buckets=0,
            residual_bytes=0,
            rebucketed_steps=0,
            codec_bytes_sent=0,
            codec_bytes_fp32=0,
            codec_compression=1.0,
        )
        self.device = torch.device("cpu")  # of the buckets; set by the hook
        # the three parts: residuals (kept per bucket, committed once a step is finite), the
        # hook's own bucket layout over the bound parameters, and the exchange's buffers
        self.strict_skip = check_bool(self.where, "strict_skip", options.get("strict_skip", False))
        self.store = ResidualStore(
            self.where, self._stats, self.residual_dtype, strict=self.strict_skip
        )
        self.bucket_layout = BucketLayout(self.where, self._stats)
        self.workspace = Workspace()
        # DDP buckets whose parameters were handed to the optimizer check (pycomm.hooks.advice)
        # when no parameters were bound: a state registered with plain register_comm_hook
        self._advice_buckets: set[int] = set()

    phases: Optional[Stage] = None  # set when the state binds to its group
    node_plan: Optional[hier.NodePlan] = None  # the node hierarchy, when it resolves to it

    @property
    def residuals(self) -> dict[tuple, dict[str, torch.Tensor]]:
        """Bucket key -> {"r1", "r2"}: the error-feedback residuals as of the last finite step
        whose backward has returned (a step's residuals are kept once all its buckets are
        decoded; read in the middle of a backward, the previous step's)."""
        if self.store.touched and self._fold_next:
            self.commit()
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
            self.phases = phase_groups(self.process_group) if plan is None else plan.cross

    @property
    def exchange_size(self) -> int:
        """Ranks in the compressed exchange: the group's, or the nodes' with the hierarchy."""
        return self.world_size if self.node_plan is None else self.node_plan.nodes

    def count_exchange(self, bucket: dist.GradBucket, nbytes: int, collectives: int) -> None:
        """Account one compressed exchange of ``bucket`` that sends ``nbytes`` in the totals,
        which the node hierarchy counts itself (its exact in-node stages included)."""
        if self.node_plan is None:
            self.count(bucket, nbytes, collectives=collectives)

    def count_codec(self, numel: int, nbytes: int, bytes_fp32: Optional[int] = None) -> None:
        """Account one compressed exchange of ``numel`` elements that sends ``nbytes`` in
        ``codec_bytes_sent``/``codec_bytes_fp32``/``codec_compression``: the codec's own ratio
        over its exchanges alone (no warm-up step; under the node hierarchy, the cross-node
        exchange of each rank's shard only). ``bytes_fp32``: what the exact fp32 collective
        sends, where it is not a ring all-reduce of ``numel`` elements (a reduce-scatter's)."""
        s = self._stats
        s["codec_bytes_sent"] += nbytes
        if bytes_fp32 is None:
            bytes_fp32 = ring_bytes(numel * 4, self.exchange_size)
        s["codec_bytes_fp32"] += bytes_fp32
        s["codec_compression"] = s["codec_bytes_fp32"] / max(s["codec_bytes_sent"], 1)

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

    # A registered codec's factory (pycomm.hooks.register_hook(name, codec=...)): its keyword
    # parameters are the hook's codec options, and make_codec calls it with them.
    codec_factory: Optional[Any] = None
    codec_option_names: tuple = ()

    def make_codec(self, options: dict[str, Any]) -> Codec:
        """The codec of this state for ``options`` (the subclass's format). The default
        calls :attr:`codec_factory` with the codec's own options (set by ``register_hook``)."""
        if self.codec_factory is None:
            raise NotImplementedError(f"{type(self).__name__} has no codec_factory")
        kwargs = {k: options[k] for k in self.codec_option_names if k in options}
        self.codec_kwargs = kwargs
        try:
            codec = self.codec_factory(**kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.where}: {_refusal(str(e), kwargs)}") from e
        check_codec(codec, self.where)
        return codec

    def codec_options(self) -> dict[str, Any]:
        """A registered codec's options as this state runs them (its factory's defaults
        filled in): part of :meth:`options`, so compared across ranks and checkpointed."""
        if self.codec_factory is None:
            return {}
        sig = inspect.signature(self.codec_factory)
        given = getattr(self, "codec_kwargs", {})
        out = {k: given.get(k, sig.parameters[k].default) for k in self.codec_option_names}
        # a dtype by its name: "bfloat16" and torch.bfloat16 are one option value
        return {k: _named(v) for k, v in out.items()}

    def identity(self) -> dict[str, Any]:
        """The state class, and the codec's class and format (:func:`codec_identity`)."""
        return {**super().identity(), **codec_identity(self.codec)}

    def options(self) -> dict[str, Any]:
        return {
            "start_iter": self.start_iter,
            "error_feedback": self.error_feedback,
            "local_feedback": self.local_feedback,
            "residual_dtype": _RESIDUAL_DTYPES[self.residual_dtype],
            "strict_skip": self.strict_skip,
            "hierarchy": self.hierarchy,
            **self.codec_options(),
        }

    # --- layout ------------------------------------------------------------------------

    def chunk(self, n: int) -> int:
        """Elements per rank's chunk for a bucket of ``n``: a whole number of blocks."""
        b, w = self.codec.block, self.exchange_size
        return max(1, math.ceil(n / (w * b))) * b

    def residual_sizes(self, n: int) -> dict[str, int]:
        """Residual elements kept for a bucket of ``n``: r1 on the whole padded bucket (phase 1;
        none with ``local_feedback=False``), r2 on this rank's chunk (phase 2)."""
        if not self.codec.two_phase:
            return {"r1": summed_numel(self.codec, n)}
        c = self.chunk(n)
        if not self.local_feedback:
            return {"r2": c}
        return {"r1": self.exchange_size * c, "r2": c}

    def key_sizes(self, key: tuple) -> dict[str, int]:
        """The residuals kept under ``key``: a bucket's, ``(index, n, dtype)``, those of
        :meth:`residual_sizes`; a reduce-scatter's, ``(index, n, PHASE_1)``, r1 alone (its
        exchange is phase 1; none with ``local_feedback=False``)."""
        sizes = self.residual_sizes(key[1])
        if key[2] == PHASE_1:
            return {name: numel for name, numel in sizes.items() if name == "r1"}
        return sizes

    def residual(self, key: tuple, n: int) -> tuple:
        """(r1, r2, r1_out, r2_out): the kept residuals of bucket ``key`` (n elements, its
        second field) to read and the buffers this step's new ones go to (all None without
        error feedback; see :meth:`key_sizes`)."""
        if not self.error_feedback:
            return None, None, None, None
        return self.store.get(key, self.key_sizes((key[0], n, *key[2:])), self.device)

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

    def check_fingerprint(self, state: dict[str, Any]) -> None:
        # a checkpoint of a version without strict_skip (which kept two copies): its
        # residuals are those of either way
        options = state.get("fingerprint", {}).get("options")
        if isinstance(options, dict) and "strict_skip" not in options:
            fingerprint = {**state["fingerprint"]}
            fingerprint["options"] = {**options, "strict_skip": self.strict_skip}
            state = {**state, "fingerprint": fingerprint}
        super().check_fingerprint(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        loaded = state.get("residuals", {})
        for key, res in loaded.items():
            for name, numel in self.key_sizes(key).items():
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


def _named(value: Any) -> Any:
    """A dtype as its name (``"bfloat16"``), any other option value as it is."""
    return str(value).split(".")[-1] if isinstance(value, torch.dtype) else value


def _refusal(message: str, kwargs: dict[str, Any]) -> str:
    """A codec's refusal of its options as the hook's: ``block=12, expected ...`` when the
    codec's message names one of them after its own prefix, else the options and the message."""
    for name in kwargs:
        head, sep, rest = message.partition(": ")
        if sep and rest.startswith(f"{name}="):
            return rest
    return f"the codec refused options {kwargs}: {message}"


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
    state.count_codec(n, 2 * (w - 1) * row_bytes)
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


def _summed(
    state: CompressedState,
    bucket: dist.GradBucket,
    x: torch.Tensor,
    index: Optional[int] = None,
    step: Optional[int] = None,
):
    """A ``two_phase=False`` codec's exchange: encode (pre-scaled, optional residual), sum
    the codes in their own dtype with one all-reduce, decode once."""
    codec, n, w = state.codec, x.numel(), state.exchange_size
    step = state.iter if step is None else step
    index = bucket.index() if index is None else index
    state.device = x.device
    numel = summed_numel(codec, n)
    r1, _, r1_out, _ = state.residual((index, n, str(x.dtype)), n)
    enc, _ = codec.encode(x, r1, 1.0 / w, numel, r1_out)
    state.count_codec(n, ring_bytes(codec.code_bytes(numel), w))
    state.count_exchange(bucket, ring_bytes(codec.code_bytes(numel), w), collectives=1)
    work = dist.all_reduce(enc, group=state.phases.groups[0], async_op=True)

    def decode(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()
        state.note_decode(codec.decode_sum(enc.view(1, -1), None, 1.0, x), step)
        return x

    return work.get_future().then(decode)


def codec_identity(codec: Codec) -> dict[str, Any]:
    """What two ranks' codecs must agree on to exchange codes: the codec's class and its
    format (block, dtypes, phases, bytes of 8 blocks), so that a codec edited on one node, or
    one with another default, is named before the first collective instead of hanging it."""
    cls, m = type(codec), 8 * codec.block
    return {
        "codec": f"{cls.__module__}.{cls.__qualname__}",
        "codec format": (
            f"block {codec.block}, codes {codec.code_dtype}, scales {codec.scale_dtype}, "
            f"{'two-phase' if codec.two_phase else 'one-phase'}, "
            f"{codec.code_bytes(m)} + {codec.scale_bytes(m)} bytes per {m} elements"
        ),
    }


def summed_numel(codec: Codec, n: int) -> int:
    """Elements a ``two_phase=False`` codec encodes for a bucket of ``n``: n rounded up to
    whole blocks (what the exchange sums, and the size of its residual)."""
    return max(1, math.ceil(n / codec.block)) * codec.block


def compressed_hook(
    state: CompressedState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group through the state's codec: the one hook function of
    every registered codec, pycomm's and users' alike. The first ``state.start_iter``
    iterations use the exact fp32 all-reduce.

    Args:
        state: a registered codec hook's state (``pycomm.hooks.hook_spec(name).state``, a
            :class:`CompressedState` subclass): codec, options, residuals, counters.
        bucket: the DDP bucket that is ready: its flat buffer and the parameters it holds.

    Returns:
        A future of the reduced bucket buffer (same shape and dtype), which DDP copies into
        the parameters' gradients;
        identical on every rank.

    Example:
        >>> state = pycomm.hooks.hook_spec("int8").state(process_group=None, block=64)
        >>> ddp.register_comm_hook(state, pycomm.hooks.compressed_hook)
    """

    def begin() -> None:
        state.new_step()  # at a step's first bucket: the previous step is committed
        if not is_sparse(bucket):
            state.watch_bucket(bucket)

    def dense(x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        if state.node_plan is not None:
            return _node(state, bucket, x)
        if state.iter < state.start_iter:
            return exact_allreduce(state, bucket, x, state.phases.groups[0])
        reduce = _two_phase if state.codec.two_phase else _summed
        if state.bucket_layout.bound:
            return state.bucket_layout.run(bucket, x, lambda b, t, i: reduce(state, b, t, i))
        return reduce(state, bucket, x)

    return per_bucket(state, bucket, dense, begin=begin, end=state.end_step)


def _node(state: CompressedState, bucket: dist.GradBucket, x: torch.Tensor):
    """The hook on the node hierarchy (pycomm.hooks.hierarchy): exact inside the node, this
    hook's exchange across nodes on the rank's shard; the exact one while warming up."""
    plan = state.node_plan
    L, m = plan.local_size, plan.nodes
    if state.iter < state.start_iter:
        cross = hier.exact_cross(plan, x.numel(), 1.0 / m)
        return hier.node_reduce(state, plan, bucket, x, bucket.index(), cross, postscale=1.0 / L)

    def reduce(state: CompressedState, bucket, x: torch.Tensor, index: int):
        s = hier.shard_size(x.numel(), L)
        if state.codec.two_phase:
            c = state.chunk(s)
            row = state.codec.code_bytes(c) + state.codec.scale_bytes(c)
            nbytes, calls = 2 * (m - 1) * row, 2
            path = _two_phase
        else:
            numel = summed_numel(state.codec, s)
            nbytes, calls, path = ring_bytes(state.codec.code_bytes(numel), m), 1, _summed

        step = state.iter  # now, in the hook: stage 2 runs later, from a callback

        def issue(shard_bucket, shard: torch.Tensor):
            return path(state, shard_bucket, shard, index, step)

        cross = hier.Cross(issue, nbytes, calls)
        return hier.node_reduce(
            state, plan, bucket, x, index, cross, postscale=1.0 / L, finite_step=step
        )

    if state.bucket_layout.bound:
        return state.bucket_layout.run(bucket, x, lambda b, t, i: reduce(state, b, t, i))
    return reduce(state, bucket, x, bucket.index())
