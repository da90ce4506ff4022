"""Generation speed: our KV-cache `generate` against Hugging Face `transformers` `generate`, same weights, side by side.

The reference model of benchmarks/train_throughput.py (random init, seed 0) decodes with our
`model_core.eval.generate_batch`; its weights, converted by `model_core.convert.llama.to_hf`, load into a
`transformers` LlamaForCausalLM that decodes with `generate(use_cache=True)`. Both run 2 kernel threads (MindSpore
op_tuning.threads_num, torch.set_num_threads), decode the same prompts (`--batches`: 1 prompt, then 8 prompts of
different lengths, left-padded on both sides) for exactly `--new-tokens` tokens each (EOS disabled), greedy and
sampled (temperature 0.8, top-k 40: speed only, the two samplers draw differently). Greedy outputs must be the
same token for token (`greedy_identical`). transformers runs in a child process of its own, loading the converted
weights from a temporary directory, so that MindSpore's kernel threads do not share its process. The child stays up
and the two sides take turns case by case, `--rounds` times (transformers first in odd rounds, ours first in even
ones), so each pair of figures meets the same load on a shared machine; each side's rate is the median over rounds.

    python benchmarks/generation.py                       # batch 1 and 8, greedy and sampled, ~3 min here
    python benchmarks/generation.py --batches 8 --new-tokens 32

tokens/s is new tokens of all rows over the wall time of a whole generate call (prompt prefill included), the
median of `--repeats` calls after a warm-up call. Ours compiles its decode graphs in the warm-up and runs past
MindSpore's per-kernel thread-split search there (the first ~30 launches of every kernel; see AUTOTUNED_AFTER in
train_throughput.py), so the warm-up is at least that many tokens. The last line printed is one JSON object:
ours_b{B}_tokens_per_s and hf_b{B}_tokens_per_s (greedy), the sampled rates, and greedy_identical.
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
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from train_throughput import AUTOTUNED_AFTER, REFERENCE  # the throughput benchmark's reference model

THREADS = 2
SAMPLING = {"temperature": 0.8, "top_k": 40}


def prompts(count: int) -> list[list[int]]:
    """`count` prompts of 12 to 19 tokens (different lengths from the second on), the same for every batch size."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, REFERENCE["vocab_size"], 12 + index % 8).tolist() for index in range(count)]


def median_rate(run, tokens: int, repeats: int) -> tuple[float, list[list[int]]]:
    """tokens / median seconds of `repeats` calls of run() -> outputs, and the outputs (the same every call)."""
    seconds, outputs = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = run()
        seconds.append(time.perf_counter() - start)
    return tokens / statistics.median(seconds), outputs


def ours(model, batch: list[list[int]], new_tokens: int, sampled: bool, repeats: int) -> tuple[float, list[list[int]]]:
    from model_core.eval import GenerationConfig, generate_batch

    config = GenerationConfig(max_new_tokens=new_tokens, **(SAMPLING if sampled else {}))
    vocab = REFERENCE["vocab_size"]

    def run(config=config):
        return [out.token_ids for out in generate_batch(model, batch, config, eos_id=-1, vocab_limit=vocab, seed=0)]

    run(GenerationConfig(max_new_tokens=max(new_tokens, AUTOTUNED_AFTER), **(SAMPLING if sampled else {})))
    return median_rate(run, new_tokens * len(batch), repeats)


def hf(model, batch: list[list[int]], new_tokens: int, sampled: bool, repeats: int) -> tuple[float, list[list[int]]]:
    import torch

    width = max(len(ids) for ids in batch)
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    options = {"do_sample": True, "top_p": 1.0, **SAMPLING} if sampled else {"do_sample": False}

    def run(tokens=new_tokens):
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=tokens, min_new_tokens=tokens,
                use_cache=True, pad_token_id=0, eos_token_id=None, **options,
            )
        return out[:, width:].tolist()

    run(max(new_tokens, AUTOTUNED_AFTER))
    return median_rate(run, new_tokens * len(batch), repeats)


def build_ours(hf_dir: Path):
    """Our reference model (seed 0), with its weights converted for transformers written to `hf_dir`."""
    import mindspore as ms

    from model_core.convert.llama import to_hf
    from model_core.model import Llama
    from model_core.model.weights import model_weights
    from params.schema import ModelParams

    ms.device_context.cpu.op_tuning.threads_num(THREADS)
    ms.set_seed(0)
    params = ModelParams(**REFERENCE)
    model = Llama(params)
    state, config = to_hf(model_weights(model), params)
    np.savez(hf_dir / "weights.npz", **state)
    (hf_dir / "config.json").write_text(json.dumps(config))
    return model


