"""``python -m pycomm.bench``: train a model on N local ranks (gloo), one DDP model per hook,
the hooks interleaved step by step, and print each hook's step time against compute alone
(no communication) and plain DDP, the bytes each rank sends per step, and the relative error
of the reduced gradient against the exact fp32 mean.

    python -m pycomm.bench                        # 8.4M-param MLP, unshaped loopback
    python -m pycomm.bench --link 2.5gbit         # each rank gets about 2.5 Gbit/s
    python -m pycomm.bench --nodes 2 --nprocs 4 --link 2.5gbit   # 2 nodes, 2.5 Gbit/s uplinks
    python -m pycomm.bench --model transformer --d-model 512 --layers 12 --hooks ddp,int8
    python -m pycomm.bench --accumulate-steps 4 --json out.json --plot out.png
    python -m pycomm.bench --device cuda --model transformer --layers 12 --d-model 768 \
        --heads 12 --seq-len 1024 --vocab 50257 --batch 8     # GPT-2 small (124M) on GPUs

Sizes: --model mlp has layers x width^2 parameters (--width 256 --layers 16: 1.1M;
--width 4096 --layers 6: 101M); --model transformer about 12 x layers x d_model^2 plus
vocab x d_model (--d-model 1024 --layers 8: 109M). Each hook gets its own copy of the model
on every rank: check memory before going big (the benchmark refuses sizes that cannot fit).

--device cuda puts every rank on a GPU: with --backend auto, NCCL when each rank has a GPU of
its own, gloo with CUDA tensors when ranks share GPUs; the table adds each hook's peak GPU
memory per rank.

--link re-runs the benchmark in a private network namespace (unshare -n) whose loopback is
shaped with tc (tbf, rate = ranks x RATE); it needs root, unshare (util-linux) and tc
(iproute2), and runs unshaped, saying so, without them. With --nodes M (M > 1) the ranks are
split into M simulated nodes, each a network namespace of its own joined to the others by a
bridge: traffic inside a node is unshaped, each node's uplink (and downlink) is shaped to RATE,
and the table adds the bytes each node sends across its uplink per step (pycomm.bench.nodes).
A hook that fails or hangs (torch's
PowerSGD on gloo with several buckets) is reported as failed; the others are still measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from typing import Any, Optional

import torch

from pycomm.bench import link as _link
from pycomm.bench.args import (
    RANK_RUNTIME_BYTES,
    add_import_argument,
    available_memory,
    check_memory,
    check_output_paths,
    positive_float,
    positive_int,
    timeout_seconds,
)
from pycomm.bench.models import MODELS, ModelSpec, count_params
from pycomm.bench.nodes import Nodes
from pycomm.bench.report import add_ratios, plot, table
from pycomm.bench.runner import (
    BASELINE,
    COMPUTE,
    NODE_VARIANTS,
    available_hooks,
    default_hooks_set,
    describe,
    is_pycomm,
    is_user_hook,
    user_hook_factory,
)
from pycomm.bench.session import measure
from pycomm.codec.engine import ring_bytes
from pycomm.hooks.registry import import_modules, user_modules

_NETNS_FLAG = _link.NETNS_FLAG

# Flags of one model only: given with the other one, they are an error (not silently ignored).
_MLP_FLAGS = {"width": "--width"}
_GPT_FLAGS = {
    "d_model": "--d-model",
    "heads": "--heads",
    "seq_len": "--seq-len",
    "vocab": "--vocab",
}
_DEFAULTS = {"width": 1024, "d_model": 256, "heads": 4, "seq_len": 64, "vocab": 8192}
_DEFAULT_BATCH = {"mlp": 64, "transformer": 4}
# --step-timeout's ceiling: faulthandler.dump_traceback_later overflows on huge deadlines, and a
# step of more than 11 days is a hang whatever the model.
STEP_TIMEOUT_MAX_S = 1e6
# --bucket-cap-mb's ceiling: DDP takes the bucket in bytes as a 64-bit integer; a terabyte of
# bucket is one bucket for any model that fits.
BUCKET_CAP_MAX_MB = 1e6


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number of seconds")
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
    _run_flags(ap)
    _model_flags(ap)
    _timing_flags(ap)
    _output_flags(ap)
    ap.add_argument(_NETNS_FLAG, action="store_true", help=argparse.SUPPRESS)
    return ap


def _run_flags(ap: argparse.ArgumentParser) -> None:
    """--nprocs, --hooks, --list-hooks, --accumulate-steps, --threads, --device, --backend,
    --bucket-cap-mb."""
    run = ap.add_argument_group("what runs")
    run.add_argument("--nprocs", type=positive_int, default=2, help="local ranks (gloo); default 2")
    run.add_argument(
        "--hooks",
        default="default",
        help="comma-separated hook names, 'default' or 'all' (see --list-hooks), or "
        "module:factory for a hook of your own (factory() returns the (state, hook) pair to "
        "register); compute and ddp are always run, as references. default: "
        f"{','.join(default_hooks_set())}",
    )
    add_import_argument(run)
    run.add_argument(
        "--list-hooks", action="store_true", help="list the hooks with what each one runs; exit"
    )
    run.add_argument(
        "--accumulate-steps",
        type=positive_int,
        default=1,
        metavar="K",
        help="micro-steps per optimizer step, each on its own micro-batch with the loss scaled "
        "by 1/K: pycomm hooks get pycomm.wrap(..., accumulate_steps=K), plain DDP and torch's "
        "hooks run the first K-1 under no_sync(); times and bytes are per optimizer step; "
        "default 1",
    )
    run.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads per rank; default 1"
    )
    run.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the ranks train: cpu, or cuda (rank r on GPU r mod the GPU count); default cpu",
    )
    run.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="the process group's backend: auto (nccl on --device cuda when every rank has a "
        "GPU of its own, else gloo), gloo, or nccl; default auto",
    )
    run.add_argument(
        "--bucket-cap-mb",
        type=positive_float("MB", BUCKET_CAP_MAX_MB, why=" (one bucket for any model)"),
        default=None,
        metavar="MB",
        help="DDP bucket size for every hook; default: each hook's own, as pycomm.wrap picks "
        'it (docs/reference.md, "The DDP bucket size")',
    )


def _model_flags(ap: argparse.ArgumentParser) -> None:
    """--model and its sizes, --batch."""
    model = ap.add_argument_group("model (synthetic data, the same weights on every rank)")
    model.add_argument(
        "--model", choices=MODELS, default="mlp", help="an MLP stack or a GPT-style transformer"
    )
    model.add_argument(
        "--layers",
        type=positive_int,
        default=8,
        help="Linear layers of the MLP, or transformer blocks; default 8",
    )
    model.add_argument(
        "--width", type=positive_int, default=None, help="MLP: width of every layer; default 1024"
    )
    model.add_argument(
        "--d-model", type=positive_int, default=None, help="transformer: model width; default 256"
    )
    model.add_argument(
        "--heads",
        type=positive_int,
        default=None,
        help="transformer: attention heads (must divide --d-model); default 4",
    )
    model.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help="transformer: tokens per sequence; default 64",
    )
    model.add_argument(
        "--vocab",
        type=positive_int,
        default=None,
        help="transformer: vocabulary size; default 8192",
    )
    model.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="micro-batch per rank: rows for the MLP (default 64), sequences for the "
        "transformer (default 4)",
    )


def _timing_flags(ap: argparse.ArgumentParser) -> None:
    """--steps, --warmup, --error-steps, the link's flags, --step-timeout, --rerun-budget,
    --timeout."""
    timing = ap.add_argument_group("timing")
    timing.add_argument(
        "--steps", type=positive_int, default=20, help="timed optimizer steps per hook; default 20"
    )
    timing.add_argument(
        "--warmup",
        type=_non_negative,
        default=3,
        help="untimed steps per hook first; default 3 (the bench runs PowerSGD and pycomm's "
        "compressed hooks compressing from step 2)",
    )
    timing.add_argument(
        "--error-steps",
        type=_non_negative,
        default=2,
        metavar="N",
        help="on the last N timed steps, measure each hook's relative L2 error against the "
        "exact fp32 mean gradient (an untimed reference copy and an fp32 all-reduce); 0: "
        "skip; default 2",
    )

    _link_flags(timing)
    timing.add_argument(
        "--step-timeout",
        type=positive_float("seconds", STEP_TIMEOUT_MAX_S, why=" (a longer step is a hang)"),
        default=10.0,
        metavar="S",
        help="a hook's step that lasts longer than max(S, 5x the slowest step so far) + 3x "
        "the time the fp32 gradient takes over --link (twice that with the error "
        "measurement) is a hang: the ranks are stopped and the hook is reported failed "
        "(setups and first steps: at least 60 s, for lazy imports); default 10",
    )
    timing.add_argument(
        "--rerun-budget",
        type=_non_negative_float,
        default=60.0,
        metavar="S",
        help="after the others are measured, rerun each hook that failed alone, to tell an "
        "intermittent failure from a deterministic one, starting reruns only while less than "
        "S seconds have gone into them; 0: no reruns; default 60",
    )
    timing.add_argument(
        "--timeout",
        type=timeout_seconds(),
        default=300.0,
        help="seconds before one launch of the ranks is given up; default 300",
    )


def _link_flags(timing: Any) -> None:
    """--link and --nodes (the shaped loopback, the simulated nodes) in the argument group
    ``timing``."""
    timing.add_argument(
        "--link",
        type=_rate,
        metavar="RATE",
        default=None,
        help="shape the loopback so that each rank sees about RATE, in tc's syntax "
        "(2.5gbit, 500mbit, 100mbps); needs root, unshare and tc",
    )
    timing.add_argument(
        "--nodes",
        type=positive_int,
        default=1,
        metavar="M",
        help="split the ranks into M simulated nodes (network namespaces joined by a bridge, "
        "each node's uplink shaped to --link RATE; ranks see torchrun's GROUP_RANK, LOCAL_RANK, "
        "LOCAL_WORLD_SIZE); M must divide --nprocs and needs --link; default 1 (one node)",
    )


def _output_flags(ap: argparse.ArgumentParser) -> None:
    """--json, --plot, --quiet."""
    out = ap.add_argument_group("output")
    out.add_argument(
        "--json", metavar="FILE", default=None, help="write config, results and failures here"
    )
    out.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="draw each hook's median step time, split into compute (the compute-only "
        "median) and communication (the rest), with matplotlib",
    )
    out.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar and no progress lines on stderr (the bar is also off when "
        "stderr is not a terminal)",
    )
    ap.add_argument(
        "--fsdp",
        action="store_true",
        help="benchmark FSDP2's gradient reduce-scatter against pycomm.fsdp.compress's instead "
        "(flags of its own: python -m pycomm.bench --fsdp --help)",
    )


def _hooks(ap: argparse.ArgumentParser, text: str) -> list[str]:
    known = available_hooks()
    names: list[str] = []
    if not any(t.strip() for t in text.split(",")):  # an empty shell variable, say
        ap.error(
            f"--hooks {text!r}: no hook given; expected comma-separated hook names, default or "
            "all (--hooks ddp runs the references compute and ddp alone)"
        )
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if token == "all":
            names += known
        elif token == "default":
            names += default_hooks_set()
        elif token in known or token in NODE_VARIANTS:
            names.append(token)
        elif is_user_hook(token):
            try:
                user_hook_factory(token)  # importable and callable, before any rank starts
            except ValueError as exc:
                ap.error(str(exc))
            names.append(token)
        else:
            ap.error(
                f"--hooks: unknown hook {token!r}; choose from all, default, {', '.join(known)}, "
                "or module:factory for a hook of your own"
            )
    for ref in (BASELINE, COMPUTE):
        if ref not in names:
            names.insert(0, ref)
    return list(dict.fromkeys(names))


def _spec(ap: argparse.ArgumentParser, args: argparse.Namespace) -> ModelSpec:
    """The model the flags describe; flags of the other model and bad shapes are errors."""
    wrong = _GPT_FLAGS if args.model == "mlp" else _MLP_FLAGS
    for key, flag in wrong.items():
        if getattr(args, key) is not None:
            ap.error(f"{flag} {getattr(args, key)}: {flag} is not a flag of --model {args.model}")
    sizes = {
        k: getattr(args, k) if getattr(args, k) is not None else v for k, v in _DEFAULTS.items()
    }
    batch = args.batch if args.batch is not None else _DEFAULT_BATCH[args.model]
    spec = ModelSpec(kind=args.model, layers=args.layers, batch=batch, **sizes)
    if spec.kind == "transformer" and spec.d_model % spec.heads:
        ap.error(
            f"--d-model {spec.d_model} is not divisible by --heads {spec.heads}: every head "
            "needs d_model / heads dimensions"
        )
    return spec


def _size_flags(spec: ModelSpec) -> str:
    """The flags that set the model's size (the transformer's positions too: seq_len x d_model
    parameters)."""
    keys = ["layers", "width"] if spec.kind == "mlp" else ["layers", "d_model", "seq_len", "vocab"]
    return " ".join(f"--{k.replace('_', '-')} {getattr(spec, k)}" for k in keys)


def _device_and_backend(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """What --device and --backend resolve to, checked before any rank starts."""
    if args.device == "cpu":
        if args.backend == "nccl":
            ap.error("--backend nccl needs --device cuda (NCCL reduces GPU tensors only)")
        return {"device": "cpu", "backend": "gloo", "gpus": 0}
    if not torch.cuda.is_available():
        ap.error(
            f"--device cuda: torch {torch.__version__} sees no CUDA device "
            f"(torch.version.cuda={torch.version.cuda}, torch.cuda.is_available() is False); "
            "run on a GPU machine, or drop --device cuda"
        )
    from pycomm import ops

    if not ops.WITH_CUDA:
        ap.error(
            "--device cuda: pycomm._C was built without its CUDA kernels; rebuild with "
            "USE_CUDA=1 pip install --no-build-isolation -e ."
        )
    gpus = torch.cuda.device_count()
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if args.nprocs <= gpus else "gloo"
    if backend == "nccl" and args.nprocs > gpus:
        ap.error(
            f"--backend nccl with --nprocs {args.nprocs}: NCCL needs a GPU per rank and "
            f"{gpus} GPU(s) are visible; use --backend gloo (ranks share GPUs) or fewer ranks"
        )
    return {
        "device": "cuda",
        "backend": backend,
        "gpus": gpus,
        "gpu_name": torch.cuda.get_device_name(0),
        "gpu_bytes": torch.cuda.get_device_properties(0).total_memory,
    }


def memory_estimate(params: int, hooks: int, nprocs: int, error_steps: int) -> int:
    """Bytes a run needs, roughly: per rank and hook the parameters, their gradients, DDP's
    buckets and a hook's buffers (4 x fp32 copies), a reference copy for the error, and ~0.5 GB
    of runtime per rank. Activations are not counted.

    Example:
        >>> round(memory_estimate(8_396_800, 11, 2, 2) / 1e9, 1)
        4.1
    """
    per_rank = hooks * 16 * params + (8 * params if error_steps else 0) + RANK_RUNTIME_BYTES
    return nprocs * per_rank


def _say(text: str) -> None:
    print(f"pycomm.bench: {text}", file=sys.stderr, flush=True)


def _quiet(text: str) -> None:
    pass


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark with command-line flags ``argv``; the exit status (0: at least one
    hook measured).

    Example:
        >>> main(["--hooks", "int8", "--steps", "5", "--json", "out.json"])
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--fsdp" in argv:  # FSDP2's reduce-scatter: a benchmark of its own, with its own flags
        from pycomm.bench import fsdp

        return fsdp.main([a for a in argv if a != "--fsdp"])
    if "--local-sgd" in argv:  # the outer loops: a benchmark of their own, with their own flags
        from pycomm.bench import local_sgd

        return local_sgd.main([a for a in argv if a != "--local-sgd"])
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        import_modules(args.imports)
    except ValueError as exc:
        ap.error(str(exc))
    if args.list_hooks:
        for name in (*available_hooks(), *NODE_VARIANTS):
            print(f"{name:<17}{describe(name, args.accumulate_steps)}")
        return 0
    hooks = _hooks(ap, args.hooks)
    spec = _spec(ap, args)
    _check_outputs(ap, args)
    placed = _device_and_backend(ap, args)
    params = count_params(spec)
    _check_memory(ap, args, spec, params, len(hooks), placed)
    link = _link_config(ap, args)
    if link is None:  # shaping needs a network namespace of its own: rerun in one
        return _in_namespace(argv)
    cfg = _rank_config(args, spec, params, link, placed)
    t0 = time.monotonic()
    result = _measure(args, cfg, hooks, link)
    doc = _document(argv, args, hooks, placed, cfg, link, result, params)
    doc["wall_s"] = time.monotonic() - t0
    print(table(doc), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    if args.plot:
        plot(doc, args.plot)
    return 0 if any(h["status"] == "ok" for h in doc["hooks"].values()) else 1


def _check_outputs(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--error-steps within --steps, and --json/--plot writable (with matplotlib for --plot),
    before any rank starts."""
    if args.error_steps > args.steps:
        ap.error(f"--error-steps {args.error_steps} is more than --steps {args.steps}")
    check_output_paths(ap, args.json, args.plot)


