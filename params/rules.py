"""The rule book: whether params describe a run that can happen, decided once, before anything runs.

Every rule about what a layout may do lives here: the arithmetic of the degrees (dp x cp x tp x pp against the
world, tp against heads, key/value heads, FFN width and vocabulary, pp against the layers, micro-batches against the
stages, ep against dp and the experts, 2 x cp against the sequence, sequence-parallel tp against the sequence), the
feature combinations not built (ZeRO-3, context or sequence parallelism with mixture-of-experts blocks, sequence
parallelism with context parallelism, parameter offload with pipeline
stages or a LoRA fine-tune), and what the data sources' weights and epochs may be. A refusal is one line naming
both settings and both values. The same place judges what a run can start with but will do nothing with (sequence
parallelism without tp) or will most likely not learn well with (RoPE theta against the sequence, no gradient
clipping, a learning rate far above its size's, fp16 without loss scaling): a warning each, one line with the
numbers and the reason.

It lives in params/ and imports no MindSpore, so the CLI judges a run in milliseconds and every layer may ask:
the schema's validators apply the rules that hold whatever a run does (so a file, a `--set` or a Prefect
parameter that breaks one is refused where it is read, with its line), the entry points call `check_run` with
what only they know (the world the run gets, whether it fine-tunes) before data prep, conversion or launch, and
model_core's `Layout` and `parallelize` call the same functions on the ranks for callers that skip the CLI.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema's validators call this module: a runtime import would be circular
    from params.schema import (
        DataSource, ModelParams, OptimizerParams, ParallelParams, PipelineParams, PrecisionParams
    )

# How far the weights of a mixture whose every source has one may sum from 1 (they are then scaled to 1 exactly).
WEIGHT_SUM_TOLERANCE = 1e-3


class ParallelConfigError(ValueError):
    """A run that cannot happen; the message names the settings and the numbers that disagree."""


def check_run(params: PipelineParams, *, world_size: int | None = None, finetunes: bool = False) -> list[str]:
    """Refuse params that describe no run that can happen, naming the first problem; else return the run's
    warnings (`run_warnings`), which the entry point that starts the run shows once (a launched rank or a stage
    that checks again ignores them). `world_size`: the ranks the run gets, when the caller knows (a launched
    rank); `finetunes`: whether the run trains LoRA adapters (the pipeline with lora.enabled, `llmflow finetune`)."""
    problems = run_problems(params, world_size=world_size, finetunes=finetunes)
    if problems:
        raise ParallelConfigError(problems[0])
    return run_warnings(params)


def run_problems(params: PipelineParams, *, world_size: int | None = None, finetunes: bool = False) -> list[str]:
    """Every reason `check_run` would refuse, in the order it checks them (empty when the run can happen)."""
    parallel = params.parallel
    problems = parallel_problems(parallel) + layout_problems(params.model, parallel)
    if world_size is not None and world_size != parallel.world_size:
        problems.append(
            f"parallel.data_parallel={parallel.data_parallel} x "
            + (f"context_parallel={parallel.context_parallel} x " if parallel.context_parallel > 1 else "")
            + f"tensor_parallel={parallel.tensor_parallel} x "
            f"pipeline_parallel={parallel.pipeline_parallel} = {parallel.world_size} ranks, but the world has {world_size}"
        )
    if finetunes and parallel.param_offload:
        problems.append(
            "parallel.param_offload=true with LoRA fine-tuning (lora.enabled=true, or `llmflow finetune`): parameter "
            "offload runs without LoRA (its frozen weights have no gradient buffers to stand in for the offloaded shards); "
            "set lora.enabled=false or parallel.param_offload=false"
        )
    return problems


def parallel_problems(parallel: ParallelParams) -> list[str]:
    """What the parallel section alone rules out."""
    problems = degree_problems(
        parallel.data_parallel, parallel.pipeline_parallel, parallel.expert_parallel, parallel.pipeline_layers
    )
    pp, ep = parallel.pipeline_parallel, parallel.expert_parallel
    if parallel.micro_batches < pp:
        problems.append(
            f"parallel.micro_batches={parallel.micro_batches} is fewer than parallel.pipeline_parallel={pp}; a "
            "pipeline needs at least one per stage"
        )
    if parallel.param_offload:
        if parallel.zero_stage != 3 or parallel.data_parallel < 2:
            problems.append(
                f"parallel.param_offload=true needs ZeRO-3 over at least 2 ranks (the shards are what it offloads): "
                f"parallel.zero_stage={parallel.zero_stage}, parallel.data_parallel={parallel.data_parallel}"
            )
        if not parallel.optimizer_offload:
            problems.append(
                "parallel.param_offload=true needs parallel.optimizer_offload=true (the update reads the shards from "
                "the file bucket by bucket with the moments): parallel.optimizer_offload=false"
            )
        if pp > 1:
            problems.append(
                f"parallel.param_offload=true with parallel.pipeline_parallel={pp}: parameter offload runs without "
                "pipeline stages (a stage's schedule keeps its own gradient buffers)"
            )
    return problems


def degree_problems(dp: int, pp: int, ep: int, pipeline_layers: Sequence[int] | None) -> list[str]:
    """What the degrees alone rule out: ep carved out of dp, one entry of pipeline_layers per stage."""
    problems = []
    if dp % ep:
        problems.append(
            f"parallel.expert_parallel={ep} does not divide parallel.data_parallel={dp}: the expert-parallel groups "
            "are carved out of the data-parallel ranks"
        )
    if pipeline_layers is not None:
        if len(pipeline_layers) != pp:
            problems.append(
                f"parallel.pipeline_layers lists {len(pipeline_layers)} stages but parallel.pipeline_parallel={pp}"
            )
        if min(pipeline_layers, default=1) < 1:
            problems.append(f"parallel.pipeline_layers={list(pipeline_layers)}: every stage needs at least one layer")
    return problems


def layout_problems(model: ModelParams, parallel: ParallelParams) -> list[str]:
    """What the model rules out of the parallel section: its shapes against the degrees, its experts."""
    problems = [tensor_parallel_problem(parallel.tensor_parallel, model)]
    problems.append(stage_problem(parallel.pipeline_parallel, parallel.pipeline_layers, model.num_layers))
    problems += expert_problems(parallel.expert_parallel, parallel.zero_stage, model)
    problems += context_parallel_problems(parallel.context_parallel, model)
    if parallel.sequence_parallel:
        problems += sequence_parallel_problems(parallel.tensor_parallel, model, parallel.context_parallel)
    return [problem for problem in problems if problem is not None]


def context_parallel_problems(cp: int, model: ModelParams) -> list[str]:
    """Every cp rank holds two equal chunks of every sequence, so 2 x cp must divide it. A mixture-of-experts block's
    routing statistics and capacity are per sequence, which no rank holds whole: refused rather than trained wrong."""
    if cp == 1:
        return []
    problems = []
    if model.seq_len % (2 * cp):
        problems.append(
            f"model.seq_len={model.seq_len} is not a multiple of 2 x parallel.context_parallel={2 * cp}: every cp rank "
            "holds two equal chunks of each sequence"
        )
    if model.moe_layers:
        problems.append(
            f"parallel.context_parallel={cp} with model.moe ({len(model.moe_layers)} MoE blocks): context parallelism "
            "trains dense models for now"
        )
    return problems


def sequence_parallel_problems(tp: int, model: ModelParams, cp: int = 1) -> list[str]:
    """Sequence parallelism gives each tp rank an equal slice of every sequence. Mixture-of-experts blocks are not
    built for it yet: their routing (capacity, balancing loss) is over the whole micro-batch's tokens, so routing
    each rank's slice would train another model than tp alone does."""
    if tp == 1:
        return []
    problems = []
    if cp > 1:  # not built: the slices of a cp rank's two chunks, and their RoPE positions, are untested
        problems.append(
            f"parallel.sequence_parallel=true with parallel.context_parallel={cp}: sequence parallelism runs "
            "without context parallelism for now; set parallel.sequence_parallel=false"
        )
    if model.seq_len % tp:
        problems.append(
            f"parallel.sequence_parallel=true: parallel.tensor_parallel={tp} does not divide model.seq_len="
            f"{model.seq_len} into equal slices of the sequence"
        )
    if model.moe_layers:
        problems.append(
            f"parallel.sequence_parallel=true with model.moe ({len(model.moe_layers)} MoE blocks): sequence "
            "parallelism runs dense models for now; set parallel.sequence_parallel=false"
        )
    return problems


