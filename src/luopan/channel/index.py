"""A channel's ``index.json`` (docs/format.md §15.1): the signed list of published versions, the patches to the
newest one and the files to download. Built canonical by the publisher; parsed by devices as hostile input — its
size, nesting, duplicate members, canonical form, every member's type and range and every file name are checked
before anything is sized or named by it. The signature is checked by luopan.channel.trust, not here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ..errors import CorruptChannelIndexError, UnsupportedFormatError
from ..format.canonical import SealError, canonical, parse_object
from ..format.names import MAX_STEP, is_hex64, is_run_name
from ..signing import SigningKey

INDEX_NAME = "index.json"
FORMAT = "luopan-channel-index"
FORMAT_VERSION = 1
MAX_INDEX_BYTES = 1 << 20  # ~350 bytes per version and per patch: 1 MiB holds far more than MAX_VERSIONS of each
MAX_DEPTH = 4  # index → versions → version → full
MAX_VERSIONS = 1024  # publish keeps at most MAX_KEEP + 1 (luopan.channel.publish)
MAX_PATCHES = 1024
MAX_FILE_BYTES = 1 << 42  # 4 TiB: beyond any model file; a larger declared size is hostile
MAX_INDEX_VERSION = MAX_STEP
MIN_CHUNK, MAX_CHUNK = 4096, 1 << 30  # a repository's chunk_size range (§3)
MEMBERS = {"channel", "chunk_size", "created", "expires", "format", "format_version", "patches", "signature",
           "subtree", "version", "versions"}
VERSION_MEMBERS = {"fingerprint", "full", "run", "step", "version"}
PATCH_MEMBERS = {"blake3", "from", "name", "size", "to"}
FILE_MEMBERS = {"blake3", "name", "size"}
SIGNATURE_MEMBERS = {"alg", "key_id", "sig"}
# A file name is one or two path parts of safe URL characters: no '..', no leading '.', '/', '\' or '%', so the
# same name is a safe relative path on any file system and a URL path that needs no escaping.
NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_-][A-Za-z0-9._-]{0,127})?", re.ASCII)
TIME_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", re.ASCII)
FINGERPRINT_RE = re.compile(r"blake3:[0-9a-f]{64}", re.ASCII)
# A string token, or one bracket. An unterminated string runs to the end of the text (its closing quote is
# optional), so a match never fails once begun: the scan is one linear pass whatever the input (a pattern needing the
# closing quote retried from every quote of an unterminated string: quadratic, minutes for 1 MiB of '\\"').
_TOKENS = re.compile(rb'"(?:[^"\\]+|\\.)*"?|[\[\]{}]', re.S)


@dataclass(frozen=True)
class FileRef:
    """A file of the channel: its name (relative to the channel's root), size and BLAKE3 (hex)."""

    name: str
    size: int
    blake3: str


@dataclass(frozen=True)
class ChannelVersion:
    """A published version: the checkpoint it was made from, its content fingerprint, its full safetensors file."""

    version: int
    run: str
    step: int
    fingerprint: str
    full: FileRef


@dataclass(frozen=True)
class PatchRef:
    """A patch file from version ``source`` to version ``target`` (the newest)."""

    source: int
    target: int
    file: FileRef


@dataclass(frozen=True)
class ChannelIndex:
    channel: str
    version: int  # of the index itself: the previous index's + 1, never reused
    created: str
    expires: str
    chunk_size: int  # the chunk size of every content fingerprint here (docs/format.md §13)
    subtree: str | None
    versions: tuple[ChannelVersion, ...]  # oldest first; the last is the newest
    patches: tuple[PatchRef, ...]
    signature: dict[str, str] | None

    @property
    def latest(self) -> ChannelVersion:
        return self.versions[-1]

    @property
    def expires_at(self) -> float:
        return parse_time(self.expires)

    def find(self, fingerprint: str) -> ChannelVersion | None:
        """The newest listed version with this content fingerprint."""
        return next((v for v in reversed(self.versions) if v.fingerprint == fingerprint), None)

    def patch_from(self, version: int) -> PatchRef | None:
        """The smallest patch from ``version`` to the newest."""
        found = [p for p in self.patches if p.source == version and p.target == self.latest.version]
        return min(found, key=lambda p: p.file.size, default=None)

    def files(self) -> list[FileRef]:
        return [v.full for v in self.versions] + [p.file for p in self.patches]

    def to_doc(self) -> dict[str, Any]:
        """The index as JSON members, without the signature."""
        return {
            "channel": self.channel, "chunk_size": self.chunk_size, "created": self.created, "expires": self.expires,
            "format": FORMAT, "format_version": FORMAT_VERSION, "subtree": self.subtree, "version": self.version,
            "versions": [{"fingerprint": v.fingerprint, "full": _file_doc(v.full), "run": v.run, "step": v.step,
                          "version": v.version} for v in self.versions],
            "patches": [{**_file_doc(p.file), "from": p.source, "to": p.target} for p in self.patches],
        }

    def signed_bytes(self) -> bytes:
        """What the index's signature signs: the canonical JSON of every member but ``signature``."""
        return canonical(self.to_doc())


def _file_doc(f: FileRef) -> dict[str, Any]:
    return {"blake3": f.blake3, "name": f.name, "size": f.size}


def format_time(t: float) -> str:
    return datetime.fromtimestamp(int(t), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def encode_index(index: ChannelIndex, key: SigningKey) -> bytes:
    """The index file's bytes: its canonical JSON with ``key``'s signature over the rest. The result is parsed back
    (so the publisher never writes what devices refuse)."""
    data = canonical({**index.to_doc(), "signature": key.sign(index.signed_bytes())})
    parse_index(data)
    return data


def parse_index(data: bytes, where: str = INDEX_NAME) -> ChannelIndex:
    """The index in ``data``, every member checked (module docstring); CorruptChannelIndexError naming ``where`` and
    the problem, UnsupportedFormatError for a newer format_version. The signature is only checked for shape."""
    return parse_signed_index(data, f"channel index {where}", FORMAT, FORMAT_VERSION, _check, "on this device")


def parse_signed_index(data: bytes, what: str, fmt: str, version: int, check: Any, who: str, *,
                       max_bytes: int = MAX_INDEX_BYTES, max_depth: int = MAX_DEPTH, after: str = "") -> Any:
    """What ``check`` makes of a signed, canonical-JSON index document of format ``fmt`` (a channel index, a
    live-sync index): size, depth, format and version checked first (CorruptChannelIndexError "``what`` is refused:
    … ``after``", UnsupportedFormatError naming ``who`` to upgrade), then ``check(doc)`` (ValueError: refused), then
    that ``data`` is the document's canonical form."""
    def bad(msg: str) -> CorruptChannelIndexError:
        return CorruptChannelIndexError(f"{what} is refused: {msg}{after}")

    if len(data) > max_bytes:
        raise bad(f"it is {len(data)} bytes, over the {max_bytes}-byte limit of any index")
    if _depth(data) > max_depth:
        raise bad(f"it is nested more than {max_depth} levels deep, as no index is")
    try:
        doc = parse_object(data)
    except SealError as exc:
        raise bad(str(exc)) from None
    if doc.get("format") != fmt:
        raise bad(f"it is not a luopan {fmt} document (format {str(doc.get('format'))[:40]!r}, expected {fmt!r})")
    fv = doc.get("format_version")
    if _is_int(fv) and fv > version:
        raise UnsupportedFormatError(f"{what} has format_version {fv}, newer than this luopan reads ({version}); "
                                     f"upgrade luopan {who}")
    try:
        index = check(doc)
        if canonical(doc) != data:
            raise ValueError("it is not in canonical JSON form (docs/format.md §4): it was not written by luopan, "
                             "or was edited")
    except ValueError as exc:
        raise bad(str(exc)) from None
    return index


def _check(doc: dict[str, Any]) -> ChannelIndex:
    _members(doc, MEMBERS, "the index", optional=frozenset({"signature"}))
    if doc["format_version"] != FORMAT_VERSION:
        raise ValueError(f"format_version {str(doc['format_version'])[:20]} is not {FORMAT_VERSION}")
    version = _int(doc["version"], "version", 1, MAX_INDEX_VERSION)
    if not is_run_name(doc["channel"]):
        raise ValueError("channel is not a name of 1-128 letters, digits, '.', '_', '-'")
    chunk = _int(doc["chunk_size"], "chunk_size", MIN_CHUNK, MAX_CHUNK)
    subtree = doc["subtree"]
    if subtree is not None and (not isinstance(subtree, str) or not 0 < len(subtree) <= 4096):
        raise ValueError("subtree is neither null nor a key path of 1-4096 characters")
    created, expires = _time(doc["created"], "created"), _time(doc["expires"], "expires")
    if parse_time(expires) <= parse_time(created):
        raise ValueError(f"it expires ({expires}) before it was created ({created})")
    sig = doc.get("signature")
    if sig is not None:
        _members(sig, SIGNATURE_MEMBERS, "signature")
        if not all(isinstance(sig[k], str) and len(sig[k]) <= 1024 for k in SIGNATURE_MEMBERS):
            raise ValueError("signature members are not strings of at most 1024 characters")
    versions = _list(doc["versions"], "versions", MAX_VERSIONS)
    if not versions:
        raise ValueError("it lists no version")
    vs = tuple(_version(v, version) for v in versions)
    if any(a.version >= b.version for a, b in zip(vs, vs[1:])):
        raise ValueError("versions are not listed in increasing order, each once")
    known = {v.version for v in vs}
    patches = tuple(_patch(p, known, vs[-1].version) for p in _list(doc["patches"], "patches", MAX_PATCHES))
    names = [f.name for f in [v.full for v in vs] + [p.file for p in patches]]
    if len(set(names)) != len(names):
        raise ValueError("two entries name the same file")
    if len({(p.source, p.target) for p in patches}) != len(patches):
        raise ValueError("two patches go between the same versions")
    return ChannelIndex(doc["channel"], version, created, expires, chunk, subtree, vs, patches, sig)


def _version(v: Any, index_version: int) -> ChannelVersion:
    _members(v, VERSION_MEMBERS, "a version")
    n = _int(v["version"], "a version's number", 1, index_version)
    if not is_run_name(v["run"]):
        raise ValueError(f"version {n}: run is not a valid run name")
    step = _int(v["step"], f"version {n}: step", 0, MAX_STEP)
    if not isinstance(v["fingerprint"], str) or not FINGERPRINT_RE.fullmatch(v["fingerprint"]):
        raise ValueError(f"version {n}: fingerprint is not 'blake3:' and 64 hex digits")
    return ChannelVersion(n, v["run"], step, v["fingerprint"], _file(v["full"], f"version {n}'s full file"))


def _patch(p: Any, known: set[int], latest: int) -> PatchRef:
    _members(p, PATCH_MEMBERS, "a patch")
    source = _int(p["from"], "a patch's from", 1, MAX_INDEX_VERSION)
    target = _int(p["to"], "a patch's to", 1, MAX_INDEX_VERSION)
    if target != latest or source not in known or source == target:
        raise ValueError(f"a patch goes from version {source} to {target}: patches go from a listed version to "
                         f"the newest ({latest})")
    return PatchRef(source, target, _file({k: p[k] for k in FILE_MEMBERS}, f"the patch {source}->{target}"))


def _file(f: Any, what: str) -> FileRef:
    _members(f, FILE_MEMBERS, what)
    name = f["name"]
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name:
        raise ValueError(f"{what} has an unsafe name {str(name)[:80]!r}: one or two path parts of letters, digits, "
                         "'.', '_', '-', not starting with '.' and without '..'")
    size = _int(f["size"], f"{what}'s size", 1, MAX_FILE_BYTES)
    if not is_hex64(f["blake3"]):
        raise ValueError(f"{what}'s blake3 is not 64 hex digits")
    return FileRef(name, size, f["blake3"])


def _members(obj: Any, members: set[str], what: str, optional: frozenset[str] = frozenset()) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{what} is not a JSON object")
    missing, extra = members - optional - set(obj), set(obj) - members
    if missing or extra:
        raise ValueError(f"{what} has members {sorted(obj)[:12]}: "
                         + (f"missing {sorted(missing)}" if missing else f"unknown {sorted(extra)[:5]}"))


def _list(obj: Any, what: str, limit: int) -> list[Any]:
    if not isinstance(obj, list):
        raise ValueError(f"{what} is not a list")
    if len(obj) > limit:
        raise ValueError(f"{what} has {len(obj)} items, over the limit of {limit}")
    return obj


def _int(x: Any, what: str, lo: int, hi: int) -> int:
    if not _is_int(x) or not lo <= x <= hi:
        raise ValueError(f"{what} is {str(x)[:30]}, not an integer from {lo} to {hi}")
    return int(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _time(x: Any, what: str) -> str:
    if not isinstance(x, str) or not TIME_RE.fullmatch(x):
        raise ValueError(f"{what} is not a UTC time written YYYY-MM-DDTHH:MM:SSZ")
    try:
        parse_time(x)
    except ValueError:
        raise ValueError(f"{what} {x!r} is not a valid date and time") from None
    return x


def _depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (strings skipped), without parsing it, in one linear
    pass (_TOKENS); it stops counting past MAX_DEPTH."""
    depth = deepest = 0
    for m in _TOKENS.finditer(data):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                break
        elif c in (b"]", b"}"):
            depth -= 1
    return deepest
