"""The convert stage as a Prefect task: turn the Hugging Face checkpoint of `convert.hf_source` into ours
(or reuse the cached conversion), after checking the model section of params against its config.json."""

from __future__ import annotations

import math
import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from model_core.convert import convert_for_run
from model_core.storage import tensor_shapes
from params import PipelineParams, flatten
from tasks.retry import retry_on_transient_io
from tasks.tracking import Tracking, stage_run


class ConvertResult(BaseModel):
    """Where the converted checkpoint is (Trainer's `initial_weights`) and what it came from."""

    checkpoint_dir: Path
    params_path: Path
    reused: bool
    source_hash: str


@task(
    name="convert-hf",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_on_transient_io,
    cache_policy=NO_CACHE,  # reuse is decided by the conversion cache, keyed by the source files' content
)
def convert_hf(params: PipelineParams, tracking: Tracking) -> ConvertResult:
    with stage_run(tracking, "convert") as run:
        run.log_params(
            {
                key: value
                for key, value in flatten(params).items()
                if key.startswith(("convert.", "model.", "parallel.tensor_parallel"))
            }
        )
        started = time.perf_counter()
        result = convert_for_run(params.convert, params.model, params.parallel.tensor_parallel)
        run.log_metrics(
            {
                "seconds": time.perf_counter() - started,
                "parameters": sum(math.prod(shape) for shape in tensor_shapes(result.weights_path).values()),
                "vocab_size": result.vocab_size,
                "padded_vocab_size": result.params.vocab_size,
            }
        )
        run.set_tags(
            {
                "llmflow.reused": str(result.reused).lower(),
                "llmflow.source_hash": result.source_hash,
                "llmflow.checkpoint_dir": str(result.path),
            }
        )
        run.log_artifact(result.params_path, "convert")
        run.log_artifact(result.record_path, "convert")
    return ConvertResult(
        checkpoint_dir=result.path, params_path=result.params_path, reused=result.reused, source_hash=result.source_hash
    )
