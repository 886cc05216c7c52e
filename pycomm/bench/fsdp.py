"""``python -m pycomm.bench --fsdp``: FSDP2 (``fully_shard``) with its own reduce-scatter beside
pycomm's (:func:`pycomm.fsdp.compress`), the same model, data and link, side by side.

Every hook gets its own copy of the model (the same seed), each transformer block (or MLP
layer) and the root ``fully_shard``-ed; the hooks take turns step by step, so they see the same
machine at the same moments. Per hook: the median step time, its ratio to FSDP2's own
(``fsdp``), the bytes a rank puts on the wire per step (counted on the private loopback under
``--link``, else the hook's own count) and against FSDP2's, and the memory per rank (sharded
parameters and gradients, and the error-feedback residuals).

``--nodes M --link RATE``: the ranks split into M simulated nodes (:mod:`pycomm.bench.nodes`),
each node's uplink shaped to RATE. ``fsdp`` is then FSDP2 sharded over every rank, ``hsdp``
FSDP2's native HSDP (a 2-D mesh: sharded inside the node, its own all-reduce across), and every
hook HSDP through pycomm (:func:`pycomm.fsdp.node_mesh`, the shards all-reduced across the
nodes through the hook); the table adds the bytes a node sends across its uplink a step.

Example:
    python -m pycomm.bench --fsdp --link 1gbit --hooks fsdp,allreduce,bf16,int8
    python -m pycomm.bench --fsdp --nodes 2 --nprocs 4 --link 1gbit --hooks fsdp,hsdp,allreduce,int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

import pycomm
import pycomm.fsdp
from pycomm.bench import link as _link
from pycomm.bench.args import (
    RANK_RUNTIME_BYTES,
    available_memory,
    check_memory,
    check_output_paths,
    positive_int,
)
from pycomm.bench.link import tx_bytes
from pycomm.bench.models import MODELS, ModelSpec, batches, build, count_params, loss_fn
from pycomm.bench.nodes import Nodes, uplink

NATIVE = "fsdp"  # FSDP2's own reduce-scatter
NATIVE_HSDP = "hsdp"  # FSDP2's own HSDP (a 2-D mesh), with --nodes
NO_RS = "no-rs"  # no reduce-scatter at all (NoReduceScatter): the rest of a step's bytes
_NETNS_FLAG = _link.NETNS_FLAG


def shard(model: torch.nn.Module, mesh: Any = None) -> torch.nn.Module:
    """``fully_shard`` each block (the GPT's blocks, the MLP's layers) and the root, on
    ``mesh`` (None: every rank)."""
    blocks = getattr(model, "blocks", model)
    for child in blocks.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _mesh(hook: str, nodes: int) -> Any:
    """The mesh ``hook`` shards on: every rank's (None), FSDP2's 2-D HSDP mesh, or the node's."""
    if nodes == 1 or hook == NATIVE:
        return None
    if hook == NATIVE_HSDP:
        from torch.distributed.device_mesh import init_device_mesh

        shape = (nodes, dist.get_world_size() // nodes)  # ranks node-major (NodeSetup)
        return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    return pycomm.fsdp.node_mesh()


class NoReduceScatter:
    """A reduce-scatter that keeps this rank's own chunk and sends nothing: what a step puts
    on the wire without one (FSDP's parameter all-gathers, the bench's barriers), subtracted
    from every hook's wire bytes to give its reduce-scatter's. Its gradients are wrong."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        output_tensor.copy_(input_tensor.view(n, -1)[r])


def _sharded_bytes(model: torch.nn.Module) -> int:
    """This rank's bytes of parameters plus gradients (fp32): its shards."""
    return 2 * sum(p.to_local().numel() * 4 for p in model.parameters())


def run_rank(
    spec: ModelSpec,
    hooks: list[str],
    steps: int,
    warmup: int,
    measure_lo: bool,
    nodes: int = 1,
    all_gather: Optional[str] = None,
) -> dict:
    """One rank: every hook's model, trained in turns; per hook its step times and bytes (and,
    on a simulated node's first rank, its uplink's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    up = uplink() if nodes > 1 else None
    runs: dict[str, dict[str, Any]] = {}
    for hook in hooks:
        model = shard(build(spec), _mesh(hook, nodes))
        comm = None
        if hook == NO_RS:
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_custom_reduce_scatter(NoReduceScatter())
        elif hook not in (NATIVE, NATIVE_HSDP):
            comm = pycomm.fsdp.compress(model, hook=hook, all_gather=all_gather)
        runs[hook] = {
            "model": model,
            "comm": comm,
            "opt": torch.optim.SGD(model.parameters(), lr=1e-3),
            "times": [],
            "lo": [],
            "uplink": [],
        }
    data = batches(spec, warmup + steps, torch.Generator().manual_seed(rank))
    for i, batch in enumerate(data):
        for hook in hooks:
            r = runs[hook]
            dist.barrier()
            lo0 = 0
            if measure_lo:
                lo0 = _link.lo_tx_bytes()
                # a second barrier: the step's first all-gather starts at once, and a rank
                # that left the first barrier early would send its shard before this rank
                # reads its counter (what is missed then is a barrier's message, not a shard)
                dist.barrier()
            up0 = tx_bytes(up) if up else 0
            t0 = time.perf_counter()
            loss_fn(spec, r["model"], batch).backward()
            r["opt"].step()
            r["opt"].zero_grad()
            dist.barrier()
            elapsed = time.perf_counter() - t0
            if i == warmup - 1:
                r["sent0"] = r["comm"].stats["bytes_sent"] if r["comm"] is not None else 0
            if i >= warmup:
                r["times"].append(elapsed)
                # the namespace's lo carries every rank's bytes: this rank's share
                r["lo"].append((_link.lo_tx_bytes() - lo0) / world if measure_lo else -1)
                if up:
                    r["uplink"].append(tx_bytes(up) - up0)
    out = {}
    for hook, r in runs.items():
        stats = r["comm"].stats if r["comm"] is not None else {}
        if stats:  # what the hook counted, a rank and a timed step
            stats["bytes_per_step"] = (stats["bytes_sent"] - r["sent0"]) / steps
        out[hook] = {
            "times": r["times"],
            "lo_bytes": r["lo"],
            "uplink_bytes": r["uplink"] if up else None,
            "stats": stats,
            "sharded_bytes": _sharded_bytes(r["model"]),
        }
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m pycomm.bench --fsdp",
        description="FSDP2's own gradient reduce-scatter against pycomm.fsdp.compress's, side "
        "by side on local gloo ranks.",
    )
    ap.add_argument(
        "--hooks",
        default="fsdp,allreduce,bf16,int8",
        help="comma-separated: fsdp (FSDP2's own) and registered hooks",
    )
    ap.add_argument("--nprocs", type=positive_int, default=2)
    ap.add_argument(
        "--all-gather",
        default=None,
        metavar="CODEC",
        help="the parameter all-gather of every pycomm hook through CODEC (int8, fp8, bf16, "
        "...); default FSDP2's own",
    )
    ap.add_argument(
        "--nodes",
        type=positive_int,
        default=1,
        help="simulated nodes (needs --link: each node's uplink); hooks run as HSDP on them",
    )
    ap.add_argument("--steps", type=positive_int, default=10, help="timed steps per hook")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= start_iter)")
    ap.add_argument("--model", choices=MODELS, default="mlp")
    ap.add_argument("--layers", type=positive_int, default=8)
    ap.add_argument("--width", type=positive_int, default=None, help="MLP: default 1024")
    ap.add_argument("--batch", type=positive_int, default=64)
    ap.add_argument("--link", default=None, help="shape loopback to RATE per rank (tc rate)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(_NETNS_FLAG, action="store_true", help=argparse.SUPPRESS)
    return ap  # fmt: skip


def memory_estimate(params: int, hooks: int, nprocs: int) -> int:
    """Bytes a run needs, roughly: per rank a whole fp32 model (each hook's is built whole
    before it is sharded, and a block's parameters are gathered whole in its forward and
    backward: 8 bytes a parameter), each hook's shards of parameters, gradients and the
    error-feedback residual (12 bytes a parameter over the ranks), and ~0.5 GB of runtime.
    Activations are not counted.

    Example:
        >>> round(memory_estimate(8_396_800, 4, 2) / 1e9, 1)
        1.5
    """
    return nprocs * (8 * params + hooks * 12 * params // nprocs + RANK_RUNTIME_BYTES)


def _hooks(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """The hooks --hooks names, in order, each once (as the step-time bench takes them)."""
    hooks = list(dict.fromkeys(h.strip() for h in text.split(",") if h.strip()))
    if not hooks:
        ap.error(
            f"--hooks {text!r}: no hook given; expected {NATIVE} (FSDP2's own), {NATIVE_HSDP} "
            f"or one of {', '.join(pycomm.Exchange.codecs())}, comma-separated"
        )
    return hooks


def _spec(ap: argparse.ArgumentParser, args: argparse.Namespace) -> ModelSpec:
    """The model of --model, --layers, --width and --batch; --width with the transformer (its
    sizes are ModelSpec's defaults) is an error, not ignored."""
    if args.model != "mlp" and args.width is not None:
        ap.error(f"--width {args.width}: --width is not a flag of --model {args.model}")
    width = args.width if args.width is not None else 1024
    return ModelSpec(args.model, layers=args.layers, width=width, batch=args.batch)


def _check_memory(
    ap: argparse.ArgumentParser, args: argparse.Namespace, spec: ModelSpec, params: int, hooks: int
) -> None:
    """An error, before any rank starts, when the run would not fit in the memory available."""
    size = f"--layers {spec.layers}" + (f" --width {spec.width}" if spec.kind == "mlp" else "")
    what = (
        f"{size}: {params / 1e6:.1f}M parameters, a whole model and each hook's shards per "
        f"rank: {hooks} hooks x {args.nprocs} ranks"
    )
    check_memory(ap, what, memory_estimate(params, hooks, args.nprocs), available_memory())


def summarize(
    results: list[dict], hooks: list[str], params: int, all_gather: Optional[str] = None
) -> dict[str, dict]:
    """Per hook over ranks: median step time (the slowest rank's each step), wire bytes a rank
    per step, ratios to FSDP2's own, memory per rank. A step's wire bytes are the fewest of its
    timed steps: they differ only by what some steps add (a few extra packets on a shaped
    loopback), which a median of few steps would carry into the subtraction."""
    rows: dict[str, dict] = {}
    for hook in hooks:
        per_step = [
            max(r[hook]["times"][i] for r in results) for i in range(len(results[0][hook]["times"]))
        ]
        lo = [b for b in results[0][hook]["lo_bytes"] if b >= 0]
        stats = results[0][hook]["stats"]
        ups = [statistics.median(r[hook]["uplink_bytes"]) for r in results if r[hook].get(
            "uplink_bytes")]  # fmt: skip
        rows[hook] = {
            "median_s": statistics.median(per_step),
            "uplink_bytes_per_step": statistics.mean(ups) if ups else None,
            "wire_bytes_per_step": min(lo) if lo else None,
            "counted_bytes_per_step": stats.get("bytes_per_step"),
            "residual_bytes": stats.get("residual_bytes", 0),
            "sharded_bytes": results[0][hook]["sharded_bytes"],
        }
    rest = rows.pop(NO_RS, {}).get("wire_bytes_per_step")
    for hook, row in rows.items():  # the reduce-scatter's own bytes on the wire
        wire = row["wire_bytes_per_step"]
        row["rs_wire_bytes_per_step"] = wire - rest if wire is not None and rest else None
        if all_gather is not None and hook not in (NATIVE, NATIVE_HSDP):
            row["rs_wire_bytes_per_step"] = None  # the rest was measured with FSDP2's all-gather
    base = rows.get(NATIVE)
    for row in rows.values():
        if base is not None:
            row["time_vs_fsdp"] = row["median_s"] / base["median_s"]
            if row["uplink_bytes_per_step"] and base["uplink_bytes_per_step"]:
                row["uplink_vs_fsdp"] = row["uplink_bytes_per_step"] / base["uplink_bytes_per_step"]
            if row["wire_bytes_per_step"] and base["wire_bytes_per_step"]:
                row["wire_vs_fsdp"] = row["wire_bytes_per_step"] / base["wire_bytes_per_step"]
            if row["rs_wire_bytes_per_step"] and base["rs_wire_bytes_per_step"]:
                row["rs_wire_vs_fsdp"] = (
                    row["rs_wire_bytes_per_step"] / base["rs_wire_bytes_per_step"]
                )
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _parser()
    args = ap.parse_args(argv)
    hooks = _hooks(ap, args.hooks)
    spec = _spec(ap, args)
    if args.nprocs < 2:
        ap.error(f"--nprocs {args.nprocs}: expected at least 2")
    if args.warmup < 2:
        ap.error(f"--warmup {args.warmup}: expected at least 2 (the hooks' exact warm-up)")
    if args.nodes < 1 or args.nprocs % args.nodes or (args.nodes > 1 and args.link is None):
        ap.error(
            f"--nodes {args.nodes}: expected a divisor of --nprocs {args.nprocs}, with --link "
            "RATE for the nodes' uplinks"
        )
    if NATIVE_HSDP in hooks and args.nodes == 1:
        ap.error(f"--hooks {NATIVE_HSDP}: FSDP2's own HSDP needs --nodes M > 1")
    if args.all_gather is not None:
        try:
            error = pycomm.fsdp.weight_error(args.all_gather)
        except (ValueError, TypeError) as e:
            ap.error(f"--all-gather {args.all_gather}: {e}")
        if error > pycomm.fsdp.WEIGHT_ERROR_LIMIT:
            ap.error(
                f"--all-gather {args.all_gather}: a relative error of {error:.3g} on weights, "
                f"expected a codec within {pycomm.fsdp.WEIGHT_ERROR_LIMIT} (bf16, fp8, int8)"
            )
    for h in hooks:
        if h not in (NATIVE, NATIVE_HSDP):
            try:
                pycomm.hooks.hook_spec(h, "--hooks")
            except ValueError as e:
                ap.error(str(e))
            if h not in pycomm.Exchange.codecs():  # as pycomm.fsdp.compress refuses it
                ap.error(
                    f"--hooks {h}: not a reduce-scatter under FSDP2; expected {NATIVE} or one "
                    f"of {', '.join(pycomm.Exchange.codecs())}"
                )
    check_output_paths(ap, args.json)
    params = count_params(spec)
    # with the wire counted (--link, one node), a run without any reduce-scatter as well
    _check_memory(ap, args, spec, params, len(hooks) + (args.link is not None))
    link: dict[str, Any] = {"rate": args.link, "shaped": False}
    if args.link is not None:
        rerun_argv = ["--fsdp", *argv]
        total, rerun = _link.in_shaped_netns(ap, args.link, args.nprocs, args._in_netns, rerun_argv)
        if rerun is not None:
            return rerun
        if args.nodes == 1:
            link["qdisc"] = _link.shape_loopback(total)
        link["shaped"] = True
    where = f"{args.nodes} nodes, uplinks" if args.nodes > 1 else "link"
    gathers = f", all-gather {args.all_gather or 'FSDP2 own'} for pycomm's hooks"
    print(f"pycomm.bench --fsdp: {spec.describe(params)}, {args.nprocs} ranks, {where} "
          f"{args.link or 'unshaped'}, hooks {', '.join(hooks)}{gathers}", flush=True)  # fmt: skip
    if args.nodes > 1:  # each node's uplink counted: no reduce-scatter-free run needed
        with Nodes(args.nodes, _link.parse_rate(args.link)) as nodes:
            link["qdisc"] = "; ".join(f"{k}: {v}" for k, v in nodes.qdiscs.items())
            results = pycomm.launch(
                run_rank, args.nprocs, spec, hooks, args.steps, args.warmup, False,
                args.nodes, args.all_gather, timeout=1800, setup=nodes.setup(args.nprocs),
            )  # fmt: skip
        rows = summarize(results, hooks, params, args.all_gather)
        _print_nodes(rows)
        _write(args, argv, spec, params, link, rows)
        return 0
    # with the wire counted, a run without any reduce-scatter gives the rest of a step's bytes
    run = [*hooks, NO_RS] if link["shaped"] else hooks
    results = pycomm.launch(
        run_rank, args.nprocs, spec, run, args.steps, args.warmup,
        link["shaped"] and _link.in_private_netns(), 1, args.all_gather, timeout=1800,
    )  # fmt: skip
    rows = summarize(results, run, params, args.all_gather)
    print("MB a rank a step on the shaped wire: every collective (a step's fewest bytes), and "
          "the reduce-scatter's (less those of a step without any reduce-scatter); counted MB: "
          "the hook's own count")  # fmt: skip
    print(f"{'hook':<10}{'step ms':>9}{'vs fsdp':>9}{'MB/step':>9}{'vs fsdp':>9}"
          f"{'RS MB/step':>12}{'vs fsdp':>9}"
          f"{'counted MB':>12}{'shards MB':>11}{'residual MB':>13}")  # fmt: skip
    nan = float("nan")
    for hook, r in rows.items():
        wire, counted = r["rs_wire_bytes_per_step"], r["counted_bytes_per_step"]
        total = r["wire_bytes_per_step"]
        print(f"{hook:<10}{r['median_s'] * 1e3:>9.1f}{r.get('time_vs_fsdp', nan):>9.3f}"
              f"{(total or nan) / 1e6:>9.3f}{r.get('wire_vs_fsdp', nan):>9.3f}"
              f"{(wire or nan) / 1e6:>12.3f}{r.get('rs_wire_vs_fsdp', nan):>9.3f}"
              f"{(counted if counted is not None else nan) / 1e6:>12.3f}"
              f"{r['sharded_bytes'] / 1e6:>11.1f}{r['residual_bytes'] / 1e6:>13.1f}")  # fmt: skip
    _write(args, argv, spec, params, link, rows)
    return 0


def _print_nodes(rows: dict[str, dict]) -> None:
    """The table of a run on simulated nodes: step time and uplink bytes against FSDP2's."""
    print("uplink MB: what a node sends across its uplink a step (median over steps, mean over "
          "nodes); counted MB: the hook's own count, a rank")  # fmt: skip
    print(f"{'hook':<10}{'step ms':>9}{'vs fsdp':>9}{'uplink MB':>11}{'vs fsdp':>9}"
          f"{'counted MB':>12}{'residual MB':>13}")  # fmt: skip
    nan = float("nan")
    for hook, r in rows.items():
        up, counted = r["uplink_bytes_per_step"], r["counted_bytes_per_step"]
        print(f"{hook:<10}{r['median_s'] * 1e3:>9.1f}{r.get('time_vs_fsdp', nan):>9.3f}"
              f"{(up if up is not None else nan) / 1e6:>11.3f}"
              f"{r.get('uplink_vs_fsdp', nan):>9.3f}"
              f"{(counted if counted is not None else nan) / 1e6:>12.3f}"
              f"{r['residual_bytes'] / 1e6:>13.1f}")  # fmt: skip


def _write(args, argv, spec, params, link, rows) -> None:
    """The run as JSON, under ``--json``."""
    if args.json:
        doc = {
            "command": "python -m pycomm.bench --fsdp "
            + " ".join(a for a in argv if a != _NETNS_FLAG),
            "model": spec.config(),
            "params": params,
            "nprocs": args.nprocs,
            "nodes": args.nodes,
            "all_gather": args.all_gather,
            "link": link,
            "steps": args.steps,
            "hooks": rows,
            "note": "rs_wire: bytes on the private loopback per rank and step (the fewest of the "
            "timed steps), less those of a step without any reduce-scatter (FSDP's "
            "all-gathers, barriers)",
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
