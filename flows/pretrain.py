"""pretrain-flow: the whole pipeline, stage after stage, tracked as one MLflow parent run.

    data prep -> smoke run -> pretraining -> (weight conversion, LoRA fine-tune, evaluation: issues #5, #6)
"""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel

from params import PipelineParams
from tasks.data import DataResult, prepare_data
from tasks.tracking import pipeline_run
from tasks.train import TrainStageResult, pretrain, smoke_run


class PipelineResult(BaseModel):
    mlflow_run_id: str
    data: DataResult
    smoke: TrainStageResult | None
    pretrain: TrainStageResult


@flow(name="pretrain-flow", log_prints=True)
def pretrain_flow(params: PipelineParams = PipelineParams()) -> PipelineResult:  # noqa: B008 (Prefect reads the default)
    with pipeline_run(params) as tracking:
        data = prepare_data(params, tracking)
        smoke = smoke_run(params, data, tracking) if params.smoke.enabled else None
        trained = pretrain(params, data, tracking)
        return PipelineResult(mlflow_run_id=tracking.parent_run_id, data=data, smoke=smoke, pretrain=trained)
