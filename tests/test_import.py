"""Importing pycomm with a missing or stale extension: an ImportError that says which, and how
to rebuild. Each case runs in a fresh interpreter, with pycomm._C replaced before import."""

import subprocess
import sys

import pytest

MISSING = "import sys; sys.modules['pycomm._C'] = None\n"
STALE = (
    "import sys, types; m = types.ModuleType('pycomm._C'); m.TORCH_VERSION = '1.13.1'\n"
    "m.WITH_CUDA = 0; m.CPU_CAPABILITY = 'DEFAULT'; sys.modules['pycomm._C'] = m\n"
)
UNLOADABLE = (
    "import sys, importlib.abc\n"
    "class F(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path, target=None):\n"
    "        if name == 'pycomm._C':\n"
    "            raise ImportError('_C.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev')\n"
    "sys.meta_path.insert(0, F())\n"
)


@pytest.mark.parametrize(
    "prelude, words",
    [
        (MISSING, ["pycomm._C is missing", "pip install --no-build-isolation -e ."]),
        (STALE, ["built against torch 1.13.1", "is installed", "pip install --no-build-isolation"]),
        (UNLOADABLE, ["failed to load", "another torch", "undefined symbol", "pip install"]),
    ],
    ids=["missing", "other-torch-version", "undefined-symbol"],
)
def test_import_error_says_which_and_how_to_rebuild(prelude, words):
    code = prelude + (
        "try:\n"
        "    import pycomm\n"
        "except ImportError as e:\n"
        "    print('IMPORTERROR', e)\n"
        "else:\n"
        "    print('IMPORTED')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "IMPORTERROR" in out.stdout, out.stdout + out.stderr
    for w in words:
        assert w in out.stdout, out.stdout


def test_real_extension_matches_torch():
    import torch

    from pycomm import ops

    assert ops._C.TORCH_VERSION == torch.__version__
    assert hasattr(torch.ops.pycomm, "pack")


def test_version_is_written_once():
    """The installed metadata reads its version from pycomm/__init__.py (pyproject's dynamic
    version), so the two cannot disagree; and pyproject.toml itself names no version."""
    import importlib.metadata
    import pathlib
    import re

    import pycomm

    assert importlib.metadata.version("pycomm") == pycomm.__version__
    root = pathlib.Path(__file__).resolve().parent.parent
    text = (root / "pyproject.toml").read_text()
    assert re.search(r"^dynamic = \[\"version\"\]$", text, re.M)
    assert not re.search(r"^version\s*=", text.split("[project]")[1].split("\n[")[0], re.M)
