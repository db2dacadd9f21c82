"""The `sync` suite (issue 32): live weight sync of an RL-like run to a subscriber in another process.

**The run.** A stack of linear layers (``--quick``: 2.4M parameters, 20 steps; else 8.4M, 100 steps) trained with
AdamW on fp32 master weights at a small learning rate (3e-7), as RL fine-tuning does; after each optimizer step the
bf16 copy of the weights (what inference serves) is published with ``luopan.sync.Publisher(dir, key, keep=10)`` (one
delta file a publish, whose prefixes are the deltas from each of the last 10 versions) and a subscriber in a second
process (``luopan.sync.Subscriber(dir, trusted_keys)``) applies it in place to its live bf16 model. The peer in the
same run: ``safetensors.torch.save_file`` of the bf16 state each step in the trainer, and
``model.load_state_dict(safetensors.torch.load_file(...))`` of that file in the subscriber process — from the page
cache, as the trainer left it (the id's figure), and again after the file's pages were dropped
(``posix_fadvise(DONTNEED)``: what a worker on another host reading a shared filesystem pays; reported beside it,
``load_cold_s``).

Per step it records the bytes the subscriber fetched, the bf16 model's size, the elements whose bits changed (the
trainer compares bf16 copies), publish and save seconds (trainer), apply and load seconds (subscriber). A second
subscriber in the subscriber process skips 10 steps at a time and catches up in one fetch.

**Ids** (goal in parentheses):
* ``SY1.bytes_over_floor``: bytes fetched per step (summed over the steps after the first) / the floor, changed
  elements x (2 value bytes + 4 index bytes: an int32 flat index) (<= 1.25);
* ``SY2.bytes_over_full``: bytes fetched per step / the bf16 model's bytes (<= 0.03);
* ``SY3.load_state_dict_over_apply``: median load_state_dict-from-safetensors seconds (page cache) / median apply
  seconds (>= 2.0); ``cold_over_apply`` beside it uses the load after the file's pages were dropped;
* ``SY4.catchup_over_union``: bytes of a catch-up after 10 missed steps / the floor of the union of those steps'
  changed elements (<= 1.5), the median over the catch-ups;
* ``SY5.publish_vs_safetensors_save``: median safetensors save seconds / median publish seconds (>= 1.0). The save is
  ``save_file`` alone (not fsynced: the page cache is enough for a reader on the same host); the publish is durable
  (fsync of every file and directory). The fsynced save is reported beside it.

    python benchmarks/run.py --suite sync [--quick] [--json OUT] [--workdir DIR]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from common import fsync_path, loadavg, machine_info

IDS = ("SY1.bytes_over_floor", "SY2.bytes_over_full", "SY3.load_state_dict_over_apply", "SY4.catchup_over_union",
       "SY5.publish_vs_safetensors_save")
GOALS = {IDS[0]: ("<=", 1.25), IDS[1]: ("<=", 0.03), IDS[2]: (">=", 2.0), IDS[3]: ("<=", 1.5), IDS[4]: (">=", 1.0)}
LR = 3e-7
MISS = 10
HERE = os.path.dirname(os.path.abspath(__file__))


def build(width: int, depth: int, seed: int, dtype: Any) -> Any:
    import torch

    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(dtype)


def sizes(quick: bool) -> tuple[int, int, int]:
    """(width, depth, steps)."""
    return (768, 4, 20) if quick else (1024, 8, 100)


# ---------------------------------------------------------------------------------------------- subscriber process

def subscriber_main(root: str, trusted: str, width: int, depth: int) -> None:
    """The subscriber process: lines "update", "peer PATH", "catchup" on stdin; one JSON line answers each."""
    import torch
    from safetensors.torch import load_file

    import luopan.sync

    live, late = build(width, depth, 1, torch.bfloat16), build(width, depth, 2, torch.bfloat16)
    peer = build(width, depth, 3, torch.bfloat16)
    sub = luopan.sync.Subscriber(root, trusted_keys=trusted)
    lag = luopan.sync.Subscriber(root, trusted_keys=trusted)
    for line in sys.stdin:
        cmd, *arg = line.split()
        t0 = time.perf_counter()
        if cmd == "update":
            v = sub.update(live)
            out = {"version": v, "s": time.perf_counter() - t0, "bytes": sub.last_bytes}
        elif cmd == "catchup":
            v = lag.update(late)
            out = {"version": v, "s": time.perf_counter() - t0, "bytes": lag.last_bytes}
        elif cmd == "peer":
            peer.load_state_dict(load_file(arg[0]))
            out = {"s": time.perf_counter() - t0}
        else:  # "cold PATH": the same load after the file's pages were dropped from the page cache
            fd = os.open(arg[0], os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            t0 = time.perf_counter()
            peer.load_state_dict(load_file(arg[0]))
            out = {"s": time.perf_counter() - t0}
        print(json.dumps(out), flush=True)


class Remote:
    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(HERE), "src"), HERE,
                                                              os.environ.get("PYTHONPATH", "")])}
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "sync.py"), *args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, line: str) -> dict[str, Any]:
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        out = self.p.stdout.readline()
        if not out:
            raise RuntimeError(f"the subscriber process died (exit {self.p.wait()}) on {line!r}")
        return json.loads(out)

    def close(self) -> None:
        if self.p.stdin:
            self.p.stdin.close()
        self.p.wait(timeout=60)


# ---------------------------------------------------------------------------------------------------- trainer

def run(quick: bool, workdir: str | None, log: Any) -> list[dict[str, Any]]:
    import torch
    from safetensors.torch import save_file

    import luopan.sync
    from luopan.signing import generate_key

    width, depth, steps = sizes(quick)
    work = tempfile.mkdtemp(prefix="luopan-sync-", dir=workdir)
    try:
        key, pub_key = generate_key(os.path.join(work, "keys"))
        trusted = os.path.join(work, "trusted")
        os.makedirs(trusted)
        shutil.copy(pub_key, trusted)
        root, st_path = os.path.join(work, "sync"), os.path.join(work, "peer.safetensors")
        torch.manual_seed(0)
        master = build(width, depth, 0, torch.float32)
        opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=0.0)
        x = torch.randn(64, width)
        target = torch.randn(64, width)
        served = {k: v.to(torch.bfloat16) for k, v in master.state_dict().items()}
        full_bytes = sum(v.numel() * 2 for v in served.values())
        numel = sum(v.numel() for v in served.values())
        log(f"sync: {numel / 1e6:.1f}M parameters ({full_bytes / 2**20:.0f} MiB bf16), {steps} steps, lr {LR}")
        pub = luopan.sync.Publisher(root, key=key, keep=MISS)
        remote = Remote("--subscriber", root, trusted, str(width), str(depth))
        rows, catchups = [], []
        union = {k: torch.zeros(v.shape, dtype=torch.bool) for k, v in served.items()}
        try:
            for step in range(steps):
                loss = (master(x) - target).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                changed = 0
                with torch.no_grad():
                    for k, v in master.state_dict().items():
                        new = v.to(torch.bfloat16)
                        diff = new.view(torch.int16) != served[k].view(torch.int16)
                        changed += int(diff.sum())
                        union[k] |= diff
                        served[k].copy_(new)
                t0 = time.perf_counter()
                version = pub.publish(step, served)
                publish_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                save_file(served, st_path)
                save_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                fsync_path(st_path)
                fsync_s = save_s + time.perf_counter() - t0
                up = remote.ask("update")
                assert up["version"] == version, up
                peer = remote.ask(f"peer {st_path}")
                cold = remote.ask(f"cold {st_path}")
                rows.append({"step": step, "changed": changed, "bytes": up["bytes"], "publish_s": publish_s,
                             "save_s": save_s, "save_fsync_s": fsync_s, "apply_s": up["s"], "load_s": peer["s"],
                             "load_cold_s": cold["s"]})
                if step == 0 or (step + 1) % MISS == 0:  # the late subscriber: at the start, then every MISS steps
                    union_count = sum(int(u.sum()) for u in union.values())
                    cu = remote.ask("catchup")
                    assert cu["version"] == version, cu
                    if step:
                        catchups.append({"step": step, "bytes": cu["bytes"], "union": union_count, "s": cu["s"]})
                    for u in union.values():
                        u.zero_()
                if step % 10 == 0:
                    log(f"sync: step {step}: {changed / numel:.4%} changed, {up['bytes']} bytes, publish "
                        f"{publish_s:.3f}s (save {save_s:.3f}s), apply {up['s']:.3f}s (load {peer['s']:.3f}s)")
        finally:
            remote.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results(rows, catchups, full_bytes, numel, quick)


def results(rows: list[dict], catchups: list[dict], full_bytes: int, numel: int, quick: bool
            ) -> list[dict[str, Any]]:
    later = rows[1:]  # the first update is a full version
    sent = sum(r["bytes"] for r in later)
    floor = sum(r["changed"] * 6 for r in later)
    med = lambda k, rs=later: statistics.median(r[k] for r in rs)  # noqa: E731
    frac = statistics.median(r["changed"] / numel for r in later)
    common = {"unit": "x", "steps": len(rows), "parameters": numel, "model_bytes": full_bytes,
              "changed_fraction_median": frac, "quick": quick}
    cu = [c["bytes"] / max(1, c["union"] * 6) for c in catchups]
    vals = {
        IDS[0]: (sent / max(1, floor), f"{sent} bytes fetched over {len(later)} steps; floor {floor} "
                                       f"(changed elements x 6 bytes)", {"bytes_sent": sent, "floor_bytes": floor}),
        IDS[1]: (sent / (len(later) * full_bytes), f"median {frac:.3%} of elements changed a step",
                 {"bytes_sent_per_step": sent / len(later), "full_bytes": full_bytes}),
        IDS[2]: (med("load_s") / med("apply_s"), "load_state_dict(load_file()) vs Subscriber.update, medians; "
                 f"from a dropped page cache {med('load_cold_s') / med('apply_s'):.2f}",
                 {"load_s": med("load_s"), "apply_s": med("apply_s"), "load_cold_s": med("load_cold_s"),
                  "cold_over_apply": med("load_cold_s") / med("apply_s")}),
        IDS[3]: (statistics.median(cu) if cu else None, f"{len(cu)} catch-ups after {MISS} missed steps",
                 {"catchups": catchups}),
        IDS[4]: (med("save_s") / med("publish_s"), "safetensors save_file vs Publisher.publish (durable), medians; "
                 f"save+fsync {med('save_fsync_s'):.4f}s",
                 {"save_s": med("save_s"), "publish_s": med("publish_s"), "save_fsync_s": med("save_fsync_s")}),
    }
    out = []
    for rid, (value, notes, raw) in vals.items():
        op, goal = GOALS[rid]
        met = None if value is None else (value <= goal if op == "<=" else value >= goal)
        out.append({"id": rid, "value": value, "ratio": value, "goal": goal, "goal_op": op, "met": met,
                    "notes": notes, **common, **raw})
    out.append({"id": "per_step", "context": True, "rows": rows})
    return out


def run_sync(quick: bool, workdir: str | None, log: Any) -> dict[str, Any]:
    work = workdir or tempfile.gettempdir()
    report = {"suite": "sync", "machine": machine_info(work), "loadavg_start": loadavg()}
    report["results"] = run(quick, workdir, log)
    report["loadavg_end"] = loadavg()
    report["problems"] = []
    return report


def print_report(report: dict[str, Any]) -> None:
    for r in report["results"]:
        if r.get("context"):
            continue
        v = "-" if r["value"] is None else f"{r['value']:.4f}"
        status = {True: "met", False: "MISSED", None: "not judged"}[r["met"]]
        print(f"{r['id']}: {v} (goal {r['goal_op']} {r['goal']}: {status}); {r['notes']}")
    missed = [r["id"] for r in report["results"] if r.get("met") is False]
    print("goals missed: " + (", ".join(missed) if missed else "none"))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--subscriber":
    subscriber_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
