"""Training checks what it reads: one byte changed in any file of a prepared dataset stops `llmflow train` and
the Trainer before their first step, with one line naming the file and both sha256s."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import SMALL_MODEL

from model_core.data import DatasetDamagedError, prepare_dataset
from model_core.data.shards import _Layout
from model_core.train.trainer import Trainer
from params import load_params


def _overrides(corpus, output_dir, train_dir) -> list[str]:
    return [
        f"data.sources=[{{kind: jsonl, paths: ['{corpus}']}}]",
        f"data.output_dir={output_dir}",
        *SMALL_MODEL,
        "train.steps=2",
        "train.eval_interval=1000",
        "train.eval_batches=2",
        f"train.output_dir={train_dir}",
    ]


@pytest.fixture(scope="module")
def prepared(corpus_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity-data")
    params = load_params("tiny", _overrides(corpus_jsonl, out, out / "unused"))
    return prepare_dataset(params.data, params.tokenizer, params.model)


def _section_byte(dataset, split: str, section: str) -> tuple[str, int]:
    """The first shard of a split, and a byte in the middle of one of its sections."""
    manifest = json.loads((dataset / "manifest.json").read_text())
    entry = manifest["splits"][split]["shards"][0]
    layout = _Layout(entry["rows"], manifest["seq_len"] + 1, entry["token_dtype"], entry["doc_starts"], entry["loss_mask"])
    offset, size = layout.sections()[section]
    return entry["file"], offset + size // 2


def _damage(dataset, kind: str):
    """Flip one bit of one byte of the file `kind` names, keeping its size; the damaged path."""
    if kind.startswith(("train:", "validation:")):
        name, at = _section_byte(dataset, *kind.split(":"))
    elif kind == "manifest.sha256":
        name, at = kind, 0
        while not (dataset / name).read_bytes()[at : at + 1].isdigit():  # a digit flips to a digit: still hex
            at += 1
    else:
        name = kind
        at = (dataset / name).stat().st_size // 2
    path = dataset / name
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    return path


KINDS = [
    "manifest.json",
    "manifest.sha256",
    "tokenizer.model",
    "train:header",
    "train:tokens",
    "train:doc_start_offsets",
    "train:doc_start_values",
    "validation:tokens",
]


def _assert_names_file_and_hashes(message: str, path, dataset) -> None:
    manifest_damaged = path.name in ("manifest.json", "manifest.sha256")
    named = dataset / "manifest.json" if manifest_damaged else path
    pattern = rf"{re.escape(str(named))} has sha256 ([0-9a-f]{{64}}) but manifest\.(json|sha256) gives ([0-9a-f]{{64}}): "
    found = re.match(pattern, message)
    assert found and found.group(1) != found.group(3), message
    assert message.endswith(f"delete {dataset} to have the dataset prepared again") and "\n" not in message


@pytest.mark.parametrize("kind", KINDS)
def test_a_changed_byte_in_any_dataset_file_stops_the_trainer_before_its_first_step(prepared, corpus_jsonl, tmp_path, kind):
    dataset = tmp_path / prepared.output_dir.name
    shutil.copytree(prepared.output_dir, dataset)
    path = _damage(dataset, kind)
    params = load_params("tiny", _overrides(corpus_jsonl, tmp_path, tmp_path / "train"))
    records = []
    with pytest.raises(DatasetDamagedError) as caught:
        Trainer(params, dataset, tmp_path / "ckpt").run(on_metrics=records.append)
    _assert_names_file_and_hashes(str(caught.value), path, dataset)
    assert records == [] and not (tmp_path / "ckpt").exists()


def test_llmflow_train_on_a_shard_with_a_changed_byte_exits_with_one_line(prepared, corpus_jsonl, tmp_path, capsys):
    from flows.cli import main

    out = tmp_path / "data"
    shutil.copytree(prepared.output_dir, out / prepared.output_dir.name)
    dataset = out / prepared.output_dir.name
    path = _damage(dataset, "train:tokens")  # same size: data.verify_on_reuse=size reuses it, training must not
    arguments = [f"--set={value}" for value in _overrides(corpus_jsonl, out, tmp_path / "train")]
    assert main(["train", "--params", "tiny", *arguments]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("llmflow train: ")
    _assert_names_file_and_hashes(last.removeprefix("llmflow train: "), path, dataset)
    assert not list((tmp_path / "train").rglob("step-*"))
