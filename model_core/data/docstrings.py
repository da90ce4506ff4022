"""The `python_docstrings` corpus: module, class and function docstrings of the Python standard library
installed on this machine, extracted once and cached.

Extraction `ast`-parses every standard-library .py file, which costs far more than reading its result, so
the documents are kept in a zstd Parquet file named by `stdlib_fingerprint` (Python version, file list,
sizes and mtimes) under the cache directory, written durably, and later runs read it back. The extraction
is serial: "spawn" workers (never "fork" inside a threaded Prefect process) each pay an interpreter start,
fail when `__main__` is not importable, and would save little on a once-per-machine step (figures:
benchmarks/README.md, "Data prep").
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import logging
import os
import platform
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from model_core.storage import build_file

# Directories of the standard library that hold tests, fixtures or third-party packages, not its docs.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_DOCSTRING_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)

logger = logging.getLogger(__name__)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's own .py files in a fixed order, without tests and installed packages."""
    files = []
    for directory, subdirectories, names in os.walk(stdlib_dir()):
        subdirectories[:] = [name for name in subdirectories if name not in _SKIPPED_DIRS]
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    return sorted(files)


def stdlib_fingerprint() -> str:
    """Hash of the Python version and every standard-library file's path, size and mtime."""
    digest = hashlib.sha256(f"python {platform.python_version()}\n".encode())
    for path in stdlib_files():
        stat = path.stat()
        digest.update(f"{path}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def stdlib_docstrings(cache_dir: Path | None) -> list[str]:
    """Every docstring of the standard library, in file order then `ast.walk` order.

    Read from `cache_dir` when an extraction of this very standard library is there; otherwise
    extracted and (when `cache_dir` is given) stored there.
    """
    cache = cache_dir / f"python-docstrings-{stdlib_fingerprint()[:16]}.parquet" if cache_dir else None
    if cache is not None and cache.is_file():
        try:
            return pq.read_table(cache).column("text").to_pylist()
        except (OSError, pa.ArrowException, KeyError) as error:
            logger.warning("docstring cache %s is unreadable (%s); extracting again", cache, error)
    texts = [text for path in stdlib_files() for text in file_docstrings(path)]
    if cache is not None:
        table = pa.table({"text": pa.array(texts, pa.large_string())})
        build_file(cache, lambda path: pq.write_table(table, str(path), compression="zstd"))
    return texts


def file_docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of one source file, in ast.walk order."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return []  # a few stdlib files are deliberately invalid (lib2to3 fixtures, bad encodings)
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, _DOCSTRING_NODES):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                texts.append(inspect.cleandoc(docstring))
    return texts
