"""The typed description of a pipeline run: one pydantic model per concern, composed by PipelineParams.

Every field states its meaning, unit and default here; `llmflow params show` prints the resolved values
and every run saves them. Unknown keys are errors (`extra="forbid"`), and checks that involve two fields
name both fields and both values. The class defaults are the `tiny` preset, so a partial dict (a Prefect
`--param` override, a short YAML file) always lands on a model that runs on a laptop CPU.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from params.rules import layout_problems, mixture_problems, parallel_problems, source_names


def _refuse(problems: list[str]) -> None:
    """A layout rule broken (params/rules.py decides them all): the first, where pydantic names the section."""
    if problems:
        raise ValueError(problems[0])


class StrictModel(BaseModel):
    """Base for every params model: unknown keys are rejected and assignments re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ----------------------------------------------------------------------------------------------- data


class DataSource(StrictModel):
    """One input of the corpus."""

    kind: Literal["jsonl", "parquet", "text", "python_docstrings"] = Field(
        "python_docstrings",
        description="Input format. `python_docstrings` reads the docstrings of the Python standard "
        "library installed on this machine (real human-written text, no download, PSF licence).",
    )
    paths: list[str] = Field(
        default_factory=list,
        description="Files or glob patterns (relative to the working directory). Unused by python_docstrings.",
    )
    text_field: str = Field("text", description="JSONL key / Parquet column that holds the document text.")
    text_unit: Literal["file", "paragraph", "line"] = Field(
        "file", description="For kind=text: what one document is (a whole file, a blank-line paragraph, a line)."
    )
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="What the manifest and the per-source metrics call this source (letters, digits, `_`, `.`, `-`); "
        "null: `source<i>`, i its place in data.sources.",
    )
    weight: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="This source's share of the training rows (each a row of model.seq_len + 1 tokens of one "
        "source), read in a keyed order per epoch and repeated when used up. Exclusive with `epochs`. A source "
        "with neither is read once per mixture cycle (epochs 1), so a corpus without weights is mixed by size.",
    )
    epochs: float | None = Field(
        None,
        gt=0.0,
        description="Passes over this source per mixture cycle: its share of the rows is epochs x its rows over "
        "the cycle's rows, where the cycle is the rows of every epochs-source read that many times and the "
        "weight-sources take the rest. Below 1, part of the source is seen per cycle. Exclusive with `weight`.",
    )

    @model_validator(mode="after")
    def _paths_match_kind(self) -> DataSource:
        if self.kind == "python_docstrings" and self.paths:
            raise ValueError("kind=python_docstrings reads the standard library and takes no paths")
        if self.kind != "python_docstrings" and not self.paths:
            raise ValueError(f"kind={self.kind} needs at least one entry in paths")
        if self.weight is not None and self.epochs is not None:
            raise ValueError(f"weight={self.weight} and epochs={self.epochs} are both set; a source takes one of them")
        return self


class DataHealthParams(StrictModel):
    """Thresholds of the data-health measures that data prep writes to the manifest (model_core/data/health.py
    defines them): a source or dataset above one gets a warning naming the measure, its value and the threshold.
    Warnings, never refusals; they change nothing in the dataset, which keeps its key whatever they are."""

    max_fertility: float = Field(
        0.5,
        gt=0.0,
        description="Tokens per character of the tokenized documents. A tokenizer trained on the text gives "
        "about 0.25 on English prose and 0.3 on code; near 1 it spells text out piece by piece (a vocabulary too "
        "small, or trained on other text). Scripts without spaces between words (Chinese, Japanese) run higher.",
    )
    max_rare_token_share: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="Share of training tokens whose id occurs fewer than 10 times in the whole training split: "
        "pieces too rare for their embeddings to learn anything.",
    )
    max_unknown_rate: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="Share of training tokens that are the unknown piece or byte-fallback pieces (<0x..>): text "
        "the vocabulary does not cover.",
    )
    max_repeated_ngram_rate: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Share of the 4-grams of token ids in a packed training row that already occurred earlier in "
        "the same row: repetitive text (boilerplate, a few lines repeated, generated filler).",
    )
    max_longest_id_run: int = Field(
        64,
        ge=1,
        description="Longest run of one token id inside a packed training row, padding left out (a separator "
        "line, a blob of whitespace or zeros).",
    )
    max_near_copy_row_share: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Share of packed training rows that nearly copy an earlier row (MinHash over "
        "data.shingle_words-token shingles, LSH banded for a Jaccard similarity of 0.8): repeated content the "
        "model sees several times per epoch.",
    )


