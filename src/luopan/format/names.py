"""Names (runs, artifacts, steps, tags, key paths) and every store key luopan builds or parses (docs/format.md §2)."""

from __future__ import annotations

import numbers
import re
import unicodedata

from ..errors import InvalidNameError

# Every name check is a *full* match: `re.match` with `$` accepts a final newline ("exp-1\n"), which then names a
# directory no reader finds. Patterns here have no anchors; callers use `fullmatch` (`is_run_name`, `is_hex64`).
RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)
HEX64_RE = re.compile(r"[0-9a-f]{64}", re.ASCII)
MAX_STEP = 10**15 - 1
MANIFEST_SUFFIX = ".json"
MAX_TAG_CHARS = 128


def is_run_name(name: object) -> bool:
    # ".tmp-" marks temporary files (docs/format.md §2): a run named so would be skipped by listings
    return isinstance(name, str) and RUN_RE.fullmatch(name) is not None and ".tmp-" not in name


def is_hex64(text: object) -> bool:
    return isinstance(text, str) and HEX64_RE.fullmatch(text) is not None


def check_run(run: object) -> str:
    """The one validation of run names (docs/format.md §2), before any write: a full match, so no newline, NUL,
    path separator, '..' or non-ASCII lookalike can reach a key."""
    if not is_run_name(run):
        shown = repr(run) if not isinstance(run, str) or len(run) <= 80 else repr(run[:80]) + f"… ({len(run)} chars)"
        raise InvalidNameError(
            f"invalid run name {shown}: use 1-128 characters from ASCII letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, without '.tmp-' (e.g. 'llama-lora-r16')"
        )
    return run


def check_step(step: object) -> int:
    """A step is an integer 0 ≤ step ≤ MAX_STEP (NumPy and torch integer scalars too); bools and floats are not."""
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):  # NumPy's bool is not Integral
        value = int(step)
        if 0 <= value <= MAX_STEP:
            return value
    elif hasattr(step, "item") and getattr(step, "ndim", None) == 0 and not getattr(step, "is_floating_point",
                                                                                       lambda: True)():
        return check_step(step.item())  # a 0-d integer tensor
    shown = repr(step) if len(repr(step)) <= 40 else repr(step)[:40] + "…"
    raise InvalidNameError(f"invalid step {shown}: use an integer from 0 to {MAX_STEP}")


def check_tag(tag: object) -> str:
    """A pin tag: 1-128 printable characters (no control characters, no lone surrogates), e.g. 'release-1'."""
    if (not isinstance(tag, str) or not 0 < len(tag) <= MAX_TAG_CHARS or not tag.isprintable()
            or any(unicodedata.category(c) == "Cs" for c in tag)):
        shown = repr(tag) if not isinstance(tag, str) or len(tag) <= 80 else repr(tag[:80]) + "…"
        raise InvalidNameError(f"invalid tag {shown}: use 1-{MAX_TAG_CHARS} printable characters, e.g. 'release-1'")
    return tag


def manifest_key(run: str, step: int) -> str:
    return f"runs/{run}/ckpt/{step:08d}{MANIFEST_SUFFIX}"


def manifest_prefix(run: str) -> str:
    return f"runs/{run}/ckpt/"


def step_from_manifest_key(key: str) -> int | None:
    name = key.rsplit("/", 1)[-1]
    if not name.endswith(MANIFEST_SUFFIX):
        return None
    digits = name[: -len(MANIFEST_SUFFIX)]
    if not (digits.isascii() and digits.isdigit()) or len(digits) > len(str(MAX_STEP)):
        return None
    step = int(digits)
    if step > MAX_STEP:
        return None
    return step if digits == f"{step:08d}" else None  # only the canonical name of a step counts


def latest_ref_key(run: str) -> str:
    return f"refs/runs/{run}/latest.json"


def record_key(run: str) -> str:
    return f"runs/{run}/record.json"


def eval_key(run: str, step: int) -> str:
    return f"runs/{run}/evals/{step:08d}.json"


