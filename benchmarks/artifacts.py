"""The `artifacts` suite: committing and checking out files and directories (luopan.artifact) against `cp -r`.

A1.insert_bytes_over_inserted: a JSONL file of `--size-mib` MiB (1 GiB; --quick 256 MiB) is committed as an
artifact, then 1 MiB of new JSONL lines is inserted in its middle (at a line boundary) and the file committed again.
value = growth of the repository's packs/ directory on disk during the second commit / the bytes inserted (exactly
1 MiB). Goal <= 2. The version's own `stored_bytes` and the growth of the whole repository are extra fields.

A2.commit_vs_copy: `cp -r SRC DST && sync` of a fresh directory of 64 JSONL files totalling `--size-mib` MiB / the
time of `art.commit(SRC)` into a fresh repository (the commit is durable: luopan fsyncs what it writes). Goal >= 0.8.

A3.checkout_vs_copy: `cp -r SRC DST && sync` of that directory / `art.checkout(DST)` of the version just committed
into a new directory. Goal >= 0.8. Cold-cache figures (page cache dropped before each) are extra fields, as for the
foundation suite's loads (root only; skipped otherwise).

Method (as the foundation suite): one process; each repetition generates new random content (so nothing is
deduplicated against anything), writes it and syncs it (untimed), then alternates peer and luopan (the order flips
every repetition) and reports medians; the first repetition is a warm-up, not counted, that also checks that the
checkout returns the committed bytes. Every luopan commit goes into a fresh repository (`luopan.open` and
`repo.artifact` untimed, `art.commit` timed); outputs are removed and `sync` is called between measurements
(untimed). Both sides read the source from a warm page cache (it was just written).
"""

from __future__ import annotations

import filecmp
import os
import subprocess
import tempfile
from functools import partial
from typing import Any

import numpy as np

from common import fmt as _fmt
from common import dir_bytes, print_footer, print_tables  # noqa: F401  (dist imports it from here)
from common import ratio_result as _ratio_result
from common import (
    MIB,
    can_drop_caches,
    drop_caches,
    loadavg,
    machine_info,
    median,
    ratio,
    remove,
    settle,
    timed,
)

ARTIFACT = "bench/data"
FILES = 64  # A2/A3: files in the directory
INSERT_BYTES = MIB  # A1: bytes of new lines inserted
CHECKOUT_RECORD = ".luopan-checkout.json"  # a checkout's record (docs/format.md §8.2.1): luopan's, not data

# -- realistic JSONL, generated with NumPy ---------------------------------------------------------------------
# Each line is {"id": <n>, "text": "<words>", "score": 0.dddddd}. The text is 1-12 "phrases" drawn (Zipf) from a
# table of 65,536 phrases of 1-4 pseudo-words (syllables; 8,192 words, Zipf frequencies). Lines are assembled
# without a Python loop: every piece of every line (constant, id digits, phrase, score) is a row of a 32-byte table
# with a mask of its valid bytes; a block of lines is one row gather and one mask compaction.

W = 32  # bytes per table row
_CONSTS = [b'{"id": ', b', "text": "', b'", "score": ', b"}\n"]
_ONSETS = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "br", "ch", "cl", "cr", "dr", "fl", "gr", "pl", "pr", "sh", "sk", "sl", "sp", "st", "str", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "i", "o", "ea", "ai", "ou", "io"]
_CODAS = [""] * 6 + ["n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rs"]
WORDS = 8192
PHRASES = 65536
TEXT_PHRASES = (1, 12)  # phrases per line, uniform
MAX_ID_DIGITS = 20


def _zipf_table(n: int, rng: np.random.Generator, size: int = 1 << 16) -> np.ndarray:
    """A lookup table: uniform uint16 -> rank in [0, n) with Zipf (s=1, offset 2.7) frequencies."""
    p = 1.0 / (np.arange(n) + 2.7)
    cdf = np.cumsum(p / p.sum())
    table = np.minimum(np.searchsorted(cdf, (np.arange(size) + 0.5) / size), n - 1)
    return rng.permutation(n)[table].astype(np.int64)  # frequent words are not the first ones in the table


