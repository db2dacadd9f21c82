"""A trainer or an inference worker in its own process, for tests/test_sync_process.py, driven by lines on stdin.

    python -m tests.sync_worker trainer DIR KEY      "step N": train and publish      -> "published V DIGEST"
                                                     "replay N": train steps 0..N-1 without publishing -> "ok"
                                                     "stall N": train, publish, stop before the index is written
                                                                -> "stalled" (then waits to be killed)
    python -m tests.sync_worker worker DIR TRUSTED STATE   "update" -> "updated V DIGEST" (V "None": nothing new)

DIGEST is the BLAKE3 of every tensor's bytes in state_dict order: equal digests, bit-equal weights."""

from __future__ import annotations

import sys
import time

import blake3

import luopan.sync
import luopan.sync.targets as targets_mod
from tests.test_sync import make_model, train_step


def digest(model) -> str:
    h = blake3.blake3()
    for v in model.state_dict().values():
        h.update(v.detach().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def trainer(root: str, key: str) -> None:
    model, pub = make_model(0), luopan.sync.Publisher(root, key=key, keep=4)
    for line in sys.stdin:
        cmd, n = line.split()
        if cmd == "replay":
            for s in range(int(n)):
                train_step(model, s)
            print("ok", flush=True)
            continue
        train_step(model, int(n))
        if cmd == "stall":
            def stall(*_a, **_k):
                print("stalled", flush=True)
                time.sleep(600)
            targets_mod._place_index = stall  # the files are written and synced; the index is not placed
        v = pub.publish(int(n), model)
        print("published", v, digest(model), flush=True)


def worker(root: str, trusted: str, state: str) -> None:
    model = make_model(7)
    sub = luopan.sync.Subscriber(root, trusted_keys=trusted, state_file=state)
    for line in sys.stdin:
        if line.strip() == "update":
            v = sub.update(model)
            print("updated", v, digest(model), flush=True)


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    trainer(*args) if role == "trainer" else worker(*args)