def check_sequence_parallel(tp: int, model: ModelParams) -> None:
    """`sequence_parallel_problems` as an error, for a layout chosen outside params."""
    problems = sequence_parallel_problems(tp, model)
    if problems:
        raise ParallelConfigError(problems[0])


def tensor_parallel_problem(tp: int, model: ModelParams) -> str | None:
    """Every tensor-parallel rank must get an equal block of heads, key/value heads, FFN width and vocabulary."""
    split = {
        "num_heads": model.num_heads,
        "num_kv_heads": model.num_kv_heads,
        "ffn_hidden_size": model.ffn_hidden_size,
        "vocab_size": model.vocab_size,
    }
    for field, value in split.items():
        if value % tp:
            hint = f" (pad it: llmflow convert hf-to-ms --tensor-parallel {tp})" if field == "vocab_size" else ""
            return f"parallel.tensor_parallel={tp} does not divide model.{field}={value}{hint}"
    return None


def check_tensor_parallel(tp: int, model: ModelParams) -> None:
    """`tensor_parallel_problem` as an error: for a layout chosen outside params (a reshard's target)."""
    problem = tensor_parallel_problem(tp, model)
    if problem is not None:
        raise ParallelConfigError(problem)


def stage_problem(pp: int, pipeline_layers: Sequence[int] | None, num_layers: int) -> str | None:
    """The stages must hold the model's layers: `pipeline_layers` summing to them, or pp equal stages."""
    if pipeline_layers is not None:
        if sum(pipeline_layers) != num_layers:
            return (
                f"parallel.pipeline_layers={list(pipeline_layers)} sum to {sum(pipeline_layers)} layers but "
                f"model.num_layers={num_layers}"
            )
        return None
    if num_layers % pp:
        return (
            f"parallel.pipeline_parallel={pp} does not divide model.num_layers={num_layers} into equal stages (or "
            "list them: parallel.pipeline_layers)"
        )
    return None


