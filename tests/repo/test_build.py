"""The built extension shares torch's C++ runtime: checked on the binary, not by its behaviour.

A ``_C`` linked with a static libstdc++ segfaults on its first formatted error message under
libstdc++ 13 (two copies of the stream and locale machinery in one process) and runs fine under
libstdc++ 12, so only the binary tells. These tests build small shared objects with and without a
private runtime and check that ``pycomm._buildcheck`` tells them apart, that the build command
strips ``-static-libstdc++`` coming from LDFLAGS, that it refuses a build which still carries the
runtime, and that importing such a build is a clear ImportError.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from pycomm import _buildcheck

CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler on PATH")

PROBE = r"""
#include <sstream>
#include <string>
extern "C" int probe_format(long n, char* buf, int len) {
  std::ostringstream s;
  s << "n=" << n;
  std::string r = s.str();
  int k = (int)r.size() < len - 1 ? (int)r.size() : len - 1;
  r.copy(buf, k);
  buf[k] = 0;
  return k;
}
"""


def _compile(tmp_path, name, *flags):
    src = tmp_path / "probe.cpp"
    src.write_text(PROBE)
    out = tmp_path / f"{name}.so"
    subprocess.run([CXX, "-O1", "-shared", "-fPIC", str(src), *flags, "-o", str(out)], check=True)
    return str(out)


def test_built_extension_shares_the_cpp_runtime():
    import importlib.util

    path = importlib.util.find_spec("pycomm._C").origin
    report = _buildcheck.inspect(path)
    assert report is not None, f"{path} is not an ELF file"
    assert "libstdc++.so.6" in report.needed, report.needed
    assert report.runtime_symbols == (), report.runtime_symbols[:10]
    assert _buildcheck.check(path) == []


@needs_cxx
@pytest.mark.parametrize(
    "flags",
    [
        ["-static-libstdc++"],
        ["-static-libstdc++", "-Wl,--exclude-libs,ALL"],  # the runtime's symbols made local
        ["-Wl,-Bstatic", "-lstdc++", "-Wl,-Bdynamic"],  # libstdc++.a named on the command line
    ],
    ids=["static-libstdc++", "exclude-libs", "libstdc++.a"],
)
def test_check_tells_a_private_runtime_from_the_shared_one(tmp_path, flags):
    shared = _compile(tmp_path, "shared")
    private = _compile(tmp_path, "private", *flags)
    assert _buildcheck.check(shared) == []
    problems = _buildcheck.check(private)
    assert any("does not import libstdc++.so.6" in p for p in problems), problems
    assert any("symbols of the C++ runtime itself" in p for p in problems), problems
    # std::locale, whose facet ids a second copy numbers on its own
    locale = [s for s in _buildcheck.inspect(private).runtime_symbols if "St6locale" in s]
    assert locale, "std::locale's members not found in the private runtime"


def test_check_ignores_what_is_not_elf(tmp_path):
    f = tmp_path / "not_elf.so"
    f.write_bytes(b"MZ\x90\x00" + bytes(60))
    assert _buildcheck.inspect(str(f)) is None
    assert _buildcheck.check(str(f)) == []


SETUP = """
import importlib.util, sys
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

spec = importlib.util.spec_from_file_location("bc", {buildcheck!r})
bc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bc)
guard = sys.argv.pop(1) == "guarded"
ext = Extension("probe", ["probe_module.cpp"], language="c++", extra_link_args={link!r})
setup(
    name="probe",
    ext_modules=[ext],
    cmdclass={{"build_ext": bc.guarded(build_ext) if guard else build_ext}},
)
"""

MODULE = (
    PROBE
    + r"""
#include <Python.h>
static PyModuleDef def = {PyModuleDef_HEAD_INIT, "probe", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_probe(void) { return PyModule_Create(&def); }
"""
)


def _setup_build(tmp_path, mode, link=(), ldflags="-static-libstdc++"):
    (tmp_path / "probe_module.cpp").write_text(MODULE)
    (tmp_path / "setup.py").write_text(
        SETUP.format(buildcheck=_buildcheck.__file__, link=list(link))
    )
    env = dict(os.environ, LDFLAGS=ldflags)
    out = subprocess.run(
        [sys.executable, "setup.py", mode, "-q", "build_ext", "--inplace"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    built = [p for p in os.listdir(tmp_path) if p.startswith("probe.") and p.endswith(".so")]
    return out, [str(tmp_path / p) for p in built]


@needs_cxx
def test_build_strips_static_libstdcxx_from_ldflags(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "guarded").mkdir()
    # without the guard, LDFLAGS really does link a private runtime (so the test can fail) ...
    out, built = _setup_build(tmp_path / "plain", "plain")
    assert out.returncode == 0, out.stderr
    assert _buildcheck.check(built[0]), "LDFLAGS=-static-libstdc++ did not reach the linker"
    # ... and with it, the same environment gives an extension that shares libstdc++
    out, built = _setup_build(tmp_path / "guarded", "guarded")
    assert out.returncode == 0, out.stderr
    assert "removed linker_so" in out.stdout + out.stderr, out.stdout + out.stderr
    assert _buildcheck.check(built[0]) == []


@needs_cxx
def test_build_refuses_an_extension_that_still_carries_the_runtime(tmp_path):
    link = ["-Wl,-Bstatic", "-lstdc++", "-Wl,-Bdynamic"]
    out, built = _setup_build(tmp_path, "guarded", link=link, ldflags="")
    assert out.returncode != 0
    err = out.stdout + out.stderr
    assert "carries its own copy of the C++ runtime" in err, err
    assert "-static-libstdc++" in err and "LDSHARED" in err, err
    assert built == [], "the refused extension must not be left behind"


@needs_cxx
def test_import_refuses_a_build_with_a_private_runtime(tmp_path):
    private = _compile(tmp_path, "private", "-static-libstdc++")
    code = textwrap.dedent(
        f"""
        import importlib.abc, importlib.machinery, sys
        class F(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "pycomm._C":
                    loader = importlib.machinery.ExtensionFileLoader(name, {private!r})
                    return importlib.machinery.ModuleSpec(name, loader, origin={private!r})
        sys.meta_path.insert(0, F())
        try:
            import pycomm
        except ImportError as e:
            print("IMPORTERROR", e)
        else:
            print("IMPORTED")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "IMPORTERROR" in out.stdout, out.stdout + out.stderr
    assert "carries its own copy of the C++ runtime" in out.stdout, out.stdout
    assert "pip install --no-build-isolation" in out.stdout, out.stdout


def test_error_message_with_an_integer_does_not_crash():
    # In a child: with a private runtime this line segfaulted (the integer 5 in the message).
    code = (
        "import torch, pycomm\n"
        "try:\n"
        "    torch.ops.pycomm.unpack_(torch.ones(5), [torch.ones(2), torch.ones(2)], 1.0)\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"exit status {out.returncode}: {out.stderr[-2000:]}"
    assert "RAISED" in out.stdout and "5" in out.stdout, out.stdout
