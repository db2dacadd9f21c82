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
        return Metadata(sd_md, planner_data=planner_data, storage_data=storage, version=doc.get("version")), storage
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptManifestError(f"manifest {where}: its DCP layout is damaged: {str(exc)[:200]}") from None