class JsonlGen:
    """Generates JSONL lines with increasing ids; deterministic per seed."""

    def __init__(self, seed: int) -> None:
        rng = self.rng = np.random.default_rng(seed)
        words: list[bytes] = []
        seen: set[bytes] = set()
        while len(words) < WORDS:
            n = int(min(4, 1 + rng.geometric(0.5)))
            w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n)) + rng.choice(_CODAS)
            b = w[:14].encode()
            if b not in seen:
                seen.add(b)
                words.append(b)
        wz = _zipf_table(WORDS, rng)
        rows = np.zeros((4 + 2 * PHRASES, W), np.uint8)
        lens = np.zeros(4 + 2 * PHRASES, np.int64)
        for j, c in enumerate(_CONSTS):
            rows[j, :len(c)] = np.frombuffer(c, np.uint8)
            lens[j] = len(c)
        nwords = rng.integers(1, 5, PHRASES)
        picks = wz[rng.integers(0, 1 << 16, int(nwords.sum()))]
        k = 0
        for i in range(PHRASES):
            ws = [words[x] for x in picks[k:k + nwords[i]]]
            k += nwords[i]
            phrase = b" ".join(ws)
            while len(phrase) + 1 > W:  # fits with its trailing space
                ws.pop()
                phrase = b" ".join(ws)
            for row, text in ((4 + i, phrase + b" "), (4 + PHRASES + i, phrase)):  # with / without the space
                rows[row, :len(text)] = np.frombuffer(text, np.uint8)
                lens[row] = len(text)
        self.base_rows = 4 + 2 * PHRASES
        self.rows = rows
        self.mask = np.arange(W)[None, :] < lens[:, None]
        self.phrase_zipf = _zipf_table(PHRASES, rng)
        self.next_id = 0
        self.filler = rows[4:4 + PHRASES][self.mask[4:4 + PHRASES]].tobytes()  # letters and spaces

    def lines(self, n: int) -> bytes:
        """n whole lines."""
        rng = self.rng
        ids = np.arange(self.next_id, self.next_id + n, dtype=np.int64)
        self.next_id += n
        k = rng.integers(TEXT_PHRASES[0], TEXT_PHRASES[1] + 1, n)
        per = k + 6  # {"id": , id, , "text": ", k phrases, ", "score": , score, }\n
        start = np.zeros(n, np.int64)
        np.cumsum(per[:-1], out=start[1:])
        end = start + per
        # per-block rows: id digits (right-aligned) and scores, after the fixed table
        digits = np.zeros((n, W), np.uint8)
        x = ids.copy()
        for d in range(MAX_ID_DIGITS):
            digits[:, W - 1 - d] = x % 10 + 48
            x //= 10
        ndig = np.maximum(1, np.floor(np.log10(np.maximum(ids, 1))).astype(np.int64) + 1)
        dmask = np.arange(W)[None, :] >= (W - ndig)[:, None]
        score = rng.integers(0, 1_000_000, n)
        srows = np.zeros((n, W), np.uint8)
        srows[:, 0], srows[:, 1] = ord("0"), ord(".")
        for d in range(6):
            srows[:, 7 - d] = score % 10 + 48
            score //= 10
        smask = np.zeros((n, W), bool)
        smask[:, :8] = True
        rows = np.concatenate([self.rows, digits, srows])
        mask = np.concatenate([self.mask, dmask, smask])
        pid = np.empty(int(per.sum()), np.int64)
        b = self.base_rows
        pid[start] = 0
        pid[start + 1] = b + np.arange(n)
        pid[start + 2] = 1
        nk = int(k.sum())
        first = np.zeros(n, np.int64)
        np.cumsum(k[:-1], out=first[1:])
        pos = np.repeat(start + 3 - first, k) + np.arange(nk)
        phr = 4 + self.phrase_zipf[rng.integers(0, 1 << 16, nk)]
        phr[first + k - 1] += PHRASES  # the last phrase of a line has no trailing space
        pid[pos] = phr
        pid[end - 3] = 2
        pid[end - 2] = b + n + np.arange(n)
        pid[end - 1] = 3
        # np.take of 32-byte rows as 4 x uint64 is several times faster than fancy indexing of uint8 rows
        got = np.take(rows.view(np.uint64), pid, axis=0).view(np.uint8)
        keep = np.take(mask.view(np.uint64), pid, axis=0).view(bool)
        return got[keep].tobytes()

    def exact(self, nbytes: int, block: int = 16 * MIB) -> Any:
        """Yields byte strings of whole lines totalling exactly nbytes (the last line's text padded to fit)."""
        if nbytes < 64:
            raise ValueError("too small for a JSONL line")
        left = nbytes
        carry = b""
        while True:
            if len(carry) < min(left, block):
                carry += self.lines(max(64, min(left, block) // 100))
                continue
            if len(carry) <= left - 256:
                left -= len(carry)
                yield carry
                carry = b""
                continue
            # carry reaches the end: whole lines up to left - 256, then one line padded to the exact size
            cut = carry.rfind(b"\n", 0, max(0, left - 256)) + 1
            if cut:
                left -= cut
                yield carry[:cut]
            head = b'{"id": %d, "text": "' % self.next_id
            tail = b'", "score": 0.%06d}\n' % int(self.rng.integers(0, 1_000_000))
            self.next_id += 1
            room = left - len(head) - len(tail)
            start = int(self.rng.integers(0, len(self.filler) - room))
            text = self.filler[start:start + room].strip(b" ").ljust(room, b"a")
            line = head + text + tail
            assert len(line) == left, (len(line), left)
            yield line
            return


def write_jsonl(path: str, nbytes: int, gen: JsonlGen) -> None:
    with open(path, "wb") as f:
        f.writelines(gen.exact(nbytes))


def make_dir(path: str, nbytes: int, files: int, seed: int) -> None:
    """A directory of `files` JSONL shards totalling exactly nbytes, fresh content per seed."""
    gen = JsonlGen(seed)
    os.makedirs(path)
    each, rest = divmod(nbytes, files)
    for i in range(files):
        write_jsonl(os.path.join(path, f"part-{i:05d}.jsonl"), each + (1 if i < rest else 0), gen)


# -- helpers ---------------------------------------------------------------------------------------------------


def copy_tree(src: str, dst: str) -> None:
    """The peer: `cp -r SRC DST && sync`."""
    subprocess.run(["cp", "-r", src, dst], check=True)
    subprocess.run(["sync"], check=True)


def same_tree(a: str, b: str) -> str | None:
    """None if the trees under a and b hold the same files with the same bytes; else what differs."""
    def files(top: str) -> set[str]:
        return {os.path.relpath(os.path.join(r, n), top) for r, _d, ns in os.walk(top) for n in ns} - {CHECKOUT_RECORD}

    fa, fb = files(a), files(b)
    if fa != fb:
        return f"file sets differ: {sorted(fa ^ fb)[:5]}"
    for rel in sorted(fa):
        if not filecmp.cmp(os.path.join(a, rel), os.path.join(b, rel), shallow=False):
            return f"{rel} differs"
    return None


def same_file_checkout(dest: str, expected: str) -> str | None:
    """Compares a single-file artifact's checkout (dest itself, or one file under it) with the expected file."""
    if os.path.isfile(dest):
        got = dest
    else:
        found = [os.path.join(r, n) for r, _d, ns in os.walk(dest) for n in ns
                 if os.path.relpath(os.path.join(r, n), dest) != CHECKOUT_RECORD]
        if len(found) != 1:
            return f"checkout of a single-file artifact holds {len(found)} files"
        got = found[0]
    return None if filecmp.cmp(got, expected, shallow=False) else f"{os.path.basename(got)} differs"


def _count(files: Any) -> Any:
    return files if isinstance(files, int) or files is None else len(files)


def _version_info(v: Any) -> dict[str, Any]:
    return {k: (_count(getattr(v, k, None)) if k == "files" else getattr(v, k, None))
            for k in ("version", "files", "logical_bytes", "stored_bytes", "new_bytes", "chunks", "new_chunks")}


# -- the suite -------------------------------------------------------------------------------------------------


def run_artifacts(size_mib: int, reps: int, cold_reps: int, workdir_parent: str | None, log: Any) -> dict[str, Any]:
    import luopan

    if workdir_parent is not None:
        os.makedirs(workdir_parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix="luopan-bench-artifacts-", dir=workdir_parent)
    try:
        return _run(size_mib, reps, cold_reps, work, log, luopan)
    finally:
        remove(work)
        settle()


def _run(size_mib: int, reps: int, cold_reps: int, work: str, log: Any, luopan: Any) -> dict[str, Any]:
    nbytes = size_mib * MIB
    need = 4 * nbytes + 256 * MIB
    st = os.statvfs(work)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise SystemExit(f"not enough free space in {work}: {free / MIB:.0f} MiB free, about {need / MIB:.0f} MiB "
                         "needed (4x the data); pass --workdir on a bigger disk or a smaller --size-mib")
    machine = machine_info(work)
    problems: list[str] = []
    a1 = _a1(nbytes, work, log, luopan, problems)
    a2, a3, samples, cold = _a2_a3(nbytes, reps, cold_reps, work, log, luopan, problems)
    machine["loadavg_end"] = loadavg()
    results = [a1, a2, a3]
    if problems:
        for r in results:
            r["met"] = False
            r["notes"] += " DATA PROBLEM: " + "; ".join(problems)
    return {
        "suite": "artifacts",
        "size_mib": size_mib,
        "machine": machine,
        "state": {
            "bytes": nbytes,
            "format": "JSONL: {\"id\": n, \"text\": \"<1-12 phrases of 1-4 pseudo-words>\", \"score\": 0.dddddd}",
            "generator": f"NumPy: {WORDS} syllable words and {PHRASES} phrases, Zipf frequencies; one seed per "
                         "data set (A1: seed 1; A2/A3: a new seed per repetition), ids increasing; each file's last "
                         "line padded so files are exactly their size",
            "a1_file_bytes": nbytes,
            "a1_insert_bytes": INSERT_BYTES,
            "a2_files": FILES,
            "a2_file_bytes": nbytes // FILES,
            "artifact": ARTIFACT,
        },
        "config": {
            "reps": reps,
            "cold_reps": cold_reps if cold else 0,
            "cold_measured": cold,
            "luopan_repo": "fresh repository per A2 commit (luopan.open and repo.artifact untimed; art.commit timed); "
                           "A3 checks out the version just committed, from the same open repository",
            "peer": "subprocess `cp -r SRC DST` then subprocess `sync`",
            "page_cache": "warm for the main ratios (the source was just written; the repository just committed); "
                          "A3 cold figures are an extra field",
        },
        "results": results,
        "samples_s": samples,
        "problems": problems,
    }


def _a1(nbytes: int, work: str, log: Any, luopan: Any, problems: list[str]) -> dict[str, Any]:
    data = os.path.join(work, "a1")
    os.makedirs(data)
    path = os.path.join(data, "data.jsonl")
    repo_path = os.path.join(work, "a1-repo")
    gen = JsonlGen(1)
    log(f"A1: generating a {nbytes / MIB:.0f} MiB JSONL file")
    t_gen, _ = timed(lambda: write_jsonl(path, nbytes, gen))
    log(f"A1: generated in {t_gen:.1f}s ({nbytes / MIB / t_gen:.0f} MiB/s)")
    settle()
    repo = luopan.open(repo_path)
    art = repo.artifact(ARTIFACT)
    t1, v1 = timed(lambda: art.commit(path))
    log(f"A1: first commit {t1:.3f}s: {_version_info(v1)}")
    # insert 1 MiB of new lines at the first line boundary at or after the middle
    with open(path, "rb") as f:
        f.seek(nbytes // 2)
        tail = f.read(1 << 16)
    at = nbytes // 2 + tail.index(b"\n") + 1
    insert = b"".join(gen.exact(INSERT_BYTES))
    assert len(insert) == INSERT_BYTES and insert.endswith(b"\n")
    new = path + ".new"
    with open(path, "rb") as src, open(new, "wb") as dst:
        left = at
        while left:
            buf = src.read(min(left, 16 * MIB))
            dst.write(buf)
            left -= len(buf)
        dst.write(insert)
        while buf := src.read(16 * MIB):
            dst.write(buf)
    os.replace(new, path)
    settle()
    packs = os.path.join(repo_path, "packs")
    packs_before, repo_before = dir_bytes(packs), dir_bytes(repo_path)
    t2, v2 = timed(lambda: art.commit(path))
    settle()
    packs_growth = dir_bytes(packs) - packs_before
    repo_growth = dir_bytes(repo_path) - repo_before
    stored = getattr(v2, "stored_bytes", None)
    log(f"A1: second commit {t2:.3f}s: {_version_info(v2)}; packs/ grew {packs_growth} bytes, the repository "
        f"{repo_growth} bytes")
    if stored is not None and stored != packs_growth:
        log(f"A1: note: stored_bytes {stored} != packs/ growth {packs_growth}")
    if getattr(v2, "logical_bytes", nbytes + INSERT_BYTES) != nbytes + INSERT_BYTES:
        problems.append(f"A1: the second version's logical_bytes is {v2.logical_bytes}, "
                        f"expected {nbytes + INSERT_BYTES}")
    dest = os.path.join(work, "a1-checkout")
    t_co, _ = timed(lambda: art.checkout(dest))
    bad = same_file_checkout(dest, path)
    if bad:
        problems.append(f"A1: checkout of the second version: {bad}")
        log(f"A1: DATA MISMATCH: {bad}")
    repo.close()
    for p in (dest, data, repo_path):
        remove(p)
    settle()
    value = packs_growth / INSERT_BYTES
    return {
        "id": "A1.insert_bytes_over_inserted",
        "peer": f"{INSERT_BYTES} bytes of new JSONL lines inserted in the middle of a {nbytes} byte file",
        "peer_short": "1 MiB inserted",
        "ratio": round(value, 4),
        "value": round(value, 4),
        "goal": 2,
        "goal_op": "<=",
        "met": value <= 2,
        "unit": "bytes the second commit added to <repo>/packs on disk / bytes inserted",
        "inserted_bytes": INSERT_BYTES,
        "insert_offset": at,
        "file_bytes_before": nbytes,
        "file_bytes_after": nbytes + INSERT_BYTES,
        "packs_growth_bytes": packs_growth,
        "repo_growth_bytes": repo_growth,
        "stored_bytes": stored,
        "stored_bytes_ratio": None if stored is None else round(stored / INSERT_BYTES, 4),
        "first_commit_s": t1,
        "second_commit_s": t2,
        "checkout_s": t_co,
        "first_version": _version_info(v1),
        "second_version": _version_info(v2),
        "generate_s": t_gen,
        "notes": "One measurement (a byte count). The file is committed by path; the edited file replaces it at the "
                 "same path (written beside it, then renamed). packs_growth_bytes: sum of file sizes under "
                 "<repo>/packs after - before the second commit; stored_bytes: the version's own figure; "
                 "repo_growth_bytes also counts manifests and index files. The second version's checkout is "
                 "compared byte for byte with the edited file.",
    }


def _timed_copy(src: str, dst: str) -> float:
    settle()
    dt, _ = timed(lambda: copy_tree(src, dst))
    remove(dst)
    settle()
    return dt


def _timed_commit(art: Any, src: str, nbytes: int, stored: list[int], problems: list[str]) -> float:
    settle()
    dt, v = timed(lambda: art.commit(src))
    stored.append(getattr(v, "stored_bytes", 0) or 0)
    if getattr(v, "logical_bytes", nbytes) != nbytes:
        problems.append(f"A2: the version's logical_bytes is {v.logical_bytes}, expected {nbytes}")
    if _count(getattr(v, "files", FILES)) != FILES:
        problems.append(f"A2: the version holds {_count(v.files)} files, expected {FILES}")
    return dt


def _timed_checkout(art: Any, dst: str, check_against: str | None, problems: list[str], log: Any) -> float:
    settle()
    dt, _ = timed(lambda: art.checkout(dst))
    if check_against is not None:
        bad = same_tree(check_against, dst)
        if bad:
            problems.append(f"A3: checkout differs from the committed directory: {bad}")
            log(f"A3: DATA MISMATCH: {bad}")
    remove(dst)
    settle()
    return dt


def _a2_a3(nbytes: int, reps: int, cold_reps: int, work: str, log: Any, luopan: Any,
           problems: list[str]) -> tuple[dict[str, Any], dict[str, Any], dict[str, list[float]], bool]:
    samples: dict[str, list[float]] = {k: [] for k in (
        "a2_copy", "a2_commit", "a3_copy", "a3_checkout", "cold_a3_copy", "cold_a3_checkout", "generate")}
    cold = cold_reps > 0 and can_drop_caches()
    stored: list[int] = []
    fixture: tuple[str, Any, Any] | None = None
    log(f"A2/A3: {reps} repetitions (+1 warm-up) of copy / commit and copy / checkout, each on a fresh "
        f"{nbytes / MIB:.0f} MiB directory of {FILES} JSONL files")
    for r in range(reps + 1):  # the first repetition warms up (and checks the checkout) and is not counted
        src = os.path.join(work, f"src{r}")
        t_gen, _ = timed(partial(make_dir, src, nbytes, FILES, 100 + r))
        settle()
        repo_path = os.path.join(work, f"repo{r}")
        repo = luopan.open(repo_path)
        art = repo.artifact(ARTIFACT)
        ops = {
            "a2_copy": partial(_timed_copy, src, os.path.join(work, f"copy{r}-a2")),
            "a2_commit": partial(_timed_commit, art, src, nbytes, stored, problems),
            "a3_copy": partial(_timed_copy, src, os.path.join(work, f"copy{r}-a3")),
            "a3_checkout": partial(_timed_checkout, art, os.path.join(work, f"checkout{r}"), src if r == 0 else None,
                                   problems, log),
        }
        order = ["a2_copy", "a2_commit", "a3_copy", "a3_checkout"]
        if r % 2:  # luopan first in odd repetitions
            order = ["a2_commit", "a2_copy", "a3_checkout", "a3_copy"]
        got = {key: ops[key]() for key in order}
        log(f"  rep {r}{' (warm-up)' if not r else ''}: generated {t_gen:.1f}s; A2 copy {got['a2_copy']:.3f}s / "
            f"commit {got['a2_commit']:.3f}s, A3 copy {got['a3_copy']:.3f}s / checkout {got['a3_checkout']:.3f}s")
        if r:
            for k, v in got.items():
                samples[k].append(v)
            samples["generate"].append(t_gen)
        if r == reps and cold:
            fixture = (src, repo_path, repo)
        else:
            repo.close()
            remove(repo_path)
            remove(src)
            settle()

    if fixture is not None:
        src, repo_path, repo = fixture
        art = repo.artifact(ARTIFACT)
        log(f"A3 cold (page cache dropped before each): {cold_reps} repetitions")
        for r in range(cold_reps):
            order = ["copy", "checkout"] if r % 2 == 0 else ["checkout", "copy"]
            for what in order:
                dst = os.path.join(work, f"cold-{what}{r}")
                drop_caches()
                dt, _ = timed(partial(copy_tree, src, dst) if what == "copy" else partial(art.checkout, dst))
                samples[f"cold_a3_{what}"].append(dt)
                remove(dst)
                settle()
            log(f"  rep {r + 1}: copy {samples['cold_a3_copy'][-1]:.3f}s / checkout "
                f"{samples['cold_a3_checkout'][-1]:.3f}s")
        repo.close()
        remove(repo_path)
        remove(src)
        settle()
    elif cold_reps > 0:
        log("A3 cold figures skipped: dropping the page cache is not permitted here")

    cold_a3 = None
    if cold and samples["cold_a3_copy"]:
        p, lp = median(samples["cold_a3_copy"]), median(samples["cold_a3_checkout"])
        cold_a3 = {"peer_s": p, "luopan_s": lp, "ratio": ratio(p, lp), "peer_samples_s": samples["cold_a3_copy"],
                   "luopan_samples_s": samples["cold_a3_checkout"]}
    a2 = _ratio_result(
        "A2.commit_vs_copy", "cp -r + sync", "`cp -r SRC DST && sync` of the directory", "a2_copy", "a2_commit", 0.8,
        samples, nbytes,
        f"A fresh directory of {FILES} JSONL files per repetition (new random content), committed into a fresh "
        "repository: every byte is chunked, hashed, written and fsynced. The peer copies the same directory.",
        luopan_stored_bytes=max(stored) if stored else None)
    a3 = _ratio_result(
        "A3.checkout_vs_copy", "cp -r + sync", "`cp -r SRC DST && sync` of the directory", "a3_copy", "a3_checkout",
        0.8, samples, nbytes,
        "art.checkout(DST) of the version just committed (A2) into a new directory, from a warm page cache; the "
        "peer is the same copy as A2's, measured again next to each checkout. The warm-up repetition checks the "
        "checkout byte for byte. Extra field `cold`: both sides with the page cache dropped before each run "
        "(root only).",
        cold=cold_a3)
    return a2, a3, samples, cold


# -- the table -------------------------------------------------------------------------------------------------


def print_report(report: dict[str, Any]) -> None:
    head = ["id", "peer", "peer", "luopan", "value", "goal", "status"]
    rows = []
    for r in report["results"]:
        status = "met" if r["met"] else "MISSED"
        goal = f"{r['goal_op']} {r['goal']}"
        if r["id"].startswith("A1"):
            rows.append([r["id"], "bytes inserted", f"{r['inserted_bytes'] / MIB:.3f} MiB",
                         f"{r['packs_growth_bytes'] / MIB:.3f} MiB written", _fmt(r["value"], ".3f"), goal, status])
        else:
            rows.append([r["id"], r["peer_short"], _fmt(r["peer_s"]) + " s", _fmt(r["luopan_s"]) + " s",
                         _fmt(r["ratio"], ".2f"), goal, status])
    xhead = ["context (not goals)", "peer", "luopan", "ratio"]
    xrows = []
    for r in report["results"]:
        if r["id"].startswith("A1"):
            xrows.append([f"{r['id']} (the version's stored_bytes)", "-", f"{_fmt(r['stored_bytes'], 'd')} B",
                          _fmt(r["stored_bytes_ratio"], ".3f")])
            xrows.append([f"{r['id']} (whole repository growth)", "-", f"{r['repo_growth_bytes']} B",
                          _fmt(r["repo_growth_bytes"] / r["inserted_bytes"], ".3f")])
            xrows.append([f"{r['id']} (commit 1 / commit 2 / checkout s)", "-",
                          f"{r['first_commit_s']:.3f} / {r['second_commit_s']:.3f} / {r['checkout_s']:.3f}", "-"])
        else:
            xrows.append([f"{r['id']} (GiB/s)", _fmt(r["peer_gib_s"], ".2f"), _fmt(r["luopan_gib_s"], ".2f"), "-"])
            c = r.get("cold")
            if c:
                xrows.append([f"{r['id']} (cold cache)", _fmt(c["peer_s"]) + " s", _fmt(c["luopan_s"]) + " s",
                              _fmt(c["ratio"], ".2f")])
    st = report["state"]
    title = (f"luopan artifacts benchmark: A1 {st['a1_file_bytes'] / MIB:.0f} MiB JSONL file + 1 MiB inserted; "
             f"A2/A3 {st['bytes'] / MIB:.0f} MiB in {st['a2_files']} JSONL files, medians of "
             f"{report['config']['reps']} alternating repetitions, warm page cache")
    print_tables(title, head, rows, xhead, xrows)
    print_footer(report, "A1 = bytes added to <repo>/packs by the second commit / bytes inserted (lower is better); A2, A3 "
                 "ratio = peer seconds / luopan seconds (> 1: luopan faster).")
