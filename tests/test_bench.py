"""The `python -m pycomm.bench` entry point: flags, the JSON report, a failing hook, shaping.

Tiny models and few steps; nothing here asserts on speed."""

import json
import subprocess
import sys

import pytest

import pycomm
from pycomm.bench import link
from pycomm.bench.__main__ import main
from pycomm.bench.runner import available_hooks

TINY = ("--nprocs", "2", "--width", "16", "--layers", "2", "--steps", "2", "--warmup", "2")
FLAGS = [
    "--nprocs", "--hooks", "--list-hooks", "--width", "--layers", "--batch", "--steps",
    "--warmup", "--threads", "--link", "--json", "--timeout",
]  # fmt: skip


def _run(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "pycomm.bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in FLAGS:
        assert flag in text, flag
    assert "_in-netns" not in text


@pytest.mark.parametrize(
    "args, words",
    [
        (("--hooks", "ddp,zstd"), "unknown hook 'zstd'"),
        (("--nprocs", "0"), "not a positive integer"),
        (("--steps", "x"), "not a positive integer"),
        (("--warmup", "-1"), "not a non-negative integer"),
        (("--link", "fast"), "'fast' is not a tc rate"),
        (("--link", "2.5zbit"), "'2.5zbit' is not a tc rate"),
        (("--link", "0gbit"), "expected at least"),
        (("--timeout", "0"), "positive number of seconds"),
    ],
)
def test_bad_flags_rejected_before_any_rank_starts(monkeypatch, capsys, args, words):
    def no_launch(*a, **k):
        raise AssertionError("a rank was launched")

    monkeypatch.setattr(pycomm, "launch", no_launch)
    monkeypatch.setattr(link, "probe", no_launch)
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def test_rates_parse_like_tc():
    assert link.parse_rate("2.5gbit") == 2_500_000_000
    assert link.parse_rate("500Mbit") == 500_000_000
    assert link.parse_rate("100mbps") == 800_000_000
    assert link.parse_rate("1gibit") == 2**30
    assert link.tc_command(5 * 10**9)[-6:] == ["rate", "5000000000bit", "burst", "1mb"] + [
        "latency",
        "100ms",
    ]


@pytest.fixture(scope="module")
def tiny_all(tmp_path_factory):
    """One run of every hook plus the test-only ``_fail``: the failure path costs three
    launches (all interleaved, _fail alone, the rest interleaved), so share it."""
    path = tmp_path_factory.mktemp("bench") / "out.json"
    out = _run(*TINY, "--hooks", "all,_fail", "--json", str(path))
    assert out.returncode == 0, out.stderr
    return out, json.loads(path.read_text())


def test_json_has_every_requested_hook(tiny_all):
    out, doc = tiny_all
    hooks = doc["hooks"]
    assert list(hooks) == [*available_hooks(), "_fail"]
    assert doc["config"]["hooks"] == list(hooks)
    assert doc["config"]["width"] == 16 and doc["params"] == 2 * (16 * 16 + 16)
    assert doc["link"]["shaped"] is False and doc["link"]["requested"] is None
    for name, h in hooks.items():
        if name == "_fail":
            continue
        assert h["status"] == "ok", (name, h)
        assert len(h["step_times_s"]) == 2 and len(h["rank_step_times_s"]) == 2
        assert h["min_s"] <= h["median_s"] <= h["max_s"]
        assert h["bytes_per_step"] is not None
    assert hooks["compute"]["ratio_to_compute"] == 1.0
    assert hooks["ddp"]["speedup_vs_ddp"] == 1.0
    assert hooks["compute"]["bytes_per_step"] == 0
    # an fp32 ring all-reduce over 2 ranks sends the whole model once
    assert hooks["ddp"]["bytes_per_step"] == 4 * doc["params"]
    assert hooks["allreduce"]["bytes_per_step"] == hooks["ddp"]["bytes_per_step"]
    assert hooks["torch-fp16"]["bytes_per_step"] == 2 * doc["params"]
    for name in hooks:
        assert any(line.startswith(name + " ") for line in out.stdout.splitlines()), name


def test_failing_hook_is_reported_and_the_others_measured(tiny_all):
    out, doc = tiny_all
    fail = doc["hooks"]["_fail"]
    assert fail["status"] == "failed"
    assert "deliberate failure" in fail["error"]
    assert fail["alone"]["status"] == "failed"
    assert [f["hook"] for f in doc["failures"]] == ["_fail"]
    assert "_fail failed: RuntimeError: _fail hook: deliberate failure" in out.stdout
    assert [launch["ok"] for launch in doc["launches"]] == [False, False, True]


@pytest.mark.skipif(link.cannot_shape() is not None, reason=f"cannot shape: {link.cannot_shape()}")
def test_shaped_link(tmp_path):
    path = tmp_path / "out.json"
    out = _run(*TINY, "--hooks", "ddp", "--link", "1gbit", "--json", str(path))
    assert out.returncode == 0, out.stderr
    doc = json.loads(path.read_text())
    assert doc["link"]["shaped"] is True, doc["link"]
    assert doc["link"]["per_rank_bits"] == 10**9 and doc["link"]["total_bits"] == 2 * 10**9
    assert "tbf" in doc["link"]["qdisc"]
    ddp = doc["hooks"]["ddp"]
    assert ddp["status"] == "ok"
    # measured on the namespace's own lo: the model's bytes plus TCP/IP headers
    assert ddp["lo_bytes_per_step"] >= ddp["bytes_per_step"] > 0
    assert "1 Gbit/s per rank" in out.stdout


def test_link_without_root_runs_unshaped(monkeypatch, capsys, tmp_path):
    import pycomm.bench.__main__ as bench_main

    def fake_measure(cfg, hooks, nprocs, timeout):
        assert cfg["measure_lo"] is False
        one = {"status": "ok", "median_s": 0.01, "min_s": 0.01, "max_s": 0.01}
        return {
            "params": 1000,
            "hooks": {name: {**one, "bytes_per_step": 0.0} for name in hooks},
            "failures": [],
            "launches": [],
        }

    monkeypatch.setattr(link.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(link, "probe", lambda bits: pytest.fail("probed without root"))
    monkeypatch.setattr(bench_main, "measure", fake_measure)
    path = tmp_path / "out.json"
    assert main([*TINY, "--hooks", "ddp", "--link", "2.5gbit", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert "cannot shape the loopback (shaping needs root" in captured.err
    assert "running UNSHAPED" in captured.err
    assert "UNSHAPED loopback (2.5gbit requested" in captured.out
    doc = json.loads(path.read_text())
    assert doc["link"]["shaped"] is False and doc["link"]["per_rank_bits"] == 2_500_000_000
    assert "root" in doc["link"]["reason"]
