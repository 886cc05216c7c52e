"""The benchmark's report: ratios between hooks, the printed table and the JSON document."""

from __future__ import annotations

from typing import Any, Optional

from pycomm.bench.link import format_rate
from pycomm.bench.runner import BASELINE, COMPUTE


def add_ratios(hooks: dict[str, dict[str, Any]]) -> None:
    """``ratio_to_compute`` (step time / compute-only step time) and ``speedup_vs_ddp``
    (plain DDP's step time / this one), from medians measured side by side."""

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
    c, link = doc["config"], doc["link"]
    params = f"{doc['params'] / 1e6:.1f}M" if doc.get("params") else "?"
    lines = [
        f"{c['nprocs']} ranks (gloo), MLP {c['layers']}x{c['width']} = {params} params, "
        f"batch {c['batch']}/rank, {c['threads']} torch thread(s)/rank",
        f"{c['steps']} timed steps (+{c['warmup']} warm-up) per hook, hooks interleaved step by "
        "step; a step lasts until its slowest rank is done",
    ]
    buckets = doc["hooks"].get(BASELINE, {}).get("bucket_sizes")
    if buckets:
        sizes = ", ".join(f"{b / 1e6:.1f}" for b in buckets)
        cap = doc.get("config", {}).get("bucket_cap_mb")
        which = "default bucket_cap_mb" if cap is None else f"bucket_cap_mb={cap:g}"
        lines.append(f"plain DDP's buckets ({which}, after DDP's rebuild): {sizes} MB")
    if link["shaped"]:
        lines.append(
            f"link: {format_rate(link['per_rank_bits'])} per rank (tc tbf "
            f"{format_rate(link['total_bits'])} on lo, in a private network namespace)"
        )
    elif link["requested"]:
        lines.append(f"link: UNSHAPED loopback ({link['requested']} requested: {link['reason']})")
    else:
        lines.append("link: unshaped loopback")
    return lines


def table(doc: dict[str, Any]) -> str:
    """The per-hook table, then one line per failure."""
    lines = header(doc)
    measured_lo = any(h.get("lo_bytes_per_step") is not None for h in doc["hooks"].values())
    cols = f"{'hook':<17}{'median ms':>10}{'min ms':>9}{'max ms':>9}{'/compute':>10}{'vs ddp':>8}"
    cols += f"{'MB/step':>9}" + (f"{'lo MB/step':>12}" if measured_lo else "") + "  status"
    lines.append(cols)
    for name, h in doc["hooks"].items():
        ok = h["status"] == "ok"
        row = f"{name:<17}"
        row += _num(h.get("median_s") if ok else None, 10, 1, 1e3)
        row += _num(h.get("min_s") if ok else None, 9, 1, 1e3)
        row += _num(h.get("max_s") if ok else None, 9, 1, 1e3)
        row += _num(h.get("ratio_to_compute"), 10, 2, x=True)
        row += _num(h.get("speedup_vs_ddp"), 8, 2, x=True)
        row += _num(h.get("bytes_per_step") if ok else None, 9, 2, 1e-6)
        if measured_lo:
            row += _num(h.get("lo_bytes_per_step") if ok else None, 12, 2, 1e-6)
        status = "ok" if ok else "FAILED (below)"
        if ok and h.get("measured") == "alone":
            status = "ok (alone)"
        lines.append(f"{row}  {status}")
    for f in doc["failures"]:
        who = f["hook"] or "(interleaved run)"
        lines.append(f"{who} failed: {f['error']}")
        alone = f.get("alone")
        if alone and alone["status"] == "ok":
            lines.append(
                f"  rerun alone it passed ({alone['median_s'] * 1e3:.1f} ms median): intermittent"
            )
        elif alone:
            lines.append("  rerun alone it failed again")
        if f["hook"] is None:
            lines.append("  every hook passed alone: the numbers above come from separate launches")
    lines.append(
        "MB/step: bytes one rank sends per step (pycomm: hook stats; ddp/torch-allreduce: fp32 "
        "ring 2(N-1)/N x 4 x params; torch-fp16: half; PowerSGD: torch's element count)"
    )
    if measured_lo:
        lines.append(
            "lo MB/step: measured on the private lo (all ranks' packets, headers included) / ranks"
        )
    return "\n".join(lines)
