"""What a sweep is: the base params of its trials, the params fields they vary (every combination of listed
values, or random draws), and the metric that ranks them. `load_sweep` reads one from YAML and checks it
before any trial runs: unknown keys, a misspelt params field or a value a field refuses are each one line that
names the file, the line and the field.

    name: lr
    params: tiny                    # the base: a preset or a params YAML file (relative to this file)
    overrides: {train.steps: 200}   # dotted params field -> value, for every trial
    method: grid                    # grid: every combination; random: `trials` draws, seeded
    space:
      optimizer.lr: [1.0e-3, 3.0e-3, 1.0e-2]          # values (grid or random)
      optimizer.weight_decay: {min: 0.01, max: 0.1}   # a range (random only), log scale unless scale: linear
    metric: pretrain.validation_loss                  # a headline metric of the pipeline run
    goal: minimize
"""

from __future__ import annotations

import itertools
import json
import math
import random
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from params.loading import ParamsError, _nearest_line, _read_yaml, load_params, resolve_source
from params.rules import ParallelConfigError, check_run
from params.schema import PipelineParams

# Fields a trial may not vary: the sweep records every trial in one MLflow experiment of one store.
FIXED_PREFIXES = ("tracking.",)


class _FieldProblem(ValueError):
    """A check across fields that belongs to one of them: the error message is put at that field's line."""

    def __init__(self, field: tuple[str, ...], message: str):
        super().__init__(message)
        self.field = field


class Range(BaseModel):
    """A continuous interval random search draws from."""

    model_config = ConfigDict(extra="forbid")

    min: float = Field(description="Lower end (inclusive).")
    max: float = Field(description="Upper end.")
    scale: Literal["log", "linear"] = Field(
        "log", description="log: uniform in log space, the usual choice for learning rates and weight decay."
    )

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if not self.min < self.max:
            relation = "equals" if self.min == self.max else "is above"
            raise ValueError(f"min={self.min} {relation} max={self.max}; a range needs min below max")
        if self.scale == "log" and self.min <= 0:
            raise ValueError(f"a log-scale range needs min > 0, got min={self.min} (or set scale: linear)")
        return self

    def draw(self, rng: random.Random) -> float:
        if self.scale == "linear":
            return rng.uniform(self.min, self.max)
        return math.exp(rng.uniform(math.log(self.min), math.log(self.max)))


def _space_kind(value: Any) -> str:
    return "range" if isinstance(value, (dict, Range)) else "values"


# A mapping is read as a range and anything else as values, so a mistake is reported against the one it meant.
SpaceValues = Annotated[
    Annotated[list[Any], Field(min_length=1), Tag("values")] | Annotated[Range, Tag("range")],
    Discriminator(_space_kind),
]


class Trial(BaseModel):
    """One pipeline run of a sweep: its number (1-based), the values it sets, and its resolved params."""

    number: int
    assignment: dict[str, Any]
    params: PipelineParams

    def label(self) -> str:
        return _label(self.assignment)


class SweepParams(BaseModel):
    """A grid or random search over params fields; each trial is one run of pretrain-flow."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="The sweep's name: its MLflow run and its trials are named after it.")
    params: str = Field("tiny", description="The base params: a preset name or a params YAML file.")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Dotted params field -> value, applied to the base for every trial."
    )
    method: Literal["grid", "random"] = Field("grid", description="grid: every combination; random: `trials` draws.")
    space: dict[str, SpaceValues] = Field(
        min_length=1, description="Dotted params field -> the values to try, or (random) a range to draw from."
    )
    trials: int | None = Field(None, ge=1, description="random: how many trials to draw.")
    seed: int = Field(0, description="random: the seed of the draws, so a sweep file always means the same trials.")
    metric: str = Field(
        "pretrain.validation_loss",
        description="The headline metric of a pipeline run that ranks the trials (`llmflow compare` lists them).",
    )
    goal: Literal["minimize", "maximize"] = Field("minimize", description="Whether lower or higher is better.")
    max_concurrency: int = Field(1, ge=1, description="Trials running at once.")

    @model_validator(mode="after")
    def _method_fits_space(self) -> SweepParams:
        if self.method == "grid":
            ranges = [name for name, values in self.space.items() if isinstance(values, Range)]
            if ranges:
                raise _FieldProblem(("space", ranges[0]), "a range, but a grid needs a list of values (or method: random)")
            if self.trials is not None:
                raise _FieldProblem(("trials",), f"trials={self.trials} is for method: random; a grid runs every combination")
        elif self.trials is None:
            raise _FieldProblem(("method",), "random needs trials: N (how many to draw)")
        return self

    def assignments(self) -> list[dict[str, Any]]:
        """The values each trial sets, in order: the grid's combinations (last field fastest), or seeded draws."""
        names = list(self.space)
        if self.method == "grid":
            return [dict(zip(names, values)) for values in itertools.product(*self.space.values())]
        rng = random.Random(self.seed)
        return [
            {name: values.draw(rng) if isinstance(values, Range) else rng.choice(values) for name, values in self.space.items()}
            for _ in range(self.trials)
        ]

    def trial_list(self) -> list[Trial]:
        """Every trial with its validated params, each judged as the pipeline run it is (ParamsError names the trial
        and the field a value breaks), so no trial starts while another cannot."""
        base = [_override(name, value) for name, value in self.overrides.items()]
        trials = []
        for number, assignment in enumerate(self.assignments(), start=1):
            sets = [_override(name, value) for name, value in assignment.items()]
            try:
                params = load_params(self.params, [*base, *sets])
                check_run(params, finetunes=params.lora.enabled)  # each trial is a pipeline run
            except (ParamsError, ParallelConfigError) as error:
                reason = str(error).replace("--set ", "")  # the values come from the sweep, not the command line
                raise ParamsError(f"sweep {self.name!r} trial {number} ({_label(assignment)}): {reason}") from None
            trials.append(Trial(number=number, assignment=assignment, params=params))
        return trials


