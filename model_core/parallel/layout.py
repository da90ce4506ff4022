"""The parallel layout: how the world of ranks splits into data-, tensor-, pipeline- and expert-parallel groups.

`Layout` is the one object that knows it. Ranks are numbered with tensor parallelism innermost, then data,
then pipeline outermost (Megatron's order), so a tp group is consecutive ranks and stays inside one node:

    rank = (pp_index * dp + dp_index) * tp + tp_index

Expert parallelism adds no ranks: it is carved out of the dp group (as Megatron and torchtitan do). Of the dp
replicas, ep consecutive ones (dp indices (d // ep) * ep + 0..ep-1) form an expert-parallel group that shares out
every MoE block's experts, ep_index = dp_index % ep holding block ep_index of them; the dp / ep ranks holding the
same experts (same ep_index) form the expert-data-parallel group, over which expert gradients are summed.

It is pure Python: it validates degrees against the world size and the model, and lists group members;
`model_core.parallel.comm.group(ranks)` turns a member list into collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

from params.schema import ModelParams, PipelineParams


class ParallelConfigError(ValueError):
    """A layout that cannot run; the message names the numbers that disagree."""


@dataclass(frozen=True)
class Coordinates:
    dp: int
    tp: int
    pp: int


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    pipeline_layers: tuple[int, ...] | None = None  # layers per stage; None: pp equal stages
    ep: int = 1  # expert-parallel ranks, a split of the dp ranks

    def __post_init__(self) -> None:
        if self.dp % self.ep:
            raise ParallelConfigError(
                f"parallel.expert_parallel={self.ep} does not divide parallel.data_parallel={self.dp}: the "
                "expert-parallel groups are carved out of the data-parallel ranks"
            )
        if self.pipeline_layers is not None:
            object.__setattr__(self, "pipeline_layers", tuple(self.pipeline_layers))  # from JSON lists too
            if len(self.pipeline_layers) != self.pp:
                stages = len(self.pipeline_layers)
                raise ParallelConfigError(f"pipeline_layers={list(self.pipeline_layers)} lists {stages} stages, pp={self.pp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @classmethod
    def from_params(cls, params: PipelineParams, world_size: int | None = None) -> Layout:
        """The layout params.parallel describes, checked against the model and (when given) the world size."""
        parallel, model = params.parallel, params.model
        explicit = tuple(parallel.pipeline_layers) if parallel.pipeline_layers is not None else None
        layout = cls(
            parallel.data_parallel, parallel.tensor_parallel, parallel.pipeline_parallel, explicit, parallel.expert_parallel
        )
        if world_size is not None and world_size != layout.world_size:
            raise ParallelConfigError(
                f"parallel.data_parallel={layout.dp} x tensor_parallel={layout.tp} x pipeline_parallel={layout.pp} "
                f"= {layout.world_size} ranks, but the world has {world_size}"
            )
        check_tensor_parallel(layout.tp, model)
        layout.stage_sizes(model.num_layers)
        check_experts(layout, parallel.zero_stage, model)
        return layout

    def stage_sizes(self, num_layers: int) -> tuple[int, ...]:
        """Layers of each pipeline stage: `pipeline_layers`, or pp equal stages."""
        if self.pipeline_layers is not None:
            if sum(self.pipeline_layers) != num_layers:
                raise ParallelConfigError(
                    f"parallel.pipeline_layers={list(self.pipeline_layers)} sum to {sum(self.pipeline_layers)} layers "
                    f"but model.num_layers={num_layers}"
                )
            return self.pipeline_layers
        if num_layers % self.pp:
            raise ParallelConfigError(
                f"parallel.pipeline_parallel={self.pp} does not divide model.num_layers={num_layers} into equal "
                "stages (or list them: parallel.pipeline_layers)"
            )
        return (num_layers // self.pp,) * self.pp

    def coordinates(self, rank: int) -> Coordinates:
        if not 0 <= rank < self.world_size:
            raise ParallelConfigError(f"rank {rank} is outside a world of {self.world_size} ranks")
        tp = rank % self.tp
        dp = rank // self.tp % self.dp
        pp = rank // (self.tp * self.dp)
        return Coordinates(dp=dp, tp=tp, pp=pp)

    def rank(self, dp: int, tp: int, pp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def dp_group(self, rank: int) -> tuple[int, ...]:
        """Ranks holding the same model shard as `rank` (same tp and pp), in dp order."""
        at = self.coordinates(rank)
        return tuple(self.rank(d, at.tp, at.pp) for d in range(self.dp))

    def tp_group(self, rank: int) -> tuple[int, ...]:
        at = self.coordinates(rank)
        return tuple(self.rank(at.dp, t, at.pp) for t in range(self.tp))

    def pp_group(self, rank: int) -> tuple[int, ...]:
        """The pipeline through `rank`'s (dp, tp) position, first stage first."""
        at = self.coordinates(rank)
        return tuple(self.rank(at.dp, at.tp, p) for p in range(self.pp))

    def ep_group(self, rank: int) -> tuple[int, ...]:
        """The ranks that share out the experts with `rank` (ep consecutive dp replicas), in ep order."""
        at = self.coordinates(rank)
        first = at.dp - at.dp % self.ep
        return tuple(self.rank(first + e, at.tp, at.pp) for e in range(self.ep))

    def expert_dp_group(self, rank: int) -> tuple[int, ...]:
        """The ranks holding the same experts as `rank` (dp / ep of them), over which expert gradients are summed."""
        at = self.coordinates(rank)
        return tuple(self.rank(d, at.tp, at.pp) for d in range(at.dp % self.ep, self.dp, self.ep))

    def ep_index(self, rank: int) -> int:
        """Which block of the experts `rank` holds."""
        return self.coordinates(rank).dp % self.ep

    def all_groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every distinct group of one kind ("dp", "tp", "pp", "ep" or "expert_dp"), by their first rank."""
        of = {"dp": self.dp_group, "tp": self.tp_group, "pp": self.pp_group, "ep": self.ep_group,
              "expert_dp": self.expert_dp_group}[kind]
        return sorted({of(rank) for rank in range(self.world_size)})

    def global_batch_rows(self, micro_batch_size: int, micro_batches: int, accumulation: int) -> int:
        """Sequences per optimizer step over the world: micro-batch x micro_batches x accumulation x dp."""
        return micro_batch_size * micro_batches * accumulation * self.dp

    def __str__(self) -> str:
        split = "" if self.pipeline_layers is None else " layers " + "+".join(map(str, self.pipeline_layers))
        experts = f" ep{self.ep}" if self.ep > 1 else ""
        return f"dp{self.dp} tp{self.tp} pp{self.pp}{experts}{split}"


def check_experts(layout: Layout, zero_stage: int, model: ModelParams) -> None:
    """Expert parallelism needs experts to share out, an equal block of them per ep rank. Mixture-of-experts
    blocks train under data, tensor, pipeline and expert parallelism with ZeRO 0 to 2: ZeRO-3 does not carry the
    expert shards yet, and is refused rather than trained wrong."""
    if layout.ep > 1 and not model.moe_layers:
        raise ParallelConfigError(f"parallel.expert_parallel={layout.ep} but model.moe is null: no experts to share out")
    if not model.moe_layers:
        return
    if model.moe.num_experts % layout.ep:
        raise ParallelConfigError(
            f"parallel.expert_parallel={layout.ep} does not divide model.moe.num_experts={model.moe.num_experts}"
        )
    if zero_stage == 3:
        raise ParallelConfigError(
            f"parallel.zero_stage=3 with model.moe ({len(model.moe_layers)} MoE blocks): mixture-of-experts "
            "models train with data, tensor, pipeline and expert parallelism and ZeRO 0 to 2 for now"
        )


def check_tensor_parallel(tp: int, model: ModelParams) -> None:
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
            raise ParallelConfigError(f"parallel.tensor_parallel={tp} does not divide model.{field}={value}{hint}")

