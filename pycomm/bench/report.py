"""The benchmark's report: ratios between hooks, the printed table and the plot."""

from __future__ import annotations

import re
from typing import Any, Optional

from pycomm.bench.link import format_rate
from pycomm.bench.models import ModelSpec
from pycomm.bench.runner import BASELINE, COMPUTE


def add_ratios(hooks: dict[str, dict[str, Any]]) -> None:
    """``ratio_to_compute`` (step time / compute-only step time) and ``speedup_vs_ddp``
    (plain DDP's step time / this one), from medians measured side by side.

    Example:
        >>> hooks = {"compute": {"status": "ok", "median_s": 0.05},
        ...          "ddp": {"status": "ok", "median_s": 0.15}}
        >>> add_ratios(hooks)
        >>> hooks["ddp"]["ratio_to_compute"], hooks["compute"]["speedup_vs_ddp"]
        (3.0, 3.0)
    """

    def median(name: str) -> Optional[float]:
        h = hooks.get(name)
        return h["median_s"] if h and h["status"] == "ok" and "median_s" in h else None

    compute, ddp = median(COMPUTE), median(BASELINE)
    for h in hooks.values():
        m = h.get("median_s") if h["status"] == "ok" else None
        h["ratio_to_compute"] = m / compute if m and compute else None
        h["speedup_vs_ddp"] = ddp / m if m and ddp else None


def _num(
    value: Optional[float], width: int, digits: int, scale: float = 1.0, x: bool = False
) -> str:
    if value is None:
        return f"{'-':>{width}}"
    text = f"{value * scale:.{digits}f}" + ("x" if x else "")
    return f"{text:>{width}}"


def header(doc: dict[str, Any]) -> list[str]:
    """The lines above the table: ranks, model, steps, buckets, link."""
    c, link = doc["config"], doc["link"]
    spec = ModelSpec(**c["model"])
    where = c.get("device", "cpu")
    if where == "cuda":
        gpus = c.get("gpus") or 1
        where = f"on {min(gpus, c['nprocs'])} GPU(s), {c.get('gpu_name', 'CUDA')}"
    lines = [
        f"{c['nprocs']} ranks ({c.get('backend', 'gloo')}, {where}), "
        f"{spec.describe(doc.get('params'))}, {c['threads']} torch thread(s)/rank",
        f"{c['steps']} timed steps (+{c['warmup']} warm-up) per hook, hooks interleaved step by "
        "step; a step lasts until its slowest rank is done",
    ]
    kept = max((h.get("salvaged_steps") or 0 for h in doc["hooks"].values()), default=0)
    if kept:
        lines.append(
            f"the first {kept} timed steps of the hooks interleaved with one that failed come "
            "from the launch(es) it stopped; the rest from a launch without it"
        )
    k = c.get("accumulate_steps", 1)
    if k > 1:
        lines.append(
            f"a step is one optimizer step of {k} micro-steps (loss / {k} each): pycomm hooks "
            f"through wrap(accumulate_steps={k}), ddp and torch's hooks with no_sync() on the "
            f"first {k - 1}"
        )
    buckets = doc["hooks"].get(BASELINE, {}).get("bucket_sizes")
    if buckets:
        sizes = ", ".join(f"{b / 1e6:.1f}" for b in buckets)
        cap = c.get("bucket_cap_mb")
        which = "default bucket_cap_mb" if cap is None else f"bucket_cap_mb={cap:g}"
        lines.append(f"plain DDP's buckets ({which}, after DDP's rebuild): {sizes} MB")
    if link.get("nodes"):
        lines.append(
            f"link: {link['nodes']} simulated nodes of {c['nprocs'] // link['nodes']} ranks, "
            f"each node's uplink and downlink {format_rate(link['per_node_bits'])} (tc tbf on "
            "its veth, network namespaces joined by a bridge); inside a node unshaped"
        )
    elif link["shaped"]:
        lines.append(
            f"link: {format_rate(link['per_rank_bits'])} per rank (tc tbf "
            f"{format_rate(link['total_bits'])} on lo, in a private network namespace)"
        )
    elif link["requested"]:
        lines.append(f"link: UNSHAPED loopback ({link['requested']} requested: {link['reason']})")
    else:
        lines.append("link: unshaped loopback")
    return lines


def _err(value: Optional[float], width: int) -> str:
    return f"{'-' if value is None else f'{value:.1e}':>{width}}"


