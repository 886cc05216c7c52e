"""The fenced code blocks of a Markdown page, and the runner that executes its Python blocks
on gloo ranks: shared by tests/repo/test_custom_hooks.py and tests/repo/test_docs.py.

A page's Python blocks run in order in one namespace per rank count (``python ranks=N``: on N
ranks, default 2), in a working directory that is also on ``sys.path``; whatever hooks they
register and modules they import from that directory are forgotten afterwards, so later jobs
on the same pooled ranks see pycomm as it was.
"""

from __future__ import annotations

import os
import re
import sys

_OPEN = re.compile(r"^```(\S*)(.*)$")


def blocks(path: str) -> list[tuple[str, str, str]]:
    """(language, the rest of the fence line, code) of every fenced block of ``path``; a fence
    without a language gives ``""``."""
    found, current = [], None
    with open(path, encoding="utf-8") as f:
        for line in f.read().splitlines():
            if current is None:
                m = _OPEN.match(line)
                if m:
                    current = (m.group(1), m.group(2).strip(), [])
            elif line.startswith("```"):
                lang, rest, lines = current
                found.append((lang, rest, "\n".join(lines) + "\n"))
                current = None
            else:
                current[2].append(line)
    assert current is None, f"{path}: a fenced block is not closed"
    return found


def ranks_of(rest: str, default: int = 2) -> int:
    """N of a fence's ``ranks=N``."""
    m = re.search(r"ranks=(\d+)", rest)
    return int(m.group(1)) if m else default


def rank_blocks(workdir: str, sources: list[tuple[str, str]], files: list[str]) -> int:
    """Run ``sources`` ((label, code)) in one namespace, in ``workdir``; then forget the hooks
    they registered and the modules (``files``) they imported, so later jobs on these ranks
    see pycomm as it was. Returns how many blocks ran."""
    import pycomm
    from pycomm.hooks import hook_names, unregister_hook
    from pycomm.topology import set_nodes

    here, before = os.getcwd(), set(hook_names())
    os.chdir(workdir)
    sys.path.insert(0, workdir)
    namespace = {"__name__": "docs_page"}
    try:
        for label, code in sources:
            # dont_inherit: not this module's ``annotations`` future, which would turn a page's
            # hook annotations into strings that DDP's register_comm_hook refuses
            exec(compile(code, label, "exec", dont_inherit=True), namespace)  # noqa: S102 - the page's code
        return len(sources)
    finally:
        for name in set(hook_names()) - before:
            unregister_hook(name)
        for f in files:
            sys.modules.pop(os.path.splitext(f)[0], None)
        sys.path.remove(workdir)
        os.chdir(here)
        set_nodes(None)
        pycomm.hooks  # noqa: B018 - still importable
