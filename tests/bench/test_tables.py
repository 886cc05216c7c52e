"""``python -m pycomm.bench.tables`` on pages and JSON files it cannot render (one ``error:``
line on stderr naming the page and the file, exit 2, no traceback), the "From" lines' commands
with today's hook names (:data:`pycomm.bench.tables.RENAMED`), and every such command of the
repository's pages parsing with today's CLIs. (The generator's tables: tests/repo.)"""

import argparse
import json
import os

import pytest
from harness import ROOT

from pycomm.bench import __main__ as bench
from pycomm.bench import fsdp, quality, quality_local_sgd, tables
from pycomm.bench.quality_tasks import all_hooks, check_names


def _page(tmp_path, spec: str, name: str = "", doc=None):
    """A page of one block ``spec`` in a repository of its own, with ``doc`` as ``name``."""
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    if name:
        (results / name).write_text(json.dumps(doc))
    page = tmp_path / ("page" + ".md")  # named so: tests/repo/test_citations reads this file
    page.write_text(f"# Page\n\n<!-- report: {spec} -->\n<!-- /report -->\n")
    return page


@pytest.mark.parametrize(
    "spec, doc, words",
    [
        (
            "fsdp f0.json",
            {"hooks": {"fsdp": {"median_s": 0.0}, "int8": {"median_s": 0.1}}},
            "f0.json is not what renderer 'fsdp' reads (ZeroDivisionError: ",
        ),
        (
            "kernels k.json",
            {"rows": [{"case": "a", "ours_ms": "fast", "torch_ms": 1.0}], "copy_gbs": 1},
            "k.json is not what renderer 'kernels' reads (ValueError: Unknown format code 'f'",
        ),
        (
            "sweep s.json",
            {
                "hooks": {"ddp": {"status": "ok", "median_s": 0.1}},
                "link": {"rate": "fast", "shaped": True},
            },  # fmt: skip
            "s.json is not what renderer 'sweep' reads (ValueError: 'fast' is not a tc rate",
        ),
        (
            "ranks l.json",
            [1, 2, 3],
            "l.json is not what renderer 'ranks' reads (TypeError: ",
        ),
    ],
)
def test_a_json_the_renderer_cannot_read_is_one_error_line(tmp_path, capsys, spec, doc, words):
    page = _page(tmp_path, spec, spec.split()[1], doc)
    assert tables.main(["--check", "--root", str(tmp_path), str(page)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"error: {page}:3: ") and err.count("\n") == 1
    assert words in err


def test_a_page_that_is_not_text_is_one_error_line(tmp_path, capsys):
    page = _page(tmp_path, "steps run.json")
    page.write_bytes(b"# t\n\xff\xfe binary")
    assert tables.main(["--check", "--root", str(tmp_path), str(page)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"error: {page}: not a UTF-8 text page (invalid start byte at byte 4)\n"


def test_errors_go_to_stderr(tmp_path, capsys):
    assert tables.main(["--check", "--root", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"error: --root {str(tmp_path)!r} has no benchmarks/results folder")
    gone = _page(tmp_path, "steps run.json").with_name("gone" + ".md")
    assert tables.main(["--check", "--root", str(tmp_path), str(gone)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: {gone}: No such file")


def test_rerun_gives_the_command_with_todays_hook_names(monkeypatch):
    monkeypatch.setattr(tables, "RENAMED", {"q.json": {"int8": "int8-b256", "int8-b64": "int8"}})
    old = "python -m pycomm.bench.quality --hooks allreduce,int8,int8-b64 --seeds 3"
    note = " (today's hook names: the JSON's `int8` is today's `int8-b256`, its `int8-b64` is "
    assert tables.rerun("q.json", old) == (
        "python -m pycomm.bench.quality --hooks allreduce,int8-b256,int8 --seeds 3",
        note + "today's `int8`)",
    )
    assert tables.rerun("q.json", old.replace("--hooks ", "--hooks="))[0] == (
        "python -m pycomm.bench.quality --hooks=allreduce,int8-b256,int8 --seeds 3"
    )
    assert tables.rerun("other.json", old) == (old, "")
    with pytest.raises(tables.ReportError, match="q.json: RENAMED renames int8-b64, which its"):
        tables.rerun("q.json", "python -m pycomm.bench.quality --hooks allreduce,int8")
    with pytest.raises(tables.ReportError, match="RENAMED renames int8, int8-b64"):
        tables.rerun("q.json", "python -m pycomm.bench.quality")


def test_the_from_line_has_the_renamed_command(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "RENAMED", {"run.json": {"int8": "int8-b256"}})
    doc = {
        "command": "python -m pycomm.bench --hooks ddp,int8",
        "hooks": {h: {"status": "ok", "median_s": 0.1} for h in ("ddp", "int8")},
    }
    page = _page(tmp_path, "steps run.json", "run.json", doc)
    tables.update([str(page)], str(tmp_path))
    assert (
        "`python -m pycomm.bench --hooks ddp,int8-b256` (today's hook names: the JSON's `int8` "
        "is today's `int8-b256`).</sub>"
    ) in page.read_text()


class _Refused(Exception):
    pass


def _refusing(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``ap`` with its errors raised as _Refused."""

    def error(message):
        raise _Refused(message)

    ap.error = error  # type: ignore[method-assign]
    return ap


def _parse(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    return _refusing(ap).parse_args(argv)


def _check_command(command: str) -> None:
    """Parse ``command`` as its CLI would, hooks included; _Refused if it does not. Commands
    joined by ``&&`` are checked one by one."""
    if "&&" in command:
        for part in command.split("&&"):
            _check_command(part.strip())
        return
    words = command.split()
    if words[:3] == ["python", "-m", "pycomm.bench.quality"] and "--local-sgd" in words:
        ap = _refusing(quality_local_sgd.parser())
        quality_local_sgd.parse(ap, [w for w in words[3:] if w != "--local-sgd"])
    elif words[:3] == ["python", "-m", "pycomm.bench.quality"]:
        args = _parse(quality._parser(), words[3:])
        try:
            check_names("hook", args.hooks, all_hooks())
        except ValueError as e:
            raise _Refused(str(e)) from None
    elif words[:4] == ["python", "-m", "pycomm.bench", "--fsdp"]:
        ap = fsdp._parser()
        fsdp._hooks(ap, _parse(ap, words[4:]).hooks)
    elif words[:3] == ["python", "-m", "pycomm.bench"]:
        ap = bench._parser()
        bench._hooks(ap, _parse(ap, words[3:]).hooks)


def test_every_from_line_command_parses_today():
    """The command a page gives for each JSON (with today's hook names) is one today's CLI
    takes, its hooks included: a reader can run it again."""
    refused, seen = [], set()
    for page in tables.pages(str(ROOT)):
        for block in tables.blocks(page):
            for path, _ in tables._expand(block, os.path.join(str(ROOT), tables.RESULTS)):
                if path in seen:
                    continue
                seen.add(path)
                with open(path, encoding="utf-8") as f:
                    doc = json.load(f)
                command = doc.get("command") if isinstance(doc, dict) else None
                if not command:
                    continue
                command, _ = tables.rerun(os.path.basename(path), command)
                try:
                    _check_command(command)
                except _Refused as e:
                    refused.append(f"{block.where}: {command}: {e}")
    assert seen, "no JSON file found through the pages' blocks"
    assert not refused, "\n".join(refused)
