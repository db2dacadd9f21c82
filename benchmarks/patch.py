"""The `patch` suite: shipping a fine-tune as a luopan patch (docs/format.md §13) against the reference article's
method (`.delta` tensors written with torch.save, merged into the base on the device).

The state is LoRA-style: a frozen base of `--size-mib` MiB (1 GiB; --quick 256 MiB) of fp32 weight matrices
(`layers.<i>.weight`, up to 4096 x 1024, 16 MiB each) plus rank-r adapters `lora_A` (r x 1024) and `lora_B` (rows x
r) per layer, r chosen so the adapters are ~1% of the base (r = 8 at 4096 rows). Step 1 is the base with fresh
adapters (A random, B zero, as LoRA initialises them); step 2 has trained adapters (both random), the base
unchanged. Both are saved into a fresh repository (default 4 MiB chunks); `repo.export(..., subtree="model")` of
step 1 is the device's base file.

P9.patch_bytes_over_changed: `luopan.patch.create(repo, run, 1, 2, subtree="model")`: patch file bytes / bytes of
the tensors that changed (the adapters). Goal <= 1.05.

P10.apply_vs_article: the article's method — `safetensors.torch.load_file(base)`, `torch.load(delta,
weights_only=True)` of the `.delta` file (the changed tensors' differences, written with `torch.save`), add, then
`safetensors.torch.save_file(merged)` and fsync — / `luopan.patch.apply(patch, base, out)` (hashes the base for its
fingerprint, writes every chunk verified, fsync, rename). Ratio = article seconds / luopan seconds, medians of
`--reps` alternating repetitions after a warm-up (the order flips every repetition; outputs removed and `sync`
called between, untimed; warm page cache). Goal >= 3. The warm-up checks that luopan's output is `repo.export` of
step 2 byte for byte and the article's has the same tensors (up to fp32 rounding of base + delta).

P10.apply_vs_raw_write: the physical floor of any method that writes the merged model — write the output file's
bytes (the exported target, read into memory before the timings) to a new file in one `write` and fsync it — / the
same `luopan.patch.apply`. Measured in the same repetitions as P10.apply_vs_article, the three methods alternated
(the order flips every repetition). Goal >= 0.8: applying a patch (reading and hashing the base, verifying every
chunk, rename and directory fsync included) costs at most 1.25x writing its output.

P12.apply_peak_rss_mib: peak RSS growth (MiB) of a subprocess that imports luopan, then runs `luopan.patch.apply`
on the `--size-mib` base (1 GiB by default), sampled with psutil every 2 ms and by the kernel's high-water mark
(VmHWM, reset first), whichever is higher, minus the RSS before the call. Goal <= 300. The article's method is
measured the same way (context).

Context (not goals): a one-sample profile of luopan's apply (hashing the base for its fingerprint / writing and
syncing the output; wall, user and system CPU seconds) and the time to write and fsync the same number of bytes of
zeros, plainly and with writeback started as it goes (the disk's floor for any method that writes the merged
model).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

from common import fmt as _fmt
from common import print_footer, print_tables
from common import ratio_result as _ratio_result
from common import (
    MIB,
    RssSampler,
    fsync_path,
    loadavg,
    machine_info,
    peak_rss_bytes,
    remove,
    reset_peak_rss,
    rss_bytes,
    settle,
    timed,
)

RUN = "ft"
COLS = 1024
MAX_ROWS = 4096  # 16 MiB fp32 layers


def layout(size_mib: int) -> tuple[int, int, int]:
    """(layers, rows per layer, LoRA rank) of a base of about ``size_mib`` MiB with ~1% adapters."""
    layer_bytes = min(MAX_ROWS * COLS * 4, max(COLS * 4, size_mib * MIB // 8))
    rows = layer_bytes // (COLS * 4)
    layers = max(1, size_mib * MIB // layer_bytes)
    rank = max(1, round(0.01 * rows * COLS / (COLS + rows)))
    return layers, rows, rank


def build(size_mib: int, torch: Any, trained: bool) -> dict[str, Any]:
    layers, rows, rank = layout(size_mib)
    g = torch.Generator().manual_seed(0)
    model = {}
    for i in range(layers):
        model[f"layers.{i}.weight"] = torch.randn(rows, COLS, generator=g)
    t = torch.Generator().manual_seed(1 if trained else 2)
    for i in range(layers):
        model[f"layers.{i}.lora_A"] = torch.randn(rank, COLS, generator=t) * 0.01
        model[f"layers.{i}.lora_B"] = torch.randn(rows, rank, generator=t) * 0.01 if trained \
            else torch.zeros(rows, rank)
    return model


def article_apply(base: str, delta: str, out: str) -> None:
    """The reference article's merge: load the base, load the .delta (torch.save, weights_only on load), add,
    save the merged model with safetensors, fsync."""
    import torch
    from safetensors.torch import load_file, save_file

    merged = load_file(base)
    for name, d in torch.load(delta, weights_only=True).items():
        merged[name] = merged[name] + d if name in merged else d
    save_file(merged, out)
    fsync_path(out)


def raw_write(data: bytes, out: str) -> None:
    """The floor: the output's bytes, already in memory, written to a new file and fsynced."""
    with open(out, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def luopan_apply(patch: str, base: str, out: str) -> None:
    import luopan.patch

    luopan.patch.apply(patch, base, out)


def rss_probe(method: str, patch: str, base: str, delta: str, out: str) -> dict[str, Any]:
    """Run in a subprocess: peak RSS growth of one apply, after the imports it needs."""
    import psutil  # noqa: F401  (imported before the baseline, as the sampler needs it)
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    import luopan.patch  # noqa: F401

    before = rss_bytes()
    reset_peak_rss()
    with RssSampler(0.002) as sampler:
        if method == "luopan":
            luopan_apply(patch, base, out)
        else:
            article_apply(base, delta, out)
    hwm = peak_rss_bytes() or 0
    peak = max(sampler.peak, hwm)
    return {"method": method, "rss_before_mib": before / MIB, "peak_mib": peak / MIB,
            "growth_mib": (peak - before) / MIB, "samples": sampler.samples, "hwm_mib": hwm / MIB}


def _probe(method: str, paths: dict[str, str]) -> dict[str, Any]:
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(here), "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_rss-probe", method, paths["patch"],
                           paths["base"], paths["delta"], paths["probe_out"]], capture_output=True, text=True,
                          env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"RSS probe ({method}) failed: {proc.stderr[-2000:]}")
    remove(paths["probe_out"])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_patch(size_mib: int, reps: int, workdir_parent: str | None, log: Any, rss: bool = True) -> dict[str, Any]:
    if workdir_parent is not None:
        os.makedirs(workdir_parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix="luopan-bench-patch-", dir=workdir_parent)
    try:
        return _run(size_mib, reps, work, log, rss)
    finally:
        remove(work)
        settle()


