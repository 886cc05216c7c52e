"""The quality suite's tasks and its per-rank training loop (``python -m pycomm.bench.quality``).

Real data that needs no download: scikit-learn's digits (1797 8x8 images, 10 classes; an MLP,
test accuracy on 360 held-out images) and the text of Python's own documentation
(``pydoc_data.topics``, about 465K characters of English; a character-level GPT, held-out
cross-entropy in nats per character on the last 10% of the text). And a regression drawn
fresh each step, Friedman's first function with noise (an MLP, mean squared error on 4096
held-out draws; :func:`friedman`).

Every hook trains the same model from the same initial weights on the same batches, one after
the other, on every rank; the exact all-reduce is the reference.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pycomm
from pycomm.bench.models import GPT, ModelSpec
from pycomm.hooks.registry import import_modules
from pycomm.topology import set_nodes

DEFAULT_HOOKS = ("allreduce", "fp16", "bf16", "int8", "onebit", "powersgd")
HOOKS = (
    *DEFAULT_HOOKS,
    "fp8",
    "int4",
    "onebit-local",
    "int8-nolocal",
    "int8-noef",
    "int8-warm20",
    "int8-b256",
    "int4-b32",
    "int4-b64",
    "int4-b32-bf16",
    "int4-b64-bf16",
    "int4-b128-bf16",
    "int8-ef",  # under --fsdp
    "int8-ef-bf16",
    "ag-int8",  # under --fsdp: the parameter all-gather through a codec
    "ag-fp8",
    "int8-ag-int8",
)
REFERENCE = "allreduce"


def all_hooks() -> tuple[str, ...]:
    """Every name ``--hooks`` takes: the built-in ones and variants above, then every other
    registered hook (pycomm.hooks.register_hook; read now, hooks get added).

    Example:
        >>> all_hooks()[:3]
        ('allreduce', 'fp16', 'bf16')
    """
    from pycomm.hooks import hook_names

    return tuple(dict.fromkeys([*HOOKS, *hook_names()]))


OPTIMIZERS = ("sgd", "adamw", "sgd-plain")
DEFAULT_OPTIMIZERS = ("sgd", "adamw")  # sgd-plain: only when named

# Options the suite gives a hook instead of its defaults: torch's PowerSGD compresses only
# from iteration 1000 by default, beyond every task here; on gloo it aborts with several
# buckets (their callbacks issue the collectives in a different order on each rank), so it gets
# one bucket.
HOOK_OPTIONS: dict[str, dict[str, Any]] = {
    "powersgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 10},
}
ONE_BUCKET_MB = 1024.0
# Named variants, run only when asked for: (hook, options). onebit-local: error feedback on
# each rank's own gradient as well (phase 1), compressed from iteration 2; the int8 ones, what
# was measured before int8's block became 64 (benchmarks/README.md, "int8's block of 64").
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "onebit-local": ("onebit", {"local_feedback": True, "start_iter": 2}),
    "int8-nolocal": ("int8", {"local_feedback": False}),
    "int8-noef": ("int8", {"error_feedback": False}),
    "int8-warm20": ("int8", {"start_iter": 20}),
    "int8-b256": ("int8", {"block": 256}),
    # int4's block and scale dtype (its default: block 128, fp32 scales)
    "int4-b32": ("int4", {"block": 32}),
    "int4-b64": ("int4", {"block": 64}),
    "int4-b32-bf16": ("int4", {"block": 32, "scale_dtype": "bfloat16"}),
    "int4-b64-bf16": ("int4", {"block": 64, "scale_dtype": "bfloat16"}),
    "int4-b128-bf16": ("int4", {"block": 128, "scale_dtype": "bfloat16"}),
    # under --fsdp, where error feedback is off by default (pycomm.fsdp)
    "int8-ef": ("int8", {"error_feedback": True}),
    "int8-ef-bf16": ("int8", {"error_feedback": True, "residual_dtype": "bfloat16"}),
    # under --fsdp: the all-gather's codec (pycomm.fsdp.compress(all_gather=...)), with the
    # exact reduce-scatter (its effect alone) or int8's (int8 both ways)
    "ag-int8": ("allreduce", {"all_gather": "int8"}),
    "ag-fp8": ("allreduce", {"all_gather": "fp8"}),
    "int8-ag-int8": ("int8", {"all_gather": "int8"}),
}
# hooks that have no FSDP2 reduce-scatter (--fsdp refuses them), and variants of FSDP2 alone
NOT_FSDP = ("powersgd", "onebit-local", "int8-nolocal")
FSDP_ONLY = ("ag-int8", "ag-fp8", "int8-ag-int8")

# How far a hook's mean may fall behind the exact all-reduce's, at its defaults: accuracy
# points (tasks measured in accuracy) and a relative loss (tasks measured in loss).
LIMITS: dict[str, tuple[float, float]] = {
    "fp16": (0.5, 0.01),
    "bf16": (0.5, 0.01),
    "int8": (0.5, 0.01),
    "onebit": (1.0, 0.03),
    "onebit-local": (1.0, 0.03),
    "int8-nolocal": (0.5, 0.01),
    "int8-noef": (0.5, 0.01),
    "int8-warm20": (0.5, 0.01),
    "int8-b256": (0.5, 0.01),
    "fp8": (0.5, 0.01),
    "int4": (0.5, 0.01),
    "int4-b32": (0.5, 0.01),
    "int4-b64": (0.5, 0.01),
    "int4-b32-bf16": (0.5, 0.01),
    "int4-b64-bf16": (0.5, 0.01),
    "int4-b128-bf16": (0.5, 0.01),
    "int8-ef": (0.5, 0.01),
    "int8-ef-bf16": (0.5, 0.01),
    "ag-int8": (0.5, 0.01),
    "ag-fp8": (0.5, 0.01),
    "int8-ag-int8": (0.5, 0.01),
}


@dataclasses.dataclass(frozen=True)
class Task:
    """One case of the suite: data, model, training length, bucket size and learning rates.

    ``bucket_mb`` None: each hook's default bucket size (what ``pycomm.wrap`` picks).
    ``steps``: digits, epochs over each rank's shard; charlm and friedman, optimizer steps.
    """

    name: str
    kind: str  # "digits", "charlm" or "friedman"
    description: str
    steps: int
    quick_steps: int
    batch: int
    lr: dict[str, float]
    widths: tuple[int, ...] = ()
    bucket_mb: Optional[float] = None
    d_model: int = 64
    layers: int = 2
    seq_len: int = 64
    max_grad_norm: Optional[float] = None

    @property
    def metric(self) -> str:
        return "accuracy" if self.kind == "digits" else "loss"


_WIDE = Task(
    "digits-wide",
    "digits",
    "digits, MLP 64-512-512-10 (300K params), each hook's default buckets (one)",
    steps=8,
    quick_steps=4,
    batch=16,
    lr={"sgd": 0.05, "adamw": 1e-3},
    widths=(512, 512),
)
TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        dataclasses.replace(
            _WIDE,
            name="digits-small",
            description="digits, MLP 64-128-10 (9.6K params), one bucket",
            lr={"sgd": 0.05, "adamw": 2e-3},
            widths=(128,),
        ),
        _WIDE,
        dataclasses.replace(
            _WIDE,
            name="digits-wide-split",
            description="digits, MLP 64-512-512-10 (300K params), 0.25 MB buckets (5)",
            bucket_mb=0.25,
        ),
        Task(
            "charlm",
            "charlm",
            "Python docs text, char GPT 2x64 (110K params), 0.1 MB buckets (5)",
            steps=150,
            quick_steps=80,
            batch=16,
            lr={"sgd": 0.3, "adamw": 3e-3},
            bucket_mb=0.1,
            max_grad_norm=1.0,
        ),
        Task(
            "friedman",
            "friedman",
            "Friedman #1 regression, noise sd 1, MLP 10-256-256-1 (69K params), one bucket",
            steps=2000,
            quick_steps=300,
            batch=32,
            lr={"sgd": 0.01, "adamw": 3e-4},
            widths=(256, 256),
        ),
    )
}
DEFAULT_TASKS = ("digits-small", "digits-wide-split", "charlm")
QUICK_TASKS = ("digits-wide-split", "charlm")


def check_names(what: str, names: list[str], valid: tuple[str, ...]) -> list[str]:
    """``names`` if every one is in ``valid``, else a ValueError naming the first stranger and
    listing the valid ones.

    Example:
        >>> check_names("hook", ["int8"], HOOKS)
        ['int8']
    """
    if not names:
        raise ValueError(f"no {what} given; valid: {', '.join(valid)}")
    for name in names:
        if name not in valid:
            raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(valid)}")
    return list(dict.fromkeys(names))


# --- data --------------------------------------------------------------------------------


def digits_data() -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): 1437 / 360 images, a fixed permutation, features
    standardized with the training statistics."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    train, test = slice(0, 1437), slice(1437, None)
    mu, sd = x[train].mean(0), x[train].std(0) + 1e-3
    x = (x - mu) / sd
    return x[train], y[train], x[test], y[test]


def docs_text() -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train ids, held-out ids, vocabulary size): the text of ``pydoc_data.topics`` (topics
    in sorted order), characters as ids, the last 10% held out."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    cut = len(ids) * 9 // 10
    return ids[:cut], ids[cut:], len(chars)


# Friedman #1: y = 10 sin(pi x1 x2) + 20 (x3 - 1/2)^2 + 10 x4 + 5 x5 + noise, x uniform on
# [0, 1]^10 (x6..x10 unused), standardized by the noiseless target's mean and sd over that
# distribution (sampled: 14.42, 4.88)
FRIEDMAN_INPUTS, FRIEDMAN_NOISE = 10, 1.0
_FRIEDMAN_MEAN, _FRIEDMAN_SD = 14.42, 4.88


def friedman(n: int, g: torch.Generator, noise: float = FRIEDMAN_NOISE) -> tuple[torch.Tensor, ...]:
    """(x, y): ``n`` draws of Friedman's first regression problem from ``g``, the target
    standardized (noise of sd ``noise`` before it; 0: the noiseless function).

    Example:
        >>> x, y = friedman(4, torch.Generator().manual_seed(0))
        >>> x.shape, y.shape
        (torch.Size([4, 10]), torch.Size([4]))
    """
    x = torch.rand(n, FRIEDMAN_INPUTS, generator=g)
    y = (
        10 * torch.sin(torch.pi * x[:, 0] * x[:, 1])
        + 20 * (x[:, 2] - 0.5) ** 2
        + 10 * x[:, 3]
        + 5 * x[:, 4]
    )
    if noise:
        y = y + noise * torch.randn(n, generator=g)
    return x, (y - _FRIEDMAN_MEAN) / _FRIEDMAN_SD


def friedman_data() -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): the held-out set, 4096 draws with the training's noise, so its mean squared
    error has a floor of about the noise's variance (1 / 4.88^2 = 0.042); every rank the same,
    the training batches drawn fresh (:func:`batches`)."""
    return friedman(4096, torch.Generator().manual_seed(2**31 - 1))


