"""Mixture-of-experts layer throughput and peak memory: our MoE block's forward + backward against a PyTorch eager
implementation of the same layer, same shapes and weights, side by side.

The layer: 8 SwiGLU experts (hidden 512, ffn 1376), top-2 softmax routing renormalised (Mixtral's), on 2,048
tokens (8 x 256). Ours is `model_core.model.moe.MoE` under `ms.jit` with `value_and_grad` (how the trainer
runs it), dropless (every expert gets a slot per token: E/k = 4x the routed FLOPs) and with capacity factor
1.25; PyTorch's is the per-expert loop of `transformers`' Mixtral (tokens gathered per expert, `index_add_`
back), which computes only the routed tokens. The loss is the sum of the outputs plus the load-balancing
loss, so the backward reaches the router through both. Each variant runs in its own subprocess, so its peak
RSS (VmHWM) is its own.

Expert parallelism: the same layer step (capacity 1.25) on the same 2,048 tokens, as one process with 2 threads
(ep1) and as two msrun ranks with 1 thread each (ep2), each rank routing its 4 sequences and holding 4 of the 8
experts, the dispatch buffer exchanged by all-to-all (on CPU the all-reduce fallback of
`model_core.parallel.comm`). ep2_over_ep1 is the ratio of their tokens/s (ep2: the whole batch over rank 0's
median step time).

    python benchmarks/moe.py                       # every variant, two rounds
    python benchmarks/moe.py --variant ours-cf1.25 # one variant in this process (JSON line)

The last line is one JSON object: ours_tokens_per_s and ours_peak_rss_mb (the capacity-1.25 variant),
torch_tokens_per_s, torch_peak_rss_mb, their ratios, the dropless figures, ep1_tokens_per_s, ep2_tokens_per_s
and ep2_over_ep1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
EXPERTS, TOP_K, HIDDEN, FFN, BATCH, SEQ = 8, 2, 512, 1376, 8, 256
TOKENS = BATCH * SEQ
AUX_COEF = 0.01
WARMUP = 31  # MindSpore's CPU kernels settle their thread split after 30 launches (see train_throughput.py)
STEPS = 20
VARIANTS = {"torch": None, "ours-dropless": None, "ours-cf1.25": 1.25}
EP_CAPACITY = 1.25


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    """The layer's weights, shared by both frameworks: router [E, H], experts' gate/up [E, F, H], down [E, H, F]."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: (rng.standard_normal(shape) * 0.02).astype(np.float32)  # noqa: E731
    return {"router": draw(EXPERTS, HIDDEN), "gate": draw(EXPERTS, FFN, HIDDEN), "up": draw(EXPERTS, FFN, HIDDEN),
            "down": draw(EXPERTS, HIDDEN, FFN)}


def inputs(step: int) -> np.ndarray:
    return np.random.default_rng(100 + step).standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32)


