"""Bytes each rank sends per step as the rank count grows, for the same model.

Runs ``python -m pycomm.bench`` once per rank count (default 2 and 4) with the same model and
hooks, and compares each hook's bytes per rank per step to the first rank count's: from the
hook's own stats and, with ``--link`` (root: the ranks run in a private network namespace),
from what actually crossed that namespace's loopback.

Any all-reduce shaped like a ring sends 2(N-1)/N of its payload per rank: 1x at 2 ranks,
1.5x at 4, 2x as N grows. The two-phase int8 and onebit hooks are built to follow that shape
(an all-gather of compressed buckets would send (N-1)x instead: 3x at 4 ranks).

    python benchmarks/bench_ranks.py [--nprocs 2 4] [--json benchmarks/results/bytes_vs_ranks.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nprocs", type=int, nargs="+", default=[2, 4], help="rank counts")
    ap.add_argument("--hooks", default="allreduce,bf16,int8,onebit", help="hooks to compare")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per hook (bytes only)")
    ap.add_argument("--link", default="10gbit", help="--link for the bench ('' for none)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("bench_args", nargs="*", help="more flags for pycomm.bench, after --")
    args = ap.parse_args()

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.nprocs:
            path = os.path.join(tmp, f"{n}.json")
            cmd = [
                sys.executable, "-m", "pycomm.bench", "--nprocs", str(n), "--hooks", args.hooks,
                "--steps", str(args.steps), "--error-steps", "0", "--quiet", "--json", path,
                *(["--link", args.link] if args.link else []), *args.bench_args,
            ]  # fmt: skip
            print(" ".join(cmd[1:]), file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(path) as f:
                runs[n] = json.load(f)

    base = args.nprocs[0]
    doc = {"hooks": {}, "config": runs[base]["config"], "params": runs[base]["params"]}
    doc["config"]["nprocs"] = args.nprocs
    doc["link"] = {n: runs[n]["link"] for n in args.nprocs}
    first = runs[base]
    print(
        f"MB per rank per step, {first['params'] / 1e6:.1f}M params; ratio: to {base} ranks "
        "(stats: the hook's own count; lo: measured on the private loopback)"
    )
    head = "".join(f"{f'{n} ranks':>12}" for n in args.nprocs)
    print(
        f"{'hook':<12}{'source':<7}{head}" + "".join(f"{f'{n}/{base}':>8}" for n in args.nprocs[1:])
    )
    for name in first["hooks"]:
        if name == "compute":
            continue
        row = {}
        for key, label in (("bytes_per_step", "stats"), ("lo_bytes_per_step", "lo")):
            values = {n: runs[n]["hooks"].get(name, {}).get(key) for n in args.nprocs}
            if any(v is None for v in values.values()):
                continue
            ratios = {n: values[n] / values[base] for n in args.nprocs[1:] if values[base]}
            row[label] = {"bytes": values, "ratio": ratios}
            cells = "".join(f"{values[n] / 1e6:>12.3f}" for n in args.nprocs)
            cells += "".join(f"{ratios.get(n, float('nan')):>7.3f}x" for n in args.nprocs[1:])
            print(f"{name:<12}{label:<7}{cells}")
        doc["hooks"][name] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
