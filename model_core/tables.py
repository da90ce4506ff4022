"""Tables for people, shared by tasks and model_core: fixed-width for the console, Markdown for MLflow and
READMEs. The first row is the header."""

from __future__ import annotations


def fixed_width(rows: list[list[str]]) -> str:
    """Columns padded to their widest cell, a rule of dashes under the header."""
    widths = [max(len(cells[i]) for cells in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip() for cells in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def markdown(rows: list[list[str]]) -> str:
    header, *body = rows
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(cells) + " |" for cells in body)])
