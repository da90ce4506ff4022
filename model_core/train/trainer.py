"""The training loop: batches in, optimizer steps out, metrics to a callback, checkpoints to disk.

`train(...)` builds the model, the compiled step pieces (model_core.optim.step) and AdamW from params,
optionally resumes from the newest valid checkpoint, and runs `steps` optimizer steps. It knows nothing of
MLflow or Prefect: every `log_interval` steps it hands a metrics record (a flat dict) to `on_metrics`.
A step whose loss or gradient norm is not finite is skipped and counted; `max_consecutive_nonfinite` of
them in a row stop the run with `NonFiniteError`, leaving the last good checkpoint as it was.

Under msrun (params.parallel world size > 1) each rank builds only its share of the model, as the placement
table places it (`model_core.parallel.placement`, `parallelize.build_shard`): with tensor parallelism its tp
block of every weight, with pipeline parallelism its stage's layers (`model_core.parallel.pipeline`: a step's
micro-batches then run through the 1F1B or GPipe schedule, the loss is shared by all stages and the gradient
norm summed over them). Every weight starts as the same block of the single-process initialisation, drawn
from a generator keyed by (seed, path), or read block by block from the initial weights. Each data-parallel
replica trains on its slice of each global batch and sums gradients over its dp group once per optimizer
step; token counts and summed losses are summed too, so the update is the one a single process makes on the
whole global batch. ZeRO-1 shards the Adam moments over the dp group; ZeRO-2 the gradient buffers too,
reduce-scattering each micro-batch's gradients instead of summing once per step; ZeRO-3 the weights too
(`model_core.parallel.zero3`: each rank keeps a shard of every weight and gathers it where it is used, and
checkpoints gather whole weights). ZeRO shards what a rank holds: its tp block, its pipeline stage (a stage
is pruned before ZeRO-3 shards it). Only rank 0 reports metrics. Checkpoints are written by the ranks of
the first dp replica, one file per tp block of each pipeline stage, and resume under another tp or pp
(resharded in memory) or, with the same global batch, another dp.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mindspore as ms
import numpy as np

from model_core.data import open_split
from model_core.model import Llama
from model_core.model.weights import WeightMismatchError, load_weights, model_weights, named_weights
from model_core.optim.adamw import AdamW
from model_core.optim.step import (
    AccumulateGradients,
    ApplyGradients,
    GradientNorm,
    SummedTokenLoss,
    ZeroGradients,
    scalar,
)
from model_core.parallel import comm
from model_core.parallel.data_parallel import GradientAllReduce, broadcast_parameters, sum_over
from model_core.parallel.gradient_norm import ParallelGradientNorm
from model_core.parallel.layout import Layout
from model_core.parallel.parallelize import VocabParallelTokenLoss, build_shard
from model_core.parallel.pipeline import MicroBatch, PipelineStage, SummedVocabParallelLoss
from model_core.parallel.placement import placement_table
from model_core.parallel.pipeline import SummedTokenLoss as StageTokenLoss
from model_core.parallel.zero import ShardedAccumulateGradients, ShardedAdamW
from model_core.parallel.zero3 import Zero3AdamW, shard_parameters
from model_core.train import checkpoint as ckpt
from model_core.train.callbacks import MetricsCallback
from model_core.train.flops import flops_per_token, mfu, peak_flops_for_current_device
from model_core.train.loader import Batch, ShuffledBatches, make_batch, sequential_batches
from model_core.train.precision import LossScale, check_precision
from model_core.train.reshard import blocks_for, stage_tensors
from model_core.train.schedule import learning_rate
from model_core.train.system import device_target, peak_memory_bytes
from params.schema import PipelineParams

RESUME_CHOICES = ("auto", "none")


class NonFiniteError(ArithmeticError):
    """Too many non-finite steps in a row; the message names the step."""


class ResumeError(ValueError):
    """A checkpoint that cannot continue this run; the message says which field differs."""


@dataclass
class TrainResult:
    steps: int
    initial_loss: float
    final_loss: float
    skipped_steps: int
    nonfinite_steps: int
    checkpoint: Path | None
    resumed_from: Path | None
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class _Counters:
    step: int = 0
    skipped: int = 0
    nonfinite: int = 0
    consecutive_nonfinite: int = 0
    initial_loss: float = math.nan
    last_loss: float = math.nan
    tokens_seen: int = 0


class Trainer:
    """One training run over a prepared dataset."""

    def __init__(
        self,
        params: PipelineParams,
        dataset_dir: str | Path,
        checkpoint_dir: str | Path,
        steps: int | None = None,
        initial_weights: str | Path | None = None,
        adapt_model: Callable[[Llama], object] | None = None,
    ):
        """`initial_weights`: a directory with `model.safetensors` (a converted or earlier checkpoint) to start
        from instead of a random initialisation; a resumed checkpoint takes precedence over it.
        `adapt_model(model)` changes the model from outside after those weights are loaded and before the
        optimizer is built (LoRA: wrap projections, freeze the base); only parameters it leaves trainable
        are trained. What it returns is kept as `self.adaptation`. Under tensor parallelism the model is this
        rank's block of the full one (`parallelize`), which LoRA adapters do not know, so it is refused."""
        device = device_target()
        check_precision(params.precision, device)
        self.params = params
        self.steps = steps if steps is not None else params.train.steps
        self.checkpoint_dir = Path(checkpoint_dir)
        self.initial_weights = Path(initial_weights) if initial_weights is not None else None
        check_dataset(dataset_dir, params)
        self.layout, self.rank = _join_layout(params)
        self.dp_group = comm.group(self.layout.dp_group(self.rank))
        self.tp_group = comm.group(self.layout.tp_group(self.rank))
        self.is_reporting = self.rank == 0
        self.writes_checkpoints = self.dp_group.index == 0  # the first dp replica holds every tp block
        if adapt_model is not None and (self.tp_group.size > 1 or self.layout.pp > 1):
            raise ValueError(
                f"adapt_model (LoRA) needs parallel.tensor_parallel=1 and pipeline_parallel=1, not "
                f"{self.tp_group.size} and {self.layout.pp}: its adapters are not split into blocks or stages"
            )
        if adapt_model is not None and params.parallel.zero_stage == 3:
            raise ValueError(
                "adapt_model (LoRA) needs parallel.zero_stage of 2 or less, not 3: ZeRO-3 replaces the projections "
                "LoRA wraps with flat weight shards"
            )
        ms.set_seed(params.train.seed)
        self.table = placement_table(params.model, self.layout, params.parallel.zero_stage)
        self.model, self.tensor_parallelism = build_shard(  # this rank's stage and tp block, nothing more
            params.model, self.table, self.rank, params.train.seed, params.precision.compute_dtype, self.initial_weights
        )
        apply_recompute(self.model, params)
        self.zero3 = (  # each rank keeps its shard of every weight and gathers weights where they are used
            shard_parameters(self.model, self.dp_group) if params.parallel.zero_stage == 3 and self.dp_group.size > 1 else None
        )
        self.adaptation = adapt_model(self.model) if adapt_model is not None else None
        self.model.set_train(True)  # training-only layers (LoRA's dropout) act in the step, not in evaluate()

        train = params.train
        self.micro_batches = params.parallel.micro_batches * train.grad_accum_steps
        self.batches = ShuffledBatches(
            open_split(dataset_dir, "train"),
            global_batch_rows=self.layout.global_batch_rows(
                train.micro_batch_size, params.parallel.micro_batches, train.grad_accum_steps
            ),
            seed=train.seed,
            rank=self.dp_group.index,
            world=self.dp_group.size,
        )
        self.validation = open_split(dataset_dir, "validation")

        zero_stage = params.parallel.zero_stage if self.dp_group.size > 1 else 0
        self.pipeline = None
        if self.layout.pp > 1:  # this rank keeps its stage's layers; a step's micro-batches run the schedule
            self.eval_loss = None
            self.pipeline = self.accumulate = PipelineStage(
                self.model, self.layout, self.rank, params.model, params.parallel.pipeline_schedule, self._stage_loss(),
                zero2_group=self.dp_group if zero_stage == 2 else None,
            )
        elif self.tensor_parallelism is not None:
            self.eval_loss = VocabParallelTokenLoss(self.model, self.tensor_parallelism)
            if zero_stage == 2:  # this tp block's gradients reduce-scattered over dp per micro-batch
                self.accumulate = ShardedAccumulateGradients(self.model, self.dp_group, loss=self.eval_loss)
            else:
                self.accumulate = AccumulateGradients(self.model, loss=self.eval_loss)
        elif zero_stage == 2:  # gradients reduce-scattered per micro-batch into this rank's shard
            self.eval_loss = SummedTokenLoss(self.model)
            self.accumulate = ShardedAccumulateGradients(self.model, self.dp_group)
        else:
            self.eval_loss = SummedTokenLoss(self.model)
            self.accumulate = AccumulateGradients(self.model)
        names = {id(param): name for name, param in named_weights(self.model).items()}
        weight_names = [names[id(param)] for param in self.accumulate.weights]
        if self.zero3 is not None:
            self.optimizer = Zero3AdamW(self.zero3, params.optimizer, weight_names)
        elif zero_stage >= 1:
            self.optimizer = ShardedAdamW(
                self.accumulate.weights, params.optimizer, weight_names, self.dp_group, sharded_gradients=zero_stage == 2,
                shard_length=self.accumulate.shard_length if zero_stage == 2 else None,
            )
        else:
            self.optimizer = AdamW.from_params(self.accumulate.weights, params.optimizer, weight_names)
        summed_once_per_step = self.dp_group.size > 1 and zero_stage < 2
        self.sum_gradients = GradientAllReduce(self.accumulate.buffers, self.dp_group) if summed_once_per_step else None
        if self.tensor_parallelism is None and self.pipeline is None and zero_stage < 2:
            self.norm = GradientNorm(self.accumulate.buffers)  # whole gradients (summed over dp, if any)
        else:
            # The weight each buffer holds gradients of: ZeRO-2's buffers are pieces of this rank's shard.
            owner = self.accumulate.piece_params if zero_stage == 2 else range(len(weight_names))
            counted = self.pipeline.counted_in_norm(self.accumulate.weights) if self.pipeline is not None else None
            self.norm = ParallelGradientNorm(
                self.accumulate.buffers,
                split=[self.tp_group.size > 1 and self.table[weight_names[i]].tp_axis is not None for i in owner],
                counted=[counted[i] for i in owner] if counted is not None else None,
                tp_group=self.tp_group,
                shard_group=self.dp_group if zero_stage >= 2 else None,  # ZeRO-3's buffers are shards too
                pp_group=self.pipeline.group if self.pipeline is not None else None,
            )
        self.apply = ApplyGradients(self.accumulate.buffers, self.optimizer)
        self.zero = ZeroGradients(self.accumulate.buffers)
        self.loss_scale = LossScale.from_params(params.precision)
        self.counters = _Counters()
        self.last_lr = 0.0

        self.flops_per_token = flops_per_token(params.model)
        self.peak_flops = peak_flops_for_current_device(params.precision.compute_dtype)

    # ------------------------------------------------------------------------------------------ resume

    def resume(self, how: str | Path) -> Path | None:
        """`auto`: newest valid checkpoint in checkpoint_dir, if any; `none`: start fresh (from the random
        initialisation or `initial_weights`); or a path."""
        found = self._find_checkpoint(how)
        if found is None:
            return None
        state = found.state()
        self._check_compatible(state, found.path)
        weights, moments = blocks_for(found, self.tp_group.size, self.tp_group.index)  # resharded if tp differs
        if self.pipeline is not None:  # this stage's layers, whatever stages the checkpoint was saved with
            owned = (stage_tensors(t, self.table, self.pipeline.stage) for t in (weights, moments))
            weights, moments = owned
        if self.zero3 is not None:
            self.zero3.load_full_weights(weights)
        else:
            try:
                load_weights(self.model, weights)
            except WeightMismatchError as error:
                raise ResumeError(f"checkpoint {found.path}: {error}") from error
        self.optimizer.load_state_dict(moments)
        self.batches.load_state_dict(state["data"])
        self.loss_scale.load_state_dict(state["loss_scale"])
        self.counters = _Counters(**state["counters"])
        return found.path

    def _find_checkpoint(self, how: str | Path) -> ckpt.Checkpoint | None:
        if how == "none":
            return None
        found = ckpt.latest_valid(self.checkpoint_dir) if how == "auto" else ckpt.Checkpoint(Path(how), -1)
        if found is None:
            return None
        if how != "auto" and (problem := ckpt.verify(found)):
            raise ResumeError(f"checkpoint {found.path} is not usable: {problem}")
        return found

    def _check_compatible(self, state: dict, path: Path) -> None:
        saved, ours = state["model"], self.params.model.model_dump(mode="json")
        for key, value in ours.items():
            if saved.get(key) != value:
                raise ResumeError(
                    f"checkpoint {path} was made with model.{key}={saved.get(key)}, this run has model.{key}={value}"
                )

    # --------------------------------------------------------------------------------------------- run

    def run(self, on_metrics: MetricsCallback | None = None, resume: str | Path = "none") -> TrainResult:
        resumed_from = self.resume(resume)
        if self.zero3 is None:  # ZeRO-3 ranks hold different shards of the same seeded model
            broadcast_parameters(self.accumulate.weights, self.dp_group, root=self.dp_group.ranks[0])
        history: list[dict[str, float]] = []
        train = self.params.train
        last_checkpoint = resumed_from
        window_tokens, window_start = 0, time.perf_counter()
        while self.counters.step < self.steps:
            loss, grad_norm, tokens = self._optimizer_step()
            window_tokens += tokens
            step = self.counters.step
            if step % train.log_interval == 0 or step == self.steps:
                elapsed = time.perf_counter() - window_start
                record = self._record(loss, grad_norm, window_tokens / max(elapsed, 1e-9))
                if step % train.eval_interval == 0 or step == self.steps:
                    record["validation_loss"] = self.evaluate()
                history.append(record)
                if on_metrics is not None and self.is_reporting:
                    on_metrics(record)
                window_tokens, window_start = 0, time.perf_counter()
            due = step % train.checkpoint_interval == 0 or step == self.steps
            if due and self.counters.consecutive_nonfinite == 0:  # never replace good checkpoints with bad weights
                saved = self.save()
                last_checkpoint = saved.path if saved is not None else None
        comm.barrier()  # ranks leave together, so a launcher can treat an early exit as a failure
        return TrainResult(
            steps=self.counters.step,
            initial_loss=self.counters.initial_loss,
            final_loss=self.counters.last_loss,
            skipped_steps=self.counters.skipped,
            nonfinite_steps=self.counters.nonfinite,
            checkpoint=last_checkpoint,
            resumed_from=resumed_from,
            history=history,
        )

    def _optimizer_step(self) -> tuple[float, float, int]:
        """k micro-batches, one update (or a skip). Returns (mean loss, gradient norm, tokens processed)."""
        rows = self.batches.next_rows()  # this step's global batch, cut into k micro-batches
        size = self.params.train.micro_batch_size
        micro = [self._batch(rows.take(np.arange(i, i + size))) for i in range(0, len(rows), size)]
        [counted] = sum_over(self.dp_group, [sum(batch.counted_tokens for batch in micro)])
        scale = scalar(self.loss_scale.scale / max(counted, 1))
        summed = self._accumulate(micro, scale)
        if self.sum_gradients is not None:
            self.sum_gradients()  # once per optimizer step, not per micro-batch
        [summed] = sum_over(self.dp_group, [summed])
        loss = summed / max(counted, 1)
        grad_norm = float(self.norm(scalar(1.0 / self.loss_scale.scale)).asnumpy())
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        self.loss_scale.update(finite)
        counters = self.counters
        step = counters.step
        if finite:
            clip = self.params.optimizer.grad_clip
            coefficient = min(1.0, clip / (grad_norm + 1e-6)) if clip is not None else 1.0
            lr = learning_rate(step, self.steps, self.params.optimizer)
            self.last_lr = lr
            self.apply(scalar(lr), scalar(step + 1), scalar(coefficient / self.loss_scale.scale))
            counters.consecutive_nonfinite = 0
            if math.isnan(counters.initial_loss):
                counters.initial_loss = loss
            counters.last_loss = loss
        else:
            self.zero()
            counters.skipped += 1
            counters.nonfinite += 1
            counters.consecutive_nonfinite += 1
            if counters.consecutive_nonfinite >= self.params.train.max_consecutive_nonfinite:
                raise NonFiniteError(
                    f"step {step + 1}: loss {loss} / gradient norm {grad_norm} not finite for "
                    f"{counters.consecutive_nonfinite} steps in a row (train.max_consecutive_nonfinite="
                    f"{self.params.train.max_consecutive_nonfinite}); the last good checkpoint is kept"
                )
        counters.step += 1
        tokens = sum(batch.tokens.size for batch in micro) * self.dp_group.size
        counters.tokens_seen += tokens
        return loss, grad_norm, tokens

    def _accumulate(self, micro: list[Batch], scale: ms.Tensor) -> float:
        """Forward and backward of a step's micro-batches, gradients added into the buffers; their summed token
        loss. Under pipeline parallelism they go through the schedule `parallel.micro_batches` at a time."""
        if self.pipeline is None:
            return sum(float(self.accumulate(*_inputs(batch), scale).asnumpy()) for batch in micro)
        per_pass = self.params.parallel.micro_batches
        passes = [micro[i : i + per_pass] for i in range(0, len(micro), per_pass)]
        return sum(self.pipeline.run([_micro_batch(batch) for batch in one], scale) for one in passes)

    def _stage_loss(self) -> ms.nn.Cell:
        """The last pipeline stage's summed token loss, from full or vocab-parallel logits."""
        if self.tensor_parallelism is None:
            return StageTokenLoss()
        return SummedVocabParallelLoss(self.tensor_parallelism.vocab_start, self.tensor_parallelism.group)

    def _batch(self, rows) -> Batch:
        return make_batch(rows, self.params.tokenizer.pad_id, self.params.train.reset_at_document_boundaries)

    def _record(self, loss: float, grad_norm: float, tokens_per_second: float) -> dict[str, float]:
        step = self.counters.step
        record = {
            "step": step,
            "loss": loss,
            "lr": self.last_lr,
            "grad_norm": grad_norm,
            "tokens_per_second": tokens_per_second,
            "tokens_seen": self.counters.tokens_seen,
            "peak_memory_bytes": peak_memory_bytes(),
            "loss_scale": self.loss_scale.scale,
            "skipped_steps": self.counters.skipped,
        }
        utilisation = mfu(tokens_per_second, self.flops_per_token, self.peak_flops)
        if utilisation is not None:
            record["mfu"] = utilisation
        if self.pipeline is not None:  # of the step's last pipeline pass, over all stages
            record["pipeline_bubble"] = self.pipeline.last_timing.bubble()
        return record

    def evaluate(self) -> float:
        """Mean token loss over the first `train.eval_batches` validation micro-batches. Every rank calls it:
        the dp replicas take turns over the batches and sum (no replica idles at its next collective while
        another evaluates, which can outlast the backend's collective timeout)."""
        train = self.params.train
        total, counted = 0.0, 0
        batches = sequential_batches(
            self.validation, train.micro_batch_size, train.eval_batches, self.params.tokenizer.pad_id,
            train.reset_at_document_boundaries,
        )
        self.model.set_train(False)
        try:
            if self.zero3 is not None:
                total, counted = self._evaluate_in_lockstep(list(batches))
            else:  # under pipeline parallelism every stage of this replica's pipeline takes part
                for index, batch in enumerate(batches):
                    if index % self.dp_group.size == self.dp_group.index:
                        total += self._summed_loss(batch)
                        counted += batch.counted_tokens
        finally:
            self.model.set_train(True)
        total, counted = sum_over(self.dp_group, [total, counted])
        return total / counted if counted else math.nan

    def _evaluate_in_lockstep(self, batches: list[Batch]) -> tuple[float, int]:
        """ZeRO-3's share of `evaluate`: every forward gathers weights over the dp group, so every replica runs
        the same number of them; a replica with no batch left in the last round repeats one and counts nothing."""
        total, counted = 0.0, 0
        size, index = self.dp_group.size, self.dp_group.index
        for start in range(0, len(batches), size):
            mine = start + index
            summed = self._summed_loss(batches[min(mine, len(batches) - 1)])
            if mine < len(batches):
                total += summed
                counted += batches[mine].counted_tokens
        return total, counted

    def _summed_loss(self, batch: Batch) -> float:
        """The summed token loss of one batch, forward only (through every stage of a pipeline)."""
        if self.pipeline is not None:
            return self.pipeline.loss(_micro_batch(batch))
        _, summed = self.eval_loss(*_inputs(batch), scalar(1.0))
        return float(summed.asnumpy())

    # ------------------------------------------------------------------------------------- checkpoints

    def save(self) -> ckpt.Checkpoint | None:
        """Every rank calls it (gathering ZeRO-sharded moments and the write itself are collective). The first
        dp replica's ranks write their tp blocks; rank 0 commits and returns the checkpoint."""
        moments = self.optimizer.state_dict()
        gathered = self.zero3.full_weights() if self.zero3 is not None else None  # collective under ZeRO-3
        block = ckpt.block_index(self.layout, self.layout.coordinates(self.rank).pp, self.tp_group.index)
        shards = {block: (gathered or model_weights(self.model), moments)} if self.writes_checkpoints else {}
        state = None if not self.is_reporting else {
            "step": self.counters.step,
            "counters": vars(self.counters),
            "data": self.batches.state_dict(),
            "loss_scale": self.loss_scale.state_dict(),
            "model": self.params.model.model_dump(mode="json"),
            "lora": self.params.lora.model_dump(mode="json") if self.adaptation is not None else None,  # its adapters
            "rng": {"seed": self.params.train.seed},
        }
        return ckpt.save_shards(
            self.checkpoint_dir, self.counters.step, shards, state, self.layout,
            keep=self.params.train.keep_checkpoints, barrier=comm.barrier,
        )


