"""Per-rank side of ``python -m pycomm.bench``: the hooks it knows, and the training loop that
times them side by side (one DDP model per hook, hooks interleaved step by step).

Each rank also measures, on the last ``error_steps`` timed steps, every hook's relative L2 error
against the exact fp32 mean gradient: a plain copy of the model, loaded with the hook model's
parameters as they were before the step, runs the same micro-batches, and its local gradients
are summed over ranks with an fp32 all-reduce (untimed).

A per-step deadline turns a hang into a failure that costs seconds: around every hook's setup
and step, :func:`faulthandler.dump_traceback_later` is armed, so a rank stuck in a collective
dumps its stack into its stderr file and exits; the parent blames the hook it was in.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import os
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm
from pycomm.bench.hooks import compute_hook, wire_state
from pycomm.bench.link import lo_tx_bytes, tx_bytes
from pycomm.bench.models import ModelSpec, batches, build, count_params, loss_fn
from pycomm.bench.nodes import uplink
from pycomm.codec.engine import ring_bytes
from pycomm.dist import all_gather_objects
from pycomm.hooks.registry import import_modules

COMPUTE = "compute"  # the bucket comes back untouched: no communication at all
BASELINE = "ddp"  # plain DDP, no hook: torch's own reduction


def is_user_hook(name: str) -> bool:
    """Whether ``name`` is ``module:factory``, a hook of the caller's own (see
    :func:`user_hook_factory`)."""
    return ":" in name


def user_hook_factory(name: str) -> Callable[[], tuple[Any, Callable]]:
    """The factory that ``module:factory`` names: called with no arguments on every rank, it
    returns the ``(state, hook)`` pair to register on the bench's DDP model, as
    ``ddp.register_comm_hook(state, hook)`` takes them. Raises ValueError naming what is wrong.

    Example:
        >>> state, hook = user_hook_factory("mypkg.hooks:make_topk")()
    """
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--hooks: {name!r}, expected module:factory (both parts)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to see
        raise ValueError(
            f"--hooks: {name!r}: cannot import module {module_name!r} ({type(exc).__name__}: "
            f"{exc}); expected an importable module (run from where it imports, or set "
            "PYTHONPATH)"
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(
            f"--hooks: {name!r}: module {module_name!r} has no callable {attr!r}; expected a "
            "function that returns (state, hook)"
        )
    return factory


# torch's own hooks, registered the way a user would: name -> (description, factory of
# (state, hook)); PowerSGD from iteration 2 so that the warm-up steps reach compression.
TORCH_HOOKS: dict[str, tuple[str, Callable[[], tuple[Any, Callable]]]] = {
    "torch-allreduce": (
        "torch allreduce_hook",
        lambda: (None, default_hooks.allreduce_hook),
    ),
    "torch-fp16": (
        "torch fp16_compress_hook",
        lambda: (None, default_hooks.fp16_compress_hook),
    ),
    "torch-powersgd1": (
        "torch powerSGD_hook, rank 1",
        lambda: (
            torch_powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2),
            torch_powersgd.powerSGD_hook,
        ),
    ),
    "torch-powersgd4": (
        "torch powerSGD_hook, rank 4",
        lambda: (
            torch_powersgd.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2),
            torch_powersgd.powerSGD_hook,
        ),
    ),
}

# Diagnostics: a compressed hook's two-phase exchange, bytes and buckets as the hook's, without
# its codecs (pycomm.bench.hooks.WireOnlyCodec). Step time minus compute's is the exchange's
# cost; the hook's own time minus this one's is its codecs'. Gradients are not reduced.
WIRE_HOOKS: dict[str, str] = {"int8-wire": "int8", "onebit-wire": "onebit"}

# Options for pycomm hooks whose defaults would not show them working within a benchmark's
# few steps (torch's PowerSGD only compresses from iteration 1000 by default, onebit from 20).
PYCOMM_OPTIONS: dict[str, dict[str, Any]] = {
    "powersgd": {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
    "onebit": {"start_iter": 2},
}

# pycomm hooks with a non-default option, side by side with the defaults: name -> (hook, options)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "int8-bf16res": ("int8", {"residual_dtype": "bfloat16"}),
    "onebit-bf16res": ("onebit", {"residual_dtype": "bfloat16", "start_iter": 2}),
}

# hierarchy="node" and "flat" side by side, for --nodes (the plain names run "auto"); not in
# --hooks all, since "node" is refused on one node
NODE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    f"{hook}-{h}": (hook, {"hierarchy": h})
    for hook in ("allreduce", "bf16", "int8", "onebit")
    for h in ("node", "flat")
}


def _hook_and_options(name: str) -> tuple[str, Optional[dict[str, Any]]]:
    """The pycomm.wrap hook and options that bench hook ``name`` stands for."""
    if name in VARIANTS:
        return VARIANTS[name]
    if name in NODE_VARIANTS:
        return NODE_VARIANTS[name]
    return name, PYCOMM_OPTIONS.get(name)


# pycomm's powersgd is torch's PowerSGD delegated: torch-powersgd1 already stands for it in
# the default set.
_NOT_DEFAULT = {"powersgd"}


def pycomm_hooks() -> list[str]:
    """pycomm's hook names, read from the registry now (hooks get added): allreduce first.

    Example:
        >>> pycomm_hooks()[:2]
        ['allreduce', 'bf16']
    """
    from pycomm.hooks import hook_names

    return sorted(hook_names(), key=lambda name: (name != "allreduce", name))


def registered_descriptions() -> dict[str, str]:
    """The one-line descriptions of the hooks registered outside pycomm, by name."""
    from pycomm.hooks import hook_names, hook_spec

    specs = [hook_spec(n) for n in hook_names()]
    return {s.name: s.description for s in specs if not s.module.startswith("pycomm.")}


def available_hooks() -> list[str]:
    """Every hook the benchmark can run (``--hooks all``).

    Example:
        >>> available_hooks()[:2]
        ['compute', 'ddp']
    """
    return [COMPUTE, BASELINE, *TORCH_HOOKS, *pycomm_hooks(), *VARIANTS, *WIRE_HOOKS]


def default_hooks_set() -> list[str]:
    """compute, ddp, all of torch's hooks, and pycomm's own hooks but its delegated PowerSGD.

    Example:
        >>> "torch-powersgd4" in default_hooks_set()
        True
    """
    return [
        COMPUTE,
        BASELINE,
        *TORCH_HOOKS,
        *(h for h in pycomm_hooks() if h not in _NOT_DEFAULT),
    ]


def is_pycomm(name: str) -> bool:
    """Whether ``name`` runs through :func:`pycomm.wrap` (and its accumulate stage)."""
    return not is_user_hook(name) and name not in (COMPUTE, BASELINE, *TORCH_HOOKS, *WIRE_HOOKS)


def reduces(name: str) -> bool:
    """Whether hook ``name`` averages the gradients (compute and the wire diagnostics do not)."""
    return name != COMPUTE and name not in WIRE_HOOKS


def describe(name: str, accumulate_steps: int = 1) -> str:
    """One line on what the benchmark runs under ``name``.

    Example:
        >>> describe("torch-fp16")
        'torch fp16_compress_hook'
    """
    if name == COMPUTE:
        return "no communication (the bucket is returned untouched): compute only"
    if name == BASELINE:
        text = "plain DDP, no hook"
    elif name in TORCH_HOOKS:
        text = TORCH_HOOKS[name][0]
    elif is_user_hook(name):
        doc = (user_hook_factory(name).__doc__ or "").strip().splitlines()
        return f"your hook {name}" + (f": {doc[0]}" if doc else "")
    elif name in WIRE_HOOKS:
        return (
            f"pycomm {WIRE_HOOKS[name]} hook's exchange without its codecs: the wire and gloo "
            "alone (gradients not reduced)"
        )
    else:
        hook, options = _hook_and_options(name)
        text = f"pycomm {hook} hook" + (f" {options}" if options else "")
        if hook in registered_descriptions():
            text += f": {registered_descriptions()[hook]}"
        if accumulate_steps > 1:
            return f"{text}, wrap(accumulate_steps={accumulate_steps})"
    if accumulate_steps > 1:
        text += f", no_sync() on {accumulate_steps - 1} of {accumulate_steps} micro-steps"
    return text


def _build(
    name: str, module: torch.nn.Module, cap: Optional[float], accumulate_steps: int
) -> tuple[DDP, Any]:
    """The DDP model for hook ``name`` (buckets of ``cap`` MB, None: the hook's default) and
    the state its byte count is read from."""
    kw = {} if cap is None else {"bucket_cap_mb": cap}
    if name in WIRE_HOOKS:
        from pycomm.hooks import compressed_hook, hook_spec

        cls = hook_spec(WIRE_HOOKS[name]).state
        if cap is None and cls.default_bucket_cap_mb is not None:
            kw["bucket_cap_mb"] = cls.default_bucket_cap_mb  # as pycomm.wrap builds the hook's
        ddp = DDP(module, gradient_as_bucket_view=True, **kw)
        state = wire_state(cls(None, error_feedback=False, start_iter=2))
        ddp.register_comm_hook(state, compressed_hook)
        return ddp, state
    if not is_pycomm(name):
        factory = user_hook_factory(name) if is_user_hook(name) else None
        pair = factory() if factory is not None else None  # may raise: a failed setup
        ddp = DDP(module, **kw)
        state: Any = None
        if name == COMPUTE:
            ddp.register_comm_hook(None, compute_hook)
        elif pair is not None:
            state, hook = pair
            ddp.register_comm_hook(state, hook)
        elif name in TORCH_HOOKS:
            state, hook = TORCH_HOOKS[name][1]()
            ddp.register_comm_hook(state, hook)
        return ddp, state
    ddp = pycomm.wrap(
        module,
        hook=_hook_and_options(name)[0],
        accumulate_steps=accumulate_steps,
        hook_options=_hook_and_options(name)[1],
        **kw,
    )
    return ddp, pycomm.hook_state(ddp)


def _counters(state: Any) -> dict[str, float]:
    """Cumulative bytes sent as the hook itself counts them, where it does."""
    if isinstance(state, torch_powersgd.PowerSGDState):
        # fp32 elements all-reduced while compressing (P, Q and the uncompressed tensors)
        return {"elements": float(state.total_numel_after_compression)}
    if state is not None and hasattr(state, "stats"):
        return {"bytes": float(state.stats["bytes_sent"])}
    return {}


def _bytes_per_step(
    name: str, params: int, world: int, before: dict, after: dict, steps: int
) -> tuple[Optional[float], str]:
    """Bytes one rank puts on the wire per optimizer step, and where that number comes from."""
    if name == COMPUTE or world == 1:
        return 0.0, "no communication"
    if name in (BASELINE, "torch-allreduce"):
        return float(ring_bytes(params * 4, world)), "fp32 ring all-reduce of every parameter"
    if name == "torch-fp16":
        return float(ring_bytes(params * 2, world)), "fp16 ring all-reduce of every parameter"
    if "elements" in after:
        elements = (after["elements"] - before.get("elements", 0.0)) / max(steps, 1)
        return (
            float(ring_bytes(int(elements * 4), world)),
            "ring all-reduce of the elements torch's PowerSGDState counts",
        )
    if "bytes" in after and steps > 0:
        return (after["bytes"] - before.get("bytes", 0.0)) / steps, "hook stats (bytes_sent)"
    return None, "unknown"


class _Progress:
    """Where this rank is, in a file the parent reads: for its progress bar, and when a launch
    fails (a rank killed by a gloo abort or by its deadline reports nothing else). The text
    ends with ``done/total`` work units (hook setups and hook steps)."""

    def __init__(self, path: Optional[str], total: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if path else None
        self.done, self.total = 0, total

    def __call__(self, text: str) -> None:
        if self.fd is not None:
            line = f"{text} {self.done}/{self.total}"
            os.pwrite(self.fd, line.encode().ljust(128)[:128], 0)


class _Deadline:
    """Arms faulthandler around one setup or step: past the deadline the rank dumps every
    thread's stack to stderr and exits, so that a hung collective costs seconds.

    The deadline is ``max(floor_s, 5 x the slowest step seen) + 3 x comm_s`` (comm_s: the time
    the fp32 gradient takes over the shaped link), so that big models and slow links are not
    mistaken for hangs, times ``factor`` (2 when the guard also covers the error measurement,
    itself a step and an fp32 all-reduce). Setups and each hook's first step get at least
    ``COLD_S``: first calls import modules lazily (DDP pulls in torch._dynamo), which takes
    seconds on a loaded machine, so the very first step is not taken as the scale either;
    torch's PowerSGD only starts compressing, and hanging, at iteration 2.
    """

    COLD_S = 60.0

    def __init__(self, floor_s: float, comm_s: float) -> None:
        self.floor_s, self.comm_s, self.slowest = floor_s, comm_s, 0.0

    def seconds(self, cold: bool = False, factor: float = 1.0) -> float:
        floor = max(self.floor_s, self.COLD_S) if cold else self.floor_s
        return (max(floor, 5 * self.slowest) + 3 * self.comm_s) * factor

    def observe(self, seconds: float) -> None:
        self.slowest = max(self.slowest, seconds)

    @contextlib.contextmanager
    def guard(self, cold: bool = False, factor: float = 1.0):
        seconds = self.seconds(cold, factor)
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


def _capture_stderr(path: str) -> None:
    """Send this rank's fd 2 to ``path``: what gloo prints before it aborts (and faulthandler's
    stacks) is kept there for the parent's failure report."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def _flat_grads(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
            for p in module.parameters()
            if p.requires_grad
        ]
    )