def peak_rss_mb() -> float:
    sys.path.insert(0, str(REPO))
    from model_core.train.system import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def timed(step, warmup: int, steps: int) -> dict:
    seconds, cpu = [], []
    for i in range(warmup + steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        step(i)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    return {
        "tokens_per_s": TOKENS / statistics.median(seconds[warmup:]),
        "cpu_seconds_per_step": round(statistics.median(cpu[warmup:]), 4),
        "step_seconds": [round(s, 4) for s in seconds[warmup:]],
    }


def layer_params(capacity_factor: float | None, experts: int = EXPERTS):
    from params.schema import ModelParams

    return ModelParams(
        vocab_size=64, hidden_size=HIDDEN, num_layers=1, num_heads=8, num_kv_heads=8, ffn_hidden_size=FFN,
        seq_len=SEQ, moe={"num_experts": experts, "experts_per_token": TOP_K, "capacity_factor": capacity_factor},
    )


def run_ours(capacity_factor: float | None, warmup: int, steps: int, ep: int = 1) -> dict:
    """Our layer's step; with ep > 1 this is one rank of an msrun job of ep ranks, routing its BATCH / ep
    sequences, holding its EXPERTS / ep experts."""
    sys.path.insert(0, str(REPO))
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from model_core.model.moe import Experts, MoE
    from model_core.parallel import comm
    from model_core.parallel.expert import ExpertParallelExperts

    group = comm.group(tuple(range(ep)))
    layer = MoE(layer_params(capacity_factor), output_std=0.02)
    values = weights()
    layer.router.weight.set_data(Tensor(values["router"]))
    experts = Experts(layer_params(capacity_factor, EXPERTS // ep), output_std=0.02) if ep > 1 else layer.experts
    for name, key in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
        getattr(experts, name).set_data(Tensor(np.split(values[key], ep)[group.index]))
    if ep > 1:
        layer.experts = ExpertParallelExperts(experts, group)
    rows = slice(group.index * BATCH // ep, (group.index + 1) * BATCH // ep)

    class Objective(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def construct(self, x):
            out, (aux, _, _, dropped) = self.layer(x)
            return out.sum() + AUX_COEF * aux, dropped

    class Step(nn.Cell):
        """Forward and backward as one compiled graph, as the trainer's AccumulateGradients runs them."""

        def __init__(self, objective: nn.Cell):
            super().__init__()
            self.grad = ops.value_and_grad(objective, None, objective.trainable_params(), has_aux=True)

        @ms.jit
        def construct(self, x):
            return self.grad(x)

    step_graph = Step(Objective())
    dropped = []

    def step(i: int) -> None:
        (_, lost), grads = step_graph(Tensor(inputs(i)[rows]))
        dropped.append(float(lost.asnumpy()))
        _ = [g.asnumpy() for g in grads[:1]]  # wait for the step to finish

    result = timed(step, warmup, steps)
    result["dropped_choices_per_step"] = statistics.median(dropped[warmup:])
    return result


def run_torch(warmup: int, steps: int) -> dict:
    import torch
    import torch.nn.functional as F

    values = {name: torch.tensor(array, requires_grad=True) for name, array in weights().items()}

    def layer(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, HIDDEN)
        probs = F.softmax(F.linear(flat, values["router"]).float(), dim=-1)
        chosen_weights, chosen = torch.topk(probs, TOP_K, dim=-1)
        chosen_weights = chosen_weights / chosen_weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for expert in range(EXPERTS):
            token, rank = torch.where(chosen == expert)
            if token.numel() == 0:
                continue
            h = flat[token]
            h = F.silu(F.linear(h, values["gate"][expert])) * F.linear(h, values["up"][expert])
            out.index_add_(0, token, F.linear(h, values["down"][expert]) * chosen_weights[token, rank, None])
        load = F.one_hot(chosen, EXPERTS).sum((0, 1)).float()
        aux = EXPERTS * (load / (TOP_K * flat.shape[0]) * probs.mean(0)).sum()
        return out.sum() + AUX_COEF * aux

    def step(i: int) -> None:
        for value in values.values():
            value.grad = None
        layer(torch.from_numpy(inputs(i))).backward()

    return timed(step, warmup, steps)


def run_expert_parallel_rank(out: Path) -> None:
    """One rank of the ep2 job (started by msrun): 1 thread, its share of the batch and of the experts."""
    sys.path.insert(0, str(REPO))
    import mindspore as ms

    from model_core.parallel import comm

    comm.init()
    ms.device_context.cpu.op_tuning.threads_num(1)
    result = run_ours(EP_CAPACITY, WARMUP, STEPS, ep=comm.world_size())
    if comm.rank() == 0:
        out.write_text(json.dumps({"variant": "ep2", **result, "peak_rss_mb": round(peak_rss_mb(), 1)}))
    comm.barrier()


def run_expert_parallel(work: Path) -> dict:
    """The ep2 job on 2 msrun ranks; rank 0's record."""
    sys.path.insert(0, str(REPO))
    from model_core.parallel.launch import launch

    out = work / "ep2.json"
    launch([__file__, "--ep-rank", str(out)], 2, work / "logs", grace_s=10)
    return json.loads(out.read_text())


def run_variant(name: str) -> dict:
    if name == "torch":
        result = run_torch(5, STEPS)
    elif name == "ep1":
        import mindspore as ms

        ms.device_context.cpu.op_tuning.threads_num(2)
        result = run_ours(EP_CAPACITY, WARMUP, STEPS)
    else:
        result = run_ours(VARIANTS[name], WARMUP, STEPS)
    return {"variant": name, **result, "peak_rss_mb": round(peak_rss_mb(), 1)}


def run_in_subprocess(name: str, work: Path) -> dict:
    """One variant's record, measured in a fresh process (ep2: a fresh msrun job)."""
    if name == "ep2":
        return run_expert_parallel(work)
    out = subprocess.run([sys.executable, __file__, "--variant", name], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=[*VARIANTS, "ep1"], help="run one variant in this process")
    parser.add_argument("--ep-rank", type=Path, help=argparse.SUPPRESS)  # a rank of the ep2 job, writing here
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.ep_rank:
        run_expert_parallel_rank(args.ep_rank)
        return
    if args.variant:
        print(json.dumps(run_variant(args.variant)))
        return
    found: dict[str, list[dict]] = {name: [] for name in [*VARIANTS, "ep1", "ep2"]}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(args.rounds):
            for name in found:
                found[name].append(record := run_in_subprocess(name, Path(work)))
                print(f"{name}: {record['tokens_per_s']:.0f} tokens/s, {record['cpu_seconds_per_step']} CPU s/step, "
                      f"peak RSS {record['peak_rss_mb']:.0f} MB"
                      + (f", {record['dropped_choices_per_step']:.0f} choices dropped/step" if "dropped_choices_per_step" in record else ""))
    pooled = {
        name: {"tokens_per_s": statistics.median(TOKENS / s for r in runs for s in r["step_seconds"]),
               "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}
        for name, runs in found.items()
    }
    ours, torch_, dropless = pooled["ours-cf1.25"], pooled["torch"], pooled["ours-dropless"]
    ep1, ep2 = pooled["ep1"], pooled["ep2"]
    print(f"ep2 (2 ranks x 1 thread) over ep1 (1 process x 2 threads): {ep2['tokens_per_s'] / ep1['tokens_per_s']:.3f}")
    print(json.dumps({
        "ours_tokens_per_s": round(ours["tokens_per_s"], 1), "torch_tokens_per_s": round(torch_["tokens_per_s"], 1),
        "ours_peak_rss_mb": ours["peak_rss_mb"], "torch_peak_rss_mb": torch_["peak_rss_mb"],
        "tokens_per_s_ratio": round(ours["tokens_per_s"] / torch_["tokens_per_s"], 3),
        "peak_rss_ratio": round(ours["peak_rss_mb"] / torch_["peak_rss_mb"], 3),
        "dropless_tokens_per_s": round(dropless["tokens_per_s"], 1), "dropless_peak_rss_mb": dropless["peak_rss_mb"],
        "ep1_tokens_per_s": round(ep1["tokens_per_s"], 1), "ep2_tokens_per_s": round(ep2["tokens_per_s"], 1),
        "ep2_over_ep1": round(ep2["tokens_per_s"] / ep1["tokens_per_s"], 3),
    }))


if __name__ == "__main__":
    main()
