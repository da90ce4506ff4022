"""The `llmflow` command line: run the pipeline or one stage from a params preset or file, and the
conversion and tokenizer tools.

The pipeline commands take `--params NAME_OR_FILE` (default: the `tiny` preset) and any number of
`--set section.field=value` overrides. Errors are said on stderr without a traceback: bad params or
arguments exit with status 2 and a message naming the file, line and field (one line per problem); any
other failure exits with status 1 and its reason in one line (LLMFLOW_DEBUG=1 shows the traceback too).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from importlib import metadata
from typing import NoReturn

from flows.commands import (
    ckpt,
    compare,
    convert,
    evaluate,
    finetune,
    lora,
    params_show,
    plan,
    prep,
    run,
    sweep,
    tokenizer,
    train,
)
from model_core.parallel.launch import LaunchError, note_rank_failure
from params import ParamsError

# In the order `llmflow --help` lists them; each module holds its command's arguments beside its handler.
COMMANDS = (run, prep, train, finetune, evaluate, lora, compare, sweep, plan, ckpt, params_show, convert, tokenizer)


def _quiet_prefect_defaults() -> None:
    # Prefect's temporary local API otherwise prints a harmless analytics traceback.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Its 20 s default for the temporary API to start is missed on a busy machine, failing the run before it begins.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if not os.environ.get("LLMFLOW_DEBUG"):
        import logging

        for name in ("prefect.task_runs", "prefect.flow_runs"):
            logging.getLogger(name).addFilter(_without_traceback)


def _without_traceback(record) -> bool:
    """A failed task or flow run is logged by Prefect's engine with its traceback, once per enclosing run; the
    failure's own message is in the record's text and in llmflow's last line, so the traceback is kept only
    for LLMFLOW_DEBUG=1."""
    record.exc_info, record.exc_text = None, None
    return True


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line (the usage itself is one --help away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _version() -> str:
    try:
        return metadata.version("llmflow")
    except metadata.PackageNotFoundError:  # a checkout run without installing it
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="llmflow",
        description="Declarative LLM pretraining and fine-tuning on MindSpore, orchestrated by Prefect, "
        "tracked in MLflow.",
    )
    parser.add_argument("--version", action="version", version=f"llmflow {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    raw_args = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(raw_args)
    args.raw_args = raw_args
    handler: Callable[[argparse.Namespace], int] = args.handler
    _quiet_prefect_defaults()
    try:
        return handler(args)
    except ParamsError as error:
        print(f"llmflow: {error}", file=sys.stderr)
        note_rank_failure(str(error))  # a rank under msrun: for its launcher to report
        return 2
    except KeyboardInterrupt:
        print(f"llmflow {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if os.environ.get("LLMFLOW_DEBUG"):
            raise
        reason = _reason(error)
        print(f"llmflow {args.command}: {reason}", file=sys.stderr)
        note_rank_failure(reason)
        return 1


def _reason(error: Exception) -> str:
    """What went wrong, for people: llmflow's own message, an OS error's file and cause, or for anything
    unexpected its type, with the way to see where."""
    if isinstance(error, OSError) and error.strerror and error.filename:
        return f"{error.filename}: {error.strerror}"
    if isinstance(error, (ValueError, ArithmeticError, LaunchError, OSError)):  # bad input, a diverged run, a failed rank
        return str(error)
    return f"{type(error).__name__}: {error} (unexpected; LLMFLOW_DEBUG=1 shows the traceback)"


if __name__ == "__main__":
    sys.exit(main())
