"""``hook="auto"``: measure the job during the exact warm-up, then run the hook (and the node
hierarchy) a cost model predicts fastest, within an accuracy budget.

What is measured, on every rank, during the first ``start_iter`` iterations (default 5; each
runs the exact fp32 all-reduce, as the warm-up of every compressed hook; iteration 0 is not
measured, DDP rebuilds its buckets after it). Each number is the smallest over the measured
iterations (other processes only ever add time; the first iterations run on cold caches):

- ``forward_s``: the forward pass (from DDP's forward pre-hook to its forward hook);
- ``ready_s``: when each DDP bucket became ready, in seconds after the forward ended (the
  start of backward), and ``numel``, its elements;
- ``exposed_s``: how long the exact all-reduce ran on after the last bucket was ready;
- ``step_s``: forward_s + the last bucket's ready_s + exposed_s: the part of a step the hook
  changes, in time. The optimizer step and data loading are the same for every candidate and
  left out (they would also count other models' steps where several train interleaved, as in
  the bench);
- ``wire_s_per_byte``: the seconds one rank's exchange takes per byte it sends: the busy time
  of the exchange (the union of every bucket's [ready, reduced] interval) over the ring bytes
  of the buckets. On an accelerator, where a collective's future completes before the
  device has run it, a synchronized all-reduce of the largest bucket, once, instead;
- ``latency_s``: a one-element all-reduce, timed once: what every collective costs whatever
  its size;
- ``codec_s_per_elem``: each codec's encode and decode-sum cost per element on this device,
  timed once on a tensor as large as the largest bucket (at most 2M elements);
- on several nodes with several ranks each, ``intra_s_per_byte`` and ``inter_s_per_byte``: a
  fp32 all-to-all inside the node and an all-reduce across nodes of that bucket, timed once.

Every rank all-reduces its measurements with MAX (every number is seconds, or seconds per
byte or element: the slowest rank bounds the step), then takes the decision of
:func:`choose`, a pure function: the same measurements give the same choice on every rank.

The cost model (:func:`predict`). Per candidate, each bucket b of n elements is:
``pre`` (encoding, on the backward thread: it delays the rest of backward), its exchange
(``wire`` = bytes one rank sends x seconds per byte, plus codec work between two phases),
then ``post`` (decoding). Exchanges run one after another, in bucket order, each starting
when its bucket is encoded and the previous exchange is done::

    start_b  = max(ready_b + sum(pre_0..pre_b), end_{b-1})
    end_b    = start_b + wire_b + mid_b
    finish   = max(ready_last + sum(pre), max_b(end_b + post_b))
    exposed  = finish - ready_last
    predicted step time = step_s - exposed_s (the exact all-reduce's, measured) + exposed

and the choice is the most exact candidate predicted within 5% (``MARGIN``) of the fastest.

So a candidate pays only for the communication and codec work not hidden behind the rest of
backward. Bytes per bucket: fp32 ring 2(N-1)/N x 4n (allreduce), 2(N-1)/N x 2n (bf16, fp16),
2(N-1)/N x the packed codes and scales (int8, fp8, int4, onebit: the two-phase exchange).
With the node hierarchy each bucket also crosses the node twice in fp32 (1/L of it each way,
at ``intra_s_per_byte``) and only its 1/L shard goes across nodes (``inter_s_per_byte``).

The order of exactness is allreduce, bf16, fp16, int8, fp8, int4, onebit, flat before node
(bf16 and fp16 send the same bytes through the same kernel: bf16 has fp32's range). Which
hooks are candidates is the accuracy budget: ``allow`` (default allreduce, bf16, fp16, int8,
fp8 and int4, the hooks that held their quality limit on every task and optimizer of the
quality suite, benchmarks/README.md, "The limits"; onebit, which did not, runs only when
allowed).

The bucket size is DDP's: DDP takes ``bucket_cap_mb`` when it is built and has no way to change
it afterwards, so ``pycomm.wrap(hook="auto")`` builds it with auto's own bucket size
(docs/reference.md, "The DDP bucket size") unless told otherwise, and the decision is taken on
those buckets.
"""