class DataParams(StrictModel):
    """Data prep: read, clean, deduplicate, filter, tokenize, pack, shuffle, split, write shards."""

    sources: list[DataSource] = Field(
        default_factory=lambda: [DataSource()],
        min_length=1,
        description="Corpus inputs, read in order. Each source packs into rows of its own, and training mixes "
        "the sources by their `weight` or `epochs` (README: Data mixtures).",
    )
    output_dir: str = Field(
        "artifacts/data",
        description="Parent directory of prepared datasets; each one lands in a subdirectory named by "
        "the hash of its inputs and params, so identical inputs reuse it.",
    )
    normalize_unicode: bool = Field(True, description="Apply Unicode NFKC normalisation while cleaning.")
    dedup_exact: bool = Field(True, description="Drop documents whose cleaned text is an exact repeat.")
    near_dup_threshold: float | None = Field(
        0.8,
        gt=0.0,
        le=1.0,
        description="Estimated Jaccard similarity (MinHash over token shingles, after tokenization) at or "
        "above which a document is dropped as a near-duplicate of an earlier one, in either split. "
        "null disables near-dedup.",
    )
    shingle_words: int = Field(5, ge=1, description="Tokens per shingle for near-duplicate detection.")
    minhash_permutations: int = Field(
        64, ge=8, description="MinHash signature length; more is more exact and slower."
    )
    min_chars: int = Field(64, ge=1, description="Documents shorter than this (characters, after cleaning) are dropped.")
    max_chars: int = Field(
        200_000, ge=1, description="Documents longer than this (characters, after cleaning) are dropped."
    )
    max_bad_record_fraction: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="Malformed records (bad JSON, missing text field) are reported and skipped; the "
        "run fails when their share of all records exceeds this fraction.",
    )
    add_bos: bool = Field(True, description="Start every packed document with the BOS token.")
    last_row: Literal["drop", "pad"] = Field(
        "drop",
        description="What happens to the final partial row of each split: drop it, or pad it with "
        "pad_id (padding positions are not documents and carry no loss).",
    )
    validation_fraction: float = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        description="Share of documents held out for validation: a document is held out when its keyed hash "
        "(data.shuffle_seed, its text) falls in this share of the hash range, so the split needs no global "
        "shuffle and a document lands in the same split whatever else the corpus holds.",
    )
    shuffle_seed: int = Field(1234, description="Seed of the document and row shuffles; same seed, same shards.")
    rows_per_shard: int = Field(4096, ge=1, description="Packed rows per token shard file.")
    shard_bytes: int = Field(
        64 << 20,
        ge=1 << 12,
        description="Input bytes per map task: a larger uncompressed JSONL or text file is read as byte ranges "
        "of about this size (cut at line ends). Compressed files and Parquet row groups are not split below "
        "a file or a row group. A map task's memory grows with this, never with the corpus.",
    )
    num_workers: int | None = Field(
        None,
        ge=1,
        description="Local worker processes for the map steps (runner=local), and native encoding threads per "
        "worker process. null means all cores.",
    )
    verify_on_reuse: Literal["size", "sha256"] = Field(
        "size",
        description="How data prep checks a prepared dataset before it reuses it: every shard's size (instant), or "
        "its sha256 (reads every byte: minutes per TB), a damaged dataset being rebuilt. The manifest (against "
        "manifest.sha256) and the tokenizer are always checked by their sha256, and training checks each shard's "
        "sha256 when it first reads it, whichever is chosen here.",
    )
    health: DataHealthParams = Field(
        default_factory=DataHealthParams,
        description="Thresholds of the data-health warnings (README 'Data health').",
    )
    runner: Literal["local", "ray"] = Field(
        "local",
        description="Where the map steps run: `local` worker processes on this machine (no extra service), or "
        "a Ray cluster (`ray`, through prefect-ray's RayTaskRunner under Prefect; data.output_dir must then be "
        "a filesystem every Ray node sees).",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster address for runner=ray (`auto`, `ray://head:10001`, or `host:6379`); null starts "
        "a Ray instance on this machine.",
    )
    ray_connect_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long the cluster at data.ray_address has to accept a connection and answer a gRPC "
        "handshake before the command stops with the address and what to check; Ray's own driver would retry a "
        "silent address for minutes.",
    )

    @model_validator(mode="after")
    def _length_bounds(self) -> DataParams:
        if self.ray_address is not None and self.runner != "ray":
            raise ValueError(f"data.ray_address={self.ray_address!r} is set but data.runner={self.runner!r}, not 'ray'")
        if self.min_chars > self.max_chars:
            raise ValueError(f"data.min_chars={self.min_chars} is greater than data.max_chars={self.max_chars}")
        _refuse(mixture_problems(self.sources))
        return self

    def source_names(self) -> list[str]:
        """Each source's name: its `name`, or `source<i>`."""
        return source_names(self.sources)


