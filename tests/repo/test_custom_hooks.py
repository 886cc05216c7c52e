"""docs/custom_hooks.md runs as written: every fenced code block of the page.

``# file: NAME`` blocks are saved as NAME in a temporary directory (on sys.path and the
working directory of every block); the Python blocks run in order in one namespace on 2 gloo
ranks (``python ranks=4``: on 4 ranks, in a namespace of their own); the shell blocks run
line by line, concurrently, in that directory. A block asserts what it shows (ranks bitwise
equal, the loss falling, a bitwise resume), so a broken engine or a broken page fails here.
"""

import os
import re
import subprocess
import sys

import doc_blocks
import pytest
from harness import ROOT, run_ranks

PAGE = os.path.join(ROOT, "docs", "custom_hooks.md")


def blocks(path: str = PAGE) -> list[tuple[str, str, str]]:
    """(language, the rest of the fence line, code) of every fenced block of ``path``."""
    return doc_blocks.blocks(path)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The page's blocks, with its files written to a temporary directory."""
    workdir = tmp_path_factory.mktemp("custom_hooks")
    found = blocks()
    files = []
    runs: dict[int, list[tuple[str, str]]] = {}
    shell = []
    for i, (lang, rest, code) in enumerate(found):
        label = f"docs/custom_hooks.md block {i + 1}"
        first = code.splitlines()[0] if code.strip() else ""
        if lang == "python" and first.startswith("# file: "):
            name = first[len("# file: ") :].strip()
            (workdir / name).write_text(code)
            files.append(name)
        elif lang == "python":
            ranks = doc_blocks.ranks_of(rest)
            runs.setdefault(ranks, []).append((label, code))
        elif lang == "bash":
            shell += [line for line in code.splitlines() if line.strip()]
        else:
            raise AssertionError(f"{label}: a {lang!r} block, which this test cannot run")
    return {"dir": str(workdir), "files": files, "runs": runs, "shell": shell}


def test_the_page_has_what_the_tests_run():
    langs = [(lang, code.splitlines()[0]) for lang, _, code in blocks()]
    assert ("python", "# file: topk.py") in langs
    assert sum(lang == "bash" for lang, _ in langs) >= 1
    topk = next(code for lang, _, code in blocks() if code.startswith("# file: topk.py"))
    assert len(topk.splitlines()) <= 80, "the tutorial's codec is one file of about 80 lines"
    assert topk.count("register_hook(") == 1


def test_python_blocks_run_on_gloo_ranks(page):
    for ranks, sources in sorted(page["runs"].items()):
        results = run_ranks(
            doc_blocks.rank_blocks, ranks, page["dir"], sources, page["files"], timeout=240
        )
        assert results == [len(sources)] * ranks


@pytest.mark.slow
def test_shell_blocks_run(page):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([page["dir"], ROOT]))
    procs = []
    for line in page["shell"]:
        assert line.startswith("python "), line
        cmd = [sys.executable, *line.split()[1:], *(["--no-progress"] if "quality" in line else [])]
        procs.append(
            (
                line,
                subprocess.Popen(
                    cmd,
                    cwd=page["dir"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
            )  # fmt: skip
        )
    outputs = {}
    for line, p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, f"{line}\n{out[-3000:]}"
        outputs[line] = out
    listing = next(out for line, out in outputs.items() if "--list-hooks" in line)
    assert re.search(r"^topk\s+pycomm topk hook: top-k per block", listing, re.MULTILINE)
    bench = next(out for line, out in outputs.items() if "--hooks int8,topk" in line)
    assert re.search(r"^topk\s+[\d.]+.* ok$", bench, re.MULTILINE), bench
    quality = next(out for line, out in outputs.items() if "bench.quality" in line)
    assert "| digits-small | sgd-plain | topk | acc " in quality, quality


def _rank_topk_engine(workdir: str, strict: bool) -> dict:
    """The page's top-k codec through what the page does not show: bf16 residuals, the decode
    statistics TrainLoop clips with, and the non-finite skip."""
    import torch
    import torch.distributed as dist

    import pycomm
    from pycomm.hooks import unregister_hook

    sys.path.insert(0, workdir)
    try:
        import topk  # noqa: F401

        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        )
        opts = {"residual_dtype": "bfloat16", "strict_skip": strict}
        ddp = pycomm.wrap(model, hook="topk", hook_options=opts)
        state = pycomm.hook_state(ddp)
        g = torch.Generator().manual_seed(dist.get_rank())
        out = {}
        for step in range(5):
            x = torch.randn(8, 32, generator=g)
            if step == 4 and dist.get_rank() == 1:
                x[0, 0] = float("nan")  # one rank's NaN: every rank skips the step
            ddp.zero_grad()
            ddp(x).square().mean().backward()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            if step == 3:
                out["sqnorm"] = (state.reduced_sqnorm(), float(grads.double().square().sum()))
                kept = state.state_dict()["residuals"]
                out["bf16"] = {t.dtype for r in kept.values() for t in r.values()}
            if step == 4:
                out["nan_everywhere"] = not bool(torch.isfinite(grads).all())
                after = state.state_dict()["residuals"]
                out["residuals_kept"] = all(
                    torch.equal(kept[k][n], after[k][n]) for k in kept for n in kept[k]
                )
                out["residuals_finite"] = all(
                    bool(torch.isfinite(t).all()) for r in after.values() for t in r.values()
                )
                out["nonfinite_buckets"] = state.stats["nonfinite_buckets"]
        return out
    finally:
        unregister_hook("topk")
        sys.modules.pop("topk", None)
        sys.path.remove(workdir)


@pytest.mark.parametrize("strict", [False, True])
def test_the_pages_codec_gets_bf16_residuals_the_norm_and_the_nonfinite_skip(page, strict):
    import torch

    for out in run_ranks(_rank_topk_engine, 2, page["dir"], strict, timeout=120):
        reduced, exact = out["sqnorm"]
        assert reduced == pytest.approx(exact, rel=1e-5)
        assert out["bf16"] == {torch.bfloat16}
        assert out["nan_everywhere"] and out["nonfinite_buckets"] >= 1
        # one copy: the residuals stay finite; strict_skip: bitwise as before the NaN step
        assert out["residuals_finite"]
        assert out["residuals_kept"] or not strict