import logging
import math
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from pycomm._validate import check_int
from pycomm.codec.agree import dtype_names
from pycomm.codec.codecs import Codec
from pycomm.codec.config import check_hierarchy
from pycomm.codec.engine import ring_bytes
from pycomm.codec.groups import phase_groups
from pycomm.exchange import hierarchy as hier
from pycomm.hooks.ddp import (
    BucketLayout,
    CompressedState,
    HookState,
    accepts_dtype,
    exact_allreduce,
    per_bucket,
)
from pycomm.hooks.registry import hook_names, hook_spec, spec_identity
from pycomm.hooks.warmup import Warmup, timed, timed_allreduce

logger = logging.getLogger(__name__)


def choices() -> dict[str, tuple[type[HookState], Callable]]:
    """The hooks auto can run (registered with ``auto=True``), most exact first (the
    tie-break order): name -> (state class, hook function).

    Example:
        >>> list(choices())
        ['allreduce', 'bf16', 'fp16', 'int8', 'fp8', 'int4', 'onebit']
    """
    return {n: (hook_spec(n).state, hook_spec(n).hook) for n in hook_names(auto=True)}


def codec_of(hook: str) -> Optional[Codec]:
    """The codec hook ``hook`` runs at its defaults (None: the exact all-reduce)."""
    factory = hook_spec(hook).codec
    return None if factory is None else factory()


# the hooks that held their limit in the quality suite (benchmarks/README.md, "The limits")
DEFAULT_ALLOW = ("allreduce", "bf16", "fp16", "int8", "fp8", "int4")
_PROBE_MAX = 1 << 21
# the scalar measurements, all-reduced with MAX in this order
_MAXED = (
    "step_s", "forward_s", "exposed_s", "wire_s_per_byte", "latency_s", "intra_s_per_byte",
    "inter_s_per_byte",
)  # fmt: skip  # elements of the codec and link probes, at most


def check_allow(value: Any) -> tuple[str, ...]:
    """``allow`` as a tuple of hook names, or a ValueError naming the argument, the value and
    the valid names."""
    known = choices()
    valid = ", ".join(known)
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise ValueError(
            f"pycomm auto hook: allow={value!r}, expected a non-empty list of hook names "
            f"from: {valid}"
        )
    for name in value:
        if not isinstance(name, str) or name not in known:
            raise ValueError(
                f"pycomm auto hook: allow={list(value)!r} names {name!r}, which auto cannot "
                f"choose; valid names: {valid}"
            )
    return tuple(n for n in known if n in value)


def candidate_name(hook: str, hierarchy: str, hierarchies: Sequence[str]) -> str:
    """The label of a candidate in ``stats``: the hook, with ``-flat``/``-node`` when the
    hierarchy is being chosen too (the bench's names for them)."""
    return hook if len(hierarchies) == 1 and hierarchy == "flat" else f"{hook}-{hierarchy}"


def _exchange(
    hook: str, codec: Optional[Codec], n: int, ranks: int, codec_cost: dict[str, Sequence[float]]
) -> tuple[int, float, float, float]:
    """(bytes one rank sends, pre, mid, post seconds) of ``hook``'s exchange of n elements
    among ``ranks`` ranks, with its ``codec`` (None: the exact fp32 all-reduce)."""
    if codec is None:
        return ring_bytes(4 * n, ranks), 0.0, 0.0, 0.0
    enc, dec = codec_cost[hook]
    if not codec.two_phase:  # one all-reduce of the codes
        numel = max(1, math.ceil(n / codec.block)) * codec.block
        return ring_bytes(codec.code_bytes(numel), ranks), enc * n, 0.0, dec * n
    c = max(1, math.ceil(n / (ranks * codec.block))) * codec.block
    row = codec.code_bytes(c) + codec.scale_bytes(c)
    # encode the bucket; decode-sum N rows and re-encode the chunk; decode-sum N rows
    return 2 * (ranks - 1) * row, enc * ranks * c, dec * ranks * c + enc * c, dec * ranks * c