def expert_problems(ep: int, zero_stage: int, model: ModelParams) -> list[str]:
    """Expert parallelism needs experts to share out, an equal block of them per ep rank. Mixture-of-experts
    blocks train under data, tensor, pipeline and expert parallelism with ZeRO 0 to 2: ZeRO-3 does not carry the
    expert shards yet, and is refused rather than trained wrong."""
    if not model.moe_layers:
        return [f"parallel.expert_parallel={ep} but model.moe is null: no experts to share out"] if ep > 1 else []
    problems = []
    if model.moe.num_experts % ep:
        problems.append(f"parallel.expert_parallel={ep} does not divide model.moe.num_experts={model.moe.num_experts}")
    if zero_stage == 3:
        problems.append(
            f"parallel.zero_stage=3 with model.moe ({len(model.moe_layers)} MoE blocks): mixture-of-experts "
            "models train with data, tensor, pipeline and expert parallelism and ZeRO 0 to 2 for now"
        )
    return problems


def source_names(sources: Sequence[DataSource]) -> list[str]:
    """Each data source's name: its `name`, or `source<i>` by its place."""
    return [source.name or f"source{index}" for index, source in enumerate(sources)]


def mixture_problems(sources: Sequence[DataSource]) -> list[str]:
    """What the data sources' weights and epochs alone rule out (what needs the data, a weight on a source with no
    rows, is judged when training opens the dataset: model_core/data/mixture.py)."""
    names = source_names(sources)
    problems = [f"data.sources: two sources are named {name!r}" for name in sorted({n for n in names if names.count(n) > 1})]
    weighted = [(name, source.weight) for name, source in zip(names, sources) if source.weight is not None]
    total = sum(weight for _, weight in weighted)
    others = [name for name, source in zip(names, sources) if source.weight is None]
    listed = ", ".join(f"{name}={weight}" for name, weight in weighted)
    if weighted and not others and abs(total - 1.0) > WEIGHT_SUM_TOLERANCE:
        problems.append(f"data.sources weights ({listed}) sum to {total:.6g}, not 1: every source has a weight, so they are its shares")
    if others and total >= 1.0:
        problems.append(
            f"data.sources weights ({listed}) sum to {total:.6g}, leaving no share for {', '.join(others)} "
            "(sources without a weight are read by epochs; weights must then sum to less than 1)"
        )
    return problems


