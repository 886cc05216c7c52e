"""The `python -m pycomm.bench` entry point: flags, the JSON report, failing and hanging hooks,
models, accumulation, the plot, shaping, and the kernel benchmarks' coverage of every op.

Tiny models and few steps; nothing here asserts on speed."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from harness import ROOT

import pycomm
from pycomm.bench import link, session
from pycomm.bench.__main__ import main
from pycomm.bench.models import ModelSpec, count_params
from pycomm.bench.report import plot, table
from pycomm.bench.runner import available_hooks, default_hooks_set

TINY = ("--nprocs", "2", "--width", "16", "--layers", "2", "--steps", "2", "--warmup", "2")
FLAGS = [
    "--nprocs", "--hooks", "--list-hooks", "--accumulate-steps", "--threads", "--bucket-cap-mb",
    "--model", "--layers", "--width", "--d-model", "--heads", "--seq-len", "--vocab", "--batch",
    "--steps", "--warmup", "--error-steps", "--link", "--step-timeout", "--rerun-budget",
    "--timeout", "--json", "--plot", "--quiet", "--device", "--backend", "--nodes",
]  # fmt: skip


BAD = "tests.bench.bench_hooks:badsetup"  # a hook of the caller's own (module:factory) that raises


def _run(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "pycomm.bench", *args],
        cwd=ROOT,  # where tests.bench.bench_hooks imports from
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _main(capfd, monkeypatch, *args):
    """``main(args)`` in this process, which has torch imported already: the ranks start as
    they do under ``python -m pycomm.bench`` (the fixture ``tiny_all`` runs that entry point
    itself), without a second interpreter importing torch first. Returns (exit status,
    stdout); capfd, since a shaped run re-runs itself in a namespace of its own."""
    monkeypatch.syspath_prepend(str(ROOT))  # where tests.bench.bench_hooks imports from
    monkeypatch.chdir(ROOT)
    capfd.readouterr()
    code = main(list(args))
    out, err = capfd.readouterr()
    assert code == 0, err
    return out


def _main_captured(*args):
    """``main(args)`` in this process for a module's fixture (which has no capfd): what
    ``_run`` returns, the stdout of this process's own prints."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.syspath_prepend(str(ROOT))
        mp.chdir(ROOT)
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), "")


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
        (("--hooks", "ddp,zstd"), "--hooks: unknown hook 'zstd'"),
        (("--hooks", "no_such_mod:make"), "cannot import module 'no_such_mod'"),
        (("--hooks", "tests.bench.bench_hooks:nothing"), "has no callable 'nothing'"),
        (("--hooks", "tests.bench.bench_hooks:"), "expected module:factory (both parts)"),
        (("--nprocs", "0"), "--nprocs: '0' is not a positive integer"),
        (("--nprocs", "-2"), "--nprocs: '-2' is not a positive integer"),
        (("--steps", "x"), "--steps: 'x' is not a positive integer"),
        (("--warmup", "-1"), "--warmup: '-1' is not a non-negative integer"),
        (("--link", "fast"), "--link: 'fast' is not a tc rate"),
        (("--link", "2.5zbit"), "--link: '2.5zbit' is not a tc rate"),
        (("--link", "0gbit"), "expected at least"),
        (("--link", "1e400gbit"), "--link: '1e400gbit' is more than 1000000000000 bit/s"),
        (("--link", "1e30gbit"), "--link: '1e30gbit' is more than 1000000000000 bit/s"),
        (("--timeout", "1e10"), "--timeout: '1e10' is more than 1e+09 seconds"),
        (("--timeout", "1e-7"), "--timeout: '1e-7' is less than 1e-06 seconds"),
        (("--step-timeout", "1e300"), "--step-timeout: '1e300' is more than 1e+06 seconds"),
        (("--bucket-cap-mb", "1e300"), "--bucket-cap-mb: '1e300' is more than 1e+06 MB"),
        (("--hooks", ""), "--hooks '': no hook given"),
        (("--hooks", ","), "--hooks ',': no hook given"),
        (
            ("--model", "transformer", "--seq-len", "1000000000"),
            "--layers 8 --d-model 256 --seq-len 1000000000 --vocab 8192: 256008.4M parameters",
        ),
        (("--nprocs", "100000"), " x 100000 ranks need about"),
        (("--timeout", "0"), "--timeout: '0' is not a positive number of seconds"),
        (("--rerun-budget", "-1"), "--rerun-budget: '-1' is not a non-negative number"),
        (("--step-timeout", "-1"), "--step-timeout: '-1' is not a positive number"),
        (("--bucket-cap-mb", "-5"), "--bucket-cap-mb: '-5' is not a positive number of MB"),
        (("--width", "0"), "--width: '0' is not a positive integer"),
        (("--accumulate-steps", "0"), "--accumulate-steps: '0' is not a positive integer"),
        (("--model", "cnn"), "--model: invalid choice: 'cnn'"),
        (("--model", "transformer", "--width", "64"), "--width 64: --width is not a flag of"),
        (("--d-model", "64"), "--d-model 64: --d-model is not a flag of --model mlp"),
        (
            ("--model", "transformer", "--d-model", "100", "--heads", "3"),
            "--d-model 100 is not divisible by --heads 3",
        ),
        (("--steps", "3", "--error-steps", "4"), "--error-steps 4 is more than --steps 3"),
        (("--json", "/nonexistent/dir/out.json"), "--json /nonexistent/dir/out.json: the folder"),
        (("--plot", "/nonexistent/dir/b.png"), "--plot /nonexistent/dir/b.png: the folder"),
        (("--json", "/"), "--json /: is a folder, expected a file name"),
        (("--plot", "bench.txt"), "--plot bench.txt: matplotlib does not write .txt"),
        (("--width", "100000", "--layers", "100"), "--layers 100 --width 100000: 1000010.0M"),
        (("--device", "tpu"), "--device: invalid choice: 'tpu'"),
        (("--backend", "mpi"), "--backend: invalid choice: 'mpi'"),
        (("--backend", "nccl"), "--backend nccl needs --device cuda"),
        (("--device", "cuda"), "--device cuda: torch"),  # (no GPU: see below)
        (("--nodes", "3", "--nprocs", "4", "--link", "1gbit"), "--nodes 3: expected a divisor"),
        (("--nodes", "2", "--nprocs", "4"), "and a --link RATE"),
    ],
)
def test_bad_flags_rejected_before_any_rank_starts(monkeypatch, capsys, args, words):
    def no_launch(*a, **k):
        raise AssertionError("a rank was launched")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    monkeypatch.setattr(pycomm, "launch", no_launch)
    monkeypatch.setattr(link, "probe", no_launch)
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    "entry, args, words",
    [
        ("fsdp", ("--steps", "0"), "--steps: '0' is not a positive integer"),
        ("fsdp", ("--width", "-5"), "--width: '-5' is not a positive integer"),
        ("fsdp", ("--hooks", "fsdp,powersgd"), "--hooks powersgd: not a reduce-scatter"),
        ("fsdp", ("--json", "/"), "--json /: is a folder"),
        ("fsdp", ("--hooks", ""), "--hooks '': no hook given; expected fsdp"),
        ("fsdp", ("--hooks", ","), "--hooks ',': no hook given"),
        (
            "fsdp",
            ("--model", "transformer", "--width", "10"),
            "--width 10: --width is not a flag of --model transformer",
        ),
        (
            "fsdp",
            ("--width", "200000", "--hooks", "fsdp", "--steps", "1"),
            "--layers 8 --width 200000: 320001.6M parameters",
        ),
        ("fsdp", ("--nprocs", "100000"), "4 hooks x 100000 ranks need about"),
        ("fsdp", ("--link", "1e400gbit"), "--link 1e400gbit: '1e400gbit' is more than"),
        ("quality", ("--timeout", "-5"), "--timeout: '-5' is not a positive number of seconds"),
        ("quality", ("--timeout", "1e10"), "--timeout: '1e10' is more than 1e+09 seconds"),
        ("quality", ("--timeout", "1e-7"), "--timeout: '1e-7' is less than 1e-06 seconds"),
        ("quality", ("--nprocs", "100000"), "--nprocs 100000: about 0.5 GB a rank, 100000 ranks"),
        ("quality", ("--json", "/nonexistent/q.json"), "--json /nonexistent/q.json: the folder"),
    ],
)
def test_the_fsdp_bench_and_the_quality_suite_reject_bad_flags_first(
    monkeypatch, capsys, entry, args, words
):
    import pycomm.bench.fsdp
    import pycomm.bench.quality

    def no_launch(*a, **k):
        raise AssertionError("a rank was launched")

    monkeypatch.setattr(pycomm, "launch", no_launch)
    monkeypatch.setattr(link, "probe", no_launch)
    module = {"fsdp": pycomm.bench.fsdp, "quality": pycomm.bench.quality}[entry]
    with pytest.raises(SystemExit) as exit_:
        module.main(["--hooks", "bf16", *args] if entry == "quality" else list(args))
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def test_the_fsdp_bench_runs_each_hook_once_in_order(monkeypatch, capsys):
    import pycomm.bench.fsdp

    class Launched(Exception):
        pass

    def launch(fn, nprocs, spec, hooks, *args, **kwargs):
        raise Launched(hooks)

    monkeypatch.setattr(pycomm, "launch", launch)
    with pytest.raises(Launched) as launched:
        pycomm.bench.fsdp.main(["--hooks", "int8,fsdp,int8,fsdp"])
    assert launched.value.args[0] == ["int8", "fsdp"]


