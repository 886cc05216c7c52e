"""The docs' tables of measured figures, generated from the results' JSON files.

A measured figure lives in one place: the JSON file a benchmark wrote
(``benchmarks/results/*.json``). A Markdown page shows it through a generated block:

.. code-block:: markdown

    <!-- report: steps bench_2.5gbit.json hooks=ddp,bf16,int8 -->
    (the table, written by the generator)
    <!-- /report -->

The first word after ``report:`` names a renderer (:data:`RENDERERS`), the next words the JSON
files (relative to the results folder; a ``*`` pattern takes every match, in name order), the
``key=value`` words its options (:data:`OPTIONS`; another is an error).
``python -m pycomm.bench.tables`` rewrites every block of the repository's Markdown pages;
``--check`` changes nothing and exits 1 naming each block whose text is not what its JSON gives
(a test runs it). Each block ends with the JSON it came from
and the command that wrote it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pycomm.bench.link import parse_rate
from pycomm.bench.quality import table as quality_table
from pycomm.bench.report import choice, header, table

RESULTS = os.path.join("benchmarks", "results")

_BEGIN = re.compile(r"^<!-- report: (?P<spec>.+?) -->$")
_END = "<!-- /report -->"


# Hooks that a recorded run's command names and that run otherwise today (a default changed, a
# variant went): the JSON file -> {the name in its command: today's name of the same hook}. The
# JSON keeps what was run; a block's "From" line gives the command with today's names (the one
# that runs it again, parsed by today's CLI) and the names the JSON's rows have.
RENAMED: dict[str, dict[str, str]] = {
    # int8's block was 256 (int8-b256 today); int8-b64 a variant of block 64, int8's default now
    "quality_int8_block.json": {"int8": "int8-b256", "int8-b64": "int8"},
    # int4's block was 64 (int4-b64 today); int4-b128 a variant of block 128, int4's default now
    "quality_int4_fp8_full.json": {"int4": "int4-b64"},
    "quality_int4_charlm_plain.json": {"int4": "int4-b64", "int4-b128": "int4"},
    "quality_int4_b128_full.json": {"int4-b128": "int4"},
}


class ReportError(ValueError):
    """A report block that cannot be generated: the page and line, and why."""


@dataclass
class Block:
    """One generated block of a page: where it is, what it asks for and what it holds now."""

    path: str
    line: int  # 1-based line of the opening comment
    renderer: str
    files: list[str]
    options: dict[str, str]
    text: str  # the lines between the two comments, as they are in the page

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


# ---------------------------------------------------------------------------------------------
# formatting


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _seconds(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


def _mb(count: Optional[float]) -> str:
    return "-" if count is None else f"{count / 1e6:.2f}"


def _x(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(_value(x) for x in v)
    return str(v)


def _md(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _names(options: dict[str, str], key: str) -> Optional[list[str]]:
    text = options.get(key)
    return None if text is None else [n for n in text.split(",") if n]


def _pick(block: Block, available: list[str], key: str) -> list[str]:
    """The names option ``key`` lists (in its order), each checked against ``available``."""
    wanted = _names(block.options, key)
    if wanted is None:
        return list(available)
    unknown = [n for n in wanted if n not in available]
    if unknown:
        raise ReportError(
            f"{block.where}: {key}={','.join(unknown)} not in {block.files[0]}; "
            f"it has {', '.join(available)}"
        )
    return wanted


def _one(block: Block, docs: list[dict[str, Any]]) -> dict[str, Any]:
    if len(docs) != 1:
        raise ReportError(
            f"{block.where}: renderer {block.renderer!r} takes one JSON file, got {len(docs)}"
        )
    return docs[0]


# ---------------------------------------------------------------------------------------------
# renderers: (block, documents) -> lines


def _printed(block: Block, docs: list[dict[str, Any]]) -> list[str]:
    """What ``python -m pycomm.bench`` printed for this run: its header and table
    (``hooks=``: those rows only; ``notes=no``: without the lines under the table)."""
    doc = _one(block, docs)
    names = _pick(block, list(doc["hooks"]), "hooks")
    doc = {**doc, "hooks": {n: doc["hooks"][n] for n in names}}
    text = table(doc)
    if block.options.get("notes", "yes") == "no":  # the table alone, without what follows it
        keep = len(header(doc)) + 1 + len(doc["hooks"])
        text = "\n".join(text.splitlines()[:keep])
    return ["```text", *text.splitlines(), "```"]


def _steps(block: Block, docs: list[dict[str, Any]]) -> list[str]:
    """A step-time run as Markdown: each hook's median, its ratio to a reference hook
    (``vs=``, default ddp: the reference's time / the hook's, so above 1x is faster) and the
    bytes a rank sends per step (and the bytes a node sends across its uplink, when measured)."""
    doc = _one(block, docs)
    hooks = doc["hooks"]
    vs = block.options.get("vs", "ddp")
    names = _pick(block, list(hooks), "hooks")
    if vs not in hooks:
        raise ReportError(f"{block.where}: vs={vs} not in {block.files[0]}")
    ref = hooks[vs].get("median_s") if hooks[vs]["status"] == "ok" else None
    uplink = any(hooks[n].get("uplink_bytes_per_step") is not None for n in names)
    head = ["hook", "median ms", f"speed vs {vs}", "MB sent per rank and step"]
    head += ["uplink MB per node and step"] if uplink else []
    rows = []
    for n in names:
        h = hooks[n]
        ok = h["status"] == "ok"
        m = h.get("median_s") if ok else None
        row = [f"`{n}`", _ms(m) if ok else "failed", _x(ref / m if ref and m else None)]
        row.append(_mb(h.get("bytes_per_step") if ok else None))
        if uplink:
            row.append(_mb(h.get("uplink_bytes_per_step") if ok else None))
        if ok and h.get("auto"):
            row[0] += f" (chose {choice(h['auto'])})"
        rows.append(row)
    return _md(head, rows)


def _label(doc: dict[str, Any], path: str) -> str:
    link = doc.get("link") or {}
    rate = link.get("requested") or link.get("rate")
    if rate and not link.get("shaped", True):
        rate = f"{rate} (unshaped)"
    return rate or ("unshaped" if link else os.path.basename(path))


def _rate_bits(doc: dict[str, Any]) -> float:
    link = doc.get("link") or {}
    bits = link.get("per_rank_bits") or (link.get("rate") and parse_rate(link["rate"]))
    return float(bits) if bits and link.get("shaped", True) else float("inf")


def _ok(hook: dict[str, Any]) -> bool:
    return hook.get("status", "ok") == "ok"  # an FSDP run's hooks have no status: all measured


def _predicted(hooks: dict[str, dict[str, Any]], name: str) -> Optional[float]:
    """The step time (s) the run's ``hook="auto"`` predicted for hook ``name``, if it has one."""
    for h in hooks.values():
        if _ok(h) and h.get("auto"):
            return h["auto"].get("predicted_s", {}).get(name)
    return None


