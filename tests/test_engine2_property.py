"""Property tests of the storage engine's deltas (docs/format.md §5.2, §5.4, §5.5) and codecs (§6, §6.1): random
sequences of edits to a state of several tensors — sparse row changes, dense small updates, writes through dtype
views, whole-tensor replacement, reverting rows, no change, and process restarts (a new Repo object on the same
path) — under every compression and delta policy. Every checkpoint must load back byte for byte, right after its
save and at the end from a fresh Repo object, and the repository must verify; pruning the checkpoints that stored a
delta's base (then gc) must leave every remaining checkpoint exact.

Sizes are small so that deltas happen: 16 KiB chunks and ``DeltaPolicy(min_bytes=4096, xor_min_bytes=4096)``.
"""

import collections
import dataclasses
import os
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import luopan
from luopan.retention import KeepLast

CHUNK = 16 << 10
SMALL = luopan.DeltaPolicy(min_bytes=4096, xor_min_bytes=4096)
# name -> (compression given to luopan.open, delta policy); None: the default
CONFIGS = {
    "default": (None, SMALL),  # compression "auto" (the default for a new repository)
    "none": ("none", SMALL),
    "zstd": ("zstd", SMALL),
    "auto": ("auto", SMALL),
    "no-xor": (None, dataclasses.replace(SMALL, xor=False)),
    "disabled": (None, dataclasses.replace(SMALL, enabled=False)),
    "default-policy": (None, None),  # DeltaPolicy(): nothing here is large enough for a delta
}
ROW_TABLES = ["emb", "tab", "w", "wide", "odd"]  # 2-D: row-delta candidates
DENSE = ["emb", "tab", "w", "v", "wide", "odd"]  # floating point: small dense updates
TENSORS = ["emb", "tab", "w", "v", "ids", "wide", "odd"]

FORMS = collections.Counter()  # "delta" / "xor" entries seen by the property tests (they must exercise both)


def initial_state(seed):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": rng.standard_normal((512, 64), dtype=np.float32),  # numpy fp32, 256-byte rows: 8 chunks of 64 rows
        "tab": torch.randn(1024, 16, generator=g),  # torch fp32, 64-byte rows: 4 chunks
        "w": torch.randn(96, 128, generator=g).to(torch.bfloat16),  # torch bf16, 256-byte rows: 2 chunks
        "v": torch.randn(10001, generator=g).to(torch.float16),  # torch fp16 vector: 2 flat chunks, odd length
        "wide": rng.standard_normal((6, 6000), dtype=np.float32),  # rows (24000 B) longer than a chunk: flat chunks
        "odd": torch.randn(1500, 7, generator=g).to(torch.float16),  # 14-byte rows: 1170 rows a chunk
        "ids": torch.arange(3000, dtype=torch.int64) * 7919 % 1000,  # torch int64: 2 chunks
        "opt": {"step": 0, "lr": 1e-3},
        # small entries the edits never touch: with them a manifest has enough entries to be stored in entry groups
        # (docs/format.md §8.5) in repositories of version 6, unchanged ones shared from save to save
        "frozen": {f"f{i:02d}": np.full(8, i, dtype=np.float32) for i in range(30)},
    }


