"""Generator of tests/data/v4_repo/: repositories written by luopan of repository format version 4.

tests/test_format_v4_compat.py opens them with the current code and compares what it reads with what the functions
below build (every value is a pure function of fixed seeds; only ids, nonces and timestamps in the files differ
between two runs of this script).

How the sample was made (commit 35180d9, "verify lists the strays under every kind's root ...", is the last commit
whose luopan writes format version 4; its luopan.format.FORMAT_VERSION is 4)::

    git -C /work/main worktree add /tmp/v4 35180d9
    PYTHONPATH=/tmp/v4/src .venv/bin/python tests/data/make_v4_repo.py tests/data/v4_repo
    git -C /work/main worktree remove /tmp/v4 --force

The script refuses to run with a luopan that writes another format version. Each run's first save writes a run
record (argv, cwd, environment, git state: docs/format.md §8.1), so the script first moves into an empty temporary
directory (no git work tree), empties the environment down to PATH and sets argv to the script's name: the sample
records nothing of the machine that made it. What it writes:

* ``plain/`` (compression none, 16 KiB chunks, 64 KiB packs):
  - run ``train``, steps 0-5: a 256x32 fp32 numpy table changed in a few scattered rows at each step, so that the
    later checkpoints are row deltas (version-2 manifests), a bf16 and an fp32 torch tensor, an int64 numpy vector,
    Python scalars and typed values (docs/format.md §8.3: datetime, path, set, bytes, torch.dtype; version-3
    manifests);
  - run ``other``, steps 10 and 20: torch tensors in lists and tuples;
  - artifact ``dataset``, versions 1 and 2 (a directory of small files);
  - journal ``events``: records 0-5 compacted into a snapshot at seq 6, then records 6-8 in the log.
* ``zstd/`` (compression zstd level 3, 16 KiB chunks): run ``ids``, steps 0-3, compressible int32 tables with
  row deltas.

The functions ``train_state``, ``other_state``, ``ids_state``, ``artifact_files``, ``journal_records`` and
``journal_snapshot`` are what the test imports to build the expected contents.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import shutil
import sys
import tempfile

import numpy as np
import torch

CHUNK = 16 << 10
TRAIN_STEPS = list(range(6))
OTHER_STEPS = [10, 20]
IDS_STEPS = list(range(4))
ROWS, DIM = 256, 32  # 32 KiB fp32 table with 128-byte rows: two 16 KiB chunks


def _rows(seed: int, n: int, nrows: int = ROWS) -> np.ndarray:
    return np.random.default_rng(seed).choice(nrows, n, replace=False)


def train_state(step: int) -> dict:
    """The state saved as checkpoint ``step`` of run ``train`` (built from the seeds by replaying steps 1..step)."""
    rng = np.random.default_rng(1234)
    emb = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(64, generator=g)
    ids = np.arange(500, dtype=np.int64) * 7919 % 1000
    for s in range(1, step + 1):
        emb[_rows(100 + s, 3)] += np.float32(0.5 * s)  # a few scattered rows: a row delta
        b[s] = float(s)
        if s % 2 == 0:
            w[s % 32] = torch.full((64,), s / 8, dtype=torch.bfloat16)
            ids[s * 10 : s * 10 + 5] = -s
    meta = {
        "started": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc),
        "data": pathlib.PurePosixPath("/data/train"),
        "modules": {"q_proj", "v_proj"},
        "salt": bytes([0, 255, step]),
        "dtype": torch.bfloat16,
    }
    return {"model": {"emb": emb, "w": w, "b": b}, "ids": ids, "step": step, "lr": 3e-4 / (step + 1),
            "name": f"train-{step}", "flags": [True, None, step % 2 == 0], "meta": meta}


def other_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"layers": [torch.randn(8, 8, generator=g), torch.arange(step, dtype=torch.int32)],
            "pair": (torch.ones(3, dtype=torch.float16) * step, {"x": step}), "half": torch.zeros(0)}


def ids_state(step: int) -> dict:
    """Compressible int32 tables (a zstd repository stores them compressed)."""
    tok = (np.arange(512 * 16, dtype=np.int32) % 97).reshape(512, 16)
    for s in range(1, step + 1):
        tok[_rows(200 + s, 4, 512)] = s
    return {"tok": tok, "mask": np.tile(np.array([1, 0, 0, 1], dtype=np.uint8), 1024), "step": step}


def artifact_files(version: int) -> dict[str, bytes]:
    rng = np.random.default_rng(77)
    files = {"README.txt": b"sample dataset\n", "train/part-0.bin": rng.bytes(20000),
             "train/part-1.bin": rng.bytes(5000), "empty.txt": b""}
    if version >= 2:
        files["train/part-1.bin"] = files["train/part-1.bin"][:2500] + b"edited" + files["train/part-1.bin"][2500:]
        files["eval/labels.csv"] = b"".join(b"%d,%d\n" % (i, i % 3) for i in range(200))
    return files


def journal_records() -> list:
    """Every record appended to journal ``events`` (0-5 end up in the snapshot, 6-8 stay in the log)."""
    return [{"event": "start", "i": 0}, b"\x00\x01raw", {"event": "loss", "value": 1.5}, {"event": "loss", "value": 1.25},
            b"", {"nested": {"a": [1, 2, 3]}}, {"event": "after", "i": 6}, b"tail", {"event": "end", "i": 8}]


SNAPSHOT_AT = 6


def journal_snapshot() -> dict:
    return {"losses": [1.5, 1.25], "count": SNAPSHOT_AT}


def _write_dir(root: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o644)
    for dirpath, _dirs, _files in os.walk(root):
        os.chmod(dirpath, 0o755)


def main(out: str) -> None:
    import luopan
    from luopan.format import FORMAT_VERSION

    if FORMAT_VERSION != 4:
        sys.exit(f"this luopan writes format version {FORMAT_VERSION}; run with PYTHONPATH=<checkout of 35180d9>/src")
    out = os.path.abspath(out)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    # Run records (§8.1) capture argv, cwd, the environment and the git diff of the cwd: keep them neutral.
    home, scratch = os.getcwd(), tempfile.mkdtemp(prefix="make_v4_repo-")
    os.chdir(scratch)
    os.environ.clear()
    os.environ["PATH"] = "/usr/bin:/bin"
    sys.argv = ["make_v4_repo.py"]
    try:
        _write(out, luopan)
    finally:
        os.chdir(home)
        shutil.rmtree(scratch)


def _write(out: str, luopan) -> None:
    policy = luopan.DeltaPolicy(min_bytes=4096)

    repo = luopan.open(os.path.join(out, "plain"), chunk_size=CHUNK, pack_size=4 * CHUNK, compression="none",
                       delta_policy=policy)
    for step in TRAIN_STEPS:
        repo.save("train", step, train_state(step), metrics={"loss": 1.0 / (step + 1)})
    for step in OTHER_STEPS:
        repo.save("other", step, other_state(step))
    art = repo.artifact("dataset")
    for version in (1, 2):
        src = os.path.abspath(f"artifact-v{version}")  # in the scratch directory
        _write_dir(src, artifact_files(version))
        art.commit(src, metadata={"version": version})
        shutil.rmtree(src)
    journal = repo.journal("events")
    records = journal_records()
    for r in records[:SNAPSHOT_AT]:
        journal.append(r)
    journal.compact(journal_snapshot(), upto=SNAPSHOT_AT)
    for r in records[SNAPSHOT_AT:]:
        journal.append(r)
    journal.close()
    assert repo.verify().ok
    repo.close()

    zrepo = luopan.open(os.path.join(out, "zstd"), chunk_size=CHUNK, compression="zstd", delta_policy=policy)
    for step in IDS_STEPS:
        zrepo.save("ids", step, ids_state(step))
    assert zrepo.verify().ok
    zrepo.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "v4_repo"))