def test_rates_parse_like_tc():
    assert link.parse_rate("2.5gbit") == 2_500_000_000
    assert link.parse_rate("1tbit") == link.MAX_BITS
    for text in ("1e400gbit", "1.1tbit"):
        with pytest.raises(ValueError, match=f"'{text}' is more than 1000000000000 bit/s"):
            link.parse_rate(text)
    assert link.parse_rate("500Mbit") == 500_000_000
    assert link.parse_rate("100mbps") == 800_000_000
    assert link.parse_rate("1gibit") == 2**30
    assert link.tc_command(5 * 10**9)[-6:] == ["rate", "5000000000bit", "burst", "1mb"] + [
        "latency",
        "100ms",
    ]


def test_model_sizes():
    assert count_params(ModelSpec("mlp", layers=8, width=1024)) == 8 * (1024 * 1024 + 1024)
    # a GPT block is 12 d^2 + 13 d; embeddings vocab x d (tied with the head) and seq x d
    d, v, t, n = 64, 100, 16, 3
    spec = ModelSpec("transformer", layers=n, d_model=d, heads=4, seq_len=t, vocab=v)
    assert count_params(spec) == n * (12 * d * d + 13 * d) + v * d + t * d + 2 * d
    assert count_params(ModelSpec("mlp", layers=16, width=256)) < 1.2e6
    assert count_params(ModelSpec("transformer", layers=8, d_model=1024)) > 100e6


