"""Builds pycomm._C: CPU kernels always, CUDA kernels when torch has CUDA and nvcc is found.

Environment:
  USE_CUDA=auto|0|1   auto (default) builds the CUDA kernels when torch was built with CUDA and
                      nvcc is found; 1 requires them; 0 skips them.
  PYCOMM_CPU=auto|avx2|default
                      auto (default): on x86-64, build the CPU kernels for AVX2+FMA+F16C when
                      the building machine has them (as at::vec's AVX2 kernels); default: no
                      ISA flags (portable, slower fp16/bf16 conversion).
  DEBUG=1             -O0 -g instead of -O3.
  TORCH_CUDA_ARCH_LIST  honoured by torch.utils.cpp_extension (default here: 8.0;9.0).
"""

import glob
import importlib.util
import os
import platform
import sys

import setuptools
import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))

# pyproject.toml's build-system requirement, which `pip install --no-build-isolation` does not
# install: the environment's own setuptools builds, and before 77 it cannot read the SPDX
# license expression (it fails with "project.license must be valid exactly by one definition").
_SETUPTOOLS = tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())
if _SETUPTOOLS < (77,):
    raise SystemExit(
        f"setup.py: pycomm builds with setuptools>=77 and this environment has setuptools "
        f"{setuptools.__version__}. Upgrade it first (it does not change torch): "
        "python -m pip install -U 'setuptools>=77' wheel ninja"
    )


def _load_buildcheck():
    # by path: importing the pycomm package would load the extension this builds
    spec = importlib.util.spec_from_file_location(
        "pycomm_buildcheck", os.path.join(ROOT, "pycomm", "_buildcheck.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _use_cuda() -> bool:
    mode = os.environ.get("USE_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"setup.py: USE_CUDA={mode!r} is not one of auto, 0, 1")
    have = torch.version.cuda is not None and CUDA_HOME is not None
    if mode == "1" and not have:
        why = "torch was built without CUDA" if torch.version.cuda is None else "nvcc not found"
        raise SystemExit(f"setup.py: USE_CUDA=1 but {why} (torch {torch.__version__})")
    return mode != "0" and have


def _cpu_flags() -> list:
    mode = os.environ.get("PYCOMM_CPU", "auto").strip().lower()
    if mode not in ("auto", "avx2", "default"):
        raise SystemExit(f"setup.py: PYCOMM_CPU={mode!r} is not one of auto, avx2, default")
    if mode == "auto":
        try:
            with open("/proc/cpuinfo") as f:
                flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
        except OSError:
            flags = set()
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        mode = "avx2" if x86 and {"avx2", "fma", "f16c"} <= flags else "default"
    if mode == "default":
        return ['-DPYCOMM_CPU_CAPABILITY="DEFAULT"']
    # at::vec picks its AVX2 Vectorized<T> from these; pycomm.ops refuses to load the build on
    # a CPU without AVX2 (a clear ImportError instead of SIGILL).
    return [
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-DCPU_CAPABILITY=AVX2",
        "-DCPU_CAPABILITY_AVX2",
        '-DPYCOMM_CPU_CAPABILITY="AVX2"',
    ]


def _extension():
    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    # The torch version is compiled in so that pycomm.ops can refuse a stale build clearly.
    macros = [("PYCOMM_TORCH_VERSION", f'"{torch.__version__}"')]
    # -ffp-contract=off: no fused multiply-adds the references do not do, so the CPU kernels
    # round exactly as pycomm.reference does.
    cxx = opt + ["-ffp-contract=off"] + _cpu_flags()
    link = []
    # at::parallel_for is a header template over `#pragma omp parallel` when torch uses OpenMP:
    # without -fopenmp it silently runs on one thread. The libgomp torch already loaded is used.
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    if _use_cuda():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        macros.append(("PYCOMM_WITH_CUDA", "1"))
        # --fmad=false is nvcc's -ffp-contract=off; with IEEE division and denormals the CUDA
        # kernels round exactly as the CPU kernels and pycomm.reference do.
        nvcc = opt + [
            "--expt-relaxed-constexpr",
            "-lineinfo",
            "--fmad=false",
            "-ftz=false",
            "-prec-div=true",
            "-prec-sqrt=true",
        ]
        return CUDAExtension(
            "pycomm._C",
            sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=macros,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=link,
        )
    return CppExtension(
        "pycomm._C",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=macros,
        extra_compile_args={"cxx": cxx},
        extra_link_args=link,
    )


setup(
    ext_modules=[_extension()],
    # links against the shared libstdc++ (strips -static-libstdc++ that the interpreter's
    # sysconfig or LDFLAGS may carry) and refuses a built _C that defines the C++ runtime itself
    cmdclass={"build_ext": _load_buildcheck().guarded(BuildExtension.with_options(use_ninja=True))},
)
