"""The `scale` suite (issue 30): the metadata of a 70B-class checkpoint, and a run of a thousand of them, on one
machine; then many ranks saving to one object store (benchmarks/scale_ranks.py).

**What it reproduces.** A 70B model with AdamW and fp32 master weights is ~1 TB a checkpoint: ~262,000 chunks of
4 MiB. Here a ~1 GiB state is stored with 4 KiB chunks, so each checkpoint has the same number of chunk rows
(262,144 at full size), the same manifest, the same groups, the same index rows, at a thousandth of the bytes.

**State.** ``tensors`` fp32 matrices of 256 x 256 (256 KiB, 64 chunks each): 4,096 at full size (1 GiB), 1,024 with
--quick (256 MiB; 65,536 chunks). A fixed 1% of them (every 100th, from the 8th: 41 at full size) is "trained": each
step adds 1e-3 to every element of those tensors (a LoRA-like or partially unfrozen fine-tune: the same tensors, and
their optimizer state, change every step; ~1% of the chunks, 10.6 MB a save at full size). Saved with
``repo.save("run", step, state, trust_versions=True)`` (what a training loop passes: the untouched tensors'
version counters did not move) into one repository made with ``luopan.open(path, chunk_size=4096)``.

**The run.** 1,000 checkpoints (100 with --quick). At 10, 100 and 1,000 checkpoints (10 and 100 with --quick) it
measures, each once (these take seconds to minutes: one sample, in the JSON with its count):
* ``save``: the median wall time of the 10 saves ending at that count;
* ``load_newest``, ``load_oldest``: ``repo.load`` of the newest / the oldest checkpoint (every chunk verified);
* ``show``: ``repo.manifest(run, newest)`` (what ``luopan show`` reads: one manifest, its groups expanded);
* ``ls``: ``repo.checkpoints(run)`` (what ``luopan ls`` lists: every checkpoint's manifest);
* ``verify``: ``repo.verify(run, structure=True)`` (``luopan verify --structure``: every manifest as a load parses
  it, each distinct entry group once, every row against its pack; no chunk read);
* ``gc``: ``repo.gc(grace=0)`` (mark, index, sweep; with every checkpoint kept there is nothing to sweep, but the
  index files are consolidated as a periodic gc would), and its mark phase alone;
* ``open``: ``luopan.open(path)`` plus the first ``chunk_index`` read a new process pays before its first save (every
  index file: what a resumed job's first save reads);
* ``manifest bytes``: the manifest file plus the entry-group blobs that save stored (stored bytes), for the first
  checkpoint (all inline) and the saves at that count.
After the last count: ``prune`` to keep the newest 10 (``KeepLast(10)``) and a ``gc(grace=0)`` that frees the rest.

**Ids** (values are ratios; goal in parentheses):
* ``SC1.gc_growth_1000_over_100`` gc time at 1,000 / at 100 (<= 12: at most linear);
* ``SC2.ls_growth_1000_over_100`` ls time at 1,000 / at 100 (<= 12);
* ``SC3.save_growth_1000_over_10`` save time at 1,000 / at 10 (<= 1.2: a save touches one checkpoint);
* ``SC4.load_newest_growth_1000_over_10`` load of the newest at 1,000 / at 10 (<= 1.2);
* ``SC5.manifest_share_unchanged`` manifest bytes of a mostly-unchanged checkpoint (the median of the last 10 saves)
  / the first checkpoint's manifest bytes (<= 0.02).
With --quick the counts are 10 and 100, so each "1000 over 100" is 100 over 10 and "1000 over 10" is 100 over 10
(the JSON says which counts were used). SC6-SC8 come from benchmarks/scale_ranks.py.

    python benchmarks/run.py --suite scale [--quick] [--json OUT] [--workdir DIR]
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from common import loadavg, machine_info, timed

ID_GC = "SC1.gc_growth_1000_over_100"
ID_LS = "SC2.ls_growth_1000_over_100"
ID_SAVE = "SC3.save_growth_1000_over_10"
ID_LOAD = "SC4.load_newest_growth_1000_over_10"
ID_SHARE = "SC5.manifest_share_unchanged"
CHUNK = 4096
SIDE = 256  # each tensor SIDE x SIDE fp32: 256 KiB, 64 chunks
TRAINED_EVERY = 100  # every 100th tensor is trained: 1%
WINDOW = 10  # saves per save-time median


def _state(tensors: int) -> tuple[dict[str, Any], list[str]]:
    import torch

    g = torch.Generator().manual_seed(30)
    state = {f"layers.{i // 16}.w{i % 16}": torch.randn(SIDE, SIDE, generator=g) for i in range(tensors)}
    trained = [k for i, k in enumerate(state) if i % TRAINED_EVERY == 7]
    return state, trained


def _manifest_file(root: str, step: int) -> str:
    return os.path.join(root, "runs", "run", "ckpt", f"{step:08d}.json")


def _manifest_doc(path: str) -> dict[str, Any]:
    """A manifest file as docs/format.md §4 and §8 describe it: a zstd frame of sealed JSON (or plain JSON)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] == b"\x28\xb5\x2f\xfd":
        import zstandard

        data = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 30)
    return json.loads(data)


