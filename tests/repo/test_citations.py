"""What the code and the docs cite is in the repository: every ``*.md`` file a source, script,
test or doc names exists; every README section a docstring or comment names is a heading of
README.md; and every section of a page cited as ``docs/<page>.md, "Section"`` (or
``docs/<page>.md#<section>``) is a heading of that page (or a bold list item's lead:
``- **Section.**``)."""

import os
import re

from harness import ROOT

_DIRS = ("pycomm", "scripts", "tests", "csrc", "docs", "benchmarks")
_TOP = ("README.md", "Makefile", "setup.py", "pyproject.toml")
_TEXT = (".py", ".md", ".h", ".cpp", ".cu", ".cuh", ".sh", ".toml")


def _files() -> list[str]:
    paths = [os.path.join(ROOT, f) for f in _TOP]
    for d in _DIRS:
        for root, dirs, files in os.walk(os.path.join(ROOT, d)):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x != "__pycache__"]
            paths += [os.path.join(root, f) for f in files if f.endswith(_TEXT)]
    return [p for p in paths if os.path.isfile(p)]


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def test_cited_markdown_files_exist():
    files = _files()
    names = {os.path.basename(p) for p in files if p.endswith(".md")}
    missing = []
    for path in files:
        for cited in re.findall(r"[\w./-]*\w\.md\b", _read(path)):
            here = os.path.join(os.path.dirname(path), cited)
            if not (os.path.isfile(os.path.join(ROOT, cited)) or os.path.isfile(here)):
                if "/" in cited or cited not in names:
                    missing.append(f"{os.path.relpath(path, ROOT)} cites {cited}")
    assert not missing, "\n".join(missing)


def test_cited_readme_sections_exist():
    headings = set(re.findall(r"^#+ (.+?)\s*$", _read(os.path.join(ROOT, "README.md")), re.M))
    missing = []
    for path in _files():
        if not path.endswith(".py"):
            continue
        text = re.sub(r"\s*\n\s*(#\s*)?", " ", _read(path))  # sections cited across lines
        for section in re.findall(r"README(?:'s|,) \"([^\"]+)\"", text):
            if section not in headings:
                missing.append(f"{os.path.relpath(path, ROOT)} cites README section {section!r}")
    assert not missing, "\n".join(missing)


def _headings(page: str) -> set[str]:
    """A page's headings, and the leads of its bold list items."""
    text = _read(os.path.join(ROOT, page))
    leads = re.findall(r"^\s*- \*\*(.+?)[.:]?\*\*", text, re.M)
    return set(re.findall(r"^#+ (.+?)\s*$", text, re.M)) | set(leads)


def _has_section(page: str, section: str) -> bool:
    """``section`` is a heading of ``page``, or one less its parenthesis (``Training quality``
    for ``Training quality (`python -m pycomm.bench.quality`)``)."""
    return any(h == section or h.startswith(section + " (") for h in _headings(page))


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


# ``docs/<page>.md``, "Section" (backticks optional, the section possibly on the next line)
_CITED_SECTION = re.compile(r"`?((?:[\w.-]+/)*[\w.-]+\.md)`?,\s+\"([^\"]+)\"")
_CITED_ANCHOR = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.md)#([\w-]+)")


def test_cited_page_sections_exist():
    missing, cited = [], 0
    for path in _files():
        text = _read(path)
        if path.endswith(".py"):
            text = re.sub(r"\s*\n\s*(#\s*)?", " ", text)  # sections cited across lines
        for page, section in _CITED_SECTION.findall(text):
            if not os.path.isfile(os.path.join(ROOT, page)):
                continue  # a page named by a relative path: test_cited_markdown_files_exist
            cited += 1
            if not _has_section(page, section):
                missing.append(f"{os.path.relpath(path, ROOT)} cites {page}, {section!r}")
        for page, anchor in _CITED_ANCHOR.findall(text):
            cited += 1
            page_path = os.path.join(ROOT, page)
            if not os.path.isfile(page_path) or anchor not in map(_anchor, _headings(page)):
                missing.append(f"{os.path.relpath(path, ROOT)} cites {page}#{anchor}")
    assert cited, "no page section is cited: the pattern no longer matches the citations"
    assert not missing, "\n".join(missing)
