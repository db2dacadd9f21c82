"""The `tiers` suite (issue 5): tiered storage and housekeeping measurements.

T1.tiered_over_local: the time of `repo.save` of a fp32 NumPy state (1 GiB; --quick 256 MiB) into a repository
opened with `replicate_to=` a loopback S3 server (moto's standalone server in a child process, spoken to over HTTP
like any S3 endpoint) / the time of the same save into a local-only repository. Steady state: each repetition saves
step 1 (state A), waits GAP_S seconds (the training compute between two saves; the CPUs are idle here, a GPU would
be busy), then saves step 2 (state B, every byte different) and times it: the replication of step 1 (several
seconds) is in full flight when the timed save starts, as in a training loop that saves often. Local and tiered repetitions
alternate in ABBA order, each in a fresh repository (and a fresh S3 prefix); medians. Goal <= 1.15. Also reported: the same ratio
for the first save (nothing replicating), the time from the end of save 2 to both checkpoints confirmed on the
server, and the replication throughput.

Measurements are functions in MEASUREMENTS, each `(ctx) -> list of result dicts` (ids "T<n>.<name>"): T1 here, T2
(gc + repack seconds per GiB of live data) in gc_bench.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from common import machine_info, median, settle, spread, timed

BUCKET = "luopan-bench"
GAP_S = 1.0  # between save 1 and save 2 (both variants)
SETTLE_S = 6.0  # after sync, before each variant (ext4 commits its journal every 5 s: the previous variant's deletes)
SERVER_NICE = 19  # the loopback server stands in for a remote machine: it gets the CPU only when the host is idle

# moto's standalone S3 server on 127.0.0.1 (a free port), printed on stdout; it runs until stdin closes.
# (tests/s3server.py starts the same server for the tests, with requests serialized for racing-writer tests.)
SERVER = r"""
import sys, threading
from werkzeug.serving import make_server
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app