# --- models --------------------------------------------------------------------------------


def build_model(task: Task, vocab: int = 0) -> torch.nn.Module:
    if task.kind in ("digits", "friedman"):
        mods: list[torch.nn.Module] = []
        width, out = (64, 10) if task.kind == "digits" else (FRIEDMAN_INPUTS, 1)
        for w in task.widths:
            mods += [torch.nn.Linear(width, w), torch.nn.ReLU()]
            width = w
        return torch.nn.Sequential(*mods, torch.nn.Linear(width, out))
    spec = ModelSpec(
        "transformer", layers=task.layers, d_model=task.d_model, heads=4, seq_len=task.seq_len,
        vocab=vocab,
    )  # fmt: skip
    model = GPT(spec)
    for m in model.modules():  # GPT-2's initialization (the default N(0, 1) embeddings
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):  # start at a loss of ~30)
            torch.nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            torch.nn.init.zeros_(m.bias)
    return model


def make_optimizer(name: str, params, lr: dict[str, float]) -> torch.optim.Optimizer:
    """The task's optimizer ``name`` at its learning rate. sgd-plain (no momentum) takes
    sgd's rate: at 3x and 10x (momentum 0.9's effective step) the exact all-reduce itself
    trained worse on charlm (benchmarks/README.md, "int8's block of 64")."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr["sgd"], momentum=0.9)
    if name == "sgd-plain":
        return torch.optim.SGD(params, lr=lr["sgd"])
    return torch.optim.AdamW(params, lr=lr["adamw"], weight_decay=0.01)


# --- one rank --------------------------------------------------------------------------------


class _Progress:
    """Rank 0's tqdm bar over every optimizer step of the launch (nothing on other ranks)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and dist.get_rank() == 0:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", desc="quality", leave=False)

    def update(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _curve(losses: list[float], points: int = 40) -> list[float]:
    """The training loss averaged over ``points`` equal windows of steps."""
    n = len(losses)
    points = min(points, n)
    return [
        sum(losses[i * n // points : (i + 1) * n // points])
        / max(1, (i + 1) * n // points - i * n // points)
        for i in range(points)
    ]


def batches(task: Task, data, length: int, seed: int):
    """The rank's micro-batches: digits, ``length`` epochs, a reshuffle of its shard each;
    charlm, ``length`` batches of random windows of the training text; friedman, ``length``
    batches drawn fresh (noisy targets). The same for every hook; every rank the same count."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if task.kind == "friedman":
        for _ in range(length):
            yield friedman(task.batch, g)
        return
    if task.kind == "digits":
        xtr, ytr = data[0][rank::world], data[1][rank::world]
        per_epoch = len(data[0]) // world // task.batch
        for _ in range(length):
            order = torch.randperm(len(xtr), generator=g)
            for s in range(per_epoch):
                idx = order[s * task.batch : (s + 1) * task.batch]
                yield xtr[idx], ytr[idx]
        return
    train = data[0]
    for _ in range(length):
        starts = torch.randint(len(train) - task.seq_len - 1, (task.batch,), generator=g)
        window = starts[:, None] + torch.arange(task.seq_len + 1)
        seq = train[window]
        yield seq[:, :-1], seq[:, 1:]


def loss_of(task: Task, model, batch) -> torch.Tensor:
    x, y = batch
    out = model(x)
    if task.kind == "friedman":
        return F.mse_loss(out.squeeze(-1), y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(task: Task, model: torch.nn.Module, data) -> float:
    """Digits: test accuracy in percent; charlm: mean held-out cross-entropy over 64 windows
    spread evenly over the held-out text; friedman: mean squared error on the held-out draws
    (:func:`friedman_data`)."""
    model.eval()
    try:
        if task.kind == "digits":
            return (model(data[2]).argmax(1) == data[3]).float().mean().item() * 100
        if task.kind == "friedman":
            return loss_of(task, model, data).item()
        held = data[1]
        starts = torch.linspace(0, len(held) - task.seq_len - 2, 64).long()
        seq = held[starts[:, None] + torch.arange(task.seq_len + 1)]
        return loss_of(task, model, (seq[:, :-1], seq[:, 1:])).item()
    finally:
        model.train()


def _train_fsdp(task, data, vocab, hook, optimizer, seed, steps, progress, label, nodes=1):
    """The same run under FSDP2 (each block and the root ``fully_shard``-ed): ``allreduce``
    is FSDP2's own reduction over every rank (the reference), every other hook
    :func:`pycomm.fsdp.compress`'s, on each node's mesh (HSDP) when ``nodes`` > 1; the loop
    clips as TrainLoop does."""
    import pycomm.fsdp
    from pycomm.bench.fsdp import shard

    torch.manual_seed(seed)
    mesh = pycomm.fsdp.node_mesh() if nodes > 1 and hook != REFERENCE else None
    model = shard(build_model(task, vocab), mesh)
    comm = None
    if hook != REFERENCE:
        name, options = VARIANTS.get(hook, (hook, HOOK_OPTIONS.get(hook)))
        options = dict(options or {})
        gather = options.pop("all_gather", None)
        comm = pycomm.fsdp.compress(model, hook=name, hook_options=options, all_gather=gather)
    opt = make_optimizer(optimizer, model.parameters(), task.lr)
    losses = []
    for batch in batches(task, data, steps, seed):
        loss = loss_of(task, model, batch)
        loss.backward()
        if task.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), task.max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        progress.update(label)
    value = evaluate(task, model, data)
    model.reshard()  # the root keeps its parameters gathered after a forward without backward
    with torch.no_grad():
        checksum = float(sum(p.full_tensor().double().sum() for p in model.parameters()))
    return {
        "value": value,
        "curve": _curve(losses),
        "compression": comm.stats["compression"] if comm is not None else 1.0,
        "checksum": checksum,
        "warning": None,
    }


def _train_one(task, data, vocab, hook, optimizer, seed, steps, progress, label):
    torch.manual_seed(seed)
    model = build_model(task, vocab)
    kwargs: dict[str, Any] = {}
    if hook == "powersgd":
        kwargs["bucket_cap_mb"] = ONE_BUCKET_MB
    elif task.bucket_mb is not None:
        kwargs["bucket_cap_mb"] = task.bucket_mb
    name, options = VARIANTS.get(hook, (hook, HOOK_OPTIONS.get(hook)))
    ddp = pycomm.wrap(model, hook=name, hook_options=options, **kwargs)
    opt = make_optimizer(optimizer, ddp.parameters(), task.lr)
    with warnings.catch_warnings(record=True) as caught:  # kept in the record, not printed
        warnings.simplefilter("always")
        loop = pycomm.TrainLoop(ddp, opt, max_grad_norm=task.max_grad_norm)
    losses = []
    for batch in batches(task, data, steps, seed):
        losses.append(loop.step(lambda b=batch: loss_of(task, ddp, b)).item())
        progress.update(label)
    value = evaluate(task, model, data)
    stats = pycomm.hook_state(ddp).stats
    # a checksum of the parameters: the parent checks that every rank ends with the same model
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    return {
        "value": value,
        "curve": _curve(losses),
        "compression": stats.get("compression"),
        "checksum": checksum,
        "warning": str(caught[0].message) if caught else None,
    }


def task_steps(task: Task, quick: bool, world: int) -> int:
    """Optimizer steps of one run of ``task`` on ``world`` ranks."""
    n = task.quick_steps if quick else task.steps
    if task.kind == "digits":
        return n * (1437 // world // task.batch)
    return n


def run_rank(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Train every (task, optimizer, seed, hook) of ``plan`` on this rank; one record each.

    ``plan``: ``tasks``, ``optimizers``, ``hooks`` (names), ``seeds`` (ints), ``quick``,
    ``threads``, ``progress``, ``fsdp`` (train under FSDP2 instead of DDP), ``nodes`` (with
    ``fsdp``: the ranks as that many nodes, the hooks HSDP on them).

    Example:
        >>> pycomm.launch(run_rank, 4, {"tasks": ["digits-small"], "optimizers": ["sgd"],
        ...               "hooks": ["allreduce", "int8"], "seeds": [0], "quick": True})
    """
    torch.set_num_threads(plan.get("threads", 1))
    nodes = plan.get("nodes", 1)
    if nodes > 1:
        set_nodes(nodes)  # pycomm.topology(): the ranks as nodes, for node_mesh()
    import_modules(plan.get("imports", ()))  # the modules registering the caller's hooks
    world = dist.get_world_size()
    tasks = [TASKS[t] for t in plan["tasks"]]
    runs = len(plan["optimizers"]) * len(plan["seeds"]) * len(plan["hooks"])
    total = runs * sum(task_steps(t, plan["quick"], world) for t in tasks)
    progress = _Progress(total, plan.get("progress", False))
    records = []
    try:
        for task in tasks:
            if task.kind == "digits":
                data, vocab = digits_data(), 0
            elif task.kind == "friedman":
                data, vocab = friedman_data(), 0
            else:
                train, held, vocab = docs_text()
                data = (train, held)
            n = task.quick_steps if plan["quick"] else task.steps
            for optimizer in plan["optimizers"]:
                for seed in plan["seeds"]:
                    for hook in plan["hooks"]:
                        label = f"{task.name} {optimizer} seed {seed} {hook}"
                        args = (task, data, vocab, hook, optimizer, seed, n, progress, label)
                        if plan.get("fsdp"):
                            rec = _train_fsdp(*args, nodes=nodes)
                        else:
                            rec = _train_one(*args)
                        rec.update(task=task.name, optimizer=optimizer, seed=seed, hook=hook)
                        records.append(rec)
    finally:
        progress.close()
        if nodes > 1:
            set_nodes(None)
    return records
