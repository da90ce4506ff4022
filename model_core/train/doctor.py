"""What went wrong with a training run, read from what it left: its params, its metrics records (what the trainer
hands `on_metrics`), its dataset's health (the manifest's `health` section), its logs and its ranks' heartbeats.

`diagnose` first says what kind of trouble the run shows, checking in this order:
  oom         a log says memory ran out (`model_core.parallel.oom` places the phase);
  hang        the launcher found the job hung, the scheduler lost a node, or the heartbeats show a silent rank;
  divergence  after warmup, the loss climbed well above its best and did not come back, or passed the loss of
              guessing uniformly over the vocabulary (ln V) for several records running;
  non-finite  steps whose loss or gradient norm was inf or nan (the trainer skips them);
  spikes      after warmup, single records far above the median of the records before them, then back down;
  plateau     after warmup, the last third of the records is barely below the first third (or the smoke gate
              failed without any of the above);
  none        none of these.
Steps up to the end of the learning-rate warmup are never judged: early loss is noisy, and a few hundred noisy
warmup steps are normal.

Then it ranks the likely causes, each with its evidence (a window of the metrics, a log line, a param against the
bound it breaks) and the param that changes it. A cause's rank is how strongly its evidence holds (how far past
its bound) times how often it makes this kind of trouble, as experienced trainers read it: a learning rate far
above what models of this size train at, or clipping off, for divergence and spikes; an fp16 loss scale that
overflows for non-finite steps; repeated data (or a validation loss that climbs while the training loss falls), a tokenizer that cuts text into rare pieces, RoPE theta too small
for the sequence, or documents attending across their boundaries, for a loss that will not fall. With kind
`none` the causes still listed are the params and data that break a bound without having shown in the metrics.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from statistics import median

from model_core.parallel import heartbeat
from model_core.parallel.launch import hang_report
from model_core.parallel.oom import ADVICE, PHASE_WORDS, explain_oom
from params.rules import (
    LEARNING_RATE_CEILING,
    approximate_parameters,
    learning_rate_warning,
    rate_far_above,
    rope_warning,
    slowest_rope_wavelength,
    typical_learning_rate,
)
from params.schema import PipelineParams

KINDS = {
    "oom": "out of memory",
    "hang": "hang or silent node",
    "divergence": "divergence: the loss climbed and did not come back",
    "non-finite": "non-finite steps",
    "spikes": "loss spikes",
    "plateau": "plateau: the loss does not fall",
    "none": "healthy: nothing wrong in the metrics",
}
# A loss above its best post-warmup value by this share (and by at least DIVERGED_NATS) has diverged.
DIVERGED_SHARE, DIVERGED_NATS = 0.25, 0.5
# Records in a row above ln V (and DIVERGED_NATS) after warmup that make a divergence even if the loss comes back.
BLOWN_UP_RECORDS = 3
# A record above the median of the SPIKE_WINDOW records before it by this share (at least SPIKE_NATS) is a spike.
SPIKE_SHARE, SPIKE_NATS, SPIKE_WINDOW = 0.1, 0.3, 10
# A post-warmup loss whose last third is below its first third by less than this share is a plateau.
PLATEAU_DROP = 0.02
# Validation loss this far above its best while the training loss falls: the model memorises its training rows.
MEMORISING_NATS = 0.1
# The peak learning rate LoRA fine-tunes are usually run at (Hu et al. 2021 and Dettmers et al. 2023 use 1e-4 to
# 4e-4 on their largest models). A fine-tune's lora.lr is judged against it by the rule book's ceiling, as a
# pretraining rate is against its size's.
LORA_USUAL_LR = 2e-4
# An fp16 loss scale above this overflows on the first backward of most models (fp16's largest value is 65504).
FP16_SCALE_LIMIT = 2.0**24
# Which causes make which kind of trouble, and how often (the weight a cause's strength is multiplied by).
RELEVANCE = {
    "divergence": {"lr": 3.0, "clip": 2.0, "fp16": 1.0, "repetition": 0.5},
    "spikes": {"lr": 2.0, "clip": 2.0, "repetition": 1.0, "fp16": 1.0},
    "non-finite": {"fp16": 3.0, "lr": 2.0, "clip": 1.5},
    "plateau": {"repetition": 2.0, "tokenizer": 2.0, "rope": 2.0, "lr": 1.0, "mask": 0.5},
    "none": {"repetition": 1.0, "tokenizer": 1.0, "rope": 1.0, "lr": 1.0, "clip": 0.5, "fp16": 1.0},
}
REPETITION_METRICS = ("repeated_ngram_rate", "near_copy_row_share", "longest_id_run")
TOKENIZER_METRICS = ("fertility", "rare_token_share", "unknown_rate")
# Log lines of a distributed job that cannot form or keep its group: (topic, pattern, what it means, what to change).
_LAUNCH_FAILURES = (
    (
        "hang", re.compile(r"the job hung: .*"), "a rank went silent (the launcher's hang watch)",
        ("read the silent rank's log (logs/worker_<rank>.log) and its host; parallel.hang_step_multiple and "
         "parallel.hang_min_seconds set how soon a hang is called"),
    ),
    (
        "hang", re.compile(r"rank \d+ on node \d+.*stopped answering the job's scheduler.*|The node: \d+ is timed out.*"),
        "a node went silent: its processes died or it lost the network",
        "check that node's host and network; --node-timeout sets how long the scheduler waits for it",
    ),
    (
        "port",
        re.compile(r".*(?:Connection refused|connect(?:ing)? to (?:the )?scheduler|cluster_time_out|Failed to connect|"
                   r"Cluster is not ready|timed out waiting for (?:the )?(?:workers|nodes)).*", re.IGNORECASE),
        "the nodes could not reach the master address and port",
        "--master-addr (node 0's address as the other nodes reach it) and --master-port (open between the nodes)",
    ),
    (
        "count",
        re.compile(r".*(?:worker number is \d+, but|exceeded local worker number|but the world has \d+|"
                   r"(?:device_num|RANK_SIZE|worker_num).*(?:mismatch|does not match|not equal)).*", re.IGNORECASE),
        "the process count does not match the devices or the params' layout",
        ("parallel.data_parallel x tensor_parallel x pipeline_parallel must equal the devices the job gets (--nodes "
         "x devices per node)"),
    ),
    (
        "rank-env",
        re.compile(r".*(?:RANK_ID|DEVICE_ID|rank id).*(?:conflict|duplicate|invalid|differ|disagree|mismatch).*",
                   re.IGNORECASE),
        "ranks disagree on RANK_ID / DEVICE_ID",
        "leave RANK_ID, DEVICE_ID and RANK_SIZE unset: msrun gives each rank its own",
    ),
)


@dataclass(frozen=True)
class Cause:
    name: str  # what is wrong, in words
    evidence: str  # the metric window, log line or param bound it rests on
    change: str  # the param that changes it
    score: float = 0.0  # how likely it is, for ranking: relevance to the kind x strength of the evidence


@dataclass(frozen=True)
class Report:
    kind: str  # a key of KINDS
    summary: str  # what the metrics (or logs) show, in one line
    causes: list[Cause] = field(default_factory=list)  # most likely first

    def text(self) -> str:
        lines = [f"trouble: {KINDS[self.kind]}", f"  {self.summary}"]
        if self.causes:
            lines.append("likely causes, most likely first:" if self.kind != "none" else "still worth fixing:")
        for number, cause in enumerate(self.causes, start=1):
            lines += [f"{number}. {cause.name}", f"   evidence: {cause.evidence}", f"   change: {cause.change}"]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@dataclass
class RunEvidence:
    """Everything known of a run; any part may be missing."""

    params: PipelineParams | None = None
    metrics: list[dict] = field(default_factory=list)  # the trainer's records, each with a step
    health: dict | None = None  # the dataset manifest's `health` section
    logs: dict[str, str] = field(default_factory=dict)  # name (a path) -> text
    heartbeats: list[dict] = field(default_factory=list)
    failure: str | None = None  # the error the run ended with, when known
    # "finetune" when the metrics are a LoRA fine-tune's: `params` are then the ones its trainer ran with
    # (`finetune_params`: lora.lr as the peak, a tenth of lora.steps as warmup) and the learning rate is judged
    # against LoRA's, not pretraining's.
    stage: str | None = None


def diagnose(run: RunEvidence) -> Report:
    """The kind of trouble the run shows and its likely causes, ranked (see the module docstring)."""
    kind, summary, found = _kind(run)
    candidates = found + _param_causes(run) + _data_causes(run.health) + _memorising(run.metrics)
    weights = RELEVANCE.get(kind, {})
    ranked = [
        Cause(cause.name, cause.evidence, cause.change, cause.score * weights.get(topic, 1.0 if topic == kind else 0.0))
        for topic, cause in candidates
    ]
    ranked = sorted((cause for cause in ranked if cause.score > 0), key=lambda cause: -cause.score)
    return Report(kind, summary, ranked)


# ------------------------------------------------------------------------------------------------ the kind


def _kind(run: RunEvidence) -> tuple[str, str, list[tuple[str, Cause]]]:
    """(kind, summary, the causes the kind's own evidence names)."""
    oom = _oom(run.logs)
    if oom is not None:
        return "oom", oom.evidence, [("oom", oom)]
    hang = _hang(run)
    if hang:
        return "hang", hang[0][1].evidence.splitlines()[0], hang
    records = sorted((r for r in run.metrics if "step" in r and "loss" in r), key=lambda r: r["step"])
    warmup = _warmup_end(run.params, records)
    judged = [r for r in records if r["step"] > warmup and math.isfinite(r["loss"])]
    nonfinite = _nonfinite(records, run.failure)
    diverged = _diverged(judged, run.params, nonfinite is not None)
    if diverged:
        return "divergence", diverged, []
    if nonfinite is not None:
        return "non-finite", nonfinite, []
    spikes = _spikes(judged)
    if spikes:
        return "spikes", spikes, []
    plateau = _plateau(judged, warmup, run.failure)
    if plateau:
        return "plateau", plateau, []
    if run.failure:
        return "none", f"the run failed with an error its metrics and logs do not explain: {run.failure[:300]}", []
    if not records:
        return "none", "no metrics records to judge (pass the run's metrics JSONL)", []
    first, last = records[0], records[-1]
    return "none", (
        f"loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']}); after warmup "
        f"(step {warmup}) no non-finite step, spike, climb or plateau"
    ), []


def _warmup_end(params: PipelineParams | None, records: list[dict]) -> int:
    """The last step of the learning-rate warmup; without params, the first tenth of the records."""
    if params is None:
        return records[len(records) // 10]["step"] if records else 0
    optimizer = params.optimizer
    if optimizer.warmup_steps is not None:
        return optimizer.warmup_steps
    return int(params.train.steps * (optimizer.warmup_ratio or 0.0))


def _oom(logs: dict[str, str]) -> Cause | None:
    for name, text in logs.items():
        found = explain_oom(text)
        if found.phase is not None:
            return Cause(f"memory ran out {PHASE_WORDS[found.phase]}", f"{name}: {found.evidence}",
                         ADVICE[found.phase], 1.0)
        if found.evidence.startswith("memory ran out"):
            return Cause("memory ran out", f"{name}: {found.evidence}", found.advice, 1.0)
    return None


def _hang(run: RunEvidence) -> list[tuple[str, Cause]]:
    """Causes of a hang: the silent ranks by their heartbeats, and the launch failures the logs name."""
    found: list[tuple[str, Cause]] = []
    texts = dict(run.logs)
    if run.failure:
        texts["the run's error"] = run.failure
    for topic, pattern, words, change in _LAUNCH_FAILURES:
        for name, text in texts.items():
            line = next((m.group(0).strip() for m in pattern.finditer(text)), None)
            if line is not None:
                found.append(("hang", Cause(words, f"{name}: {line[:300]}", change, 2.0 if topic == "hang" else 3.0)))
                break
    silent, _ = heartbeat.silent_ranks(run.heartbeats) if run.heartbeats else ([], [])
    if silent:
        report = hang_report(run.heartbeats)
        ranks = ", ".join(map(str, silent))
        found.insert(0, ("hang", Cause(
            f"rank {ranks} went silent while the others waited for {'it' if len(silent) == 1 else 'them'}",
            report.replace("\n", "; "),
            f"read logs/worker_{silent[0]}.log and that rank's host (stopped, swapping, a dead device); "
            "parallel.hang_step_multiple and parallel.hang_min_seconds set how soon a hang is called", 4.0,
        )))
    return sorted(found, key=lambda item: -item[1].score)


def _nonfinite(records: list[dict], failure: str | None) -> str | None:
    bad = [r for r in records if not (math.isfinite(r["loss"]) and math.isfinite(r.get("grad_norm", 0.0)))]
    skipped = max((r.get("skipped_steps", 0) for r in records), default=0)
    if not bad and not skipped and not (failure and "not finite" in failure):
        return None
    if bad:
        first, last = bad[0], bad[-1]
        words = (f"steps {first['step']}-{last['step']}: {len(bad)} records with a non-finite loss or gradient norm "
                 f"(first: loss {first['loss']}, gradient norm {first.get('grad_norm')})")
    else:
        words = f"{skipped} steps skipped as non-finite"
    if failure and "not finite" in failure:
        words += f"; the run stopped: {failure.strip().splitlines()[-1][:200]}"
    return words


def _diverged(judged: list[dict], params: PipelineParams | None, then_nonfinite: bool) -> str | None:
    """After warmup: the loss ended well above its best (or passed ln V) and did not come back."""
    if len(judged) < 3:
        return None
    losses = [r["loss"] for r in judged]
    best_at = min(range(len(losses)), key=losses.__getitem__)
    tail = judged[-max(3, len(judged) // 10):]
    ending = median(r["loss"] for r in tail)
    margin = max(DIVERGED_NATS, DIVERGED_SHARE * losses[best_at])
    uniform = math.log(params.model.vocab_size) if params is not None else None
    above_uniform = uniform is not None and ending > uniform + DIVERGED_NATS and best_at < len(losses) - len(tail)
    if ending - losses[best_at] < margin and not above_uniform:
        return _blew_up(judged, uniform, then_nonfinite)
    norms = [r.get("grad_norm") for r in (judged[best_at], tail[-1])]
    norm_words = f", gradient norm {norms[0]:.3g} -> {norms[1]:.3g}" if None not in norms else ""
    words = (f"steps {judged[best_at]['step']}-{tail[-1]['step']}: loss {losses[best_at]:.3f} (best, step "
             f"{judged[best_at]['step']}) -> {ending:.3f} (median of the last {len(tail)} records){norm_words}")
    if above_uniform:
        words += f"; above ln(vocab_size) = {uniform:.3f}, worse than guessing"
    return words + ("; then non-finite steps" if then_nonfinite else "")


def _blew_up(judged: list[dict], uniform: float | None, then_nonfinite: bool) -> str | None:
    """After warmup, BLOWN_UP_RECORDS or more records in a row worse than guessing (above ln V): the update threw
    the model out of what it had learnt, a divergence even where the loss later found its way back down."""
    if uniform is None:
        return None
    start, longest = None, (0, 0)
    for i, record in enumerate([*judged, {"loss": -math.inf}]):
        if record["loss"] > uniform + DIVERGED_NATS:
            start = i if start is None else start
        elif start is not None:
            longest = max(longest, (i - start, start), key=lambda pair: pair[0])
            start = None
    length, first = longest
    if length < BLOWN_UP_RECORDS:
        return None
    window = judged[first:first + length]
    peak = max(window, key=lambda r: r["loss"])
    after = judged[first + length:]
    back = f", then back to {after[-1]['loss']:.3f} by step {after[-1]['step']}" if after else ""
    return (f"steps {window[0]['step']}-{window[-1]['step']}: loss above ln(vocab_size) = {uniform:.3f}, worse than "
            f"guessing, for {length} records running, peaking at {peak['loss']:.3f} (step {peak['step']}){back}"
            + ("; then non-finite steps" if then_nonfinite else ""))


def _spikes(judged: list[dict]) -> str | None:
    found = []
    for i in range(5, len(judged)):
        before = median(r["loss"] for r in judged[max(0, i - SPIKE_WINDOW):i])
        if judged[i]["loss"] - before > max(SPIKE_NATS, SPIKE_SHARE * before):
            found.append((judged[i], before))
    if not found:
        return None
    record, before = max(found, key=lambda item: item[0]["loss"] - item[1])
    norm = f", gradient norm {record['grad_norm']:.3g}" if "grad_norm" in record else ""
    return (f"{len(found)} spikes after warmup; the largest at step {record['step']}: loss {record['loss']:.3f} against "
            f"{before:.3f}, the median of the {SPIKE_WINDOW} records before it{norm}")


def _plateau(judged: list[dict], warmup: int, failure: str | None) -> str | None:
    smoke_failed = failure is not None and "smoke run failed" in failure
    if len(judged) < 6:
        return f"the smoke gate failed: {failure.strip()[:300]}" if smoke_failed else None
    third = len(judged) // 3
    early, late = median(r["loss"] for r in judged[:third]), median(r["loss"] for r in judged[-third:])
    drop = (early - late) / early if early > 0 else 0.0
    if drop >= PLATEAU_DROP and not smoke_failed:
        return None
    return (f"after warmup (step {warmup}), steps {judged[0]['step']}-{judged[-1]['step']}: loss {early:.3f} (median of "
            f"the first {third} records) -> {late:.3f} (of the last {third}), a drop of {drop:.1%}"
            + (f"; the smoke gate failed: {failure.strip()[:200]}" if smoke_failed else ""))


# ------------------------------------------------------------------------------------------------ the causes


def _param_causes(run: RunEvidence) -> list[tuple[str, Cause]]:
    params = run.params
    if params is None:
        return []
    found = []
    optimizer, model, precision = params.optimizer, params.model, params.precision
    lr = _learning_rate_cause(params, run.stage)
    if lr is not None:
        found.append(("lr", lr))
    if optimizer.grad_clip is None:
        peak = max((r["grad_norm"] for r in run.metrics if math.isfinite(r.get("grad_norm", math.nan))), default=None)
        seen = f"; the largest gradient norm logged was {peak:.3g}" if peak is not None else ""
        found.append(("clip", Cause(
            "gradient clipping is off, so one bad batch moves the weights as far as its gradient says",
            f"optimizer.grad_clip=null{seen}", "optimizer.grad_clip=1.0", 1.0 + 0.5 * (peak is not None and peak > 10.0),
        )))
    if precision.compute_dtype == "float16":
        found.append(("fp16", _fp16_cause(precision.initial_loss_scale, run.metrics)))
    rope = rope_warning(model)
    if rope is not None:
        found.append(("rope", Cause(
            "RoPE theta too small for the sequence length: far positions alias, and the loss hovers high on long "
            "sequences", rope, "model.rope_theta=10000 (Llama 2) or more for longer contexts (500000 for Llama 3's 8K)",
            1.0 + math.log10(model.seq_len / slowest_rope_wavelength(model.rope_theta, model.head_dim)),
        )))
    if not params.train.reset_at_document_boundaries:
        found.append(("mask", Cause(
            "documents packed into one row attend to each other (no attention reset at document boundaries)",
            "train.reset_at_document_boundaries=false: each packed row is one causal sequence across its documents",
            "train.reset_at_document_boundaries=true", 1.0,
        )))
    return found


def _learning_rate_cause(params: PipelineParams, stage: str | None) -> Cause | None:
    """The rule book's warning for a peak rate far above the usual one, as a cause: a fine-tune's against LoRA's
    usual rate, a pretraining run's against its size's."""
    rate = params.optimizer.lr
    if stage == "finetune":
        setting, usual, whose = "lora.lr", LORA_USUAL_LR, "LoRA fine-tunes"
        evidence = rate_far_above(setting, rate, usual, "LoRA and QLoRA fine-tunes train at")
    else:
        setting, whose = "optimizer.lr", "models of this size"
        usual = typical_learning_rate(approximate_parameters(params.model))
        evidence = learning_rate_warning(params.model, params.optimizer)
    if evidence is None:
        return None
    clip = "" if stage == "finetune" else " (and keep optimizer.grad_clip=1.0)"
    return Cause(
        f"learning rate far above what {whose} train at", evidence, f"{setting}: try {usual:.2g}{clip}",
        1.0 + math.log10(rate / (LEARNING_RATE_CEILING * usual)),
    )


def _fp16_cause(initial_scale: float, metrics: list[dict]) -> Cause:
    overflowed = [r for r in metrics if not math.isfinite(r.get("grad_norm", 0.0)) and "loss_scale" in r]
    if overflowed:
        first, last = overflowed[0], overflowed[-1]
        evidence = (f"steps {first['step']}-{last['step']}: gradient norm {first['grad_norm']} at loss scale "
                    f"{first['loss_scale']:.3g} -> {last['loss_scale']:.3g}, {last.get('skipped_steps', len(overflowed))}"
                    f" steps skipped (precision.initial_loss_scale={initial_scale:g})")
        strength = 2.0 + (initial_scale > FP16_SCALE_LIMIT)
    else:
        evidence = f"precision.compute_dtype=float16, precision.initial_loss_scale={initial_scale:g}"
        strength = 1.0 if initial_scale > FP16_SCALE_LIMIT else 0.3
    return Cause(
        "fp16 loss-scale overflow: the scaled gradients pass fp16's largest value (65504) and the step is skipped",
        evidence, "precision.initial_loss_scale=65536 (2^16), or precision.compute_dtype=float32", strength,
    )


def _memorising(metrics: list[dict]) -> list[tuple[str, Cause]]:
    """Validation loss climbing from its best while the training loss keeps falling: the model learns the training
    rows by heart, as it does when they repeat."""
    evaluated = [r for r in metrics if math.isfinite(r.get("validation_loss", math.nan)) and "loss" in r]
    if len(evaluated) < 3:
        return []
    best = min(evaluated, key=lambda r: r["validation_loss"])
    last = evaluated[-1]
    if last["validation_loss"] - best["validation_loss"] < MEMORISING_NATS or last["loss"] >= best["loss"]:
        return []
    return [("repetition", Cause(
        "the model learns the training rows by heart: validation loss climbs while training loss falls",
        f"steps {best['step']}-{last['step']}: validation loss {best['validation_loss']:.3f} -> "
        f"{last['validation_loss']:.3f} while training loss went {best['loss']:.3f} -> {last['loss']:.3f}",
        "more (or less repeated) data in data.sources, fewer steps (train.steps), or more weight decay "
        "(optimizer.weight_decay)", 1.0 + (last["validation_loss"] - best["validation_loss"]),
    ))]


def _data_causes(health: dict | None) -> list[tuple[str, Cause]]:
    """A cause per family (repetition, tokenizer) whose health metrics cross their thresholds."""
    if not health:
        return []
    found = []
    families = (
        ("repetition", REPETITION_METRICS, "repetition in the data: the model memorises repeated text",
         "deduplicate (data.dedup_exact=true, data.near_dup_threshold, e.g. 0.8) or add varied sources to data.sources"),
        ("tokenizer", TOKENIZER_METRICS, "the tokenizer cuts text into many rare pieces (high fertility)",
         ("a larger vocabulary (model.vocab_size) trained on this text (tokenizer.model_path=null retrains it), "
          "tokenizer.byte_fallback=true")),
    )
    for topic, metrics, words, change in families:
        crossed = [item for item in (_crossed(health, metric) for metric in metrics) if item is not None]
        if crossed:
            ratio, evidence = max(crossed)
            others = "; ".join(text for _, text in sorted(crossed, reverse=True)[1:])
            found.append((topic, Cause(words, evidence + (f"; also {others}" if others else ""), change, ratio)))
    return found


def _crossed(health: dict, metric: str) -> tuple[float, str] | None:
    """(value / threshold, evidence) when the dataset's or a source's `metric` crosses its threshold."""
    thresholds = health.get("thresholds", {})
    bound = thresholds.get(metric, thresholds.get(f"max_{metric}"))
    warned = [line for line in health.get("warnings", []) if metric in line]
    values = [("the dataset", health.get("dataset", {}).get(metric))]
    values += [(f"source {name}", numbers.get(metric)) for name, numbers in health.get("sources", {}).items()]
    values = [(where, value) for where, value in values if isinstance(value, (int, float))]
    if bound is None or not values:
        return (1.0, f"data health: {warned[0]}") if warned else None
    where, value = max(values, key=lambda item: item[1])
    if value <= bound:
        return None
    return value / bound if bound > 0 else math.inf, f"{metric} {value:.3g} in {where}, threshold {bound:g}"
