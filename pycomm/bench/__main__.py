"""``python -m pycomm.bench``: train an MLP on N local ranks (gloo), one DDP model per hook,
the hooks interleaved step by step, and print each hook's step time against compute alone
(no communication) and plain DDP, with the bytes each rank sends per step.

    python -m pycomm.bench                      # the reference setup, unshaped loopback
    python -m pycomm.bench --link 2.5gbit       # each rank gets about 2.5 Gbit/s
    python -m pycomm.bench --hooks all --json out.json

--link re-runs the benchmark in a private network namespace (unshare -n) whose loopback is
shaped with tc (tbf, rate = ranks x RATE); it needs root, unshare (util-linux) and tc
(iproute2), and runs unshaped, saying so, without them. A hook that fails (torch's PowerSGD
on gloo with several buckets) is reported as failed; the others are still measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Optional

import torch

import pycomm
from pycomm.bench import link as _link
from pycomm.bench.report import add_ratios, table
from pycomm.bench.runner import (
    BASELINE,
    COMPUTE,
    FAIL,
    available_hooks,
    default_hooks_set,
    describe,
)
from pycomm.bench.session import measure

_NETNS_FLAG = "--_in-netns"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a non-negative integer")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _rate(text: str) -> str:
    try:
        _link.parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m pycomm.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--nprocs", type=_positive, default=2, help="local ranks (gloo); default 2")
    ap.add_argument(
        "--hooks",
        default="default",
        help="comma-separated hook names, 'default' or 'all' (see --list-hooks); compute and "
        f"ddp are always run, as references. default: {','.join(default_hooks_set())}",
    )
    ap.add_argument(
        "--list-hooks", action="store_true", help="list the hooks with what each one runs; exit"
    )
    ap.add_argument("--width", type=_positive, default=1024, help="MLP width; default 1024")
    ap.add_argument(
        "--layers", type=_positive, default=8, help="MLP depth (Linear layers); default 8"
    )
    ap.add_argument("--batch", type=_positive, default=64, help="batch per rank; default 64")
    ap.add_argument("--steps", type=_positive, default=20, help="timed steps per hook; default 20")
    ap.add_argument(
        "--warmup",
        type=_non_negative,
        default=3,
        help="untimed steps per hook first; default 3 (PowerSGD compresses from step 2)",
    )
    ap.add_argument(
        "--threads", type=_positive, default=1, help="torch threads per rank; default 1"
    )
    ap.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        metavar="MB",
        help="DDP bucket size for every hook; default: each hook's own (DDP's 25 MB, and the "
        "8 MB pycomm.wrap picks for int8, bf16 and fp16)",
    )
    ap.add_argument(
        "--link",
        type=_rate,
        metavar="RATE",
        default=None,
        help="shape the loopback so that each rank sees about RATE, in tc's syntax "
        "(2.5gbit, 500mbit, 100mbps); needs root, unshare and tc",
    )
    ap.add_argument(
        "--json", metavar="FILE", default=None, help="write config, results and failures here"
    )
    ap.add_argument(
        "--timeout",
        type=_seconds,
        default=300,
        help="seconds before one launch of the ranks is given up; default 300",
    )
    ap.add_argument(_NETNS_FLAG, action="store_true", help=argparse.SUPPRESS)
    return ap


def _hooks(ap: argparse.ArgumentParser, text: str) -> list[str]:
    known = available_hooks()
    names: list[str] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if token == "all":
            names += known
        elif token == "default":
            names += default_hooks_set()
        elif token in known or token == FAIL:
            names.append(token)
        else:
            ap.error(
                f"--hooks: unknown hook {token!r}; choose from all, default, {', '.join(known)}"
            )
    for ref in (BASELINE, COMPUTE):
        if ref not in names:
            names.insert(0, ref)
    return list(dict.fromkeys(names))


def _child_argv(args: argparse.Namespace) -> list[str]:
    """The same run as flags, for the copy of the benchmark inside the namespace."""
    argv = [
        "--nprocs", str(args.nprocs), "--hooks", args.hooks, "--width", str(args.width),
        "--layers", str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--threads", str(args.threads), "--link", args.link,
        "--timeout", str(args.timeout), _NETNS_FLAG,
    ]  # fmt: skip
    if args.bucket_cap_mb is not None:
        argv += ["--bucket-cap-mb", str(args.bucket_cap_mb)]
    if args.json:
        argv += ["--json", os.path.abspath(args.json)]
    return argv


def _in_namespace(args: argparse.Namespace) -> int:
    """Re-run this benchmark in a private network namespace; its exit status."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(pycomm.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # The namespace has no DNS: c10d warns on every connection that it cannot name the peer.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    cmd = ["unshare", "-n", "--", sys.executable, "-m", "pycomm.bench", *_child_argv(args)]
    return subprocess.call(cmd, env=env)


def main(argv: Optional[list[str]] = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.list_hooks:
        for name in available_hooks():
            print(f"{name:<17}{describe(name)}")
        return 0
    hooks = _hooks(ap, args.hooks)

    per_rank = _link.parse_rate(args.link) if args.link else None
    total = per_rank * args.nprocs if per_rank else None
    link: dict[str, Any] = {
        "requested": args.link,
        "per_rank_bits": per_rank,
        "total_bits": total,
        "shaped": False,
        "reason": None,
        "qdisc": None,
    }
    if total and not args._in_netns:
        reason = _link.cannot_shape() or _link.probe(total)
        if reason is None:
            return _in_namespace(args)
        print(
            f"pycomm.bench: --link {args.link}: cannot shape the loopback ({reason}); "
            "running UNSHAPED",
            file=sys.stderr,
        )
        link["reason"] = reason
    elif total:
        link["qdisc"] = _link.shape_loopback(total)
        link["shaped"] = True
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the namespace's only interface
    elif args._in_netns:
        ap.error(f"{_NETNS_FLAG} is internal and needs --link")

    cfg = {
        "width": args.width,
        "layers": args.layers,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "bucket_cap_mb": args.bucket_cap_mb,
        "measure_lo": link["shaped"] and _link.in_private_netns(),
    }
    t0 = time.monotonic()
    result = measure(cfg, hooks, args.nprocs, args.timeout)
    numbers = result["hooks"]
    ordered = {name: {"description": describe(name), **numbers[name]} for name in hooks}
    add_ratios(ordered)
    doc = {
        "config": {
            "nprocs": args.nprocs,
            "backend": "gloo",
            "hooks": hooks,
            **{k: v for k, v in cfg.items() if k != "measure_lo"},
            "timeout_s": args.timeout,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "params": result["params"],
        "link": link,
        "hooks": ordered,
        "failures": result["failures"],
        "launches": result["launches"],
        "wall_s": time.monotonic() - t0,
    }
    print(table(doc), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0 if any(h["status"] == "ok" for h in ordered.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
