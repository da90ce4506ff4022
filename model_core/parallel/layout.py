"""The parallel layout: how the world of ranks splits into data-, context-, tensor-, pipeline- and expert-parallel
groups.

`Layout` is the one object that knows it. Ranks are numbered with tensor parallelism innermost, then context,
then data, then pipeline outermost (Megatron's order), so a tp group is consecutive ranks and stays inside one node,
and so does a cp group next to it as long as a node holds cp x tp ranks: tp ranks talk in every layer's forward and
backward, cp ranks exchange every layer's keys and values, dp ranks sum gradients once a step and pp ranks pass one
activation per micro-batch:

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

Context parallelism (cp) splits every sequence over its ranks; the weights are replicated over cp as over dp, so
their gradients are summed, and ZeRO shards them, over the dp x cp ranks together (`replica_group`): `folded()` is
the layout as the weights see it, cp folded into dp, which numbers the ranks the same way.

Expert parallelism adds no ranks: it is carved out of the dp group (as Megatron and torchtitan do). Of the dp
replicas, ep consecutive ones (dp indices (d // ep) * ep + 0..ep-1) form an expert-parallel group that shares out
every MoE block's experts, ep_index = dp_index % ep holding block ep_index of them; the dp / ep ranks holding the
same experts (same ep_index) form the expert-data-parallel group, over which expert gradients are summed.

It is pure Python: it lists group members, and `model_core.parallel.comm.group(ranks)` turns a member list into
collectives. Whether a layout may run is params/rules.py's to decide; `from_params` asks it again on the ranks,
for callers that start one without the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass

from params.rules import ParallelConfigError, check_run, degree_problems, stage_problem
from params.schema import PipelineParams


@dataclass(frozen=True)
class Coordinates:
    dp: int
    tp: int
    pp: int
    cp: int = 0


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    pipeline_layers: tuple[int, ...] | None = None  # layers per stage; None: pp equal stages
    ep: int = 1  # expert-parallel ranks, a split of the dp ranks
    cp: int = 1  # context-parallel ranks, each holding 2 of the 2 x cp chunks of every sequence

    def __post_init__(self) -> None:
        if self.pipeline_layers is not None:
            object.__setattr__(self, "pipeline_layers", tuple(self.pipeline_layers))  # from JSON lists too
        problems = degree_problems(self.dp, self.pp, self.ep, self.pipeline_layers)
        if problems:
            raise ParallelConfigError(problems[0])

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @classmethod
    def from_params(cls, params: PipelineParams, world_size: int | None = None) -> Layout:
        """The layout params.parallel describes, once the rule book has passed it for the model and (when given)
        the world size."""
        check_run(params, world_size=world_size)
        parallel = params.parallel
        explicit = tuple(parallel.pipeline_layers) if parallel.pipeline_layers is not None else None
        return cls(
            parallel.data_parallel, parallel.tensor_parallel, parallel.pipeline_parallel, explicit, parallel.expert_parallel,
            parallel.context_parallel,
        )

    def folded(self) -> Layout:
        """This layout as the weights see it: the cp ranks folded into dp (dp index dp_index * cp + cp_index), over
        which a weight is replicated, its gradient summed and its ZeRO shards cut. Rank numbers do not change."""
        if self.cp == 1:
            return self
        return Layout(self.dp * self.cp, self.tp, self.pp, self.pipeline_layers, self.ep)

    def stage_sizes(self, num_layers: int) -> tuple[int, ...]:
        """Layers of each pipeline stage: `pipeline_layers`, or pp equal stages."""
        problem = stage_problem(self.pp, self.pipeline_layers, num_layers)
        if problem is not None:
            raise ParallelConfigError(problem)
        return self.pipeline_layers or (num_layers // self.pp,) * self.pp

    def coordinates(self, rank: int) -> Coordinates:
        if not 0 <= rank < self.world_size:
            raise ParallelConfigError(f"rank {rank} is outside a world of {self.world_size} ranks")
        tp = rank % self.tp
        cp = rank // self.tp % self.cp
        dp = rank // (self.tp * self.cp) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return Coordinates(dp=dp, tp=tp, pp=pp, cp=cp)

    def rank(self, dp: int, tp: int, pp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def dp_group(self, rank: int) -> tuple[int, ...]:
        """Ranks holding the same model shard and the same part of every sequence as `rank` (same tp, pp and cp),
        in dp order: the data replicas, which read different rows."""
        at = self.coordinates(rank)
        return tuple(self.rank(d, at.tp, at.pp, at.cp) for d in range(self.dp))

    def cp_group(self, rank: int) -> tuple[int, ...]:
        """Ranks holding the other parts of `rank`'s sequences (same dp, tp and pp), in cp order."""
        at = self.coordinates(rank)
        return tuple(self.rank(at.dp, at.tp, at.pp, c) for c in range(self.cp))

    def replica_group(self, rank: int) -> tuple[int, ...]:
        """Ranks holding the same model shard as `rank` (same tp and pp): dp x cp of them, in rank order, over which
        gradients are summed and ZeRO shards cut."""
        return self.folded().dp_group(rank)

    def tp_group(self, rank: int) -> tuple[int, ...]:
        at = self.coordinates(rank)
        return tuple(self.rank(at.dp, t, at.pp, at.cp) for t in range(self.tp))

    def pp_group(self, rank: int) -> tuple[int, ...]:
        """The pipeline through `rank`'s (dp, cp, tp) position, first stage first."""
        at = self.coordinates(rank)
        return tuple(self.rank(at.dp, at.tp, p, at.cp) for p in range(self.pp))

    def ep_group(self, rank: int) -> tuple[int, ...]:
        """The ranks that share out the experts with `rank` (ep consecutive dp replicas), in ep order."""
        at = self.coordinates(rank)
        first = at.dp - at.dp % self.ep
        return tuple(self.rank(first + e, at.tp, at.pp, at.cp) for e in range(self.ep))

    def expert_dp_group(self, rank: int) -> tuple[int, ...]:
        """The ranks holding the same experts as `rank` (dp / ep of them), over which expert gradients are summed."""
        at = self.coordinates(rank)
        return tuple(self.rank(d, at.tp, at.pp, at.cp) for d in range(at.dp % self.ep, self.dp, self.ep))

    def ep_index(self, rank: int) -> int:
        """Which block of the experts `rank` holds."""
        return self.coordinates(rank).dp % self.ep

    def all_groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every distinct group of one kind ("dp", "cp", "replica", "tp", "pp", "ep" or "expert_dp"), by their first
        rank."""
        of = {"dp": self.dp_group, "cp": self.cp_group, "replica": self.replica_group, "tp": self.tp_group,
              "pp": self.pp_group, "ep": self.ep_group, "expert_dp": self.expert_dp_group}[kind]
        return sorted({of(rank) for rank in range(self.world_size)})

    def global_batch_rows(self, micro_batch_size: int, micro_batches: int, accumulation: int) -> int:
        """Sequences per optimizer step over the world: micro-batch x micro_batches x accumulation x dp."""
        return micro_batch_size * micro_batches * accumulation * self.dp

    def __str__(self) -> str:
        split = "" if self.pipeline_layers is None else " layers " + "+".join(map(str, self.pipeline_layers))
        experts = f" ep{self.ep}" if self.ep > 1 else ""
        context = f" cp{self.cp}" if self.cp > 1 else ""
        return f"dp{self.dp}{context} tp{self.tp} pp{self.pp}{experts}{split}"

