"""P14: luopan's float codec (compression="auto", docs/format.md §6.1) against zipnn on the same bf16 weights.

P14.bf16_compression_vs_zipnn: bf16 weights of a GPT-like model (~size_mib MiB; 256 with --quick) are saved into a
fresh luopan repository with its default compression ("auto"), and compressed with `zipnn.ZipNN` (its bf16 byte
settings: input_format="byte", bytearray_dtype="bfloat16", its default threads and method). Value = zipnn's
compressed bytes / luopan's stored bytes. Goal >= 1.0.

The weights: GPT-2-small shapes — token and position embeddings (50257 x 768, 1024 x 768) and transformer blocks
of width 768 (qkv 768 x 2304, proj 768 x 768, MLP 768 x 3072 and 3072 x 768, two LayerNorms, all with biases; 13
blocks make 256 MiB) — each module built on its own with PyTorch's default init (nn.Linear: Kaiming-uniform weights
and uniform biases, bound 1/sqrt(fan_in); nn.Embedding: N(0, 1); LayerNorm: ones and zeros), seed 0, cast to bf16:
independent layers, not copies of one. Where every fan_in is a power of 4 (width 1024) the uniform bounds are powers
of 2, the exponents' distribution is dyadic, Huffman coding is optimal for both codecs and the value is ~1.000.

luopan's bytes are `info.stored_bytes` of the save: the pack files written, framing included (16-byte headers, the
JSON trailer of ~150 bytes per chunk), so slightly more than the blobs alone. zipnn's are the smaller of (a) each
tensor compressed on its own (luopan's granularity: one entry per tensor) and (b) all tensors concatenated into one
buffer (a safetensors file's granularity). Both round trips are checked byte for byte (luopan by `load`). Context:
plain zstd level 3 per 4 MiB chunk; compress and decompress seconds for both codecs on all cores (luopan's codec
alone through its blob encoder/decoder on 4 MiB chunks, as a save and a load run it, and the end-to-end save and
load); zipnn is given private copies because its compress rewrites the buffer it is handed (0.5.4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MIB, remove, settle, timed  # noqa: E402

WIDTH, VOCAB, POSITIONS, CHUNK = 768, 50257, 1024, 4 << 20
BLOCK_PARAMS = 12 * WIDTH * WIDTH  # qkv 3, proj 1, MLP 8 (times width^2), biases aside


def build_weights(size_mib: int, dtype: str = "bfloat16") -> tuple[dict[str, Any], str]:
    """A state dict of ~size_mib MiB of ``dtype`` weights and a description of it."""
    import torch

    torch.manual_seed(0)
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    blocks = max(1, round((size_mib * MIB / itemsize - (VOCAB + POSITIONS) * WIDTH) / BLOCK_PARAMS))
    modules: dict[str, Any] = {"wte": torch.nn.Embedding(VOCAB, WIDTH), "wpe": torch.nn.Embedding(POSITIONS, WIDTH)}
    for b in range(blocks):
        modules.update({f"h.{b}.ln_1": torch.nn.LayerNorm(WIDTH), f"h.{b}.attn.qkv": torch.nn.Linear(WIDTH, 3 * WIDTH),
                        f"h.{b}.attn.proj": torch.nn.Linear(WIDTH, WIDTH), f"h.{b}.ln_2": torch.nn.LayerNorm(WIDTH),
                        f"h.{b}.mlp.fc": torch.nn.Linear(WIDTH, 4 * WIDTH),
                        f"h.{b}.mlp.proj": torch.nn.Linear(4 * WIDTH, WIDTH)})
    modules["ln_f"] = torch.nn.LayerNorm(WIDTH)
    state = {}
    for name, mod in modules.items():
        for k, v in mod.state_dict().items():
            state[f"{name}.{k}"] = v.detach().to(getattr(torch, dtype)).contiguous()
        del mod
    what = (f"GPT-2-small-shaped {dtype} weights: {blocks} blocks of width {WIDTH}, vocab {VOCAB}, {POSITIONS} "
            f"positions, PyTorch default init (seed 0), {len(state)} tensors")
    return state, what


def _raw(t: Any) -> memoryview:
    import torch

    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def zipnn_sizes(state: dict[str, Any], log: Any) -> dict[str, Any]:
    """zipnn's compressed bytes per tensor and for the concatenation, its seconds, and its round-trip check."""
    import zipnn

    def codec() -> Any:
        return zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16")

    originals = [bytes(_raw(t)) for t in state.values()]
    copies = [bytearray(b) for b in originals]  # zipnn's compress rewrites its input in place
    z = codec()
    t_comp, packed = timed(lambda: [bytes(z.compress(c)) for c in copies])
    t_dec, unpacked = timed(lambda: [codec().decompress(p) for p in packed])
    exact = all(bytes(u) == o for u, o in zip(unpacked, originals))
    whole = bytearray(b"".join(originals))
    t_whole, packed_whole = timed(lambda: bytes(codec().compress(whole)))
    whole_ok = bytes(codec().decompress(packed_whole)) == b"".join(originals)
    copies.clear()
    unpacked.clear()
    per_tensor = sum(len(p) for p in packed)
    log(f"zipnn: per tensor {per_tensor / MIB:.1f} MiB ({t_comp:.2f} s, decompress {t_dec:.2f} s), whole buffer "
        f"{len(packed_whole) / MIB:.1f} MiB ({t_whole:.2f} s); round trips exact: {exact and whole_ok}")
    return {"zipnn_per_tensor_bytes": per_tensor, "zipnn_whole_bytes": len(packed_whole),
            "zipnn_compress_s": t_comp, "zipnn_decompress_s": t_dec, "zipnn_whole_compress_s": t_whole,
            "zipnn_roundtrip_exact": exact and whole_ok, "zipnn_version": _version("zipnn")}


