"""Parent side of ``python -m pycomm.bench``: launch the ranks, survive failing hooks, and
turn the ranks' raw times into per-hook numbers.

All hooks run interleaved in one :func:`pycomm.launch`, so they see the same machine at the
same moments. A hook can kill that launch (torch's PowerSGD mis-orders its collectives on gloo
with several buckets and gloo aborts the process), so when a launch fails the hook that was
running on the failing rank (each rank keeps a progress file) is marked failed and the others
are rerun interleaved without it; once they are measured, each failed hook is rerun alone (to
tell a deterministic failure from a racy one) while a time budget lasts. When no hook can be
blamed, the launch is retried once (start-up failures are often transient), then each hook
is rerun alone to find the ones that fail. A hook whose setup
raises (``pycomm.wrap`` refusing an option) is dropped by every rank inside the launch and
reported without a relaunch. A hang costs one per-step deadline (see runner.py), not the
launch timeout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

import pycomm
from pycomm.bench.report import short_error
from pycomm.bench.runner import BASELINE, COMPUTE, run_rank
from pycomm.launcher import LaunchTimeoutError

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
        if len(parts) >= 2 and parts[0] in ("setup", "step", "error"):
            return parts[2] if parts[0] == "error" else parts[1]
        if len(parts) >= 3 and parts[:2] == ["barrier", "after"]:
            return parts[2]  # its own step is over; some other rank's is not
        return None

    failing = [error.rank] if error.rank is not None else []
    failing += list(getattr(error, "unfinished", ()))
    for r in failing:
        if r in where and hook_of(where[r]):
            return hook_of(where[r])
    names = {hook_of(text) for text in where.values()} - {None}
    return names.pop() if len(names) == 1 else None


_HUNG = re.compile(r"^Timeout \(([0-9:.]+)\)!", re.MULTILINE)


def _summary(error: pycomm.LaunchError, stderr: str, seconds: float, hung: Optional[str]) -> str:
    """One line: how the rank failed and the message that says why."""
    head = str(error).splitlines()[0]
    if hung:
        return (
            f"hung: a step made no progress for {hung} (the per-step deadline, see "
            "--step-timeout); the ranks were stopped (their stacks are in the JSON)"
        )
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


class _Bar:
    """A tqdm bar on stderr that follows rank 0's progress file (hook setups and steps done);
    nothing when disabled or without tqdm."""

    def __init__(self, path: str, total: int, desc: str, enabled: bool) -> None:
        self.bar = None
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)
        self.path, self.stop = path, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.wait(0.25):
            m = re.search(r"(\d+)/(\d+)\s*$", _read(self.path, 200))
            if m:
                done, total = int(m.group(1)), int(m.group(2))
                if total != self.bar.total:
                    self.bar.total = total
                if done > self.bar.n:
                    self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.stop.set()
            self.thread.join()
            self.bar.close()


def units(cfg: dict[str, Any], hooks: list[str]) -> int:
    """Work units of one launch as a rank counts them: each hook's setup and each of its steps.

    Example:
        >>> units({"warmup": 3, "steps": 20}, ["compute", "ddp"])
        48
    """
    return len(hooks) * (1 + cfg.get("warmup", 0) + cfg["steps"])


def _launch(
    cfg: dict[str, Any],
    hooks: list[str],
    nprocs: int,
    timeout: float,
    log: Log,
    progress: bool = False,
    number: int = 1,
) -> dict[str, Any]:
    """One pycomm.launch of ``hooks``; the ranks' results, or why it failed and whom to blame."""
    workdir = tempfile.mkdtemp(prefix="pycomm-bench-")
    t0 = time.monotonic()
    record: dict[str, Any] = {"hooks": list(hooks)}
    what = hooks[0] if len(hooks) == 1 else f"{len(hooks)} hooks"
    bar = _Bar(
        os.path.join(workdir, "rank0.progress"),
        units(cfg, hooks),
        f"launch {number} ({what}, {nprocs} ranks)",
        progress,
    )
    try:
        results = pycomm.launch(
            run_rank,
            nprocs,
            {**cfg, "hooks": list(hooks), "workdir": workdir},
            backend=cfg.get("backend", "gloo"),
            timeout=timeout,
            setup=cfg.get("setup"),
        )
        record.update(ok=True, results=results)
    except pycomm.LaunchError as error:
        rank = error.rank if error.rank is not None else 0
        stderrs = [_read(os.path.join(workdir, f"rank{r}.stderr")) for r in range(nprocs)]
        hung = next((m.group(1) for m in map(_HUNG.search, stderrs) if m), None)
        stderr = stderrs[rank] if rank < nprocs else ""
        tails = "\n".join(
            f"--- rank {r} stderr (tail) ---\n{text.strip()}"
            for r, text in enumerate(stderrs)
            if text.strip() and (r == rank or hung)
        )
        record.update(
            ok=False,
            # where each rank was when the launch failed, e.g. "step torch-powersgd1 9 107/253"
            progress={
                r: _read(os.path.join(workdir, f"rank{r}.progress")).strip() for r in range(nprocs)
            },
            blame=_blame(error, workdir, nprocs),
            rounds=_rounds(workdir, nprocs),
            error=_summary(error, stderr, timeout, hung),
            hung=bool(hung),
            detail=f"{error}\n{tails}".strip(),
        )
    finally:
        bar.close()
        shutil.rmtree(workdir, ignore_errors=True)
        record["wall_s"] = time.monotonic() - t0
    if record["ok"]:
        log(f"launch of {', '.join(hooks)}: ok ({record['wall_s']:.1f} s)")
    else:
        who = f"in hook {record['blame']}" if record["blame"] else "outside any hook"
        log(f"launch of {', '.join(hooks)} failed {who}: {short_error(record['error'])}")
    return record