class TokenizerParams(StrictModel):
    """SentencePiece tokenizer: trained on the prepared corpus, or loaded from a file."""

    model_path: str | None = Field(
        None, description="An existing SentencePiece .model to load instead of training one."
    )
    model_type: Literal["bpe", "unigram"] = Field("bpe", description="SentencePiece algorithm when training.")
    byte_fallback: bool = Field(True, description="Encode unknown characters as UTF-8 bytes instead of <unk>.")
    character_coverage: float = Field(
        0.9995, gt=0.0, le=1.0, description="Share of characters the trained vocabulary must cover."
    )
    training_sentences: int = Field(
        2_000_000,
        ge=1,
        description="At most this many lines of training documents train the tokenizer: a deterministic "
        "sample (the lines with the smallest keyed hashes), taken shard by shard in bounded memory.",
    )
    unk_id: int = Field(0, ge=0, description="Id of the unknown token.")
    bos_id: int = Field(1, ge=0, description="Id of the beginning-of-sequence token.")
    eos_id: int = Field(2, ge=0, description="Id of the end-of-sequence token (document separator).")
    pad_id: int = Field(3, ge=0, description="Id of the padding token.")

    @model_validator(mode="after")
    def _distinct_special_ids(self) -> TokenizerParams:
        ids = {"unk_id": self.unk_id, "bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id}
        seen: dict[int, str] = {}
        for name, value in ids.items():
            if value in seen:
                raise ValueError(f"tokenizer.{name}={value} collides with tokenizer.{seen[value]}={value}")
            seen[value] = name
        return self


# ---------------------------------------------------------------------------------------------- model


class MoEParams(StrictModel):
    """Sparse mixture-of-experts feed-forward blocks (Mixtral-style): a linear router, softmax (or sigmoid)
    gating over the experts, each token sent to its top `experts_per_token`, SwiGLU experts."""

    num_experts: int = Field(8, ge=2, description="Experts in each MoE block.")
    experts_per_token: int = Field(2, ge=1, description="Experts each token is sent to (top-k).")
    every: int = Field(
        1, ge=1, description="Every k-th block is MoE, counting from the first: block i when (i + 1) % every == 0 "
        "(1: all; 2: blocks 1, 3, 5, ...). Ignored when `layers` is given."
    )
    layers: list[int] | None = Field(None, description="The MoE blocks by index; the rest stay dense.")
    expert_ffn_hidden_size: int | None = Field(
        None, ge=1, description="Inner width of each expert's SwiGLU (default model.ffn_hidden_size)."
    )
    gating: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="How router logits become expert weights: softmax over the experts (Mixtral, "
        "Qwen2-MoE) or an independent sigmoid per expert (DeepSeek-V3), the top k chosen by that score."
    )
    normalize_top_k: bool = Field(
        True, description="Rescale a token's top-k router probabilities to sum to 1 (Mixtral does; Qwen2-MoE not)."
    )
    aux_loss_coef: float = Field(
        0.01, ge=0.0, description="Weight of the load-balancing loss (Switch Transformer's E * sum_e f_e * P_e, "
        "f_e counting all k choices, averaged over the MoE blocks) in the training objective."
    )
    z_loss_coef: float = Field(
        0.0, ge=0.0, description="Weight of the router z-loss (mean squared logsumexp of the router logits, "
        "ST-MoE), averaged over the MoE blocks."
    )
    shared_expert_ffn_hidden_size: int | None = Field(
        None, ge=1, description="Inner width of a shared SwiGLU expert every token also goes through "
        "(DeepSeek-MoE, Qwen2-MoE); null: none."
    )
    shared_expert_gate: bool = Field(
        False, description="Scale the shared expert's output by sigmoid(w . x), a learned [1, hidden] gate "
        "(Qwen2-MoE); false adds it as is (DeepSeek-MoE)."
    )
    capacity_factor: float | None = Field(
        None, gt=0.0, description="null: dropless, every choice is computed. Otherwise each expert takes at "
        "most ceil(capacity_factor * tokens * experts_per_token / num_experts) of a micro-batch's choices, "
        "first choices before second ones and in token order within each; a choice past that is dropped "
        "(it adds nothing; the token keeps its residual)."
    )
    router_jitter: float = Field(
        0.0, description="eps of the router's input jitter in training (Switch Transformer; Hugging Face Mixtral's "
        "router_jitter_noise): each element of a token's router input is multiplied by a draw from uniform "
        "[1 - eps, 1 + eps], keyed by (train.seed, optimizer step, the row's place in the step's global batch), "
        "so a resumed run draws the same noise; never in evaluation or generation. 0: off. 0 <= eps < 1."
    )

    @model_validator(mode="after")
    def _jitter_in_range(self) -> MoEParams:
        if not 0.0 <= self.router_jitter < 1.0:
            raise ValueError(
                f"model.moe.router_jitter={self.router_jitter} must be at least 0 and below 1 (the noise factor "
                f"ranges over [1 - {self.router_jitter}, 1 + {self.router_jitter}], which must stay positive)"
            )
        return self

    def capacity(self, tokens: int) -> int:
        """Slots each expert has for a micro-batch of `tokens` tokens (the rule `capacity_factor` states)."""
        if self.capacity_factor is None:
            return tokens
        return min(tokens, math.ceil(self.capacity_factor * tokens * self.experts_per_token / self.num_experts))