def _join_layout(params: PipelineParams) -> tuple[Layout, int]:
    """(layout, this rank): joins the msrun job when params ask for more than one rank."""
    if params.parallel.world_size > 1:
        if not comm.launched_by_msrun():
            raise ValueError(
                f"params.parallel asks for {params.parallel.world_size} ranks; start them with `llmflow train` "
                "(which launches msrun) or model_core.parallel.launch, not as one process"
            )
        comm.init()
    return Layout.from_params(params, comm.world_size()), comm.rank()


def check_dataset(dataset_dir: str | Path, params: PipelineParams) -> None:
    """The prepared data must have been made for this model's vocabulary and sequence length."""
    manifest = json.loads((Path(dataset_dir) / "manifest.json").read_text())
    for field in ("vocab_size", "seq_len"):
        made_for, wanted = manifest[field], getattr(params.model, field)
        if made_for != wanted:
            raise ValueError(
                f"dataset {dataset_dir} was prepared for {field}={made_for} but model.{field}={wanted}; "
                "prepare the data again with these params"
            )


def _inputs(batch: Batch) -> tuple:
    """The step's tensor inputs; the document-reset ones stay None unless the loader made them."""
    positions = None if batch.position_ids is None else ms.Tensor(batch.position_ids)
    segments = None if batch.segment_ids is None else ms.Tensor(batch.segment_ids)
    return ms.Tensor(batch.tokens), ms.Tensor(batch.labels), ms.Tensor(batch.loss_mask), positions, segments


def _micro_batch(batch: Batch) -> MicroBatch:
    return MicroBatch(*_inputs(batch))


def apply_recompute(model: Llama, params: PipelineParams) -> list[int]:
    """Mark blocks for activation recomputation from outside the model; returns their indices."""
    choice = params.recompute
    layers = range(params.model.num_layers)
    if choice.mode == "all":
        chosen = list(layers)
    elif choice.mode == "selected":
        chosen = list(choice.layers) if choice.layers else [i for i in layers if i % choice.every_k == 0]
    else:
        chosen = []
    for index in chosen:
        model.layers[index].recompute()
    return chosen