def load_hf(hf_dir: Path):
    import torch
    import transformers

    torch.set_num_threads(THREADS)
    config = json.loads((hf_dir / "config.json").read_text())
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    with np.load(hf_dir / "weights.npz") as state:
        weights = {name: torch.from_numpy(state[name]) for name in state.files}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise AssertionError(f"converted weights do not fit LlamaForCausalLM: missing {missing}, extra {unexpected}")
    model.tie_weights()
    model.generation_config.eos_token_id = None
    return model


def cases(batches: str):
    for batch_size in (int(b) for b in batches.split(",")):
        for sampled in (False, True):
            yield batch_size, sampled, f"b{batch_size}" + ("_sampled" if sampled else "")


def hf_worker(args) -> None:
    """The transformers side, in a process of its own: MindSpore's kernel threads, idle or spinning, are not in it.
    Reads one case a line ([batch size, sampled]) and answers each with one line, [rate, outputs]."""
    model = load_hf(Path(args.hf_worker))
    print("ready", flush=True)
    for line in sys.stdin:
        batch_size, sampled = json.loads(line)
        print(json.dumps(hf(model, prompts(batch_size), args.new_tokens, sampled, args.repeats)), flush=True)


def ask(worker: subprocess.Popen, batch_size: int, sampled: bool) -> tuple[float, list[list[int]]]:
    """One case decoded by the transformers child."""
    worker.stdin.write(json.dumps([batch_size, sampled]) + "\n")
    worker.stdin.flush()
    answer = worker.stdout.readline()
    if not answer:
        raise RuntimeError(f"the transformers worker stopped:\n{worker.stderr.read()[-3000:]}")
    rate, outputs = json.loads(answer)
    return rate, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="turns each side takes at every case")
    parser.add_argument("--hf-worker", help=argparse.SUPPRESS)  # internal: run the transformers side on this dir
    args = parser.parse_args()
    if args.hf_worker:
        return hf_worker(args)
    with tempfile.TemporaryDirectory() as hf_dir:
        model = build_ours(Path(hf_dir))
        command = [sys.executable, __file__, "--hf-worker", hf_dir, "--new-tokens", str(args.new_tokens),
                   "--repeats", str(args.repeats)]
        worker = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        try:
            if worker.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the transformers worker failed:\n{worker.stderr.read()[-3000:]}")
            measured = {}
            for batch_size, sampled, suffix in cases(args.batches):
                turns = {"ours": [], "hf": []}
                for round_index in range(args.rounds):
                    order = ("hf", "ours") if round_index % 2 == 0 else ("ours", "hf")
                    for side in order:
                        if side == "hf":
                            turns["hf"].append(ask(worker, batch_size, sampled))
                        else:
                            batch = prompts(batch_size)
                            turns["ours"].append(ours(model, batch, args.new_tokens, sampled, args.repeats))
                measured[suffix] = {
                    side: (statistics.median(rate for rate, _ in runs), runs[-1][1]) for side, runs in turns.items()
                }
        finally:
            worker.stdin.close()
            worker.wait(timeout=60)
    results, identical = {}, True
    print("| batch | decoding | ours tokens/s | transformers tokens/s | ours / transformers |")
    print("|---:|---|---:|---:|---:|")
    for batch_size, sampled, suffix in cases(args.batches):
        (ours_rate, ours_out), (hf_rate, hf_out) = measured[suffix]["ours"], measured[suffix]["hf"]
        results[f"ours_{suffix}_tokens_per_s"] = round(ours_rate, 1)
        results[f"hf_{suffix}_tokens_per_s"] = round(hf_rate, 1)
        if not sampled:
            same = ours_out == hf_out
            identical &= same
            results[f"greedy_identical_b{batch_size}"] = same
        name = "sampled" if sampled else "greedy"
        print(f"| {batch_size} | {name} | {ours_rate:,.1f} | {hf_rate:,.1f} | {ours_rate / hf_rate:.2f}x |")
    results["greedy_identical"] = identical
    results["new_tokens"] = args.new_tokens
    print(json.dumps(results))


if __name__ == "__main__":
    main()
