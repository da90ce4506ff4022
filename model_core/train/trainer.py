"""The training loop: batches in, optimizer steps out, metrics to a callback, checkpoints to disk.

`Trainer(params, ...)` joins the msrun job when params ask for more than one rank, has
`model_core.parallel.parallelize` build this rank's shard of the model and wire its step for the layout (the
one place where layouts are composed), then drives that `Parallelized` the same way for every layout:
optionally resume from the newest valid checkpoint (or continue an earlier run's), then run `steps` optimizer
steps. It knows nothing of MLflow or Prefect: every `log_interval` steps it hands a metrics record (a flat
dict) to `on_metrics`.
A step whose loss or gradient norm is not finite is skipped and counted; `max_consecutive_nonfinite` of
them in a row stop the run with `NonFiniteError`, leaving the last good checkpoint as it was.

Each data-parallel replica trains on its slice of each global batch, and each context-parallel rank of a replica
on its part of every sequence of that slice; token counts and summed losses are summed over dp x cp, so the update
is the one a single process makes on the whole global batch. Only rank 0
reports metrics. Checkpoints are written by the ranks of the first dp replica, one file per tp block of each
pipeline stage (ZeRO shards gathered whole), and resume under another tp or pp (resharded in memory), dp,
micro-batch size or global batch: the data position is the number of samples of the mixture consumed.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import mindspore as ms
import numpy as np

from model_core.data import open_split, read_manifest
from model_core.data.mixture import MixtureSource, mixture_sources
from model_core.host_memory import release_free_heap
from model_core.model.moe import router_noise
from model_core.model.weights import WeightMismatchError
from model_core.optim.step import scalar
from model_core.parallel import comm, heartbeat
from model_core.parallel.data_parallel import sum_over
from model_core.parallel.layout import Layout
from model_core.parallel.parallelize import parallelize
from model_core.parallel.pipeline import MicroBatch
from model_core.train import checkpoint as ckpt
from model_core.train.callbacks import MetricsCallback
from model_core.train.flops import flops_per_token, mfu, peak_flops_for_current_device
from model_core.train.loader import Batch, ShuffledBatches, context_shard, make_batch, sequential_batches
from model_core.train.precision import LossScale, check_precision
from model_core.train.reshard import blocks_for, stage_tensors
from model_core.train.schedule import learning_rate
from model_core.train.system import device_target, peak_memory_bytes
from params.schema import LoraParams, ModelParams, PipelineParams

RESUME_CHOICES = ("auto", "none")

logger = logging.getLogger(__name__)


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
    continued_from: Path | None = None
    schedule_start: int = 0  # the step this run's learning-rate schedule starts at (that of the run it continues)


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
        lora: LoraParams | None = None,
        continue_from: str | Path | None = None,
    ):
        """`initial_weights`: a directory with `model.safetensors` (a converted or earlier checkpoint) to start
        from instead of a random initialisation; a resumed checkpoint takes precedence over it. `lora`: train
        LoRA adapters (and nothing else) on top of those weights. `continue_from`: a training checkpoint of an
        earlier run (on other data) whose weights, AdamW moments, loss scale and step number this run starts
        from when it has no checkpoint of its own to resume; it then trains `steps` more steps, its learning-rate
        warmup and decay run again over them, and the data is read from its first sample (each source's epochs
        going on from the earlier run's count)."""
        device = device_target()
        check_precision(params.precision, device)
        self.params = params
        self.steps = steps if steps is not None else params.train.steps
        self.checkpoint_dir = Path(checkpoint_dir)
        self.initial_weights = Path(initial_weights) if initial_weights is not None else None
        self.continue_from = Path(continue_from) if continue_from is not None else None
        self.schedule_start = 0
        sources = check_dataset(dataset_dir, params)
        self.layout, self.rank = _join_layout(params)
        ms.set_seed(params.train.seed)
        self.parallel = parallelize(params, self.layout, self.rank, self.initial_weights, lora)
        self.model, self.optimizer = self.parallel.model, self.parallel.optimizer
        self.adaptation = self.parallel.adaptation
        self.dp_group = self.parallel.dp_group  # dp x cp: the ranks that sum token counts and losses
        self.data_group, self.cp_group = self.parallel.data_group, self.parallel.cp_group
        self.is_reporting = self.rank == 0
        self.writes_checkpoints = self.dp_group.index == 0  # the first dp replica holds every tp block

        train = params.train
        self.batches = ShuffledBatches(
            open_split(dataset_dir, "train"),
            global_batch_rows=self.layout.global_batch_rows(
                train.micro_batch_size, params.parallel.micro_batches, train.grad_accum_steps
            ),
            seed=train.seed,
            rank=self.data_group.index,
            world=self.data_group.size,
            sources=sources,
        )
        self.batch_change: tuple[int, int] | None = None  # (saved, this run's) global batch rows of a resume across them
        self.epochs_reported: dict[str, int] = {}  # whole epochs of each source the log has announced
        self.validation = open_split(dataset_dir, "validation")
        # First read at the first evaluation, steps into the run: a damaged shard there stops the run before it starts.
        self.validation.check(np.arange(min(len(self.validation), train.eval_batches * train.micro_batch_size)))
        self.loss_scale = LossScale.from_params(params.precision)
        self.counters = _Counters()
        self.last_lr = 0.0
        self.last_routing: dict[str, float] = {}  # a mixture-of-experts model's routing metrics of the last step
        self.flops_per_token = flops_per_token(params.model)
        self.peak = peak_flops_for_current_device(params.precision.compute_dtype)
        self.compiled: set[str] = set()  # the phases whose graphs have been compiled (`_after_phase`)

    # ------------------------------------------------------------------------------------------ resume

    @property
    def final_step(self) -> int:
        return self.schedule_start + self.steps

    def resume(self, how: str | Path) -> Path | None:
        """`auto`: newest valid checkpoint in checkpoint_dir, if any; `none`: start fresh (from `continue_from`,
        `initial_weights` or the random initialisation); or a path. Returns the resumed checkpoint."""
        found = self._find_checkpoint(how)
        if found is None:
            if self.continue_from is not None:
                self._continue(self.continue_from)
            return None
        state = self._load(found)
        self.batches.load_state_dict(state["data"])
        saved_batch = state["data"]["global_batch_rows"]
        if saved_batch != self.batches.global_batch_rows:
            self.batch_change = (saved_batch, self.batches.global_batch_rows)
            logger.warning(
                "resuming %s at sample %d of the data: saved under a global batch of %d rows, continuing with %d",
                found.path, self.batches.samples, saved_batch, self.batches.global_batch_rows,
            )
        self.counters = _Counters(**state["counters"])
        self.schedule_start = state.get("schedule_start", 0)
        return found.path

    def _continue(self, path: Path) -> None:
        found = ckpt.Checkpoint(path, -1)
        if problem := ckpt.verify(found):
            raise ResumeError(f"checkpoint {path} to continue from is not usable: {problem}")
        state = self._load(found)
        # The position belongs to the earlier data: this data starts at its first sample, each source going on
        # from the epochs the earlier run read of it (data/mixture.py).
        self.batches.mixture.carry(state["data"].get("epochs", {}))
        self.schedule_start = state["step"]
        self.counters = _Counters(step=state["step"], tokens_seen=state["counters"]["tokens_seen"])

    def _load(self, found: ckpt.Checkpoint) -> dict:
        """Weights, moments and loss scale of a checkpoint into this rank's shard; returns its state."""
        state = found.state()
        self._check_compatible(state, found.path)
        at = self.layout.coordinates(self.rank)
        weights, moments = blocks_for(found, self.layout.tp, at.tp)  # resharded if tp differs
        try:
            self.parallel.load_weights(weights)  # this stage's layers, whatever stages the checkpoint was saved with
        except WeightMismatchError as error:
            raise ResumeError(f"checkpoint {found.path}: {error}") from error
        self.optimizer.load_state_dict(stage_tensors(moments, self.parallel.table, at.pp))
        self.loss_scale.load_state_dict(state["loss_scale"])
        return state

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
        """Train to `self.steps`. With optimizer offload its file is released when the run ends, normally or by an
        exception (a later run needs a new Trainer, which resumes from the checkpoints)."""
        try:
            return self._run(on_metrics, resume)
        finally:
            self.parallel.close()

    def _run(self, on_metrics: MetricsCallback | None, resume: str | Path) -> TrainResult:
        resumed_from = self.resume(resume)
        self._after_phase("resume", always=True)  # a checkpoint's arrays, read and placed
        history: list[dict[str, float]] = []
        train = self.params.train
        last_checkpoint = resumed_from
        window_tokens, window_start = 0, time.perf_counter()
        while self.counters.step < self.final_step:
            loss, grad_norm, tokens = self._optimizer_step()
            window_tokens += tokens
            step = self.counters.step
            if step % train.log_interval == 0 or step == self.final_step:
                elapsed = time.perf_counter() - window_start
                record = self._record(loss, grad_norm, window_tokens / max(elapsed, 1e-9))
                if step % train.eval_interval == 0 or step == self.final_step:
                    record["validation_loss"] = self.evaluate()
                history.append(record)
                if on_metrics is not None and self.is_reporting:
                    on_metrics(record)
                window_tokens, window_start = 0, time.perf_counter()
            due = step % train.checkpoint_interval == 0 or step == self.final_step
            if due and self.counters.consecutive_nonfinite == 0:  # never replace good checkpoints with bad weights
                saved = self.save()
                last_checkpoint = saved.path if saved is not None else None
        heartbeat.phase("end")
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
            continued_from=self.continue_from if resumed_from is None else None,
            schedule_start=self.schedule_start,
        )

    def _optimizer_step(self) -> tuple[float, float, int]:
        """k micro-batches, one update (or a skip). Returns (mean loss, gradient norm, tokens processed)."""
        heartbeat.phase("forward-backward", step=self.counters.step + 1)  # its compiled graph sums the gradients
        rows = self.batches.next_rows()  # this step's global batch, cut into k micro-batches
        size = self.params.train.micro_batch_size
        micro = [self._batch(rows.take(np.arange(i, i + size))) for i in range(0, len(rows), size)]
        [counted] = sum_over(self.dp_group, [sum(batch.counted_tokens for batch in micro)])
        scale = scalar(self.loss_scale.scale / max(counted, 1))
        noise = self._router_noise(len(rows), size, micro[0].tokens.shape[1])
        summed = self.parallel.gradients([_micro_batch(batch, n) for batch, n in zip(micro, noise)], scale)
        self._after_phase("gradients")
        routing = self.parallel.routing_statistics()
        # One host all-reduce carries the summed loss and the routing statistics together.
        summed, *routing_sums = sum_over(self.dp_group, [summed, *(routing if routing is not None else [])])
        loss = summed / max(counted, 1)
        if routing is not None:
            self.last_routing = routing_metrics(routing_sums, counted, self.params.model)
        heartbeat.phase("gradient norm")
        grad_norm = self.parallel.gradient_norm(scalar(1.0 / self.loss_scale.scale))
        self._after_phase("gradient norm")
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        self.loss_scale.update(finite)
        counters = self.counters
        step = counters.step
        if finite:
            clip = self.params.optimizer.grad_clip
            coefficient = min(1.0, clip / (grad_norm + 1e-6)) if clip is not None else 1.0
            lr = learning_rate(step - self.schedule_start, self.steps, self.params.optimizer)
            self.last_lr = lr
            heartbeat.phase("update")
            self.parallel.apply(scalar(lr), scalar(step + 1), scalar(coefficient / self.loss_scale.scale))
            self._after_phase("update")
            counters.consecutive_nonfinite = 0
            if math.isnan(counters.initial_loss):
                counters.initial_loss = loss
            counters.last_loss = loss
        else:
            self.parallel.discard_gradients()
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

    def _after_phase(self, phase: str, always: bool = False) -> None:
        """Return the heap's free pages to the system after a phase's first call (which compiled its graph: the
        compiler's scratch, hundreds of MB on a large model, is freed but kept by glibc, and the next step's peak
        would land on top of it), or after every call where `always` (a checkpoint's arrays)."""
        if always or phase not in self.compiled:
            self.compiled.add(phase)
            release_free_heap()

    def _router_noise(self, rows: int, size: int, seq: int) -> list[ms.Tensor | None]:
        """The router jitter factors of each of this step's micro-batches (`size` of its `rows` rows of `seq`
        tokens), None without jitter. This replica's rows come after the earlier replicas' in the step's global
        batch (`ShuffledBatches.next_rows`), and each row's noise is keyed by its place there, so a resumed run
        or another layout draws the same."""
        model, steps = self.params.model, range(0, rows, size)
        if model.moe is None or model.moe.router_jitter == 0:
            return [None for _ in steps]
        first = self.data_group.index * rows
        return [
            ms.Tensor(router_noise(
                model.moe.router_jitter, self.params.train.seed, self.counters.step,
                range(first + start, first + min(start + size, rows)), len(model.moe_layers), seq, model.hidden_size,
            ))
            for start in steps
        ]

    def _batch(self, rows) -> Batch:
        batch = make_batch(rows, self.params.tokenizer.pad_id, self.params.train.reset_at_document_boundaries)
        return context_shard(batch, self.cp_group.size, self.cp_group.index)

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
        if self.peak is not None:  # MFU with the peak it divides by: measured on this machine (1.0) or a datasheet's (0.0)
            record["mfu"] = mfu(tokens_per_second, self.flops_per_token, self.peak.flops)
            record["mfu_peak_flops"] = self.peak.flops
            record["mfu_peak_measured"] = float(self.peak.measured)
        record.update(self._data_metrics())
        record.update(self.last_routing)
        offload = self.parallel.offload
        if offload is not None:  # moments (and parameter shards) read from and written to the files, and the staging time
            record["offload_bytes_per_step"] = self.parallel.offload_bytes()
            record["offload_seconds_per_step"] = offload.last_seconds
        if self.parallel.pipeline is not None:  # of the step's last pipeline pass
            record["pipeline_bubble"] = self.parallel.pipeline.last_timing.bubble()  # over all stages
            record["pipeline_sent_bytes"] = self.parallel.pipeline.last_timing.sent_bytes  # by this rank
        return record

    def _data_metrics(self) -> dict[str, float]:
        """Per data source, the tokens the run has read of it (inputs, as `tokens_seen` counts) and the epochs they
        make (above 1: the source was used up and is being repeated); after a resume under another global batch,
        both sizes in its first record."""
        metrics: dict[str, float] = {}
        for name, (samples, epochs) in self.batches.consumed().items():
            metrics[f"data/{name}/tokens_seen"] = samples * self.params.model.seq_len
            metrics[f"data/{name}/epochs"] = epochs
            if int(epochs) > self.epochs_reported.setdefault(name, int(epochs)):
                self.epochs_reported[name] = int(epochs)
                logger.info("data source %s read whole %d time(s): it is repeated, in a new order", name, int(epochs))
        if self.batch_change is not None:
            metrics["resumed_global_batch_rows_before"], metrics["resumed_global_batch_rows_after"] = self.batch_change
            self.batch_change = None
        return metrics

    def evaluate(self) -> float:
        """Mean token loss over the first `train.eval_batches` validation micro-batches. Every rank calls it:
        the dp replicas take turns over the batches and sum (no replica idles at its next collective while
        another evaluates, which can outlast the backend's collective timeout)."""
        train = self.params.train
        heartbeat.phase("validation")
        total, counted = 0.0, 0
        batches = sequential_batches(
            self.validation, train.micro_batch_size, train.eval_batches, self.params.tokenizer.pad_id,
            train.reset_at_document_boundaries,
        )
        self.model.set_train(False)
        try:
            total, counted = self._evaluate_in_lockstep(
                [context_shard(batch, self.cp_group.size, self.cp_group.index) for batch in batches]
            )
        finally:
            self.model.set_train(True)
        self._after_phase("validation")
        total, counted = sum_over(self.dp_group, [total, counted])
        return total / counted if counted else math.nan

    def _evaluate_in_lockstep(self, batches: list[Batch]) -> tuple[float, int]:
        """The dp replicas take turns over the batches, each running the same number of forwards (under ZeRO-3 a
        forward gathers weights over dp, under pp it runs on every stage): a replica with no batch left in the
        last round repeats one and counts nothing."""
        total, counted = 0.0, 0
        size, index = self.data_group.size, self.data_group.index
        for start in range(0, len(batches), size):
            mine = start + index
            summed = self._summed_loss(batches[min(mine, len(batches) - 1)])
            if mine < len(batches):
                total += summed
                counted += batches[mine].counted_tokens
        return total, counted

    def _summed_loss(self, batch: Batch) -> float:
        """The summed token loss of one batch, forward only (through every stage of a pipeline)."""
        return self.parallel.summed_loss(_micro_batch(batch))

    # ------------------------------------------------------------------------------------- checkpoints

    def save(self) -> ckpt.Checkpoint | None:
        """Every rank calls it (gathering ZeRO-sharded moments and the write itself are collective). The first
        dp replica's ranks write their tp blocks; rank 0 commits and returns the checkpoint."""
        heartbeat.phase("checkpoint")
        moments = self.optimizer.state_dict()
        weights = self.parallel.full_weights()  # collective under ZeRO-3
        at = self.layout.coordinates(self.rank)
        shards = {ckpt.block_index(self.layout, at.pp, at.tp): (weights, moments)} if self.writes_checkpoints else {}
        state = None if not self.is_reporting else {
            "step": self.counters.step,
            "schedule_start": self.schedule_start,
            "counters": vars(self.counters),
            "data": self.batches.state_dict(),
            "loss_scale": self.loss_scale.state_dict(),
            "model": self.params.model.model_dump(mode="json"),
            "lora": self.parallel.table.lora.model_dump(mode="json") if self.parallel.table.lora else None,
            "rng": {"seed": self.params.train.seed},
        }
        try:
            return ckpt.save_shards(
                self.checkpoint_dir, self.counters.step, shards, state, self.layout,
                keep=self.params.train.keep_checkpoints, barrier=comm.barrier,
            )
        finally:
            del weights, moments, shards
            self._after_phase("checkpoint", always=True)


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