def pin_key(run: str, step: int) -> str:
    return f"refs/pins/{run}/{step:08d}.json"


def signatures_prefix(run: str, step: int) -> str:
    return f"refs/signatures/{run}/{step:08d}/"


def signature_key(run: str, step: int, key_hex: str) -> str:
    """One signer's signature of a checkpoint (docs/format.md §9.3); ``key_hex`` is the hex part of its key id."""
    if len(key_hex) != 32 or any(c not in "0123456789abcdef" for c in key_hex):
        raise InvalidNameError(f"invalid key id hex {key_hex[:40]!r}")
    return f"{signatures_prefix(run, step)}{key_hex}.json"


# -- artifacts (docs/format.md §2): names are run names joined by "/"; "_v" and "_artifacts" cannot be one --------
ARTIFACTS = "artifacts/"
ARTIFACT_VERSIONS = "_v"
ARTIFACT_PINS = "refs/pins/_artifacts/"
MAX_ARTIFACT_NAME = 256
MAX_ARTIFACT_PARTS = 8  # the deepest key is then 12 components (refs/pins/_artifacts/<8 parts>/<v>.json), within a walk


def is_artifact_name(name: object) -> bool:
    return (isinstance(name, str) and 0 < len(name) <= MAX_ARTIFACT_NAME
            and 0 < name.count("/") + 1 <= MAX_ARTIFACT_PARTS and all(is_run_name(part) for part in name.split("/")))


def check_artifact(name: object) -> str:
    """An artifact name: run names (1-128 ASCII letters, digits, '.', '_', '-', starting with a letter or digit)
    joined by '/', at most 256 characters (e.g. 'datasets/clean')."""
    if not is_artifact_name(name):
        shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else repr(name[:80]) + "…"
        raise InvalidNameError(
            f"invalid artifact name {shown}: use parts of 1-128 ASCII letters, digits, '.', '_' and '-' (each starting "
            f"with a letter or digit, without '.tmp-') joined by '/', at most {MAX_ARTIFACT_PARTS} parts and "
            f"{MAX_ARTIFACT_NAME} characters (e.g. 'datasets/clean')")
    return name  # type: ignore[return-value]


# -- file paths inside a manifest (artifact files; docs/format.md §2): the one rule, for writers and readers ---------
MAX_PATH_CHARS = 4096
# C0 controls (NUL, tab, newline, ESC…), DEL, C1 controls, the backslash, the line and paragraph separators, and lone
# surrogates (what Python makes of a file name that is not UTF-8)
_BAD_PATH_CHAR = re.compile(r"[\x00-\x1f\x7f-\x9f\\\u2028\u2029\ud800-\udfff]")


def path_problem(path: object, max_chars: int = MAX_PATH_CHARS) -> str | None:
    """Why ``path`` cannot be a file path inside a manifest (None when it can). The one rule for file names of every
    kind, checked by writers before anything is written and by every reader of a manifest: 1 to 4096 characters of
    '/'-separated parts, none of them empty, '.' or '..' (so never absolute), without a backslash, a control character
    (C0, DEL, C1: NUL, tab, newline, ESC…), a line or paragraph separator (U+2028, U+2029) or a lone surrogate (a
    file name that is not valid UTF-8)."""
    if not isinstance(path, str):
        return f"not a string ({type(path).__name__})"
    if not path:
        return "an empty path"
    if len(path) > max_chars:
        return f"a path longer than {max_chars} characters"
    if path.startswith("/"):
        return "an absolute path"
    bad = _BAD_PATH_CHAR.search(path)
    if bad is not None:
        c = bad.group()
        if c == "\\":
            return "a path with a backslash (use '/' between directories)"
        if 0xD800 <= ord(c) <= 0xDFFF:
            return "a path that is not valid UTF-8"
        return f"a path with a control character or line break ({c!r})"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "a path with an empty, '.' or '..' part (it would escape or alias the directory)"
    return None