def test_default_set_has_every_torch_and_pycomm_hook():
    names = default_hooks_set()
    for name in ("compute", "ddp", "torch-allreduce", "torch-fp16", "torch-powersgd1"):
        assert name in names
    for name in ("torch-powersgd4", "allreduce", "fp16", "bf16", "int8", "onebit"):
        assert name in names


@pytest.fixture(scope="module")
def tiny_all(tmp_path_factory):
    """One run of every hook plus ``tests.bench.bench_hooks:badsetup``, a hook of our own that
    raises while being set up: it is dropped inside the launch, never relaunched."""
    folder = tmp_path_factory.mktemp("bench")
    out = _run(
        *TINY,
        "--hooks", "all,tests.bench.bench_hooks:badsetup",
        "--json", str(folder / "out.json"),
        "--plot", str(folder / "out.png"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out, json.loads((folder / "out.json").read_text()), folder / "out.png"


@pytest.mark.slow
def test_json_has_every_requested_hook(tiny_all):
    out, doc, _ = tiny_all
    hooks = doc["hooks"]
    assert list(hooks) == [*available_hooks(), BAD]
    assert doc["config"]["hooks"] == list(hooks)
    assert doc["config"]["model"] == {"kind": "mlp", "layers": 2, "batch": 64, "width": 16}
    assert doc["params"] == 2 * (16 * 16 + 16)
    assert doc["link"]["shaped"] is False and doc["link"]["requested"] is None
    for name, h in hooks.items():
        if name == BAD:
            continue
        assert h["status"] == "ok", (name, h)
        assert len(h["step_times_s"]) == 2 and len(h["rank_step_times_s"]) == 2
        assert h["min_s"] <= h["median_s"] <= h["max_s"]
        assert h["bytes_per_step"] is not None
        assert h["cpu_median_s"] > 0, (name, h)  # process CPU per step, from every rank
    assert "cpu ms" in doc_table_header(doc)
    assert hooks["compute"]["ratio_to_compute"] == 1.0
    assert hooks["ddp"]["speedup_vs_ddp"] == 1.0
    assert hooks["compute"]["bytes_per_step"] == 0
    # an fp32 ring all-reduce over 2 ranks sends the whole model once
    assert hooks["ddp"]["bytes_per_step"] == 4 * doc["params"]
    assert hooks["allreduce"]["bytes_per_step"] == hooks["ddp"]["bytes_per_step"]
    assert hooks["torch-fp16"]["bytes_per_step"] == 2 * doc["params"]
    # the bf16-residual variants send their hook's bytes
    for variant, hook in (("int8-bf16res", "int8"), ("onebit-bf16res", "onebit")):
        assert hooks[variant]["bytes_per_step"] == hooks[hook]["bytes_per_step"]
    # the wire diagnostics send exactly their hook's bytes, and reduce nothing
    for wire, hook in (("int8-wire", "int8"), ("onebit-wire", "onebit")):
        assert hooks[wire]["bytes_per_step"] == hooks[hook]["bytes_per_step"] > 0
        assert hooks[wire]["rel_err"] is None
    for name in hooks:
        assert any(line.startswith(name + " ") for line in out.stdout.splitlines()), name


@pytest.mark.slow
def test_gradient_error_against_the_exact_mean(tiny_all):
    _, doc, _ = tiny_all
    hooks = doc["hooks"]
    assert hooks["compute"]["rel_err"] is None  # no reduction to compare
    for name in ("ddp", "torch-allreduce", "allreduce"):
        assert hooks[name]["rel_err"] < 1e-6, name
        assert len(hooks[name]["rel_errors"]) == 2
    for name, bound in (
        ("bf16", 2e-2),
        ("fp16", 2e-2),
        ("torch-fp16", 2e-2),
        ("int8", 0.1),
        ("int8-bf16res", 0.1),
    ):
        assert 0 < hooks[name]["rel_err"] < bound, (name, hooks[name]["rel_err"])
    # one bit per element plus error feedback: far from exact on one step, but finite
    assert 0.05 < hooks["onebit"]["rel_err"] < 10
    assert "rel err" in doc_table_header(doc)


def doc_table_header(doc):
    return next(line for line in table(doc).splitlines() if line.startswith("hook"))


@pytest.mark.slow
def test_failing_hook_is_reported_and_the_others_measured(tmp_path, capfd, monkeypatch):
    """``tests.bench.bench_hooks:fail`` raises in its second step (the second timed one, without
    warm-up): the others' first step is kept, the launch without it runs the other 3, then the
    failing hook alone."""
    path = tmp_path / "out.json"
    args = (
        "--warmup",
        "0",
        "--steps",
        "4",
        "--hooks",
        "int8,tests.bench.bench_hooks:fail",
        "--json",
        str(path),
    )
    stdout = _main(capfd, monkeypatch, *TINY, *args)
    doc = json.loads(path.read_text())
    for name in ("compute", "ddp", "int8"):
        h = doc["hooks"][name]
        assert h["status"] == "ok" and h["measured"] == "interleaved", h
        assert len(h["step_times_s"]) == 4 and h["salvaged_steps"] == 1
        assert [len(ts) for ts in h["rank_step_times_s"]] == [4, 4]
    assert [launch["steps"] for launch in doc["launches"]] == [4, 3, 4]
    assert doc["launches"][0]["rounds_completed"] == 1
    assert "the first 1 timed steps" in stdout
    fail = doc["hooks"]["tests.bench.bench_hooks:fail"]
    assert fail["status"] == "failed" and fail["phase"] == "step"
    assert "deliberate failure" in fail["error"]
    assert fail["alone"]["status"] == "failed"
    assert (
        "tests.bench.bench_hooks:fail failed: RuntimeError: fail hook: deliberate failure" in stdout
    )
    # interleaved (fails), the others without it, then the failed hook alone
    assert [launch["ok"] for launch in doc["launches"]] == [False, True, False]


@pytest.mark.slow
def test_hook_failing_in_setup_is_reported_without_a_relaunch(tiny_all):
    out, doc, _ = tiny_all
    bad = doc["hooks"][BAD]
    assert bad["status"] == "failed" and bad["phase"] == "setup"
    assert bad["error"] == "RuntimeError: badsetup hook: deliberate failure while setting up"
    assert f"{BAD} failed while setting up: RuntimeError" in out.stdout
    assert [launch["ok"] for launch in doc["launches"]] == [True]
    assert [f["hook"] for f in doc["failures"]] == [BAD]


@pytest.mark.slow
def test_plot_is_a_png(tiny_all):
    _, _, png = tiny_all
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_hanging_hook_costs_its_step_deadline_not_the_launch_timeout(tmp_path, capfd, monkeypatch):
    """``tests.bench.bench_hooks:hang`` never completes its second step: the deadline stops the
    ranks; with --rerun-budget 0 it is not rerun alone."""
    path = tmp_path / "out.json"
    stdout = _main(
        capfd, monkeypatch, *TINY, "--hooks", "tests.bench.bench_hooks:hang", "--step-timeout", "3",
        "--rerun-budget", "0", "--json", str(path),
    )  # fmt: skip
    doc = json.loads(path.read_text())
    hang = doc["hooks"]["tests.bench.bench_hooks:hang"]
    assert hang["status"] == "failed" and hang["phase"] == "hung", hang
    # the deadline: max(--step-timeout, 5x the slowest step so far), seconds either way
    assert re.match(r"hung: a step made no progress for 0:00:\d\d", hang["error"]), hang
    assert "ranks were stopped" in hang["error"]
    assert hang["alone"]["status"] == "skipped"
    assert "not rerun alone: --rerun-budget spent" in stdout
    assert doc["hooks"]["ddp"]["status"] == "ok"
    assert [launch["ok"] for launch in doc["launches"]] == [False, True]
    # the stuck rank's stack, dumped by faulthandler, is kept for the reader
    assert "Timeout (0:00:" in doc["failures"][0]["detail"]
    assert "backward" in doc["failures"][0]["detail"]


GPT = ("--d-model", "32", "--heads", "4", "--seq-len", "8", "--vocab", "50", "--batch", "2")


@pytest.fixture(scope="module")
def gpt_accumulated(tmp_path_factory):
    """One run for two flags: the transformer, with 2 micro-steps per optimizer step (the
    accumulation loop is the same for either model, so one launch checks both)."""
    path = tmp_path_factory.mktemp("bench_gpt") / "out.json"
    out = _main_captured(
        "--model", "transformer", "--layers", "2", *GPT, "--steps", "2", "--warmup", "2",
        "--accumulate-steps", "2", "--hooks", "allreduce,int8", "--json", str(path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out, json.loads(path.read_text())


@pytest.mark.slow  # the fixture is a whole run (about 20 s): make frameworks
def test_transformer(gpt_accumulated):
    out, doc = gpt_accumulated
    spec = ModelSpec("transformer", layers=2, batch=2, d_model=32, heads=4, seq_len=8, vocab=50)
    assert doc["params"] == count_params(spec)
    assert doc["config"]["model"] == spec.config()
    assert "GPT 2 blocks x d_model 32 (4 heads)" in out.stdout
    for name in ("compute", "ddp", "allreduce", "int8"):
        assert doc["hooks"][name]["status"] == "ok", doc["hooks"][name]
    assert doc["hooks"]["allreduce"]["rel_err"] < 1e-6
    assert doc["hooks"]["ddp"]["bytes_per_step"] == 4 * doc["params"]


@pytest.mark.slow
def test_accumulate_steps(gpt_accumulated):
    """K=2: plain DDP under no_sync and pycomm's accumulate stage both give the exact mean of
    the 2 micro-batches, and send the model once per optimizer step, in one launch."""
    out, doc = gpt_accumulated
    assert doc["config"]["accumulate_steps"] == 2
    assert "one optimizer step of 2 micro-steps" in out.stdout
    ddp = doc["hooks"]["ddp"]
    assert ddp["status"] == "ok" and ddp["rel_err"] < 1e-6
    assert ddp["bytes_per_step"] == 4 * doc["params"]
    assert len(doc["launches"]) == 1
    ours = doc["hooks"]["allreduce"]
    assert ours["status"] == "ok" and ours["rel_err"] < 1e-6, ours
    assert ours["bytes_per_step"] == ddp["bytes_per_step"]
    int8 = doc["hooks"]["int8"]
    assert int8["status"] == "ok" and 0 < int8["bytes_per_step"] < ddp["bytes_per_step"], int8


@pytest.mark.slow
@pytest.mark.skipif(link.cannot_shape() is not None, reason=f"cannot shape: {link.cannot_shape()}")
def test_shaped_link(tmp_path, capfd, monkeypatch):
    path = tmp_path / "out.json"
    stdout = _main(
        capfd, monkeypatch, *TINY, "--hooks", "ddp", "--link", "1gbit", "--json", str(path)
    )
    doc = json.loads(path.read_text())
    assert doc["link"]["shaped"] is True, doc["link"]
    assert doc["link"]["per_rank_bits"] == 10**9 and doc["link"]["total_bits"] == 2 * 10**9
    assert "tbf" in doc["link"]["qdisc"]
    ddp = doc["hooks"]["ddp"]
    assert ddp["status"] == "ok"
    # measured on the namespace's own lo: the model's bytes plus TCP/IP headers
    assert ddp["lo_bytes_per_step"] >= ddp["bytes_per_step"] > 0
    assert "1 Gbit/s per rank" in stdout


@pytest.mark.slow
@pytest.mark.skipif(link.cannot_shape() is not None, reason=f"cannot shape: {link.cannot_shape()}")
def test_simulated_nodes(tmp_path, capfd, monkeypatch):
    """2 nodes x 2 ranks: the ranks see the nodes (auto resolves to node), and the node
    hierarchy sends about half of flat's bytes across each node's uplink (bytes, not time)."""
    path = tmp_path / "out.json"
    tiny = ("--width", "64", "--layers", "2", "--steps", "2", "--warmup", "2", "--nprocs", "4")
    hooks = "ddp,int8,int8-node,int8-flat,allreduce-node"
    args = (*tiny, "--nodes", "2", "--hooks", hooks, "--link", "1gbit", "--json", str(path))
    stdout = _main(capfd, monkeypatch, *args)
    doc = json.loads(path.read_text())
    assert doc["link"]["nodes"] == 2 and doc["link"]["shaped"] is True
    assert doc["link"]["qdisc"].count("tbf") == 2, doc["link"]
    h = doc["hooks"]
    assert all(v["status"] == "ok" for v in h.values()), h
    up = {name: v["uplink_bytes_per_step"] for name, v in h.items()}
    assert all(b > 0 for b in up.values()), up
    assert up["int8-node"] < 0.7 * up["int8-flat"], up
    assert up["allreduce-node"] < 0.8 * up["ddp"], up
    # auto is node here: the same bytes as int8-node by the hook's own count
    assert h["int8"]["bytes_per_step"] == h["int8-node"]["bytes_per_step"]
    assert h["allreduce-node"]["rel_err"] < 1e-6
    assert "uplink MB/step" in stdout and "2 simulated nodes of 2 ranks" in stdout


def _fake_measure(cfg, hooks, nprocs, timeout, **kwargs):
    one = {"status": "ok", "median_s": 0.01, "min_s": 0.01, "max_s": 0.01}
    return {
        "params": 1000,
        "hooks": {name: {**one, "bytes_per_step": 0.0, "cfg": cfg} for name in hooks},
        "failures": [],
        "launches": [],
    }


def test_link_without_root_runs_unshaped(monkeypatch, capsys, tmp_path):
    import pycomm.bench.__main__ as bench_main

    monkeypatch.setattr(link.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(link, "probe", lambda bits: pytest.fail("probed without root"))
    monkeypatch.setattr(bench_main, "measure", _fake_measure)
    path = tmp_path / "out.json"
    assert main([*TINY, "--hooks", "ddp", "--link", "2.5gbit", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert "cannot shape the loopback (shaping needs root" in captured.err
    assert "running UNSHAPED" in captured.err
    assert "UNSHAPED loopback (2.5gbit requested" in captured.out
    doc = json.loads(path.read_text())
    assert doc["link"]["shaped"] is False and doc["link"]["per_rank_bits"] == 2_500_000_000
    assert "root" in doc["link"]["reason"]
    assert doc["hooks"]["ddp"]["cfg"]["measure_lo"] is False


def _fake_gpus(monkeypatch, count):
    from types import SimpleNamespace

    from pycomm import ops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "FakeGPU")
    props = SimpleNamespace(total_memory=80 * 10**9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    monkeypatch.setattr(ops, "WITH_CUDA", True)


@pytest.mark.parametrize(
    "gpus, nprocs, backend, want",
    [
        (2, 2, "auto", "nccl"),
        (1, 2, "auto", "gloo"),
        (1, 2, "gloo", "gloo"),
        (4, 2, "nccl", "nccl"),
    ],
)
def test_device_cuda_picks_the_backend(monkeypatch, capsys, gpus, nprocs, backend, want):
    import pycomm.bench.__main__ as bench_main

    seen = {}

    def fake(cfg, hooks, nprocs, timeout, **kwargs):
        seen.update(cfg=cfg)
        return _fake_measure(cfg, hooks, nprocs, timeout)

    _fake_gpus(monkeypatch, gpus)
    monkeypatch.setattr(bench_main, "measure", fake)
    argv = ["--device", "cuda", "--backend", backend, "--nprocs", str(nprocs), "--quiet"]
    assert main(argv + ["--hooks", "int8"]) == 0
    assert seen["cfg"]["device"] == "cuda" and seen["cfg"]["backend"] == want
    out = capsys.readouterr().out
    assert f"({want}, on {min(gpus, nprocs)} GPU(s), FakeGPU)" in out, out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--backend", "nccl", "--nprocs", "3"], "NCCL needs a GPU per rank and 2 GPU(s)"),
        (["--width", "16384", "--layers", "30"], "GB is on one GPU (1 rank(s) on it)"),
    ],
)
def test_device_cuda_refuses_what_the_gpus_cannot_hold(monkeypatch, capsys, argv, words):
    def no_launch(*a, **k):
        raise AssertionError("a rank was launched")

    _fake_gpus(monkeypatch, 2)
    monkeypatch.setattr(pycomm, "launch", no_launch)
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cuda", *argv])
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def test_flags_reach_the_ranks(monkeypatch, capsys):
    import pycomm.bench.__main__ as bench_main

    seen = {}

    def fake(cfg, hooks, nprocs, timeout, **kwargs):
        seen.update(cfg=cfg, hooks=hooks, nprocs=nprocs, **kwargs)
        return _fake_measure(cfg, hooks, nprocs, timeout)

    monkeypatch.setattr(bench_main, "measure", fake)
    argv = ["--nprocs", "3", "--hooks", "int8", "--accumulate-steps", "4", "--error-steps", "1"]
    argv += ["--model", "transformer", "--d-model", "64", "--heads", "8", "--quiet"]
    assert main(argv) == 0
    cfg = seen["cfg"]
    assert seen["nprocs"] == 3 and seen["hooks"] == ["compute", "ddp", "int8"]
    assert cfg["accumulate_steps"] == 4 and cfg["error_steps"] == 1
    assert cfg["model"] == {
        "kind": "transformer", "layers": 8, "batch": 4, "d_model": 64, "heads": 8,
        "seq_len": 64, "vocab": 8192,
    }  # fmt: skip
    assert seen["progress"] is False  # --quiet
    assert capsys.readouterr().err == ""  # --quiet: nothing on stderr


def test_plot_draws_failed_hooks_too(tmp_path):
    doc = {
        "config": {
            "nprocs": 2,
            "threads": 1,
            "steps": 2,
            "warmup": 1,
            "model": ModelSpec().config(),
        },
        "params": 8396800,
        "link": {"shaped": False, "requested": None},
        "hooks": {
            "compute": {"status": "ok", "median_s": 0.05, "min_s": 0.04, "max_s": 0.06},
            "ddp": {"status": "ok", "median_s": 0.15, "min_s": 0.14, "max_s": 0.2},
            "int8": {"status": "failed", "error": "hung: a step made no progress; ..."},
        },
        "failures": [],
    }
    plot(doc, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_progress_bar_follows_rank0(tmp_path, monkeypatch):
    pytest.importorskip("tqdm")
    path = tmp_path / "rank0.progress"
    path.write_text("step ddp 3 5/10".ljust(128))
    bar = session._Bar(str(path), 10, "test", enabled=True)
    try:
        for _ in range(100):  # the poller reads every 0.25 s
            if bar.bar.n == 5:
                break
            time.sleep(0.05)
        assert bar.bar.n == 5 and bar.bar.total == 10
    finally:
        bar.close()
    assert session._Bar(str(path), 10, "test", enabled=False).bar is None


def _registered_ops():
    with open(os.path.join(ROOT, "csrc", "registration.cpp")) as f:
        return sorted(set(re.findall(r'm\.def\(\s*"([a-z0-9_]+)\(', f.read())))


@pytest.mark.slow
def test_kernel_benchmarks_cover_every_op(tmp_path):
    """Every op in csrc/registration.cpp is timed by a kernel benchmark (against the copy floor
    and torch eager): run them at a tiny size and read the cases they timed."""
    ops = _registered_ops()
    assert len(ops) >= 11, ops
    covered = set()
    runs = {}
    for script in ("bench_fusion.py", "bench_codecs.py"):  # side by side: one start-up's wait
        out_json = tmp_path / f"{script}.json"
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), "--mb", "0.05"]
        cmd += ["--reps", "1", "--warm-ms", "0", "--json", str(out_json)]
        runs[out_json] = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
    for out_json, proc in runs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        rows = json.loads(out_json.read_text())["rows"]
        assert all(r["ours_gbs"] > 0 and r["copy_over_ours"] > 0 for r in rows)
        covered |= {r["case"].split()[0] for r in rows}
    assert set(ops) <= covered, set(ops) - covered


# --- measure's decisions on failing launches, with the launches scripted (nothing starts) ---


def _scripted_launches(module, monkeypatch, fails):
    """Replaces ``module._launch``: a launch of ``hooks`` fails, blaming ``fails(hooks)``'s
    answer (a hook name, or "" for none), when that answer is not None. Returns the launches'
    hooks, in order."""
    launches: list[list[str]] = []

    def launch(cfg, hooks, nprocs, timeout, log, progress=False, number=1):
        launches.append(list(hooks))
        blame = fails(hooks)
        if blame is None:
            per = {
                "times_s": [0.1], "cpu_s": [0.1], "bytes_per_step": 8, "bytes_source": "test",
                "lo_bytes": None, "uplink_bytes": None, "rel_errors": [], "bucket_sizes": [],
                "gpu_peak_bytes": None, "auto": None,
            }  # fmt: skip
            result = {"params": 10, "hooks": {h: dict(per) for h in hooks}, "setup_failures": {}}
            return {"hooks": list(hooks), "ok": True, "results": [result]}
        return {
            "hooks": list(hooks), "ok": False, "blame": blame or None, "rounds": [],
            "error": f"boom ({', '.join(hooks)})", "hung": False, "detail": "detail",
        }  # fmt: skip

    monkeypatch.setattr(module, "_launch", launch)
    return launches


def _scripted_cases(module, monkeypatch):
    """(what measure returned, the launches) for three scripted failures."""
    hooks, cfg = ["compute", "ddp", "int8"], {"steps": 2}
    out = {}

    def run(name, fails):
        launches = _scripted_launches(module, monkeypatch, fails)
        out[name] = (module.measure(cfg, hooks, 2, 60, log=lambda text: None), launches)

    # compute fails even alone: the machine is broken, every hook fails, no hook is blamed
    run("environment", lambda hs: "compute" if "compute" in hs else None)
    # launches of several hooks fail outside any hook, each hook alone works
    run("together", lambda hs: "" if len(hs) > 1 else None)
    # int8 kills the launches it is in with others, and passes alone at the end
    run("intermittent", lambda hs: "int8" if "int8" in hs and len(hs) > 1 else None)
    return out


def test_measure_decides_from_the_failed_launches(monkeypatch):
    cases = _scripted_cases(session, monkeypatch)

    result, launches = cases["environment"]
    assert launches == [["compute", "ddp", "int8"], ["compute"]]
    assert [(f["hook"], f["phase"]) for f in result["failures"]][0] == (None, "environment")
    assert all(h["status"] == "failed" for h in result["hooks"].values()), result["hooks"]

    result, launches = cases["together"]
    assert launches == [["compute", "ddp", "int8"]] * 2 + [["compute"], ["ddp"], ["int8"]]
    assert [(f["hook"], f["phase"]) for f in result["failures"]] == [(None, "interleaved")]
    assert {h["measured"] for h in result["hooks"].values()} == {"alone"}

    result, launches = cases["intermittent"]
    assert launches == [["compute", "ddp", "int8"], ["compute", "ddp"], ["int8"]]
    int8 = result["hooks"]["int8"]
    assert int8["status"] == "failed" and int8["alone"]["status"] == "ok", int8
    assert result["hooks"]["ddp"]["measured"] == "interleaved"


@pytest.mark.slow
@pytest.mark.skipif(link.cannot_shape() is not None, reason=f"cannot shape: {link.cannot_shape()}")
def test_local_sgd_bench_measures_each_variant(tmp_path):
    """python -m pycomm.bench --local-sgd on a shaped link: every variant's step time and
    bytes, the outer loop's far fewer than DDP's."""
    out = tmp_path / "local_sgd.json"
    cmd = [sys.executable, "-m", "pycomm.bench", "--local-sgd", "--link", "1gbit",
           "--variants", "compute,ddp,localsgd-H10-F1-d1,diloco-H10-F4-d0", "--block", "50",
           "--rounds", "1", "--width", "32", "--layers", "2", "--batch", "8",
           "--json", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=240, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"compute", "ddp", "localsgd-H10-F1-d1", "diloco-H10-F4-d0"}
    assert rows["compute"]["bytes_per_step"] == 0
    assert rows["ddp"]["bytes_per_step"] > 5 * rows["localsgd-H10-F1-d1"]["bytes_per_step"] > 0
    assert all(r["step_ms"] > 0 for r in rows.values())
