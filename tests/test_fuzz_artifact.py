"""Fuzz the artifact manifest parser with hostile file names (issue 27 item 12), in the style of test_fuzz_parsers.

A valid manifest from a real commit has one entry's path (or several) replaced by a hostile name: a newline, a
backslash, C0/C1 control characters, NUL, '..', an absolute path, empty parts, lone surrogates (what Python makes of
a file name that is not UTF-8), U+2028, very long names; then the document is *sealed again*, so the checksum passes and
the name rule behind it is what is tested. Raw bytes that are not UTF-8 are spliced into a path too. Every outcome must
be a correct parse (every path obeys the name rule) or a luopan error, never another exception; a manifest whose only
fault is a name gives ManifestNameError whose ``doc`` gc can mark from (its chunk rows are valid).

Bounded in CI (``LUOPAN_FUZZ_EXAMPLES``); ``make test-slow`` runs the ``slow`` copies with many more examples.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import luopan
from luopan.artifact.api import ArtifactVersion
from luopan.artifact.manifest import parse_artifact_manifest
from luopan.errors import CorruptManifestError, LuopanError, ManifestNameError
from luopan.format.canonical import digest, seal
from luopan.format.names import MAX_PATH_CHARS, artifact_manifest_key, path_problem
from luopan.repository.kinds import rows_by_pack
from luopan.store import MemoryStore

FUZZ_EXAMPLES = int(os.environ.get("LUOPAN_FUZZ_EXAMPLES", "200"))
SLOW_EXAMPLES = 3000
KEY = artifact_manifest_key("data/set", 1)
SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

HOSTILE = ["a\nb", "\n", "a\\b", "\\", "..", "../x", "a/../b", "./a", "a/.", "/etc/passwd", "/", "", "a//b", "a/",
           "\x00", "a\x00b", "\x1b[31mred", "\x7f", "\x85", "\x9b", "tab\there", "cr\r", "\u2028", "\u2029",
           "\udcff", "\ud800", "a\udcfeb", "x" * (MAX_PATH_CHARS + 1), "y/" * 3000 + "z", "é", "日本/語", "\u202e",
           "a b", "-", "CON", "a:b"]
hostile_names = st.one_of(
    st.sampled_from(HOSTILE),
    st.text(alphabet=st.characters(codec=None, categories=None), max_size=64),
    st.text(alphabet=st.sampled_from(["a", "/", ".", "\\", "\n", "\x00", "\udcff", "\x9f", "\u2028"]), max_size=24),
    st.integers(1, 3 * MAX_PATH_CHARS).map(lambda n: "p" * n),
)


@pytest.fixture(scope="module")
def sample() -> dict[str, Any]:
    """A valid artifact manifest (nested files, an empty file, an empty directory) as a document."""
    repo = luopan.open(MemoryStore())
    repo.artifact("data/set").commit({"top.bin": os.urandom(3000), "d/inner.txt": b"hello", "empty": b""})
    doc = json.loads(repo.store.get(KEY))
    doc.pop("checksum")
    parse_artifact_manifest(seal(doc), KEY, "data/set", 1)  # the fuzz starts from a file the parser accepts
    return doc


def _sealed(doc: dict[str, Any]) -> bytes:
    """``doc`` sealed; where it holds a lone surrogate (no UTF-8 encoding exists, so no checksum can match) the JSON
    escapes it and carries the checksum of the text as it is written."""
    try:
        return seal(doc)
    except UnicodeEncodeError:
        body = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
        return b'{"checksum":"blake3:' + digest(body).encode() + b'",' + body[1:]


def check(data: bytes) -> None:
    """A correct parse or a luopan error; memory bounded by the input's size."""
    tracemalloc.start()
    try:
        doc = parse_artifact_manifest(data, KEY, "data/set", 1)
    except ManifestNameError as exc:
        assert isinstance(exc.doc, dict)  # what gc marks from instead: every chunk row valid
        assert any(path_problem(e["path"]) for e in exc.doc["entries"])
        rows_by_pack(exc.doc)
        assert "\n" not in str(exc).split(": entry ", 1)[-1].split(" is ", 1)[0]  # the name is shown escaped
        return
    except LuopanError:
        return
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak <= 64 * len(data) + (8 << 20), f"parsing {len(data)} bytes allocated {peak} bytes"
    for e in doc["entries"]:
        assert path_problem(e["path"]) is None, e["path"]
    ArtifactVersion.from_doc(doc, KEY)


def renamed(sample: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """The sample with one or more entry paths replaced by hostile names, sealed again."""

    @st.composite
    def gen(draw: Any) -> bytes:
        doc = json.loads(json.dumps(sample))
        entries = doc["entries"]
        for _ in range(draw(st.integers(1, 3))):
            entries[draw(st.integers(0, len(entries) - 1))]["path"] = draw(hostile_names)
        if draw(st.booleans()):
            entries.sort(key=lambda e: e["path"])
        return _sealed(doc)

    return gen()


def spliced(sample: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """Raw bytes (not UTF-8, control bytes, JSON escapes of them) spliced into the path of the sealed sample."""
    raw = seal(sample)
    at = raw.index(b'"top.bin"') + 4
    junk = st.one_of(st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\x00", b"\n", b"\\u0000", b"\\ud800",
                                      b"\\udcff", b"\\n", b"\\\\", b"/../", b"\x1b"]), st.binary(max_size=8))
    return junk.map(lambda j: raw[:at] + j + raw[at:])


def _fuzz(strategy: st.SearchStrategy[bytes], examples: int) -> None:
    @settings(max_examples=examples, deadline=None, suppress_health_check=SUPPRESS, derandomize=examples <= 200)
    @given(data=strategy)
    def run(data: bytes) -> None:
        check(data)

    run()


@pytest.mark.parametrize("how", ["renamed", "spliced"])
def test_fuzz_artifact_manifest_names(sample, how):
    _fuzz(renamed(sample) if how == "renamed" else spliced(sample), FUZZ_EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["renamed", "spliced"])
def test_fuzz_artifact_manifest_names_long(sample, how):
    _fuzz(renamed(sample) if how == "renamed" else spliced(sample), SLOW_EXAMPLES)


@pytest.mark.parametrize("name", HOSTILE)
def test_every_hostile_name_gives_a_typed_error(sample, name):
    """Each listed name, as the path of the top-level file: refused by the rule (a typed error, never another one),
    and a name the rule accepts parses."""
    doc = json.loads(json.dumps(sample))
    top = next(e for e in doc["entries"] if e["path"] == "top.bin")
    top["path"] = name
    data = _sealed(doc)
    if path_problem(name) is None:  # a good name: parses, or fails on something else (its directory is no entry)
        try:
            parse_artifact_manifest(data, KEY, "data/set", 1)
        except ManifestNameError:
            raise
        except CorruptManifestError as exc:
            assert "appears twice" in str(exc) or "no entry for its directory" in str(exc)
        return
    with pytest.raises(CorruptManifestError):
        parse_artifact_manifest(data, KEY, "data/set", 1)
    check(data)


def test_a_name_only_fault_gives_the_document_gc_marks_from(sample):
    doc = json.loads(json.dumps(sample))
    next(e for e in doc["entries"] if e["path"] == "top.bin")["path"] = "top\n.bin"
    with pytest.raises(ManifestNameError) as caught:
        parse_artifact_manifest(seal(doc), KEY, "data/set", 1)
    assert rows_by_pack(caught.value.doc) == rows_by_pack(sample)
    assert "'top\\n.bin'" in str(caught.value)  # escaped: the message stays one line
