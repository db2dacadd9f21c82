"""Signed checkpoints (docs/format.md §9.3; keys §14): ``repo.checkpointing.sign(run, step, key)`` and
``repo.verify(..., trusted_keys=…)``.

What a signature covers is the checkpoint's *content*, not its manifest file: the run, the step, the tree, the
metrics and every entry with its chunks' BLAKE3 addresses and sizes — not where the chunks lie (pack, offset, stored
length, codec), which gc may rewrite in place. Every chunk is verified against its address on read, so a signature
over the addresses covers every byte. A signature of other content (a step deleted and saved again) is stale: it is
kept but covers nothing.
"""

from __future__ import annotations

import json
from typing import Any

import blake3

from ..errors import CorruptRepoError, LuopanError, SignatureError, UnsignedError
from ..format.canonical import canonical
from ..format.manifest import Manifest
from ..format.names import signature_key, signatures_prefix
from ..signing import SigningKey, TrustedKeys
from ..store.base import KeyNotFound, Store

FORMAT = "luopan-checkpoint-signature"
MAX_SIGNATURE_FILE = 4096
MAX_SIGNERS = 64


def _rows(rows: list[list[Any]]) -> list[list[Any]]:
    return [[r[0], r[4]] for r in rows]  # address and raw size: where a chunk lies is not content


def content_digest(m: Manifest) -> str:
    """``blake3:<hex>`` of a checkpoint's content statement (module docstring)."""
    entries = []
    for e in m.entries:
        c = {k: v for k, v in e.items() if k not in ("chunks", "delta", "xor")}
        c["chunks"] = _rows(e.get("chunks", []))
        if "delta" in e:
            d = e["delta"]
            c["delta"] = {"rows": d["rows"], "index": _rows(d["index"]), "values": _rows(d["values"])}
        if "xor" in e:  # docs/format.md §5.4: what the bytes are made of is content
            c["xor"] = {"chunks": _rows(e["xor"]["chunks"])}
        entries.append(c)
    statement = {"format": "luopan-checkpoint-content", "run": m.run, "step": m.step, "tree": m.tree,
                 "metrics": m.doc.get("metrics", {}), "entries": entries}
    return "blake3:" + blake3.blake3(canonical(statement)).hexdigest()


def signed_bytes(run: str, step: int, content: str) -> bytes:
    """The bytes a checkpoint signature signs."""
    return canonical({"format": FORMAT, "run": run, "step": step, "content": content})


def sign(store: Store, m: Manifest, key: SigningKey) -> dict[str, Any]:
    """Write ``key``'s signature of checkpoint ``m`` (replacing that key's earlier one). Returns the document."""
    content = content_digest(m)
    doc = {"format": FORMAT, "run": m.run, "step": m.step, "content": content,
           "signature": key.sign(signed_bytes(m.run, m.step, content))}
    store.put(signature_key(m.run, m.step, key.key_id.split(":", 1)[1]), json.dumps(doc, sort_keys=True).encode())
    return doc


def signatures(store: Store, run: str, step: int) -> list[dict[str, Any]]:
    """The signature documents of a checkpoint (each checked for shape; CorruptRepoError when one is damaged)."""
    out = []
    for key in sorted(store.list(signatures_prefix(run, step)))[:MAX_SIGNERS]:
        if not key.endswith(".json"):
            continue
        try:
            if store.size(key) > MAX_SIGNATURE_FILE:
                raise CorruptRepoError(f"signature file {key} is larger than any signature ({MAX_SIGNATURE_FILE} B)")
            out.append(parse_signature(store.get(key), key, run, step))
        except KeyNotFound:
            continue
    return out


def parse_signature(data: bytes, key: str, run: str, step: int) -> dict[str, Any]:
    """A checkpoint signature file, checked for shape (the signature itself is checked by ``check``)."""
    try:
        doc = json.loads(data, object_pairs_hook=_no_duplicates)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("run") != run or \
                doc.get("step") != step or not isinstance(doc.get("content"), str) or \
                not isinstance(doc.get("signature"), dict):
            raise ValueError("not a checkpoint signature of this step")
    except (ValueError, UnicodeDecodeError, TypeError, RecursionError) as exc:
        raise CorruptRepoError(f"signature file {key} is damaged ({str(exc)[:120]})") from None
    return doc


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"member {k!r} given twice")
        out[k] = v
    return out


def check(store: Store, m: Manifest, trusted: TrustedKeys) -> str:
    """The trusted key id whose signature covers checkpoint ``m``'s current content; UnsignedError when none does,
    SignatureError when a trusted key's signature of this content does not verify."""
    where = f"run {m.run!r} step {m.step}"
    content = content_digest(m)
    docs = signatures(store, m.run, m.step)
    current = [d for d in docs if d["content"] == content]
    problems: list[LuopanError] = []
    for d in current:
        try:
            return trusted.verify(signed_bytes(m.run, m.step, content), d.get("signature"), f"checkpoint {where}")
        except SignatureError as exc:  # an untrusted signer, or a bad signature: try the others, report if none
            problems.append(exc)
    if problems:
        raise problems[0]
    stale = len(docs) - len(current)
    raise UnsignedError(f"checkpoint {where} has no signature by a trusted key ({trusted.source}) of its current "
                        "content" + (f" ({stale} signature(s) of other content: it was saved again)" if stale else
                                     "") + f": sign it with `luopan sign {m.run} {m.step} --key KEY`")