def copy_state(state):
    if isinstance(state, dict):
        return {k: copy_state(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, np.ndarray):
        return state.copy()
    return state


def raw(x):
    if isinstance(x, torch.Tensor):
        return x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def assert_exact(got, expected, path="<root>"):
    """Same tree, types, dtypes and shapes; every tensor equal byte for byte."""
    assert type(got) is type(expected), f"{path}: {type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, dict):
        assert list(got) == list(expected), f"{path}: keys {list(got)} != {list(expected)}"
        for k in expected:
            assert_exact(got[k], expected[k], f"{path}/{k}")
    elif isinstance(expected, (torch.Tensor, np.ndarray)):
        assert got.dtype == expected.dtype and tuple(got.shape) == tuple(expected.shape), path
        assert raw(got) == raw(expected), f"{path}: bytes differ"
    else:
        assert got == expected, path


def zeroed(state):
    """A load_into target of the same layout, every tensor zero (so a byte not written by the load shows)."""
    out = copy_state(state)
    for v in out.values():
        if isinstance(v, (torch.Tensor, np.ndarray)):
            v[...] = 0
    return out


def row_bytes(t):
    return len(raw(t[:1]))


class Session:
    """A state, a repository and what each saved step must load as."""

    def __init__(self, path, config, seed, hints, rebase=None, events=True):
        self.path = path
        self.events = events  # hypothesis events (only inside a hypothesis test)
        self.compression, policy = CONFIGS[config]
        if policy is not None and rebase is not None:
            policy = dataclasses.replace(policy, rebase_fraction=rebase)
        self.policy = policy
        self.config = config
        self.repo = luopan.open(path, chunk_size=CHUNK, compression=self.compression, delta_policy=policy)
        self.state = initial_state(seed)
        self.hints = hints
        self.touched = {}  # table -> rows changed since the last save; None: changed otherwise (no hint possible)
        self.saved = {}  # step -> copy of the state saved
        self.step = 0

    # -- edits --------------------------------------------------------------------------------------------------
    def _rows_changed(self, name, rows):
        if name in ROW_TABLES and self.touched.get(name, ()) is not None:
            self.touched[name] = set(self.touched.get(name, ())) | {int(r) for r in rows}

    def _whole_changed(self, name):
        if name in ROW_TABLES:
            self.touched[name] = None

    def apply(self, op):
        kind, args = op[0], op[1:]
        getattr(self, "op_" + kind)(*args)

    def op_sparse(self, name, rows, mode):
        t = self.state[name]
        n = t.shape[0]
        rows = sorted({r % n for r in rows})
        rng = np.random.default_rng(sum(rows) + len(rows))
        if isinstance(t, np.ndarray):
            if mode == "add":
                t[rows] += np.float32(1)
            else:
                t[rows] = rng.standard_normal((len(rows), t.shape[1]), dtype=np.float32)
        else:
            idx = torch.tensor(rows)
            if mode == "add":
                t[idx] += 1
            else:
                t[idx] = torch.from_numpy(rng.standard_normal((len(rows), t.shape[1]), dtype=np.float32)).to(t.dtype)
        self._rows_changed(name, rows)

    def op_dense(self, name, seed):
        """Every element moves a little (a full fine-tune step)."""
        t = self.state[name]
        if isinstance(t, np.ndarray):
            with np.errstate(invalid="ignore", over="ignore"):  # a dtype-view write may have left NaNs or infs
                t += (np.random.default_rng(seed).standard_normal(t.shape, dtype=np.float32) * 1e-4).astype(t.dtype)
        else:
            noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(seed))
            if t.dtype == torch.float32:
                t.add_(noise * 1e-4)
            else:  # bf16 / fp16: a relative change large enough to move most values by an ulp or more
                t.copy_((t.float() * (1 + noise * 0.01)).to(t.dtype))
        self._whole_changed(name)

    def op_view(self, name, start, length, seed):
        """Write random bytes through a dtype view (int16 for torch, uint8 for numpy) into part of a tensor."""
        t = self.state[name]
        if isinstance(t, np.ndarray):
            flat, width = t.view(np.uint8).reshape(-1), 1
        else:
            flat, width = t.view(torch.int16).view(-1), 2
        if flat.shape[0] == 0:
            return
        a = start % flat.shape[0]
        b = min(flat.shape[0], a + length)
        vals = np.random.default_rng(seed).integers(0, 1 << 16, b - a).astype(np.uint16)
        if isinstance(t, np.ndarray):
            flat[a:b] = vals.astype(np.uint8)
        else:
            flat[a:b] = torch.from_numpy(vals.view(np.int16))
        if name in ROW_TABLES:
            rb = row_bytes(t)
            self._rows_changed(name, range(a * width // rb, ((b * width) - 1) // rb + 1))

    def op_replace(self, name, seed, reshape):
        """New random values in a new object (with a different number of rows or elements when ``reshape``)."""
        t = self.state[name]
        shape = list(t.shape)
        if reshape:
            d = max(1, shape[0] // 8)
            shape[0] = max(2, shape[0] + (d if seed % 2 else -d))
        g = torch.Generator().manual_seed(seed)
        if isinstance(t, np.ndarray):
            new = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
        elif t.dtype == torch.int64:
            new = torch.randint(-(1 << 40), 1 << 40, shape, generator=g, dtype=torch.int64)
        else:
            new = torch.randn(shape, generator=g).to(t.dtype)
        self.state[name] = new
        self._whole_changed(name)

    def op_noop(self):
        pass

    def op_revert(self, name, back, rows):
        """Put rows back to what an earlier checkpoint saved."""
        if not self.saved:
            return
        steps = sorted(self.saved)
        old = self.saved[steps[-min(back, len(steps))]][name]
        t = self.state[name]
        if tuple(old.shape) != tuple(t.shape):
            return
        rows = sorted({r % t.shape[0] for r in rows})
        if isinstance(t, np.ndarray):
            t[rows] = old[rows]
        else:
            t[torch.tensor(rows)] = old[torch.tensor(rows)]
        self._rows_changed(name, rows)

    def op_restart(self, policy="same"):
        """A new process: the delta state of the old Repo object is gone. It may save with another delta policy
        (the policy is not stored: each process brings its own)."""
        self.repo.close()
        if policy != "same":
            self.policy = CONFIGS[policy][1]
        self.repo = luopan.open(self.path, delta_policy=self.policy)

    # -- saving and checking --------------------------------------------------------------------------------------
    def save(self):
        step = self.step
        self.step += 1
        self.state["opt"]["step"] = step
        hint = None
        if self.hints:
            hint = {k: np.array(sorted(v), dtype=np.int64) for k, v in self.touched.items() if v}
        self.repo.save("run", step, self.state, touched_rows=hint or None)
        self.touched = {}
        expected = copy_state(self.state)
        self.saved[step] = expected
        if step % 2:
            target = zeroed(expected)
            self.repo.load_into("run", target, step)
            assert_exact(target, expected, f"load_into step {step}")
        else:
            assert_exact(self.repo.load("run", step), expected, f"step {step}")
        m = self.repo.manifest("run", step)
        for name in TENSORS:
            e = m.entry(name)
            for form in ("delta", "xor"):
                if form in e:
                    FORMS[form] += 1
                    if "segments" in e[form]:  # a patch kept in segments (format 7, §5.2)
                        FORMS["segments"] += 1
                    if self.events:
                        event(f"{self.config}: {form} entry")
            assert not ("delta" in e and "xor" in e)
        if "groups" in m.doc:
            FORMS["groups"] += 1
        return m

    def check_all(self):
        """Every checkpoint from a fresh Repo object (a new process), and verify."""
        self.repo.close()
        fresh = luopan.open(self.path)
        try:
            assert fresh.steps("run") == sorted(self.saved)
            for step, expected in self.saved.items():
                assert_exact(fresh.load("run", step), expected, f"fresh step {step}")
            assert fresh.verify().ok
        finally:
            fresh.close()


rows_st = st.lists(st.integers(0, 1 << 20), min_size=1, max_size=5)
sparse_op = st.tuples(st.just("sparse"), st.sampled_from(ROW_TABLES), rows_st, st.sampled_from(["add", "set"]))
dense_op = st.tuples(st.just("dense"), st.sampled_from(DENSE), st.integers(0, 1 << 16))
OP = st.one_of(
    sparse_op, sparse_op, dense_op, dense_op,
    st.tuples(st.just("view"), st.sampled_from(TENSORS), st.integers(0, 1 << 20), st.integers(1, 3000),
              st.integers(0, 1 << 16)),
    st.tuples(st.just("replace"), st.sampled_from(TENSORS), st.integers(0, 1 << 16), st.booleans()),
    st.just(("noop",)),
    st.tuples(st.just("revert"), st.sampled_from(ROW_TABLES), st.integers(1, 4), rows_st),
    st.just(("restart",)),
    st.tuples(st.just("restart"), st.sampled_from(["default", "no-xor", "disabled"])),
)
STEPS = st.lists(st.lists(OP, min_size=1, max_size=3), min_size=1, max_size=7)  # edits before each save

# Known sequences, always run: both delta forms, across a restart.
KNOWN = [[("sparse", "emb", [3, 100, 400], "add"), ("dense", "w", 1)],
         [("sparse", "tab", [5, 900], "set"), ("dense", "w", 2), ("dense", "tab", 3)],
         [("restart",), ("sparse", "emb", [7], "add"), ("view", "tab", 17, 40, 4)],
         [("revert", "emb", 3, [3, 100]), ("dense", "v", 5)]]
# LUOPAN_PROPERTY_EXAMPLES=500 for a longer hunt; the defaults keep this file at ~30 s on two cores.
EXAMPLES = os.environ.get("LUOPAN_PROPERTY_EXAMPLES")


def property_settings(examples):
    return settings(max_examples=int(EXAMPLES or examples), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@property_settings(60)
@given(config=st.sampled_from(sorted(CONFIGS)), seed=st.integers(0, 3), hints=st.booleans(),
       rebase=st.sampled_from([0.08, 0.3]), steps=STEPS)
@example(config="default", seed=0, hints=False, rebase=0.3, steps=KNOWN)
@example(config="zstd", seed=1, hints=True, rebase=0.08, steps=KNOWN)
def _random_sequences(config, seed, hints, rebase, steps):
    with tempfile.TemporaryDirectory() as tmp:
        s = Session(tmp + "/r", config, seed, hints, rebase)
        s.save()  # the first checkpoint: every entry in full
        for edits in steps:
            for op in edits:
                s.apply(op)
            s.save()
        s.check_all()


def test_random_edit_sequences_load_exactly():
    FORMS.clear()
    _random_sequences()
    assert FORMS["delta"] and FORMS["xor"], FORMS  # the sequences did exercise both delta forms
    assert FORMS["groups"], FORMS  # and manifests stored in entry groups
    assert FORMS["segments"], FORMS  # and row deltas whose patch is kept in segments


PRUNED = collections.Counter()


@property_settings(40)
@given(config=st.sampled_from(["default", "none", "zstd", "no-xor"]), seed=st.integers(0, 3),
       steps=st.lists(st.lists(st.one_of(sparse_op, dense_op, st.just(("restart",))), min_size=1, max_size=2),
                      min_size=2, max_size=5),
       keep=st.integers(1, 3), repack=st.sampled_from([0.0, 0.5, 0.99]), restart_after=st.booleans(),
       more=st.lists(st.one_of(sparse_op, dense_op), min_size=1, max_size=2))
@example(config="default", seed=0, steps=KNOWN, keep=1, repack=0.99, restart_after=False,
         more=[("sparse", "emb", [9], "add")])
def _prune_the_base(config, seed, steps, keep, repack, restart_after, more):
    with tempfile.TemporaryDirectory() as tmp:
        s = Session(tmp + "/r", config, seed, hints=False)
        s.save()
        for edits in steps:
            for op in edits:
                s.apply(op)
            s.save()
        s.repo.prune("run", KeepLast(keep))
        kept = sorted(s.saved)[-keep:]
        assert s.repo.steps("run") == kept
        bases = {e[f]["base_step"] for step in kept for e in s.repo.manifest("run", step).doc["entries"]
                 for f in ("delta", "xor") if f in e}
        if bases - set(kept):
            PRUNED["base pruned"] += 1
            event("a delta's base checkpoint was pruned")
        s.saved = {k: v for k, v in s.saved.items() if k in kept}
        s.repo.gc(grace=0, repack_below=repack)
        for step in kept:
            assert_exact(s.repo.load("run", step), s.saved[step], f"after gc, step {step}")
        assert s.repo.verify().ok
        if restart_after:
            s.op_restart()
        for op in more:  # later saves still find their bases (or store in full), and load exactly
            s.apply(op)
        s.save()
        s.check_all()


def test_pruning_the_base_of_deltas_keeps_the_rest_exact():
    PRUNED.clear()
    _prune_the_base()
    assert PRUNED["base pruned"], "no example pruned the base of a remaining delta"


def test_a_known_sequence_stores_both_delta_forms_across_a_restart(tmp_path):
    s = Session(tmp_path / "r", "default", 0, hints=False, events=False)
    forms = []
    s.save()
    for edits in KNOWN:
        for op in edits:
            s.apply(op)
        m = s.save()
        forms.append({name: [f for f in ("delta", "xor") if f in m.entry(name)] for name in ("emb", "w", "tab")})
    assert forms[0]["emb"] == ["delta"] and forms[0]["w"] == ["xor"]
    assert forms[1]["w"] == ["xor"]
    assert forms[2]["emb"] == ["delta"]  # the first save after the restart is a row delta already
    s.check_all()


# -- the first save after a restart stores about the changed rows only ------------------------------------------------
BIG_ROWS, BIG_DIM = 8192, 128  # 4 MiB fp32 table, 512-byte rows


def _restart_history(path, compression, restart):
    """Base, then two saves changing 1% of the rows (and every weight of a bf16 matrix a little), then a restart
    (or not), then a save changing 1% of the rows again (step 3). Returns (step 3's CheckpointInfo, its manifest,
    the rows that differ from the base, the open repo, step -> state saved, the live state)."""
    policy = luopan.DeltaPolicy(min_bytes=1 << 20, xor_min_bytes=64 << 10)
    repo = luopan.open(path, chunk_size=1 << 20, compression=compression, delta_policy=policy)
    rng = np.random.default_rng(42)
    emb = rng.standard_normal((BIG_ROWS, BIG_DIM), dtype=np.float32)
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(42)).to(torch.bfloat16)
    state = {"emb": emb, "w": w}
    saved = {0: copy_state(state)}
    repo.save("run", 0, state)
    changed = set()
    for step in (1, 2):
        rows = rng.choice(BIG_ROWS, BIG_ROWS // 100, replace=False)
        emb[rows] += 1
        changed |= set(rows.tolist())
        w.copy_((w.float() * (1 + torch.randn(w.shape, generator=torch.Generator().manual_seed(step)) * 0.01))
                .to(torch.bfloat16))
        repo.save("run", step, state)
        saved[step] = copy_state(state)
    m = repo.manifest("run", 2)
    assert m.entry("emb")["delta"]["base_step"] == 0
    assert ("xor" in m.entry("w")) == (compression != "none")
    if restart:
        repo.close()
        repo = luopan.open(path, delta_policy=policy)
    rows = rng.choice(BIG_ROWS, BIG_ROWS // 100, replace=False)
    emb[rows] += 1
    changed |= set(rows.tolist())
    info = repo.save("run", 3, state)
    saved[3] = copy_state(state)
    return info, repo.manifest("run", 3), changed, repo, saved, state


@pytest.mark.parametrize("compression", ["none", "auto"])
def test_first_save_after_a_restart_stores_only_the_changed_rows(tmp_path, compression):
    info, m, changed, repo, saved, state = _restart_history(tmp_path / "r", compression, restart=True)
    e = m.entry("emb")
    assert e["delta"]["base_step"] == 0
    if compression == "none":  # a format-1 repository: one cumulative patch, exactly the rows off the base
        assert e["delta"]["rows"] == len(changed)
    else:  # format 7 (§5.2): the patch on disk kept in segments (read back and checked), one more for this save
        assert e["delta"]["segments"] == [BIG_ROWS // 100] * 3
    # A row delta stores every row that differs from its base (§5.2: the patch is cumulative, here the 3 x 1% of
    # rows changed since the base), so the rows changed since the base are what a save after a restart may cost.
    patch = len(changed) * (BIG_DIM * 4 + 8)
    assert info.stored_bytes <= 1.5 * patch + 8192, (info.stored_bytes, patch)
    assert info.stored_bytes < (BIG_ROWS * BIG_DIM * 4) // 10  # not the table
    if compression != "none":
        assert "xor" in m.entry("w")  # unchanged since an XOR delta: the same XOR delta, nothing new stored
        interval = (BIG_ROWS // 100) * (BIG_DIM * 4 + 8)  # with segments: this save's rows only
        assert info.stored_bytes <= 1.5 * interval + 8192, (info.stored_bytes, interval)
    # as cheap as the same save without the restart
    control, control_m, _changed, control_repo, *_ = _restart_history(tmp_path / "control", compression,
                                                                      restart=False)
    control_repo.close()
    assert control_m.entry("emb")["delta"] == {**e["delta"], "cycle": control_m.entry("emb")["delta"]["cycle"]}
    assert abs(info.stored_bytes - control.stored_bytes) <= 4096, (info.stored_bytes, control.stored_bytes)
    # later saves of the new process keep working: rows and a dense update of the bf16 matrix
    rng = np.random.default_rng(7)
    for step in (4, 5):
        state["emb"][rng.choice(BIG_ROWS, 40, replace=False)] -= 1
        state["w"].copy_((state["w"].float() * 1.01).to(torch.bfloat16))
        repo.save("run", step, state)
        saved[step] = copy_state(state)
        assert "delta" in repo.manifest("run", step).entry("emb")
    repo.close()
    fresh = luopan.open(tmp_path / "r")
    for step, expected in saved.items():
        assert_exact(fresh.load("run", step), expected, f"step {step}")
    assert fresh.verify().ok