app = DomainDispatcherApplication(create_backend_app)
server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
print(server.server_address[1], flush=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
sys.stdin.read()
server.shutdown()
"""


class S3Server:
    """The loopback S3 server, with the AWS environment pointed at it while the context is open.

    ``nice`` lowers the server process's CPU priority: a real S3 endpoint does its work (parsing uploads, hashing,
    assembling multipart objects — moto does it in Python, ~0.3 s of CPU per 64 MiB pack here) on other machines,
    not on the training host's cores. The client side (luopan's replication thread, s3fs) runs at normal priority.
    """

    script = SERVER  # a variant may wrap the WSGI app (scale_ranks.py counts requests)

    def __init__(self, nice: int = 0) -> None:
        self.nice = nice

    def __enter__(self) -> S3Server:
        nice = self.nice
        self.proc = subprocess.Popen([sys.executable, "-c", self.script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, preexec_fn=(lambda: os.nice(nice)) if nice else None)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.proc.kill()
            raise RuntimeError("the moto S3 server did not start (pip install 'moto[server]')")
        self.endpoint = f"http://127.0.0.1:{int(line)}"
        self._saved = dict(os.environ)
        os.environ.update({
            "LUOPAN_S3_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"})
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "HTTP_PROXY",
                  "HTTPS_PROXY", "http_proxy", "https_proxy"):
            os.environ.pop(k, None)
        import s3fs

        self.fs = s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True)
        self.fs.mkdir(BUCKET)
        return self

    def fresh_url(self) -> str:
        return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"

    def remove(self, url: str) -> None:
        try:
            self.fs.rm(url.split("://", 1)[1], recursive=True)
        except FileNotFoundError:
            pass

    def __exit__(self, *exc: object) -> None:
        os.environ.clear()
        os.environ.update(self._saved)
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Context:
    size_mib: int
    reps: int
    work: str
    log: Any
    quick: bool


def build_state(size_mib: int, seed: int) -> dict[str, Any]:
    """fp32 arrays totalling size_mib MiB in 4 MiB matrices (a model + optimizer shape)."""
    rng = np.random.default_rng(seed)
    return {f"layers.{i}.weight": rng.standard_normal((1024, 1024), dtype=np.float32)
            for i in range(max(1, size_mib // 4))}


def t1_tiered_over_local(ctx: Context) -> list[dict[str, Any]]:
    import luopan
    from luopan.checkpoint.kind import CHECKPOINTS

    a, b = build_state(ctx.size_mib, 1), build_state(ctx.size_mib, 2)
    nbytes = sum(x.nbytes for x in a.values())
    local_first, local_second, tier_first, tier_second, latency, throughput, sent = [], [], [], [], [], [], []
    with S3Server(SERVER_NICE) as s3:
        for r in range(ctx.reps + 1):  # the first repetition warms up (imports, connections) and is not counted
            # ABBA order: whichever variant runs second inherits the disk state (writeback, journal) of the first.
            for variant in (("local", "tiered") if r % 2 else ("tiered", "local")):
                path = os.path.join(ctx.work, f"{variant}{r}")
                url = s3.fresh_url()
                repo = luopan.open(path, **({"replicate_to": url} if variant == "tiered" else {}))
                settle()
                time.sleep(SETTLE_S)
                s1, _ = timed(lambda: repo.save("run", 1, a))
                time.sleep(GAP_S)
                s2, _ = timed(lambda: repo.save("run", 2, b))  # tiered: step 1 replicates meanwhile
                if variant == "local":
                    t1, t2 = s1, s2
                else:
                    u1, u2 = s1, s2
                    t0 = time.perf_counter()
                    ok = repo.tier.wait(1800)
                    lat = time.perf_counter() - t0
                    status = repo.tier.status(CHECKPOINTS, "run")
                    bytes_sent = repo.tier.sent_bytes
                    if not ok or set(status.values()) != {"replicated"}:
                        raise RuntimeError(f"replication did not finish: {status}")
                repo.close()
                s3.remove(url)
                shutil.rmtree(path)
            busy = GAP_S + u2 + lat  # from the end of save 1 until both are confirmed
            ctx.log(f"  rep {r}{' (warm-up)' if not r else ''}: local {t1:.3f}s / {t2:.3f}s, tiered {u1:.3f}s / "
                    f"{u2:.3f}s, replicated {lat:.3f}s after save 2 ({bytes_sent / max(busy, 1e-9) / 2**20:.0f} "
                    "MiB/s)")
            if r:
                local_first.append(t1)
                local_second.append(t2)
                tier_first.append(u1)
                tier_second.append(u2)
                latency.append(lat)
                throughput.append(bytes_sent / (GAP_S + u2 + lat))
                sent.append(bytes_sent)
    ratio = median(tier_second) / median(local_second)
    return [{
        "id": "T1.tiered_over_local",
        "ratio": round(ratio, 4),
        "value": round(ratio, 4),
        "goal": 1.15,
        "goal_op": "<=",
        "met": ratio <= 1.15,
        "local_save_s": median(local_second),
        "tiered_save_s": median(tier_second),
        "local_save_spread": spread(local_second),
        "tiered_save_spread": spread(tier_second),
        "first_save_ratio": round(median(tier_first) / median(local_first), 4),
        "local_first_save_s": median(local_first),
        "tiered_first_save_s": median(tier_first),
        "replication_latency_s": median(latency),
        "replication_mib_per_s": round(median(throughput) / 2**20, 1),
        "bytes_replicated": max(sent),
        "server_nice": SERVER_NICE,
        "state_bytes": nbytes,
        "notes": "ratio = median time of save 2 (step 1 replicating in the background) in a tiered repository / "
                 "the same save in a local-only one. replication_latency_s: end of save 2 to both checkpoints "
                 "confirmed on the server; replication_mib_per_s: bytes sent / (end of save 1 to confirmation). "
                 "Loopback moto server in a child process on the same machine at nice SERVER_NICE (a real endpoint's "
                 "server-side work does not run on the training host; moto's runs in Python on the same cores).",
    }]


def t2_gc_s_per_gib(ctx: Context) -> list[dict[str, Any]]:
    """T2 (benchmarks/gc_bench.py): gc + repack seconds per GiB of live data after pruning half of 20 checkpoints
    of a size_mib/8 state (128 MiB at the default 1 GiB: 20 checkpoints write about 1.2 GiB)."""
    from gc_bench import measure_t2

    return [measure_t2(ctx.work, max(16, ctx.size_mib // 8), ctx.log)]


MEASUREMENTS: list[Callable[[Context], list[dict[str, Any]]]] = [
    t1_tiered_over_local,
    t2_gc_s_per_gib,
]


def run_tiers(size_mib: int, reps: int, workdir_parent: str | None, log: Any, quick: bool = False) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="luopan-bench-tiers-", dir=workdir_parent)
    try:
        ctx = Context(size_mib, reps, work, log, quick)
        results = []
        for measure in MEASUREMENTS:
            results += measure(ctx)
        return {"suite": "tiers", "size_mib": size_mib, "machine": machine_info(work), "config": {"reps": reps},
                "results": results}
    finally:
        shutil.rmtree(work, ignore_errors=True)