class ModelParams(StrictModel):
    """Llama-family decoder architecture."""

    vocab_size: int = Field(
        4096, ge=8, description="Rows of the embedding table: the tokenizer's pieces plus vocab_padding."
    )
    vocab_padding: int = Field(
        0,
        ge=0,
        description="Rows at the end of the table that no token uses (added so tensor parallelism divides the "
        "vocabulary); their logits are kept out of the softmax.",
    )
    hidden_size: int = Field(128, ge=1, description="Width of the residual stream (d_model).")
    num_layers: int = Field(4, ge=1, description="Transformer blocks.")
    num_heads: int = Field(4, ge=1, description="Query attention heads.")
    num_kv_heads: int = Field(
        2, ge=1, description="Key/value heads (grouped-query attention); equal to num_heads for plain MHA."
    )
    ffn_hidden_size: int = Field(352, ge=1, description="Inner width of the SwiGLU MLP.")
    seq_len: int = Field(128, ge=2, description="Tokens per training sequence (context length).")
    rope_theta: float = Field(10_000.0, gt=0.0, description="RoPE base frequency.")
    norm_eps: float = Field(1e-5, gt=0.0, description="RMSNorm epsilon.")
    tie_embeddings: bool = Field(True, description="Share the token embedding with the LM head.")
    init_std: float = Field(0.02, gt=0.0, description="Std of the normal initialisation of weights.")
    moe: MoEParams | None = Field(None, description="Mixture-of-experts blocks; null: every block dense.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the MoE blocks (none without `moe`)."""
        if self.moe is None:
            return ()
        if self.moe.layers is not None:
            return tuple(sorted(self.moe.layers))
        return tuple(i for i in range(self.num_layers) if (i + 1) % self.moe.every == 0)

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe.expert_ffn_hidden_size or self.ffn_hidden_size if self.moe is not None else 0

    @property
    def unpadded_vocab_size(self) -> int:
        """The tokenizer's pieces: the ids a token can have."""
        return self.vocab_size - self.vocab_padding

    @model_validator(mode="after")
    def _shapes_divide(self) -> ModelParams:
        if self.vocab_padding >= self.vocab_size:
            raise ValueError(
                f"model.vocab_padding={self.vocab_padding} leaves no tokens of model.vocab_size={self.vocab_size}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}"
            )
        if self.num_kv_heads > self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head dim {self.head_dim} (model.hidden_size={self.hidden_size} / "
                f"model.num_heads={self.num_heads}) must be even for RoPE"
            )
        if self.moe is not None:
            if self.moe.experts_per_token > self.moe.num_experts:
                raise ValueError(
                    f"model.moe.experts_per_token={self.moe.experts_per_token} exceeds "
                    f"model.moe.num_experts={self.moe.num_experts}"
                )
            outside = [i for i in self.moe.layers or () if not 0 <= i < self.num_layers]
            if outside or len(set(self.moe.layers or ())) != len(self.moe.layers or ()):
                raise ValueError(
                    f"model.moe.layers={self.moe.layers} must name distinct blocks 0..{self.num_layers - 1} "
                    f"(model.num_layers={self.num_layers})"
                )
            if not self.moe_layers:
                raise ValueError(
                    f"model.moe.every={self.moe.every} selects no block of model.num_layers={self.num_layers}"
                )
        return self


# ------------------------------------------------------------------------------------------- training


class ParallelParams(StrictModel):
    """How the world of devices is split. dp * cp * tp * pp must equal the number of workers."""

    data_parallel: int = Field(1, ge=1, description="Data-parallel replicas (dp).")
    tensor_parallel: int = Field(1, ge=1, description="Tensor-parallel ranks per layer (tp), innermost.")
    pipeline_parallel: int = Field(1, ge=1, description="Pipeline stages (pp).")
    expert_parallel: int = Field(
        1,
        ge=1,
        description="Expert-parallel ranks (ep), carved out of the dp ranks: each of ep consecutive dp replicas "
        "holds model.moe.num_experts / ep of every MoE block's experts, and tokens travel to their experts' rank "
        "by all-to-all. Must divide data_parallel and model.moe.num_experts; adds no ranks.",
    )
    context_parallel: int = Field(
        1,
        ge=1,
        description="Context-parallel ranks (cp): every sequence is cut into 2 x cp equal chunks and each cp rank "
        "holds two of them (chunk i and chunk 2 x cp - 1 - i, so causal attention costs every rank the same); "
        "attention gathers every layer's keys and values over the cp ranks. Divides each rank's activations by cp. "
        "model.seq_len must be a multiple of 2 x cp; adds ranks (world = dp x cp x tp x pp).",
    )
    micro_batches: int = Field(
        1,
        ge=1,
        description="Micro-batches per pipeline pass, each of train.micro_batch_size sequences; must be "
        ">= pipeline_parallel. With pp=1 they act as extra gradient accumulation.",
    )
    pipeline_schedule: Literal["1f1b", "gpipe"] = Field("1f1b", description="Pipeline schedule.")
    sequence_parallel: bool = Field(
        False,
        description="Megatron's sequence parallelism, with tensor_parallel > 1: between the tp regions the residual "
        "stream, the norms and the projections' kept inputs hold 1/tp of the sequence on each tp rank, so those "
        "activations take 1/tp of the memory. tp's all-reduces become all-gathers and reduce-scatters along the "
        "sequence, each projection gathering its own input (forward and again in the backward): about 2.4x tp's "
        "bytes (README 'Scaling out'). Results equal tp without it. Needs tp to divide model.seq_len; "
        "does nothing at tensor_parallel=1 (a warning); dense models only.",
    )
    overlap_gradient_reduction: bool = Field(
        False,
        description="In a step of one micro-batch per rank, sum its gradients over dp (and tp, expert-dp where the "
        "layout sums them) inside its backward graph, bucket by bucket in backward order, instead of after it. Same "
        "result either way. Off by default: MindSpore's kernel-by-kernel execution order runs what follows a "
        "collective only once the compute ready beside it has run, so every bucket after the first waits for the "
        "end of the backward with its gradients alive, a share of a whole fresh set that grows with depth "
        "(benchmarks/README.md, 'Model states'), and on CPU the sum hides no time. Applies where "
        "gradients are summed once per step (ZeRO 0/1, no pipeline); steps of several micro-batches always sum "
        "after the backward.",
    )
    gradient_bucket_mb: float = Field(
        32,
        gt=0,
        description="Size of the flat buckets gradients are summed in, MiB: fewer, larger collectives against "
        "an earlier start for the first bucket when the sum overlaps the backward.",
    )
    layout_trial_steps: int | None = Field(
        None,
        ge=2,
        description="In pretrain-flow, before pretraining: train each layout of this world size that the planner "
        "finds fitting for this many steps and pretrain with the fastest (`llmflow plan --try` by hand). The layout "
        "is not part of a run's identity, so the chosen one trains the same run. null: the layout as given.",
    )
    pipeline_layers: list[int] | None = Field(
        None,
        description="Layers of each pipeline stage, first to last (e.g. [5, 3]: the last stage also runs the head "
        "and loss); must sum to model.num_layers. Default: pipeline_parallel equal stages.",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        0,
        description="ZeRO sharding over the dp group: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters.",
    )
    optimizer_offload: bool = Field(
        False,
        description="Keep the AdamW moments (this rank's ZeRO shard of them) in a memory-mapped file under the "
        "temp directory (TMPDIR: choose a local disk) and stream them through memory in 4 MiB buckets for the "
        "update; the result and the checkpoints are bit-identical to the run without it. Saves the moments' "
        "bytes (8 per trainable parameter, /dp under ZeRO) for a slower update; see README 'Offload'.",
    )
    param_offload: bool = Field(
        False,
        description="ZeRO-3 only, with optimizer_offload: keep this rank's parameter shards (fp32, so also the "
        "master weights) in a memory-mapped file under the temp directory and read each one where the step "
        "gathers it (forward and backward) and in the update; bit-identical to the run without it. Takes the "
        "shards' bytes (4 per parameter / dp) out of memory for reading them twice a micro-batch, though peak RSS "
        "on the reference model fell by a third of them at best; see README 'Offload'.",
    )
    hang_step_multiple: float = Field(
        10.0,
        ge=2.0,
        description="Under msrun: stop a job in which no rank has started a new step or phase for this many times "
        "the median step time, naming the silent ranks and what the others wait in (README 'Troubleshooting').",
    )
    hang_min_seconds: float = Field(
        180.0,
        gt=0.0,
        description="The hang watch never stops a job sooner than this after the last progress: above the longest "
        "validation or checkpoint write of the run (the first step, which compiles, is never judged).",
    )

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.context_parallel * self.tensor_parallel * self.pipeline_parallel

    @model_validator(mode="after")
    def _degrees_fit(self) -> ParallelParams:
        _refuse(parallel_problems(self))
        return self


class PrecisionParams(StrictModel):
    """Numeric precision: compute dtype over fp32 master weights, and fp16 loss scaling."""

    compute_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="dtype of matmuls and activations; master weights, norms, softmax and loss stay fp32.",
    )
    initial_loss_scale: float = Field(2.0**16, gt=0.0, description="fp16 only: starting dynamic loss scale.")
    loss_scale_factor: float = Field(2.0, gt=1.0, description="fp16 only: scale multiplier/divisor on growth/overflow.")
    loss_scale_window: int = Field(
        1000, ge=1, description="fp16 only: overflow-free steps before the loss scale grows."
    )