def _rank_device(cfg: dict[str, Any], rank: int) -> torch.device:
    """This rank's device: the CPU, or a GPU (ranks spread over the visible GPUs, several ranks
    sharing one when there are more ranks than GPUs; with NCCL each rank has its own)."""
    if cfg.get("device", "cpu") != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def run_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train one model per hook, interleaving the hooks step by step (the order rotates each
    step); every rank's per-step times and process CPU times, bytes per step, gradient errors
    and, when ``measure_lo``, what crossed this namespace's ``lo`` during each step.

    ``cfg``: ``model`` (ModelSpec fields), ``hooks``, ``steps``, ``warmup``, ``threads``,
    ``bucket_cap_mb``, ``accumulate_steps``, ``error_steps``, ``step_timeout``, ``comm_s``,
    ``measure_lo``, ``device`` ("cpu" or "cuda"), ``workdir`` (progress and stderr files for
    the parent). On a GPU a step is timed until the device has finished it, and each hook's
    peak GPU memory during its steps is kept.

    Example:
        >>> pycomm.launch(run_rank, 2, {"model": {"width": 16, "layers": 2}, "hooks": ["ddp"],
        ...                             "steps": 2, "warmup": 1})
    """
    import_modules(cfg.get("imports", ()))  # the modules registering the caller's hooks
    run = _RankRun(cfg)
    failed = run.build_hooks()
    run.train()
    return run.results(failed)


class _Measured:
    """What :func:`run_rank` measures of one hook, one entry per timed step (errors: per
    checked step)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.wire: list[int] = []
        self.uplink: list[int] = []
        self.errors: list[float] = []
        self.gpu_peak = 0
        self.before: dict[str, float] = {}  # the state's counters when timing starts


