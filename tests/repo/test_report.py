"""The docs' tables of measured figures against the JSON files they are generated from."""

from __future__ import annotations

import json
import os
import re

import pytest
from harness import ROOT

from pycomm.bench import tables


def test_every_table_in_the_docs_is_what_its_json_gives():
    stale = tables.update(tables.pages(ROOT), ROOT, check=True)
    assert not stale, (
        "tables that differ from their JSON (run python -m pycomm.bench.tables): "
        + ", ".join(f"{b.where} ({b.renderer} {' '.join(b.files)})" for b in stale)
    )


def test_the_docs_have_generated_tables():
    found = [b for p in tables.pages(ROOT) for b in tables.blocks(p)]
    assert len(found) >= 10
    assert {b.renderer for b in found} >= {"printed", "steps", "quality", "fsdp", "kernels"}


# A row of a Markdown table with a measured figure in it: a time, a ratio, a share or a size.
_FIGURE = re.compile(r"\b\d+(\.\d+)?\s?(ms|x|%|MB|GB/s|GB|pt)\b")


def _hand_tables(path: str) -> list[str]:
    inside, found = False, []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.startswith("<!-- report:"):
                inside = True
            elif line.startswith("<!-- /report -->"):
                inside = False
            elif not inside and line.startswith("|") and _FIGURE.search(line):
                found.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()[:80]}")
    return found


def test_no_table_of_figures_is_written_by_hand():
    found = [row for p in tables.pages(ROOT) for row in _hand_tables(p)]
    assert not found, "tables of figures outside a report block:\n" + "\n".join(found)


# --- the generator itself, on a page and results of its own ------------------------------------


def _bench(ms: dict[str, float]) -> dict:
    hooks = {
        name: {"status": "ok", "median_s": v / 1e3, "bytes_per_step": 1e6 * (i + 1)}
        for i, (name, v) in enumerate(ms.items())
    }
    return {
        "command": "python -m pycomm.bench --link 1gbit",
        "link": {"requested": "1gbit", "per_rank_bits": 10**9, "shaped": True},
        "hooks": hooks,
    }


def _page(repo, name: str):
    """A page of the test's own docs/ (named without its suffix: test_citations reads this
    file, and these pages are not the repository's)."""
    return repo / "docs" / (name + ".md")


@pytest.fixture
def repo(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "run.json").write_text(json.dumps(_bench({"ddp": 200.0, "int8": 100.0})))
    (tmp_path / "docs").mkdir()
    page = _page(tmp_path, "page")
    page.write_text(
        "# Page\n\ntext\n<!-- report: steps run.json -->\n<!-- /report -->\nmore text\n"
        "<!-- report: steps run.json hooks=int8 vs=int8 -->\nold\n<!-- /report -->\n"
    )
    return tmp_path


def test_update_writes_the_tables_and_check_then_passes(repo):
    page = _page(repo, "page")
    changed = tables.update([str(page)], str(repo))
    assert [b.line for b in changed] == [4, 7]
    text = page.read_text()
    assert "| `int8` | 100.0 | 2.00x | 2.00 |" in text  # ddp's 200 ms / int8's 100 ms
    assert "| `int8` | 100.0 | 1.00x | 2.00 |" in text
    assert "[`run.json`](../benchmarks/results/run.json): `python -m pycomm.bench" in text
    assert text.startswith("# Page\n\ntext\n") and "more text\n" in text and "old" not in text
    assert tables.update([str(page)], str(repo), check=True) == []
    assert tables.main(["--check", "--root", str(repo), str(page)]) == 0


def test_a_changed_figure_makes_its_table_stale(repo, capsys):
    page = _page(repo, "page")
    tables.update([str(page)], str(repo))
    before = page.read_text()
    (repo / "benchmarks" / "results" / "run.json").write_text(
        json.dumps(_bench({"ddp": 200.0, "int8": 125.0}))
    )
    stale = tables.update([str(page)], str(repo), check=True)
    assert [b.line for b in stale] == [4, 13]  # both blocks, at their lines once generated
    assert page.read_text() == before  # --check writes nothing
    assert tables.main(["--check", "--root", str(repo), str(page)]) == 1
    assert f"{page}:4: stale (steps run.json)" in capsys.readouterr().out
    tables.update([str(page)], str(repo))
    assert "| `int8` | 125.0 | 1.60x | 2.00 |" in page.read_text()


