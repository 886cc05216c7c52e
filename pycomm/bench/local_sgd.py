"""``python -m pycomm.bench --local-sgd``: step time and bytes per step of the outer loops
(``pycomm.LocalSGD``, ``pycomm.DiLoCo``) against compute alone, DDP and DDP with int4, on
links shaped to each ``--link`` rate (default 1 Gbit/s, then 100 Mbit/s).

Each variant trains its own copy of an MLP on every rank. The variants run in blocks of
``--block`` steps (a multiple of every H), their order rotating from round to round, so each
sees the same machine; a block's time ends once its exchanges in flight are done, so a delayed
sync is charged to its own variant. Step time is the mean over the timed blocks (a sync every
H steps is part of the mean, not of a median), bytes per step what each rank's counters say.

    python -m pycomm.bench --local-sgd                       # 1gbit, then 100mbit
    python -m pycomm.bench --local-sgd --link 100mbit --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

import pycomm
from pycomm.bench import link as _link

_NETNS_FLAG = _link.NETNS_FLAG
COMPUTE, DDP, DDP_INT4 = "compute", "ddp", "ddp-int4"


def variants() -> list[str]:
    """Every variant's name: compute, DDP, DDP int4, then the outer loops' grid."""
    out = [COMPUTE, DDP, DDP_INT4]
    for kind in ("localsgd", "diloco"):
        for h in (10, 50):
            for f in (1, 4):
                for delay in (0, 1):
                    out.append(f"{kind}-H{h}-F{f}-d{delay}")
    return out


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def _build(name: str, width: int, layers: int) -> tuple[Any, Any, Any]:
    """(module to call, inner optimizer, outer loop or None) of variant ``name``."""
    model = _model(width, layers)
    if name == COMPUTE:
        return model, torch.optim.SGD(model.parameters(), lr=1e-3), None
    if name in (DDP, DDP_INT4):
        ddp = pycomm.wrap(model, hook="allreduce" if name == DDP else "int4")
        return ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), None
    kind, h, f, d = name.split("-")
    cls = pycomm.LocalSGD if kind == "localsgd" else pycomm.DiLoCo
    outer = cls(model, sync_every=int(h[1:]), fragments=int(f[1:]), delay=int(d[1:]))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), outer


def run_rank(
    names: list[str], width: int, layers: int, block: int, rounds: int, batch: int
) -> dict:
    """Every variant's block times (s) and bytes per step on this rank."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    built = {n: _build(n, width, layers) for n in names}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g)
    times: dict[str, list[float]] = {n: [] for n in names}
    sent: dict[str, float] = {}
    for r in range(rounds + 1):  # round 0: the warm-up (DDP's bucket rebuild, first syncs)
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            model, opt, outer = built[n]
            before = _sent(model, outer)
            dist.barrier()
            t0 = time.perf_counter()
            # round 0 runs half a block more: the timed blocks start mid-window, so no sync
            # falls on a block's last step (a delayed one would land in the next block)
            for _ in range(block + (block // 2 if r == 0 else 0)):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                if outer is not None:
                    outer.step()
            if outer is not None:  # its syncs in flight end inside its own time
                for _, work, _ in outer.pending.values():
                    work.wait()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if r > 0:
                times[n].append(dt.item())
                sent[n] = sent.get(n, 0.0) + (_sent(model, outer) - before)
    return {"times": times, "bytes": {n: b / (rounds * block) for n, b in sent.items()}}


def _sent(model: Any, outer: Any) -> float:
    if outer is not None:
        return float(outer.stats["bytes_sent"])
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return float(pycomm.hook_state(model).stats["bytes_sent"])
    return 0.0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m pycomm.bench --local-sgd",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--link", default=None, help="one tc rate (default: 1gbit, then 100mbit)")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256, help="rows a step (compute per step)")
    ap.add_argument("--block", type=int, default=50, help="steps a block (a multiple of 50)")
    ap.add_argument("--rounds", type=int, default=2, help="timed blocks per variant")
    ap.add_argument("--variants", default=None, help="comma-separated (default every one)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(_NETNS_FLAG, action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _parser()
    args = ap.parse_args(argv)
    names = args.variants.split(",") if args.variants else variants()
    unknown = [n for n in names if n not in variants()]
    if unknown:
        ap.error(f"--variants {','.join(unknown)}: expected some of {', '.join(variants())}")
    if args.block < 1 or args.block % 50:
        ap.error(f"--block {args.block}: expected a positive multiple of 50 (every H divides it)")
    if args.link is None and not args._in_netns:  # each rate in a namespace of its own
        docs = {}
        for rate in ("1gbit", "100mbit"):
            out = f"{args.json}.{rate}" if args.json else None
            rest = [a for a in argv if a != "--json" and a != args.json]
            code = main([*rest, "--link", rate, *(["--json", out] if out else [])])
            if code:
                return code
            if out:
                with open(out) as f:
                    docs[rate] = json.load(f)
                os.remove(out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(docs, f, indent=1)
        return 0
    rerun_argv = ["--local-sgd", *argv]
    total, rerun = _link.in_shaped_netns(ap, args.link, args.nprocs, args._in_netns, rerun_argv)
    if rerun is not None:
        return rerun
    _link.shape_loopback(total)
    params = sum(p.numel() for p in _model(args.width, args.layers).parameters())
    print(f"pycomm.bench --local-sgd: MLP {args.layers}x{args.width} ({params / 1e6:.2f}M "
          f"params), batch {args.batch}, {args.nprocs} ranks, link {args.link} a rank, blocks "
          f"of {args.block} steps, {args.rounds} timed rounds", flush=True)  # fmt: skip
    res = pycomm.launch(run_rank, args.nprocs, names, args.width, args.layers, args.block,
                        args.rounds, args.batch, timeout=3600)[0]  # fmt: skip
    rows = {}
    for n in names:
        step = statistics.mean(res["times"][n]) / args.block
        rows[n] = {"step_ms": step * 1e3, "bytes_per_step": res["bytes"].get(n, 0.0)}
    base, ddp = rows[COMPUTE]["step_ms"], rows.get(DDP, {}).get("bytes_per_step")
    print(f"{'variant':<22}{'step ms':>9}{'/compute':>10}{'KB/step':>11}{'DDP/this':>10}")
    for n, r in rows.items():
        r["vs_compute"] = r["step_ms"] / base
        if ddp and r["bytes_per_step"]:
            r["ddp_bytes_ratio"] = ddp / r["bytes_per_step"]
        ratio = r.get("ddp_bytes_ratio", float("nan"))
        print(f"{n:<22}{r['step_ms']:>9.2f}{r['vs_compute']:>10.2f}"
              f"{r['bytes_per_step'] / 1e3:>11.1f}{ratio:>10.1f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "_in_netns"},
                       "params": params, "rows": rows}, f, indent=1)  # fmt: skip
    return 0