class RecomputeParams(StrictModel):
    """Activation recomputation (trade compute for memory)."""

    mode: Literal["none", "selected", "all"] = Field("none", description="Which blocks recompute activations.")
    layers: list[int] = Field(default_factory=list, description="mode=selected: block indices to recompute.")
    every_k: int | None = Field(None, ge=1, description="mode=selected: recompute every k-th block instead.")

    @model_validator(mode="after")
    def _selection_given(self) -> RecomputeParams:
        chosen = bool(self.layers) + (self.every_k is not None)
        if self.mode == "selected" and chosen != 1:
            raise ValueError("recompute.mode=selected needs exactly one of recompute.layers or recompute.every_k")
        if self.mode != "selected" and chosen:
            raise ValueError(f"recompute.layers/every_k are only used with mode=selected, not mode={self.mode}")
        return self


class OptimizerParams(StrictModel):
    """AdamW and its learning-rate schedule."""

    lr: float = Field(1e-3, gt=0.0, description="Peak learning rate.")
    min_lr: float = Field(1e-4, ge=0.0, description="Learning rate at the end of a cosine or linear decay.")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after warmup: cosine or linear to min_lr, or constant at lr."
    )
    warmup_steps: int | None = Field(20, ge=0, description="Linear warmup length in optimizer steps.")
    warmup_ratio: float | None = Field(
        None, ge=0.0, lt=1.0, description="Warmup as a share of train steps (instead of warmup_steps)."
    )
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW first-moment decay.")
    beta2: float = Field(0.95, ge=0.0, lt=1.0, description="AdamW second-moment decay.")
    eps: float = Field(1e-8, gt=0.0, description="AdamW denominator epsilon.")
    weight_decay: float = Field(0.1, ge=0.0, description="Decoupled weight decay; never applied to norms or biases.")
    grad_clip: float | None = Field(1.0, gt=0.0, description="Global gradient-norm clip; null disables clipping.")

    @model_validator(mode="after")
    def _schedule_consistent(self) -> OptimizerParams:
        if self.min_lr > self.lr:
            raise ValueError(f"optimizer.min_lr={self.min_lr} is greater than optimizer.lr={self.lr}")
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ValueError(
                f"give one of optimizer.warmup_steps={self.warmup_steps} and "
                f"optimizer.warmup_ratio={self.warmup_ratio}, not both (set the other to null)"
            )
        return self