def manifest_bytes(root: str, step: int, seen_groups: set[str]) -> dict[str, int]:
    """Bytes a checkpoint's metadata added: its manifest file, and the entry groups (§8.5) no earlier checkpoint
    named (their stored length in packs). ``seen_groups`` is updated."""
    path = _manifest_file(root, step)
    doc = _manifest_doc(path)
    new = [g for g in doc.get("groups", []) if g[0] not in seen_groups]
    seen_groups.update(g[0] for g in doc.get("groups", []))
    file_bytes = os.path.getsize(path)
    group_bytes = sum(g[3] for g in new)
    return {"file": file_bytes, "new_groups": len(new), "group_bytes": group_bytes, "total": file_bytes + group_bytes,
            "groups": len(doc.get("groups", [])), "inline_entries": len(doc.get("entries", []))}


def _timed_save(repo: Any, step: int, state: dict[str, Any]) -> float:
    """One save's wall time, the cyclic GC paused during it. Unlike common.timed it does not collect first (a full
    collection of this process's heap, millions of objects by the 1,000th save, would cost more than the save); it
    collects every 50 saves, untimed."""
    if step % 50 == 0:
        gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        repo.save("run", step, state, trust_versions=True)
        return time.perf_counter() - t0
    finally:
        gc.enable()


def _measure(repo: Any, root: str, n: int, saves: list[float], log: Any) -> dict[str, Any]:
    import luopan

    out: dict[str, Any] = {"checkpoints": n, "save_s": statistics.median(saves[-WINDOW:]),
                           "save_spread": [min(saves[-WINDOW:]), max(saves[-WINDOW:])]}
    newest = n - 1
    out["show_s"], _ = timed(lambda: repo.manifest("run", newest))
    out["ls_s"], infos = timed(lambda: repo.checkpoints("run"))
    assert len(infos) == n, (len(infos), n)
    out["verify_structure_s"], rep = timed(lambda: repo.verify("run", structure=True))
    out["verify_rows"] = rep.chunks

    def fresh() -> Any:
        r = luopan.open(root)
        try:
            r.checkpointing.chunk_index()
        finally:
            r.close()
    out["open_s"], _ = timed(fresh)
    log(f"scale: {n} checkpoints: loading the newest and the oldest")
    out["load_newest_s"], _ = timed(lambda: repo.load("run", newest))
    out["load_oldest_s"], _ = timed(lambda: repo.load("run", 0))
    out["gc_s"], report = timed(lambda: repo.gc(grace=0))
    out["gc_phases_s"] = {k: round(v, 4) for k, v in report.seconds.items()}
    out["gc_mark_s"] = report.seconds.get("mark")
    out["index_files_before_gc"] = report.index_files_before
    out["manifests_marked"] = report.manifests
    return out