def test_a_hand_edit_inside_a_block_is_stale(repo):
    page = _page(repo, "page")
    tables.update([str(page)], str(repo))
    page.write_text(page.read_text().replace("| 100.0 | 2.00x", "| 100.0 | 2.10x"))
    assert [b.line for b in tables.update([str(page)], str(repo), check=True)] == [4]


@pytest.mark.parametrize(
    "block, message",
    [
        ("<!-- report: bars run.json -->\n<!-- /report -->", "renderer 'bars' unknown"),
        ("<!-- report: steps gone.json -->\n<!-- /report -->", "gone.json does not exist"),
        ("<!-- report: steps -->\n<!-- /report -->", "no JSON file named after 'steps'"),
        ("<!-- report: steps run.json -->\n", "not closed by <!-- /report -->"),
        ("<!-- /report -->\n", "without an opening report comment"),
        (
            "<!-- report: steps run.json hooks=int4 -->\n<!-- /report -->",
            "hooks=int4 not in run.json; it has ddp, int8",
        ),
        ("<!-- report: steps run*.json vs=fp8 -->\n<!-- /report -->", "vs=fp8 not in run.json"),
        ("<!-- report: quality run.json -->\n<!-- /report -->", "is not what renderer 'quality'"),
        (
            "<!-- report: steps run.json hook=int8 -->\n<!-- /report -->",
            "hook=int8 is not an option of renderer 'steps'; it reads hooks=, vs=",
        ),
        (
            "<!-- report: launch run.json vs=ddp -->\n<!-- /report -->",
            "vs=ddp is not an option of renderer 'launch'; it reads no option",
        ),
    ],
)
def test_a_bad_block_names_the_page_line_and_value(repo, block, message):
    page = _page(repo, "bad")
    page.write_text("# Bad\n\n" + block)
    with pytest.raises(tables.ReportError, match=re.escape(message)) as e:
        tables.update([str(page)], str(repo))
    assert str(e.value).startswith(f"{page}:3: ") or "without" in message
    assert tables.main(["--root", str(repo), str(page)]) == 2


def test_a_page_or_json_that_cannot_be_read_is_an_error_not_stale(repo, capsys):
    (repo / "benchmarks" / "results" / "broken.json").write_text("{not json")
    page = _page(repo, "broken")
    page.write_text("# Broken\n\n<!-- report: steps broken.json -->\n<!-- /report -->\n")
    assert tables.main(["--check", "--root", str(repo), str(page)]) == 2
    assert "broken.json cannot be read as JSON" in capsys.readouterr().err
    gone = _page(repo, "gone")
    assert tables.main(["--check", "--root", str(repo), str(gone)]) == 2
    assert f"error: {gone}: No such file" in capsys.readouterr().err


def test_sweep_orders_runs_by_link_rate(repo):
    results = repo / "benchmarks" / "results"
    slow = _bench({"ddp": 900.0, "int8": 300.0})
    slow["link"] = {"requested": "100mbit", "per_rank_bits": 10**8, "shaped": True}
    (results / "run_slow.json").write_text(json.dumps(slow))
    page = _page(repo, "sweep")
    page.write_text("<!-- report: sweep run*.json hooks=int8 -->\n<!-- /report -->\n")
    tables.update([str(page)], str(repo))
    rows = [r for r in page.read_text().splitlines() if r.startswith("| 1")]
    assert rows == ["| 100mbit | 3.00x |", "| 1gbit | 2.00x |"]


def _render(repo, spec: str) -> list[str]:
    """The table rows a block with ``spec`` gets on a page of its own."""
    page = _page(repo, "one")
    page.write_text(f"<!-- report: {spec} -->\n<!-- /report -->\n")
    tables.update([str(page)], str(repo))
    return [r for r in page.read_text().splitlines() if r.startswith("| ")]


