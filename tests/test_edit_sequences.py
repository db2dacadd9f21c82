"""Hypothesis stateful test: random sequences of in-place edits between saves; every checkpoint loads exactly the
state that was saved (the XXH3 change-detection tier, version-counter skipping, row deltas with and without
touched_rows hints, and dedup must never return stale bytes)."""

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import luopan

NAMES = ["emb", "w", "b"]
SHAPES = {"emb": (256, 32), "w": (16, 16), "b": (2000,)}


class EditSequences(RuleBasedStateMachine):
    @initialize(use_async=st.booleans(), trust=st.booleans(), rebase=st.sampled_from([0.05, 0.25, 0.9]),
                hints=st.booleans())
    def setup(self, use_async, trust, rebase, hints):
        self.trust = trust  # tier 1 (version counters): then only edits that move the counter are allowed
        # Every 2-D tensor is a row-delta candidate here (docs/format.md §5.2); "emb" has 8 chunks of 32 rows.
        policy = luopan.DeltaPolicy(min_bytes=1024, rebase_fraction=rebase)
        self.repo = luopan.open("memory://", chunk_size=4096, pack_size=16384, delta_policy=policy)
        self.hints = hints
        self.touched = set()  # rows of "emb" changed since the last save, while every change is a row edit
        g = torch.Generator().manual_seed(0)
        self.state = {n: torch.randn(*SHAPES[n], generator=g) for n in NAMES}
        self.saved = {}  # step -> deep copy of what was saved
        self.deltas = 0  # saves that stored "emb" as a row delta
        self.step = 0
        self.use_async = use_async

    @rule(name=st.sampled_from(NAMES), idx=st.integers(0, 10**6), value=st.floats(-1e3, 1e3))
    def edit_element(self, name, idx, value):
        flat = self.state[name].view(torch.float32).view(-1)  # "b" may currently be an int32 view
        flat[idx % flat.numel()] = value
        self._touch(name, (idx % flat.numel()) // SHAPES["emb"][1])

    @rule(row=st.integers(0, 255))
    def edit_row(self, row):
        self.state["emb"][row].add_(1)
        self._touch("emb", row)

    @rule(rows=st.lists(st.integers(0, 255), max_size=40))
    def edit_rows_scattered(self, rows):
        self.state["emb"].view(torch.int32)[rows] += 1  # like a sparse optimizer step (a dtype view of the rows)
        for r in rows:
            self._touch("emb", r)

    @rule(rows=st.lists(st.integers(0, 255), max_size=8))
    def sparse_step_then_save(self, rows):
        """A training step touching a few rows, then a checkpoint: the pattern row deltas are for."""
        self.edit_rows_scattered(rows)
        self.save()

    def _touch(self, name, row):
        if name == "emb" and self.touched is not None:
            self.touched.add(row)

    def _untrack(self, name):
        if name == "emb":
            self.touched = None  # edits the hint cannot describe: save without one

    @rule(name=st.sampled_from(NAMES))
    def edit_whole(self, name):
        self.state[name].view(torch.uint8).bitwise_xor_(0x55)
        self._untrack(name)

    @precondition(lambda self: not self.trust)
    @rule(name=st.sampled_from(NAMES))
    def write_through_data(self, name):
        self.state[name].data.view(torch.uint8)[0] ^= 0x0F  # does not move the version counter
        self._touch(name, 0)

    @precondition(lambda self: not self.trust)
    @rule(name=st.sampled_from(NAMES))
    def write_through_numpy_view(self, name):
        self.state[name].numpy().view("u1").reshape(-1)[-1] ^= 0xF0  # neither does this
        self._touch(name, SHAPES["emb"][0] - 1)

    @rule(name=st.sampled_from(NAMES), seed=st.integers(0, 3))
    def replace_with_new_object(self, name, seed):
        g = torch.Generator().manual_seed(seed)  # small seeds: often the very same values as an earlier tensor
        self.state[name] = torch.randn(*SHAPES[name], generator=g)
        self._untrack(name)

    @rule(name=st.sampled_from(["b", "emb"]))
    def dtype_view(self, name):
        self.state[name] = self.state[name].view(torch.int32) if self.state[name].dtype == torch.float32 \
            else self.state[name].view(torch.float32)
        self._untrack(name)

    @rule()
    def save(self):
        self.step += 1
        expected = {k: v.clone() for k, v in self.state.items()}
        hint = {"emb": sorted(self.touched)} if self.hints and self.touched is not None else None
        self.touched = set()
        if self.use_async:
            handle = self.repo.save_async("r", self.step, self.state, trust_versions=self.trust, touched_rows=hint)
            for v in self.state.values():  # mutate right after save_async returns (and back)
                v.view(torch.uint8)[0] ^= 0xFF
            handle.wait()
            for v in self.state.values():
                v.view(torch.uint8)[0] ^= 0xFF
        else:
            self.repo.save("r", self.step, self.state, trust_versions=self.trust, touched_rows=hint)
        self.saved[self.step] = expected
        self.deltas += "delta" in self.repo.manifest("r", self.step).entry("emb")

    @invariant()
    def every_checkpoint_loads_what_was_saved(self):
        for step, expected in self.saved.items():
            out = self.repo.load("r", step)
            for k, v in expected.items():
                assert out[k].dtype == v.dtype and torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)), \
                    (step, k)


    @invariant()
    def also_exact_through_load_into(self):
        if self.saved:
            step = max(self.saved)
            target = {k: torch.zeros_like(v) for k, v in self.saved[step].items()}
            self.repo.load_into("r", target, step)
            for k, v in self.saved[step].items():
                assert torch.equal(target[k].view(torch.uint8), v.view(torch.uint8)), (step, k)

    def teardown(self):
        DELTA_SAVES.append(self.deltas)
        self.repo.close()


DELTA_SAVES = []
EditSequences.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


class TestEditSequences(EditSequences.TestCase):
    @classmethod
    def teardown_class(cls):
        # The sequences must actually exercise row deltas, or this test proves nothing about them.
        assert sum(DELTA_SAVES) > 0, DELTA_SAVES