def run_metadata(quick: bool, workdir: str, log: Any, *, tensors: int | None = None, total: int | None = None,
                 marks: list[int] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """SC1-SC5 and their context (see the module docstring). ``tensors``, ``total`` and ``marks`` override the
    sizes (the suite's own test runs it tiny)."""
    import luopan
    from luopan.retention import KeepLast

    tensors = tensors or (1024 if quick else 4096)
    total = total or (100 if quick else 1000)
    marks = marks or ([10, 100] if quick else [10, 100, 1000])
    root = os.path.join(workdir, "scale-repo")
    state, trained = _state(tensors)
    state_bytes = sum(t.numel() * 4 for t in state.values())
    log(f"scale: {tensors} tensors ({state_bytes / 2**30:.2f} GiB, {state_bytes // CHUNK} chunks of {CHUNK} B), "
        f"{len(trained)} trained; {total} checkpoints")
    os.environ.setdefault("LUOPAN_PROGRESS", "0")
    repo = luopan.open(root, chunk_size=CHUNK)
    saves: list[float] = []
    at: dict[int, dict[str, Any]] = {}
    seen: set[str] = set()
    mbytes: list[dict[str, int]] = []
    t_run = time.perf_counter()
    try:
        for step in range(total):
            if step:
                for k in trained:
                    state[k].add_(1e-3)
            dt = _timed_save(repo, step, state)
            saves.append(dt)
            mbytes.append(manifest_bytes(root, step, seen))
            if step % 100 == 99 or step < 3:
                log(f"scale: saved {step + 1}/{total} (last {dt:.3f}s, manifest {mbytes[-1]['total']} B)")
            if step + 1 in marks:
                log(f"scale: measuring at {step + 1} checkpoints")
                at[step + 1] = _measure(repo, root, step + 1, saves, log)
                at[step + 1]["manifest_bytes"] = mbytes[-1]
                log(f"scale: at {step + 1}: {json.dumps({k: v for k, v in at[step + 1].items() if k.endswith('_s')})}")
        run_s = time.perf_counter() - t_run
        # check what the last save holds before deleting anything
        back = repo.load("run", total - 1)
        for k in trained[:3] + list(state)[:3]:
            assert back[k].equal(state[k]), k
        prune_s, plan = timed(lambda: repo.prune("run", KeepLast(10)))
        gc_after_s, gc_after = timed(lambda: repo.gc(grace=0))
        left = repo.steps("run")
        assert left == list(range(max(0, total - 10), total)), left
        assert repo.load("run", total - 1)[trained[0]].equal(state[trained[0]])
    finally:
        repo.close()
    lo, mid, hi = marks[0], marks[-2] if len(marks) > 2 else marks[0], marks[-1]
    first = mbytes[0]["total"]
    steady = statistics.median(m["total"] for m in mbytes[-WINDOW:])

    def res(rid: str, value: float, goal: float, **extra: Any) -> dict[str, Any]:
        return {"id": rid, "value": round(value, 4), "ratio": round(value, 4), "goal": goal, "goal_op": "<=",
                "met": value <= goal, **extra}

    results = [
        res(ID_GC, at[hi]["gc_s"] / at[mid]["gc_s"], 12, counts=[mid, hi], at_low_s=at[mid]["gc_s"],
            at_high_s=at[hi]["gc_s"], mark_growth=at[hi]["gc_mark_s"] / at[mid]["gc_mark_s"]),
        res(ID_LS, at[hi]["ls_s"] / at[mid]["ls_s"], 12, counts=[mid, hi], at_low_s=at[mid]["ls_s"],
            at_high_s=at[hi]["ls_s"]),
        res(ID_SAVE, at[hi]["save_s"] / at[lo]["save_s"], 1.2, counts=[lo, hi], at_low_s=at[lo]["save_s"],
            at_high_s=at[hi]["save_s"]),
        res(ID_LOAD, at[hi]["load_newest_s"] / at[lo]["load_newest_s"], 1.2, counts=[lo, hi],
            at_low_s=at[lo]["load_newest_s"], at_high_s=at[hi]["load_newest_s"]),
        res(ID_SHARE, steady / first, 0.02, first_manifest_bytes=first, steady_manifest_bytes=steady,
            steady_detail=mbytes[-1]),
    ]
    context = {
        "state": {"tensors": tensors, "bytes": state_bytes, "chunk_size": CHUNK, "chunks": state_bytes // CHUNK,
                  "trained_tensors": len(trained), "changed_fraction": len(trained) / tensors},
        "checkpoints": total, "marks": at, "run_s": run_s,
        "first_save_s": saves[0], "prune_keep_10_s": prune_s, "pruned": len(plan.remove),
        "gc_after_prune_s": gc_after_s, "gc_after_prune": {"deleted_packs": gc_after.deleted_packs,
                                                           "deleted_bytes": gc_after.deleted_bytes,
                                                           "phases_s": gc_after.seconds},
        "growth": {f"{k}_{hi}_over_{lo}": _ratio(at[hi].get(k), at[lo].get(k))
                   for k in ("save_s", "show_s", "load_newest_s", "load_oldest_s", "open_s", "ls_s",
                             "verify_structure_s", "gc_s")},
        "growth_over_mid": {f"{k}_{hi}_over_{mid}": _ratio(at[hi].get(k), at[mid].get(k))
                            for k in ("ls_s", "verify_structure_s", "gc_s", "gc_mark_s", "open_s")},
        "manifest_bytes_first": mbytes[0], "manifest_bytes_steady_median": steady,
        "save_s_by_hundred": [round(statistics.median(saves[i:i + 100]), 4) for i in range(1, total, 100)],
    }
    return results, context


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def run_scale(quick: bool, workdir_parent: str | None, log: Any, ranks: bool = True) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="luopan-bench-scale-", dir=workdir_parent)
    try:
        machine = machine_info(work)
        t0 = time.perf_counter()
        results, context = run_metadata(quick, work, log)
        if ranks:
            try:
                import scale_ranks
            except ImportError:
                scale_ranks = None  # type: ignore[assignment]
            if scale_ranks is not None:
                rows = scale_ranks.run_ranks(quick, work, log)
                results += [r for r in rows if "goal" in r]
                context["ranks"] = [r for r in rows if "goal" not in r]
        context["suite_s"] = time.perf_counter() - t0
        machine["loadavg_end"] = loadavg()
        return {"suite": "scale", "quick": quick, "machine": machine, "results": results, "context": context}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_report(report: dict[str, Any]) -> None:
    from common import fmt, print_footer, print_tables

    c = report["context"]
    st = c["state"]
    head = ["id", "what", "low", "high", "value", "goal", "status"]
    rows = []
    for r in report["results"]:
        if r.get("context"):
            continue
        counts = r.get("counts") or r.get("over_worlds")
        what = f"{counts[1]} vs {counts[0]}" if counts else ""
        low = r.get("at_low_s", r.get("first_manifest_bytes"))
        high = r.get("at_high_s", r.get("steady_manifest_bytes"))
        if "commit_s" in r and counts:
            low, high = r["commit_s"].get(counts[0]), r["commit_s"].get(counts[1])
        rows.append([r["id"], what, fmt(low), fmt(high), fmt(r["value"], ".4f"),
                     f"{r['goal_op']} {r['goal']:g}", "met" if r["met"] else "MISSED"])
    xhead = ["context (seconds at each count)"] + [str(n) for n in c["marks"]]
    keys = ["save_s", "show_s", "load_newest_s", "load_oldest_s", "ls_s", "verify_structure_s", "gc_s", "gc_mark_s",
            "open_s"]
    xrows = [[k] + [fmt(c["marks"][n].get(k)) for n in c["marks"]] for k in keys]
    xrows.append(["manifest bytes (file + new groups)"] + [str(c["marks"][n]["manifest_bytes"]["total"])
                                                            for n in c["marks"]])
    for w in c.get("ranks", []):
        req = w.get("requests_per_save", {})
        xrows.append([f"{w['world']} ranks: rank-0 commit s / save s / PUT,GET,HEAD,LIST per save"]
                     + [f"{fmt(w.get('commit_s'))} / {fmt(w.get('save_s'))} / "
                        f"{','.join(str(req.get(k, '-')) for k in ('PUT', 'GET', 'HEAD', 'LIST'))}"]
                     + [""] * (len(c["marks"]) - 1))
    title = (f"luopan scale suite: {st['tensors']} tensors, {st['bytes'] / 2**30:.2f} GiB in {st['chunks']} chunks of "
             f"{st['chunk_size']} B, {st['changed_fraction']:.1%} changed a save, {c['checkpoints']} checkpoints")
    print_tables(title, head, rows, xhead, xrows)
    print(f"first save {c['first_save_s']:.1f}s; prune to 10: {c['prune_keep_10_s']:.2f}s ({c['pruned']} removed); "
          f"gc after it {c['gc_after_prune_s']:.2f}s ({c['gc_after_prune']['deleted_packs']} packs, "
          f"{c['gc_after_prune']['deleted_bytes'] / 2**30:.2f} GiB freed); suite {c.get('suite_s', 0):.0f}s")
    print_footer(report, "SC1-SC4: time at the higher count / at the lower (1.0: flat; counts in the JSON). SC5: "
                 "manifest bytes of a mostly-unchanged checkpoint / the first's. SC6-SC8: see scale_ranks.")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--workdir")
    ap.add_argument("--no-ranks", action="store_true")
    a = ap.parse_args()
    rep = run_scale(a.quick, a.workdir, lambda m: print(m, file=sys.stderr, flush=True), ranks=not a.no_ranks)
    print_report(rep)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1, default=str)
