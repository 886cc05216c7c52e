"""``python -m pycomm.bench.quality --local-sgd``: the outer loops' held-out loss against DDP's.

The task (``--task``): the character-level GPT of the quality suite (``charlm``: Python's
documentation text, 2 x 64, 110K parameters, AdamW at lr 3e-3, each rank its own random
windows), or its Friedman #1 regression (``friedman``: an MLP of 69K parameters, AdamW at lr
3e-4, each rank its own fresh draws); gradients clipped at 1. A warm start of ``--warmup``
steps averages the parameters exactly every step (``LocalSGD(sync_every=1,
codec="allreduce")``), then each variant trains to ``--steps`` in all. DDP
(``pycomm.wrap(hook="allreduce")``) trains every step. After the last step every variant
syncs, and the held-out loss (the same on every rank) is compared with DDP's of the same seed
(when ``ddp`` is among ``--variants``), and each variant synced through a codec with the same
loop synced exactly (:func:`exact_of`).

    python -m pycomm.bench.quality --local-sgd                       # 2 ranks, 2 seeds
    python -m pycomm.bench.quality --local-sgd --nprocs 4 --json out.json
    python -m pycomm.bench.quality --local-sgd --nprocs 4 --nodes 2  # DDP inside each node
    python -m pycomm.bench.quality --local-sgd --task friedman --seeds 0,1,2 \
        --variants diloco-m02-H50,diloco-m02-H50-exact,diloco-m02-H50-int8

Variants (:data:`VARIANTS`): ``-exact`` syncs exactly, ``-int8`` through int8, ``-b32``
through int4 with blocks of 32, ``-noef`` through int4 without error feedback, the others
through int4 (blocks of 128, error feedback); ``diloco-m02`` is DiLoCo with outer Nesterov SGD
at lr 0.8 and momentum 0.2, ``diloco`` its default (lr 0.7, momentum 0.9).

With ``--nodes M`` the ranks are M nodes (``pycomm.init(nodes=M)``): each variant trains DDP
over its node's ranks (``pycomm.node_group()``) and syncs the outer loop across the nodes
(``pycomm.cross_node_group()``), the run across slow links of docs/slow-links.md; DDP, the
baseline, trains over every rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from typing import Any, Callable, Optional

import torch

import pycomm
from pycomm.bench.quality_tasks import (
    TASKS,
    batches,
    build_model,
    docs_text,
    evaluate,
    friedman_data,
    loss_of,
)


@dataclasses.dataclass(frozen=True)
class Outer:
    """One outer-loop variant: the loop (``"LocalSGD"`` or ``"DiLoCo"``), H, fragments, delay,
    the exchange's codec and its options (``hook_options``), and DiLoCo's outer optimizer:
    ``nesterov=(lr, momentum)``, Nesterov SGD at that rate and momentum (None: the class's
    own, lr 0.7 and momentum 0.9)."""

    loop: str
    h: int = 50
    fragments: int = 1
    delay: int = 0
    codec: str = "int4"
    options: tuple[tuple[str, Any], ...] = ()
    nesterov: Optional[tuple[float, float]] = None

    def build(self, model: torch.nn.Module, group: Any) -> pycomm.DiLoCo:
        """The outer loop on ``model``, syncing over ``group``."""
        common: dict[str, Any] = dict(
            codec=self.codec, fragments=self.fragments, delay=self.delay,
            process_group=group, hook_options=dict(self.options) or None,
        )  # fmt: skip
        if self.loop == "LocalSGD":
            return pycomm.LocalSGD(model, self.h, **common)
        return pycomm.DiLoCo(model, self.h, outer_optimizer=self._outer_optimizer(), **common)

    def _outer_optimizer(self) -> Optional[Callable[[list], torch.optim.Optimizer]]:
        if self.nesterov is None:
            return None
        lr, momentum = self.nesterov

        def make(params: list) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)

        return make


# DiLoCo's outer Nesterov SGD at lr 0.8, momentum 0.2 (docs/slow-links.md, "int4 against
# exact syncs")
_M02 = (0.8, 0.2)
# name -> its outer loop; None: DDP every step
VARIANTS: dict[str, Optional[Outer]] = {
    "ddp": None,
    "localsgd-H50": Outer("LocalSGD"),
    "localsgd-H50-exact": Outer("LocalSGD", codec="allreduce"),
    "localsgd-H50-F4": Outer("LocalSGD", fragments=4),
    "localsgd-H50-F4-d1": Outer("LocalSGD", fragments=4, delay=1),
    "diloco-H50": Outer("DiLoCo"),
    "diloco-H50-exact": Outer("DiLoCo", codec="allreduce"),
    # int4's options and int8, against the same loop's exact syncs
    "localsgd-H50-b32": Outer("LocalSGD", options=(("block", 32),)),
    "localsgd-H50-int8": Outer("LocalSGD", codec="int8"),
    "localsgd-H50-noef": Outer("LocalSGD", options=(("error_feedback", False),)),
    "diloco-H50-b32": Outer("DiLoCo", options=(("block", 32),)),
    "diloco-H50-int8": Outer("DiLoCo", codec="int8"),
    # DiLoCo with outer Nesterov SGD at lr 0.8, momentum 0.2
    "diloco-m02-H50": Outer("DiLoCo", nesterov=_M02),
    "diloco-m02-H50-exact": Outer("DiLoCo", codec="allreduce", nesterov=_M02),
    "diloco-m02-H50-b32": Outer("DiLoCo", options=(("block", 32),), nesterov=_M02),
    "diloco-m02-H50-int8": Outer("DiLoCo", codec="int8", nesterov=_M02),
    "diloco-m02-H50-noef": Outer("DiLoCo", options=(("error_feedback", False),), nesterov=_M02),
}
DEFAULT_VARIANTS = (
    "ddp", "localsgd-H50", "localsgd-H50-exact", "localsgd-H50-F4", "localsgd-H50-F4-d1",
    "diloco-H50", "diloco-H50-exact",
)  # fmt: skip
LOCAL_SGD_TASKS = ("charlm", "friedman")


def exact_of(name: str) -> Optional[str]:
    """The variant that is ``name`` with exact syncs (codec "allreduce", no options), if
    ``name`` syncs through a codec and that variant exists.

    Example:
        >>> exact_of("diloco-m02-H50-b32")
        'diloco-m02-H50-exact'
    """
    v = VARIANTS.get(name)
    if v is None or v.codec == "allreduce":
        return None
    exact = dataclasses.replace(v, codec="allreduce", options=())
    return next((n for n, w in VARIANTS.items() if w == exact), None)


def run_rank(
    names: list[str], seeds: list[int], steps: int, warmup: int, nodes: int = 1,
    task_name: str = "charlm",
) -> dict:  # fmt: skip
    """Each variant's held-out loss per seed (the same on every rank)."""
    torch.set_num_threads(1)
    inner = cross = None
    if nodes > 1:
        pycomm.init(nodes=nodes)
        inner, cross = pycomm.node_group(), pycomm.cross_node_group()
    task = dataclasses.replace(TASKS[task_name], steps=steps)
    vocab = 0
    if task.kind == "friedman":
        data: Any = friedman_data()
    else:
        train, held, vocab = docs_text()
        data = (train, held)
    out: dict[str, list[float]] = {n: [] for n in names}
    for seed in seeds:
        for name in names:
            torch.manual_seed(seed)
            model = build_model(task, vocab)
            v = VARIANTS[name]
            net: Any = model
            if v is None:
                net = pycomm.wrap(model, hook="allreduce")
            elif inner is not None:
                net = pycomm.wrap(model, hook="allreduce", process_group=inner)
            opt = torch.optim.AdamW(net.parameters(), lr=task.lr["adamw"], weight_decay=0.01)
            outer: Any = _NoOuter()
            if v is not None:  # the warm start: the parameters averaged exactly every step
                outer = pycomm.LocalSGD(model, sync_every=1, codec="allreduce", process_group=cross)
            for step, batch in enumerate(batches(task, data, steps, seed)):
                if v is not None and step == warmup:  # the warm start ends: the variant's
                    outer = v.build(model, cross)
                opt.zero_grad()
                loss_of(task, net, batch).backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                outer.step()
            outer.sync()
            out[name].append(evaluate(task, model, data))
    return out


