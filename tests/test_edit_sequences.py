"""Hypothesis stateful test: random sequences of in-place edits between saves; every checkpoint loads exactly the
state that was saved (the XXH3 change-detection tier and dedup must never return stale bytes)."""

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import luopan

NAMES = ["emb", "w", "b"]
SHAPES = {"emb": (256, 32), "w": (16, 16), "b": (2000,)}


class EditSequences(RuleBasedStateMachine):
    @initialize(use_async=st.booleans(), trust=st.booleans())
    def setup(self, use_async, trust):
        self.trust = trust  # tier 1 (version counters): then only edits that move the counter are allowed
        self.repo = luopan.open("memory://", chunk_size=4096, pack_size=16384)
        g = torch.Generator().manual_seed(0)
        self.state = {n: torch.randn(*SHAPES[n], generator=g) for n in NAMES}
        self.saved = {}  # step -> deep copy of what was saved
        self.step = 0
        self.use_async = use_async

    @rule(name=st.sampled_from(NAMES), idx=st.integers(0, 10**6), value=st.floats(-1e3, 1e3))
    def edit_element(self, name, idx, value):
        flat = self.state[name].view(torch.float32).view(-1)  # "b" may currently be an int32 view
        flat[idx % flat.numel()] = value

    @rule(row=st.integers(0, 255))
    def edit_row(self, row):
        self.state["emb"][row].add_(1.0)

    @rule(name=st.sampled_from(NAMES))
    def edit_whole(self, name):
        self.state[name].view(torch.uint8).bitwise_xor_(0x55)

    @precondition(lambda self: not self.trust)
    @rule(name=st.sampled_from(NAMES))
    def write_through_data(self, name):
        self.state[name].data.view(torch.uint8)[0] ^= 0x0F  # does not move the version counter

    @precondition(lambda self: not self.trust)
    @rule(name=st.sampled_from(NAMES))
    def write_through_numpy_view(self, name):
        self.state[name].numpy().view("u1").reshape(-1)[-1] ^= 0xF0  # neither does this

    @rule(name=st.sampled_from(NAMES), seed=st.integers(0, 3))
    def replace_with_new_object(self, name, seed):
        g = torch.Generator().manual_seed(seed)  # small seeds: often the very same values as an earlier tensor
        self.state[name] = torch.randn(*SHAPES[name], generator=g)

    @rule()
    def dtype_view(self):
        self.state["b"] = self.state["b"].view(torch.int32) if self.state["b"].dtype == torch.float32 \
            else self.state["b"].view(torch.float32)

    @rule()
    def save(self):
        self.step += 1
        expected = {k: v.clone() for k, v in self.state.items()}
        if self.use_async:
            handle = self.repo.save_async("r", self.step, self.state, trust_versions=self.trust)
            for v in self.state.values():  # mutate right after save_async returns (and back)
                v.view(torch.uint8)[0] ^= 0xFF
            handle.wait()
            for v in self.state.values():
                v.view(torch.uint8)[0] ^= 0xFF
        else:
            self.repo.save("r", self.step, self.state, trust_versions=self.trust)
        self.saved[self.step] = expected

    @invariant()
    def every_checkpoint_loads_what_was_saved(self):
        for step, expected in self.saved.items():
            out = self.repo.load("r", step)
            for k, v in expected.items():
                assert out[k].dtype == v.dtype and torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)), \
                    (step, k)


EditSequences.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestEditSequences = EditSequences.TestCase
