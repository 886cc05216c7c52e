"""pycomm.transformers, pycomm.ray and pycomm.lightning: optional (``import pycomm`` imports
none of their packages, nor accelerate; a missing one is an ImportError naming what to
install), and each module imports the real package it is named after, not itself (with the
package installed: scripts/frameworks_check.sh). Fresh interpreters, a few seconds each: one
answers for every client."""

import json
import subprocess
import sys

import pytest

CLIENTS = [
    ("pycomm.transformers", "transformers", "pip install transformers", "Trainer"),
    ("pycomm.ray", "ray", 'pip install "ray[train]"', "init"),
]
# (module, the packages made missing, what its ImportError says to install)
OPTIONAL = [
    *((module, (package,), install) for module, package, install, _ in CLIENTS),
    ("pycomm.lightning", ("lightning", "pytorch_lightning"), "pip install lightning"),
]
PACKAGES = ["transformers", "ray", "lightning", "pytorch_lightning", "accelerate"]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


# One interpreter for every client: `import pycomm` first (which of PACKAGES did it import?),
# then each client's packages made missing (sys.modules[name] = None) before its module is
# imported: the ImportError's message, or None when the import worked anyway.
_OPTIONAL = """
import json, sys
import pycomm
out = {"imported": sorted(p for p in PACKAGES if p in sys.modules), "errors": {}}
for module, packages, _ in OPTIONAL:
    for package in packages:
        sys.modules[package] = None
    try:
        __import__(module)
        out["errors"][module] = None
    except ImportError as e:
        out["errors"][module] = str(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def optional():
    out = _python(f"PACKAGES = {PACKAGES!r}\nOPTIONAL = {OPTIONAL!r}\n{_OPTIONAL}")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_import_pycomm_imports_no_client_package(optional):
    assert optional["imported"] == [], optional


@pytest.mark.parametrize("module, _, install", OPTIONAL, ids=[m[0] for m in OPTIONAL])
def test_client_stays_optional(optional, module, _, install):
    error = optional["errors"][module]
    assert error is not None and install in error, (module, error)


@pytest.mark.frameworks
@pytest.mark.parametrize("module, package, _, attr", CLIENTS, ids=["transformers", "ray"])
def test_client_module_imports_the_real_package(module, package, _, attr):
    pytest.importorskip(package)
    out = _python(  # the module first: an `import transformers` in it must find the package
        f"import os, sys, {module}, pycomm\n"
        f"real = sys.modules[{package!r}]\n"
        "assert not real.__file__.startswith(os.path.dirname(pycomm.__file__)), real.__file__\n"
        f"assert real.__name__ == {package!r} and hasattr(real, {attr!r})\n"
        "print('ok')\n"
    )
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]
