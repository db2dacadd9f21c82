#!/usr/bin/env python
"""luopan benchmarks.

    python benchmarks/run.py --suite foundation [--size-mib 1024] [--quick] [--json OUT] [--workdir DIR]
                                                     (P1, P5, P7; P5.cold_* needs root to drop the page cache)
    python benchmarks/run.py --suite incremental [--size-mib 1024] [--quick] [--json OUT]
                                                     (P2, P3, P4, P6, P8, P13, P14, P15)
    python benchmarks/run.py --suite tiers [--size-mib 1024] [--quick] [--json OUT]         (T1, T2)
    python benchmarks/run.py --suite artifacts [--size-mib 1024] [--quick] [--json OUT]     (A1, A2, A3)
    python benchmarks/run.py --suite dist [--size-mib 1024] [--quick] [--json OUT]          (D1, D2, D3)
    python benchmarks/run.py --suite patch [--size-mib 1024] [--quick] [--json OUT]         (P9, P10, P11, P12)
    python benchmarks/run.py --suite agent [--quick] [--json OUT]                           (J1, J2, I1, I2)
    python benchmarks/run.py --suite scale [--quick] [--json OUT]                           (SC1-SC8)
    python benchmarks/run.py --suite stacks [--quick] [--json OUT]                          (E1, E2, E3)
    python benchmarks/run.py --suite sync [--quick] [--json OUT]                            (SY1-SY5)

Runs in one process, alternating peer and luopan measurements, and prints medians and ratios. Exits 0 whether or
not the goals are met (the table and the JSON say which are missed); exits non-zero only when it cannot run.
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import luopan  # noqa: F401
except ImportError:  # running from a checkout without an installed luopan
    sys.path.insert(1, os.path.join(os.path.dirname(HERE), "src"))

import agent  # noqa: E402
import artifacts  # noqa: E402
import channel  # noqa: E402
import dist  # noqa: E402
import foundation  # noqa: E402
import incremental  # noqa: E402
import patch  # noqa: E402
import scale  # noqa: E402
import stacks  # noqa: E402
import sync  # noqa: E402
import tiers  # noqa: E402

QUICK_SIZE_MIB = 256
DEFAULT_SIZE_MIB = 1024


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=["foundation", "incremental", "tiers", "artifacts", "dist", "patch", "agent", "scale", "stacks", "sync"], default="foundation")
    ap.add_argument("--size-mib", type=int, default=None,
                    help=f"state size in MiB (default {DEFAULT_SIZE_MIB}; {QUICK_SIZE_MIB} with --quick)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_SIZE_MIB} MiB state, fewer cold repetitions")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each alternating pair (default 5)")
    ap.add_argument("--cold-reps", type=int, default=None,
                    help="cold-cache load repetitions, 0 to skip (default 3; 2 with --quick). Needs root to drop "
                         "the page cache; skipped otherwise")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocess probes (P7, P12)")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    ap.add_argument("--workdir", metavar="DIR",
                    help="parent directory for temporary data (default: the system temp dir); a fresh "
                         "subdirectory is created there and removed at the end")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--_rss-probe", dest="rss_probe", choices=["luopan", "safetensors"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.size_mib is None:
        args.size_mib = QUICK_SIZE_MIB if args.quick else DEFAULT_SIZE_MIB
    if args.cold_reps is None:
        args.cold_reps = 2 if args.quick else 3
    if args.size_mib <= 0 or args.reps <= 0 or args.cold_reps < 0:
        ap.error("--size-mib and --reps must be positive, --cold-reps non-negative")
    return args


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None:
        return "-"
    return format(x, spec)


def _status(r: dict[str, Any]) -> str:
    if r.get("met") is None:
        return "skipped" if r.get("skipped") else "-"
    return "met" if r["met"] else "MISSED"


def rows(report: dict[str, Any]) -> list[list[str]]:
    out = []
    for r in report["results"]:
        if r.get("context"):  # no goal: shown in the context table
            continue
        op = r.get("goal_op", ">=")
        status = _status(r)
        if r["id"].startswith("P7"):
            out.append([r["id"], "peak RSS - state (MiB)", _fmt(r.get("safetensors_peak_over_state_mib"), ".0f")
                        + " (safetensors)", _fmt(r["value"], ".0f") + " (luopan)", _fmt(r["value"], ".0f"),
                        f"{op} {r['goal']}", status])
            continue
        out.append([r["id"], r["peer_short"], _fmt(r["peer_s"]), _fmt(r["luopan_s"]),
                    _fmt(r["ratio"], ".2f"), f"{op} {r['goal']}", status])
    return out


def extra_rows(report: dict[str, Any]) -> list[list[str]]:
    out = []
    for r in report["results"]:
        if r["id"] == "P5.vs_safetensors_into_model":
            pr = r.get("extra_safetensors_pread_load_model")
            if pr:
                out.append([f"{r['id']} (peer: load_model backend=pread, warm)", _fmt(pr["peer_s"]),
                            _fmt(r["luopan_s"]), _fmt(pr["ratio"], ".2f")])
        if r["id"] == "P5.cold_vs_safetensors_into_model":
            if r.get("skipped"):
                out.append([f"{r['id']} ({r['skipped']})", "-", "-", "-"])
            for key, label in (("cold_pread", "peer: load_model backend=pread, cold"),
                               ("cold_dcp", "peer: DCP into the model, cold")):
                c = r.get(key)
                if c:
                    out.append([f"{r['id']} ({label})", _fmt(c["peer_s"]), _fmt(c["luopan_s"]),
                                _fmt(c["ratio"], ".2f")])
        if r["id"] == "P5.vs_safetensors_load":  # context only (the pre-issue-15 P5 figure, lazy mmap)
            out.append([f"{r['id']} (lazy mmap load_file+touch vs repo.load, warm; no goal)", _fmt(r["peer_s"]),
                        _fmt(r["luopan_s"]), _fmt(r["ratio"], ".2f")])
            # its load_file backend=pread figure is the goal P5.load_vs_safetensors_load_file now: not repeated here
            for key, label in (("cold", "mmap+touch vs repo.load, cold"), ("cold_pread", "pread vs repo.load, cold")):
                c = r.get(key)
                if c:
                    out.append([f"{r['id']} ({label})", _fmt(c["peer_s"]), _fmt(c["luopan_s"]),
                                _fmt(c["ratio"], ".2f")])
        if r["id"] == "P5.vs_dcp_load":
            out.append([f"{r['id']} (luopan repo.load, fresh tensors, warm)", _fmt(r["peer_s"]),
                        _fmt(r.get("luopan_load_s")), _fmt(r.get("ratio_vs_load"), ".2f")])
            c = r.get("cold")
            if c:
                out.append([f"{r['id']} (cold cache, load_into)", _fmt(c["peer_s"]), _fmt(c["luopan_s"]),
                            _fmt(c["ratio"], ".2f")])
    return out


def print_report(report: dict[str, Any]) -> None:
    head = ["id", "peer", "peer s", "luopan s", "ratio", "goal", "status"]
    xhead = ["context (not goals)", "peer s", "luopan s", "ratio"]
    st = report["state"]
    title = (f"luopan foundation benchmark: {report['size_mib']} MiB fp32 state ({st['tensors']} tensors), "
             f"medians of {report['config']['reps']} alternating repetitions, warm page cache")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None  # type: ignore[assignment]
    if Console is not None:
        console = Console(width=None if sys.stdout.isatty() else 118)
        t = Table(title=title, title_justify="left")
        for h in head:
            t.add_column(h, justify="right" if h in ("peer s", "luopan s", "ratio") else "left")
        for row in rows(report):
            style = {"met": "green", "MISSED": "bold red"}.get(row[-1], "yellow")
            t.add_row(*row[:-1], f"[{style}]{row[-1]}[/{style}]")
        console.print(t)
        x = extra_rows(report)
        if x:
            t2 = Table(title="context (not goals): alternative peer modes, cold cache, the old lazy-mmap P5",
                       title_justify="left")
            for h in xhead:
                t2.add_column(h, justify="left" if h == xhead[0] else "right")
            for row in x:
                t2.add_row(*row)
            console.print(t2)
    else:
        print(title)
        all_rows = [head] + rows(report)
        widths = [max(len(r[i]) for r in all_rows) for i in range(len(head))]
        for row in all_rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
        x = extra_rows(report)
        if x:
            print()
            all_rows = [xhead] + x
            widths = [max(len(r[i]) for r in all_rows) for i in range(len(xhead))]
            for row in all_rows:
                print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    m = report["machine"]
    print(f"machine: {m.get('cpu_count')} CPUs, {m.get('mem_total_gib')} GiB RAM, workdir on "
          f"{(m.get('workdir_mount') or {}).get('fstype', '?')}; load average at start {m.get('loadavg_start')}, "
          f"at end {m.get('loadavg_end')} (other work on the machine makes the figures noisier)")
    missed = [r["id"] for r in report["results"] if r["met"] is False]
    skipped = [r["id"] for r in report["results"] if r["met"] is None and not r.get("context")]
    print("ratio = peer seconds / luopan seconds (> 1: luopan faster); P7 in MiB (lower is better).")
    print("goals missed: " + (", ".join(missed) if missed else "none")
          + (f"; not judged (skipped): {', '.join(skipped)}" if skipped else ""))
    if report.get("problems"):
        print("DATA PROBLEMS: " + "; ".join(report["problems"]))


def _finish(report: dict, print_report: Any, args: argparse.Namespace, argv: list[str] | None, log: Any) -> int:
    """Record the command line, print the suite's tables and write its JSON (the suites with their own report)."""
    report["command"] = " ".join([os.path.basename(sys.executable), "benchmarks/run.py", *sys.argv[1:]]) \
        if argv is None else " ".join(argv)
    log("done")
    print_report(report)
    _write_json(args.json, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rss_probe:
        work = args.workdir or os.path.join(os.getcwd(), ".")
        print(json.dumps(foundation.rss_probe(args.rss_probe, args.size_mib, work)))
        return 0
    log = foundation.Log(verbose=not args.quiet)
    if args.suite == "scale":  # its own sizes (a 262k-chunk state, 1,000 checkpoints; --quick smaller): no --size-mib
        return _finish(scale.run_scale(args.quick, args.workdir, log), scale.print_report, args, argv, log)
    if args.suite == "stacks":  # the tests' tiny runs of each stack: no --size-mib
        return _finish(stacks.run_stacks(args.quick, args.workdir, log), stacks.print_report, args, argv, log)
    if args.suite == "sync":  # live weight sync to a subscriber process (SY1-SY5): its own sizes, no --size-mib
        return _finish(sync.run_sync(args.quick, args.workdir, log), sync.print_report, args, argv, log)
    if args.suite == "agent":
        report = agent.run_agent(args.quick, args.reps, args.workdir, log)
        return _finish(report, agent.print_report, args, argv, log)
    if args.suite == "artifacts":
        report = artifacts.run_artifacts(args.size_mib, args.reps, args.cold_reps, args.workdir, log)
        return _finish(report, artifacts.print_report, args, argv, log)
    if args.suite == "dist":
        return _finish(dist.run_dist(args.size_mib, args.reps, args.workdir, log), dist.print_report, args, argv, log)
    if args.suite == "patch":
        report = patch.run_patch(args.size_mib, args.reps, args.workdir, log, not args.no_rss)
        report["results"] += channel.run(args.quick, args.workdir, log,  # P11: a resumed pull over a real nginx
                                         min(args.size_mib, 64 if args.quick else 256))
        return _finish(report, patch.print_report, args, argv, log)
    if args.suite == "tiers":
        report = tiers.run_tiers(args.size_mib, min(args.reps, 3) if args.quick else args.reps, args.workdir, log,
                                 args.quick)
        log("done")
        for r in report["results"]:
            detail = {
                "T1": lambda: f"save {r['tiered_save_s']:.3f}s tiered vs {r['local_save_s']:.3f}s local while the "
                              f"previous checkpoint replicates (first save: ratio {r['first_save_ratio']}); "
                              f"replicated {r['replication_latency_s']:.2f}s after the save, "
                              f"{r['replication_mib_per_s']} MiB/s, {r['state_bytes']} bytes per save",
            }.get(r["id"][:2], lambda: "")()
            if r["id"].startswith("T2"):
                print(f"{r['id']}: {r['value']:.3f} s/GiB (report only; no goal yet): gc {r['gc_s']:.2f}s for "
                      f"{r['live_bytes'] / 2**20:.0f} MiB live, deleted {r['deleted_bytes'] / 2**20:.0f} MiB in "
                      f"{r['deleted_packs']} packs, repacked {r['repacked_packs']} ({r['copied_bytes'] / 2**20:.0f} "
                      f"MiB copied), rewrote {r['manifests_rewritten']} manifests; seconds per phase "
                      f"{r['profile_s']}")
                continue
            print(f"{r['id']}: {r['ratio']:.4f} (goal {r['goal_op']} {r['goal']}: {'met' if r['met'] else 'MISSED'})"
                  f"; {detail}")
        _write_json(args.json, report)
        return 0
    if args.suite == "incremental":
        report = incremental.run_incremental(args.size_mib, args.reps, args.workdir, log, quick=args.quick)
        log("done")
        for r in report["results"]:
            print(_incremental_line(r))
        errors = [r["id"] for r in report["results"] if "error" in r]
        missed = [r["id"] for r in report["results"] if r.get("met") is False and "error" not in r]
        print("goals missed: " + (", ".join(missed) if missed else "none")
              + (f"; FAILED to run: {', '.join(errors)}" if errors else ""))
        _write_json(args.json, report)
        return 0
    report = foundation.run_foundation(args.size_mib, args.reps, args.cold_reps, args.workdir, not args.no_rss,
                                       log)
    report["command"] = " ".join([os.path.basename(sys.executable), "benchmarks/run.py", *sys.argv[1:]]) \
        if argv is None else " ".join(argv)
    log("done")
    print_report(report)
    _write_json(args.json, report)
    return 0


def _incremental_detail(r: dict[str, Any]) -> str:
    """The detail after an incremental result's figure: by full id first, then by the id's prefix before the dot
    ("P3", "P13", ...), else its notes."""
    by_id = {
        "P3.first_resave_over_changed": lambda: (
            f"{r['table_bytes'] >> 20} MiB table, {r['changed_rows']} rows changed ({r['changed_row_bytes']} "
            f"bytes): the first re-save in a new process stored {r['stored_bytes']} bytes in {r['luopan_s']:.3f}s; "
            f"restart without a load: ratio {r['ratio_restart_without_load']}; in one process: ratio "
            f"{r['ratio_in_process']}; by disk growth {r['ratio_by_disk_growth']}"),
        "P13.fullft_logical_over_stored": lambda: (
            f"bytes ratio {'met' if r['ratio_met'] else 'MISSED'}; save time ratio {r['save_time_ratio']} (goal <= "
            f"{r['save_time_goal']}: {'met' if r['save_time_met'] else 'MISSED'}); stored {r['stored_bytes']} of "
            f"{r['logical_bytes']} logical bytes over {r['saves']} saves"),
        "P14.bf16_compression_vs_zipnn": lambda: (
            f"luopan {r['luopan_bytes']} B, zipnn {r['zipnn_bytes']} B of {r['raw_bytes']} raw bf16 bytes"),
        "P15.manifest_share": lambda: (
            f"{r['saves']} LoRA saves: manifests {r['manifest_bytes']} B ({r['manifests']} files, mean "
            f"{r['manifest_mean_bytes']} B), entry groups {r.get('entry_group_bytes', 0)} B, index "
            f"{r['index_bytes']} B ({r['index_files']} files), packs "
            f"{r['pack_bytes']} B, all {r['total_bytes']} B"),
    }
    by_prefix = {
        "P8": lambda: f"full save {r['luopan_full_save_s']:.3f}s, unchanged re-save "
                      f"{r['luopan_unchanged_resave_s']:.3f}s, re-save wrote {r['resave_bytes_written']} "
                      f"bytes of {r['state_bytes']}",
        "P6": lambda: f"save_async blocked {r['luopan_async_stall_s']:.3f}s, synchronous save "
                      f"{r['luopan_sync_save_s']:.3f}s, {r['state_bytes']} bytes",
        "P2": lambda: (f"peer {r['peer_s']:.3f}s, luopan {r['luopan_s']:.3f}s (trust_versions), "
                       f"default mode ratio {r['ratio_default_mode']}") if "peer_s" in r else
                      f"wrote {r['luopan_stored_bytes']} bytes for {r['changed_tensor_bytes']} changed",
        "P4": lambda: (f"load #{r['saves']} {r['load_last_s']:.3f}s vs load #1 {r['load_first_s']:.3f}s, "
                       f"standalone {r['load_standalone_s']:.3f}s"),
        "P3": lambda: (f"{r['table_bytes'] >> 20} MiB table, {r['intervals']} intervals: auto {r['ratio']}, "
                       f"touched_rows hint {r['ratio_hint_mode']}, row deltas off {r['ratio_deltas_off']}, "
                       f"ideal {r['ideal_ratio']}; table rewrites {r['table_rewrites']}"),
    }
    fn = by_id.get(r["id"]) or by_prefix.get(r["id"].split(".")[0])
    try:
        if fn is not None:
            return fn()
    except (KeyError, TypeError, ValueError):
        pass
    notes = str(r.get("notes", ""))
    return notes if len(notes) <= 200 else notes[:197] + "..."


def _incremental_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['id']}: FAILED to run: {r['error']}"
    figure = "-" if r.get("ratio") is None else f"{r['ratio']:.4f}"
    status = {True: "met", False: "MISSED"}.get(r.get("met"), "not judged")
    return f"{r['id']}: {figure} (goal {r.get('goal_op')} {r.get('goal')}: {status}); {_incremental_detail(r)}"


def _write_json(path: str | None, report: dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"JSON written to {path}")


if __name__ == "__main__":
    sys.exit(main())