class _NoOuter:
    """DDP's stand-in for an outer loop: nothing to step or sync."""

    def step(self) -> None:
        pass

    def sync(self) -> None:
        pass


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m pycomm.bench.quality --local-sgd``."""
    ap = argparse.ArgumentParser(
        prog="python -m pycomm.bench.quality --local-sgd",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--task", default="charlm", choices=LOCAL_SGD_TASKS)
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps in all")
    ap.add_argument("--warmup", type=int, default=200, help="steps averaged every step first")
    ap.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="nodes of --nprocs/--nodes ranks: DDP inside, the outer loop across",
    )
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated (ddp, when named, is the baseline); of {', '.join(VARIANTS)}",
    )
    ap.add_argument("--json", default=None)
    return ap


def parse(ap: argparse.ArgumentParser, argv: list[str]) -> tuple[Any, list[str], list[int]]:
    """``argv`` parsed and checked by ``ap`` (``ap.error`` on a bad value): the arguments,
    the variants' names and the seeds."""
    args = ap.parse_args(argv)
    names = list(dict.fromkeys(args.variants.split(",")))
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names:
        ap.error(f"--variants {args.variants}: expected some of {', '.join(VARIANTS)}")
    if not 0 <= args.warmup < args.steps:
        ap.error(f"--warmup {args.warmup}: expected 0 <= warmup < --steps {args.steps}")
    if args.nodes < 1 or args.nprocs % args.nodes:
        ap.error(f"--nodes {args.nodes}: expected a divisor of --nprocs {args.nprocs}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds {args.seeds}: expected comma-separated integers")
    return args, names, seeds


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, names, seeds = parse(parser(), argv)
    res = pycomm.launch(run_rank, args.nprocs, names, seeds, args.steps, args.warmup,
                        args.nodes, args.task, timeout=7200)[0]  # fmt: skip
    rows = rows_of(res)
    where = f" as {args.nodes} nodes (DDP inside)" if args.nodes > 1 else ""
    lr = TASKS[args.task].lr["adamw"]
    unit = "nats/char" if args.task == "charlm" else "mean squared error"
    print(f"{args.task}, {args.nprocs} ranks{where}, {args.steps} steps ({args.warmup} "
          f"averaged every step first), AdamW {lr:g}, seeds {args.seeds}: held-out loss "
          f"({unit})")  # fmt: skip
    print(f"{'variant':<22}{'loss per seed':>30}{'vs ddp':>10}{'vs exact':>10}")
    for n, r in rows.items():
        each = " / ".join(f"{x:.4f}" for x in r["loss"])
        print(f"{n:<22}{each:>30}{_percent(r.get('vs_ddp'))}{_percent(r.get('vs_exact'))}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=1)
    return 0


def _percent(x: Optional[float]) -> str:
    return f"{x * 100:>9.2f}%" if x is not None else f"{'-':>10}"


def rows_of(res: dict[str, list[float]]) -> dict[str, Any]:
    """Each variant's losses, and the mean over seeds of its relative difference from DDP's
    (when DDP ran) and, for a variant synced through a codec, from the same variant synced
    exactly (:func:`exact_of`, when it ran) of the same seed: ``vs_ddp``, ``vs_exact``, and
    each seed's in ``vs_exact_each``."""
    rows: dict[str, Any] = {}
    for n, losses in res.items():
        r: dict[str, Any] = {"loss": losses}
        if "ddp" in res:
            r["vs_ddp"] = statistics.mean(x / d - 1 for x, d in zip(losses, res["ddp"]))
        exact = res.get(exact_of(n) or "")
        if exact:
            r["vs_exact_each"] = [x / e - 1 for x, e in zip(losses, exact)]
            r["vs_exact"] = statistics.mean(r["vs_exact_each"])
        rows[n] = r
    return rows
