"""Every section citation (``§8.5``, ``§2a``, ``§§5.1-5.2``, ``docs/format.md §10.2``, ``§10.4's``) in the code,
the docs, the README, the benchmarks and the tests names a heading of docs/format.md, and every ``docs/<file>``
cited in the code, the docs and the README exists (issue 28: ``§14`` and ``docs/format-index.md`` were cited and did
not exist). A dangling citation is reported as ``file:line: §N``.

A ``§`` that no pattern below can read is reported too, so a new way of writing a citation fails here instead of
being skipped."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = os.path.join(ROOT, "docs", "format.md")
THIS = os.path.abspath(__file__)

# Where § citations are looked for, and which files are text worth reading.
CITING = ("src", "docs", "README.md", "benchmarks", "tests", "examples")
# Where docs/<file> paths are looked for (tests build throwaway docs/ trees of their own).
PATH_CITING = ("src", "docs", "README.md", "benchmarks", "examples")
SUFFIXES = (".py", ".md", ".json", ".toml", ".txt", ".yml", ".yaml", ".sh", ".cfg")
SKIP_DIRS = {"__pycache__", ".git", ".venv", "node_modules", ".pytest_cache", ".hypothesis"}

# A section number: 8, 8.5, 2a, 10.6.1. A trailing "." (end of a sentence) or "'s" is not part of it.
NUMBER = r"\d+[a-z]?(?:\.\d+)*"
# "§N", or "§§N-M" / "§§N, M" / "§§N and M" / "§§N to M" (a range is checked at both ends).
CITATION = re.compile(rf"(§§)\s?({NUMBER})((?:\s*(?:[-–,]|and|to)\s*{NUMBER})*)|(§)\s?({NUMBER})")
LIST_PART = re.compile(NUMBER)
# Sections of other documents, named right before the §: not format.md's.
EXTERNAL = re.compile(r"(persistence-in-ai-engineering|RFC\s*\d+|PEP\s*\d+)\W{0,8}$")
HEADING = re.compile(rf"^#{{2,6}}\s+({NUMBER})\.?\s")
DOC_PATH = re.compile(r"(?<![\w/.-])docs/[A-Za-z0-9_\-/]*[A-Za-z0-9_\-](?:\.[A-Za-z0-9]+)?")


def spec_headings(text: str) -> list[str]:
    """The section numbers of format.md's headings, in order (fenced code blocks skipped)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            out.append(m.group(1))
    return out


def citations(line: str) -> tuple[list[str], list[int]]:
    """The section numbers ``line`` cites (format.md's only), and the columns of any § no pattern could read."""
    cited, read = [], set()
    for m in CITATION.finditer(line):
        sign = m.group(1) or m.group(4)
        read.update(range(m.start(), m.start() + len(sign)))
        if EXTERNAL.search(line[:m.start()]):
            continue
        if m.group(1):
            cited += [m.group(2)] + LIST_PART.findall(m.group(3))
        else:
            cited.append(m.group(5))
    unread = [i for i, c in enumerate(line) if c == "§" and i not in read]
    return cited, unread


def text_files(roots: tuple[str, ...]):
    for root in roots:
        top = os.path.join(ROOT, root)
        if os.path.isfile(top):
            yield top
            continue
        for d, dirs, files in os.walk(top):
            dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
            for f in sorted(files):
                path = os.path.join(d, f)
                if f.endswith(SUFFIXES) and os.path.abspath(path) != THIS:
                    yield path


def lines_of(path: str):
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            yield n, line


def dangling(roots: tuple[str, ...], headings: set[str]) -> list[str]:
    problems = []
    for path in text_files(roots):
        rel = os.path.relpath(path, ROOT)
        for n, line in lines_of(path):
            if "§" not in line:
                continue
            cited, unread = citations(line)
            problems += [f"{rel}:{n}: §{s} (no such heading in docs/format.md)" for s in cited if s not in headings]
            problems += [f"{rel}:{n}: unreadable citation at column {c + 1}: {line.strip()[:100]!r}" for c in unread]
    return problems


@pytest.fixture(scope="module")
def headings() -> list[str]:
    with open(SPEC, encoding="utf-8") as f:
        return spec_headings(f.read())


@pytest.mark.parametrize(("text", "expected"), [
    ("see docs/format.md §10.2 for", ["10.2"]),
    ("(§8.5)", ["8.5"]),
    ("as §10.4's rule says", ["10.4"]),
    ("kinds (§2a): the", ["2a"]),
    ("the end of §8.", ["8"]),
    ("§§5.1-5.2 and §7", ["5.1", "5.2", "7"]),
    ("§§17.2, 17.4", ["17.2", "17.4"]),
    ("§§5.1–5.3", ["5.1", "5.3"]),
    ("§5.2, §8, §16.1;", ["5.2", "8", "16.1"]),
    ("rules 1–6 of §10 (§10.6)", ["10", "10.6"]),
    ("(``persistence-in-ai-engineering``, §3.1)", []),
    ("RFC 6901 §4", []),
])
def test_citation_forms(text: str, expected: list[str]) -> None:
    assert citations(text) == (expected, [])


def test_an_unreadable_section_sign_is_reported() -> None:
    assert citations("see § above")[1] == [4]


def test_a_dangling_citation_is_reported(tmp_path) -> None:
    (tmp_path / "a.md").write_text("fine §2\nbroken §99.9 here\n", encoding="utf-8")
    problems = dangling((str(tmp_path),), {"2"})
    assert len(problems) == 1 and problems[0].endswith("a.md:2: §99.9 (no such heading in docs/format.md)")


def test_headings_are_unique(headings: list[str]) -> None:
    doubles = sorted({h for h in headings if headings.count(h) > 1})
    assert not doubles, f"docs/format.md numbers these sections twice: {doubles}"


def _order(number: str) -> tuple[tuple[int, str], ...]:
    return tuple((int(p.rstrip("abcdefghijklmnopqrstuvwxyz")), p.lstrip("0123456789")) for p in number.split("."))


def test_headings_are_in_order(headings: list[str]) -> None:
    late = [f"§{b} after §{a}" for a, b in zip(headings, headings[1:]) if _order(b) <= _order(a)]
    assert not late, f"docs/format.md has sections out of order: {late}"


def test_every_cited_section_exists(headings: list[str]) -> None:
    problems = dangling(CITING, set(headings))
    assert not problems, "dangling section citations:\n" + "\n".join(problems)


def test_every_cited_doc_exists() -> None:
    problems = []
    for path in text_files(PATH_CITING):
        rel = os.path.relpath(path, ROOT)
        for n, line in lines_of(path):
            for m in DOC_PATH.finditer(line):
                if not os.path.exists(os.path.join(ROOT, m.group(0))):
                    problems.append(f"{rel}:{n}: {m.group(0)} does not exist")
    assert not problems, "dangling docs/ paths:\n" + "\n".join(problems)
