"""Run records and eval logs (docs/format.md §8.1): what a run was, and what it produced besides checkpoints.

A run's record is written once, by its first save: the config the user passes, ``sys.argv``, package versions,
Python and OS, the git commit with the full diff of a dirty work tree, and the environment with secrets redacted.
Eval results keep per-sample outputs, not just scores: ``repo.run("run-a").log_eval(step, metrics, samples=[...])``.
"""

from __future__ import annotations

import json
import os
import re
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata as importlib_metadata
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointExistsError, CheckpointNotFoundError, UnsupportedValueError
from ..format import BASE_FORMAT_VERSION, refuse_newer
from ..format.canonical import SealError, canonical, parse_object, seal, verify_seal
from ..format.names import check_run, check_step, manifest_key
from ..locks import locked
from ..store.base import KeyNotFound

if TYPE_CHECKING:
    from .repo import Repo

SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")
PACKAGES = ("luopan", "torch", "numpy", "safetensors", "transformers", "accelerate", "deepspeed", "lightning")
MAX_DIFF_BYTES = 16 << 20  # a larger diff is cut (and says so): records stay loadable


def record_key(run: str) -> str:
    return f"runs/{run}/record.json"


def eval_key(run: str, step: int) -> str:
    return f"runs/{run}/evals/{step:08d}.json"


def pin_key(run: str, step: int) -> str:
    return f"refs/pins/{run}/{step:08d}.json"


_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
_SECRET_FLAG = re.compile(r"^--?[\w.-]*(" + "|".join(SECRET_MARKERS) + r")[\w.-]*(=|$)", re.IGNORECASE)


def _text(value: str) -> str:
    """A str that encodes as UTF-8 (undecodable bytes from the OS arrive as surrogates)."""
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _scrub(value: str) -> str:
    """Credentials inside a value: the user:password@ of URLs."""
    return _URL_USERINFO.sub("<redacted>@", _text(value))


def redacted_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment with the value of every variable whose name contains a secret marker replaced, and the
    credentials of URLs in the others (DATABASE_URL, index URLs with user:token@)."""
    env = os.environ if environ is None else environ
    return {_text(k): ("<redacted>" if any(m in k.upper() for m in SECRET_MARKERS) else _scrub(v))
            for k, v in sorted(env.items())}


def redacted_argv(argv: list[str]) -> list[str]:
    """argv with the values of secret-looking flags (--hf_token X, --api-key=X) and URL credentials redacted."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("<redacted>")
            hide_next = False
            continue
        m = _SECRET_FLAG.match(arg)
        if m and m.group(2) == "=":
            out.append(arg.split("=", 1)[0] + "=<redacted>")
        else:
            out.append(_scrub(arg))
            hide_next = bool(m)
    return out


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.decode("utf-8", "replace") if out.returncode == 0 else None  # diffs may hold any bytes


def git_state() -> dict[str, Any] | None:
    commit = _git("rev-parse", "--verify", "-q", "HEAD")
    if commit is None:
        return None
    diff = _git("diff", "HEAD", "--binary") or ""
    untracked = [p for p in (_git("ls-files", "--others", "--exclude-standard") or "").splitlines() if p]
    state: dict[str, Any] = {"commit": commit.strip(), "dirty": bool(diff), "diff": diff,
                             "untracked_files": untracked}
    if len(diff.encode()) > MAX_DIFF_BYTES:
        state["diff"] = diff.encode()[:MAX_DIFF_BYTES].decode(errors="ignore")
        state["diff_truncated"] = True
    return state


def packages() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            continue
    return out