def show_path(path: object, limit: int = 200) -> str:
    """A path for a message: repr-escaped (a newline or ESC in it cannot break or colour the line), a name that is
    not valid UTF-8 shown as its bytes (b'\\xff…'), cut after ``limit`` characters."""
    if isinstance(path, str):
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            try:
                path = path.encode("utf-8", "surrogateescape")  # the bytes the file system gave
            except UnicodeEncodeError:
                pass  # other lone surrogates: repr shows them escaped
    text = repr(path)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def check_version(version: object) -> int:
    """An artifact version: an integer from 1 to MAX_STEP."""
    value = check_step(version)
    if value == 0:
        raise InvalidNameError("invalid artifact version 0: versions count from 1")
    return value


def artifact_manifest_key(name: str, version: int) -> str:
    return f"{ARTIFACTS}{name}/{ARTIFACT_VERSIONS}/{version:08d}{MANIFEST_SUFFIX}"


def artifact_pin_key(name: str, version: int) -> str:
    return f"{ARTIFACT_PINS}{name}/{version:08d}.json"


def parse_ref_text(text: object, what: str = "reference") -> tuple[str, int]:
    """'NAME@N' -> (NAME, N); InvalidNameError naming the expected form otherwise."""
    if not isinstance(text, str) or text.count("@") != 1:
        raise InvalidNameError(f"invalid {what} {text!r}: use NAME@NUMBER, e.g. 'datasets/clean@2' or 'run-a@100'")
    name, _, number = text.partition("@")
    if not (number.isascii() and number.isdigit()):
        raise InvalidNameError(f"invalid {what} {text!r}: the part after '@' must be a number")
    return name, int(number)


# -- tier markers (docs/format.md §10.2): tier/<state>/<marker><series>/<number:08d>.json --------------------------
def tier_marker_key(state: str, marker: str, series: str, number: int) -> str:
    return f"tier/{state}/{marker}{series}/{number:08d}.json"


TIER_CONFIG_KEY = "tier/config.json"  # a tiered repository's recorded remote and cold policy


def pending_key(run: str, step: int) -> str:  # the checkpoint kind's markers (its marker prefix is "")
    return tier_marker_key("pending", "", run, step)


def replicated_key(run: str, step: int) -> str:
    return tier_marker_key("replicated", "", run, step)


def cold_key(run: str, step: int) -> str:
    return tier_marker_key("cold", "", run, step)


CONFIG_KEY = "luopan.json"  # the repository config (docs/format.md §3)
LOCK_PREFIX = "locks/"  # lock records and waiting markers (§9.2)
LOCK_NAME = re.compile(r"locks/(shared|exclusive|waiting)-[0-9a-f]{16}\.json", re.ASCII)
CONDEMNED_KEY = "gc/condemned.json"  # gc's record of unreferenced packs and since when (docs/format.md §10.3)


def lock_key(kind: str, lock_id: str) -> str:
    """``locks/<shared|exclusive|waiting>-<16 hex>.json``."""
    return f"{LOCK_PREFIX}{kind}-{lock_id}.json"


def eval_prefix(run: str) -> str:
    return f"runs/{run}/evals/"


def pack_key(pack_id: str) -> str:
    if not is_hex64(pack_id):
        raise InvalidNameError(f"invalid pack id {pack_id!r}")
    return f"packs/{pack_id[:2]}/{pack_id}.pack"


def index_key(index_id: str) -> str:
    return f"index/{index_id}.json"


def is_index_key(key: str) -> bool:
    """``index/<64 hex>.json``: the only keys under index/ that are index files (others are strays)."""
    return key.startswith("index/") and key.endswith(".json") and is_hex64(key[len("index/"):-len(".json")])


def is_pack_key(key: str) -> bool:
    """``packs/<2 hex>/<64 hex>.pack`` with the directory matching the id."""
    name = key.rsplit("/", 1)[-1]
    return name.endswith(".pack") and is_hex64(name[:-5]) and key == f"packs/{name[:2]}/{name}"


def escape_key(key: str | int) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def join_path(parent: str, key: str | int) -> str:
    part = escape_key(key)
    return f"{parent}/{part}" if parent else part
