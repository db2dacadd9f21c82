"""A data loader that resumes mid-epoch with the same shuffled order, with or without worker processes.

The position saved is the number of batches the training loop has *received* this epoch, not how far the sampler
or the workers have prefetched: a DataLoader with workers draws indices ahead of the loop, so the sampler's own
position would skip batches on resume. Each epoch's order is a permutation drawn from a generator seeded with
``(seed, epoch)``, so it can be recomputed after a restart without storing it; resuming skips the batches already
consumed. The loader also gives the DataLoader its own generator (seeded the same way), so creating an iterator
never draws from torch's global RNG (which would shift dropout and every other random stream of a resumed run).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from ..errors import StateMismatchError


def _generator(seed: int, epoch: int, salt: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + epoch * 7919 + salt) % (2**63))
    return g


class _EpochSampler(Sampler[int]):
    """Indices of one epoch (shuffled by (seed, epoch) or in order), starting at ``start``."""

    def __init__(self, n: int, shuffle: bool, seed: int, epoch: int, start: int) -> None:
        self.n, self.shuffle, self.seed, self.epoch, self.start = n, shuffle, seed, epoch, start

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.n, generator=_generator(self.seed, self.epoch, 0)) if self.shuffle \
            else torch.arange(self.n)
        return iter(order[self.start :].tolist())

    def __len__(self) -> int:
        return max(0, self.n - self.start)


class ResumableLoader:
    """``DataLoader(dataset, batch_size, shuffle=…)`` that can be checkpointed and resumed mid-epoch.

    Iterate it once per epoch, as a DataLoader. ``state_dict()`` gives ``{"epoch", "batches", …}``: the epoch in
    progress and how many of its batches the loop has received; ``load_state_dict`` makes the next iteration
    continue from there with the same order. Other keyword arguments (``num_workers``, ``collate_fn``,
    ``pin_memory``, ``persistent_workers=False`` …) go to the DataLoader. Random augmentation inside a dataset
    running in workers must draw from the sample index (or a generator in the dataset's own state) to be
    reproducible after a resume, as with any loader.
    """

    def __init__(self, dataset: Any, batch_size: int = 1, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, **loader_kwargs: Any) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for bad in ("sampler", "batch_sampler", "generator"):
            if bad in loader_kwargs:
                raise ValueError(f"ResumableLoader chooses the {bad} itself (to resume exactly); do not pass {bad}=")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.loader_kwargs = loader_kwargs
        self.epoch = 0
        self.batches = 0  # batches of `epoch` the training loop has received

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        n = len(self.dataset)
        sampler = _EpochSampler(n, self.shuffle, self.seed, self.epoch, self.batches * self.batch_size)
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler, drop_last=self.drop_last,
                            generator=_generator(self.seed, self.epoch, 1), **self.loader_kwargs)
        for batch in loader:
            self.batches += 1
            yield batch
        self.epoch += 1
        self.batches = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches": self.batches, "seed": self.seed, "batch_size": self.batch_size,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "dataset_len": len(self.dataset)}

    def check_state_dict(self, state: dict[str, Any]) -> list[str]:
        """What stops ``state`` from resuming this loader at the same position (empty when nothing)."""
        if not isinstance(state, dict) or not {"epoch", "batches"} <= set(state):
            return [f"not a ResumableLoader state: {state!r:.80}"]
        return [f"{k}: checkpoint has {state.get(k)!r}, this loader has {v!r}"
                for k, v in (("seed", self.seed), ("batch_size", self.batch_size), ("shuffle", self.shuffle),
                             ("drop_last", self.drop_last), ("dataset_len", len(self.dataset)))
                if state.get(k) != v]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        problems = self.check_state_dict(state)
        if problems:
            raise StateMismatchError(
                "cannot resume the data loader at the same position: " + "; ".join(problems)
                + ". Build the loader with the checkpoint's settings, or leave it out of the restore (strict=False) "
                "to start the epoch over")
        self.epoch = int(state["epoch"])
        self.batches = int(state["batches"])
