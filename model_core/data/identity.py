"""What a prepared split is, for lineage: a name, a digest of its content, where it lies and which input files
it was made from, read from the dataset's manifest (checked against manifest.sha256) without reading a shard.

The digest hashes the split's content as the manifest records it: the tokenizer's sha256 and the sha256 of
every shard of the split, in order. Prep writes the same shards whatever built them (the mapper, the number
of workers, data.shard_bytes, an interrupted or incremental run), so the same tokens give the same digest
however they were made, and in whatever directory; training checks each shard it reads against that sha256.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from model_core.data.shards import read_manifest

DIGEST_CHARS = 16  # of the sha256's hex digits: tells datasets apart, and stays readable where it is shown
PRETRAINING, INSTRUCTIONS = "pretraining", "instructions"


@dataclass(frozen=True)
class InputDigest:
    path: str
    sha256: str  # of the file's content; the standard library's docstrings by their fingerprint


@dataclass(frozen=True)
class SplitIdentity:
    kind: str  # pretraining or instructions
    split: str  # train or validation
    digest: str
    directory: Path
    inputs: tuple[InputDigest, ...]  # empty for a dataset whose manifest does not list its inputs
    profile: dict[str, int]  # the split's documents (or examples), rows, tokens and shards; the dataset's seq_len

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.split}"


def split_identities(directory: str | Path, splits: tuple[str, ...] = ("train", "validation")) -> list[SplitIdentity]:
    """The identities of the `splits` of the prepared dataset (pretraining or instructions) in `directory` that
    hold rows (a split held out at data.validation_fraction=0 is empty, and nothing reads it)."""
    directory = Path(directory).resolve()
    manifest = read_manifest(directory)
    return [_identity(directory, manifest, split) for split in splits if manifest["splits"][split]["rows"]]


def _identity(directory: Path, manifest: dict, split: str) -> SplitIdentity:
    entry = manifest["splits"][split]
    content = {"tokenizer_sha256": manifest["tokenizer"]["sha256"], "shards": [shard["sha256"] for shard in entry["shards"]]}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:DIGEST_CHARS]
    counted = ("documents", "examples", "rows", "tokens")  # a pretraining split counts documents, instructions examples
    profile = {key: entry[key] for key in counted if key in entry}
    profile.update(shards=len(entry["shards"]), seq_len=manifest["seq_len"])
    return SplitIdentity(dataset_kind(manifest), split, digest, directory, input_digests(manifest), profile)


def dataset_kind(manifest: dict) -> str:
    return INSTRUCTIONS if manifest.get("kind") == INSTRUCTIONS else PRETRAINING


def input_digests(manifest: dict) -> tuple[InputDigest, ...]:
    """The input files a dataset was made from with their content's sha256: a pretraining manifest lists them
    under `inputs`; an instruction manifest's `input_fingerprint` is their list as `path<TAB>sha256` lines."""
    if "inputs" in manifest:
        return tuple(InputDigest(item["path"], item["sha256"]) for item in manifest["inputs"])
    listed = manifest.get("input_fingerprint")
    if isinstance(listed, list):
        return tuple(InputDigest(*line.rsplit("\t", 1)) for line in listed)
    return ()
