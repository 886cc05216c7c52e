"""The `python -m pycomm.bench` entry point: a tiny run prints the table; bad flags are
rejected before any rank starts."""

import subprocess
import sys


def _run(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "pycomm.bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_tiny_run_prints_table():
    out = _run("--nprocs", "2", "--width", "32", "--layers", "2", "--steps", "3", "--warmup", "1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("2 ranks (gloo)")
    rows = {ln.split()[0]: ln.split() for ln in lines[2:]}
    assert set(rows) == {"ddp", "allreduce"}
    assert rows["ddp"][4] == "1.000x"
    # both send what an fp32 ring all-reduce of the model sends
    assert rows["ddp"][5] == rows["allreduce"][5] and float(rows["ddp"][5]) > 0


def test_bad_flags_rejected():
    for args, words in [
        (("--hooks", "ddp,zstd"), "unknown hook 'zstd'"),
        (("--nprocs", "0"), "not a positive integer"),
    ]:
        out = _run(*args, timeout=30)
        assert out.returncode == 2 and words in out.stderr, out.stderr
