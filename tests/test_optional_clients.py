"""pycomm.transformers and pycomm.ray: optional (``import pycomm`` imports neither package, a
missing one is an ImportError naming what to install), and each module imports the real
package it is named after, not itself (with the package installed: scripts/frameworks_check.sh).
Fresh interpreters, a few seconds each."""

import subprocess
import sys

import pytest

CLIENTS = [
    ("pycomm.transformers", "transformers", "pip install transformers", "Trainer"),
    ("pycomm.ray", "ray", 'pip install "ray[train]"', "init"),
]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module, package, install, _", CLIENTS, ids=["transformers", "ray"])
def test_client_stays_optional(module, package, install, _):
    out = _python(
        f"import sys; sys.modules[{package!r}] = None\n"
        "import pycomm\n"
        f"try:\n    import {module}\nexcept ImportError as e:\n    print(e)\n"
    )
    assert out.returncode == 0, out.stderr
    assert install in out.stdout
    out = _python(f"import sys, pycomm; print({package!r} in sys.modules)")
    assert out.stdout.strip() == "False", out.stderr


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