def routing_metrics(statistics: list[float], counted: float, model: ModelParams) -> dict[str, float]:
    """Metrics of a step's summed routing statistics (`optim.step.SummedTokenLoss`): the token-weighted mean
    aux and z losses, the share of token choices dropped past an expert's capacity, and for every MoE block
    the tokens its busiest and idlest experts took and the coefficient of variation of its experts' load
    (0 when perfectly balanced)."""
    experts = model.moe.num_experts
    loads = np.asarray(statistics[3:], dtype=np.float64).reshape(-1, experts)
    metrics = {
        "moe_aux_loss": statistics[0] / max(counted, 1),
        "moe_z_loss": statistics[1] / max(counted, 1),
        "moe_dropped_fraction": statistics[2] / max(float(loads.sum()), 1.0),
    }
    for layer, load in zip(model.moe_layers, loads):
        metrics[f"moe_load_min_layer{layer}"] = float(load.min())
        metrics[f"moe_load_max_layer{layer}"] = float(load.max())
        metrics[f"moe_load_cv_layer{layer}"] = float(load.std() / load.mean()) if load.mean() > 0 else 0.0
    return metrics


def check_dataset(dataset_dir: str | Path, params: PipelineParams) -> list[MixtureSource] | None:
    """The prepared data must have been made for this model's tokens (its vocabulary less the padding rows no
    token uses, so a model padded for tensor parallelism trains on the same data) and sequence length, and a
    pretraining dataset must give the mixture data.sources asks for (`mixture_sources`): returns its sources,
    None for an instruction dataset (one source)."""
    manifest = read_manifest(dataset_dir)  # checked against manifest.sha256 before anything trusts it
    model = params.model
    tokens = "model.vocab_size - model.vocab_padding" if model.vocab_padding else "model.vocab_size"
    checks = (
        ("vocab_size", manifest["vocab_size"] - manifest.get("vocab_padding", 0), model.unpadded_vocab_size, tokens),
        ("seq_len", manifest["seq_len"], model.seq_len, "model.seq_len"),
    )
    for name, made_for, wanted, ours in checks:
        if made_for != wanted:
            raise ValueError(
                f"dataset {dataset_dir} was prepared for {name}={made_for} but {ours}={wanted}; "
                "prepare the data again with these params"
            )
    if manifest.get("kind") is not None:  # instruction data: its examples, not data.sources
        return None
    return mixture_sources(params.data.sources, manifest["splits"]["train"], str(dataset_dir))


def _inputs(batch: Batch) -> tuple:
    """The step's tensor inputs; the document-reset ones stay None unless the loader made them."""
    positions = None if batch.position_ids is None else ms.Tensor(batch.position_ids)
    segments = None if batch.segment_ids is None else ms.Tensor(batch.segment_ids)
    return ms.Tensor(batch.tokens), ms.Tensor(batch.labels), ms.Tensor(batch.loss_mask), positions, segments


def _micro_batch(batch: Batch, router_noise: ms.Tensor | None = None) -> MicroBatch:
    return MicroBatch(*_inputs(batch), router_noise)
