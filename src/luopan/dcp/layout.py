"""DCP's checkpoint metadata as JSON, never pickle (docs/format.md §8.4): the global layout of every tensor (its
chunks' offsets and sizes), which entries are bytes values, the planner's key mappings, and where each item's data
lives in the luopan manifest."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CorruptManifestError
from ..tree import TORCH_DTYPE_SIZES, torch_dtype_name


def index_json(index: MetadataIndex) -> list[Any]:
    return [index.fqn, None if index.offset is None else list(index.offset), index.index]


def index_of(doc: Any) -> MetadataIndex:
    fqn, offset, hint = doc
    return MetadataIndex(fqn, None if offset is None else torch.Size(offset), hint)


def encode_metadata(md: Metadata, storage: list[list[Any]]) -> dict[str, Any]:
    """The ``dcp`` member of a manifest written through luopan.dcp.Writer."""
    tensors, values = {}, []
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            values.append(fqn)
            continue
        props = item.properties
        tensors[fqn] = {"dtype": torch_dtype_name(props.dtype), "requires_grad": bool(props.requires_grad),
                        "size": list(item.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in item.chunks]}
    mappings = None
    if isinstance(md.planner_data, dict):
        mappings = [[k, list(v)] for k, v in md.planner_data.items()]
    return {"tensors": tensors, "values": values, "mappings": mappings, "storage": storage,
            "version": md.version}


def check_storage(metadata: Metadata, storage: dict[MetadataIndex, Any], entries: list[dict[str, Any]],
                  where: str) -> None:
    """Every item's data is an entry of the manifest whose shape is the item's chunk (or a JSON value): a layout that
    disagrees with the entries would make DCP read the wrong region."""
    def bad(why: str) -> CorruptManifestError:
        return CorruptManifestError(f"manifest {where}: its DCP layout is damaged: {why}")

    for index, info in storage.items():
        item = metadata.state_dict_metadata.get(index.fqn)
        if item is None or not isinstance(info, dict):
            raise bad(f"item {index.fqn!r} is not in the layout")
        if isinstance(item, BytesStorageMetadata):
            if not isinstance(info.get("value"), dict):
                raise bad(f"value {index.fqn!r} has no JSON node")
            continue
        i = info.get("entry")
        if type(i) is not int or not 0 <= i < len(entries):
            raise bad(f"item {index.fqn!r} names entry {str(i)[:20]}")
        chunk = next((c for c in item.chunks if list(c.offsets) == list(index.offset or [0] * len(item.size))), None)
        if chunk is None or list(chunk.sizes) != list(entries[i]["shape"]):
            raise bad(f"item {index.fqn!r} at {list(index.offset or [])} is not the shape of its entry")
        if any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, item.size)):
            raise bad(f"item {index.fqn!r} lies outside its tensor")


def decode_metadata(doc: Any, where: str) -> tuple[Metadata, dict[MetadataIndex, Any]]:
    """(the DCP Metadata, item index -> where its data is) of a manifest's ``dcp`` member."""
    try:
        sd_md: dict[str, Any] = {}
        for fqn, t in doc["tensors"].items():
            if t["dtype"] not in TORCH_DTYPE_SIZES:
                raise ValueError(f"dtype {t['dtype']!r}")
            props = TensorProperties(dtype=getattr(torch, t["dtype"]), requires_grad=bool(t["requires_grad"]))
            sd_md[fqn] = TensorStorageMetadata(props, torch.Size(t["size"]),
                                               [ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                                                for o, s in t["chunks"]])
        for fqn in doc["values"]:
            sd_md[fqn] = BytesStorageMetadata()
        planner_data = None
        if doc["mappings"] is not None:
            planner_data = {k: tuple(v) for k, v in doc["mappings"]}
        storage = {index_of(i): where_ for i, where_ in doc["storage"]}
        metadata = Metadata(sd_md, planner_data=planner_data, storage_data=storage, version=doc.get("version"))
        return metadata, storage
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptManifestError(f"manifest {where}: its DCP layout is damaged: {str(exc)[:200]}") from None
