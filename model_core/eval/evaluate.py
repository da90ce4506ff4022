"""One checkpoint (and optionally its LoRA adapters) evaluated as `params.eval` says: held-out loss and
perplexity on each given prepared dataset, and a generation from every prompt, all with the same seed."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import sentencepiece as spm

from model_core.convert.checkpoint import PARAMS
from model_core.data import open_split
from model_core.eval.generate import GenerationConfig, generate_batch
from model_core.eval.perplexity import held_out_loss
from model_core.eval.report import EvalReport, PromptOutput
from model_core.model import Llama
from model_core.model.lora import apply_lora, base_sha256, load_adapters, read_adapters
from model_core.model.weights import load_weights
from model_core.storage import read_weights
from model_core.train.checkpoint import STATE, Checkpoint
from model_core.train.precision import check_precision
from model_core.train.reshard import whole_tensors
from model_core.train.system import device_target
from params.schema import LoraParams, ModelParams, PipelineParams


def evaluate_checkpoint(
    params: PipelineParams,
    checkpoint: str | Path,
    tokenizer_path: str | Path,
    held_out: Mapping[str, str | Path],
    adapters: str | Path | None = None,
) -> EvalReport:
    """`checkpoint`: a directory with model.safetensors; `held_out`: name -> prepared dataset directory
    (its validation split is scored); `adapters`: a directory written by the fine-tune stage, or None."""
    check_precision(params.precision, device_target())
    model = load_model(checkpoint, adapters, params.model, params.precision.compute_dtype)
    adapter_list = [] if adapters is None else [str(adapters)]
    return evaluate_model(model, params, tokenizer_path, held_out, str(checkpoint), adapter_list)


def evaluate_model(
    model: Llama,
    params: PipelineParams,
    tokenizer_path: str | Path,
    held_out: Mapping[str, str | Path],
    checkpoint: str,
    adapters: list[str],
) -> EvalReport:
    """The report of a loaded model; `checkpoint` and `adapters` only name where its weights came from.

    A prompt longer than model.seq_len is an error, raised before any scoring starts.
    """
    tokenizer = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    vocab_limit = tokenizer.get_piece_size()
    if vocab_limit > params.model.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer_path} has {vocab_limit} pieces, more than model.vocab_size={params.model.vocab_size}"
        )
    prompts = [_encode_prompt(tokenizer, prompt, params) for prompt in params.eval.prompts]
    seq_len = params.model.seq_len
    for index, prompt_ids in enumerate(prompts):
        if len(prompt_ids) > seq_len:
            raise ValueError(f"eval.prompts[{index}] is {len(prompt_ids)} tokens long, more than model.seq_len={seq_len}")
    metrics = {}
    for name, dataset_dir in held_out.items():
        rows = open_split(dataset_dir, "validation")
        # Instruction rows (they carry a loss mask) are trained with examples kept apart; score them that way.
        reset = params.train.reset_at_document_boundaries or rows.has_loss_mask
        metrics[name] = held_out_loss(
            model, rows, params.train.micro_batch_size, params.eval.batches, params.tokenizer.pad_id, reset
        )
    config = GenerationConfig.from_params(params.eval)
    # One batch: each prompt's output is the one it generates alone (prompt i seeded by (seed, i)), in fewer steps.
    generations = generate_batch(model, prompts, config, params.tokenizer.eos_id, vocab_limit, params.eval.seed)
    outputs = [
        PromptOutput(prompt, prompt_ids, generation.token_ids, tokenizer.decode(generation.token_ids), generation.stopped_by)
        for prompt, prompt_ids, generation in zip(params.eval.prompts, prompts, generations)
    ]
    return EvalReport(checkpoint, adapters, config, params.eval.seed, metrics, outputs)


def load_model(
    checkpoint: str | Path,
    adapters: str | Path | None = None,
    model: ModelParams | None = None,
    compute_dtype: str = "float32",
) -> Llama:
    """The model stored in `checkpoint` (a converted checkpoint, a merged one, or a training checkpoint of any
    layout), in inference mode, with its LoRA `adapters` if given (rank, alpha and targets as the adapters were
    trained). The architecture comes from the checkpoint's own record (params.json or state.json); `model` is
    needed only for a bare directory holding just model.safetensors, and must agree with a recorded one."""
    model = _model_params(Path(checkpoint), model)
    built = Llama(model, compute_dtype)
    load_weights(built, _whole_weights(checkpoint))
    if adapters is not None:
        base_hash = base_sha256(checkpoint)
        _, config = read_adapters(adapters, base_hash)  # the adapters' own shape, whatever params.lora says
        apply_lora(built, LoraParams(**{key: config[key] for key in ("rank", "alpha", "target_modules")}, dropout=0.0))
        load_adapters(built, adapters, base_hash)
    built.set_train(False)
    return built


def _model_params(checkpoint: Path, given: ModelParams | None) -> ModelParams:
    """The checkpoint's recorded architecture, checked against `given`; `given` for a bare weights directory."""
    if (checkpoint / PARAMS).is_file():
        recorded = ModelParams(**json.loads((checkpoint / PARAMS).read_text()))
    elif (checkpoint / STATE).is_file():
        recorded = ModelParams(**Checkpoint(checkpoint, -1).state()["model"])
    elif given is not None:
        return given
    else:
        raise FileNotFoundError(f"{checkpoint} records no model ({PARAMS} or {STATE}); pass the model params")
    held = recorded.model_dump()
    for key, value in (given.model_dump() if given is not None else {}).items():
        if held[key] != value:
            raise ValueError(f"checkpoint {checkpoint} holds a model with model.{key}={held[key]}, not {value}")
    return recorded


def _encode_prompt(tokenizer: spm.SentencePieceProcessor, prompt: str, params: PipelineParams) -> list[int]:
    """Token ids of a prompt, starting with BOS where data prep starts documents with one."""
    return ([params.tokenizer.bos_id] if params.data.add_bos else []) + tokenizer.encode(prompt)


def _whole_weights(checkpoint: str | Path) -> dict:
    """Weights of a converted or training checkpoint, its tensor-parallel blocks and pipeline stages joined
    if it has several."""
    stored = Checkpoint(Path(checkpoint), -1)
    layout = stored.layout()
    if layout.tp > 1 or layout.pp > 1:
        return whole_tensors(stored)[0]
    return read_weights(checkpoint)