def _sweep(block: Block, docs: list[dict[str, Any]]) -> list[str]:
    """Several step-time runs (one per link rate, say; FSDP runs too, with ``vs=fsdp``): a row
    per run, a column per hook, each cell the hook's speed against ``vs=`` (default ddp) in
    that run, its median ms with ``value=ms``, or with ``value=predicted`` the ms the run's
    ``hook="auto"`` predicted for it (``-``: a hook auto did not weigh)."""
    vs = block.options.get("vs", "ddp")
    value = block.options.get("value", "speed")
    if value not in ("speed", "ms", "predicted"):
        raise ReportError(f"{block.where}: value={value}; expected speed, ms or predicted")
    common = [n for n in docs[0]["hooks"] if all(n in d["hooks"] for d in docs)]
    names = _pick(block, common, "hooks")
    head = ["run", *(f"`{n}`" for n in names)]
    rows = []
    for path, doc in sorted(zip(block.files, docs), key=lambda pd: _rate_bits(pd[1])):
        hooks = doc["hooks"]
        ref = hooks.get(vs, {}).get("median_s") if _ok(hooks.get(vs, {})) else None
        row = [_label(doc, path)]
        for n in names:
            h = hooks[n]
            m = h.get("median_s") if _ok(h) else None
            if value == "ms":
                cell = _ms(m)
            elif value == "predicted":
                cell = _ms(_predicted(hooks, n))
            else:
                cell = _x(ref / m if ref and m else None)
            if _ok(h) and h.get("auto"):
                cell += f" ({choice(h['auto'])})"
            row.append(cell)
        rows.append(row)
    return _md(head, rows)