def _run(size_mib: int, reps: int, work: str, log: Any, rss: bool) -> dict[str, Any]:
    import torch

    import luopan
    import luopan.patch

    nbytes = size_mib * MIB
    need = 6 * nbytes + 256 * MIB
    st = os.statvfs(work)
    if st.f_bavail * st.f_frsize < need:
        raise SystemExit(f"not enough free space in {work}: about {need / MIB:.0f} MiB needed (6x the base); pass "
                         "--workdir on a bigger disk or a smaller --size-mib")
    machine = machine_info(work)
    problems: list[str] = []
    paths = {name: os.path.join(work, name) for name in ("base.safetensors", "target.safetensors", "update.lpatch",
                                                          "update.delta", "lp.safetensors", "art.safetensors",
                                                          "probe.safetensors", "zeros.bin", "raw.safetensors")}
    paths.update(base=paths["base.safetensors"], target=paths["target.safetensors"], patch=paths["update.lpatch"],
                 delta=paths["update.delta"], probe_out=paths["probe.safetensors"])
    layers, rows, rank = layout(size_mib)
    log(f"building the LoRA-style state: {layers} layers of {rows}x{COLS} fp32, rank {rank} adapters; workdir {work}")
    repo = luopan.open(os.path.join(work, "repo"))
    step1 = build(size_mib, torch, trained=False)
    repo.save(RUN, 1, {"model": step1})
    step2 = build(size_mib, torch, trained=True)
    repo.save(RUN, 2, {"model": step2})
    changed = {k: v for k, v in step2.items() if not torch.equal(v, step1[k])}
    changed_bytes = sum(v.numel() * v.element_size() for v in changed.values())
    base_bytes = sum(v.numel() * v.element_size() for v in step1.values())
    torch.save({k: v - step1[k] for k, v in changed.items()}, paths["delta"])  # the article's .delta
    del step1, step2
    repo.export(RUN, path=paths["base"], step=1, subtree="model")
    repo.export(RUN, path=paths["target"], step=2, subtree="model")
    log("creating the patch")
    create_s, info = timed(lambda: luopan.patch.create(repo, RUN, 1, 2, paths["patch"], subtree="model"))
    patch_bytes = os.path.getsize(paths["patch"])
    header_bytes = _header_len(paths["patch"])
    repo.close()
    p9 = {
        "id": "P9.patch_bytes_over_changed", "value": patch_bytes / changed_bytes, "goal": 1.05, "goal_op": "<=",
        "met": patch_bytes / changed_bytes <= 1.05, "unit": "patch file bytes / bytes of the tensors that changed",
        "patch_bytes": patch_bytes, "changed_bytes": changed_bytes, "changed_tensors": len(changed),
        "header_bytes": header_bytes, "base_bytes": base_bytes, "carried_chunks": info["carried_chunks"],
        "chunks": info["chunks"], "create_s": create_s, "delta_file_bytes": os.path.getsize(paths["delta"]),
        "notes": "luopan.patch.create(repo, run, 1, 2, subtree='model') of the LoRA-style state; changed = every "
                 "adapter tensor (the base is frozen). delta_file_bytes: the article's torch.save .delta (context).",
    }
    log(f"P9: patch {patch_bytes} bytes for {changed_bytes} changed bytes ({p9['value']:.4f})")

    samples: dict[str, list[float]] = {"article": [], "luopan": [], "raw": []}
    with open(paths["target"], "rb") as f:
        output = f.read()  # the floor writes these bytes from memory
    for rep in range(reps + 1):
        order = [("article", lambda: article_apply(paths["base"], paths["delta"], paths["art.safetensors"])),
                 ("luopan", lambda: luopan_apply(paths["patch"], paths["base"], paths["lp.safetensors"])),
                 ("raw", lambda: raw_write(output, paths["raw.safetensors"]))]
        if rep % 2:
            order.reverse()
        for name, fn in order:
            settle()
            dt, _ = timed(fn)
            if rep:
                samples[name].append(dt)
            log(f"P10 {'warm-up' if not rep else f'rep {rep}'}: {name} {dt:.3f}s")
        if not rep:
            _check(paths, problems)
        remove(paths["art.safetensors"])
        remove(paths["lp.safetensors"])
        remove(paths["raw.safetensors"])
    output_bytes = len(output)
    del output
    p10 = _ratio_result(
        "P10.apply_vs_article", "article merge", "the article's method: safetensors load_file(base) + "
        "torch.load(.delta, weights_only=True) + add + safetensors save_file(merged) + fsync", "article", "luopan", 3,
        samples, base_bytes + changed_bytes,
        "Both write the whole merged model (base + adapters) and fsync it, from a warm page cache; luopan also hashes "
        "the base (its content fingerprint) and verifies every chunk, and renames its output into place.")
    p10["profile"] = _profile(paths, base_bytes + changed_bytes)
    log(f"P10: ratio {p10['ratio']:.2f}; profile {p10['profile']}")
    p10_raw = _ratio_result(
        "P10.apply_vs_raw_write", "write+fsync", "the physical floor: the output file's bytes, from memory, written "
        "to a new file in one write and fsynced", "raw", "luopan", 0.8, samples, output_bytes,
        "The same repetitions as P10.apply_vs_article (three methods alternated). luopan also reads and hashes the "
        "base (its content fingerprint), verifies every chunk as it is written, renames its output into place and "
        "fsyncs the directory.", output_bytes=output_bytes)
    log(f"P10 raw write: ratio {p10_raw['ratio']:.2f}")

    probes = {}
    if rss:
        for method in ("luopan", "article"):
            settle()
            probes[method] = _probe(method, paths)
            log(f"P12 probe {method}: +{probes[method]['growth_mib']:.0f} MiB")
    growth = probes["luopan"]["growth_mib"] if probes else None
    p12 = {"id": "P12.apply_peak_rss_mib", "value": growth, "goal": 300, "goal_op": "<=",
           "met": growth is not None and growth <= 300, "unit": "MiB of peak RSS growth during luopan.patch.apply",
           "base_bytes": base_bytes, "luopan": probes.get("luopan"), "article": probes.get("article"),
           "notes": "A subprocess imports luopan, safetensors and torch, then applies; RSS sampled every 2 ms and "
                    "the kernel's VmHWM (reset first), minus the RSS before the call."}
    machine["loadavg_end"] = loadavg()
    results = [p9, p10, p10_raw, p12]
    if problems:
        for r in results:
            r["met"] = False
            r["notes"] += " DATA PROBLEM: " + "; ".join(problems)
    return {"suite": "patch", "size_mib": size_mib, "machine": machine, "problems": problems,
            "config": {"reps": reps, "chunk_size": 4 * MIB, "rss": rss},
            "state": {"base_bytes": base_bytes, "changed_bytes": changed_bytes, "layers": layers, "rows": rows,
                      "cols": COLS, "rank": rank, "tensors": 3 * layers},
            "results": results}


