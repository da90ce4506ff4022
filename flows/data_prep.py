"""data-prep-flow: only the data stage, for preparing or refreshing a dataset on its own."""

from __future__ import annotations

from prefect import flow

from params import PipelineParams
from tasks.data import DataResult, prepare_data
from tasks.tracking import pipeline_run


@flow(name="data-prep-flow", log_prints=True)
def data_prep_flow(params: PipelineParams = PipelineParams()) -> DataResult:  # noqa: B008 (Prefect reads the default)
    with pipeline_run(params) as tracking:
        return prepare_data(params, tracking)
