"""Fixed-seed evaluation: held-out loss and perplexity, generation with or without the KV cache, the report."""

from model_core.eval.generate import Generation, GenerationConfig, choose_token, generate, generate_batch
from model_core.eval.perplexity import HeldOutLoss, held_out_loss
from model_core.eval.report import EvalReport, PromptOutput, write_report

__all__ = [
    "EvalReport",
    "Generation",
    "GenerationConfig",
    "HeldOutLoss",
    "PromptOutput",
    "choose_token",
    "generate",
    "generate_batch",
    "held_out_loss",
    "write_report",
]