def _rounds(workdir: str, nprocs: int) -> list[dict[str, list[float]]]:
    """The timed rounds every rank completed before a launch failed: one ``{hook: [seconds on
    each rank]}`` per round, in order."""
    per_rank = []
    for r in range(nprocs):
        rows = {}
        for line in _read(os.path.join(workdir, f"rank{r}.rounds"), 10**7).splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by the failure
            rows[row["step"]] = row["times"]
        per_rank.append(rows)
    steps = sorted(set.intersection(*(set(rows) for rows in per_rank))) if per_rank else []
    return [{name: [rows[s][name] for rows in per_rank] for name in per_rank[0][s]} for s in steps]


def _per_hook(
    results: list[dict[str, Any]],
    mode: str,
    salvaged: Optional[list[dict[str, list[float]]]] = None,
) -> dict[str, dict[str, Any]]:
    """Per-hook numbers from every rank's result: a step lasts until its slowest rank is done.
    ``salvaged``: earlier rounds of the same hooks from launches that another hook killed."""
    nprocs = len(results)
    out = {}
    for name, r0 in results[0]["hooks"].items():
        per_rank = [r["hooks"][name]["times_s"] for r in results]
        early = [row[name] for row in salvaged or () if name in row]
        if early:
            per_rank = [[row[r] for row in early] + ts for r, ts in enumerate(per_rank)]
            salvaged_steps = len(early)
        else:
            salvaged_steps = 0
        steps = [max(ts) for ts in zip(*per_rank)]
        lo = r0["lo_bytes"]
        out[name] = {
            "status": "ok",
            "error": None,
            "measured": mode,
            "median_s": statistics.median(steps),
            "min_s": min(steps),
            "max_s": max(steps),
            # process CPU time per step (all threads), mean over ranks, median over steps
            "cpu_median_s": statistics.median(
                statistics.fmean(cs) for cs in zip(*(r["hooks"][name]["cpu_s"] for r in results))
            )
            if r0.get("cpu_s")
            else None,
            "bytes_per_step": r0["bytes_per_step"],
            "bytes_source": r0["bytes_source"],
            # every rank's packets cross the one lo once: the share of one rank
            "lo_bytes_per_step": statistics.median(lo) / nprocs if lo else None,
            # simulated nodes: what each node's first rank read on its uplink, mean over nodes
            "uplink_bytes_per_step": _uplink(results, name),
            "bucket_sizes": r0["bucket_sizes"],
            "gpu_peak_bytes": max((r["hooks"][name].get("gpu_peak_bytes") or 0) for r in results)
            or None,
            # every rank computes the same reduced gradient and the same exact mean
            "rel_err": statistics.median(r0["rel_errors"]) if r0["rel_errors"] else None,
            "rel_err_max": max(r0["rel_errors"]) if r0["rel_errors"] else None,
            "rel_errors": r0["rel_errors"],
            "step_times_s": steps,
            "rank_step_times_s": per_rank,
            # the first ones from launches that another, failing hook stopped
            "salvaged_steps": salvaged_steps,
            # hook="auto": its decision (the same on every rank)
            "auto": r0.get("auto"),
        }
    return out