class TrainParams(StrictModel):
    """The training loop: length, batch, cadence, seed."""

    steps: int = Field(300, ge=1, description="Optimizer steps of the pretraining run.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per micro-batch per data-parallel rank.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batch passes accumulated per optimizer step.")
    log_interval: int = Field(10, ge=1, description="Optimizer steps between metric records.")
    eval_interval: int = Field(100, ge=1, description="Optimizer steps between validation-loss evaluations.")
    eval_batches: int = Field(8, ge=1, description="Validation micro-batches per evaluation.")
    checkpoint_interval: int = Field(100, ge=1, description="Optimizer steps between checkpoints (and one at the end).")
    keep_checkpoints: int = Field(3, ge=1, description="Newest checkpoints kept; older ones are deleted.")
    max_consecutive_nonfinite: int = Field(
        5, ge=1, description="Non-finite steps in a row (each skipped) after which the run stops with an error."
    )
    reset_at_document_boundaries: bool = Field(
        False, description="Restart attention and positions at the document boundaries recorded by data prep."
    )
    seed: int = Field(1234, description="Seed of initialisation, dropout and data order.")
    output_dir: str = Field(
        "artifacts/train",
        description="Where checkpoints and run outputs go: one directory per stage run, named by the key of the "
        "inputs that decide its result (`pretrain-<key>`, `smoke-<key>`, `finetune-<key>`, `eval-<key>`), so a run "
        "whose result is already there is reused.",
    )
    continue_from: Literal["latest", "none"] = Field(
        "none",
        description="When the prepared data is new for this model, optimizer and train section: `latest` continues "
        "pretraining from the last checkpoint of the newest finished run of them on earlier data (weights, AdamW "
        "moments and the step number; then train.steps more steps, the learning-rate warmup and decay run again "
        "over them, and the new data is read from its start); `none` starts from the initialisation. Continuing "
        "needs the same tokenizer (tokenizer.model_path).",
    )