def _header_len(path: str) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(16)[12:16], "little")


def _check(paths: dict[str, str], problems: list[str]) -> None:
    """luopan's output is the export of step 2 byte for byte; the article's has the same tensors (fp32 rounding)."""
    import torch
    from safetensors.torch import load_file

    with open(paths["lp.safetensors"], "rb") as a, open(paths["target"], "rb") as b:
        while True:
            x, y = a.read(64 * MIB), b.read(64 * MIB)
            if x != y:
                problems.append("luopan's applied patch differs from the export of the target")
                break
            if not x:
                break
    got, want = load_file(paths["art.safetensors"]), load_file(paths["target"])
    if got.keys() != want.keys() or not all(torch.allclose(got[k], want[k], atol=1e-6) for k in want):
        problems.append("the article's merged model differs from the target")


def _profile(paths: dict[str, str], nbytes: int) -> dict[str, float]:
    """One sample each: luopan's apply and, alone, its first pass (hashing the base for its content fingerprint:
    `luopan.patch.fingerprint_file`), so the rest is writing, verifying and syncing; and writing + fsyncing as many
    zeros, plainly and with writeback started as it goes."""
    import luopan.patch

    settle()
    hash_s, _fp = timed(lambda: luopan.patch.fingerprint_file(paths["base"], 4 * MIB))
    settle()
    before = resource.getrusage(resource.RUSAGE_SELF)
    apply_s, _ = timed(lambda: luopan_apply(paths["patch"], paths["base"], paths["lp.safetensors"]))
    after = resource.getrusage(resource.RUSAGE_SELF)
    remove(paths["lp.safetensors"])
    floor = {}
    for behind in (False, True):
        settle()
        floor[behind] = _write_zeros(paths["zeros.bin"], nbytes, behind)
        remove(paths["zeros.bin"])
    return {"hash_base_s": hash_s, "apply_s": apply_s, "write_verify_fsync_s": apply_s - hash_s,
            "apply_user_cpu_s": after.ru_utime - before.ru_utime, "apply_sys_cpu_s": after.ru_stime - before.ru_stime,
            "write_zeros_fsync_s": floor[False], "write_zeros_behind_fsync_s": floor[True]}


