"""The kernel backends every kernel test runs on, through the ``be`` fixture:

- ``cpu``: the CPU kernels (csrc/cpu), on CPU tensors. Always.
- ``emu``: the CUDA kernels' source (csrc/cuda) compiled as C++ against
  ``csrc/cuda/emu/emu.h``, which runs every CUDA thread as a fiber with real barriers and warp
  shuffles, registered as the CPU kernels of a mirror library ``pycomm_emu`` (with pycomm's
  own schemas). It runs everywhere: building it takes about half a minute, cached in the temp
  directory (``PYCOMM_EMU_BUILD`` names another); ``PYCOMM_CUDA_EMU=0`` skips it. It checks
  the kernels' indexing, vector and scalar paths, reductions, launch shapes and rounding
  without a GPU (not their speed, nor what only concurrent blocks or a memory checker would
  show).
- ``cuda``: the CUDA kernels on a GPU, with CUDA tensors, when there is one and the build
  has them (``scripts/gpu_validate.sh`` runs the kernel tests on one).

Two options select and stand in for the device (``scripts/gpu_validate.sh`` passes them):

- ``--device-tests``: only the tests that run on the GPU (the ``cuda`` backend's cases of
  ``be`` and ``cuda_be``, and the tests that take the ``cuda`` or ``gpu`` fixture), instead of
  ``-k cuda``, which also matches the module name ``test_cuda.py``.
- ``--cpu-stand-in``: the dry run of a machine without a GPU. The tests that take the ``gpu``
  fixture, whose code needs no kernel launched on a device (the hooks' host paths, the
  side-stream path, opcheck's samples, the sync-free script), run with the CPU as their
  device; those that take ``cuda`` (streams, device placement) are skipped, saying why.

A test written against ``be`` calls ``be("op", *args)`` with its tensors moved there by
``be.to`` / ``be.args`` (same shape, strides and storage offset, so alignment is kept) and
compares with ``pycomm.reference`` on the CPU (``kernel_data.bits_equal`` moves results back).
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from pycomm import launcher

# Ranks fork from one server that imported torch once (pycomm.launch's start_method): a
# launch costs a fraction of a second instead of each rank's import of torch. The tests of
# launch itself run both start methods.
os.environ.setdefault("PYCOMM_START_METHOD", "forkserver")
# a test's subprocess that crashes (SIGSEGV, SIGABRT) prints every thread's Python stack
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# whichever starts the server first (a launch, or a test's own forkserver processes)
multiprocessing.set_forkserver_preload(launcher.FORKSERVER_PRELOAD)

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
# The shared helpers (harness, ddp_harness, fsdp_harness, kernel_data, doc_blocks) sit here,
# beside this file; the test modules in the subfolders (kernels/, hooks/, ...) import them by
# name. pytest's default import mode would put this folder on sys.path when it imports this
# file; this says so whatever the mode. The ranks the harness starts get this sys.path too.
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
CSRC = os.path.join(ROOT, "csrc")
EMU_SOURCES = [
    os.path.join(CSRC, "cuda", "emu", "fusion_emu.cpp"),
    os.path.join(CSRC, "cuda", "emu", "codecs_emu.cpp"),
]
BACKENDS = ["cpu", "emu", "cuda"]


def pycomm_ops() -> list[str]:
    """The names of every torch.ops.pycomm op the loaded build defines."""
    return sorted(
        n.split("::", 1)[1]
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("pycomm::")
    )


def _sources_digest() -> str:
    # everything the emulator compiles: the CUDA sources, the host entries, the checks
    h = hashlib.sha256(torch.__version__.encode())
    for sub in ("cuda", "host"):
        for root, dirs, files in os.walk(os.path.join(CSRC, sub)):
            dirs.sort()
            for f in sorted(files):
                with open(os.path.join(root, f), "rb") as fh:
                    h.update(f.encode() + fh.read())
    with open(os.path.join(CSRC, "checks.h"), "rb") as fh:
        h.update(fh.read())
    return h.hexdigest()[:16]


_EMU_LIB = None
# A process building the emulator while the session's first tests run (see
# pytest_collection_finish), or None.
_EMU_BUILDER = None


def _emu_build_dir() -> str:
    return os.environ.get("PYCOMM_EMU_BUILD") or os.path.join(
        tempfile.gettempdir(), f"pycomm_cuda_emu_{_sources_digest()}"
    )


def pytest_addoption(parser) -> None:
    group = parser.getgroup("pycomm devices")
    group.addoption(
        "--device-tests",
        action="store_true",
        help="only the tests that run on the GPU (scripts/gpu_validate.sh)",
    )
    group.addoption(
        "--cpu-stand-in",
        action="store_true",
        help="a dry run without a GPU: the gpu fixture's tests run on the CPU",
    )


def _runs_on_the_device(item) -> bool:
    names = getattr(item, "fixturenames", ())
    if "cuda" in names or "gpu" in names:
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("be") == "cuda" or params.get("cuda_be") == "cuda"


def pytest_collection_modifyitems(config, items) -> None:
    if not config.getoption("--device-tests"):
        return
    keep = [item for item in items if _runs_on_the_device(item)]
    dropped = [item for item in items if not _runs_on_the_device(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def pytest_collection_finish(session) -> None:
    """When collected tests run on the emulator: build it in a process of its own now (half a
    minute of one core; ninja's check alone when the cached build is this checkout's), beside
    the tests that come first."""
    global _EMU_BUILDER
    wanted = any(
        getattr(item, "callspec", None) is not None and item.callspec.params.get("be") == "emu"
        for item in session.items
    )
    if not wanted or skip_reason("emu") is not None:
        return
    _EMU_BUILDER = subprocess.Popen(
        [sys.executable, "-c", "import conftest; conftest.load_emulator()"],
        cwd=os.path.dirname(os.path.abspath(__file__)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def load_emulator() -> None:
    """Builds (once per source version, cached in the temp directory) and loads the emulated
    CUDA kernels as ``torch.ops.pycomm_emu.*``, with pycomm's own schemas."""
    global _EMU_LIB
    if _EMU_LIB is not None:
        return
    from torch.utils.cpp_extension import load

    lib = torch.library.Library("pycomm_emu", "DEF")
    for name in pycomm_ops():
        schema = str(getattr(torch.ops.pycomm, name).default._schema)
        lib.define(schema.split("::", 1)[1])
    if _EMU_BUILDER is not None:
        # done building (a failed build fails again below, with its compiler's message)
        _EMU_BUILDER.wait()
    build = _emu_build_dir()
    os.makedirs(build, exist_ok=True)
    load(
        name="pycomm_cuda_emu",
        sources=EMU_SOURCES,
        extra_cflags=[
            "-O1",
            "-ffp-contract=off",  # as the CPU kernels, so that fp32 rounds as on the GPU
            "-fno-strict-aliasing",
            "-Wno-unknown-pragmas",
            "-DPYCOMM_CUDA_EMULATION",
        ],
        extra_include_paths=[CSRC],
        build_directory=build,
        is_python_module=False,
        verbose=False,
    )
    _EMU_LIB = lib