# ----------------------------------------------------------------------------------------------- warnings

# The peak learning rates GPT-3 trained its sizes at (Brown et al. 2020, Table 2.1): parameters -> rate.
GPT3_LEARNING_RATES = {
    125e6: 6.0e-4, 350e6: 3.0e-4, 760e6: 2.5e-4, 1.3e9: 2.0e-4, 2.7e9: 1.6e-4, 6.7e9: 1.2e-4, 13e9: 1.0e-4, 175e9: 0.6e-4
}
# How far above its size's GPT-3 rate a learning rate is "far above": Llama 2 trained 7B and 13B at 3e-4 (2.5 and 3
# times GPT-3's rate there), so a ceiling closer to the table would warn about published recipes.
LEARNING_RATE_CEILING = 5.0


def run_warnings(params: PipelineParams) -> list[str]:
    """What a run can start with but will most likely not learn well with, one line each with the numbers and the
    reason (empty for the presets)."""
    warnings = [
        sequence_parallel_warning(params.parallel),
        rope_warning(params.model),
        clipping_warning(params.optimizer),
        learning_rate_warning(params.model, params.optimizer),
        loss_scale_warning(params.precision, params.train.steps),
    ]
    return [warning for warning in warnings if warning is not None]


def sequence_parallel_warning(parallel: ParallelParams) -> str | None:
    """Sequence parallelism splits the sequence over the tp group, so with tensor_parallel=1 there is nothing to
    split. A warning, not a refusal: one params file runs under several layouts (`llmflow plan --try`, layout
    trials, a resume resharded to another tp), and a long-context preset should keep sequence_parallel on wherever
    tp > 1 without being refused at tp=1."""
    if parallel.sequence_parallel and parallel.tensor_parallel == 1:
        return (
            "parallel.sequence_parallel=true with parallel.tensor_parallel=1: there is no tp group to split the "
            "sequence over, so it changes nothing"
        )
    return None


def rope_warning(model: ModelParams) -> str | None:
    """A RoPE theta whose slowest pair comes full circle inside the sequence (`slowest_rope_wavelength`): a token
    that far back gets the same rotation as a near one, attention cannot tell them apart, and the loss hovers high
    on long sequences. The least theta whose slowest wavelength covers seq_len is (seq_len / 2 pi)^(d/(d-2))."""
    d = model.head_dim
    wavelength = slowest_rope_wavelength(model.rope_theta, d)
    if wavelength >= model.seq_len:
        return None
    fix = f"raise model.rope_theta to at least {(model.seq_len / (2 * math.pi)) ** (d / (d - 2)):.0f}" if d > 2 else "widen the heads"
    return (
        f"model.rope_theta={model.rope_theta:g} with head dim {d}: the slowest RoPE pair comes full circle every "
        f"{wavelength:.0f} positions, fewer than model.seq_len={model.seq_len}, so attention cannot tell tokens that "
        f"far apart from near ones and loss hovers high on long sequences ({fix}; 10000 is usual)"
    )


