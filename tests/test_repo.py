"""Promises about the repository itself: CI runs the README's test command, layers import one way, one module
writes durably, and docstrings quote no measurements."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_IN_MODEL_CORE = ("prefect", "mlflow", "tasks", "flows")


def _readme_command(heading: str) -> str:
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"{re.escape(heading)}.*?```(?:bash|sh)?\n(.+?)\n```", readme, flags=re.S)
    assert match, f"README.md has no code block after {heading!r}"
    return match.group(1).strip()


def test_ci_runs_exactly_the_readme_test_command():
    command = _readme_command("Run the tests")
    ci_lines = [line.strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines


def test_readme_run_command_installs_and_runs_the_pipeline():
    command = _readme_command("Install and run the default pipeline")
    assert "pip install" in command and "llmflow run" in command


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "model_core").rglob("*.py")), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_model_core_never_imports_orchestration_or_tracking(path):
    assert not _imported_roots(path) & set(FORBIDDEN_IN_MODEL_CORE)


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "tasks").rglob("*.py")), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_tasks_never_import_flows(path):
    assert "flows" not in _imported_roots(path)


# model_core's packages, lowest first: each imports only those below it (STYLE.md, "one direction").
MODEL_CORE_LAYERS = ("storage", "tables", "data", "model", "optim", "parallel", "train", "convert", "eval")


def _model_core_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found |= {name.split(".")[1] for name in names if name.startswith("model_core.")}
    return found & set(MODEL_CORE_LAYERS)


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "model_core").rglob("*.py")), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_model_core_packages_import_one_way(path):
    relative = path.relative_to(REPO_ROOT / "model_core")
    package = relative.parts[0].removesuffix(".py") if len(relative.parts) > 1 or relative.stem in ("storage", "tables") else None
    if package is None:  # model_core/__init__.py exposes load_model from the top
        return
    below = set(MODEL_CORE_LAYERS[: MODEL_CORE_LAYERS.index(package)])
    assert _model_core_imports(path) <= below | {package}, f"{relative} imports a package above {package}"


def test_the_cli_and_data_prep_load_no_mindspore():
    """Prep's worker processes are spawned from the CLI's module and import the data tasks: MindSpore loaded
    there costs each of them about 0.5 GB (the process tree's peak doubled once when the CLI imported it)."""
    code = "import sys, flows.cli, tasks.data, model_core.data.prepare; sys.exit(int('mindspore' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


def test_data_prep_workers_load_no_mlflow():
    """A prep worker imports the CLI's module and, unpickling its first task run's context, the data tasks:
    MLflow loaded there took each worker ~1 s before its first job (only the flow process talks to MLflow)."""
    code = "import sys, flows.cli, tasks.data; sys.exit(int('mlflow' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


# Renames that are not a durable write of something a later run reads: (file, function) -> why.
NOT_DURABLE_WRITES = {
    ("model_core/parallel/launch.py", "_set_aside_earlier_logs"): "keeps an earlier job's logs beside the new ones",
}
PACKAGES = ("model_core", "tasks", "flows", "params", "deployments")


def _renames_and_fsyncs(path: Path) -> list[tuple[str, int, str]]:
    """(function, line, call) of each rename (os.replace/rename, shutil.move, Path.replace/rename: one
    argument, so str.replace is not one) and each os.fsync in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = {}
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in [tree, *functions]:
        for node in ast.walk(scope):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            call = f"{owner}.{node.func.attr}"
            path_method = node.func.attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords
            if call in ("os.replace", "os.rename", "os.fsync", "shutil.move") or path_method:
                name = getattr(scope, "name", "<module>")
                found[node.lineno, node.col_offset] = (name, node.lineno, ast.unparse(node))
    return list(found.values())  # named after the innermost function: it is walked after those around it


def test_storage_is_the_only_durable_write():
    """Temp, fsync, rename and fsync the parent live in model_core/storage.py; elsewhere a copy of them
    drifts (one left its temporary behind on error, one skipped the fsync)."""
    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            relative = str(path.relative_to(REPO_ROOT))
            if relative == "model_core/storage.py":
                continue
            offenders += [
                f"{relative}:{line} {call}"
                for function, line, call in _renames_and_fsyncs(path)
                if (relative, function) not in NOT_DURABLE_WRITES
            ]
    use = "write through model_core.storage (write_file, build_file, build_directory):"
    assert not offenders, "\n".join([use, *offenders])


# A figure with a unit of time or rate, a ratio against something else, or a quantity said to be measured.
_NUMBER = r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?(?:\s*(?:-|–|to)\s*\d[\d,]*(?:\.\d+)?)?"
_TIMING = re.compile(
    rf"{_NUMBER}\s*(?:ms|µs|us|ns|s|secs?|seconds?|mins?|minutes?|h|hours?|CPU[- ]s(?:econds?)?|tokens/s|[KMGT]i?B/s"
    rf"|[GT]FLOP/s|it/s)(?![\w/])"
)
_SETTING = re.compile(
    r"default|time ?out|interval|limit|at most|at least|within|every|wait|sleep|poll|grace|deadline", re.I
)
_RATIO = re.compile(
    rf"{_NUMBER}\s*(?:x|×|times|%)\s+(?:faster|slower|more|less|longer|shorter|fewer|larger|smaller"
    rf"|as (?:fast|slow|long|much|many))\b",
    re.I,
)
_MEASURED = re.compile(
    rf"\b(?:measured|took|profiled)\b[^.;]*?{_NUMBER}\s*(?:[mµun]?s|CPU[- ]s(?:econds?)?|[KMGT]i?B|%|x)(?![\w/])", re.I
)


def _quoted_measurements(docstring: str) -> list[str]:
    """The measurements a docstring quotes. A timing that describes a setting (a default, a timeout, an
    interval) is not one: it does not go stale when the code gets faster."""
    found = []
    for clause in re.split(r"(?<=[.;])\s+|\n\s*\n|\)", docstring):
        clause = " ".join(clause.split())
        found += [
            match.group(0)
            for match in _TIMING.finditer(clause)
            if not _SETTING.search(clause[max(0, match.start() - 40) : match.end() + 30])
        ]
        found += [match.group(0) for match in (*_RATIO.finditer(clause), *_MEASURED.finditer(clause))]
    return found


def test_quoted_measurements_are_recognised():
    for quoting, figure in (
        ("Runs ~7x faster than the BroadcastTo kernel.", "~7x faster"),
        ("(measured: requests took 6 ms at p90)", "6 ms"),
        ("(measured: a 13 MB child of a 320 MB parent reports 320 MB)", "13 MB"),
        ("By default a thread busy-waits: a step took 7.9-9.7 CPU-seconds with it", "7.9-9.7 CPU-seconds"),
        ("made 80% more documents candidates", "80% more"),
        ("measured 128 MB for one 32 MB product", "128 MB"),
    ):
        assert any(figure in quoted for quoted in _quoted_measurements(quoting)), quoting
    for setting in (
        "the switch interval (5 ms by default)",
        "MindSpore's default of 30 s, plus the stop that follows",
        "x [B, T, 512] -> [B, T, 1376], 16 bytes per element",
        "warmup over the first 10% of them",
        "sha256 over the files' names and sha256s",
        "or 20 times the last poll's time",
    ):
        assert _quoted_measurements(setting) == [], setting


def test_model_core_docstrings_quote_no_measurements():
    """A docstring says why; the figures behind it go stale, so they live in benchmarks/README.md."""
    quoted = []
    for path in sorted((REPO_ROOT / "model_core").rglob("*.py")):
        relative = str(path.relative_to(REPO_ROOT))
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=relative)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                figures = _quoted_measurements(ast.get_docstring(node) or "")
                quoted += [f"{relative} {getattr(node, 'name', '')}: {figure!r}" for figure in figures]
    assert not quoted, "move these figures to benchmarks/README.md:\n" + "\n".join(quoted)
