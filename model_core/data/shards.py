"""Token shards: packed rows of one split in flat, uncompressed files that are read a row at a time.

A shard `<split>-NNNNN.tokens` is one little-endian file, every section starting at a multiple of 64 bytes
(so `np.memmap` views of it are aligned), zero bytes between sections:

    header             64 bytes: magic b"LLMFROWS", then uint64 format version (1), rows, row_len,
                       doc_starts (number of document-start values), token itemsize (2: uint16, 4: int32),
                       loss_mask (0 or 1), and 0
    tokens             rows x row_len token ids (row_len = seq_len + 1: inputs and shifted targets),
                       uint16 when the vocabulary has at most 65,536 ids, else int32
    doc_start_offsets  rows + 1 int64: row i's document starts are doc_start_values[offsets[i]:offsets[i + 1]]
    doc_start_values   doc_starts int32: offsets inside the row where a document starts, always including 0
    loss_mask          rows x row_len int8, instruction shards only: 1 on the tokens that are training
                       targets (responses and their EOS), 0 on prompts, BOS and padding. Pretraining shards
                       have none; every non-padding token is a target there.

The dataset's manifest.json lists the shards of each split in order; an entry holds what opening the shard
needs (rows, token_dtype, doc_starts, loss_mask) besides its file name, sha256, `tokens` (non-padding) and,
with a mask, `response_tokens`. `open_split` reads the rows a caller asks for, nothing else, straight into
the result (seek and readinto; consecutive rows in one read): a memory map would keep every page it ever
touched in the process's resident memory, which over an epoch of random rows grows to the size of the split.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_core.data.packing import PackedRows

MANIFEST_NAME = "manifest.json"
SHARD_SUFFIX = ".tokens"
_MAGIC = b"LLMFROWS"
_FORMAT_VERSION = 1
_ALIGN = 64
_HEADER = np.dtype(
    [("magic", "S8"), ("version", "<u8"), ("rows", "<u8"), ("row_len", "<u8"), ("doc_starts", "<u8"),
     ("token_bytes", "<u8"), ("loss_mask", "<u8"), ("reserved", "<u8")]
)
_TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "int32": np.dtype("<i4")}
_OFFSET_DTYPE, _VALUE_DTYPE, _MASK_DTYPE = np.dtype("<i8"), np.dtype("<i4"), np.dtype("i1")

logger = logging.getLogger(__name__)


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}{SHARD_SUFFIX}"


def token_dtype(vocab_size: int | None) -> str:
    """The stored token type: uint16 when every id fits (half the bytes of int32), else int32.
    An unknown vocabulary (None) is stored as int32."""
    return "uint16" if vocab_size is not None and vocab_size <= 1 << 16 else "int32"


@dataclass(frozen=True)
class _Layout:
    """Where each section of a shard lies (byte offsets), from its counts."""

    rows: int
    row_len: int
    token_dtype: str
    doc_starts: int
    loss_mask: bool

    @property
    def token_array_dtype(self) -> np.dtype:
        return _TOKEN_DTYPES[self.token_dtype]

    def sections(self) -> dict[str, tuple[int, int]]:
        """(offset, bytes) of every section, the header first."""
        sizes = {
            "header": _HEADER.itemsize,
            "tokens": self.rows * self.row_len * self.token_array_dtype.itemsize,
            "doc_start_offsets": (self.rows + 1) * _OFFSET_DTYPE.itemsize,
            "doc_start_values": self.doc_starts * _VALUE_DTYPE.itemsize,
        }
        if self.loss_mask:
            sizes["loss_mask"] = self.rows * self.row_len * _MASK_DTYPE.itemsize
        sections, at = {}, 0
        for name, size in sizes.items():
            sections[name] = (at, size)
            at = -(-(at + size) // _ALIGN) * _ALIGN
        return sections

    def header(self) -> np.ndarray:
        values = (_MAGIC, _FORMAT_VERSION, self.rows, self.row_len, self.doc_starts,
                  self.token_array_dtype.itemsize, int(self.loss_mask), 0)
        return np.array(values, dtype=_HEADER)


def write_shard(path: Path, rows: PackedRows, pad_id: int, vocab_size: int | None = None) -> dict:
    """Write the rows as one shard at `path`; returns its manifest entry. Token ids must lie in
    [0, vocab_size) (in int32 when vocab_size is None)."""
    dtype = token_dtype(vocab_size)
    tokens = rows.tokens
    limit = vocab_size if vocab_size is not None else 1 << 31
    if tokens.size and (tokens.min() < 0 or tokens.max() >= limit):
        raise ValueError(f"{path.name}: token ids {tokens.min()}..{tokens.max()} are outside [0, {limit})")
    offsets = rows.doc_start_offsets
    if offsets[0] != 0 or offsets[-1] != len(rows.doc_start_values):
        raise ValueError(
            f"{path.name}: doc_start_offsets run {offsets[0]}..{offsets[-1]}, not 0..{len(rows.doc_start_values)}"
        )
    layout = _Layout(len(rows), tokens.shape[1], dtype, len(rows.doc_start_values), rows.loss_mask is not None)
    arrays = {
        "header": layout.header(),
        "tokens": tokens.astype(layout.token_array_dtype, copy=False),
        "doc_start_offsets": offsets.astype(_OFFSET_DTYPE, copy=False),
        "doc_start_values": rows.doc_start_values.astype(_VALUE_DTYPE, copy=False),
    }
    if layout.loss_mask:
        arrays["loss_mask"] = rows.loss_mask.astype(_MASK_DTYPE, copy=False)
    digest = hashlib.sha256()
    with open(path, "wb") as file:
        for name, (offset, _) in layout.sections().items():
            gap = bytes(offset - file.tell())
            data = memoryview(np.ascontiguousarray(arrays[name])).cast("B")
            for chunk in (gap, data):  # hashed as written: no second read of the file
                file.write(chunk)
                digest.update(chunk)
    entry = {"file": path.name, "rows": len(rows), "tokens": int(np.count_nonzero(tokens != pad_id))}
    if layout.loss_mask:
        entry["response_tokens"] = int(np.count_nonzero(rows.loss_mask))
    entry.update(token_dtype=dtype, doc_starts=layout.doc_starts, loss_mask=layout.loss_mask)
    return {**entry, "sha256": digest.hexdigest()}


def write_shards(
    rows: PackedRows, directory: Path, split: str, rows_per_shard: int, pad_id: int, vocab_size: int | None = None
) -> list[dict]:
    """Write the rows as consecutive shards of `rows_per_shard` rows; returns their manifest entries."""
    entries = []
    for index, first in enumerate(range(0, len(rows), rows_per_shard)):
        shard = rows.take(slice(first, first + rows_per_shard))  # its tokens a view, not a copy
        entries.append(write_shard(directory / shard_name(split, index), shard, pad_id, vocab_size))
    return entries


class SplitRows:
    """The rows of one split of a prepared dataset, in manifest order; `take` reads only the rows asked for."""

    def __init__(self, shards: list[_Shard], row_len: int) -> None:
        self._shards = shards
        self.row_len = row_len
        self._first_rows = np.cumsum([0] + [shard.layout.rows for shard in shards])
        masked = sum(shard.layout.loss_mask for shard in shards)
        if masked not in (0, len(shards)):
            raise ValueError(f"{masked} of the {len(shards)} shards of a split have a loss mask; all or none must")
        self.has_loss_mask = bool(masked)

    def __len__(self) -> int:
        return int(self._first_rows[-1])

    def take(self, indices: np.ndarray) -> PackedRows:
        """The rows at the given split-wide indices, in that order (repeats allowed), tokens as int32."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"row indices {indices.min()}..{indices.max()} outside a split of {len(self)} rows")
        shard_of = np.searchsorted(self._first_rows, indices, side="right") - 1
        by_shard = np.argsort(shard_of, kind="stable")
        parts = [
            self._shards[shard].read(indices[shard_of == shard] - self._first_rows[shard])
            for shard in np.unique(shard_of)
        ]
        return _concatenate(parts, self.row_len, self.has_loss_mask).take(np.argsort(by_shard))