def _delta(row: dict[str, Any]) -> str:
    if row["delta"] is None:
        return "reference" if row["hook"] == "allreduce" else "-"
    if row["metric"] == "accuracy":
        text = f"{row['delta']:+.2f} pt"
    else:
        text = f"{100 * row['delta']:+.2f}%"
    return text if row["ok"] is not False else f"**{text}**"


def _quality(block: Block, docs: list[dict[str, Any]]) -> list[str]:
    """A quality run: a row per task and optimizer, a column per hook, each cell the hook's
    mean paired difference from the exact all-reduce over the seeds (accuracy: points, loss:
    relative; bold where it breaks the hook's limit). ``full=yes``: the whole summary, one row
    per task, optimizer and hook. Several files are read together: ``FILE:HOOKS`` takes only
    those hooks of a file (and its exact all-reduce, the reference of its rows); a hook that
    two files hold for the same task and optimizer is an error."""
    rows: list[dict[str, Any]] = []
    seen: dict[tuple[str, str, str], str] = {}
    for name, doc in zip(block.files, docs):
        pick = name.partition(":")[2]
        keep = None if not pick else {"allreduce", *pick.split(",")}
        for r in doc["summary"]:
            if keep is not None and r["hook"] not in keep:
                continue
            key = (r["task"], r["optimizer"], r["hook"])
            if key in seen and r["hook"] != "allreduce":
                raise ReportError(
                    f"{block.where}: {'/'.join(key)} is in {seen[key]} and in {name}: "
                    "pick the hooks of each file with FILE:HOOKS"
                )
            seen.setdefault(key, name)
            if key not in seen or seen[key] == name:
                rows.append(r)
    tasks = _pick(block, list(dict.fromkeys(r["task"] for r in rows)), "tasks")
    optimizers = _pick(block, list(dict.fromkeys(r["optimizer"] for r in rows)), "optimizers")
    hooks = _pick(block, list(dict.fromkeys(r["hook"] for r in rows)), "hooks")
    rows = [r for r in rows if r["task"] in tasks and r["optimizer"] in optimizers]
    if block.options.get("full") == "yes":
        return quality_table([r for r in rows if r["hook"] in hooks]).splitlines()
    hooks = [h for h in hooks if h != "allreduce"]
    cells = {(r["task"], r["optimizer"], r["hook"]): r for r in rows}
    out = []
    for task in tasks:
        for opt in optimizers:
            if not any((task, opt, h) in cells for h in hooks):
                continue
            ref = cells.get((task, opt, "allreduce"))
            metric = ref["metric"] if ref else "?"
            seeds = ref["seeds"] if ref else "-"
            line = [task, opt, f"{metric}, {seeds} seeds"]
            line += [
                _delta(cells[(task, opt, h)]) if (task, opt, h) in cells else "-" for h in hooks
            ]
            out.append(line)
    return _md(["task", "optimizer", "metric", *(f"`{h}`" for h in hooks)], out)


