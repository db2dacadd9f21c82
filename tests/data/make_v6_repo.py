"""Generator of tests/data/v6_repo/: a repository written by luopan of repository format version 6.

tests/test_format_v6_compat.py opens it with the current code and compares what it reads with what
``make_v5_repo.lora_state`` builds: the same run as the version-5 sample (see make_v5_repo.py for the state), written
by a luopan whose ``luopan.format.FORMAT_VERSION`` is 6. Commit c2fe856 ("tests: the v4 and v5 compatibility tests
load their generator scripts through one helper ...") is the last commit whose luopan writes format version 6::

    git -C /work/main worktree add /tmp/v6 c2fe856
    PYTHONPATH=/tmp/v6/src .venv/bin/python tests/data/make_v6_repo.py tests/data/v6_repo
    git -C /work/main worktree remove /tmp/v6 --force

What a version-6 writer stores there and a version-7 reader must still read: manifests whose unchanged entries are
in entry groups (docs/format.md §8.5), row deltas whose patch is one cumulative run of rows (no ``segments``: the
table changes at every step, so steps 2 and 3 repeat the rows of the steps before), XOR deltas and bytegroup chunks.
The script keeps run records neutral with make_v5_repo.run_neutral.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("make_v5_repo", os.path.join(_here, "make_v5_repo.py"))
v5 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(v5)

CHUNK, PACK, STEPS = v5.CHUNK, v5.PACK, v5.STEPS
lora_state, metrics = v5.lora_state, v5.metrics


def main(out: str) -> None:
    import luopan
    from luopan.format import FORMAT_VERSION

    if FORMAT_VERSION != 6:
        sys.exit(f"this luopan writes format version {FORMAT_VERSION}; run with PYTHONPATH=<checkout of c2fe856>/src")
    print(f"luopan from {luopan.__file__} (format version {FORMAT_VERSION})")
    v5.run_neutral(out, "make_v6_repo.py", lambda path: _write(path, luopan))


def _write(out: str, luopan) -> None:
    from luopan.format.manifest import stored_rows

    root, repo, docs, entries = v5.write_run(out, luopan)
    assert any("xor" in e for e in entries), "no XOR delta"
    deltas = [e["delta"] for e in entries if "delta" in e]
    assert deltas and not any("segments" in d for d in deltas), "no row delta"
    assert deltas[-1]["rows"] > deltas[0]["rows"], "the last patch is not cumulative"
    assert any(r[5] == "bytegroup" for e in entries for r in stored_rows(e)), "no bytegroup chunk"
    assert all(d["format_version"] <= 6 for d in docs)
    repo.close()
    with open(os.path.join(root, "luopan.json"), "rb") as f:
        assert json.loads(f.read())["format_version"] == 6
    with luopan.open(root) as again:  # the file documents (parse expands groups): some must name groups
        assert again.verify().ok
    import zstandard
    grouped = 0
    for step in STEPS:
        with open(os.path.join(root, "runs", "lora", "ckpt", f"{step:08d}.json"), "rb") as f:
            grouped += "groups" in json.loads(zstandard.ZstdDecompressor().decompress(f.read()))
    assert grouped, "no manifest with entry groups"


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(_here, "v6_repo"))