def predict(
    m: dict[str, Any], allow: Sequence[str], hierarchies: Sequence[str] = ("flat",)
) -> dict[str, float]:
    """Predicted seconds per step of every allowed hook (and hierarchy), from measurements
    ``m`` (the keys of the module's docstring). A pure function: no timing, no collective.

    Example:
        >>> m = {"step_s": 0.2, "exposed_s": 0.05, "ready_s": [0.05, 0.1], "numel": [2**20] * 2,
        ...      "wire_s_per_byte": 1e-8, "world_size": 2,
        ...      "codec_s_per_elem": {"bf16": (1e-9, 1e-9), "int8": (2e-9, 2e-9)}}
        >>> {k: round(v, 4) for k, v in predict(m, ["allreduce", "int8"]).items()}
        {'allreduce': 0.1919, 'int8': 0.1701}
    """
    ready, numel = list(m["ready_s"]), list(m["numel"])
    if len(ready) != len(numel) or not ready:
        raise ValueError("pycomm auto: measurements need one ready time per bucket")
    order = sorted(range(len(ready)), key=lambda b: ready[b])
    ready, numel = [ready[b] for b in order], [numel[b] for b in order]
    world, latency = int(m["world_size"]), float(m.get("latency_s", 0.0))
    codecs = m.get("codec_s_per_elem", {})
    base = float(m["step_s"]) - float(m["exposed_s"])
    out: dict[str, float] = {}
    for hook in allow:
        codec = codec_of(hook)
        calls = 1 if codec is None or not codec.two_phase else 2
        for h in hierarchies:
            finish, shift, end = 0.0, 0.0, 0.0
            for t, n in zip(ready, numel):
                if h == "node":
                    L, M = int(m["local_size"]), int(m["nodes"])
                    s = hier.shard_size(n, L)
                    nbytes, pre, mid, post = _exchange(hook, codec, s, M, codecs)
                    intra = 2 * (L - 1) * s * 4 * float(m["intra_s_per_byte"])
                    wire = nbytes * float(m["inter_s_per_byte"]) + intra + 3 * latency
                else:
                    nbytes, pre, mid, post = _exchange(hook, codec, n, world, codecs)
                    wire = nbytes * float(m["wire_s_per_byte"]) + calls * latency
                shift += pre
                start = max(t + shift, end)
                end = start + wire + mid
                finish = max(finish, end + post)
            finish = max(finish, ready[-1] + shift)
            out[candidate_name(hook, h, hierarchies)] = base + finish - ready[-1]
    return out


# A less exact candidate must be predicted this much faster to be chosen: the model leaves out
# what a compressed hook costs beyond its codecs and bytes (callbacks, buffers, cold caches),
# and a gain within the noise of a step is not worth the accuracy.
MARGIN = 0.05


def choose(predicted: dict[str, float], margin: float = MARGIN) -> str:
    """The first candidate of :func:`predict`'s result (the most exact: allreduce, bf16, fp16,
    int8, fp8, int4, onebit; flat before node) predicted within ``margin`` (a fraction) of
    the fastest.

    Example:
        >>> choose({"allreduce": 0.104, "int8": 0.100})
        'allreduce'
        >>> choose({"allreduce": 0.2, "int8": 0.1})
        'int8'
    """
    best = min(predicted.values())
    return next(name for name, t in predicted.items() if t <= best * (1 + margin) + 1e-12)


BUCKET_CAPS_MB = (1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 64.0)
FIRST_BUCKET_MB = 1.0  # DDP caps its first bucket (the last layers) at 1 MB