def test_sweep_reads_fsdp_runs_and_auto_predictions(repo):
    results = repo / "benchmarks" / "results"
    fsdp = {"link": {"rate": "100mbit", "shaped": True},
            "hooks": {"fsdp": {"median_s": 0.4}, "int8": {"median_s": 0.1}}}  # fmt: skip
    (results / "fsdp_slow.json").write_text(json.dumps(fsdp))
    fsdp["link"] = {"rate": None, "shaped": False}
    fsdp["hooks"]["int8"]["median_s"] = 0.5
    (results / "fsdp_fast.json").write_text(json.dumps(fsdp))
    # no status in an FSDP run's hooks, its rate in "rate": ordered slow to unshaped
    assert _render(repo, "sweep fsdp_*.json vs=fsdp hooks=int8")[1:] == [
        "| 100mbit | 4.00x |",
        "| unshaped | 0.80x |",
    ]
    run = _bench({"ddp": 200.0, "int8": 100.0, "auto": 101.0})
    run["hooks"]["auto"]["auto"] = {"choice": "int8", "predicted_s": {"int8": 0.09, "ddp": 0.25}}
    (results / "run.json").write_text(json.dumps(run))
    assert _render(repo, "sweep run.json value=predicted")[1:] == [
        "| 1gbit | 250.0 | 90.0 | - (int8) |"
    ]
    with pytest.raises(tables.ReportError, match="value=bars; expected speed, ms or predicted"):
        _render(repo, "sweep run.json value=bars")


def test_ranks_gives_each_hook_and_source_its_bytes_and_growth(repo):
    doc = {"hooks": {"int8": {
        "stats": {"bytes": {"2": 8e6, "4": 12e6}, "ratio": {"4": 1.5}},
        "lo": {"bytes": {"2": 8.1e6, "4": 12.3e6}, "ratio": {"4": 12.3 / 8.1}},
    }}}  # fmt: skip
    (repo / "benchmarks" / "results" / "ranks.json").write_text(json.dumps(doc))
    assert _render(repo, "ranks ranks.json") == [
        "| hook | source | MB at 2 ranks | MB at 4 ranks | 4 ranks / 2 |",
        "| `int8` | stats | 8.00 | 12.00 | 1.50x |",
        "| `int8` | lo | 8.10 | 12.30 | 1.52x |",
    ]


def test_launch_gives_a_row_per_file_by_ranks(repo):
    results = repo / "benchmarks" / "results"
    for n, spawn in ((4, 4.0), (2, 2.0)):
        doc = {"nprocs": n, "median_s": {"spawn": spawn, "forkserver": spawn / 10},
               "forkserver_vs_spawn": 0.1, "forkserver_first_s": 2.5}  # fmt: skip
        (results / f"launch_{n}.json").write_text(json.dumps(doc))
    assert _render(repo, "launch launch_*.json")[1:] == [
        "| 2 | 2.000 | 0.200 | 0.10x | 2.500 |",
        "| 4 | 4.000 | 0.400 | 0.10x | 2.500 |",
    ]


def test_kernels_reads_another_list_against_its_own_reference(repo):
    row = {"case": "quantize_int4", "bytes": 4e6, "ours_ms": 2.0, "ours_gbs": 2.0}
    doc = {"copy_gbs": 4.0, "rows": [row | {"eager_ms": 20.0, "speedup_vs_eager": 10.0,
                                             "copy_over_ours": 2.0}],
           "vs_int8": [row | {"int8_ms": 2.5, "speedup_vs_int8": 1.25}]}  # fmt: skip
    (repo / "benchmarks" / "results" / "codecs.json").write_text(json.dumps(doc))
    assert _render(repo, "kernels codecs.json") == [
        "| case | MB moved | pycomm ms | eager ms | pycomm GB/s | speedup vs eager "
        "| pycomm / copy_ (4.0 GB/s) |",
        "| quantize_int4 | 4.00 | 2.00 | 20.00 | 2.0 | 10.00x | 2.00x |",
    ]
    assert _render(repo, "kernels codecs.json at=vs_int8") == [
        "| case | MB moved | pycomm ms | int8 ms | pycomm GB/s | speedup vs int8 |",
        "| quantize_int4 | 4.00 | 2.00 | 2.50 | 2.0 | 1.25x |",
    ]


