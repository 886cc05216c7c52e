"""``python -m pycomm.bench.quality --local-sgd``: the outer loops' held-out loss against DDP's.

The task: the character-level GPT of the quality suite (``charlm``: Python's documentation
text, 2 x 64, 110K parameters), AdamW at lr 3e-3, each rank its own random windows, gradients
clipped at 1. A warm start of ``--warmup`` steps averages the parameters exactly every step
(``LocalSGD(sync_every=1, codec="allreduce")``), then each variant trains to ``--steps`` in
all. DDP (``pycomm.wrap(hook="allreduce")``) trains every step. After the last step every
variant syncs, and the held-out loss (nats per character, the same on every rank) is compared
with DDP's of the same seed, and each int4 variant with the same run synced exactly.

    python -m pycomm.bench.quality --local-sgd                       # 2 ranks, 2 seeds
    python -m pycomm.bench.quality --local-sgd --nprocs 4 --json out.json
    python -m pycomm.bench.quality --local-sgd --nprocs 4 --nodes 2  # DDP inside each node

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
from typing import Any, Optional

import torch

import pycomm
from pycomm.bench.quality_tasks import TASKS, batches, build_model, docs_text, evaluate, loss_of

# name -> (class, H, fragments, delay, codec); None: DDP every step
VARIANTS: dict[str, Optional[tuple]] = {
    "ddp": None,
    "localsgd-H50": ("LocalSGD", 50, 1, 0, "int4"),
    "localsgd-H50-exact": ("LocalSGD", 50, 1, 0, "allreduce"),
    "localsgd-H50-F4": ("LocalSGD", 50, 4, 0, "int4"),
    "localsgd-H50-F4-d1": ("LocalSGD", 50, 4, 1, "int4"),
    "diloco-H50": ("DiLoCo", 50, 1, 0, "int4"),
    "diloco-H50-exact": ("DiLoCo", 50, 1, 0, "allreduce"),
}


def run_rank(names: list[str], seeds: list[int], steps: int, warmup: int, nodes: int = 1) -> dict:
    """Each variant's held-out loss per seed (the same on every rank)."""
    torch.set_num_threads(1)
    inner = cross = None
    if nodes > 1:
        pycomm.init(nodes=nodes)
        inner, cross = pycomm.node_group(), pycomm.cross_node_group()
    task = dataclasses.replace(TASKS["charlm"], steps=steps)
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
                    kind, h, f, d, codec = v
                    cls = pycomm.LocalSGD if kind == "LocalSGD" else pycomm.DiLoCo
                    outer = cls(model, sync_every=h, codec=codec, fragments=f, delay=d,
                                process_group=cross)  # fmt: skip
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


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="python -m pycomm.bench.quality --local-sgd",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps in all")
    ap.add_argument("--warmup", type=int, default=200, help="steps averaged every step first")
    ap.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="nodes of --nprocs/--nodes ranks: DDP inside, the outer loop across",
    )
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad or "ddp" not in names:
        ap.error(f"--variants {args.variants}: expected ddp and some of {', '.join(VARIANTS)}")
    if not 0 <= args.warmup < args.steps:
        ap.error(f"--warmup {args.warmup}: expected 0 <= warmup < --steps {args.steps}")
    if args.nodes < 1 or args.nprocs % args.nodes:
        ap.error(f"--nodes {args.nodes}: expected a divisor of --nprocs {args.nprocs}")
    seeds = [int(s) for s in args.seeds.split(",")]
    res = pycomm.launch(run_rank, args.nprocs, names, seeds, args.steps, args.warmup,
                        args.nodes, timeout=7200)[0]  # fmt: skip
    rows = rows_of(res)
    where = f" as {args.nodes} nodes (DDP inside)" if args.nodes > 1 else ""
    print(f"charlm, {args.nprocs} ranks{where}, {args.steps} steps ({args.warmup} averaged "
          f"every step first), AdamW 3e-3, seeds {args.seeds}: held-out loss "
          "(nats/char)")  # fmt: skip
    print(f"{'variant':<22}{'loss per seed':>22}{'vs ddp':>10}{'vs exact':>10}")
    for n, r in rows.items():
        each = " / ".join(f"{x:.4f}" for x in r["loss"])
        vs_exact = r.get("vs_exact")
        print(f"{n:<22}{each:>22}{r['vs_ddp'] * 100:>9.2f}%"
              + (f"{vs_exact * 100:>9.2f}%" if vs_exact is not None else f"{'-':>10}"))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=1)
    return 0


def rows_of(res: dict[str, list[float]]) -> dict[str, Any]:
    """Each variant's losses, and the mean over seeds of its relative difference from DDP's
    (and, for an int4 variant, from the same variant synced exactly) of the same seed."""
    rows: dict[str, Any] = {}
    for n, losses in res.items():
        r: dict[str, Any] = {"loss": losses}
        r["vs_ddp"] = statistics.mean(x / d - 1 for x, d in zip(losses, res["ddp"]))
        exact = res.get(f"{n}-exact")
        if exact:
            r["vs_exact"] = statistics.mean(x / e - 1 for x, e in zip(losses, exact))
        rows[n] = r
    return rows
