"""Turn a preset name or YAML file plus `--set a.b=c` overrides into validated PipelineParams.

Errors are for people: a YAML syntax error, an unknown key or a bad value is reported as a
ParamsError that names the file, the line (when the value came from the file) and the field.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from params.schema import PipelineParams

PRESETS_DIR = Path(__file__).resolve().parent


class ParamsError(ValueError):
    """Params that cannot describe a run; the message says where and why."""


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESETS_DIR.glob("*.yaml"))


def resolve_source(source: str | Path) -> Path:
    """A preset name (`tiny`) or a path to a YAML file."""
    path = Path(source)
    if path.suffix in {".yaml", ".yml"} or path.exists():
        if not path.is_file():
            raise ParamsError(f"params file {path} does not exist")
        return path
    preset = PRESETS_DIR / f"{source}.yaml"
    if not preset.is_file():
        raise ParamsError(f"unknown preset {source!r}; presets are {', '.join(preset_names())}, or give a YAML path")
    return preset


def load_params(source: str | Path | None = "tiny", overrides: list[str] | tuple[str, ...] = ()) -> PipelineParams:
    """Read a preset or YAML file (None means the built-in defaults), apply overrides, validate."""
    raw: dict[str, Any] = {}
    lines: dict[tuple[str, ...], int] = {}
    path: Path | None = None
    if source is not None:
        path = resolve_source(source)
        raw, lines = _read_yaml(path)
    overridden: dict[tuple[str, ...], str] = {}
    for override in overrides:
        overridden[_apply_override(raw, override)] = override
    try:
        return PipelineParams.model_validate(raw)
    except ValidationError as error:
        raise ParamsError(_describe(error, path, lines, overridden)) from None


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[tuple[str, ...], int]]:
    text = path.read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ParamsError(f"{where}: invalid YAML: {getattr(error, 'problem', error)}") from None
    if raw is None:
        return {}, {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    lines: dict[tuple[str, ...], int] = {}
    _record_lines(node, (), lines)
    return raw, lines


def _record_lines(node: yaml.Node, prefix: tuple[str, ...], lines: dict[tuple[str, ...], int]) -> None:
    """Map every key path of a composed YAML document to its 1-based line number."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = (*prefix, str(key_node.value))
            lines[key] = key_node.start_mark.line + 1
            _record_lines(value_node, key, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            key = (*prefix, str(index))
            lines[key] = item.start_mark.line + 1
            _record_lines(item, key, lines)


def _apply_override(raw: dict[str, Any], override: str) -> tuple[str, ...]:
    """`a.b.c=value`; the value is parsed as YAML so numbers, booleans, null and lists keep their type."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ParamsError(f"override {override!r} must look like section.field=value")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ParamsError(f"override {override!r}: value is not valid YAML ({error})") from None
    parts = key.strip().split(".")
    target = raw
    for depth, part in enumerate(parts[:-1]):
        child = target.setdefault(part, {})
        if not isinstance(child, dict):
            raise ParamsError(f"override {override!r}: {'.'.join(parts[: depth + 1])} is not a section")
        target = child
    target[parts[-1]] = value
    return tuple(parts)


def _describe(
    error: ValidationError,
    path: Path | None,
    lines: dict[tuple[str, ...], int],
    overridden: dict[tuple[str, ...], str],
) -> str:
    problems = []
    for item in error.errors():
        loc = tuple(str(part) for part in item["loc"])
        field = ".".join(loc) or "params"
        setting = [text for key, text in overridden.items() if loc[: len(key)] == key]
        inside = [text for key, text in overridden.items() if key[: len(loc)] == loc and key != loc]
        line = _nearest_line(loc, lines)
        if setting:
            where = f"--set {setting[0]}: "
        elif path is not None:
            where = f"{path}:{line}: " if line else f"{path}: "
        else:
            where = ""
        if inside:
            where = f"{where.rstrip(': ')} (with --set {', --set '.join(inside)}): "
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; `llmflow params show` lists every field)"
        problems.append(f"{where}{field}: {message}")
    if len(problems) == 1:
        return f"invalid params: {problems[0]}"
    return "invalid params:\n  " + "\n  ".join(problems)


def _nearest_line(loc: tuple[str, ...], lines: dict[tuple[str, ...], int]) -> int | None:
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None


def params_hash(params: PipelineParams) -> str:
    """sha256 of the canonical JSON of the params: equal params, equal hash."""
    return canonical_hash(params.model_dump(mode="json"))


def canonical_hash(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def to_yaml(params: PipelineParams) -> str:
    return yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False)


def flatten(params: PipelineParams) -> dict[str, str]:
    """`section.field` -> string value, the form MLflow params take."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, child in value.items():
                walk(f"{prefix}.{key}" if prefix else key, child)
        else:
            flat[prefix] = json.dumps(value) if isinstance(value, (list, type(None))) else str(value)

    walk("", params.model_dump(mode="json"))
    return flat