class ConvertParams(StrictModel):
    """Starting from a Hugging Face Llama checkpoint on disk (never downloaded at run time)."""

    hf_source: str | None = Field(
        None,
        description="A local Hugging Face model directory (config.json + model.safetensors, a sharded "
        "safetensors index, or pytorch_model.bin). When set, pretraining and fine-tuning start from its "
        "weights, and the model section must agree with its config.json.",
    )
    cache_dir: str = Field(
        "artifacts/converted", description="Converted checkpoints, one directory per hash of the source files."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the converted weights on disk."
    )


class SmokeParams(StrictModel):
    """Short run that must show learning before the expensive pretraining run starts."""

    enabled: bool = Field(True, description="Run the smoke stage before pretraining.")
    steps: int = Field(500, ge=1, description="Optimizer steps of the smoke run.")
    min_loss_drop: float = Field(
        0.5, ge=0.0, description="Required drop of the final loss below the initial loss, in nats."
    )


class LoraParams(StrictModel):
    """LoRA fine-tuning on instruction data."""

    enabled: bool = Field(True, description="Run the fine-tune stage after pretraining.")
    rank: int = Field(16, ge=1, description="Adapter rank r.")
    alpha: float = Field(32.0, gt=0.0, description="Adapter scale numerator; the update is scaled by alpha / rank.")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: list[Literal["q", "k", "v", "o", "gate", "up", "down"]] = Field(
        default_factory=lambda: ["q", "k", "v", "o"], min_length=1, description="Projections that get adapters."
    )
    lr: float = Field(1e-4, gt=0.0, description="Fine-tuning peak learning rate.")
    steps: int = Field(100, ge=1, description="Fine-tuning optimizer steps.")
    data_paths: list[str] = Field(
        default_factory=list,
        description="Instruction JSONL files: Alpaca records (instruction, optional input, output) or "
        '{"messages": [user/assistant turns]}; empty uses the bundled set of standard-library docstring questions.',
    )
    instruction_header: str = Field("### Instruction:", description="Separator before the instruction.")
    input_header: str = Field("### Input:", description="Separator before the optional input.")
    response_header: str = Field("### Response:", description="Separator before the response (loss starts after it).")