def table(doc: dict[str, Any]) -> str:
    """The per-hook table, then one line per failure, then what the columns mean.

    Example:
        >>> print(table(json.load(open("benchmarks/results/bench_2.5gbit.json"))))
    """
    lines = header(doc)
    hooks = doc["hooks"]
    measured_lo = any(h.get("lo_bytes_per_step") is not None for h in hooks.values())
    measured_up = any(h.get("uplink_bytes_per_step") is not None for h in hooks.values())
    errors = any(h.get("rel_err") is not None for h in hooks.values())
    cols = f"{'hook':<17}{'median ms':>10}{'min ms':>9}{'max ms':>9}{'/compute':>10}{'vs ddp':>8}"
    cpu = any(h.get("cpu_median_s") is not None for h in hooks.values())
    cols += f"{'cpu ms':>8}" if cpu else ""
    gpu = any(h.get("gpu_peak_bytes") for h in hooks.values())
    cols += f"{'MB/step':>9}" + (f"{'lo MB/step':>12}" if measured_lo else "")
    cols += f"{'uplink MB/step':>16}" if measured_up else ""
    cols += f"{'GPU GB':>8}" if gpu else ""
    cols += (f"{'rel err':>9}" if errors else "") + "  status"
    lines.append(cols)
    for name, h in hooks.items():
        ok = h["status"] == "ok"
        row = f"{name:<17}"
        row += _num(h.get("median_s") if ok else None, 10, 1, 1e3)
        row += _num(h.get("min_s") if ok else None, 9, 1, 1e3)
        row += _num(h.get("max_s") if ok else None, 9, 1, 1e3)
        row += _num(h.get("ratio_to_compute"), 10, 2, x=True)
        row += _num(h.get("speedup_vs_ddp"), 8, 2, x=True)
        if cpu:
            row += _num(h.get("cpu_median_s") if ok else None, 8, 1, 1e3)
        row += _num(h.get("bytes_per_step") if ok else None, 9, 2, 1e-6)
        if measured_lo:
            row += _num(h.get("lo_bytes_per_step") if ok else None, 12, 2, 1e-6)
        if measured_up:
            row += _num(h.get("uplink_bytes_per_step") if ok else None, 16, 2, 1e-6)
        if gpu:
            row += _num(h.get("gpu_peak_bytes") if ok else None, 8, 2, 1e-9)
        if errors:
            row += _err(h.get("rel_err") if ok else None, 9)
        status = "ok" if ok else "FAILED (below)"
        if ok and h.get("measured") == "alone":
            status = "ok (alone)"
        if ok and h.get("auto"):
            status += f", chose {choice(h['auto'])}"
        lines.append(f"{row}  {status}")
    for f in doc["failures"]:
        who = f["hook"] or f"({f.get('phase') or 'interleaved'} run)"
        where = {"setup": " while setting up"}.get(f.get("phase"), "")
        lines.append(f"{who} failed{where}: {short_error(f['error'])}")
        alone = f.get("alone")
        if alone and alone["status"] == "ok":
            lines.append(
                f"  rerun alone it passed ({alone['median_s'] * 1e3:.1f} ms median): intermittent"
            )
        elif alone and alone["status"] == "skipped":
            lines.append("  not rerun alone: --rerun-budget spent")
        elif alone:
            lines.append("  rerun alone it failed again")
        if f["hook"] is None and f.get("phase") == "environment":
            lines.append("  a reference hook failed alone: the machine or the install, not a hook")
        elif f["hook"] is None:
            lines.append("  every hook passed alone: the numbers above come from separate launches")
    if cpu:
        lines.append(
            "cpu ms: CPU time of one rank's process per step (all its threads: the hook's "
            "codecs, gloo's sends and receives), mean over ranks; where ranks share the cores, "
            "step time cannot drop below it"
        )
    if gpu:
        lines.append(
            "GPU GB: the most GPU memory one rank had allocated during the hook's steps; every "
            "hook's model stays resident, so the differences between hooks are what each adds"
        )
    lines.append(
        "MB/step: bytes one rank sends per step (pycomm: hook stats; ddp/torch-allreduce: fp32 "
        "ring 2(N-1)/N x 4 x params; torch-fp16: half; PowerSGD: torch's element count)"
    )
    if measured_lo:
        lines.append(
            "lo MB/step: measured on the private lo (all ranks' packets, headers included) / ranks"
        )
    if measured_up:
        lines.append(
            "uplink MB/step: bytes one node sends across its shaped uplink per step (its veth's "
            "counter, headers included), mean over nodes; MB/step beside it is per rank, intra- "
            "and inter-node together"
        )
    for name, h in hooks.items():
        predicted = (h.get("auto") or {}).get("predicted_s") if h["status"] == "ok" else None
        if predicted:
            each = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in predicted.items())
            cap = h["auto"].get("bucket_cap_mb_best")
            lines.append(
                f"{name}: chose {choice(h['auto'])} at iteration {h['auto']['decided_at']}; "
                f"its predicted step times (ms): {each}"
                + (f"; predicted best DDP bucket size for it: {cap:g} MB" if cap else "")
            )
    if doc["failures"]:
        lines.append("failures: the whole messages, and the ranks' stderr, are in --json")
    if errors:
        n = doc["config"].get("error_steps")
        lines.append(
            "rel err: |reduced gradient - exact fp32 mean| / |exact| (L2), median of the last "
            f"{n} timed steps; with error feedback what one step drops is sent in later steps"
        )
    return "\n".join(lines)


