"""The files every part of model_core writes: safetensors, sha256 digests, directories committed whole.

safetensors are read and written without a framework, so bf16 works with numpy (which has no bf16). In
memory every weight is an fp32 array. A file stores F32, F16 or BF16; reading widens to fp32 exactly,
writing narrows with round-to-nearest-even. `round_to` applies that narrowing in memory, so an array
that has been rounded to a dtype is written and read back bit for bit. `read_block` reads one block of one
tensor through a memory map, so a rank that owns a slice of a weight never holds the whole weight.

Everything a later run reads is written durably, here and nowhere else: a file (`write_file`, `build_file`)
or a directory (a prepared dataset, a converted checkpoint, adapters, a training checkpoint: `build_directory`,
or `commit_directory` when several processes fill it) is built under a temporary name beside its final
one, fsynced, renamed into place, and the parent directory fsynced so that the rename itself survives a
crash. A reader sees the old version or the new one whole, never a part; a failed write removes its
temporary and leaves the old version as it was.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

WEIGHTS = "model.safetensors"  # the weights file of a converted checkpoint, adapters' base, or 1-block training checkpoint


class StorageError(ValueError):
    """A file that cannot be read or written as asked; the message names the file and the problem."""

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
    raise StorageError(f"dtype {dtype!r} is not one of {DTYPES}")


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
            raise StorageError(f"{path}: tensor {name} has dtype {file_dtype}; only floating-point weights are read")
        begin, end = entry["data_offsets"]
        flat = np.empty(0, np.uint8) if raw is None else raw[begin:end]
        values = flat.view(_NUMPY_OF[file_dtype]).reshape(entry["shape"])
        tensors[name] = bf16_bits_to_float32(values) if file_dtype == "BF16" else np.array(values, dtype=np.float32)
    return tensors


def read_weights(directory: str | Path) -> dict[str, np.ndarray]:
    """fp32 weights of a checkpoint directory's model.safetensors, whatever dtype it stores (bf16 included)."""
    return read_safetensors(Path(directory) / WEIGHTS)


def read_block(path: str | Path, name: str, axis: int | None = None, blocks: int = 1, index: int = 0) -> np.ndarray:
    """Block `index` of `blocks` equal blocks along `axis` of tensor `name` (the whole tensor when axis is None),
    as fp32. Only the block's bytes are copied out of the memory-mapped file."""
    path = Path(path)
    header, data_start = _read_header(path)
    entry = header.get(name)
    if entry is None or name == "__metadata__":
        raise StorageError(f"{path} holds no tensor {name}")
    file_dtype, shape = entry["dtype"], tuple(entry["shape"])
    if file_dtype not in _NUMPY_OF:
        raise StorageError(f"{path}: tensor {name} has dtype {file_dtype}; only floating-point weights are read")
    begin, end = entry["data_offsets"]
    if begin == end:
        return np.zeros(shape, np.float32)
    values = np.memmap(path, dtype=_NUMPY_OF[file_dtype], mode="r", offset=data_start + begin, shape=shape)
    if axis is not None:
        if shape[axis] % blocks:
            raise StorageError(f"{path}: {name} has {shape[axis]} along axis {axis}, not divisible into {blocks} blocks")
        length = shape[axis] // blocks
        values = values[(slice(None),) * axis + (slice(index * length, (index + 1) * length),)]
    return bf16_bits_to_float32(values) if file_dtype == "BF16" else np.array(values, dtype=np.float32)


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a safetensors file, from its header alone."""
    header, _ = _read_header(Path(path))
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def write_safetensors(
    path: str | Path, tensors: dict[str, np.ndarray], dtype: str, metadata: dict[str, str] | None = None
) -> None:
    """Write fp32 arrays as `dtype` (tensors in name order); readable by the `safetensors` package."""
    if dtype not in _FILE_DTYPE:
        raise StorageError(f"dtype {dtype!r} is not one of {DTYPES}")
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
        raise StorageError(
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
        raise StorageError(f"{path} is not a readable safetensors file ({error})") from error
    return header, 8 + length


def file_sha256(path: str | Path) -> str:
    # file_digest reads into one reused buffer; a fresh 1 MB bytes per read was new pages to fault in.
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def write_file(path: str | Path, content: str | bytes) -> Path:
    """Write `content` (text as UTF-8) as the file `path`, durably (see `build_file`)."""
    data = content.encode("utf-8") if isinstance(content, str) else content
    return build_file(path, lambda temporary: temporary.write_bytes(data))


def replace_file(path: str | Path, content: str) -> Path:
    """Replace the file `path` with `content` atomically (a reader sees the old file or the new one, never a
    part) but not durably: no fsync. For a file rewritten every second that matters only while its writer runs
    (a rank's heartbeat), where an fsync a write would load a shared file system for nothing."""
    final = Path(path)
    temporary = _sibling(final)
    try:
        temporary.write_text(content, encoding="utf-8")
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)
    return final


def build_file(final: str | Path, write: Callable[[Path], None]) -> Path:
    """Run `write(path)` to create a temporary file beside `final`, fsync it, rename it to `final` and fsync
    the parent. When `write` fails, the temporary is removed and an existing `final` is left as it was."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = _sibling(final)
    try:
        write(temporary)
        _fsync(temporary)
        os.replace(temporary, final)
        _fsync(final.parent)
    finally:
        temporary.unlink(missing_ok=True)
    return final


def build_directory(final: str | Path, write: Callable[[Path], None], replace: bool) -> None:
    """Run `write(directory)` on a temporary sibling of `final` and commit it as `final`. An existing
    non-empty `final` is replaced when `replace`, else refused (FileExistsError)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    building = _sibling(final)
    building.mkdir()
    try:
        write(building)
        commit_directory(building, final, replace)
    finally:
        shutil.rmtree(building, ignore_errors=True)


def commit_directory(building: Path, final: Path, replace: bool) -> None:
    """fsync everything under `building`, rename it to `final` and fsync the parent. A rename cannot replace
    a non-empty directory, so with `replace` an existing `final` is first moved aside and then removed;
    without it, an existing non-empty `final` (one that another process committed first included) raises
    FileExistsError."""
    building, final = Path(building), Path(final)
    for root, _, files in os.walk(building, topdown=False):
        for name in files:
            _fsync(Path(root) / name)
        _fsync(Path(root))  # its entries: the files' names and the subdirectories
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        if not replace:
            raise FileExistsError(f"{final} exists and is not empty")
        stale = _sibling(final)
        stale.mkdir()
        os.replace(final, stale / final.name)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(building, final)
    except OSError as error:
        if error.errno in (errno.ENOTEMPTY, errno.EEXIST):  # committed by another process since the check
            raise FileExistsError(f"{final} exists and is not empty") from error
        raise
    _fsync(final.parent)


def _sibling(final: Path) -> Path:
    """An unused hidden name beside `final` (in its directory, so that a rename to `final` is atomic)."""
    return final.with_name(f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's contents (a directory's: its entries) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