def _uplink(results: list[dict[str, Any]], name: str) -> Optional[float]:
    """Bytes one node sends across its uplink per step (median over steps, mean over nodes)."""
    per_node = [r["hooks"][name].get("uplink_bytes") for r in results]
    per_node = [statistics.median(b) for b in per_node if b]
    return statistics.fmean(per_node) if per_node else None


def measure(
    cfg: dict[str, Any],
    hooks: list[str],
    nprocs: int,
    timeout: float,
    log: Log = _stderr_log,
    progress: bool = False,
    rerun_budget_s: float = 60.0,
) -> dict[str, Any]:
    """Time ``hooks`` (interleaved, see the module docstring); failures are reported, not raised.

    ``cfg`` is :func:`pycomm.bench.runner.run_rank`'s; ``progress`` shows a tqdm bar on stderr;
    hooks that failed are rerun alone at the end, each started only while less than
    ``rerun_budget_s`` seconds have gone into such reruns.
    Returns ``{"params", "hooks": {name: {...}}, "failures": [...], "launches": [...]}``.

    Example:
        >>> measure({"model": {"width": 16, "layers": 2}, "steps": 2}, ["compute", "ddp"], 2, 60)
    """
    session = _Session(cfg, hooks, nprocs, timeout, log, progress)
    while session.remaining:
        if session.round():
            break
    session.rerun_deferred(rerun_budget_s)
    return session.summary()


def _failure(
    hook: Optional[str],
    phase: str,
    record: dict[str, Any],
    text: Optional[str] = None,
    alone: Optional[dict[str, Any]] = None,
    with_: Optional[list[str]] = None,
) -> dict[str, Any]:
    """One entry of :func:`measure`'s ``failures``: the launch ``record``'s error, detail and
    hooks, unless ``text`` (a setup error: both) or ``with_`` say otherwise."""
    return {
        "hook": hook,
        "phase": phase,
        "error": record["error"] if text is None else text,
        "detail": record["detail"] if text is None else text,
        "with": record["hooks"] if with_ is None else with_,
        "alone": alone,
    }


