"""Every op schema has everything docs/custom_hooks.md's "Adding a built-in op" checklist
asks for: a CPU kernel, a CUDA kernel, a fake (or Meta) kernel, a reference, a wrapper in
pycomm.ops and kernel cases in the kernel tests. The schemas are read from
csrc/registration.cpp, so an op added there and forgotten elsewhere fails here by name."""

import os
import re

import pytest
import torch
from conftest import pycomm_ops
from harness import ROOT

import pycomm  # noqa: F401 - loads the extension
from pycomm import ops, reference

CSRC = os.path.join(ROOT, "csrc")
KERNEL_TESTS = ("kernels/test_fusion_ops.py", "kernels/test_codec_ops.py")


def _read(*parts: str) -> str:
    with open(os.path.join(*parts), encoding="utf-8") as f:
        return f.read()


def schemas() -> list[str]:
    """The op names ``m.def`` declares in csrc/registration.cpp."""
    return re.findall(r'm\.def\(\s*"(\w+)\(', _read(CSRC, "registration.cpp"))


def _registered(key: str, folder: str, suffixes: tuple[str, ...]) -> set[str]:
    """Ops with an ``m.impl`` in a csrc/host header whose ``register_*<key>`` is called from a
    source file of ``folder``."""
    called = set()
    for f in os.listdir(os.path.join(CSRC, folder)):
        if f.endswith(suffixes):
            called |= set(re.findall(rf"register_(\w+)<{key}>", _read(CSRC, folder, f)))
    out = set()
    for f in os.listdir(os.path.join(CSRC, "host")):
        text = _read(CSRC, "host", f)
        for fn, body in re.findall(
            r"void register_(\w+)\(torch::Library& m\) \{(.*?)\n\}", text, re.S
        ):
            if fn in called:
                out |= set(re.findall(r'm\.impl\("(\w+)"', body))
    return out


SCHEMAS = schemas()


def test_the_schemas_are_the_loaded_ops():
    assert SCHEMAS and sorted(SCHEMAS) == pycomm_ops()


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_op_has_a_cpu_kernel(name):
    assert name in _registered("Cpu", "cpu", (".cpp",)), f"{name}: no m.impl for the CPU"
    has = torch._C._dispatch_has_kernel_for_dispatch_key(f"pycomm::{name}", "CPU")
    assert has, f"{name}: the loaded build has no CPU kernel"


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_op_has_a_cuda_kernel(name):
    assert name in _registered("Cuda", "cuda", (".cu",)), f"{name}: no m.impl for CUDA"


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_op_has_a_fake(name):
    qualname = f"pycomm::{name}"
    meta = torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta")
    fake = torch._library.simple_registry.singleton.find(qualname).fake_impl.kernel is not None
    assert meta or fake, f"{name}: neither a Meta kernel nor a registered fake"


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_op_has_a_reference(name):
    assert callable(getattr(reference, name, None)), f"pycomm.reference.{name} is missing"


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_op_has_a_wrapper(name):
    fn = getattr(ops, name, None)
    assert callable(fn), f"pycomm.ops.{name} is missing"
    assert "Example:" in (fn.__doc__ or ""), f"pycomm.ops.{name} has no docstring example"


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_op_has_kernel_cases(name):
    text = "".join(_read(ROOT, "tests", f) for f in KERNEL_TESTS)
    assert re.search(rf"""["']{name}["']""", text), (
        f"{name}: no kernel case in {', '.join(KERNEL_TESTS)} (be({name!r}, ...) against "
        "pycomm.reference)"
    )