class EvalParams(StrictModel):
    """Fixed-seed evaluation: held-out loss/perplexity and generation on fixed prompts."""

    seed: int = Field(0, description="Seed of sampling; the same seed gives the same generations.")
    batches: int = Field(16, ge=1, description="Held-out micro-batches for loss and perplexity.")
    prompts: list[str] = Field(
        default_factory=lambda: ["Return the number of", "### Instruction:\nExplain what a list is.\n\n### Response:\n"],
        description="Prompts generated from at every evaluation.",
    )
    max_new_tokens: int = Field(48, ge=1, description="Generated tokens per prompt at most.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 keeps all.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 keeps all.")
    repetition_penalty: float = Field(1.0, ge=1.0, description="Divide logits of already-seen tokens by this.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Generation stops at any of these (EOS always stops).")


class TrackingParams(StrictModel):
    """Where MLflow records runs, and how long the servers that record them may take to answer."""

    uri: str = Field(
        "sqlite:///mlflow.db",
        description="MLflow tracking URI; the MLFLOW_TRACKING_URI environment variable wins when set.",
    )
    experiment: str = Field("llmflow", description="MLflow experiment of all pipeline runs.")
    connect_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long an MLflow tracking server (an http(s) tracking URI) and the Prefect API "
        "(PREFECT_API_URL, when set) have to answer before a pipeline command stops with the URL; their clients "
        "would retry a silent address for minutes.",
    )
    artifact_location: str | None = Field(
        None, description="Artifact root for a newly created experiment; null lets MLflow choose (./mlruns)."
    )
    log_optimizer_state: bool = Field(
        False, description="Upload the AdamW moments with each training stage's final checkpoint (twice the "
        "model's size: ~80 GB at 7B); by default MLflow gets the weights and the small state files only, and "
        "the full checkpoint stays in train.output_dir."
    )


# ------------------------------------------------------------------------------------------- pipeline


class PipelineParams(StrictModel):
    """Everything one pipeline run is. Flows take this as their only parameter."""

    name: str = Field("tiny", min_length=1, description="Preset or experiment name, shown in run names.")
    data: DataParams = Field(default_factory=DataParams)
    tokenizer: TokenizerParams = Field(default_factory=TokenizerParams)
    model: ModelParams = Field(default_factory=ModelParams)
    parallel: ParallelParams = Field(default_factory=ParallelParams)
    precision: PrecisionParams = Field(default_factory=PrecisionParams)
    recompute: RecomputeParams = Field(default_factory=RecomputeParams)
    convert: ConvertParams = Field(default_factory=ConvertParams)
    optimizer: OptimizerParams = Field(default_factory=OptimizerParams)
    train: TrainParams = Field(default_factory=TrainParams)
    smoke: SmokeParams = Field(default_factory=SmokeParams)
    lora: LoraParams = Field(default_factory=LoraParams)
    eval: EvalParams = Field(default_factory=EvalParams)
    tracking: TrackingParams = Field(default_factory=TrackingParams)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step across the whole world."""
        return (
            self.train.micro_batch_size
            * self.parallel.micro_batches
            * self.train.grad_accum_steps
            * self.parallel.data_parallel
        )

    @model_validator(mode="after")
    def _cross_checks(self) -> PipelineParams:
        model, parallel, tokenizer = self.model, self.parallel, self.tokenizer
        for name in ("unk_id", "bos_id", "eos_id", "pad_id"):
            token_id = getattr(tokenizer, name)
            if token_id >= model.vocab_size:
                raise ValueError(f"tokenizer.{name}={token_id} is outside model.vocab_size={model.vocab_size}")
        _refuse(layout_problems(model, parallel))
        bad_layers = [i for i in self.recompute.layers if not 0 <= i < model.num_layers]
        if bad_layers:
            raise ValueError(
                f"recompute.layers {bad_layers} are outside 0..{model.num_layers - 1} (model.num_layers={model.num_layers})"
            )
        bad_stops = [t for t in self.eval.stop_token_ids if not 0 <= t < model.vocab_size]
        if bad_stops:
            raise ValueError(f"eval.stop_token_ids {bad_stops} are outside model.vocab_size={model.vocab_size}")
        if self.lora.rank > model.hidden_size:
            raise ValueError(f"lora.rank={self.lora.rank} exceeds model.hidden_size={model.hidden_size}")
        return self
