"""Parent side of ``python -m pycomm.bench``: launch the ranks, survive failing hooks, and
turn the ranks' raw times into per-hook numbers.

All hooks run interleaved in one :func:`pycomm.launch`, so they see the same machine at the
same moments. A hook can kill that launch (torch's PowerSGD mis-orders its collectives on gloo
with several buckets and gloo aborts the process), so when a launch fails the hook that was
running on the failing rank (each rank keeps a progress file) is marked failed, rerun alone
to tell a deterministic failure from a racy one, and the others are rerun interleaved without
it. When no hook can be blamed, the launch is retried once (start-up failures are often
transient), then each hook is rerun alone to find the ones that fail.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import pycomm
from pycomm.bench.runner import run_rank
from pycomm.dist import LaunchTimeoutError

Log = Callable[[str], None]


def _stderr_log(text: str) -> None:
    print(f"pycomm.bench: {text}", file=sys.stderr, flush=True)


def _read(path: str, limit: int = 8000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text[-limit:]


def _blame(error: pycomm.LaunchError, workdir: str, nprocs: int) -> Optional[str]:
    """The hook the failing rank was setting up or stepping, else the one hook any rank was
    in; None when the failure happened outside any hook (a barrier, start-up)."""
    where = {r: _read(os.path.join(workdir, f"rank{r}.progress")).strip() for r in range(nprocs)}

    def hook_of(text: str) -> Optional[str]:
        parts = text.split()
        if len(parts) >= 2 and parts[0] in ("setup", "step"):
            return parts[1]
        return None

    failing = [error.rank] if error.rank is not None else []
    failing += list(getattr(error, "unfinished", ()))
    for r in failing:
        if r in where and hook_of(where[r]):
            return hook_of(where[r])
    names = {hook_of(text) for text in where.values()} - {None}
    return names.pop() if len(names) == 1 else None


def _summary(error: pycomm.LaunchError, stderr: str, seconds: float) -> str:
    """One line: how the rank failed and the message that says why."""
    head = str(error).splitlines()[0]
    if isinstance(error, LaunchTimeoutError):
        return f"timed out: no result after {seconds:g} s (see --timeout)"
    if error.traceback:
        lines = [ln.strip() for ln in error.traceback.strip().splitlines() if ln.strip()]
        return lines[-1] if lines else head
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    why = next((ln.split("what():", 1)[1].strip() for ln in lines if "what():" in ln), None)
    if why is None and lines:
        why = lines[-1]
    return f"{head}: {why}" if why else head


def _launch(
    cfg: dict[str, Any], hooks: list[str], nprocs: int, timeout: float, log: Log
) -> dict[str, Any]:
    """One pycomm.launch of ``hooks``; the ranks' results, or why it failed and whom to blame."""
    workdir = tempfile.mkdtemp(prefix="pycomm-bench-")
    t0 = time.monotonic()
    record: dict[str, Any] = {"hooks": list(hooks)}
    try:
        results = pycomm.launch(
            run_rank,
            nprocs,
            {**cfg, "hooks": list(hooks), "workdir": workdir},
            backend="gloo",
            timeout=timeout,
        )
        record.update(ok=True, results=results)
    except pycomm.LaunchError as error:
        rank = error.rank if error.rank is not None else 0
        stderr = _read(os.path.join(workdir, f"rank{rank}.stderr"))
        record.update(
            ok=False,
            blame=_blame(error, workdir, nprocs),
            error=_summary(error, stderr, timeout),
            detail=f"{error}\n--- rank {rank} stderr (tail) ---\n{stderr}".strip(),
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        record["wall_s"] = time.monotonic() - t0
    if record["ok"]:
        log(f"launch of {', '.join(hooks)}: ok ({record['wall_s']:.1f} s)")
    else:
        who = f"in hook {record['blame']}" if record["blame"] else "outside any hook"
        log(f"launch of {', '.join(hooks)} failed {who}: {record['error']}")
    return record


def _per_hook(results: list[dict[str, Any]], mode: str) -> dict[str, dict[str, Any]]:
    """Per-hook numbers from every rank's result: a step lasts until its slowest rank is done."""
    nprocs = len(results)
    out = {}
    for name, r0 in results[0]["hooks"].items():
        per_rank = [r["hooks"][name]["times_s"] for r in results]
        steps = [max(ts) for ts in zip(*per_rank)]
        lo = r0["lo_bytes"]
        out[name] = {
            "status": "ok",
            "error": None,
            "measured": mode,
            "median_s": statistics.median(steps),
            "min_s": min(steps),
            "max_s": max(steps),
            "bytes_per_step": r0["bytes_per_step"],
            "bytes_source": r0["bytes_source"],
            # every rank's packets cross the one lo once: the share of one rank
            "lo_bytes_per_step": statistics.median(lo) / nprocs if lo else None,
            "bucket_sizes": r0["bucket_sizes"],
            "step_times_s": steps,
            "rank_step_times_s": per_rank,
        }
    return out


def measure(
    cfg: dict[str, Any],
    hooks: list[str],
    nprocs: int,
    timeout: float,
    log: Log = _stderr_log,
) -> dict[str, Any]:
    """Time ``hooks`` (interleaved, see the module docstring); failures are reported, not raised.

    Returns ``{"params", "hooks": {name: {...}}, "failures": [...], "launches": [...]}``.
    """
    remaining = list(hooks)
    launches: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    numbers: dict[str, dict[str, Any]] = {}
    params = None

    def run(names: list[str]) -> dict[str, Any]:
        nonlocal params
        record = _launch(cfg, names, nprocs, timeout, log)
        launches.append({k: v for k, v in record.items() if k not in ("results", "detail")})
        if record["ok"]:
            params = record["results"][0]["params"]
        return record

    def fail(name: str, record: dict[str, Any], alone: Optional[dict[str, Any]]) -> None:
        failures.append(
            {
                "hook": name,
                "error": record["error"],
                "detail": record["detail"],
                "with": record["hooks"],
                "alone": alone,
            }
        )
        remaining.remove(name)

    while remaining:
        record = run(remaining)
        if record["ok"]:
            numbers.update(_per_hook(record["results"], "interleaved"))
            break
        suspect = record["blame"] if record["blame"] in remaining else None
        if suspect is None:
            # Outside any hook (start-up, a barrier): often transient, e.g. a gloo connection
            # refused on a busy loopback. Once more before blaming each hook in turn.
            log("no hook to blame; retrying the same launch once")
            record = run(remaining)
            if record["ok"]:
                numbers.update(_per_hook(record["results"], "interleaved"))
                break
            suspect = record["blame"] if record["blame"] in remaining else None
        if suspect is not None and len(remaining) > 1:
            again = run([suspect])
            if again["ok"]:
                alone = {"status": "ok", **_per_hook(again["results"], "alone")[suspect]}
                log(f"{suspect} passed when rerun alone: its failure is intermittent")
            else:
                alone = {"status": "failed", "error": again["error"]}
            fail(suspect, record, alone)
            continue
        if suspect is not None:
            fail(suspect, record, None)
            continue
        # Nobody to blame: each hook alone shows which ones fail.
        alone_numbers: dict[str, dict[str, Any]] = {}
        culprits = []
        for name in list(remaining):
            again = run([name])
            if again["ok"]:
                alone_numbers.update(_per_hook(again["results"], "alone"))
            else:
                culprits.append((name, again))
        for name, again in culprits:
            fail(name, again, {"status": "failed", "error": again["error"]})
        if not culprits:
            # Every hook works alone but not together: keep the numbers from separate launches.
            failures.append(
                {
                    "hook": None,
                    "error": record["error"],
                    "detail": record["detail"],
                    "with": record["hooks"],
                    "alone": None,
                }
            )
            numbers.update(alone_numbers)
            break

    for failure in failures:
        if failure["hook"] is not None:
            numbers[failure["hook"]] = {
                "status": "failed",
                "error": failure["error"],
                "measured": None,
                "alone": failure["alone"],
            }
    return {"params": params, "hooks": numbers, "failures": failures, "launches": launches}