def _kernels(block: Block, docs: list[dict[str, Any]]) -> list[str]:
    """A kernel benchmark: a row per case with pycomm's time, the reference's (pure PyTorch:
    ``eager`` or ``torch``) and the speedup, the bytes each moves, and pycomm's time over a
    ``copy_`` of those bytes (1.00x: as fast as the machine copies memory). ``at=`` another list
    of such rows (``vs_int8``: int4's and fp8's kernels against int8's, timed side by side)."""
    doc = _one(block, docs)
    rows_in = _node(doc, block.options.get("at", "rows"), block)
    refs = [k[: -len("_ms")] for r in rows_in for k in r if k.endswith("_ms") and k != "ours_ms"]
    ref = refs[0] if refs else "torch"
    copy = any(r.get("copy_over_ours") is not None for r in rows_in)
    head = ["case", "MB moved", "pycomm ms", f"{ref} ms", "pycomm GB/s", f"speedup vs {ref}"]
    head += [f"pycomm / copy_ ({doc['copy_gbs']:.1f} GB/s)"] if copy else []
    rows = [
        [
            r["case"],
            _mb(r.get("bytes")),
            f"{r['ours_ms']:.2f}",
            "-" if r.get(f"{ref}_ms") is None else f"{r[f'{ref}_ms']:.2f}",
            f"{r['ours_gbs']:.1f}" if r.get("ours_gbs") else "-",
            _x(r.get(f"speedup_vs_{ref}")),
        ]
        + ([_x(r.get("copy_over_ours"))] if copy else [])
        for r in rows_in
    ]
    return _md(head, rows)


def _fsdp(block: Block, docs: list[dict[str, Any]]) -> list[str]:
    """An FSDP2 run (``python -m pycomm.bench --fsdp``): each hook's median step, its speed
    against FSDP2's own (``vs=``, default fsdp), the bytes sent per rank and step on the wire
    (and by the reduce-scatters alone), across a node's uplink, and the residual's memory."""
    doc = _one(block, docs)
    hooks = doc["hooks"]
    names = _pick(block, list(hooks), "hooks")
    vs = block.options.get("vs", "fsdp")
    if vs not in hooks:
        raise ReportError(f"{block.where}: vs={vs} not in {block.files[0]}")
    ref = hooks[vs]["median_s"]
    cols = [
        ("wire_bytes_per_step", "wire MB per rank and step"),
        ("rs_wire_bytes_per_step", "reduce-scatter wire MB"),
        ("uplink_bytes_per_step", "uplink MB per node and step"),
        ("residual_bytes", "residual MB per rank"),
    ]
    cols = [(k, t) for k, t in cols if any(hooks[n].get(k) is not None for n in names)]
    head = ["hook", "median ms", f"speed vs {vs}", *(t for _, t in cols)]
    rows = [
        [f"`{n}`", _ms(hooks[n]["median_s"]), _x(ref / hooks[n]["median_s"])]
        + [_mb(hooks[n].get(k)) for k, _ in cols]
        for n in names
    ]
    return _md(head, rows)


def _ranks(block: Block, docs: list[dict[str, Any]]) -> list[str]:
    """Bytes per rank as the ranks grow (``benchmarks/bench_ranks.py``): a row per hook and
    source (``stats``: what the hook counted; ``lo``: what crossed the loopback, per rank), the
    MB one rank sends per step at each number of ranks, and each one's over the fewest ranks'."""
    doc = _one(block, docs)
    hooks = doc["hooks"]
    names = _pick(block, list(hooks), "hooks")
    counts = sorted({int(n) for h in hooks.values() for s in h.values() for n in s["bytes"]})
    head = ["hook", "source", *(f"MB at {n} ranks" for n in counts)]
    head += [f"{n} ranks / {counts[0]}" for n in counts[1:]]
    rows = []
    for name in names:
        for source, s in hooks[name].items():
            row = [f"`{name}`", source, *(_mb(s["bytes"].get(str(n))) for n in counts)]
            rows.append(row + [_x(s["ratio"].get(str(n))) for n in counts[1:]])
    return _md(head, rows)


