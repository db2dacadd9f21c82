"""The tensor dtypes luopan stores, by name: their element sizes, and their codes in a safetensors file.

Plain tables, importing nothing: a device that only applies patches (luopan.patch) reads and writes safetensors
files with them without importing NumPy, torch or the repository.
"""

from __future__ import annotations

# The torch dtypes luopan stores, by name, with their element size. A whitelist: a name read from a manifest is
# never looked up on the torch module unless it is here, and a dtype a future torch adds is refused, not guessed.
TORCH_DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    **{f"int{n}": 1 for n in range(1, 8)}, **{f"uint{n}": 1 for n in range(1, 8)},
}

# safetensors dtype codes, by luopan dtype name (torch names and NumPy names coincide where both exist)
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "complex64": "C64",
}