def slowest_rope_wavelength(theta: float, head_dim: int) -> float:
    """Positions one turn of the most slowly rotating RoPE pair takes: pair i of a head's d dimensions turns by
    theta^(-2i/d) radians a position, so the slowest (i = d/2 - 1) comes full circle every 2 pi theta^((d-2)/d)."""
    return 2 * math.pi * theta ** ((head_dim - 2) / head_dim)


def clipping_warning(optimizer: OptimizerParams) -> str | None:
    """Without a clip, one batch with an outsized gradient moves every weight by its full size."""
    if optimizer.grad_clip is not None:
        return None
    return (
        "optimizer.grad_clip=null: gradients are not clipped, so one batch with an outsized gradient moves every "
        "weight by its full size (loss spikes, divergence mid-run); 1.0 is the usual clip"
    )


def approximate_parameters(model: ModelParams) -> int:
    """Kaplan et al.'s 12 L H^2 for the blocks (attention 4 H^2, an MLP of 8 H^2), plus the embedding table: the
    size that learning-rate tables are read at."""
    return 12 * model.num_layers * model.hidden_size**2 + model.vocab_size * model.hidden_size


def typical_learning_rate(parameters: float) -> float:
    """The power law a N^b fitted by least squares to GPT-3's table in log-log, which carries it below its smallest
    model (125M) and between its rows."""
    xs = [math.log(size) for size in GPT3_LEARNING_RATES]
    ys = [math.log(rate) for rate in GPT3_LEARNING_RATES.values()]
    x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / sum((x - x_mean) ** 2 for x in xs)
    return math.exp(y_mean + slope * (math.log(parameters) - x_mean))


def learning_rate_warning(model: ModelParams, optimizer: OptimizerParams) -> str | None:
    """A peak learning rate more than LEARNING_RATE_CEILING times what models of this size train at."""
    parameters = approximate_parameters(model)
    return rate_far_above(
        "optimizer.lr", optimizer.lr, typical_learning_rate(parameters),
        f"models of ~{_count(parameters)} parameters train at (GPT-3's table, fitted)",
    )


def rate_far_above(setting: str, rate: float, usual: float, whose: str) -> str | None:
    """The warning for a peak learning rate `rate`, set by `setting`, above LEARNING_RATE_CEILING times `usual`, the
    rate that `whose` says who trains at ("LoRA and QLoRA fine-tunes train at"); None when it is not above. `llmflow
    doctor` judges a fine-tune's lora.lr with it."""
    ceiling = LEARNING_RATE_CEILING * usual
    if rate <= ceiling:
        return None
    return (
        f"{setting}={rate:g} is {rate / usual:.0f}x the {usual:.2g} that {whose}, above the {LEARNING_RATE_CEILING:g}x "
        f"that published recipes stay under: expect loss spikes and divergence (lower {setting} to {ceiling:.2g} or less)"
    )


def loss_scale_warning(precision: PrecisionParams, steps: int) -> str | None:
    """fp16 flushes gradients below ~6e-8 to zero unless the loss is scaled up first; the scale here is dynamic,
    but one that starts at 1 and cannot grow within the run (loss_scale_window >= steps) scales nothing."""
    if precision.compute_dtype != "float16":
        return None
    if precision.initial_loss_scale <= 1 and precision.loss_scale_window >= steps:
        return (
            f"precision.compute_dtype=float16 without loss scaling: precision.initial_loss_scale="
            f"{precision.initial_loss_scale:g} cannot grow within train.steps={steps} (precision.loss_scale_window="
            f"{precision.loss_scale_window}), so small gradients flush to zero in fp16; start it at 65536 (the default)"
        )
    return None


def _count(parameters: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if parameters >= size:
            return f"{parameters / size:.3g}{unit}"
    return f"{parameters:.0f}"