def _launch(block: Block, docs: list[dict[str, Any]]) -> list[str]:
    """Start-up runs of ``pycomm.launch`` (``benchmarks/bench_launch.py``), a row per file: the
    ranks, each start method's median launch in seconds, forkserver's over spawn's, and
    forkserver's first launch (the one that starts its server)."""
    methods = list(dict.fromkeys(m for d in docs for m in d["median_s"]))
    head = ["ranks", *(f"{m}, median s" for m in methods), "forkserver / spawn"]
    head.append("forkserver's first launch, s")
    rows = [
        [str(d["nprocs"])]
        + [_seconds(d["median_s"].get(m)) for m in methods]
        + [_x(d["forkserver_vs_spawn"]), _seconds(d["forkserver_first_s"])]
        for d in sorted(docs, key=lambda d: d["nprocs"])
    ]
    return _md(head, rows)


def _node(doc: Any, path: str, block: Block) -> Any:
    for part in [p for p in path.split(".") if p]:
        if isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        elif isinstance(doc, dict) and part in doc:
            doc = doc[part]
        else:
            raise ReportError(f"{block.where}: at={path}: no {part!r} in {block.files[0]}")
    return doc


def _values(block: Block, docs: list[dict[str, Any]]) -> list[str]:
    """Any JSON node as a table (``at=`` a dotted path): a list of records or a mapping of
    records gives a row per record and a column per field (``cols=`` picks and orders them),
    a mapping of values gives a row per key."""
    node = _node(_one(block, docs), block.options.get("at", ""), block)
    if isinstance(node, dict) and not any(isinstance(v, dict) for v in node.values()):
        keys = _pick(block, list(node), "cols")
        return _md(["", "value"], [[k, _value(node[k])] for k in keys])
    if isinstance(node, dict):
        records = [({"": k} | v) if isinstance(v, dict) else {"": k, "value": v}
                   for k, v in node.items()]  # fmt: skip
    elif isinstance(node, list) and all(isinstance(r, dict) for r in node):
        records = node
    else:
        raise ReportError(f"{block.where}: at={block.options.get('at', '')} is not a table")
    fields = list(dict.fromkeys(k for r in records for k in r))
    cols = _pick(block, fields, "cols")
    return _md(cols, [[_value(r.get(c)) for c in cols] for r in records])


Renderer = Callable[[Block, "list[dict[str, Any]]"], "list[str]"]

RENDERERS: dict[str, Renderer] = {
    "printed": _printed,
    "steps": _steps,
    "sweep": _sweep,
    "quality": _quality,
    "kernels": _kernels,
    "fsdp": _fsdp,
    "ranks": _ranks,
    "launch": _launch,
    "values": _values,
}

# the options each renderer reads: any other is an error (a misspelt option is not ignored)
OPTIONS: dict[str, tuple[str, ...]] = {
    "printed": ("hooks", "notes"),
    "steps": ("hooks", "vs"),
    "sweep": ("hooks", "vs", "value"),
    "quality": ("hooks", "tasks", "optimizers", "full"),
    "kernels": ("at",),
    "fsdp": ("hooks", "vs"),
    "ranks": ("hooks",),
    "launch": (),
    "values": ("at", "cols"),
}


# ---------------------------------------------------------------------------------------------
# pages


def _parse(spec: str, path: str, line: int, text: str) -> Block:
    words = spec.split()
    options = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    files = [w for w in words[1:] if "=" not in w]
    if not words or words[0] not in RENDERERS:
        raise ReportError(
            f"{path}:{line}: renderer {words[0] if words else ''!r} unknown; "
            f"expected one of {', '.join(RENDERERS)}"
        )
    unknown = [k for k in options if k not in OPTIONS[words[0]]]
    if unknown:
        reads = ", ".join(f"{k}=" for k in OPTIONS[words[0]]) or "no option"
        raise ReportError(
            f"{path}:{line}: {unknown[0]}={options[unknown[0]]} is not an option of renderer "
            f"{words[0]!r}; it reads {reads}"
        )
    if not files:
        raise ReportError(f"{path}:{line}: no JSON file named after {words[0]!r}")
    return Block(path, line, words[0], files, options, text)


