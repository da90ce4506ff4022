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
the result (positioned reads; consecutive rows in one read): a memory map would keep every page it ever
touched in the process's resident memory, which over an epoch of random rows grows to the size of the split.

What is read is checked first, so a damaged dataset stops a run with one line naming the file and both
hashes (`DatasetDamagedError`) instead of training on it. manifest.sha256 (`sha256sum -c` reads it) holds
the manifest's sha256, and the manifest every other file's. `open_split` checks the manifest and the
tokenizer by their sha256 and every shard of the split by its size; a shard's sha256 is checked, streaming,
when a `SplitRows` first opens it, before any of its rows is returned: once per shard per process, on the
shards the process reads. Hashing every shard up front would cost each rank a read of the whole split
before its first step (minutes per rank on a terabyte corpus), where a random batch reaches most shards
within an epoch's first steps anyway.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_core.data.packing import PackedRows
from model_core.storage import build_directory

MANIFEST_NAME = "manifest.json"
MANIFEST_DIGEST_NAME = "manifest.sha256"
TOKENIZER_NAME = "tokenizer.model"
SHARD_SUFFIX = ".tokens"
_MAGIC = b"LLMFROWS"
_FORMAT_VERSION = 1
_ALIGN = 64
_OPEN_FILES = 64
_HEADER = np.dtype(
    [("magic", "S8"), ("version", "<u8"), ("rows", "<u8"), ("row_len", "<u8"), ("doc_starts", "<u8"),
     ("token_bytes", "<u8"), ("loss_mask", "<u8"), ("reserved", "<u8")]
)
_TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "int32": np.dtype("<i4")}
_OFFSET_DTYPE, _VALUE_DTYPE, _MASK_DTYPE = np.dtype("<i8"), np.dtype("<i4"), np.dtype("i1")

logger = logging.getLogger(__name__)


class DatasetDamagedError(ValueError):
    """A prepared dataset's file differs from what its manifest (or manifest.sha256) says: `problem` names the
    file and both values, the message adds what to do."""

    def __init__(self, problem: str, directory: Path) -> None:
        super().__init__(problem, directory)
        self.problem, self.directory = problem, directory

    def __str__(self) -> str:
        return f"{self.problem}; delete {self.directory} to have the dataset prepared again"


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

    @property
    def file_bytes(self) -> int:
        """The size of the whole file: its last section's end."""
        offset, size = list(self.sections().values())[-1]
        return offset + size

    def header(self) -> np.ndarray:
        values = (_MAGIC, _FORMAT_VERSION, self.rows, self.row_len, self.doc_starts,
                  self.token_array_dtype.itemsize, int(self.loss_mask), 0)
        return np.array(values, dtype=_HEADER)


def write_shard(path: Path, rows: PackedRows, pad_id: int, vocab_size: int | None = None) -> dict:
    """Write the rows as one shard at `path`; returns its manifest entry. Token ids must lie in
    [0, vocab_size); they are stored as `token_dtype(vocab_size)`."""
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


