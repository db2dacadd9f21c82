"""Run names, steps, key paths and the store keys derived from them (docs/format.md §2)."""

from __future__ import annotations

import re

from ..errors import InvalidNameError

RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
HEX64_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_STEP = 10**15 - 1
MANIFEST_SUFFIX = ".json"


def check_run(run: object) -> str:
    if not isinstance(run, str) or not RUN_RE.match(run):
        raise InvalidNameError(
            f"invalid run name {run!r}: use 1-128 characters from letters, digits, '.', '_' and '-', "
            "starting with a letter or digit (e.g. 'llama-lora-r16')"
        )
    return run


def check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise InvalidNameError(f"invalid step {step!r}: use an integer from 0 to {MAX_STEP}")
    return step


def manifest_key(run: str, step: int) -> str:
    return f"runs/{run}/ckpt/{step:08d}{MANIFEST_SUFFIX}"


def manifest_prefix(run: str) -> str:
    return f"runs/{run}/ckpt/"


def step_from_manifest_key(key: str) -> int | None:
    name = key.rsplit("/", 1)[-1]
    if not name.endswith(MANIFEST_SUFFIX):
        return None
    digits = name[: -len(MANIFEST_SUFFIX)]
    if not (digits.isascii() and digits.isdigit()):
        return None
    step = int(digits)
    return step if digits == f"{step:08d}" else None  # only the canonical name of a step counts


def latest_ref_key(run: str) -> str:
    return f"refs/runs/{run}/latest.json"


def pack_key(pack_id: str) -> str:
    if not HEX64_RE.match(pack_id):
        raise ValueError(f"invalid pack id {pack_id!r}")
    return f"packs/{pack_id[:2]}/{pack_id}.pack"


def index_key(index_id: str) -> str:
    return f"index/{index_id}.json"


def escape_key(key: str | int) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def join_path(parent: str, key: str | int) -> str:
    part = escape_key(key)
    return f"{parent}/{part}" if parent else part
