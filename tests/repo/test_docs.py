"""The guides run as written: every fenced Python block of README.md and of every page in docs/
(docs/custom_hooks.md has its own test, tests/repo/test_custom_hooks.py).

The fence line says how a block runs:

- ```` ```python ````: on 2 gloo ranks (the pooled ranks of tests/harness.py), the page's
  blocks in order in one namespace, in a temporary working directory;
  ```` ```python ranks=N ````: on N ranks, in a namespace of its own rank count.
- ```` ```python script ````: a whole script, saved to a file and run as ``python FILE``
  (``ranks=N``: under torchrun with N processes).
- ```` ```python script slow ````: a script that takes more than a few seconds (several
  torchruns), run only under ``pytest -m slow`` (``make frameworks``, CI's frameworks job).
- ```` ```python frameworks ````: a whole script that needs an optional framework
  (Lightning, Accelerate, Transformers, Ray), run as a script (``ranks=N``: under torchrun)
  only under ``pytest -m frameworks`` (``make frameworks``, CI's frameworks job).

A fragment that cannot run (a signature, an output) is not a Python block: it is fenced
```` ```text ````. Blocks assert what they show, so a broken page fails here. Models are small:
the pages without frameworks take seconds.
"""

import os
import re
import socket
import subprocess
import sys

import doc_blocks
import pytest
from harness import ROOT, run_ranks

RUN_ELSEWHERE = {"custom_hooks.md"}  # tests/repo/test_custom_hooks.py runs every block of it
PAGES = ["README.md"] + sorted(
    os.path.join("docs", f)
    for f in os.listdir(os.path.join(ROOT, "docs"))
    if f.endswith(".md") and f not in RUN_ELSEWHERE
)
# the guides whose task is code: each must show it
MUST_HAVE_CODE = {
    "README.md",
    "docs/accumulation.md",
    "docs/choosing-a-hook.md",
    "docs/exchange.md",
    "docs/fault-tolerance.md",
    "docs/frameworks.md",
    "docs/fsdp.md",
    "docs/launch.md",
    "docs/nodes.md",
    "docs/reference.md",
    "docs/slow-links.md",
}


def python_blocks(page: str) -> list[tuple[str, str, str]]:
    """(label, fence rest, code) of the page's Python blocks."""
    found = doc_blocks.blocks(os.path.join(ROOT, page))
    return [
        (f"{page} block {i + 1}", rest, code)
        for i, (lang, rest, code) in enumerate(found)
        if lang == "python"
    ]


def _kind(rest: str) -> str:
    words = set(re.sub(r"ranks=\d+", "", rest).split())
    assert words <= {"script", "frameworks", "slow"}, f"unknown fence attributes {words}"
    if "slow" in words:
        return "slow"
    return "frameworks" if "frameworks" in words else "script" if "script" in words else "ranks"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_script(workdir, label: str, rest: str, code: str, timeout: float) -> str:
    name = re.sub(r"\W+", "_", label) + ".py"
    (workdir / name).write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, name]
    if "ranks=" in rest:
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nproc-per-node", str(doc_blocks.ranks_of(rest)),
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
            "--max-restarts", "0", name,
        ]  # fmt: skip
    out = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{label}\n{(out.stdout + out.stderr)[-4000:]}"
    return out.stdout


def test_the_pages_have_their_code():
    for page in MUST_HAVE_CODE:
        assert python_blocks(page), f"{page} shows no Python block"
    kinds = {_kind(rest) for page in PAGES for _, rest, _ in python_blocks(page)}
    assert kinds == {"ranks", "script", "frameworks", "slow"}
    frameworks = [code for _, rest, code in python_blocks("docs/frameworks.md")]
    for name in ("lightning", "accelerate", "transformers", "ray"):
        assert any(f"import {name}" in code or f"from {name}" in code for code in frameworks), name


@pytest.mark.parametrize(
    "page",
    [
        p
        for p in PAGES
        if any(_kind(rest) in ("ranks", "script") for _, rest, _ in python_blocks(p))
    ],
)
def test_python_blocks_run(page, tmp_path):
    runs: dict[int, list[tuple[str, str]]] = {}
    for label, rest, code in python_blocks(page):
        kind = _kind(rest)
        if kind == "ranks":
            runs.setdefault(doc_blocks.ranks_of(rest), []).append((label, code))
        elif kind == "script":
            _run_script(tmp_path, label, rest, code, timeout=120)
    for ranks, sources in sorted(runs.items()):
        results = run_ranks(doc_blocks.rank_blocks, ranks, str(tmp_path), sources, [], timeout=120)
        assert results == [len(sources)] * ranks


_SLOW = [
    pytest.param(label, rest, code, id=label.replace(" ", "-"))
    for page in PAGES
    for label, rest, code in python_blocks(page)
    if _kind(rest) == "slow"
]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("label,rest,code", _SLOW)
def test_slow_script_blocks_run(label, rest, code, tmp_path):
    _run_script(tmp_path, label, rest, code, timeout=280)


_FRAMEWORKS = [
    pytest.param(label, rest, code, id=label.replace(" ", "-"))
    for page in PAGES
    for label, rest, code in python_blocks(page)
    if _kind(rest) == "frameworks"
]


@pytest.mark.frameworks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("label,rest,code", _FRAMEWORKS)
def test_frameworks_blocks_run(label, rest, code, tmp_path):
    _run_script(tmp_path, label, rest, code, timeout=280)
