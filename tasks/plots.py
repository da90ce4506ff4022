"""Pictures for MLflow and `llmflow compare`: loss curves as PNG bytes."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # no display on workers and CI

import matplotlib.pyplot as plt  # noqa: E402


def loss_curve_png(history: list[dict[str, float]], title: str) -> bytes:
    """Training loss (and validation loss where measured) against optimizer step."""
    curves = {"train loss": [(record["step"], record["loss"]) for record in history]}
    validation = [(record["step"], record["validation_loss"]) for record in history if "validation_loss" in record]
    if validation:
        curves["validation loss"] = validation
    return overlay_png(curves, title, markers={"validation loss": "o"})


def overlay_png(curves: dict[str, list[tuple[int, float]]], title: str, markers: dict[str, str] | None = None) -> bytes:
    """Several (step, loss) curves on one plot, one labelled line each."""
    figure, axis = plt.subplots(figsize=(7, 4), dpi=100)
    for name, points in curves.items():
        axis.plot(*zip(*points), label=name, marker=(markers or {}).get(name))
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("mean token loss (nats)")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()
