"""Data prep (corpus -> cleaned, deduplicated, packed token shards; instruction records -> masked shards)
and the reader of its shards."""

from model_core.data.errors import DataPrepError
from model_core.data.instruction_prep import prepare_instructions
from model_core.data.packing import PackedRows
from model_core.data.prepare import PrepResult, prepare_dataset
from model_core.data.shards import SplitRows, open_split, read_shards, write_shard, write_shards

__all__ = [
    "DataPrepError", "PackedRows", "PrepResult", "SplitRows", "open_split", "prepare_dataset", "prepare_instructions",
    "read_shards", "write_shard", "write_shards",
]
