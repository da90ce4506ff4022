"""safetensors files read and written without a framework, so bf16 works with numpy (which has no bf16).

In memory every weight is an fp32 array. A file stores F32, F16 or BF16; reading widens to fp32 exactly,
writing narrows with round-to-nearest-even. `round_to` applies that narrowing in memory, so an array
that has been rounded to a dtype is written and read back bit for bit.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from model_core.convert.errors import ConversionError

DTYPES = ("float32", "bfloat16", "float16")
_FILE_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_NUMPY_OF = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8")}
_HEADER_ALIGNMENT = 8


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> fp32 (exact: bf16 is the top half of an fp32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 -> uint16 bf16 bit patterns, rounding to nearest even; NaN stays a (quiet) NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def round_to(values: np.ndarray, dtype: str, name: str = "tensor") -> np.ndarray:
    """fp32 array holding `values` rounded to `dtype` (what a file of that dtype will store)."""
    values = np.asarray(values, dtype=np.float32)
    if dtype == "float32":
        return values
    if dtype == "float16":
        return _to_float16(values, name).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_bits_to_float32(float32_to_bf16_bits(values))
    raise ConversionError(f"dtype {dtype!r} is not one of {DTYPES}")


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as an fp32 array (F32, F16, BF16 or F64 on disk)."""
    path = Path(path)
    header, data_start = _read_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start) if path.stat().st_size > data_start else None
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        file_dtype = entry["dtype"]
        if file_dtype not in _NUMPY_OF:
            raise ConversionError(f"{path}: tensor {name} has dtype {file_dtype}; only floating-point weights are read")
        begin, end = entry["data_offsets"]
        flat = np.empty(0, np.uint8) if raw is None else raw[begin:end]
        values = flat.view(_NUMPY_OF[file_dtype]).reshape(entry["shape"])
        tensors[name] = bf16_bits_to_float32(values) if file_dtype == "BF16" else np.array(values, dtype=np.float32)
    return tensors


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a safetensors file, from its header alone."""
    header, _ = _read_header(Path(path))
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def write_safetensors(
    path: str | Path, tensors: dict[str, np.ndarray], dtype: str, metadata: dict[str, str] | None = None
) -> None:
    """Write fp32 arrays as `dtype` (tensors in name order); readable by the `safetensors` package."""
    if dtype not in _FILE_DTYPE:
        raise ConversionError(f"dtype {dtype!r} is not one of {DTYPES}")
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    blobs, offset = [], 0
    for name in sorted(tensors):
        blob = _encode(name, tensors[name], dtype)
        header[name] = {
            "dtype": _FILE_DTYPE[dtype],
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % _HEADER_ALIGNMENT)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for blob in blobs:
            handle.write(blob)


def _encode(name: str, values: np.ndarray, dtype: str) -> bytes:
    values = np.asarray(values, dtype=np.float32)
    if dtype == "float32":
        return values.astype("<f4").tobytes()
    if dtype == "bfloat16":
        return float32_to_bf16_bits(values).astype("<u2").tobytes()
    return _to_float16(values, name).astype("<f2").tobytes()


def _to_float16(values: np.ndarray, name: str) -> np.ndarray:
    narrowed = values.astype(np.float16)
    if np.isinf(narrowed).sum() > np.isinf(values).sum():
        largest = float(np.abs(values[np.isfinite(values)]).max())
        raise ConversionError(
            f"{name}: |value| up to {largest:g} overflows float16 (max 65504); use bfloat16 or float32"
        )
    return narrowed


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > path.stat().st_size:
                raise ValueError(f"header length {length} exceeds the file size")
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error) as error:
        raise ConversionError(f"{path} is not a readable safetensors file ({error})") from error
    return header, 8 + length
