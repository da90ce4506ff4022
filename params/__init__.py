"""What a run is: typed, validated params (see schema.py) and the YAML presets beside this file."""

from params.loading import ParamsError, flatten, load_params, params_hash, preset_names, to_yaml
from params.schema import (
    ConvertParams,
    DataParams,
    DataSource,
    EvalParams,
    LoraParams,
    ModelParams,
    OptimizerParams,
    ParallelParams,
    PipelineParams,
    PrecisionParams,
    RecomputeParams,
    SmokeParams,
    TokenizerParams,
    TrackingParams,
    TrainParams,
)

__all__ = [
    "ConvertParams",
    "DataParams",
    "DataSource",
    "EvalParams",
    "LoraParams",
    "ModelParams",
    "OptimizerParams",
    "ParallelParams",
    "ParamsError",
    "PipelineParams",
    "PrecisionParams",
    "RecomputeParams",
    "SmokeParams",
    "TokenizerParams",
    "TrackingParams",
    "TrainParams",
    "flatten",
    "load_params",
    "params_hash",
    "preset_names",
    "to_yaml",
]