def shard_file_bytes(entry: dict, row_len: int) -> int:
    """The size a shard's file has when it is whole, from its manifest entry."""
    return _Layout(entry["rows"], row_len, entry["token_dtype"], entry["doc_starts"], entry["loss_mask"]).file_bytes


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
    """The rows of one split of a prepared dataset, in manifest order; `take` reads only the rows asked for.

    Up to _OPEN_FILES shard files stay open (the most recently read), so a random batch costs a few reads
    per row and no opens once the shards it touches have been seen.
    """

    def __init__(self, shards: list[_Shard], row_len: int) -> None:
        self._shards = shards
        self.row_len = row_len
        self._first_rows = np.cumsum([0] + [shard.layout.rows for shard in shards])
        masked = sum(shard.layout.loss_mask for shard in shards)
        if masked not in (0, len(shards)):
            raise ValueError(f"{masked} of the {len(shards)} shards of a split have a loss mask; all or none must")
        self.has_loss_mask = bool(masked)
        token_dtypes = {shard.layout.token_dtype for shard in shards}
        if len(token_dtypes) > 1:
            raise ValueError(f"the shards of a split store their tokens as {sorted(token_dtypes)}; one type must")
        self._token_dtype = _TOKEN_DTYPES[token_dtypes.pop() if token_dtypes else "int32"]
        self._open: dict[int, int] = {}  # shard index -> file descriptor, least recently used first
        self._checked: set[int] = set()  # shards whose whole file matched its sha256 in this process
        weakref.finalize(self, _close_all, self._open)

    def __len__(self) -> int:
        return int(self._first_rows[-1])

    def take(self, indices: np.ndarray) -> PackedRows:
        """The rows at the given split-wide indices, in that order (repeats allowed), tokens as int32."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"row indices {indices.min()}..{indices.max()} outside a split of {len(self)} rows")
        unique, order = np.unique(indices, return_inverse=True)
        shard_of = np.searchsorted(self._first_rows, unique, side="right") - 1
        # Runs of consecutive rows within one shard are read together.
        run_starts = np.flatnonzero((np.diff(unique, prepend=-2) != 1) | (np.diff(shard_of, prepend=-1) != 0))
        run_lengths = np.diff(run_starts, append=len(unique))
        tokens = np.empty((len(unique), self.row_len), self._token_dtype)
        loss_mask = np.empty((len(unique), self.row_len), _MASK_DTYPE) if self.has_loss_mask else None
        offsets, values = np.zeros(len(unique) + 1, np.int64), [np.empty(0, _VALUE_DTYPE)]
        for at, count, shard in zip(run_starts.tolist(), run_lengths.tolist(), shard_of[run_starts].tolist()):
            first = int(unique[at]) - int(self._first_rows[shard])
            run_mask = None if loss_mask is None else loss_mask[at : at + count]
            run_offsets, run_values = self._shards[shard].read_run(
                self._file(shard), first, tokens[at : at + count], run_mask
            )
            offsets[at + 1 : at + count + 1] = run_offsets[1:] - run_offsets[0] + offsets[at]
            values.append(run_values)
        rows = PackedRows(tokens.astype(np.int32), np.concatenate(values), offsets, loss_mask)
        if len(unique) == len(indices) and (unique == indices).all():
            return rows
        return rows.take(order)

    def check(self, indices: np.ndarray) -> None:
        """Check now the shards that hold these rows, as the first read of each would (rows read only later,
        such as the validation rows of a run's first evaluation, then cannot stop the run midway)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        for shard in np.unique(np.searchsorted(self._first_rows, indices, side="right") - 1).tolist():
            self._file(shard)

    def _file(self, shard: int) -> int:
        descriptor = self._open.pop(shard, None)
        if descriptor is None:
            descriptor = os.open(self._shards[shard].path, os.O_RDONLY)
            if shard not in self._checked:
                try:
                    self._shards[shard].check(descriptor)
                except Exception:
                    os.close(descriptor)
                    raise
                self._checked.add(shard)
            if len(self._open) >= _OPEN_FILES:
                os.close(self._open.pop(next(iter(self._open))))
        self._open[shard] = descriptor
        return descriptor


def open_split(dataset_dir: str | Path, split: str) -> SplitRows:
    """The rows of a prepared split; only the manifest is read until rows are taken."""
    rows = SplitRows(*_split_shards(Path(dataset_dir), split))
    if not len(rows):
        raise ValueError(f"{dataset_dir} has no rows in split {split!r}")
    return rows


def read_shards(dataset_dir: str | Path, split: str) -> Iterator[PackedRows]:
    """The packed rows of a prepared split, one PackedRows per shard in manifest order."""
    shards, row_len = _split_shards(Path(dataset_dir), split)
    rows, first = SplitRows(shards, row_len), 0
    for shard in shards:
        yield rows.take(np.arange(first, first + shard.layout.rows))
        first += shard.layout.rows


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
    def write(directory: Path) -> None:
        write_manifest(directory, build(directory))

    build_directory(final_dir, write, replace=True)
    return False


def write_manifest(directory: Path, manifest: dict) -> None:
    """manifest.json, and manifest.sha256 with its sha256 (the root of the checksums: the manifest holds every
    other file's)."""
    text = (json.dumps(manifest, indent=2) + "\n").encode()
    (directory / MANIFEST_NAME).write_bytes(text)
    (directory / MANIFEST_DIGEST_NAME).write_text(f"{hashlib.sha256(text).hexdigest()}  {MANIFEST_NAME}\n")


def read_manifest(directory: str | Path) -> dict:
    """A prepared dataset's manifest, after checking it against manifest.sha256 (DatasetDamagedError if not)."""
    directory = Path(directory)
    digest_path = directory / MANIFEST_DIGEST_NAME
    try:
        recorded = digest_path.read_bytes().decode(errors="replace")
        text = (directory / MANIFEST_NAME).read_bytes()
    except FileNotFoundError as error:
        raise DatasetDamagedError(f"{error.filename} is missing", directory) from None
    found = re.fullmatch(rf"([0-9a-f]{{64}})  {re.escape(MANIFEST_NAME)}\n", recorded)
    if found is None:
        raise DatasetDamagedError(f"{digest_path} does not hold '<64 hex digits>  {MANIFEST_NAME}'", directory)
    _check_digest(directory / MANIFEST_NAME, hashlib.sha256(text).hexdigest(), found.group(1), MANIFEST_DIGEST_NAME)
    return json.loads(text)


def check_file(path: Path, expected_sha256: str) -> None:
    """The whole file, streamed, must have the sha256 its manifest entry gives (DatasetDamagedError if not)."""
    with open(path, "rb") as file:
        actual = hashlib.file_digest(file, "sha256").hexdigest()
    _check_digest(path, actual, expected_sha256, MANIFEST_NAME)


def _check_digest(path: Path, actual: str, expected: str, recorded_in: str) -> None:
    if actual != expected:
        raise DatasetDamagedError(
            f"{path} has sha256 {actual} but {recorded_in} gives {expected}: the dataset changed after it was prepared",
            path.parent,
        )


class _Shard:
    """Where one shard's file is, its sha256 and how it is laid out; reads runs of its rows from an open descriptor."""

    def __init__(self, path: Path, layout: _Layout, sha256: str) -> None:
        self.path = path
        self.layout = layout
        self.sha256 = sha256
        self._sections = layout.sections()

    def check_size(self) -> None:
        size = self.path.stat().st_size
        if size != self.layout.file_bytes:
            raise DatasetDamagedError(
                f"{self.path} holds {size} bytes but its manifest entry makes it {self.layout.file_bytes}",
                self.path.parent,
            )

    def check(self, descriptor: int) -> None:
        """The whole file must have the manifest entry's sha256 (read once more, streaming) and its header must
        say what the entry says."""
        with os.fdopen(os.dup(descriptor), "rb") as file:  # reads use offsets: the shared position is unused
            actual = hashlib.file_digest(file, "sha256").hexdigest()
        _check_digest(self.path, actual, self.sha256, MANIFEST_NAME)
        header = np.frombuffer(os.pread(descriptor, _HEADER.itemsize, 0), dtype=_HEADER)
        if len(header) != 1 or header[0] != self.layout.header()[()]:
            raise ValueError(
                f"{self.path} is not the shard its manifest entry describes ({self.layout}); prepare the dataset again"
            )

    def read_run(
        self, descriptor: int, first: int, tokens: np.ndarray, loss_mask: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows first.. (as many as `tokens` holds) into `tokens` and `loss_mask`; returns their doc_start_offsets
        (count + 1, as stored) and doc_start_values."""
        count, row_len = len(tokens), self.layout.row_len
        self._read(descriptor, "tokens", tokens, first * row_len)
        if loss_mask is not None:
            self._read(descriptor, "loss_mask", loss_mask, first * row_len)
        offsets = np.empty(count + 1, _OFFSET_DTYPE)
        self._read(descriptor, "doc_start_offsets", offsets, first)
        low, high = int(offsets[0]), int(offsets[-1])
        if not 0 <= low <= high <= self.layout.doc_starts or (offsets[1:] < offsets[:-1]).any():
            raise ValueError(f"{self.path}: damaged doc_start_offsets; prepare the dataset again")
        values = np.empty(high - low, _VALUE_DTYPE)
        self._read(descriptor, "doc_start_values", values, low)
        return offsets, values

    def _read(self, descriptor: int, section: str, into: np.ndarray, first_item: int) -> None:
        start = self._sections[section][0] + first_item * into.itemsize
        buffer, done = memoryview(into).cast("B"), 0
        while done < len(buffer):  # one read returns at most ~2 GB on Linux
            got = os.preadv(descriptor, [buffer[done:]], start + done)
            if got == 0:
                raise ValueError(f"{self.path} is shorter than its manifest entry says; prepare the dataset again")
            done += got


def _split_shards(directory: Path, split: str) -> tuple[list[_Shard], int]:
    """The shards of a split as its manifest lists them, and the length of a row; the manifest and the
    tokenizer are checked by their sha256, the shards by their size."""
    manifest = read_manifest(directory)
    if "tokenizer" in manifest:
        check_file(directory / manifest["tokenizer"].get("file", TOKENIZER_NAME), manifest["tokenizer"]["sha256"])
    row_len = manifest["seq_len"] + 1
    shards = []
    for entry in manifest["splits"][split]["shards"]:
        if "token_dtype" not in entry:
            raise ValueError(
                f"{directory}: shard {entry['file']} is in an older format than this reader's; "
                "prepare the dataset again"
            )
        layout = _Layout(entry["rows"], row_len, entry["token_dtype"], entry["doc_starts"], entry["loss_mask"])
        shards.append(_Shard(directory / entry["file"], layout, entry["sha256"]))
        shards[-1].check_size()
    return shards, row_len


def _close_all(descriptors: dict[int, int]) -> None:
    for descriptor in descriptors.values():
        os.close(descriptor)
    descriptors.clear()
