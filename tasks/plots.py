"""Pictures for MLflow: the loss curve of a training stage as PNG bytes."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # no display on workers and CI

import matplotlib.pyplot as plt  # noqa: E402


def loss_curve_png(history: list[dict[str, float]], title: str) -> bytes:
    """Training loss (and validation loss where measured) against optimizer step."""
    figure, axis = plt.subplots(figsize=(7, 4), dpi=100)
    steps = [record["step"] for record in history]
    axis.plot(steps, [record["loss"] for record in history], label="train loss")
    validation = [(record["step"], record["validation_loss"]) for record in history if "validation_loss" in record]
    if validation:
        axis.plot(*zip(*validation), marker="o", label="validation loss")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("mean token loss (nats)")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()
