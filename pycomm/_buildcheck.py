"""Checks a built ``pycomm._C`` for a private copy of the C++ runtime, which crashes at run time.

torch and every library it loads share the system's ``libstdc++.so.6``. An extension linked with a
static libstdc++ (``-static-libstdc++`` in the interpreter's ``LDSHARED``/``LDFLAGS``, or a
``libstdc++.a`` picked up by the linker) carries a second copy of the stream and locale machinery:
its ``std::locale::id`` counters and facet tables are not the ones the shared copy initialised,
and the first integer formatted into an error message (``TORCH_CHECK(..., n)``) dereferences a
facet that does not exist. Whether that crashes depends on the toolchain (libstdc++ 13 moved
stream initialisation into the library), so a build can pass every test on one machine and
segfault on another. The check is on the binary instead: the extension must import
``libstdc++.so.6`` and must define no symbol of the C++ runtime itself.

Standard library only (``setup.py`` loads this file before the extension exists); ELF files only:
on other formats the check reports nothing.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

# Strong (non-weak) definitions with these mangled prefixes come only from the C++ runtime's own
# objects (libstdc++.a / libsupc++.a): template code a compiler instantiates from the headers is
# emitted as weak symbols, so a strong one means the runtime was linked in.
RUNTIME_PREFIXES = (
    "_ZNSt",  # std::...
    "_ZNKSt",  # std::... const members
    "_ZNSo",  # std::ostream
    "_ZNKSo",
    "_ZNSi",  # std::istream
    "_ZNSd",  # std::iostream
    "_ZSt",  # std:: free functions and objects (std::cout, std::__throw_*)
    "_ZTVSt",  # vtables of std:: classes
    "_ZTISt",  # typeinfo of std:: classes
    "__cxa_",  # the C++ ABI runtime (libsupc++)
    "__gxx_personality",
    "_ZTVN10__cxxabiv1",
)
SHARED_RUNTIME = "libstdc++.so.6"

_SHT_SYMTAB, _SHT_DYNAMIC, _SHT_DYNSYM = 2, 6, 11
_STB_LOCAL, _STB_GLOBAL = 0, 1
_STT_OBJECT, _STT_FUNC = 1, 2
_DT_NEEDED = 1


class Report(NamedTuple):
    """What a shared object needs and which C++ runtime symbols it defines itself."""

    path: str
    needed: tuple  # DT_NEEDED entries, in order
    runtime_symbols: tuple  # mangled names of strong runtime definitions, sorted

    @property
    def problems(self) -> list:
        out = []
        if SHARED_RUNTIME not in self.needed:
            out.append(
                f"it does not import {SHARED_RUNTIME} (needs: {', '.join(self.needed) or 'none'})"
            )
        if self.runtime_symbols:
            shown = ", ".join(self.runtime_symbols[:5])
            more = len(self.runtime_symbols) - 5
            out.append(
                f"it defines {len(self.runtime_symbols)} symbols of the C++ runtime itself "
                f"({shown}{f', and {more} more' if more > 0 else ''})"
            )
        return out


def _cstr(blob: bytes, off: int) -> str:
    end = blob.find(b"\0", off)
    return blob[off:end].decode("ascii", "replace")


def inspect(path: str) -> Report | None:
    """Reads the ELF file at ``path``; None when it is not a 64-bit little-endian ELF file."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    needed, runtime = [], set()
    for _name, kind, _flags, _addr, off, size, link, _info, _align, entsize in sections:
        if kind not in (_SHT_DYNAMIC, _SHT_SYMTAB, _SHT_DYNSYM):
            continue
        strtab = sections[link]
        strings = data[strtab[4] : strtab[4] + strtab[5]]
        if kind == _SHT_DYNAMIC:
            for i in range(0, size, entsize or 16):
                tag, val = struct.unpack_from("<qQ", data, off + i)
                if tag == _DT_NEEDED:
                    needed.append(_cstr(strings, val))
        elif kind in (_SHT_SYMTAB, _SHT_DYNSYM):
            for i in range(0, size, entsize or 24):
                st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", data, off + i)
                bind, typ = st_info >> 4, st_info & 0xF
                if st_shndx == 0 or bind not in (_STB_LOCAL, _STB_GLOBAL):
                    continue  # undefined, or weak/unique: instantiated from the headers
                if typ not in (_STT_OBJECT, _STT_FUNC):
                    continue
                name = _cstr(strings, st_name)
                # "name.isra.0", ".constprop", ".cold": local clones the compiler made of
                # header code; _ZStL: internal-linkage objects a header defines per file
                if name.startswith(RUNTIME_PREFIXES) and "." not in name:
                    if not name.startswith("_ZStL"):
                        runtime.add(name)
    return Report(path, tuple(needed), tuple(sorted(runtime)))


def check(path: str) -> list:
    """The problems of the shared object at ``path`` as sentences; empty when it is sound."""
    report = inspect(path)
    return [] if report is None else report.problems


def message(path: str, problems: list) -> str:
    return (
        f"{os.path.basename(path)} carries its own copy of the C++ runtime: "
        + "; ".join(problems)
        + ". Two libstdc++ copies in one process crash on the first formatted error message. "
        "Rebuild without -static-libstdc++ (look at LDFLAGS, CFLAGS and the interpreter's "
        "sysconfig LDSHARED); pycomm's setup.py removes that flag itself, so a build that still "
        "carries the runtime was linked by another route."
    )


STATIC_RUNTIME_FLAGS = ("-static-libstdc++",)


def strip_static_runtime(compiler) -> list:
    """Removes the flags that link a private C++ runtime from every command of a distutils
    compiler (they arrive from the interpreter's sysconfig or from LDFLAGS/CFLAGS); returns the
    commands that carried one, as ``name: flag`` strings."""
    removed = []
    for attr in getattr(compiler, "executables", {}):
        cmd = getattr(compiler, attr, None)
        if not isinstance(cmd, list):
            continue
        kept = [a for a in cmd if a not in STATIC_RUNTIME_FLAGS]
        removed += [f"{attr}: {a}" for a in cmd if a in STATIC_RUNTIME_FLAGS]
        setattr(compiler, attr, kept)
    return removed


def guarded(base):
    """A ``build_ext`` command class over ``base`` that links against the shared C++ runtime and
    refuses a built extension that carries its own (see :func:`check`)."""

    class GuardedBuildExt(base):
        def build_extensions(self):
            for what in strip_static_runtime(self.compiler):
                print(f"pycomm setup: removed {what} (the extension must share torch's libstdc++)")
            super().build_extensions()
            for ext in self.extensions:
                path = self.get_ext_fullpath(ext.name)
                problems = check(path) if os.path.exists(path) else []
                if problems:
                    os.remove(path)
                    raise SystemExit(f"pycomm setup: {message(path, problems)}")

    return GuardedBuildExt