class _Session:
    """:func:`measure`'s launches: the hooks still to measure, the ones that failed (and which
    to rerun alone at the end), the numbers so far, every launch's record."""

    def __init__(
        self,
        cfg: dict[str, Any],
        hooks: list[str],
        nprocs: int,
        timeout: float,
        log: Log,
        progress: bool,
    ) -> None:
        self.cfg, self.nprocs, self.timeout = cfg, nprocs, timeout
        self.log, self.progress = log, progress
        self.remaining = list(hooks)
        self.deferred: list[str] = []
        self.launches: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.numbers: dict[str, dict[str, Any]] = {}
        self.params = None
        # Timed rounds of the remaining hooks from launches another hook killed: the next
        # interleaved launch only runs the steps still missing.
        self.salvaged: list[dict[str, list[float]]] = []

    def run(self, names: list[str], resume: bool = False) -> dict[str, Any]:
        """One launch of ``names``; hooks whose setup failed are failures from here on."""
        use = self.cfg
        if resume and self.salvaged:
            left = max(1, self.cfg["steps"] - len(self.salvaged))
            use = {
                **self.cfg,
                "steps": left,
                "error_steps": min(self.cfg.get("error_steps", 0), left),
            }
        n = len(self.launches) + 1
        record = _launch(use, names, self.nprocs, self.timeout, self.log, self.progress, n)
        record["steps"] = use["steps"]
        self.launches.append(
            {
                **{k: v for k, v in record.items() if k not in ("results", "detail", "rounds")},
                "rounds_completed": len(record.get("rounds") or ()),
            }
        )
        if record["ok"]:
            self.params = record["results"][0]["params"]
            for name, text in record["results"][0]["setup_failures"].items():
                self.log(f"{name} failed while setting up: {text}")
                if name in self.remaining:
                    self.failures.append(_failure(name, "setup", record, text=text))
                    self.remaining.remove(name)
        return record

    def alone_result(self, name: str, again: dict[str, Any]) -> dict[str, Any]:
        if again["ok"] and name in again["results"][0]["hooks"]:
            self.log(f"{name} passed when rerun alone: its failure is intermittent")
            return {"status": "ok", **_per_hook(again["results"], "alone")[name]}
        if again["ok"]:
            return {"status": "failed", "error": again["results"][0]["setup_failures"][name]}
        return {"status": "failed", "error": again["error"]}

    def fail(self, name: str, record: dict[str, Any], alone: Optional[dict[str, Any]]) -> None:
        phase = "hung" if record.get("hung") else "step"
        self.failures.append(_failure(name, phase, record, alone=alone))
        self.remaining.remove(name)

    def keep_rounds(self, record: dict[str, Any], suspect: str) -> None:
        rounds = record.get("rounds") or []
        rounds = rounds[: max(0, self.cfg["steps"] - len(self.salvaged))]
        self.salvaged.extend({k: v for k, v in row.items() if k != suspect} for row in rounds)
        if rounds:
            self.log(
                f"keeping the {len(rounds)} timed steps of the other hooks done before it failed"
            )

    def _suspect(self, record: dict[str, Any]) -> Optional[str]:
        return record["blame"] if record["blame"] in self.remaining else None

    def round(self) -> bool:
        """One interleaved launch of the remaining hooks and what its failure says; True when
        measuring is over."""
        record = self.run(self.remaining, resume=True)
        if not record["ok"] and self._suspect(record) is None:
            # Outside any hook (start-up, a barrier): often transient, e.g. a gloo connection
            # refused on a busy loopback. Once more before blaming each hook in turn.
            self.log("no hook to blame; retrying the same launch once")
            record = self.run(self.remaining, resume=True)
        if record["ok"]:
            self.numbers.update(_per_hook(record["results"], "interleaved", self.salvaged))
            return True
        suspect = self._suspect(record)
        if suspect in (COMPUTE, BASELINE) and len(self.remaining) > 1:
            return self._reference_failed(suspect, record)
        if suspect is not None:
            # Rerun alone later, once the others are measured, while --rerun-budget lasts.
            self.keep_rounds(record, suspect)
            self.fail(suspect, record, None)
            if len(record["hooks"]) > 1:
                self.deferred.append(suspect)
            return False
        return self._each_alone(record)

    def _reference_failed(self, suspect: str, record: dict[str, Any]) -> bool:
        """compute or ddp was blamed: alone it tells a hook's failure from the machine's."""
        again = self.run([suspect])
        if again["ok"]:
            self.fail(suspect, record, self.alone_result(suspect, again))
            return False
        # Even a reference fails alone: the machine, not a hook (no namespace, no loopback, a
        # broken install). Blaming each hook in turn would take minutes.
        self.log(f"{suspect} failed alone too: giving up on every hook")
        self.failures.append(_failure(None, "environment", again, with_=[suspect]))
        for name in list(self.remaining):
            self.fail(name, record, {"status": "failed", "error": again["error"]})
        return True

    def _each_alone(self, record: dict[str, Any]) -> bool:
        """Nobody to blame: each hook alone shows which ones fail."""
        alone_numbers: dict[str, dict[str, Any]] = {}
        culprits = []
        for name in list(self.remaining):
            again = self.run([name])
            if again["ok"]:
                alone_numbers.update(_per_hook(again["results"], "alone"))
            elif name in self.remaining:
                culprits.append((name, again))
        for name, again in culprits:
            self.fail(name, again, {"status": "failed", "error": again["error"]})
        if culprits:
            return False
        # Every hook works alone but not together: keep the numbers from separate launches.
        self.failures.append(_failure(None, "interleaved", record))
        self.numbers.update(alone_numbers)
        return True

    def rerun_deferred(self, budget_s: float) -> None:
        """Rerun each failed hook alone: an intermittent failure (torch's PowerSGD on gloo)
        passes."""
        started = time.monotonic()
        for failure in self.failures:
            name = failure["hook"]
            if name not in self.deferred:
                continue
            if time.monotonic() - started >= budget_s:
                failure["alone"] = {"status": "skipped", "error": "--rerun-budget spent"}
                continue
            failure["alone"] = self.alone_result(name, self.run([name]))

    def summary(self) -> dict[str, Any]:
        numbers = dict(self.numbers)
        for failure in self.failures:
            if failure["hook"] is not None:
                numbers[failure["hook"]] = {
                    "status": "failed",
                    "error": failure["error"],
                    "phase": failure["phase"],
                    "measured": None,
                    "alone": failure["alone"],
                }
        return {
            "params": self.params,
            "hooks": numbers,
            "failures": self.failures,
            "launches": self.launches,
        }
