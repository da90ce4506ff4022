"""pretrain-flow: the whole pipeline, stage after stage, tracked as one MLflow parent run.

    data prep -> (weight conversion -> smoke run -> sharded pretraining -> LoRA fine-tune -> evaluation)

Stages in parentheses arrive with their issues; each is one task call below.
"""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel

from params import PipelineParams
from tasks.data import DataResult, prepare_data
from tasks.tracking import pipeline_run


class PipelineResult(BaseModel):
    mlflow_run_id: str
    data: DataResult


@flow(name="pretrain-flow", log_prints=True)
def pretrain_flow(params: PipelineParams = PipelineParams()) -> PipelineResult:  # noqa: B008 (Prefect reads the default)
    with pipeline_run(params) as tracking:
        data = prepare_data(params, tracking)
        return PipelineResult(mlflow_run_id=tracking.parent_run_id, data=data)
