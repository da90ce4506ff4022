"""Data prep (corpus -> cleaned, deduplicated, packed token shards; instruction records -> masked shards)
and the reader of its shards."""

from model_core.data.errors import DataPrepError
from model_core.data.instruction_prep import prepare_instructions
from model_core.data.packing import PackedRows
from model_core.data.prepare import PrepResult, prepare_dataset
from model_core.data.shards import (
    DatasetDamagedError,
    SplitRows,
    open_split,
    read_manifest,
    read_shards,
    write_manifest,
    write_shard,
    write_shards,
)

__all__ = [
    "DataPrepError", "DatasetDamagedError", "PackedRows", "PrepResult", "SplitRows", "open_split", "prepare_dataset",
    "prepare_instructions", "read_manifest", "read_shards", "write_manifest", "write_shard", "write_shards",
]
