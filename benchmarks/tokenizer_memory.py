"""What training the tokenizer costs in memory, per million sample lines, and that the prep process keeps none.

The sample: the first N non-blank lines of the installed standard library's and site-packages' .py files
(code text, like the corpora the issue measured), in sorted path order. Each N trains with the default
tokenizer params and model.vocab_size=--vocab-size through `train_tokenizer_apart`, as data prep does for a
sample above TRAIN_HERE_LINES: the child makes the sample and trains. Printed per N: the sample's lines and
characters, the child's peak resident memory (its getrusage maxrss: the interpreter and imports, the sample's
strings and the trainer's own), the seconds, and this process's RSS before and after (from /proc).

    python benchmarks/tokenizer_memory.py --lines 200000 1000000
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model_core.data.tokenizer import train_tokenizer_apart
from params.schema import TokenizerParams


def code_lines(count: int) -> list[str]:
    lines: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        lines += [line for line in text.split("\n") if line.strip()]
        if len(lines) >= count:
            return lines[:count]
    raise SystemExit(f"the standard library holds only {len(lines)} non-blank lines of .py, fewer than {count}")


def rss_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[200_000, 1_000_000])
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    for count in args.lines:
        params = TokenizerParams(training_sentences=count)
        before = rss_bytes()
        started = time.perf_counter()
        model, peak = train_tokenizer_apart(functools.partial(code_lines, count), params, args.vocab_size, 1234, args.threads)
        seconds, after = time.perf_counter() - started, rss_bytes()
        characters = sum(map(len, code_lines(count)))  # read here only after this process's RSS was taken
        print(json.dumps({
            "lines": count, "characters": characters, "vocab_size": args.vocab_size, "model_bytes": len(model),
            "child_peak_rss_mb": round(peak / 2**20), "seconds": round(seconds, 1),
            "parent_rss_before_mb": round(before / 2**20), "parent_rss_after_mb": round(after / 2**20),
        }), flush=True)


if __name__ == "__main__":
    main()