def rebucket(m: dict[str, Any], cap_mb: float) -> dict[str, Any]:
    """Measurements ``m`` as they would be with DDP buckets of ``cap_mb`` MB: the measured
    buckets' elements become ready evenly between the previous bucket's ready time and their
    own (from the start of backward for the first), and new buckets are cut from that curve
    at every ``cap_mb`` (the first at ``FIRST_BUCKET_MB`` at most) of fp32 gradients.
    A pure function, for :func:`advise_bucket_cap`.

    Example:
        >>> rebucket({"ready_s": [0.1, 0.2], "numel": [2**20, 2**20]}, 4.0)["numel"]
        [262144, 1048576, 835584]
    """
    order = sorted(range(len(m["ready_s"])), key=lambda b: m["ready_s"][b])
    points = [(0.0, 0)]  # (time, elements ready by then)
    for b in order:
        points.append((float(m["ready_s"][b]), points[-1][1] + int(m["numel"][b])))
    total = points[-1][1]
    cap = max(1, int(cap_mb * 2**20) // 4)
    cuts, edge = [], min(cap, max(1, int(FIRST_BUCKET_MB * 2**20) // 4))
    while edge < total:
        cuts.append(edge)
        edge += cap
    cuts.append(total)
    ready, numel, prev, j = [], [], 0, 1
    for c in cuts:
        while points[j][1] < c:
            j += 1
        (t0, e0), (t1, e1) = points[j - 1], points[j]
        ready.append(t0 + (t1 - t0) * (c - e0) / max(1, e1 - e0))
        numel.append(c - prev)
        prev = c
    return {**m, "ready_s": ready, "numel": numel}


def advise_bucket_cap(m: dict[str, Any], candidate: str) -> dict[str, float]:
    """Predicted seconds per step of ``candidate`` (a :func:`predict` label) with DDP buckets
    of each size in ``BUCKET_CAPS_MB`` (:func:`rebucket`): DDP takes its bucket size when it
    is built, so this is advice for the next run, not a change to this one.

    Example:
        >>> m = {"step_s": 0.2, "exposed_s": 0.05, "ready_s": [0.05, 0.1],
        ...      "numel": [2**20] * 2, "wire_s_per_byte": 1e-8, "world_size": 2}
        >>> {k: round(v, 3) for k, v in advise_bucket_cap(m, "allreduce").items()}
        {'1': 0.16, '2': 0.169, '4': 0.186, '8': 0.223, '16': 0.223, '25': 0.223, '64': 0.223}
    """
    hook, h = _split(candidate)
    return {
        f"{cap:g}": predict(rebucket(m, cap), [hook], (h,))[candidate_name(hook, h, (h,))]
        for cap in BUCKET_CAPS_MB
    }


def _split(name: str) -> tuple[str, str]:
    hook, _, h = name.partition("-")
    return hook, h or "flat"


class AutoState(HookState):
    """State of :func:`auto_hook`: measures the warm-up, decides, then holds the chosen
    hook's state (:attr:`chosen`) and hands every bucket to it.

    Options: ``allow`` (the hooks it may choose; default allreduce, bf16, fp16, int8, fp8,
    int4),
    ``hierarchy`` (``"auto"``: choose flat or node when the job spans several nodes with
    several ranks each; ``"flat"``, ``"node"``: that one), ``start_iter`` (exact, measured
    iterations before the decision; default 5, at least 2). The chosen hook runs at its
    defaults and continues from iteration ``start_iter`` (its own exact warm-up is done; onebit
    keeps to its own 20 exact iterations).

    ``stats["auto"]``: ``choice``, ``hierarchy``, ``decided_at`` (the iteration),
    ``measurements`` (after the MAX over ranks), ``predicted_s`` (every candidate's step time)
    and ``allow``; None before the decision.

    Example:
        >>> ddp = pycomm.wrap(model, hook="auto", hook_options={"allow": ["allreduce", "int8"]})
        >>> ...  # train a few steps
        >>> pycomm.hook_state(ddp).stats["auto"]["choice"]
        'int8'
    """

    hook_name = "auto"
    default_bucket_cap_mb = 8.0
    option_names = ("allow", "hierarchy", "start_iter")

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, **options: Any):
        self.allow, self.hierarchy, self.start_iter = self.check_options(options)
        self.iter = 0
        self.chosen: Optional[HookState] = None
        self._chosen_fn: Optional[Callable] = None
        self.decision: Optional[dict[str, Any]] = None
        self._params: Optional[list[torch.Tensor]] = None
        self._plan: Optional[hier.NodePlan] = None
        # per measured iteration: forward end, bucket ready and reduced times, numels
        self.warmup = Warmup()
        # DDP's buckets during the warm-up (and a checkpoint's): the layout the chosen hook
        # compresses in, so that a resume just before the decision re-buckets a fresh DDP
        self.bucket_layout = BucketLayout("pycomm auto hook", {})
        self.device = torch.device("cpu")
        self._dtypes: set[torch.dtype] = set()  # of the gradients: the candidates must take them
        self._group: Optional[dist.ProcessGroup] = None
        super().__init__(process_group)

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> tuple[tuple[str, ...], str, int]:
        """(allow, hierarchy, start_iter) from ``options``, or a ValueError naming the
        option, its value and what is valid (``pycomm.wrap`` checks before building DDP)."""
        unknown = sorted(set(options) - set(cls.option_names))
        if unknown:
            raise ValueError(
                f"pycomm auto hook: unknown option {unknown[0]!r}; valid options: "
                f"{', '.join(cls.option_names)}"
            )
        return (
            check_allow(options.get("allow", DEFAULT_ALLOW)),
            check_hierarchy("pycomm auto hook", options.get("hierarchy", "auto")),
            check_int("pycomm auto hook", "start_iter", options.get("start_iter", 5), 2),
        )

    def _bound(self) -> None:
        if self.world_size > 1:
            self._plan = hier.resolve("auto", self.process_group, self.hierarchy)
            # the warm-up, the probes and the decision run on a group of their own (the
            # compressed hooks' first phase group, shared with them), never on DDP's, where
            # DDP issues collectives of its own (bucket rebuilds, a new DDP's broadcasts)
            self._group = phase_groups(self.process_group).groups[0]

    def hierarchies(self) -> tuple[str, ...]:
        """The hierarchies the decision chooses among."""
        if self._plan is None:
            return ("flat",)
        return ("flat", "node") if self.hierarchy == "auto" else ("node",)

    def options(self) -> dict[str, Any]:
        return {
            "allow": list(self.allow),
            "hierarchy": self.hierarchy,
            "start_iter": self.start_iter,
        }

    def identity(self) -> dict[str, Any]:
        """The state class, and what each allowed candidate is on this rank: the ranks must
        agree on every hook auto may choose."""
        return {
            **super().identity(),
            **{f"auto candidate {h!r}": spec_identity(h) for h in self.allow},
        }

    def fingerprint(self) -> dict[str, Any]:
        fp = {**super().fingerprint(), "topology": hier.fingerprint(self._plan)}
        if self._params is not None:
            fp["parameters"] = [list(p.shape) for p in self._params]
        return fp

    def bind_parameters(self, params: list[torch.Tensor]) -> None:
        """The model's trainable parameters (handed on to the chosen hook: its own bucket
        layout, for bitwise resumes). ``pycomm.wrap`` calls it."""
        self._params = list(params)
        self.bucket_layout.bind(self._params)

    def expect_dtypes(self, dtypes: Sequence[torch.dtype]) -> None:
        """The gradient dtypes the model's buckets will have (``pycomm.register`` passes
        them; the warm-up adds what it sees): only allowed hooks that reduce every one of them
        are candidates. None left is a TypeError naming the dtypes and ``allow``."""
        self._dtypes.update(dtypes)
        self.candidates()

    def candidates(self) -> tuple[str, ...]:
        """The allowed hooks that reduce gradients of every dtype seen or expected."""
        fits = tuple(
            h for h in self.allow if all(accepts_dtype(hook_spec(h).state, d) for d in self._dtypes)
        )
        if not fits:
            raise TypeError(
                f"pycomm auto hook: no hook in allow={list(self.allow)} reduces gradients of "
                f"dtype {dtype_names(sorted(self._dtypes, key=str))}; expected allow to "
                "include one that does (allreduce reduces every floating dtype)"
            )
        return fits

    def forward_start(self) -> None:
        """Mark the start of a training forward (``pycomm.wrap`` registers it as a forward
        pre-hook), for the measurements."""
        if self.chosen is None and torch.is_grad_enabled():
            self.warmup.forward_start()

    def forward_done(self) -> None:
        """Mark the end of a training forward (``pycomm.wrap`` registers it as a forward hook):
        the start of backward, for the measurements."""
        if self.chosen is None and torch.is_grad_enabled():
            self.warmup.forward_done(self.iter)

    # --- the chosen hook ---------------------------------------------------------------

    @property
    def choice(self) -> Optional[str]:
        """The chosen hook's name (None before the decision)."""
        return None if self.decision is None else self.decision["choice"]

    def _make_chosen(self, decision: dict[str, Any]) -> None:
        hook, h = decision["choice"], decision["hierarchy"]
        spec = hook_spec(hook)
        cls, fn = spec.state, spec.hook
        state = cls(self.process_group, hierarchy=h)
        state.bind()
        if self._params is not None and hasattr(state, "bind_parameters"):
            state.bind_parameters(self._params)
            layout = getattr(state, "bucket_layout", None)
            seen = self.bucket_layout.saved()  # DDP's latest, after its first step
            if layout is not None and seen is not None:
                layout.load([list(k) for k in seen])
        if isinstance(state, CompressedState):
            state.iter = int(decision["decided_at"])  # its exact warm-up is done
        self.chosen, self._chosen_fn, self.decision = state, fn, decision

    def optimizer_advice(self, optimizer: Any) -> Optional[str]:
        return None if self.chosen is None else self.chosen.optimizer_advice(optimizer)

    def reduced_sqnorm(self) -> Optional[float]:
        return None if self.chosen is None else self.chosen.reduced_sqnorm()

    def scale_residuals(self, factor: float) -> None:
        if self.chosen is not None:  # (the warm-up measures exact all-reduces)
            self.chosen.scale_residuals(factor)

    @property
    def stats(self) -> dict[str, Any]:
        """The warm-up's counters plus the chosen hook's (its own stats, such as
        ``nonfinite_buckets``, too), and ``auto``: the decision (see the class docstring)."""
        out = dict(self._stats)
        if self.chosen is not None:
            inner = self.chosen.stats
            for key, value in inner.items():
                if key in ("steps", "buckets", "collectives", "bytes_sent", "bytes_fp32"):
                    out[key] = out.get(key, 0) + value
                elif key != "compression":
                    out[key] = value
            sent = out["bytes_sent"]
            out["compression"] = out["bytes_fp32"] / sent if sent else 1.0
        out["auto"] = None if self.decision is None else dict(self.decision)
        return out

    # --- measuring and deciding ----------------------------------------------------------

    def _measured(self) -> dict[str, Any]:
        """This rank's measurements (the module's docstring) over the measured iterations."""
        return self.warmup.measured(self.iter, self.world_size)

    def _probe(self, m: dict[str, Any]) -> None:
        """The one-time measurements (:func:`probe`) into ``m``."""
        probe(m, self.candidates(), self.device, self._group, self.world_size, self._plan)

    def decide(self, local: dict[str, Any]) -> dict[str, Any]:
        """Agree on the measurements (MAX over ranks) and take the decision; the same on every
        rank. A collective on the hook's group."""
        m = agree(local, self._group, self.world_size)
        if self._plan is not None:
            m["nodes"], m["local_size"] = self._plan.nodes, self._plan.local_size
        return decision_from(m, self.candidates(), self.hierarchies(), self.iter)

    def decide_now(self) -> None:
        """Measure, agree across ranks and build the chosen hook's state (every rank, at
        the same bucket: a collective)."""
        if self.world_size == 1:
            decision = decision_from(None, self.candidates(), ("flat",), self.iter)
        else:
            local = self._measured()
            self._probe(local)
            decision = self.decide(local)
        self._make_chosen(decision)
        self.warmup.reset()
        if self.rank == 0:
            log_decision(decision)

    # --- the hook's steps ---------------------------------------------------------------

    def due(self) -> bool:
        """Whether to decide at this bucket: at the first bucket of an iteration (where every
        rank has the same history; later in one, whether its first exchange has completed yet
        differs between ranks) once ``start_iter`` iterations ran and one was measured whole
        (a resume before the decision goes on with the checkpoint's records); at once on one
        rank."""
        if self.chosen is not None or self.warmup.started(self.iter):
            return False
        if self.world_size == 1:
            return True
        return self.iter >= self.start_iter and bool(self.warmup.measured_iters(self.iter))

    def run_chosen(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Hand ``bucket`` to the chosen hook (after the decision)."""
        if self.chosen is None or self._chosen_fn is None:
            raise RuntimeError("pycomm auto hook: run_chosen() before the decision")
        return self._chosen_fn(self.chosen, bucket)

    def measure_bucket(
        self, bucket: dist.GradBucket, x: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        """A warm-up bucket (its buffer ``x``): the exact all-reduce on auto's own group, its
        ready and reduced times recorded."""
        self.device = x.device
        self._dtypes.add(x.dtype)
        if self.bucket_layout.bound:
            self.bucket_layout.observe(bucket)
        done = self.warmup.bucket_ready(self.iter, x.numel())
        if self.bucket_layout.loaded:  # resumed: the checkpoint's buckets (DDP's once rebuilt),
            # so that with 3 ranks or more the fresh DDP's first step sums as the run would
            fut = self.bucket_layout.run(
                bucket, x, lambda b, t, _i: exact_allreduce(self, b, t, self._group)
            )
        else:
            fut = exact_allreduce(self, bucket, x, self._group)

        def reduced(f: torch.futures.Future) -> torch.Tensor:
            done.append(time.perf_counter())
            return f.value()

        return fut.then(reduced)

    def end_iteration(self) -> None:
        """After a warm-up iteration's last bucket."""
        self.iter += 1
        self.bucket_layout.end_step()

    # --- checkpoint ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        saved = self.bucket_layout.saved() if self.chosen is None else None
        return {
            **super().state_dict(),
            "stats": dict(self._stats),  # the warm-up's own; the chosen hook keeps its own
            "iter": self.iter,
            "decision": self.decision,
            "chosen": None if self.chosen is None else self.chosen.state_dict(),
            # before the decision, the warm-up's records: a resume decides when the
            # uninterrupted run does
            "warmup": self.warmup.state_dict() if self.chosen is None else None,
            "layout": None if saved is None else [list(k) for k in saved],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: with a decision, the chosen hook continues with its
        state (no new measurement). Another world size or topology is a ValueError."""
        super().load_state_dict(state)
        self.iter = int(state["iter"])
        self.warmup.reset()
        if state.get("decision") is None and state.get("warmup") is not None:
            self.warmup.load_state_dict(state["warmup"])
        if state.get("decision") is None:
            self.bucket_layout.load(state.get("layout"))
        self.chosen, self._chosen_fn, self.decision = None, None, None
        decision = state.get("decision")
        if decision is not None:
            self._make_chosen(dict(decision))
            self.chosen.load_state_dict(state["chosen"])


def probe(
    m: dict[str, Any],
    allow: Sequence[str],
    device: torch.device,
    group: Any,
    world_size: int,
    plan: Optional[hier.NodePlan],
) -> None:
    """The one-time measurements, into ``m``: each allowed codec's cost on ``device``, a
    collective's latency, the link's cost on an accelerator, each level's on several nodes.
    Collectives on ``group`` (and the plan's groups)."""
    n = min(max(m["numel"]), _PROBE_MAX)
    codecs = {h: codec_of(h) for h in allow}
    m["codec_s_per_elem"] = {
        h: codec_cost(c, n, device) for h, c in sorted(codecs.items()) if c is not None
    }
    x = torch.randn(n, device=device)
    # what a collective costs whatever its size: many small buckets pay it many times
    m["latency_s"] = timed_allreduce(torch.zeros(1, device=device), group)
    if device.type != "cpu":
        m["wire_s_per_byte"] = timed_allreduce(x, group) / ring_bytes(4 * n, world_size)
    if plan is not None:
        L, s = plan.local_size, hier.shard_size(n, plan.local_size)
        rows = torch.randn(L, s, device=device)
        out = torch.empty_like(rows)

        def intra() -> None:
            dist.all_to_all_single(out, rows, group=plan.intra.groups[0])

        m["intra_s_per_byte"] = timed(intra, device) / max(1, (L - 1) * s * 4)
        shard = rows[0].clone()
        m["inter_s_per_byte"] = timed_allreduce(shard, plan.cross.groups[0]) / max(
            1, ring_bytes(4 * s, plan.nodes)
        )


def agree(local: dict[str, Any], group: Any, world_size: int) -> dict[str, Any]:
    """This rank's measurements all-reduced with MAX over ``group`` (the slowest rank bounds
    the step): the same measurements on every rank. A collective."""
    keys = [k for k in _MAXED if k in local]
    flat = [float(local[k]) for k in keys] + [float(t) for t in local["ready_s"]]
    codecs = local.get("codec_s_per_elem", {})
    for f in sorted(codecs):
        flat += [float(v) for v in codecs[f]]
    t = torch.tensor(flat, dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    vals = t.tolist()
    m: dict[str, Any] = dict(zip(keys, vals[: len(keys)]))
    nb = len(local["ready_s"])
    m["ready_s"] = vals[len(keys) : len(keys) + nb]
    m["numel"] = list(local["numel"])
    rest = vals[len(keys) + nb :]
    m["codec_s_per_elem"] = {f: rest[2 * i : 2 * i + 2] for i, f in enumerate(sorted(codecs))}
    m["world_size"] = world_size
    return m


def decision_from(
    m: Optional[dict[str, Any]], allow: Sequence[str], hierarchies: Sequence[str], at: int
) -> dict[str, Any]:
    """The decision (``stats["auto"]``) from the agreed measurements ``m`` at iteration
    ``at``; ``m`` None: one rank, the exact all-reduce. A pure function.

    Example:
        >>> decision_from(None, ["allreduce", "int8"], ("flat",), 5)["choice"]
        'allreduce'
    """
    if m is None:
        return {
            "choice": "allreduce", "hierarchy": "flat", "decided_at": at, "measurements": None,
            "predicted_s": None, "allow": list(allow), "bucket_cap_mb_predicted_s": None,
            "bucket_cap_mb_best": None,
        }  # fmt: skip
    predicted = predict(m, allow, hierarchies)
    best = choose(predicted)
    hook, h = _split(best)
    caps = advise_bucket_cap(m, best)
    return {
        "choice": hook,
        "hierarchy": h,
        "decided_at": at,
        "measurements": m,
        "predicted_s": predicted,
        "allow": list(allow),
        # the chosen hook's predicted step time for other DDP bucket sizes (advice: DDP
        # cannot change its buckets once built), and the best of them
        "bucket_cap_mb_predicted_s": caps,
        "bucket_cap_mb_best": float(min(caps, key=lambda k: caps[k])),
    }


def log_decision(decision: dict[str, Any]) -> None:
    """Log the decision once (rank 0): the choice, every candidate's predicted step time, and
    a better DDP bucket size when one is predicted faster."""
    pred = decision["predicted_s"] or {}
    logger.info(
        "pycomm auto hook: chose %s (hierarchy %s) at iteration %d; predicted step times: %s",
        decision["choice"],
        decision["hierarchy"],
        decision["decided_at"],
        ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in pred.items()) or "one rank",
    )
    caps, now = decision["bucket_cap_mb_predicted_s"], pred.get(choose(pred)) if pred else 0
    if caps and min(caps.values()) < (1 - MARGIN) * now:
        cap = decision["bucket_cap_mb_best"]
        logger.info(
            "pycomm auto hook: %s is predicted %.1f ms per step faster with DDP buckets of "
            "%g MB (pass bucket_cap_mb=%g; DDP cannot change its buckets once built)",
            decision["choice"],
            (now - caps[f"{cap:g}"]) * 1e3,
            cap,
            cap,
        )


def codec_cost(codec: Codec, n: int, device: torch.device) -> tuple[float, float]:
    """(encode, decode-sum) seconds per element of ``codec`` on ``device``, timed on n
    elements, with an error-feedback residual (as the compressed hooks run by default).

    Example:
        >>> codec_cost(pycomm.hooks.Int8Codec(64), 1 << 20, torch.device("cpu"))
        (1.1e-09, 6e-10)
    """
    x = torch.randn(n, device=device)
    n_pad = max(1, math.ceil(n / codec.block)) * codec.block
    r, r_out = torch.zeros(n_pad, device=device), torch.empty(n_pad, device=device)
    out = torch.empty(n_pad, device=device)
    codes, scales = codec.encode(x, r, 1.0, n_pad, r_out)
    rows = codec.split(codec.pack(codes, scales, 1), n_pad)
    enc = timed(lambda: codec.encode(x, r, 1.0, n_pad, r_out), device)
    dec = timed(lambda: codec.decode_sum(rows[0], rows[1], 1.0, out), device)
    return enc / n, dec / n


def auto_hook(state: AutoState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The exact all-reduce, measured, for ``state.start_iter`` iterations; then, from the
    first bucket of the next one (where every rank takes the decision, see
    :class:`AutoState`), the chosen hook.

    Example:
        >>> ddp.register_comm_hook(AutoState(None, allow=["allreduce", "int8"]), auto_hook)
    """
    if state.due():
        state.decide_now()
    if state.chosen is not None:
        return state.run_chosen(bucket)
    # a sparse bucket is exact in every hook, so neither measured nor a candidate's
    return per_bucket(
        state, bucket, lambda x: state.measure_bucket(bucket, x), end=state.end_iteration,
        alone=False,
    )  # fmt: skip
