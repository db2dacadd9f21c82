"""Run records and eval logs (docs/format.md §8.1): what a run was, and what it produced besides checkpoints.

A run's record is written once, by its first save: the config the user passes, ``sys.argv``, package versions,
Python and OS, the git commit with the full diff of a dirty work tree, and the environment with secrets redacted.
Eval results keep per-sample outputs, not just scores: ``repo.run("run-a").log_eval(step, metrics, samples=[...])``.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import subprocess
import sys
import threading
from datetime import datetime, timezone
from importlib import metadata as importlib_metadata
from typing import Any

from ...errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptRepoError,
    IntegrityError,
    StorageError,
    UnsupportedFormatError,
    UnsupportedValueError,
)
from ...format import BASE_FORMAT_VERSION
from ...format.canonical import canonical, seal, unseal_file
from ...format.limits import MAX_EVAL_BYTES, MAX_RECORD_BYTES, MAX_SMALL_BYTES
from ...format.manifest import decode_metrics, encode_metrics
from ...format.names import check_run, check_step, eval_key, eval_prefix, latest_ref_key, record_key
from ...format.refs import parse_ref
from ..base import CheckpointBase
from ...repository.pins import (
    add_pin,
    check_step_field,
    pin_problems,
    read_pins,
    remove_pin,
    require_members,
)
from ...repository.verify import as_problem
from ...store.base import KeyNotFound
from ..kind import CHECKPOINTS

SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")
PACKAGES = ("luopan", "torch", "numpy", "safetensors", "transformers", "accelerate", "deepspeed", "lightning")
MAX_DIFF_BYTES = 16 << 20  # a larger diff is cut (and says so): records stay loadable


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
    """Versions of the PACKAGES installed (read once per process: ~11 ms of metadata parsing each time)."""
    return dict(_packages())


@functools.lru_cache(maxsize=1)
def _packages() -> tuple[tuple[str, str], ...]:
    out = []
    for name in PACKAGES:
        try:
            out.append((name, importlib_metadata.version(name)))
        except importlib_metadata.PackageNotFoundError:
            continue
    return tuple(out)


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




def parse_record(data: bytes, where: str, run: str | None = None) -> dict[str, Any]:
    """A run record (docs/format.md §8.1), checked; CorruptRepoError on damage."""
    doc = unseal_file(data, where)
    require_members(doc, where, run=(str,), created=(str,), argv=(list,), cwd=(str,), python=(str,), platform=(str,),
             packages=(dict,), environment=(dict,), config=(dict, type(None)), git=(dict, type(None)))
    if run is not None and doc["run"] != run:
        raise CorruptRepoError(f"{where} is damaged: it is the record of run {doc['run']!r}")
    if not all(isinstance(a, str) for a in doc["argv"]) or not all(
            isinstance(v, str) for d in (doc["packages"], doc["environment"]) for v in d.values()):
        raise CorruptRepoError(f"{where} is damaged: argv, packages and environment must hold strings")
    git = doc.get("git")
    if git is not None:
        require_members(git, where, commit=(str,), dirty=(bool,), diff=(str,), untracked_files=(list,))
    return doc


def parse_eval(data: bytes, where: str, run: str | None = None, step: int | None = None) -> dict[str, Any]:
    """An eval log (docs/format.md §8.1), checked; its metrics are decoded (NaN/±inf restored)."""
    doc = unseal_file(data, where)
    require_members(doc, where, run=(str,), name=(str,), created=(str,), metrics=(dict,), samples=(list,))
    check_step_field(doc, where, step)
    if run is not None and doc["run"] != run:
        raise CorruptRepoError(f"{where} is damaged: it is an eval of run {doc['run']!r}")
    doc["metrics"] = decode_metrics(doc["metrics"])
    return doc


class Run:
    """One run of a repository: its record and eval logs (checkpoints are on the Repo)."""

    def __init__(self, repo: CheckpointBase, name: str) -> None:
        check_run(name)
        self.repo = repo
        self.name = name

    def __repr__(self) -> str:
        return f"luopan.Run({self.name!r})"

    def record(self) -> dict[str, Any] | None:
        """The run record written by its first save, or None for a run saved before records existed."""
        key = record_key(self.name)
        try:
            return parse_record(self.repo.store.get_limited(key, MAX_RECORD_BYTES), key, self.name)
        except KeyNotFound:
            return None

    def write_record(self, config: dict[str, Any] | None = None) -> bool:
        """Write the run's record if it has none (returns whether this call wrote it)."""
        return self._put_record(seal(build_record(self.name, config)))

    def _put_record(self, data: bytes) -> bool:
        if len(data) > MAX_RECORD_BYTES:
            raise UnsupportedValueError(f"the record of run {self.name!r} would be {len(data)} bytes, more than "
                                        f"readers accept ({MAX_RECORD_BYTES}): pass a smaller config")
        return self.repo.store.put_if_absent(record_key(self.name), data)

    def log_eval(self, step: int, metrics: dict[str, Any], samples: list[Any] | None = None, *,
                 name: str = "eval", overwrite: bool = False) -> None:
        """Keep an evaluation at ``step``: its metrics and per-sample outputs (JSON values, e.g. dicts of prompt,
        output, reference, score). Written atomically; one per step unless ``overwrite``."""
        step = check_step(step)
        if not isinstance(name, str) or not name.isprintable() or not 0 < len(name) <= 128:
            raise UnsupportedValueError(f"an eval name must be 1-128 printable characters, got {name!r}")
        try:
            doc = {"format_version": BASE_FORMAT_VERSION, "run": self.name, "step": step, "name": name,
                   "created": datetime.now(timezone.utc).isoformat(), "metrics": encode_metrics(metrics),
                   "samples": json.loads(canonical(list(samples or [])))}
            data = seal(doc)
        except (TypeError, ValueError, RecursionError) as exc:
            raise UnsupportedValueError(f"eval of run {self.name!r} step {step} must hold JSON values: {exc}") from None
        if len(data) > MAX_EVAL_BYTES:
            raise UnsupportedValueError(f"eval of run {self.name!r} step {step} would be {len(data)} bytes, more than "
                                        f"readers accept ({MAX_EVAL_BYTES}): keep fewer or smaller samples")
        key = eval_key(self.name, step)
        if overwrite:
            self.repo.store.put(key, data)
        elif not self.repo.store.put_if_absent(key, data):
            raise CheckpointExistsError(f"run {self.name!r} already has an eval at step {step}; pass overwrite=True")

    def evals(self) -> list[int]:
        return [step for _key, step in self._step_files(eval_prefix(self.name))]

    def eval(self, step: int) -> dict[str, Any]:
        step = check_step(step)
        key = eval_key(self.name, step)
        try:
            return parse_eval(self.repo.store.get_limited(key, MAX_EVAL_BYTES), key, self.name, step)
        except KeyNotFound:
            raise CheckpointNotFoundError(f"run {self.name!r} has no eval at step {step}; it has: "
                                          f"{self.evals() or 'none'}") from None

    # -- lineage (docs/format.md §8.2, §9.4) -----------------------------------------------------------------------
    def link_inputs(self, step: int, inputs: list[str]) -> list[str]:
        """Record ``inputs`` (artifact versions or checkpoints, "NAME@V") as what checkpoint ``step`` was made from,
        after it was saved — as ``repo.save(..., inputs=...)`` would have, without rewriting its manifest (a link file
        beside it, docs/format.md §9.4; ``luopan lineage link RUN@STEP NAME@V``). ``repo.repository.lineage`` and
        ``luopan lineage`` then list them with the manifest's own inputs. Returns the inputs newly linked: linking one
        again, or one the manifest already names, changes nothing. CheckpointNotFoundError when the checkpoint does
        not exist, ManifestNotFoundError when an input does not (nothing written). ``luopan gc`` drops the links of
        a removed checkpoint."""
        step = check_step(step)
        if not self.repo.store.exists(CHECKPOINTS.manifest_key(self.name, step)):
            raise CheckpointNotFoundError(f"run {self.name!r} has no checkpoint at step {step}, so no input can be "
                                          f"linked to it (see `luopan ls {self.name}`)")
        return self.repo.repository.link_inputs(CHECKPOINTS, self.name, step, inputs)

    # -- pins (docs/format.md §9.1): pinned checkpoints are never removed by prune --------------------------------
    def pin(self, step: int, tag: str | None = None) -> None:
        """Protect checkpoint ``step`` from pruning (optionally with a tag, e.g. "release-1")."""
        add_pin(self.repo, CHECKPOINTS, self.name, step, tag, CheckpointNotFoundError)

    def unpin(self, step: int) -> bool:
        """Remove the pin of ``step``; returns whether there was one."""
        return remove_pin(self.repo.store, CHECKPOINTS, self.name, step)

    def pins(self) -> dict[int, dict[str, Any]]:
        """step -> {"tag", "created"} of every pinned checkpoint of the run. A pin that cannot be read raises
        (CorruptRepoError, StorageError): prune must never proceed without knowing every pin."""
        return read_pins(self.repo.store, CHECKPOINTS, self.name)

    def _step_files(self, prefix: str) -> list[tuple[str, int]]:
        """(key, step) of the ``<step:08d>.json`` files under ``prefix`` (other names are not luopan's)."""
        out = []
        for key in self.repo.store.list(prefix):
            stem = key[len(prefix):].removesuffix(".json")
            if key.endswith(".json") and stem.isascii() and stem.isdigit() and len(stem) == 8:
                out.append((key, int(stem)))
        return sorted(out, key=lambda kv: kv[1])

    def problems(self) -> list[Exception]:
        """Every damaged or unreadable file of the run besides its manifests: record, eval logs, pins and latest
        ref (for ``verify``)."""
        store = self.repo.store
        found: list[Exception] = []
        checks = [(record_key(self.name), MAX_RECORD_BYTES, lambda d, k: parse_record(d, k, self.name))]
        checks += [(k, MAX_EVAL_BYTES, lambda d, k, s=s: parse_eval(d, k, self.name, s))
                   for k, s in self._step_files(eval_prefix(self.name))]
        checks.append((latest_ref_key(self.name), MAX_SMALL_BYTES, parse_ref))
        for key, limit, parse in checks:
            try:
                parse(store.get_limited(key, limit), key)
            except KeyNotFound:
                continue
            except (IntegrityError, UnsupportedFormatError, StorageError) as exc:
                found.append(as_problem(exc))
        found += pin_problems(store, CHECKPOINTS, self.name)
        return found


class RecordWriter:
    """A run's record built on a background thread from the start (its git state and package versions cost ~20 ms of
    subprocesses and file reads, 10% of saving 256 MiB to a fresh repository here), written by ``write()``: the
    first save of a run starts one before writing its chunks and writes it afterwards."""

    def __init__(self, run: Run, config: dict[str, Any] | None = None) -> None:
        self.run = run
        self._data: bytes | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._build, args=(config,), name="luopan-record", daemon=True)
        self._thread.start()

    def _build(self, config: dict[str, Any] | None) -> None:
        try:
            self._data = seal(build_record(self.run.name, config))
        except BaseException as exc:  # noqa: BLE001 - raised by write(), on the saving thread
            self._error = exc

    def write(self) -> bool:
        """Write the record if the run has none (returns whether this call wrote it); raises what building it raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._data is not None
        return self.run._put_record(self._data)
