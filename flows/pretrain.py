"""pretrain-flow: the whole pipeline, stage after stage, tracked as one MLflow parent run.

    data prep -> weight conversion (when convert.hf_source is set) -> smoke run
    -> layout trials (when parallel.layout_trial_steps is set) -> pretraining
    -> LoRA fine-tune (when lora.enabled) -> evaluation (base vs fine-tuned) -> a table of the stages
"""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel

from params import PipelineParams
from params.rules import check_run
from tasks.convert import ConvertResult, convert_hf
from tasks.data import DataResult, prepare_data
from tasks.evaluate import EvaluateStageResult, evaluate_stage
from tasks.finetune import FinetuneStageResult, finetune_stage
from tasks.layout import choose_layout
from tasks.summary import stage_table
from tasks.tracking import pipeline_run, record_warnings
from tasks.train import TrainStageResult, pretrain, smoke_run


class PipelineResult(BaseModel):
    mlflow_run_id: str
    data: DataResult
    converted: ConvertResult | None
    smoke: TrainStageResult | None
    pretrain: TrainStageResult
    finetune: FinetuneStageResult | None
    evaluation: EvaluateStageResult


@flow(name="pretrain-flow", log_prints=True)
def pretrain_flow(params: PipelineParams = PipelineParams()) -> PipelineResult:  # noqa: B008 (Prefect reads the default)
    warnings = check_run(params, finetunes=params.lora.enabled)  # before the first task: a deployment run is refused here
    with pipeline_run(params) as tracking:
        record_warnings(tracking, warnings)
        data = prepare_data(params, tracking)
        converted = convert_hf(params, tracking) if params.convert.hf_source else None
        smoke = smoke_run(params, data, tracking) if params.smoke.enabled else None
        if params.parallel.layout_trial_steps is not None:
            params = choose_layout(params, data, tracking)
        start_from = converted.checkpoint_dir if converted else None
        trained = pretrain(params, data, tracking, start_from)
        tuned = finetune_stage(params, data, trained.checkpoint, tracking) if params.lora.enabled else None
        evaluation = evaluate_stage(params, data, trained.checkpoint, tuned, tracking)
        print("pipeline summary:\n" + stage_table(data, converted, smoke, trained, tuned, evaluation))
        return PipelineResult(
            mlflow_run_id=tracking.parent_run_id,
            data=data,
            converted=converted,
            smoke=smoke,
            pretrain=trained,
            finetune=tuned,
            evaluation=evaluation,
        )
