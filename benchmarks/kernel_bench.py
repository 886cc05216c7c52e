"""What the kernel microbenchmarks share: timing side by side, the copy floor, the table, JSON.

Ours and the other side are timed in alternation, rep by rep, so that noise on this shared
machine hits both alike. Each timed call (the copy floor's included) follows untimed calls of
the same op for ``--warm-ms`` (right after another op, even after a sleep, this machine needs
~5 back-to-back calls of a 1-2 ms op to reach its steady speed), or a cache scrub (``--cold``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Callable

import torch


def add_arguments(ap: argparse.ArgumentParser, reps: int) -> None:
    ap.add_argument("--mb", type=float, default=25.0, help="bucket size in MB (fp32)")
    ap.add_argument("--reps", type=int, default=reps, help="timed repetitions per case")
    ap.add_argument(
        "--warm-ms",
        type=float,
        default=10.0,
        help="untimed calls of the same op, for at least this long, before each timed call",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="instead, overwrite a --scrub-mb buffer before each timed call (copy "
        "floor included), so that every call starts from memory",
    )
    ap.add_argument("--scrub-mb", type=float, default=1024.0, help="scrub size for --cold")
    ap.add_argument("--json", default=None, help="write the results here")


class Bench:
    """Cases timed against ``other`` (the label of the other side) and the copy floor of a
    bucket of ``n`` fp32 elements."""

    def __init__(self, args: argparse.Namespace, n: int, other: str) -> None:
        self.args, self.n, self.other, self.rows = args, n, other, []
        if args.cold:
            scrub = torch.empty(int(args.scrub_mb * 1e6 / 4))
            self._before = lambda f: scrub.fill_(1.0)
        else:
            self._before = self._warm
        src, dst = torch.randn(n), torch.empty(n)
        self.copy_s, _ = self.median_pair(lambda: dst.copy_(src), lambda: None)
        self.copy_gbs = 2 * n * 4 / self.copy_s / 1e9

    def _warm(self, f: Callable) -> None:
        end = time.perf_counter() + self.args.warm_ms / 1e3
        f()
        while time.perf_counter() < end:
            f()

    def median_pair(self, fa: Callable, fb: Callable) -> tuple[float, float]:
        """Median seconds of fa and fb, timed in alternation."""
        for _ in range(2):
            fa()
            fb()
        ta, tb = [], []
        for _ in range(self.args.reps):
            self._before(fa)
            t0 = time.perf_counter()
            fa()
            t1 = time.perf_counter()
            self._before(fb)
            t2 = time.perf_counter()
            fb()
            t3 = time.perf_counter()
            ta.append(t1 - t0)
            tb.append(t3 - t2)
        return statistics.median(ta), statistics.median(tb)

    def case(self, name: str, nbytes: int, ours: Callable, theirs: Callable) -> None:
        """Time one case; ``nbytes``: bytes one call of ours reads and writes."""
        t_ours, t_other = self.median_pair(ours, theirs)
        gbs = nbytes / t_ours / 1e9
        self.rows.append(
            {
                "case": name,
                "bytes": nbytes,
                "ours_ms": t_ours * 1e3,
                f"{self.other}_ms": t_other * 1e3,
                "ours_gbs": gbs,
                "copy_over_ours": self.copy_gbs / gbs,
                f"speedup_vs_{self.other}": t_other / t_ours,
            }
        )

    def report(self, **config) -> None:
        """Print the table; write JSON with ``config`` when --json was given."""
        a = self.args
        state = "cold (scrubbed caches)" if a.cold else f"warm (after {a.warm_ms:g} ms of calls)"
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.mb:g} MB "
            f"buckets ({self.n} elements), median of {a.reps}, {state}"
        )
        print(f"copy_ floor: {self.copy_gbs:.2f} GB/s ({self.copy_s * 1e3:.2f} ms for {a.mb:g} MB)")
        self.print_table()
        if a.json:
            with open(a.json, "w") as f:
                json.dump(
                    {
                        "torch": torch.__version__,
                        "threads": torch.get_num_threads(),
                        "machine": platform.machine(),
                        "mb": a.mb,
                        "numel": self.n,
                        "reps": a.reps,
                        "state": "cold" if a.cold else f"warm {a.warm_ms:g} ms",
                        **config,
                        "copy_gbs": self.copy_gbs,
                        "rows": self.rows,
                    },
                    f,
                    indent=1,
                )

    def print_table(self) -> None:
        """The cases' table: ours, the other side, GB/s, the copy floor's ratio, speedup."""
        o = self.other
        width = max(28, max(len(r["case"]) for r in self.rows) + 2)
        print(
            f"{'case':<{width}}{'ours ms':>9}{o + ' ms':>10}{'ours GB/s':>11}{'copy/ours':>11}"
            f"{'vs ' + o:>10}"
        )
        for r in self.rows:
            print(
                f"{r['case']:<{width}}{r['ours_ms']:>9.3f}{r[o + '_ms']:>10.3f}"
                f"{r['ours_gbs']:>11.2f}{r['copy_over_ours']:>10.2f}x"
                f"{r['speedup_vs_' + o]:>9.2f}x"
            )