def blocks(path: str) -> list[Block]:
    """The report blocks of the Markdown page at ``path``, in order (a report comment inside a
    fenced code block is an example, not a block)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:  # a binary file, or another encoding
        raise ReportError(f"{path}: not a UTF-8 text page ({e.reason} at byte {e.start})") from None
    found, start, fenced = [], None, False
    for i, line in enumerate(lines):
        if start is None and line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        m = _BEGIN.match(line)
        if m and start is not None:
            raise ReportError(f"{path}:{i + 1}: a report block opens inside the one at line "
                              f"{start + 1}")  # fmt: skip
        if m:
            start, spec = i, m.group("spec")
        elif line == _END and start is None:
            raise ReportError(f"{path}:{i + 1}: {_END} without an opening report comment")
        elif line == _END:
            found.append(_parse(spec, path, start + 1, "\n".join(lines[start + 1 : i])))
            start = None
    if start is not None:
        raise ReportError(f"{path}:{start + 1}: report block not closed by {_END}")
    return found


def _expand(block: Block, results: str) -> list[tuple[str, str]]:
    """Each file's path and what follows its ``:`` (the quality renderer's hooks of it)."""
    paths = []
    for word in block.files:
        name, _, pick = word.partition(":")
        if pick and block.renderer != "quality":
            raise ReportError(f"{block.where}: {word}: only the quality renderer takes FILE:HOOKS")
        if any(c in name for c in "*?["):
            matches = sorted(f for f in os.listdir(results) if fnmatch.fnmatch(f, name))
            if not matches:
                raise ReportError(f"{block.where}: no file in {results} matches {name!r}")
            paths += [(os.path.join(results, f), pick) for f in matches]
        else:
            path = os.path.join(results, name)
            if not os.path.isfile(path):
                raise ReportError(f"{block.where}: {path} does not exist")
            paths.append((path, pick))
    return paths


def render(block: Block, root: str) -> str:
    """The text ``block`` should hold: the renderer's lines over its JSON files, then where
    they come from (the files, linked from the page, and the command that wrote each)."""
    paths = _expand(block, os.path.join(root, RESULTS))
    docs = []
    for p, _ in paths:
        try:
            with open(p, encoding="utf-8") as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as e:  # ValueError: json.JSONDecodeError, bad UTF-8
            raise ReportError(f"{block.where}: {p} cannot be read as JSON: {e}") from None
    names = [os.path.basename(p) + (f":{pick}" if pick else "") for p, pick in paths]
    expanded = Block(block.path, block.line, block.renderer, names, block.options, block.text)
    try:
        lines = RENDERERS[block.renderer](expanded, docs)
    except ReportError:
        raise
    # what a JSON of another shape or with other values gives: a missing key, a string where a
    # number belongs (ValueError: a format code; parse_rate), a time of 0 (ZeroDivisionError)
    except (KeyError, TypeError, AttributeError, ValueError, ArithmeticError, IndexError) as e:
        raise ReportError(
            f"{block.where}: {', '.join(names)} is not what renderer "
            f"{block.renderer!r} reads ({type(e).__name__}: {e})"
        ) from None
    page_dir = os.path.dirname(os.path.abspath(block.path))
    sources = []
    for (p, _), doc in zip(paths, docs):
        rel = os.path.relpath(os.path.abspath(p), page_dir).replace(os.sep, "/")
        command = doc.get("command") if isinstance(doc, dict) else None
        note = ""
        if command:
            command, note = rerun(os.path.basename(p), command, f"{block.where}: ")
        sources.append(
            f"[`{os.path.basename(p)}`]({rel})" + (f": `{command}`{note}" if command else "")
        )
    return "\n".join([*lines, "", "<sub>From " + "; ".join(sources) + ".</sub>"])


def rerun(name: str, command: str, where: str = "") -> tuple[str, str]:
    """The command that runs the JSON file ``name`` again today (its ``--hooks`` renamed by
    :data:`RENAMED`) and a note of the names its rows have ("" when nothing was renamed).

    Example:
        >>> rerun("quality_int4_b128_full.json", "python -m pycomm.bench.quality --hooks "
        ...       "allreduce,int4-b128")[0]
        'python -m pycomm.bench.quality --hooks allreduce,int4'
    """
    renamed = RENAMED.get(name)
    if not renamed:
        return command, ""
    words = command.split(" ")
    at = [i for i, w in enumerate(words) if w == "--hooks" or w.startswith("--hooks=")]
    hooks = None
    if at and words[at[-1]] == "--hooks":
        hooks = words[at[-1] + 1] if at[-1] + 1 < len(words) else None
    elif at:
        hooks = words[at[-1]].partition("=")[2]
    missing = [old for old in renamed if old not in (hooks or "").split(",")]
    if missing:
        raise ReportError(
            f"{where}{name}: RENAMED renames {', '.join(missing)}, which its command does not "
            f"name in --hooks: {command}"
        )
    new = ",".join(renamed.get(h, h) for h in hooks.split(","))
    if words[at[-1]] == "--hooks":
        words[at[-1] + 1] = new
    else:
        words[at[-1]] = f"--hooks={new}"
    note = ", its ".join(f"`{old}` is today's `{now}`" for old, now in renamed.items())
    return " ".join(words), f" (today's hook names: the JSON's {note})"


def pages(root: str) -> list[str]:
    """The repository's Markdown pages: README.md, docs/ and benchmarks/ (recursively)."""
    found = [os.path.join(root, "README.md")]
    for folder in ("docs", "benchmarks"):
        for here, dirs, files in os.walk(os.path.join(root, folder)):
            dirs.sort()
            found += [os.path.join(here, f) for f in sorted(files) if f.endswith(".md")]
    return [p for p in found if os.path.isfile(p)]