def _write_zeros(path: str, nbytes: int, behind: bool) -> float:
    """Seconds to write ``nbytes`` of zeros and fsync them; with ``behind``, starting writeback after every 8 MiB
    (POSIX_FADV_DONTNEED, as luopan's apply does): the disk's floor for writing the merged model."""
    piece = bytes(8 * MIB)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for i in range(nbytes // len(piece)):
            f.write(piece)
            if behind:
                f.flush()
                os.posix_fadvise(f.fileno(), i * len(piece), len(piece), os.POSIX_FADV_DONTNEED)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def print_report(report: dict[str, Any]) -> None:
    head = ["id", "peer", "peer", "luopan", "value", "goal", "status"]
    rows, xrows = [], []
    for r in report["results"]:
        status = "met" if r["met"] else "MISSED"
        goal = f"{r['goal_op']} {r['goal']}"
        if r["id"].startswith("P9"):
            rows.append([r["id"], "changed tensors", f"{r['changed_bytes'] / MIB:.2f} MiB",
                         f"{r['patch_bytes'] / MIB:.2f} MiB patch", _fmt(r["value"], ".4f"), goal, status])
            xrows.append([f"{r['id']} (article's .delta file / changed)", f"{r['delta_file_bytes'] / MIB:.2f} MiB",
                          f"{r['patch_bytes'] / MIB:.2f} MiB", _fmt(r["delta_file_bytes"] / r["changed_bytes"], ".4f")])
            xrows.append([f"{r['id']} (create s; header bytes)", "-", f"{r['create_s']:.3f} s",
                          str(r["header_bytes"])])
        elif r["id"].startswith("P10"):
            rows.append([r["id"], r["peer_short"], _fmt(r["peer_s"]) + " s", _fmt(r["luopan_s"]) + " s",
                         _fmt(r["ratio"], ".2f"), goal, status])
            p = r.get("profile")
            if p is None:
                continue
            xrows.append([f"{r['id']} (luopan: hash base / write+verify+fsync s)", "-",
                          f"{p['hash_base_s']:.3f} / {p['write_verify_fsync_s']:.3f}", "-"])
            xrows.append([f"{r['id']} (luopan apply: wall / user CPU / system CPU s)", "-",
                          f"{p['apply_s']:.3f} / {p['apply_user_cpu_s']:.3f} / {p['apply_sys_cpu_s']:.3f}", "-"])
            xrows.append([f"{r['id']} (zeros: write+fsync / with write-behind s)", "-",
                          f"{p['write_zeros_fsync_s']:.3f} / {p['write_zeros_behind_fsync_s']:.3f}", "-"])
        elif r["id"].startswith("P11"):
            rows.append([r["id"], "missing at the kill", f"{min(r['remaining_bytes']) / MIB:.1f} MiB",
                         f"{max(r['rerun_downloaded_bytes']) / MIB:.1f} MiB again", _fmt(r["value"], ".4f"), goal,
                         status])
            xrows.append([f"{r['id']} (rerun from zero / resumed rerun s)", _fmt(r["peer_s"]) + " s",
                          _fmt(r["luopan_s"]) + " s", _fmt(r.get("time_ratio"), ".2f")])
        else:
            art = (r.get("article") or {}).get("growth_mib")
            rows.append([r["id"], "article merge", _fmt(art, ".0f") + " MiB", _fmt(r["value"], ".0f") + " MiB",
                         _fmt(r["value"], ".0f"), goal, status])
    st = report["state"]
    title = (f"luopan patch benchmark: {st['base_bytes'] / MIB:.0f} MiB frozen fp32 base ({st['layers']} layers) + "
             f"{st['changed_bytes'] / MIB:.2f} MiB rank-{st['rank']} adapters, P10 medians of "
             f"{report['config']['reps']} alternating repetitions, warm page cache")
    print_tables(title, head, rows, ["context (not goals)", "peer", "luopan", "ratio"], xrows)
    print_footer(report, "P9 = patch bytes / changed bytes (lower is better); P10 ratio = article (or raw "
                 "write+fsync) seconds / luopan seconds (> 1: luopan faster); P12 = MiB of peak RSS growth (lower is better).")


if __name__ == "__main__":  # the RSS probe's subprocess: patch.py --_rss-probe METHOD PATCH BASE DELTA OUT
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if len(sys.argv) == 7 and sys.argv[1] == "--_rss-probe":
        print(json.dumps(rss_probe(*sys.argv[2:])))
        sys.exit(0)
    sys.exit("run the suite with: python benchmarks/run.py --suite patch [--quick] [--json OUT]")