class _RankRun:
    """:func:`run_rank`'s steps on one rank: set up (files, deadline, device), build a model
    per hook and drop the hooks that failed anywhere, train them interleaved, report."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.spec = ModelSpec(**cfg.get("model", {}))
        self.hooks: list[str] = list(cfg["hooks"])
        self.steps, self.warmup = cfg["steps"], cfg.get("warmup", 0)
        self.accumulate = cfg.get("accumulate_steps", 1)
        self.error_steps = min(cfg.get("error_steps", 0), self.steps)
        self.bucket_cap_mb = cfg.get("bucket_cap_mb")
        self.workdir = cfg.get("workdir")
        if self.workdir:
            _capture_stderr(self._file("stderr"))
        self.progress = _Progress(
            self._file("progress") if self.workdir else None,
            len(self.hooks) * (1 + self.warmup + self.steps),
        )
        self.deadline = _Deadline(cfg.get("step_timeout", 10.0), cfg.get("comm_s", 0.0))
        if cfg.get("threads"):
            torch.set_num_threads(cfg["threads"])
        self.device = _rank_device(cfg, self.rank)
        self.on_gpu = self.device.type == "cuda"
        # every rank takes the same barriers; rank 0 reads the counters of lo, and with
        # several nodes every node's first rank its uplink's
        self.measure_lo = bool(cfg.get("measure_lo"))
        self.reads_lo = self.measure_lo and self.rank == 0
        self.nodes = cfg.get("nodes", 1) > 1
        self.up = uplink() if self.nodes else None
        self.models: dict[str, DDP] = {}
        self.states: dict[str, Any] = {}

    def _file(self, kind: str) -> str:
        return os.path.join(self.workdir, f"rank{self.rank}.{kind}")

    def build_hooks(self) -> dict[str, str]:
        """A DDP model per hook; returns the hooks whose setup failed on some rank, with the
        first error and where, and drops them on every rank (so that the collectives of the
        rest still line up)."""
        setup_errors: dict[str, str] = {}
        for name in self.hooks:
            self.progress(f"setup {name}")
            with self.deadline.guard(cold=True):
                try:
                    model = build(self.spec).to(self.device)
                    self.models[name], self.states[name] = _build(
                        name, model, self.bucket_cap_mb, self.accumulate
                    )
                except Exception as exc:  # reported as this hook's failure; the others go on
                    setup_errors[name] = f"{type(exc).__name__}: {exc}".strip()
            self.progress.done += 1
        failed = _failed_anywhere(setup_errors, self.world)
        self.hooks = [h for h in self.hooks if h not in failed]
        self.progress.total = self.progress.done + len(self.hooks) * (self.warmup + self.steps)
        self.opts = {n: torch.optim.SGD(self.models[n].parameters(), lr=1e-3) for n in self.hooks}
        self.ref = build(self.spec).to(self.device) if self.error_steps and self.hooks else None
        g = torch.Generator().manual_seed(self.rank)
        self.data = [
            (x.to(self.device), y.to(self.device))
            for x, y in batches(self.spec, self.accumulate, g)
        ]
        self.measured = {name: _Measured() for name in self.hooks}
        return failed

    def _backward(self, model: torch.nn.Module, batch) -> None:
        loss = loss_fn(self.spec, model, batch)
        (loss / self.accumulate if self.accumulate > 1 else loss).backward()

    def one_step(self, name: str) -> None:
        """One optimizer step: ``accumulate`` micro-steps, the loss scaled by 1/k each."""
        model = self.models[name]
        self.opts[name].zero_grad(set_to_none=False)
        for k, batch in enumerate(self.data):
            sync = k == self.accumulate - 1 or is_pycomm(name)
            with contextlib.nullcontext() if sync else model.no_sync():
                self._backward(model, batch)
        self.opts[name].step()

    def rel_error(self, name: str) -> float:
        """||reduced - exact|| / ||exact||; ``ref`` holds the parameters before the step."""
        self.ref.zero_grad(set_to_none=False)
        for batch in self.data:
            self._backward(self.ref, batch)
        exact = _flat_grads(self.ref)
        dist.all_reduce(exact)
        exact /= self.world
        got = _flat_grads(self.models[name].module)
        return float((got - exact).norm() / exact.norm().clamp_min(1e-30))

    def train(self) -> None:
        """``warmup + steps`` rounds, each one step of every hook in a rotating order; a line
        per timed round in the rounds file, what the parent keeps if a later step kills the
        launch."""
        rounds = (
            os.open(self._file("rounds"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            if self.workdir
            else None
        )
        for step in range(self.warmup + self.steps):
            if step == self.warmup:
                for name in self.hooks:
                    self.measured[name].before = _counters(self.states[name])
            for i in range(len(self.hooks)):
                self._hook_step(step, i)
            if step >= self.warmup and rounds is not None:
                times = {n: self.measured[n].times[-1] for n in self.hooks}
                os.write(rounds, (json.dumps({"step": step, "times": times}) + "\n").encode())
        self.progress("barrier at the end")
        dist.barrier()
        self.progress("done")

    def _hook_step(self, step: int, i: int) -> None:
        """Round ``step``'s i-th hook: its step, timed from a common barrier, then (when timed)
        its traffic and (on the checked steps) its gradient error."""
        name = self.hooks[(i + step) % len(self.hooks)]
        timed = step >= self.warmup
        check = step >= self.warmup + self.steps - self.error_steps and reduces(name)
        m = self.measured[name]
        with self.deadline.guard(cold=step == 0, factor=2.0 if check else 1.0):
            if check:
                with torch.no_grad():
                    for p_ref, p in zip(
                        self.ref.parameters(), self.models[name].module.parameters()
                    ):
                        p_ref.copy_(p)
            self.progress(f"barrier before {name}")
            dist.barrier()
            lo0 = lo_tx_bytes() if self.reads_lo and timed else 0
            up0 = tx_bytes(self.up) if self.up and timed else 0
            self.progress(f"step {name} {step}")
            dt, dc = self._timed(name)
            if timed and (self.measure_lo or self.nodes or check):
                self.progress(f"barrier after {name}")
                dist.barrier()  # the step's traffic ends when every rank is done
                if self.reads_lo:
                    m.wire.append(lo_tx_bytes() - lo0)
                if self.up:
                    m.uplink.append(tx_bytes(self.up) - up0)
            if check:
                self.progress(f"error of {name}")
                m.errors.append(self.rel_error(name))
        if step > 0 or i > 0:  # the rank's first step also pays for lazy imports
            self.deadline.observe(dt)
        if timed:
            m.times.append(dt)
            m.cpu.append(dc)
        self.progress.done += 1

    def _timed(self, name: str) -> tuple[float, float]:
        """One step of ``name``: its wall time (on a GPU until the device has run it) and the
        CPU time of the whole process (gloo's threads and the hooks' callbacks too: where ranks
        share cores, what a hook costs beyond the wire)."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0, c0 = time.perf_counter(), time.process_time()
        self.one_step(name)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            m = self.measured[name]
            m.gpu_peak = max(m.gpu_peak, torch.cuda.max_memory_allocated(self.device))
        return time.perf_counter() - t0, time.process_time() - c0

    def results(self, failed: dict[str, str]) -> dict[str, Any]:
        params = count_params(self.spec)
        return {
            "rank": self.rank,
            "params": params,
            "hooks": {name: self._result(name, params) for name in self.hooks},
            "setup_failures": failed,
        }

    def _result(self, name: str, params: int) -> dict[str, Any]:
        m = self.measured[name]
        sent, source = _bytes_per_step(
            name, params, self.world, m.before, _counters(self.states[name]), self.steps
        )
        return {
            "times_s": m.times,
            "cpu_s": m.cpu,
            "bytes_per_step": sent,
            "bytes_source": source,
            "lo_bytes": m.wire if self.reads_lo else None,
            "uplink_bytes": m.uplink if self.up else None,
            "rel_errors": m.errors,
            "bucket_sizes": _bucket_sizes(self.models[name]),
            # on a GPU: the most memory allocated during this hook's steps (every hook's model
            # stays resident, so the differences between hooks are what each one adds)
            "gpu_peak_bytes": m.gpu_peak if self.on_gpu else None,
            # hook="auto": what it chose, from which measurements and predictions
            "auto": _auto_decision(self.states[name]),
        }