def choice(decision: dict[str, Any]) -> str:
    """An auto decision in a few characters: the hook, and the hierarchy when not flat."""
    h = decision.get("hierarchy", "flat")
    return decision["choice"] + ("" if h == "flat" else f"-{h}")


def short_error(text: Optional[str]) -> str:
    """A failure in a line: hangs and gloo aborts in a few words, anything else as it is.

    Example:
        >>> short_error("hung: a step made no progress for 0:00:10 (the per-step deadline)")
        'hung: no progress within the step deadline (--step-timeout)'
    """
    text = str(text or "failed")
    if text.startswith("hung"):
        return "hung: no progress within the step deadline (--step-timeout)"
    signal = re.search(r"\(signal (\d+)\)", text)
    if not signal:
        return text
    if "Received data size doesn't match" in text:
        why = "gloo: received data size doesn't match (collectives issued out of order)"
    else:
        why = re.sub(r"\[enforce fail at [^\]]*\]\s*", "", text.split(": ", 1)[-1])
    return f"aborted (signal {signal.group(1)}): {why}"


def plot(doc: dict[str, Any], path: str) -> None:
    """Draw each hook's median step time as a bar split into compute (the compute-only
    median) and communication (the rest), whiskers from min to max; write a PNG to ``path``.

    Example:
        >>> plot(json.load(open("benchmarks/results/bench_2.5gbit.json")), "bench.png")
    """
    from matplotlib.figure import Figure  # Agg through savefig: no display, no pyplot state

    hooks = doc["hooks"]
    names = list(hooks)
    ref = hooks.get(COMPUTE, {})
    compute_ms = ref["median_s"] * 1e3 if ref.get("status") == "ok" else None
    fig = Figure(figsize=(9, 0.42 * len(names) + 1.9))
    ax = fig.subplots()
    # the axis follows the medians: one stalled step must not squash every bar
    top = max([h["median_s"] * 1e3 for h in hooks.values() if h["status"] == "ok"] + [1.0])
    top *= 1.5
    labelled = set()

    def bar(y: float, left: float, width: float, color: str, label: str) -> None:
        ax.barh(y, width, left=left, color=color, height=0.62,
                label=None if label in labelled else label)  # fmt: skip
        labelled.add(label)

    for i, name in enumerate(names):
        h, y = hooks[name], len(names) - 1 - i
        if h["status"] != "ok":
            why = short_error(h.get("error"))[:100]
            ax.text(top * 0.01, y, f"failed: {why}", va="center", fontsize=8, color="#b00020")
            continue
        total = h["median_s"] * 1e3
        base = min(compute_ms, total) if compute_ms is not None else 0.0
        bar(y, 0, base, "#8da0b3", "compute (compute-only median)")
        if total > base:
            bar(y, base, total - base, "#d1495b", "communication (the rest)")
        lo, hi = h["min_s"] * 1e3, h["max_s"] * 1e3
        shown = min(hi, top)
        ax.errorbar(total, y, xerr=[[total - lo], [shown - total]], fmt="none", ecolor="black",
                    elinewidth=0.8, capsize=2)  # fmt: skip
        note = f"{total:.0f} ms" if total >= 10 else f"{total:.1f} ms"
        if h.get("speedup_vs_ddp") and name != BASELINE:
            note += f", {h['speedup_vs_ddp']:.2f}x vs ddp"
        if hi > top:
            note += f" (max {hi:.0f} ms)"
        ax.text(shown + top * 0.01, y, note, va="center", fontsize=8)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(list(reversed(names)))
    ax.set_xlim(0, top * 1.45)
    ax.set_xlabel("median step time, ms (whiskers: min to max)")
    lines = header(doc)
    ax.set_title(lines[0] + "\n" + lines[-1], fontsize=9)
    if labelled:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