def update(paths: list[str], root: str, check: bool = False) -> list[Block]:
    """Regenerate every block of ``paths``; returns the blocks whose text changed (with
    ``check=True`` nothing is written: they are the stale ones)."""
    stale = []
    for path in paths:
        found = blocks(path)
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        changed = []
        for b in reversed(found):
            new = render(b, root)
            if new != b.text:
                changed.insert(0, b)
                end = b.line + len(b.text.split("\n")) if b.text else b.line
                lines[b.line : end] = new.split("\n")
        stale += changed
        if changed and not check:
            with open(path, "w", encoding="utf-8") as f:
                f.write("\n".join(lines))
    return stale


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m pycomm.bench.tables",
        description="Regenerate the docs' tables of measured figures from "
        "benchmarks/results/*.json (the blocks between '<!-- report: ... -->' and "
        f"'{_END}').",
    )
    ap.add_argument(
        "pages", nargs="*", help="Markdown pages; default: README.md, docs/, benchmarks/"
    )
    ap.add_argument("--root", default=".", help="the repository's root; default: .")
    ap.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a block is stale"
    )
    args = ap.parse_args(argv)
    if not os.path.isdir(os.path.join(args.root, RESULTS)):
        print(
            f"error: --root {args.root!r} has no {RESULTS} folder; expected the repository's "
            "root (run from it, or pass --root)",
            file=sys.stderr,
        )
        return 2
    try:
        changed = update(args.pages or pages(args.root), args.root, check=args.check)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a page missing, a folder, unreadable
        print(f"error: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 2
    for b in changed:
        what = "stale" if args.check else "rewritten"
        print(f"{b.where}: {what} ({b.renderer} {' '.join(b.files)})")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
