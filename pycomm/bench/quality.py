"""``python -m pycomm.bench.quality``: train real tasks with every hook side by side on 4 local
ranks (gloo) and report each hook's final metric against the exact all-reduce, over several
seeds (mean and spread), with SGD with momentum and with AdamW.

    python -m pycomm.bench.quality                      # the full suite (three tasks)
    python -m pycomm.bench.quality --quick              # two tasks, shorter runs
    python -m pycomm.bench.quality --tasks charlm --hooks allreduce,onebit --seeds 5
    python -m pycomm.bench.quality --json out.json --plot out.png

Tasks (see --list-tasks): scikit-learn's digits with two MLP sizes and bucket sizes (test
accuracy, %), and a character-level GPT on the text of Python's documentation
(``pydoc_data.topics``; held-out loss, nats per character). Each hook runs at its defaults
(pycomm.wrap's), except torch's PowerSGD (rank 2 from iteration 10, one bucket: on gloo it
aborts with several). Variants, run only when named in --hooks: onebit-local (onebit with
local_feedback=True and start_iter=2: error feedback on each rank's own gradient too),
int8-nolocal (local_feedback=False), int8-noef (error_feedback=False), int8-warm20
(start_iter=20) and int8-b256 (block=256, the earlier default).
"(warns)": pycomm.TrainLoop warned that the hook is known to fall behind with the optimizer.
"vs allreduce" is the mean over seeds of each seed's difference from
the exact all-reduce of the same seed (the same initial weights and batches); a hook with a
limit passes when that mean stays within it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Optional

import torch

import pycomm
from pycomm.bench.args import (
    RANK_RUNTIME_BYTES,
    add_import_argument,
    available_memory,
    check_memory,
    check_output_paths,
    positive_int,
    timeout_seconds,
)
from pycomm.bench.quality_tasks import (
    DEFAULT_HOOKS,
    DEFAULT_OPTIMIZERS,
    DEFAULT_TASKS,
    FSDP_ONLY,
    HOOK_OPTIONS,
    HOOKS,
    LIMITS,
    NOT_FSDP,
    OPTIMIZERS,
    QUICK_TASKS,
    REFERENCE,
    TASKS,
    VARIANTS,
    all_hooks,
    check_names,
    run_rank,
)
from pycomm.hooks.registry import import_modules, user_modules


def _names(what: str, valid: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        try:
            return check_names(what, [t.strip() for t in text.split(",") if t.strip()], valid)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


_ALL, _QUICK = ",".join(DEFAULT_TASKS), ",".join(QUICK_TASKS)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m pycomm.bench.quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--tasks",
        type=_names("task", tuple(TASKS)),
        default=None,
        help=f"comma-separated; default: all ({_ALL}); --quick: {_QUICK}",
    )
    ap.add_argument(
        "--hooks",
        type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
        default=list(DEFAULT_HOOKS),
        help=f"comma-separated; {REFERENCE} (the reference) is always run; default: "
        f"{','.join(DEFAULT_HOOKS)}; also: {','.join(h for h in HOOKS if h not in DEFAULT_HOOKS)}"
        ", and any registered hook (see --import)",
    )
    add_import_argument(ap)
    ap.add_argument(
        "--optimizers",
        type=_names("optimizer", OPTIMIZERS),
        default=list(DEFAULT_OPTIMIZERS),
        help="comma-separated: sgd (momentum 0.9), adamw (weight decay 0.01), sgd-plain (no "
        "momentum, sgd's learning rate); default: sgd,adamw",
    )
    ap.add_argument("--seeds", type=positive_int, default=3, help="seeds 0..N-1; default 3")
    ap.add_argument("--quick", action="store_true", help="shorter training, two tasks")
    ap.add_argument("--nprocs", type=positive_int, default=4, help="local ranks (gloo); default 4")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank; 1")
    ap.add_argument("--json", metavar="PATH", help="write every run and the summary here")
    ap.add_argument("--plot", metavar="PATH", help="PNG of the training-loss curves per hook")
    ap.add_argument(
        "--timeout", type=timeout_seconds(), default=3600.0, help="seconds; default 3600"
    )
    ap.add_argument("--list-tasks", action="store_true", help="list the tasks and exit")
    ap.add_argument(
        "--fsdp",
        action="store_true",
        help="train under FSDP2 (fully_shard per block): allreduce is FSDP2's own reduction, "
        "the other hooks pycomm.fsdp.compress's",
    )
    ap.add_argument(
        "--nodes",
        type=positive_int,
        default=1,
        help="with --fsdp: the ranks as this many nodes, every hook HSDP on them "
        "(pycomm.fsdp.node_mesh), against FSDP2 over every rank; default 1",
    )
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return ap


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (task, optimizer, hook): the metric's mean and standard deviation over
    seeds, the mean paired difference from the reference (accuracy: points; loss: relative),
    the hook's limit and whether it holds.

    Example:
        >>> rows = summarize([
        ...     {"task": "digits-small", "optimizer": "sgd", "hook": h, "seed": 0, "value": v,
        ...      "compression": c}
        ...     for h, v, c in (("allreduce", 97.0, 1.0), ("int8", 96.8, 3.9))])
        >>> rows[1]["delta"], rows[1]["ok"]
        (-0.2, True)
    """
    groups: dict[tuple, dict[str, dict[int, dict[str, Any]]]] = {}
    for r in records:
        hooks = groups.setdefault((r["task"], r["optimizer"]), {})
        hooks.setdefault(r["hook"], {})[r["seed"]] = r
    rows = []
    for (task, optimizer), hooks in groups.items():
        metric = TASKS[task].metric
        ref = hooks.get(REFERENCE, {})
        for hook, by_seed in hooks.items():
            values = [by_seed[s]["value"] for s in sorted(by_seed)]
            paired = [s for s in sorted(by_seed) if s in ref]
            if metric == "accuracy":
                deltas = [by_seed[s]["value"] - ref[s]["value"] for s in paired]
            else:
                deltas = [by_seed[s]["value"] / ref[s]["value"] - 1 for s in paired]
            delta = round(statistics.fmean(deltas), 6) if deltas and hook != REFERENCE else None
            limit = LIMITS.get(hook, (None, None))[0 if metric == "accuracy" else 1]
            ok = None
            if limit is not None and delta is not None:
                ok = delta >= -limit if metric == "accuracy" else delta <= limit
            ratios = [by_seed[s]["compression"] for s in by_seed if by_seed[s]["compression"]]
            warned = any(by_seed[s].get("warning") for s in by_seed)
            rows.append(
                {
                    "task": task,
                    "optimizer": optimizer,
                    "hook": hook,
                    "metric": metric,
                    "seeds": len(values),
                    "mean": statistics.fmean(values),
                    "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                    "min": min(values),
                    "max": max(values),
                    "delta": delta,
                    "limit": limit,
                    "ok": ok,
                    "compression": statistics.fmean(ratios) if ratios else None,
                    "warned": warned,
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table (benchmarks/README.md's)."""
    lines = [
        "| task | optimizer | hook | metric, mean ± sd (min-max) | vs allreduce | limit | holds |"
        " bytes 1/x |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = r["metric"] == "accuracy"
        fmt = "{:.2f}" if acc else "{:.4f}"
        value = (
            f"{'acc' if acc else 'loss'} {fmt.format(r['mean'])} ± {fmt.format(r['std'])} "
            f"({fmt.format(r['min'])}-{fmt.format(r['max'])})"
        )
        if r["delta"] is None:
            delta = "reference" if r["hook"] == REFERENCE else "-"
        elif acc:
            delta = f"{r['delta']:+.2f} pt"
        else:
            delta = f"{100 * r['delta']:+.2f}%"
        limit = "-" if r["limit"] is None else (
            f"{r['limit']:.1f} pt" if acc else f"{100 * r['limit']:.0f}%"
        )  # fmt: skip
        holds = {None: "-", True: "yes", False: "**NO**"}[r["ok"]]
        if r.get("warned"):
            holds += " (warns)"
        comp = "-" if r["compression"] is None else f"{r['compression']:.1f}x"
        lines.append(
            f"| {r['task']} | {r['optimizer']} | {r['hook']} | {value} | {delta} | {limit} | "
            f"{holds} | {comp} |"
        )
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: str) -> None:
    """Training-loss curves (rank 0's micro-batch loss, averaged over windows of steps and
    over seeds), one panel per task and optimizer, one line per hook; a PNG at ``path``."""
    from matplotlib.figure import Figure  # Agg through savefig: no display, no pyplot state

    panels: dict[tuple[str, str], dict[str, list[list[float]]]] = {}
    for r in records:
        panels.setdefault((r["task"], r["optimizer"]), {}).setdefault(r["hook"], []).append(
            r["curve"]
        )
    keys = list(panels)
    cols = 2
    rows = (len(keys) + cols - 1) // cols
    fig = Figure(figsize=(6 * cols, 3.4 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for hook, curves in panels[key].items():
            n = min(len(c) for c in curves)
            mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
            style = {"color": "black", "linewidth": 2.2} if hook == REFERENCE else {}
            ax.plot([(i + 0.5) / n for i in range(n)], mean, label=hook, **style)
        ax.set_title(f"{key[0]}, {key[1]}", fontsize=10)
        ax.set_xlabel("fraction of training")
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--local-sgd" in argv:  # the outer loops against DDP: a run of its own, its own flags
        from pycomm.bench import quality_local_sgd

        return quality_local_sgd.main([a for a in argv if a != "--local-sgd"])
    ap = _parser()
    args = ap.parse_args(argv)
    if args.list_tasks:
        for task in TASKS.values():
            print(f"{task.name:18} {task.description}")
        return 0
    try:
        import_modules(args.imports)
        check_names("hook", args.hooks, all_hooks())
    except ValueError as exc:
        ap.error(f"--hooks: {exc}" if "--import" not in str(exc) else str(exc))
    only = [h for h in args.hooks if h in FSDP_ONLY]
    if only and not args.fsdp:
        ap.error(f"--hooks {', '.join(only)}: FSDP2's all-gather, expected --fsdp")
    if args.fsdp:
        bad = [h for h in args.hooks if h in NOT_FSDP]
        if bad and list(args.hooks) == list(DEFAULT_HOOKS):
            args.hooks = [h for h in args.hooks if h not in NOT_FSDP]
        elif bad:
            ap.error(f"--fsdp: {', '.join(bad)}: no FSDP2 reduce-scatter (pycomm.fsdp)")
    if args.nodes > 1 and (not args.fsdp or args.nprocs % args.nodes):
        ap.error(f"--nodes {args.nodes}: expected --fsdp and a divisor of --nprocs {args.nprocs}")
    check_output_paths(ap, args.json, args.plot)
    # the tasks' models are small: what a rank needs is torch and the data, as in the
    # step-time bench's estimate
    check_memory(
        ap,
        f"--nprocs {args.nprocs}: about {RANK_RUNTIME_BYTES / 1e9:.1f} GB a rank, "
        f"{args.nprocs} ranks",
        args.nprocs * RANK_RUNTIME_BYTES,
        available_memory(),
        advice="pick fewer --nprocs",
    )
    tasks = args.tasks or list(QUICK_TASKS if args.quick else DEFAULT_TASKS)
    hooks = [REFERENCE] + list(dict.fromkeys(h for h in args.hooks if h != REFERENCE))
    if args.tasks is None or any(TASKS[t].kind == "digits" for t in tasks):
        try:
            import sklearn  # noqa: F401 - the digits tasks need it
        except ImportError:
            ap.error("the digits tasks need scikit-learn: pip install scikit-learn")
    plan = {
        "tasks": tasks,
        "hooks": hooks,
        "optimizers": args.optimizers,
        "seeds": list(range(args.seeds)),
        "quick": args.quick,
        "fsdp": args.fsdp,
        "nodes": args.nodes,
        "threads": args.threads,
        "progress": not args.no_progress,
        "imports": list(dict.fromkeys([*args.imports, *user_modules()])),
    }
    t0 = time.monotonic()
    results = pycomm.launch(run_rank, args.nprocs, plan, backend="gloo", timeout=args.timeout)
    wall = time.monotonic() - t0
    records = results[0]
    # Ranks that end a run with different parameters are a failure of that run, reported
    # after the table (and in the exit status), not a reason to lose every other run.
    diverged = []
    for rank, other in enumerate(results[1:], start=1):
        for a, b in zip(records, other):
            if a["checksum"] != b["checksum"]:
                a["ranks_differ"] = True
                diverged.append(
                    f"rank {rank} ended {a['task']} {a['optimizer']} seed {a['seed']} "
                    f"{a['hook']} with other parameters than rank 0"
                )
    rows = summarize(records)
    command = "python -m pycomm.bench.quality " + " ".join(argv)
    print(
        f"{args.nprocs} ranks (gloo), seeds 0-{args.seeds - 1}, "
        f"{'quick' if args.quick else 'full'} run, {wall:.0f} s\n"
    )
    print(table(rows), flush=True)
    for line in diverged:
        print(f"FAILED: {line}")
    if args.json:
        doc = {
            "command": command.strip(),
            "config": {
                **plan,
                "nprocs": args.nprocs,
                "hook_options": {h: HOOK_OPTIONS[h] for h in hooks if h in HOOK_OPTIONS},
                "variants": {h: VARIANTS[h] for h in hooks if h in VARIANTS},
                "tasks_described": {t: TASKS[t].description for t in tasks},
                "torch": torch.__version__,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
            },
            "summary": rows,
            "runs": records,
            "wall_s": wall,
            "ranks_differ": diverged,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    if args.plot:
        plot(records, args.plot)
    return 0 if not diverged and all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