def test_quality_takes_each_files_hooks_and_refuses_a_hook_twice(repo):
    results = repo / "benchmarks" / "results"

    def run(hooks: dict[str, float]) -> dict:
        summary = [
            {"task": "charlm", "optimizer": "sgd", "hook": h, "metric": "loss", "seeds": 3,
             "delta": d, "ok": None if d is None else d <= 0.01}
            for h, d in hooks.items()
        ]  # fmt: skip
        return {"summary": summary}

    (results / "q1.json").write_text(json.dumps(run({"allreduce": None, "int8": 0.004})))
    (results / "q2.json").write_text(
        json.dumps(run({"allreduce": None, "int8": 0.002, "int4": 0.02}))
    )
    page = _page(repo, "q")
    page.write_text("<!-- report: quality q1.json q2.json:int4 -->\n<!-- /report -->\n")
    tables.update([str(page)], str(repo))
    assert "| charlm | sgd | loss, 3 seeds | +0.40% | **+2.00%** |" in page.read_text()
    page.write_text("<!-- report: quality q1.json q2.json -->\n<!-- /report -->\n")
    with pytest.raises(tables.ReportError, match="charlm/sgd/int8 is in q1.json and in q2.json"):
        tables.update([str(page)], str(repo))
    page.write_text("<!-- report: steps q1.json:int8 -->\n<!-- /report -->\n")
    with pytest.raises(tables.ReportError, match="only the quality renderer takes FILE:HOOKS"):
        tables.update([str(page)], str(repo))


def test_a_report_comment_in_a_code_block_is_an_example(repo):
    page = _page(repo, "example")
    page.write_text(
        "```text\n<!-- report: steps run.json -->\n<!-- /report -->\n```\n"
        "<!-- report: steps run.json hooks=int8 -->\n<!-- /report -->\n"
    )
    assert [b.line for b in tables.blocks(str(page))] == [5]
    tables.update([str(page)], str(repo))
    assert page.read_text().startswith("```text\n<!-- report: steps run.json -->\n<!-- /report")


def test_printed_is_the_bench_table_of_the_hooks_asked_for(repo):
    from pycomm.bench.report import table

    doc = {
        "config": {"nprocs": 2, "threads": 1, "steps": 5, "warmup": 1,
                   "model": {"kind": "mlp", "layers": 2, "width": 16, "batch": 4}},
        "link": {"requested": "1gbit", "per_rank_bits": 10**9, "shaped": False, "reason": "test"},
        "hooks": {
            n: {"status": "ok", "median_s": ms / 1e3, "min_s": ms / 1e3, "max_s": ms / 1e3,
                "bytes_per_step": 1e6}
            for n, ms in (("compute", 50.0), ("ddp", 150.0), ("int8", 80.0), ("int8-wire", 60.0))
        },
        "failures": [],
    }  # fmt: skip
    (repo / "benchmarks" / "results" / "printed.json").write_text(json.dumps(doc))
    page = _page(repo, "printed")
    page.write_text(
        "<!-- report: printed printed.json hooks=ddp,int8 notes=no -->\n<!-- /report -->\n"
    )
    tables.update([str(page)], str(repo))
    text = page.read_text()
    rows = [
        line.split()[0] for line in text.splitlines() if re.match(r"^(ddp|int8|compute) ", line)
    ]
    assert rows == ["ddp", "int8"]
    assert "int8-wire" not in text and "MB/step: bytes one rank sends" not in text
    whole = table(doc).splitlines()
    assert [line for line in whole if line.startswith("int8 ")][0] in text


def test_a_root_without_results_is_an_error(tmp_path, capsys):
    assert tables.main(["--check", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--root {str(tmp_path)!r} has no benchmarks/results folder" in err


def test_every_renderer_says_which_options_it_reads():
    assert set(tables.OPTIONS) == set(tables.RENDERERS)