class Backend:
    """Where a kernel runs: ``cpu``, ``emu`` (the CUDA kernels emulated on the CPU) or
    ``cuda`` (a GPU)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.device = torch.device("cuda") if name == "cuda" else torch.device("cpu")
        self.ns = torch.ops.pycomm_emu if name == "emu" else torch.ops.pycomm
        # the decoders' squared norm: the CPU adds squares in fp32 lanes within a tile, the
        # CUDA kernels in fp64 per element
        self.norm_rtol = 1e-6 if name == "cpu" else 1e-9

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"

    @property
    def is_cuda_kernel(self) -> bool:
        """Whether this backend runs the CUDA kernels (emulated or not)."""
        return self.name != "cpu"

    def __call__(self, op: str, *args):
        return getattr(self.ns, op)(*args)

    def to(self, t, _copies=None):
        """t on this backend with the same shape, strides and storage offset (alignment); on
        the CPU, a copy of t's storage, so that the caller's tensors stay as they were."""
        if t is None:
            return None
        key = t.untyped_storage().data_ptr()
        whole = None if _copies is None else _copies.get(key)
        if whole is None:
            n = t.untyped_storage().nbytes() // t.element_size()
            whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (n,), (1,))
            whole = whole.to(self.device, copy=True)
            if _copies is not None:
                _copies[key] = whole
        return whole.as_strided(t.shape, t.stride(), t.storage_offset())

    def args(self, args):
        """Every tensor of args (lists too) on this backend; tensors that share memory here
        share it there."""
        copies: dict = {}
        return [
            self.to(a, copies)
            if isinstance(a, torch.Tensor)
            else [self.to(t, copies) for t in a]
            if isinstance(a, list)
            else a
            for a in args
        ]


@functools.cache
def backend(name: str) -> Backend:
    """The backend ``name`` (the emulator built and loaded on first use)."""
    if name == "emu":
        load_emulator()
    return Backend(name)


def skip_reason(name: str) -> str | None:
    """Why backend ``name`` cannot run here, or None."""
    if name == "emu" and os.environ.get("PYCOMM_CUDA_EMU", "1") == "0":
        return "PYCOMM_CUDA_EMU=0 (scripts/cuda_check.sh and make test run the emulator)"
    if name == "cuda":
        from pycomm import ops

        if not torch.cuda.is_available():
            return "no CUDA device (scripts/gpu_validate.sh runs these on a GPU)"
        if not ops.WITH_CUDA:
            return "pycomm._C was built without its CUDA kernels"
    return None


def _backend_fixture(request) -> Backend:
    why = skip_reason(request.param)
    if why is not None:
        pytest.skip(why)
    return backend(request.param)


@pytest.fixture(params=BACKENDS)
def be(request) -> Backend:
    """Every backend: cpu, emu, cuda."""
    return _backend_fixture(request)


@pytest.fixture(params=["emu", "cuda"])
def cuda_be(request) -> Backend:
    """The backends that run the CUDA kernels: emu, cuda (for comparisons with the CPU's)."""
    return _backend_fixture(request)


@pytest.fixture
def cuda() -> Backend:
    """The GPU alone."""
    why = skip_reason("cuda")
    if why is not None:
        pytest.skip(why)
    return backend("cuda")


@pytest.fixture
def gpu(request) -> torch.device:
    """The device of a test whose code runs on the CPU too: the GPU where there is one, the
    CPU in a dry run (``--cpu-stand-in``), else skipped."""
    why = skip_reason("cuda")
    if why is None:
        return torch.device("cuda", 0)
    if request.config.getoption("--cpu-stand-in"):
        return torch.device("cpu")
    pytest.skip(why)
