"""The evaluation report of one checkpoint: held-out metrics and generations, as JSON (for machines) and
Markdown (for people), each written whole (`storage.write_file`) so a reader never sees half a report."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from model_core.eval.generate import GenerationConfig, StopReason
from model_core.eval.perplexity import HeldOutLoss
from model_core.storage import write_file

JSON_NAME, MARKDOWN_NAME = "eval_report.json", "eval_report.md"


@dataclass(frozen=True)
class PromptOutput:
    prompt: str
    prompt_ids: list[int]
    token_ids: list[int]  # the generated ids
    text: str  # token_ids decoded
    stopped_by: StopReason


@dataclass(frozen=True)
class EvalReport:
    checkpoint: str
    adapters: list[str]  # adapters applied on top of the checkpoint, in order; empty for none
    decoding: GenerationConfig
    seed: int
    held_out: dict[str, HeldOutLoss]  # dataset name -> its metrics
    generations: list[PromptOutput]  # one per prompt, in prompt order


def write_report(report: EvalReport, directory: str | Path) -> tuple[Path, Path]:
    """(json path, markdown path) of the report written into `directory`."""
    directory = Path(directory)
    json_path, markdown_path = directory / JSON_NAME, directory / MARKDOWN_NAME
    write_file(json_path, json.dumps(asdict(report), indent=2, ensure_ascii=False) + "\n")
    write_file(markdown_path, to_markdown(report))
    return json_path, markdown_path


def to_markdown(report: EvalReport) -> str:
    decoding = report.decoding
    sampling = (
        "greedy (temperature 0)"
        if decoding.temperature == 0
        else f"temperature {decoding.temperature}, top_k {decoding.top_k}, top_p {decoding.top_p}"
    )
    lines = [
        f"# Evaluation of `{report.checkpoint}`",
        "",
        f"- adapters: {', '.join(f'`{a}`' for a in report.adapters) or 'none'}",
        (
            f"- decoding: {sampling}, repetition_penalty {decoding.repetition_penalty}, "
            f"max_new_tokens {decoding.max_new_tokens}, stop_token_ids {list(decoding.stop_token_ids)}"
        ),
        f"- seed: {report.seed}",
        "",
        "## Held-out loss",
        "",
        "| dataset | loss (nats/token) | perplexity | tokens | batches |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {m.mean_loss:.4f} | {m.perplexity:.2f} | {m.tokens} | {m.batches} |"
            for name, m in report.held_out.items()
        ),
        "",
        "## Generations",
    ]
    for number, output in enumerate(report.generations, start=1):
        lines += [
            "",
            f"### Prompt {number}",
            "",
            _fenced(output.prompt),
            "",
            f"Output ({len(output.token_ids)} tokens, stopped by {output.stopped_by}):",
            "",
            _fenced(output.text),
        ]
    return "\n".join(lines) + "\n"


def _fenced(text: str) -> str:
    """A code block holding `text` verbatim: its fence is longer than any run of backticks inside."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"