def codec_seconds(state: dict[str, Any]) -> dict[str, Any]:
    """luopan's blob codec alone, and plain zstd-3, on the 4 MiB chunks of every tensor, on all worker threads."""
    from luopan.format.config import Compression
    from luopan.format.codecs import compressor, decode_blob, encode_blob
    from luopan.repository.parallel import WORKERS

    auto = Compression.parse("auto")
    chunks = [v[o : o + CHUNK] for v in map(_raw, state.values()) for o in range(0, len(v), CHUNK)]
    with ThreadPoolExecutor(WORKERS) as pool:
        t_enc, blobs = timed(lambda: list(pool.map(lambda c: encode_blob(c, auto, 2), chunks)))
        t_dec, raws = timed(lambda: list(pool.map(
            lambda cb: decode_blob(cb[1][0], cb[1][1], len(cb[0]), "bench") if cb[1][0] != "none" else cb[1][1],
            zip(chunks, blobs))))
        exact = all(bytes(r) == bytes(c) for r, c in zip(raws, chunks))
        # one zstd compressor per thread (they are not thread-safe)
        t_zstd, zs = timed(lambda: list(pool.map(lambda c: min(len(c), len(compressor(3).compress(c))), chunks)))
    codecs: dict[str, int] = {}
    for codec, _s in blobs:
        codecs[codec] = codecs.get(codec, 0) + 1
    return {"luopan_codec_compress_s": t_enc, "luopan_codec_decompress_s": t_dec, "luopan_codec_exact": exact,
            "luopan_blob_bytes": sum(len(s) for _c, s in blobs), "luopan_codecs": codecs,
            "zstd3_bytes": sum(zs), "zstd3_compress_s": t_zstd, "threads": WORKERS}


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def run_p14(size_mib: int, quick: bool, workdir: str | None, log: Any = print) -> dict[str, Any]:
    import torch

    import luopan

    size_mib = 256 if quick else size_mib
    log(f"P14: building ~{size_mib} MiB of bf16 weights")
    state, what = build_weights(size_mib)
    raw = sum(t.nbytes for t in state.values())
    base = tempfile.mkdtemp(prefix="luopan-p14-", dir=workdir)
    try:
        repo = luopan.open(os.path.join(base, "repo"))  # the default compression of a new repository
        settle()
        t_save, info = timed(lambda: repo.save("p14", 1, state))
        t_load, back = timed(lambda: repo.load("p14", 1))
        exact = all(torch.equal(back[k].view(torch.uint16), v.view(torch.uint16)) for k, v in state.items())
        del back
        compression = repo.config.compression.to_json()
        repo.close()
    finally:
        remove(base)
    lp = info.stored_bytes
    log(f"luopan ({compression}): {raw / MIB:.1f} MiB -> {lp / MIB:.1f} MiB stored ({lp / raw:.4f}); save "
        f"{t_save:.2f} s, load {t_load:.2f} s; load exact: {exact}")
    ctx = codec_seconds(state)
    log(f"luopan codec alone: {ctx['luopan_codec_compress_s']:.2f} s / {ctx['luopan_codec_decompress_s']:.2f} s "
        f"on {ctx['threads']} threads; zstd-3 {ctx['zstd3_bytes'] / raw:.4f} in {ctx['zstd3_compress_s']:.2f} s")
    zn = zipnn_sizes(state, log)
    peer = min(zn["zipnn_per_tensor_bytes"], zn["zipnn_whole_bytes"])
    ratio = round(peer / lp, 4)
    ok = exact and ctx["luopan_codec_exact"] and zn["zipnn_roundtrip_exact"]
    log(f"P14: zipnn {peer} / luopan {lp} = {ratio}")
    return {
        "id": "P14.bf16_compression_vs_zipnn", "peer": "zipnn", "peer_short": "zipnn", "ratio": ratio, "value": ratio,
        "goal": 1.0, "goal_op": ">=", "met": ok and ratio >= 1.0,
        "unit": "zipnn compressed bytes / luopan stored bytes (> 1: luopan smaller)",
        "weights": what, "size_mib": size_mib, "raw_bytes": raw, "luopan_bytes": lp, "zipnn_bytes": peer,
        "luopan_ratio_to_raw": round(lp / raw, 4), "zipnn_ratio_to_raw": round(peer / raw, 4),
        "luopan_compression": compression, "luopan_save_s": t_save, "luopan_load_s": t_load,
        "luopan_load_exact": exact, **ctx, **zn,
        "notes": "luopan bytes = info.stored_bytes of a save into a fresh repository (default compression), pack "
                 "framing included; zipnn bytes = the smaller of per-tensor and whole-buffer ZipNN(input_format="
                 "'byte', bytearray_dtype='bfloat16').compress. Both round trips checked exact. Seconds on all "
                 "cores; luopan save/load seconds include hashing, writing and fsync.",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="256 MiB of weights")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()
    result = run_p14(args.size_mib, args.quick, args.workdir, log=lambda s: print(s, file=sys.stderr, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(result, indent=2, default=str) + "\n")
    print(f"{result['id']}: {result['ratio']:.4f} (goal >= {result['goal']}: {'met' if result['met'] else 'MISSED'})")


if __name__ == "__main__":
    main()
