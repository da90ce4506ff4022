"""Generation speed with and without the KV cache, on the tiny preset model and the reference model of
benchmarks/train_throughput.py, side by side.

Both paths run compiled graphs of fixed shapes: with the cache (`Llama.decode`) each token costs one
step over the new token against seq_len cache slots; without it (`generate(..., use_cache=False)`) each
token reruns the training forward over the whole context padded to seq_len. So both cost the same per
token at any context length, and a short run measures them. Greedy decoding from a random-init model with
EOS disabled, so every run makes exactly `--new-tokens` tokens; the two paths must agree token for token.

    python benchmarks/generation.py                  # both models
    python benchmarks/generation.py --models tiny    # one

tokens/s is new tokens over the wall time of a whole `generate` call (prefill of the prompt included), the
median of `--repeats` calls after a warm-up call that compiles the graphs (its time is `first_call_s`).
The last line printed is one JSON object: per model, both rates, their ratio and the first-call times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from train_throughput import REFERENCE  # the throughput benchmark's reference model

PROMPT_TOKENS = 16


def model_configs() -> dict[str, dict]:
    from params import load_params

    tiny = load_params("tiny").model.model_dump()
    return {"tiny": tiny, "reference": dict(REFERENCE)}


def time_generation(model, prompt: list[int], new_tokens: int, use_cache: bool, repeats: int) -> dict:
    from model_core.eval import GenerationConfig, generate

    config = GenerationConfig(max_new_tokens=new_tokens)
    vocab = model.embed_tokens.weight.shape[0]

    def run():
        start = time.perf_counter()
        out = generate(model, prompt, config, eos_id=-1, vocab_limit=vocab, seed=0, use_cache=use_cache)
        return out, time.perf_counter() - start

    _, first_call = run()
    timed = [run() for _ in range(repeats)]
    outputs = {tuple(out.token_ids) for out, _ in timed}
    assert len(outputs) == 1, "greedy generation changed between runs"
    seconds = statistics.median(s for _, s in timed)
    return {"tokens": list(outputs.pop()), "tokens_per_s": new_tokens / seconds, "first_call_s": first_call}


def bench_model(name: str, fields: dict, new_tokens: int, repeats: int) -> dict:
    import mindspore as ms

    from model_core.model import Llama, count_parameters
    from params.schema import ModelParams

    ms.set_seed(0)
    model = Llama(ModelParams(**fields))
    prompt = np.random.default_rng(0).integers(0, fields["vocab_size"], PROMPT_TOKENS).tolist()
    cached = time_generation(model, prompt, new_tokens, True, repeats)
    recomputed = time_generation(model, prompt, new_tokens, False, repeats)
    if cached["tokens"] != recomputed["tokens"]:
        raise AssertionError(f"{name}: the KV-cache and recompute paths generated different tokens")
    return {
        "parameters": count_parameters(model),
        "seq_len": fields["seq_len"],
        "new_tokens": new_tokens,
        "cache_tokens_per_s": round(cached["tokens_per_s"], 1),
        "recompute_tokens_per_s": round(recomputed["tokens_per_s"], 1),
        "speedup": round(cached["tokens_per_s"] / recomputed["tokens_per_s"], 2),
        "cache_first_call_s": round(cached["first_call_s"], 2),
        "recompute_first_call_s": round(recomputed["first_call_s"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,reference", help="comma-separated: tiny, reference")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    configs = model_configs()
    results = {name: bench_model(name, configs[name], args.new_tokens, args.repeats) for name in args.models.split(",")}
    print("| model | parameters | seq_len | KV cache tokens/s | recompute tokens/s | speedup | first call (compile) cache / recompute |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['parameters'] / 1e6:.1f}M | {r['seq_len']} | {r['cache_tokens_per_s']:,.1f} | "
            f"{r['recompute_tokens_per_s']:,.1f} | {r['speedup']:.2f}x | {r['cache_first_call_s']} s / {r['recompute_first_call_s']} s |"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