def _failed_anywhere(setup_errors: dict[str, str], world: int) -> dict[str, str]:
    """Every rank's setup errors, gathered: each failed hook's first error, and on which
    ranks when not on all of them."""
    gathered = all_gather_objects(setup_errors, None, "pycomm.bench (the hooks' setup)")
    where: dict[str, list[int]] = {}
    failed: dict[str, str] = {}
    for r, errors in enumerate(gathered):
        for name, text in errors.items():
            failed.setdefault(name, text)
            where.setdefault(name, []).append(r)
    for name, ranks in where.items():
        if len(ranks) < world:
            failed[name] += f" (on rank {', '.join(map(str, ranks))} of {world})"
    return failed


def _bucket_sizes(model: DDP) -> list[int]:
    """DDP's bucket sizes (after its rebuild, if any); a private API, so a nicety: [] when it
    fails."""
    try:
        data = model._get_ddp_logging_data()
        buckets = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
    except Exception:
        buckets = ""
    return [int(b) for b in buckets.split(",") if b.strip().isdigit()]


def _auto_decision(state: Any) -> Optional[dict[str, Any]]:
    """The decision of a pycomm ``auto`` hook state, else None."""
    if getattr(state, "hook_name", None) != "auto":
        return None
    return state.stats["auto"]
