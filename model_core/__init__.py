"""What a run does: data, model, parallelism and training, with no knowledge of Prefect or MLflow.

Its packages import one way, each only those before it (tests/test_repo.py holds them to it):
storage (safetensors, sha256, directories committed whole) and tables (for the console) <- data
<- model (the single-device Llama, LoRA) <- optim (AdamW's arithmetic and the compiled step pieces) <- parallel (the placement table, a rank's shard, tp/pp/ZeRO, the AdamW of every layout)
<- train (the loop, checkpoints) <- convert (Hugging Face <-> llmflow) <- eval.

Importing model_core asks MindSpore to launch compiled graphs on the calling thread
(`MS_DEV_HOST_BLOCKING_RUN=1`, unless the environment already says otherwise). By default the thread that
launches a graph busy-waits for its runtime queue to drain, which on these 2-core machines takes one core of
two away from the kernels (a training step's CPU time with and without it: benchmarks/README.md, "Train
step"). MindSpore reads the variable at its first launch, so it is set here, before any of our code runs an op.

`model_core.load_model(checkpoint, adapters=None)` gives a model that returns logits from any checkpoint
directory llmflow writes (converted, merged, or trained under any layout), for notebooks and scripts.
"""

import os

os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")


def __getattr__(name: str):
    # Imported on first use: data-prep workers import model_core.data and must not pay for MindSpore.
    if name == "load_model":
        from model_core.eval.evaluate import load_model

        return load_model
    raise AttributeError(f"module 'model_core' has no attribute {name!r}")
