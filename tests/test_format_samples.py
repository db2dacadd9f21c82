"""Every sample JSON in docs/format.md is checked by the parser (or schema) that reads that kind of file, so the spec
cannot drift from the code again.

Samples abbreviate digests with "…" ("a3f1…", "blake3:…"): the test expands each to a well-formed value (hex padded
to its length, free text without the ellipsis), seals the sample again where it is sealed, and hands it to luopan's
own reader. A sample the test cannot attribute to a reader fails the test: a new sample must be wired in here.
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Any

import pytest

from luopan.artifact.manifest import parse_artifact_manifest
from luopan.checkpoint.runs.record import parse_eval, parse_record
from luopan.repository.pins import parse_pin
from luopan.format.canonical import canonical, seal, unseal_file
from luopan.format.config import RepoConfig
from luopan.format.index import parse_index
from luopan.format.manifest import _validator, parse_manifest, structure_fingerprint
from luopan.format.pack import HEADER, TRAILER_MAGIC, parse_trailer
from luopan.format.refs import parse_ref
from luopan.tree import unflatten
from luopan.repository.gc import parse_condemned
from luopan.repository.locks import parse_lock
from luopan.repository.tiersetup import parse_tier_config

from .conftest import ROOT

SPEC = os.path.join(ROOT, "docs", "format.md")
HEX = set("0123456789abcdef")


def samples() -> list[tuple[str, str]]:
    """(section heading, JSON text) of every ```json block of the spec."""
    text = open(SPEC, encoding="utf-8").read()
    out = []
    for m in re.finditer(r"^[ ]*```json\n(.*?)^[ ]*```", text, re.S | re.M):
        heading = re.findall(r"^#+ .*$", text[: m.start()], re.M)[-1]
        out.append((heading, m.group(1)))
    return out


def expand(value: Any, *, width: int = 64) -> Any:
    """The sample with every "…" placeholder made well-formed."""
    if isinstance(value, str):
        if "…" not in value:
            return value
        if value.startswith("blake3:"):
            return "blake3:" + "0" * 64
        head = value.split("…", 1)[0]
        if set(head) <= HEX:
            return head + "0" * (width - len(head))
        return value.replace("…", "")
    if isinstance(value, list):
        if len(value) == 7 and isinstance(value[0], str):  # a manifest chunk row: its xxh3-128 is 32 hex digits
            return [expand(v) for v in value[:6]] + [expand(value[6], width=32)]
        return [expand(v) for v in value]
    if isinstance(value, dict):
        return {expand(k): expand(v) for k, v in value.items()}
    return value


def sealed(doc: dict[str, Any]) -> bytes:
    return seal({k: v for k, v in doc.items() if k != "checksum"})


def check_manifest(doc: dict[str, Any]) -> None:
    m = parse_manifest(sealed(doc), "runs/run-a/ckpt/00000100.json", "run-a", 100)
    assert m.entries and m.tree


def check_delta_entry(entry: dict[str, Any], version: int = 2) -> None:
    """The §5.2 row-delta entry (abbreviated: one base chunk shown) against the manifest schema."""
    doc = json.loads(_sample_of("## 8."))
    doc = expand(doc)
    doc.update(format_version=version, entries=[entry], tree={"entry": 0})
    doc.pop("checksum")
    _validator()(doc)


def check_xor_entry(entry: dict[str, Any]) -> None:
    """The §5.4 XOR-delta entry, in a manifest of its packs, through the full manifest reader."""
    check_delta_entry(entry, 5)
    doc = expand(json.loads(_sample_of("## 8.")))
    doc.update(format_version=5, entries=[entry], tree={"entry": 0}, packs=[doc["packs"][0], "c" * 64])
    m = parse_manifest(sealed(doc), "runs/run-a/ckpt/00000100.json", "run-a", 100)
    assert len(m.entries[0]["xor"]["chunks"]) == len(m.entries[0]["chunks"]) == 2


def check_group_blob(blob: dict[str, Any]) -> None:
    """The §8.5 group blob, named by the §8 manifest in place of its entry 0, through the full manifest reader: the
    rebuilt entries are the manifest's own."""
    import blake3

    doc = expand(json.loads(_sample_of("## 8.")))
    raw = canonical(blob)
    entries = doc.pop("entries")
    doc.update(format_version=6, entries=entries[1:], fingerprint=structure_fingerprint(entries),
               groups=[[blake3.blake3(raw).hexdigest(), 0, 16, len(raw), len(raw), "none", "0" * 32]])
    m = parse_manifest(sealed(doc), "runs/run-a/ckpt/00000100.json", "run-a", 100, lambda _pack, _row: raw)
    assert m.entries == entries


def check_typed_nodes(nodes: list[dict[str, Any]]) -> None:
    """Each §8.3 node, inside a manifest's tree, through the manifest reader and the tree builder."""
    doc = expand(json.loads(_sample_of("## 8.")))
    doc.update(format_version=3, tree={"list": nodes})
    m = parse_manifest(sealed(doc), "runs/run-a/ckpt/00000100.json", "run-a", 100)
    values = unflatten(m.tree, lambda i: f"<entry {i}>", "the spec's sample")
    assert len(values) == len(nodes) and values[6] == {"q_proj", "v_proj"} and values[11]["weights"] == "<entry 0>"


def check_dcp_member(doc: dict[str, Any]) -> None:
    """The §8.4 ``dcp`` member, through luopan.dcp's decoder: DCP's Metadata and the item -> entry map."""
    from luopan.dcp.layout import decode_metadata

    metadata, storage = decode_metadata(doc, "the spec's sample")
    assert list(metadata.state_dict_metadata["emb"].size) == [64, 32] and len(storage) == 3


def check_pack(trailer: dict[str, Any]) -> None:
    blob = trailer["blobs"][0]
    body = bytes(blob["length"])
    t = canonical(trailer)
    data = HEADER + body + t + struct.pack("<Q", len(t)) + TRAILER_MAGIC
    _pid, blobs = parse_trailer(data[:16], data[-(len(t) + 12):], len(data))
    assert blobs == trailer["blobs"]


def check_tier_record(doc: dict[str, Any], members: dict[str, type | tuple[type, ...]]) -> None:
    got = unseal_file(sealed(doc), "tier record")
    for name, types in members.items():
        assert isinstance(got.get(name), types), (name, got)


def _sample_of(prefix: str) -> str:
    return next(text for heading, text in samples() if heading.startswith(prefix))


def reader(heading: str, doc: dict[str, Any]) -> Any:
    """The check for a sample, from its section and members."""
    if heading.startswith("## 3."):
        return lambda d: RepoConfig.from_bytes(sealed(d), "luopan.json")
    if heading.startswith("### 5.2"):
        return check_delta_entry
    if heading.startswith("### 5.4"):
        return check_xor_entry
    if heading.startswith("## 6."):
        return check_pack
    if heading.startswith("## 7."):
        return lambda d: parse_index(sealed(d), "index/x.json")
    if heading.startswith("## 8."):
        return check_manifest
    if heading.startswith("### 8.4"):
        return check_dcp_member
    if heading.startswith("### 8.5"):
        return check_group_blob
    if heading.startswith("### 8.3"):
        return check_typed_nodes
    if heading.startswith("#### 8.2.1"):
        from luopan.artifact.worktree import parse_checkout_record

        return lambda d: parse_checkout_record(sealed(d), "co/.luopan-checkout.json")
    if heading.startswith("### 8.2"):
        return lambda d: parse_artifact_manifest(sealed(d), "artifacts/datasets/clean/_v/00000002.json",
                                                 "datasets/clean", 2)
    if heading.startswith("### 8.1"):
        if "argv" in doc:
            return lambda d: parse_record(sealed(d), "runs/run-a/record.json", "run-a")
        if "samples" in doc:
            return lambda d: parse_eval(sealed(d), "runs/run-a/evals/00000100.json", "run-a", 100)
    if heading.startswith("## 9."):
        return lambda d: parse_ref(sealed(d), "refs/runs/run-a/latest.json")
    if heading.startswith("### 9.1"):
        return lambda d: parse_pin(sealed(d), "refs/pins/run-a/00000100.json", "run-a", 100)
    if heading.startswith("### 9.3"):
        from luopan.checkpoint.signatures import parse_signature

        return lambda d: parse_signature(json.dumps(d).encode(), "refs/signatures/run-a/00000100/x.json", "run-a",
                                         100)
    if heading.startswith("## 14."):
        return check_signature_object
    if heading.startswith("### 9.4"):
        from luopan.repository.links import link_key_tail, parse_link

        def check_link(d: dict) -> None:
            got = parse_link(sealed(d), "refs/links/run-a/00000100/" + link_key_tail(d["input"]) + ".json")
            assert (got["input"], got["ref"], got["kind"]) == ("datasets/train@2", "run-a@100", "checkpoint")

        return check_link
    if heading.startswith("### 9.2"):
        return lambda d: parse_lock("locks/shared-0123456789abcdef.json", sealed(d))
    if heading.startswith("### 10.2"):
        if "replicate_to" in doc or "cold" in doc and isinstance(doc["cold"], dict):
            return lambda d: parse_tier_config(sealed(d), "tier/config.json")
        if "replicating_pid" in doc or "started" in doc:
            return lambda d: check_tier_record(d, {"run": str, "step": int, "created": str, "replicating_pid": int})
        if "manifest_checksum" in doc:
            return lambda d: check_tier_record(d, {"run": str, "step": int, "manifest_checksum": str,
                                                   "remote": str, "replicated": str})
        if "moved" in doc:
            return lambda d: check_tier_record(d, {"run": str, "step": int, "moved": str, "cold": str})
    if heading.startswith("### 10.3"):
        return lambda d: parse_condemned(sealed(d))
    if heading.startswith("### 10.5"):
        return check_ranks_member
    if heading.startswith("### 13.2"):
        return check_patch_header
    if heading.startswith("### 16.3"):
        from luopan.journal.manifest import parse_snapshot_manifest

        return lambda d: parse_snapshot_manifest(sealed(d), "journals/agent/_v/00000101.json", "agent", 101)
    if heading.startswith(("### 17.2", "### 17.7")):
        from luopan.index.manifest import parse_index_manifest

        return lambda d: parse_index_manifest(sealed(d), "indexes/kb-main/_v/00000002.json", "kb-main", 2)
    if heading.startswith("### 17.4"):
        from luopan.index.manifest import parse_current

        return lambda d: parse_current(sealed(d), "refs/indexes/kb-main/current.json", "kb-main")
    if heading.startswith("### 19.2"):
        from luopan.sync.index import parse_index as parse_sync_index

        def check_sync_index(d: dict) -> None:
            got = parse_sync_index(canonical(d), "index.json")  # canonical JSON, as the parser requires
            assert got.latest.version == d["version"] == 9

        return check_sync_index
    if heading.startswith(("## 15.", "### 15.")):
        from luopan.channel.index import parse_index as parse_channel_index
        from luopan.channel.state import parse_state

        if doc.get("format") == "luopan-channel-index":  # canonical JSON, as the parser requires
            return lambda d: parse_channel_index(canonical(d), "index.json")
        if doc.get("format") == "luopan-channel-state":
            return lambda d: parse_state(sealed(d))
    return None


def check_patch_header(doc: dict[str, Any]) -> None:
    """The §13.2 header through the patch reader, with its target fingerprint recomputed over the expanded hashes,
    then as a whole patch file (prefix, header, a body of the declared length) through the container reader."""
    import tempfile

    from luopan.patch.container import open_patch, prefix_bytes
    from luopan.patch.fingerprint import content_fingerprint
    from luopan.patch.header import parse_header

    doc["target"]["fingerprint"] = content_fingerprint(
        doc["chunk_size"], ((t["name"], t["dtype"], t["shape"], [h for h, _s in t["chunks"]]) for t in doc["tensors"]))
    header = canonical(doc)
    got = parse_header(header, "update.lpatch")
    assert [t.name for t in got.tensors] == [t["name"] for t in doc["tensors"]] and len(got.blobs) == 2
    with tempfile.NamedTemporaryFile() as f:
        f.write(prefix_bytes(header, b"") + header + bytes(doc["body_bytes"]))
        f.flush()
        with open_patch(f.name) as pf:
            assert parse_header(pf.header_bytes, pf.path).body_bytes == doc["body_bytes"] and pf.signature is None


def check_signature_object(doc: dict[str, Any]) -> None:
    """The §14 signature object: the members a real signature has, and a shape the verifier accepts (its placeholder
    ``sig`` then fails to verify, rather than being refused as malformed)."""
    import pytest
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from luopan.errors import SignatureError
    from luopan.signing import SigningKey, TrustedKeys

    private = Ed25519PrivateKey.generate()
    assert set(SigningKey(private, doc["key_id"]).sign(b"data")) == set(doc)
    trusted = TrustedKeys({doc["key_id"]: private.public_key()}, "the sample's key")
    with pytest.raises(SignatureError, match="does not verify"):
        trusted.verify(b"data", doc, "the sample")


def check_ranks_member(doc: dict[str, Any]) -> None:
    """A manifest's ``ranks`` member, checked by the reader against entries shaped as its chunks say."""
    import types

    from luopan.checkpoint.distributed.ranks import parse_ranks

    entries = [{"path": f"e{i}", "kind": "torch", "dtype": "float32", "shape": [1]} for i in range(10)]
    for rec in doc["sharded"].values():
        for _offsets, sizes, entry, _ranks in rec["chunks"]:
            entries[entry]["shape"] = sizes
    got = parse_ranks(types.SimpleNamespace(doc={"ranks": doc}, entries=entries, run="run-a", step=100))
    assert got.world == doc["world"]


SAMPLES = samples()


def test_the_spec_has_a_sample_of_every_file():
    headings = [h for h, _t in SAMPLES]
    for section in ("## 3.", "### 5.2", "## 6.", "## 7.", "## 8.", "### 8.1", "### 8.2", "### 8.3", "### 8.4", "## 9.", "### 9.1", "### 9.2", "### 9.3", "### 9.4",
                    "### 10.2", "### 10.3", "### 10.5", "### 13.2",
                    "### 15.2", "### 15.4", "### 16.3", "### 17.2", "### 17.4", "### 17.7", "### 19.2"):
        assert any(h.startswith(section) for h in headings), f"no sample JSON in {section}"
    assert sum(h.startswith("### 8.1") for h in headings) == 2  # record and eval
    assert sum(h.startswith("### 10.2") for h in headings) == 4  # tier config, pending, replicated, cold


@pytest.mark.parametrize("heading,text", SAMPLES, ids=[f"{i}:{h[:40]}" for i, (h, _t) in enumerate(SAMPLES)])
def test_every_sample_is_read_by_its_parser(heading, text):
    doc = json.loads(text)  # a sample is valid JSON
    check = reader(heading, doc)
    assert check is not None, f"no reader for the sample in {heading!r}: wire it into tests/test_format_samples.py"
    check(expand(doc))
