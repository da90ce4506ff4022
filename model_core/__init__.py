"""What a run does: data, model, parallelism and training, with no knowledge of Prefect or MLflow.

Importing model_core asks MindSpore to launch compiled graphs on the calling thread
(`MS_DEV_HOST_BLOCKING_RUN=1`, unless the environment already says otherwise). By default the thread that
launches a graph busy-waits for its runtime queue to drain, which on these 2-core machines takes one core of
two away from the kernels: a training step took 7.9-9.7 CPU-seconds with it and 5.5-5.8 without
(benchmarks/README.md, "Train step"). MindSpore reads the variable at its first launch, so it is set here,
before any of our code runs an op.
"""

import os

os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")
