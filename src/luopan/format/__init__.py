"""The on-disk format (docs/format.md): canonical JSON, config, chunking, packs, index files, manifests."""

FORMAT_VERSION = 1