def config_json(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """A JSON copy of a run config; UnsupportedValueError says how to fix one that is not JSON."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise UnsupportedValueError(f"config must be a dict of JSON values, got {type(config).__name__}")
    try:
        return json.loads(canonical(config))
    except (TypeError, ValueError, RecursionError) as exc:
        raise UnsupportedValueError(
            f"config must hold only JSON values (resolve it first, e.g. OmegaConf.to_container(cfg, resolve=True)): "
            f"{exc}") from None


def build_record(run: str, config: dict[str, Any] | None) -> dict[str, Any]:
    config_copy = config_json(config)
    return {
        "format_version": BASE_FORMAT_VERSION,
        "run": run,
        "created": datetime.now(timezone.utc).isoformat(),
        "config": config_copy,
        "argv": redacted_argv(list(sys.argv)),
        "cwd": _text(os.getcwd()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": packages(),
        "git": git_state(),
        "environment": redacted_environment(),
    }


def _parse(data: bytes, where: str) -> dict[str, Any]:
    try:
        obj = parse_object(data)
        refuse_newer(obj, where)
        return verify_seal(obj)
    except SealError as exc:
        from ..errors import CorruptRepoError

        raise CorruptRepoError(f"{where} is damaged: {exc}") from None


class Run:
    """One run of a repository: its record and eval logs (checkpoints are on the Repo)."""

    def __init__(self, repo: Repo, name: str) -> None:
        check_run(name)
        self.repo = repo
        self.name = name

    def __repr__(self) -> str:
        return f"luopan.Run({self.name!r})"

    def record(self) -> dict[str, Any] | None:
        """The run record written by its first save, or None for a run saved before records existed."""
        try:
            return _parse(self.repo.store.get(record_key(self.name)), record_key(self.name))
        except KeyNotFound:
            return None

    def write_record(self, config: dict[str, Any] | None = None) -> bool:
        """Write the run's record if it has none (returns whether this call wrote it)."""
        return self.repo.store.put_if_absent(record_key(self.name), seal(build_record(self.name, config)))

    def log_eval(self, step: int, metrics: dict[str, Any], samples: list[Any] | None = None, *,
                 name: str = "eval", overwrite: bool = False) -> None:
        """Keep an evaluation at ``step``: its metrics and per-sample outputs (JSON values, e.g. dicts of prompt,
        output, reference, score). Written atomically; one per step unless ``overwrite``."""
        check_step(step)
        from ..format.manifest import encode_metrics

        try:
            doc = {"format_version": BASE_FORMAT_VERSION, "run": self.name, "step": step, "name": name,
                   "created": datetime.now(timezone.utc).isoformat(), "metrics": encode_metrics(metrics),
                   "samples": json.loads(canonical(list(samples or [])))}
            data = seal(doc)
        except (TypeError, ValueError) as exc:
            raise UnsupportedValueError(f"eval of run {self.name!r} step {step} must hold JSON values: {exc}") from None
        key = eval_key(self.name, step)
        if overwrite:
            self.repo.store.put(key, data)
        elif not self.repo.store.put_if_absent(key, data):
            raise CheckpointExistsError(f"run {self.name!r} already has an eval at step {step}; pass overwrite=True")

    def evals(self) -> list[int]:
        prefix = f"runs/{self.name}/evals/"
        steps = []
        for key in self.repo.store.list(prefix):
            stem = key[len(prefix):].removesuffix(".json")
            if stem.isdigit() and len(stem) == 8:
                steps.append(int(stem))
        return sorted(steps)

    def eval(self, step: int) -> dict[str, Any]:
        key = eval_key(self.name, step)
        try:
            doc = _parse(self.repo.store.get(key), key)
        except KeyNotFound:
            raise CheckpointNotFoundError(f"run {self.name!r} has no eval at step {step}; it has: "
                                          f"{self.evals() or 'none'}") from None
        from ..format.manifest import decode_metrics

        doc["metrics"] = decode_metrics(doc["metrics"])
        return doc

    # -- pins (docs/format.md §9.1): pinned checkpoints are never removed by prune --------------------------------
    def pin(self, step: int, tag: str | None = None) -> None:
        """Protect checkpoint ``step`` from pruning (optionally with a tag, e.g. "release-1")."""
        check_step(step)
        if step not in self.repo.steps(self.name):
            raise CheckpointNotFoundError(f"run {self.name!r} has no checkpoint at step {step} to pin")
        if tag is not None and (not isinstance(tag, str) or not tag or len(tag) > 128):
            raise UnsupportedValueError(f"a pin tag must be a non-empty str of at most 128 characters, got {tag!r}")
        doc = {"format_version": BASE_FORMAT_VERSION, "run": self.name, "step": step, "tag": tag,
               "created": datetime.now(timezone.utc).isoformat()}
        # Shared lock: a prune in progress finishes first (it read the pins), then the checkpoint must still exist.
        with locked(self.repo.store, "shared", f"pin of {self.name} step {step}", timeout=self.repo.lock_timeout):
            if not self.repo.store.exists(manifest_key(self.name, step)):
                raise CheckpointNotFoundError(f"run {self.name!r} step {step} was pruned before it could be pinned")
            self.repo.store.put(pin_key(self.name, step), seal(doc))
        tier = getattr(self.repo, "tier", None)
        if tier is not None:  # a tiered repository: the remote copy of the checkpoint gets the pin too
            tier.pinned(self.name, step, seal(doc))

    def unpin(self, step: int) -> bool:
        """Remove the pin of ``step``; returns whether there was one."""
        check_step(step)
        key = pin_key(self.name, step)
        if not self.repo.store.exists(key):
            return False
        self.repo.store.delete(key)
        return True

    def pins(self) -> dict[int, dict[str, Any]]:
        """step -> {"tag", "created"} of every pinned checkpoint of the run."""
        prefix = f"refs/pins/{self.name}/"
        out = {}
        for key in self.repo.store.list(prefix):
            stem = key[len(prefix):].removesuffix(".json")
            if not (stem.isdigit() and len(stem) == 8):
                continue
            try:
                doc = _parse(self.repo.store.get(key), key)
            except KeyNotFound:
                continue
            out[int(stem)] = {"tag": doc.get("tag"), "created": doc.get("created")}
        return dict(sorted(out.items()))
