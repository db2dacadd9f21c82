#!/usr/bin/env python
"""P11.resume_waste (issue 13, suite `patch`): how much a rerun of ``luopan pull`` re-downloads after the first
run was killed halfway.

A channel with one published version (a fp32 state of 256 MiB; --quick 64 MiB) is served by a real nginx on
127.0.0.1 (tests/nginx.py) twice: one server limited to RATE per connection, so that a pull in a child process
(``luopan pull URL -o FILE``, no base: the full file) can be killed with SIGKILL once its partial file holds half the
file; and one unlimited server for the reruns. The rerun (in this process, `luopan.channel.pull`) reports the bytes it
received; nginx's access log gives the bytes it sent. Value = bytes the rerun downloaded / bytes not yet downloaded
at the kill (file size - partial file size). Goal <= 1.05 (1.0 is exact resume). The worst of REPS repetitions.

Context (not the goal): the rerun's seconds against a rerun that starts from zero (the partial file deleted, as a
download tool without resume does), both against the unlimited server, medians.

    python benchmarks/channel.py [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
try:
    import luopan  # noqa: F401
except ImportError:  # running from a checkout without an installed luopan
    sys.path.insert(1, os.path.join(ROOT, "src"))

from common import median, ratio_result  # noqa: E402

RATE = "128m"  # nginx limit_rate for the run that is killed: 256 MiB take ~2 s, so "half" is hit within a piece
REPS = 3
GOAL = 1.05


def _nginx_helper() -> Any:
    """tests/nginx.py, loaded by its path (no sys.path entry that could shadow another module named ``tests``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("luopan_bench_nginx", os.path.join(ROOT, "tests", "nginx.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _state(size_mib: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(11)
    n = max(1, size_mib // 16)  # 16 MiB tensors
    return {"model": {f"layer{i}.weight": rng.standard_normal((4096, 1024), dtype=np.float32) for i in range(n)}}


def _partial(device: str) -> str | None:
    parts = [p for p in os.listdir(device) if p.endswith(".part")]
    return os.path.join(device, parts[0]) if parts else None


def _kill_halfway(url: str, out: str, trusted: str, size: int, env: dict[str, str]) -> int:
    """Start `luopan pull` in a child, SIGKILL it once its partial file holds half the file; the bytes it holds."""
    cmd = [sys.executable, "-c", "from luopan.cli.main import main; main()", "pull", url, "-o", out,
           "--trusted-keys", trusted, "--retries", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    device = os.path.dirname(out)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            p = _partial(device)
            if p is not None and os.path.getsize(p) >= size // 2:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, stderr = proc.communicate()
    if proc.returncode != -signal.SIGKILL:
        raise RuntimeError(f"the pull was not killed halfway (exit {proc.returncode}; it ran too fast or failed): "
                           f"{stderr.decode(errors='replace')[-500:]}")
    p = _partial(device)
    return os.path.getsize(p) if p else 0


def run(quick: bool, workdir: str | None = None, log: Any = None, size_mib: int | None = None
        ) -> list[dict[str, Any]]:
    """P11.resume_waste as a list of one result (benchmarks/common.py ratio_result, goal overridden to <=)."""
    import luopan
    from luopan.channel import publish, pull
    from luopan.signing import generate_key
    nginx = _nginx_helper()
    NGINX, SKIP_REASON, Nginx = nginx.NGINX, nginx.SKIP_REASON, nginx.Nginx
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if NGINX is None:
        raise RuntimeError(f"P11 needs nginx: {SKIP_REASON}")
    size_mib, reps = (size_mib or 64, 2) if quick else (size_mib or 256, REPS)
    work = tempfile.mkdtemp(prefix="luopan-p11-", dir=workdir)
    for name in ("NO_PROXY", "no_proxy"):  # a proxy in the environment must not see loopback requests
        os.environ[name] = ",".join(filter(None, [os.environ.get(name), "127.0.0.1", "localhost"]))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        say(f"P11: publishing a {size_mib} MiB version")
        key, pub = generate_key(os.path.join(work, "keys"))
        trusted = os.path.join(work, "trusted")
        os.makedirs(trusted)
        shutil.copy(pub, trusted)
        chan = os.path.join(work, "channel")
        with luopan.open(os.path.join(work, "repo")) as repo:
            repo.save("run", 1, _state(size_mib))
            publish(repo, "run", 1, chan, sign_key=key, subtree="model")
        size = luopan.channel.parse_index(open(os.path.join(chan, "index.json"), "rb").read()).latest.full.size
        device = os.path.join(work, "device")
        os.makedirs(device)
        out = os.path.join(device, "model.safetensors")
        waste, remaining_all, rerun_all, sent_all, resume_s, restart_s = [], [], [], [], [], []
        with Nginx(chan, limit_rate=RATE) as slow, Nginx(chan) as fast:
            for rep in range(reps):
                for f in os.listdir(device):
                    os.unlink(os.path.join(device, f))
                have = _kill_halfway(slow.url, out, trusted, size, env)
                remaining = size - have
                before = len(fast.requests())
                t0 = time.perf_counter()
                got = pull(fast.url, None, out, trusted_keys=trusted, retries=0)
                resume_s.append(time.perf_counter() - t0)
                logged = fast.requests(at_least=before + 2)[before:]  # the index and the file
                sent = sum(n for path, _s, n, _r in logged if path != "/index.json")
                assert got["resumed_from"] == have, (got, have)
                waste.append(got["downloaded"] / remaining)
                remaining_all.append(remaining)
                rerun_all.append(got["downloaded"])
                sent_all.append(sent)
                say(f"P11 rep {rep + 1}: killed at {have / size:.1%}; the rerun downloaded {got['downloaded']} bytes "
                    f"of the {remaining} missing (nginx sent {sent}): {waste[-1]:.4f}")
                # context: the same rerun from zero (no resume)
                os.unlink(out)
                t0 = time.perf_counter()
                pull(fast.url, None, out, trusted_keys=trusted, retries=0)
                restart_s.append(time.perf_counter() - t0)
                fast.requests(at_least=before + 4)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    worst = max(waste)
    result = ratio_result(
        "P11.resume_waste", "restart from 0", "a rerun that downloads the whole file again (no resume)",
        "restart", "resume", GOAL, {"restart": restart_s, "resume": resume_s}, size,
        notes=f"value = bytes the rerun of `luopan pull` downloaded / bytes not yet downloaded when the first run "
              f"was SIGKILLed at half the file ({size_mib} MiB full file, nginx limit_rate {RATE} for the killed "
              f"run, unlimited for the rerun); worst of {reps} repetitions. peer_s/luopan_s: seconds of a rerun from "
              "zero vs the resuming rerun (context only).")
    result.update(ratio=round(worst, 4), value=round(worst, 4), goal=GOAL, goal_op="<=", met=worst <= GOAL,
                  unit="bytes downloaded by the rerun / bytes missing at the kill (1.0 = exact resume)",
                  time_ratio=round(median(restart_s) / median(resume_s), 3) if resume_s else None,
                  file_bytes=size, remaining_bytes=remaining_all, rerun_downloaded_bytes=rerun_all,
                  nginx_sent_bytes=sent_all, waste_per_rep=[round(w, 4) for w in waste])
    return [result]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MiB file, 2 repetitions")
    ap.add_argument("--json", metavar="OUT", help="write the result as JSON to OUT")
    ap.add_argument("--workdir", metavar="DIR", help="parent of the temporary directory")
    args = ap.parse_args(argv)
    results = run(args.quick, args.workdir)
    for r in results:
        print(f"{r['id']}: {r['value']:.4f} (goal {r['goal_op']} {r['goal']}: {'met' if r['met'] else 'MISSED'}); "
              f"{r['file_bytes']} byte file, per repetition {r['waste_per_rep']}; the resuming rerun took "
              f"{r['luopan_s']:.3f} s, one from zero {r['peer_s']:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