def open_split(dataset_dir: str | Path, split: str) -> SplitRows:
    """The rows of a prepared split; only the manifest is read until rows are taken."""
    rows = SplitRows(*_split_shards(Path(dataset_dir), split))
    if not len(rows):
        raise ValueError(f"{dataset_dir} has no rows in split {split!r}")
    return rows


def read_shards(dataset_dir: str | Path, split: str) -> Iterator[PackedRows]:
    """The packed rows of a prepared split, one PackedRows per shard in manifest order."""
    shards, _ = _split_shards(Path(dataset_dir), split)
    for shard in shards:
        yield shard.read(np.arange(shard.layout.rows))


def build_or_reuse(final_dir: Path, verify: Callable[[Path], str | None], build: Callable[[Path], dict]) -> bool:
    """Whether the dataset at `final_dir` is reused: it is when `verify` finds nothing wrong with it (None).
    Otherwise `build(directory)` writes the dataset into a temporary sibling directory and returns its
    manifest, stored there as manifest.json before the directory is renamed to `final_dir`, so a failure
    never leaves a partial dataset under the final name."""
    if final_dir.exists():
        problem = verify(final_dir)
        if problem is None:
            return True
        logger.warning("prepared dataset %s is damaged (%s); rebuilding it", final_dir, problem)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    build_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.building-", dir=final_dir.parent))
    try:
        manifest = build(build_dir)
        (build_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        if final_dir.exists():  # the damaged copy goes first: a rename cannot replace a non-empty directory
            stale = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.damaged-", dir=final_dir.parent))
            os.replace(final_dir, stale / final_dir.name)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(build_dir, final_dir)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    return False


def file_sha256(path: Path) -> str:
    # file_digest reads into one reused buffer; a fresh 1 MB bytes per read was new pages to fault in
    # (hashing the 1.9 MB JSONL corpus: 2.5 -> 1.5 ms).
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


class _Shard:
    """One shard file, opened for each read (a split may have more shards than a process may hold open)."""

    def __init__(self, path: Path, layout: _Layout) -> None:
        self.path = path
        self.layout = layout
        self._sections = layout.sections()
        self._checked = False

    def read(self, rows: np.ndarray) -> PackedRows:
        """The rows at the given shard-local indices, in that order; consecutive rows are read together."""
        unique = np.unique(rows)
        runs = np.split(unique, np.flatnonzero(np.diff(unique) != 1) + 1) if len(unique) else []
        layout = self.layout
        tokens = np.empty((len(unique), layout.row_len), layout.token_array_dtype)
        loss_mask = np.empty((len(unique), layout.row_len), _MASK_DTYPE) if layout.loss_mask else None
        offsets, values = np.zeros(len(unique) + 1, np.int64), [np.empty(0, _VALUE_DTYPE)]
        with open(self.path, "rb", buffering=0) as file:
            if not self._checked:
                self._check(file)
            at = 0
            for run in runs:
                first, count = int(run[0]), len(run)
                self._read(file, "tokens", tokens[at : at + count], first * layout.row_len)
                if loss_mask is not None:
                    self._read(file, "loss_mask", loss_mask[at : at + count], first * layout.row_len)
                run_offsets = np.empty(count + 1, _OFFSET_DTYPE)
                self._read(file, "doc_start_offsets", run_offsets, first)
                low, high = int(run_offsets[0]), int(run_offsets[-1])
                if not 0 <= low <= high <= layout.doc_starts or (np.diff(run_offsets) < 0).any():
                    raise ValueError(f"{self.path}: damaged doc_start_offsets; prepare the dataset again")
                values.append(np.empty(high - low, _VALUE_DTYPE))
                self._read(file, "doc_start_values", values[-1], low)
                offsets[at + 1 : at + count + 1] = run_offsets[1:] - low + offsets[at]
                at += count
        gathered = PackedRows(tokens.astype(np.int32), np.concatenate(values), offsets, loss_mask)
        return gathered.take(np.searchsorted(unique, rows))

    def _read(self, file, section: str, into: np.ndarray, first_item: int) -> None:
        offset, _ = self._sections[section]
        file.seek(offset + first_item * into.itemsize)
        if file.readinto(memoryview(into).cast("B")) != into.nbytes:
            raise ValueError(f"{self.path} is shorter than its manifest entry says; prepare the dataset again")

    def _check(self, file) -> None:
        header = np.frombuffer(file.read(_HEADER.itemsize), dtype=_HEADER)
        if len(header) != 1 or header[0] != self.layout.header()[()]:
            raise ValueError(
                f"{self.path} is not the shard its manifest entry describes ({self.layout}); prepare the dataset again"
            )
        self._checked = True


def _split_shards(directory: Path, split: str) -> tuple[list[_Shard], int]:
    """The shards of a split as its manifest lists them, and the length of a row."""
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    row_len = manifest["seq_len"] + 1
    shards = []
    for entry in manifest["splits"][split]["shards"]:
        if "token_dtype" not in entry:
            raise ValueError(
                f"{directory}: shard {entry['file']} is in an older format than this reader's; "
                "prepare the dataset again"
            )
        layout = _Layout(entry["rows"], row_len, entry["token_dtype"], entry["doc_starts"], entry["loss_mask"])
        shards.append(_Shard(directory / entry["file"], layout))
    return shards, row_len


def _concatenate(parts: list[PackedRows], row_len: int, masked: bool) -> PackedRows:
    if not parts:
        return PackedRows(
            np.empty((0, row_len), np.int32), np.empty(0, np.int32), np.zeros(1, np.int64),
            np.empty((0, row_len), np.int8) if masked else None,
        )
    offsets = [parts[0].doc_start_offsets]
    for part in parts[1:]:
        offsets.append(part.doc_start_offsets[1:] + offsets[-1][-1])
    return PackedRows(
        np.concatenate([part.tokens for part in parts]),
        np.concatenate([part.doc_start_values for part in parts]),
        np.concatenate(offsets),
        np.concatenate([part.loss_mask for part in parts]) if masked else None,
    )
