"""Evaluate one checkpoint, with or without LoRA adapters, the same way every time: held-out loss and
perplexity on the validation split of each named dataset, then generations from the fixed prompts of
params.eval with its decoding settings and seed. Two checkpoints evaluated with the same params compare
fairly: same batches, same prompts, same draws.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import sentencepiece as spm

from model_core.convert import read_weights
from model_core.data.instruction_prep import KIND as INSTRUCTIONS_KIND
from model_core.data.shards import MANIFEST_NAME
from model_core.eval.generate import GenerationConfig, generate
from model_core.eval.perplexity import held_out_loss
from model_core.eval.report import EvalReport, PromptOutput
from model_core.model import Llama
from model_core.model.lora import apply_lora, base_sha256, load_adapters, read_adapters
from model_core.train.loader import load_split
from model_core.train.trainer import load_weights
from params.schema import LoraParams, PipelineParams


def load_model(params: PipelineParams, checkpoint: str | Path, adapters: str | Path | None = None) -> Llama:
    """The model of a checkpoint directory (training step or converted), with adapters applied when given.
    Adapters made for another base are refused (`AdapterMismatchError`)."""
    model = Llama(params.model, params.precision.compute_dtype)
    load_weights(model, read_weights(checkpoint))
    if adapters is not None:
        base_hash = base_sha256(checkpoint)
        _, config = read_adapters(adapters, base_hash)
        lora = LoraParams(rank=config["rank"], alpha=config["alpha"], target_modules=config["target_modules"], dropout=0.0)
        apply_lora(model, lora)
        load_adapters(model, adapters, base_hash)
    model.set_train(False)
    return model


def evaluate_checkpoint(
    params: PipelineParams,
    checkpoint: str | Path,
    tokenizer_path: str | Path,
    held_out: Mapping[str, str | Path],
    adapters: str | Path | None = None,
) -> EvalReport:
    """`held_out`: name -> prepared dataset directory; the first `eval.batches` batches of its validation split
    are scored. Prompts are encoded with the pretraining tokenizer (BOS first) and decoded back to text."""
    model = load_model(params, checkpoint, adapters)
    evaluation, train = params.eval, params.train
    metrics = {
        name: held_out_loss(
            model, load_split(directory, "validation"), train.micro_batch_size, evaluation.batches,
            params.tokenizer.pad_id, _resets_at_documents(directory, params),
        )
        for name, directory in held_out.items()
    }
    tokenizer = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    config = GenerationConfig.from_params(evaluation)
    outputs = []
    for index, prompt in enumerate(evaluation.prompts):
        prompt_ids = [params.tokenizer.bos_id, *tokenizer.encode(prompt)]
        generation = generate(
            model, prompt_ids, config, params.tokenizer.eos_id, tokenizer.get_piece_size(), evaluation.seed,
            prompt_index=index,
        )
        text = tokenizer.decode([t for t in generation.token_ids if t != params.tokenizer.eos_id])
        outputs.append(PromptOutput(prompt, prompt_ids, generation.token_ids, text, generation.stopped_by))
    return EvalReport(
        checkpoint=str(checkpoint),
        adapters=[str(adapters)] if adapters is not None else [],
        decoding=config,
        seed=evaluation.seed,
        held_out=metrics,
        generations=outputs,
    )


def _resets_at_documents(dataset_dir: str | Path, params: PipelineParams) -> bool:
    """Scored the way it is trained on: packed instruction examples never see each other (see
    model_core.train.finetune), pretraining rows follow train.reset_at_document_boundaries."""
    manifest = json.loads((Path(dataset_dir) / MANIFEST_NAME).read_text())
    return manifest.get("kind") == INSTRUCTIONS_KIND or params.train.reset_at_document_boundaries