def _check_memory(
    ap: argparse.ArgumentParser,
    args: argparse.Namespace,
    spec: ModelSpec,
    params: int,
    hooks: int,
    placed: dict,
) -> None:
    """An error when the run would not fit in the memory available (on a GPU: the busiest
    one's)."""
    need = memory_estimate(params, hooks, args.nprocs, args.error_steps)
    have = available_memory()
    where = "available"
    if placed["device"] == "cuda":  # the busiest GPU holds ceil(nprocs / gpus) ranks
        share = -(-args.nprocs // placed["gpus"])
        need = need // args.nprocs * share
        have, where = placed["gpu_bytes"], f"on one GPU ({share} rank(s) on it)"
    what = (
        f"{_size_flags(spec)}: {params / 1e6:.1f}M parameters, one copy per hook per rank: "
        f"{hooks} hooks x {args.nprocs} ranks"
    )
    check_memory(ap, what, need, have, where)


def _link_config(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Optional[dict]:
    """What --link and --nodes resolve to, the loopback shaped when this process may; None
    when the run must start again in a network namespace of its own (:func:`_in_namespace`)."""
    if args.nodes > 1 and (args.nprocs % args.nodes or not args.link):
        ap.error(
            f"--nodes {args.nodes}: expected a divisor of --nprocs {args.nprocs} and a --link "
            "RATE for the nodes' uplinks"
        )
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
            return None
        print(
            f"pycomm.bench: --link {args.link}: cannot shape the loopback ({reason}); "
            "running UNSHAPED",
            file=sys.stderr,
        )
        link["reason"] = reason
    elif total and args.nodes > 1:
        link.update(shaped=True, nodes=args.nodes, per_node_bits=per_rank)
    elif total:
        link["qdisc"] = _link.shape_loopback(total)
        link["shaped"] = True
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the namespace's only interface
    elif args._in_netns:
        ap.error(f"{_NETNS_FLAG} is internal and needs --link")
    return link


def _rank_config(
    args: argparse.Namespace, spec: ModelSpec, params: int, link: dict, placed: dict
) -> dict[str, Any]:
    """:func:`pycomm.bench.runner.run_rank`'s ``cfg`` for these flags."""
    per_rank = link["per_rank_bits"]
    # the fp32 gradient over the shaped link: hooks may take that long without hanging
    comm_s = ring_bytes(4 * params, args.nprocs) * 8 / per_rank if link["shaped"] else 0.0
    comm_s *= args.nprocs // args.nodes  # a node's ranks share its uplink
    return {
        "model": spec.config(),
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "bucket_cap_mb": args.bucket_cap_mb,
        "accumulate_steps": args.accumulate_steps,
        "error_steps": args.error_steps,
        "step_timeout": args.step_timeout,
        "comm_s": comm_s,
        "measure_lo": link["shaped"] and args.nodes == 1 and _link.in_private_netns(),
        "nodes": args.nodes,
        "device": placed["device"],
        "backend": placed["backend"],
        "imports": list(dict.fromkeys([*args.imports, *user_modules()])),
    }


def _measure(
    args: argparse.Namespace, cfg: dict[str, Any], hooks: list[str], link: dict
) -> dict[str, Any]:
    """:func:`pycomm.bench.session.measure` on these flags, inside the simulated nodes when
    there are several (their setup goes into ``cfg``, their qdiscs into ``link``)."""
    per_rank = link["per_rank_bits"]
    with Nodes(args.nodes, per_rank) if args.nodes > 1 else contextlib.nullcontext() as nodes:
        if nodes is not None:
            cfg["setup"] = nodes.setup(args.nprocs)
            link["qdisc"] = "; ".join(f"{k}: {v}" for k, v in nodes.qdiscs.items())
        return measure(
            cfg,
            hooks,
            args.nprocs,
            args.timeout,
            log=_quiet if args.quiet else _say,
            progress=not args.quiet and sys.stderr.isatty(),
            rerun_budget_s=args.rerun_budget,
        )


def _document(
    argv: list[str],
    args: argparse.Namespace,
    hooks: list[str],
    placed: dict,
    cfg: dict[str, Any],
    link: dict,
    result: dict[str, Any],
    params: int,
) -> dict[str, Any]:
    """The run's JSON document (what --json writes and the table shows), without its
    ``wall_s``."""
    numbers = result["hooks"]
    ordered = {
        name: {"description": describe(name, args.accumulate_steps), **numbers[name]}
        for name in hooks
    }
    add_ratios(ordered)
    return {
        "command": "python -m pycomm.bench " + " ".join(a for a in argv if a != _NETNS_FLAG),
        "config": {
            "nprocs": args.nprocs,
            "hooks": hooks,
            "gpus": placed["gpus"],
            "gpu_name": placed.get("gpu_name"),
            **{k: v for k, v in cfg.items() if k not in ("measure_lo", "setup")},
            "rerun_budget_s": args.rerun_budget,
            "pycomm_hooks": [h for h in hooks if is_pycomm(h)],
            "timeout_s": args.timeout,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "params": result["params"] or params,
        "link": link,
        "hooks": ordered,
        "failures": result["failures"],
        "launches": result["launches"],
    }


def _in_namespace(argv: list[str]) -> int:
    """Re-run this benchmark, with the same flags, in a private network namespace; its exit
    status."""
    return _link.rerun_in_netns(argv)


if __name__ == "__main__":
    sys.exit(main())