def _override(name: str, value: Any) -> str:
    return f"{name}={json.dumps(value)}"  # JSON is YAML, which is how load_params reads a --set value


def _label(assignment: dict[str, Any]) -> str:
    """`optimizer.lr=0.003, train.seed=2`: floats to 4 significant digits (random draws have many more)."""
    return ", ".join(f"{name}={f'{value:.4g}' if isinstance(value, float) else value}" for name, value in assignment.items())


def load_sweep(path: str | Path) -> SweepParams:
    """Read and check a sweep file; its base params file, when a relative path, is read from the sweep file's
    directory. Every trial's params are built once here, so a value a field refuses fails before any run."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"sweep file {path} does not exist")
    raw, lines = _read_yaml(path)
    try:
        sweep = SweepParams.model_validate(raw)
    except ValidationError as error:
        raise ParamsError(_describe(error, path, lines)) from None
    for section in ("overrides", "space"):
        for name in getattr(sweep, section):
            problem = field_problem(name)
            if problem is None and section == "space" and name.startswith(FIXED_PREFIXES):
                problem = "tracking fields are fixed for a whole sweep (its trials are recorded together); set them in overrides"
            if problem:
                raise ParamsError(f"{path}:{lines.get((section, name), 1)}: {section}.{name}: {problem}")
    base = path.parent / sweep.params
    if sweep.params.endswith((".yaml", ".yml")) and not Path(sweep.params).is_absolute() and base.is_file():
        sweep = sweep.model_copy(update={"params": str(base.resolve())})
    resolve_source(sweep.params)
    try:
        sweep.trial_list()
    except ParamsError as error:
        raise ParamsError(f"{path}: {error}".replace("\n  ", "; ")) from None
    return sweep


def _describe(error: ValidationError, path: Path, lines: dict[tuple[str, ...], int]) -> str:
    """The first problem as one line, `file:line: field: message`; an unknown key first, since a misspelt key
    also makes the field it meant look missing."""
    items = sorted(error.errors(), key=lambda item: item["type"] != "extra_forbidden")
    loc, message = _problem(items[0])
    more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
    return f"{path}:{_nearest_line(loc, lines) or 1}: {'.'.join(loc) or 'sweep'}: {message}{more}"


def _problem(item: dict) -> tuple[tuple[str, ...], str]:
    """Where in the sweep file a validation error is (a key path) and what it says, with what would be taken."""
    loc = tuple(str(part) for part in item["loc"])
    message = item["msg"].removeprefix("Value error, ")
    cause = item.get("ctx", {}).get("error")
    if isinstance(cause, _FieldProblem):
        return cause.field, message
    if loc[:1] == ("space",) and len(loc) > 2:  # space, the field, which kind the value was read as, a range's key
        field, inner = loc[:2], loc[3:]
        if item["type"] == "list_type":
            return field, f"got {item['input']!r}; give a list of values, or for method: random a range {{min: ..., max: ...}}"
        if item["type"] == "too_short":
            return field, "lists no values; give at least one"
        if item["type"] == "extra_forbidden":
            return (*field, *inner), f"unknown range field (a range has {', '.join(Range.model_fields)})"
        return (*field, *inner), message
    if loc == ("space",) and item["type"] == "too_short":
        return loc, "names no field to vary; give at least one, e.g. optimizer.lr: [1.0e-3, 3.0e-3]"
    if item["type"] == "extra_forbidden":
        return loc, f"unknown sweep field (the fields are {', '.join(SweepParams.model_fields)})"
    return loc, message


def field_problem(dotted: str) -> str | None:
    """Why `dotted` names no params field (None when it does): the first unknown part and the fields there."""
    model: type[BaseModel] | None = PipelineParams
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        if model is None:
            return f"{'.'.join(parts[:depth])} is a value, not a section"
        if part not in model.model_fields:
            where = ".".join(parts[:depth]) or "the params"
            return f"unknown params field {part!r} ({where} has {', '.join(model.model_fields)})"
        model = _section_model(model.model_fields[part].annotation)
    if model is not None:
        return f"{dotted} is a section; name one of its fields ({', '.join(model.model_fields)})"
    return None


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The params model a field holds (through `X | None`), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (Union, types.UnionType):
        models = [arg for arg in typing.get_args(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)]
        return models[0] if models else None
    return None


def sweep_yaml(sweep: SweepParams) -> str:
    return yaml.safe_dump(sweep.model_dump(mode="json"), sort_keys=False)
