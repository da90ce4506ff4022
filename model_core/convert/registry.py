"""Which state-dict adapters convert which `model_type` (the config.json key); llama and mixtral are built in.

A family is registered once under its model_type; registering a taken name is an error that names the
existing owner, so two plugins never silently replace each other. `isolated_registry()` gives tests a
scope whose registrations vanish on exit. The registry holds adapters only: where converted checkpoints
are cached is an argument of every conversion call, so runs never share hidden state through it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from model_core.convert import llama, mixtral
from model_core.convert.errors import ConversionError
from params.schema import ModelParams


class RegistryError(ValueError):
    """A registration that would replace or remove the wrong family; the message names the owner."""


@dataclass(frozen=True)
class ModelFamily:
    """The adapters of one model family (see model_core/convert/llama.py for their contracts)."""

    model_type: str
    params_from_config: Callable[..., ModelParams]
    from_hf: Callable[..., tuple[dict[str, np.ndarray], ModelParams]]
    to_hf: Callable[..., tuple[dict[str, np.ndarray], dict]]
    owner: str  # who registered it: a module or package name, shown when the name is taken


LLAMA = ModelFamily("llama", llama.params_from_config, llama.from_hf, llama.to_hf, owner=llama.__name__)
MIXTRAL = ModelFamily("mixtral", mixtral.params_from_config, mixtral.from_hf, mixtral.to_hf, owner=mixtral.__name__)

_families: dict[str, ModelFamily] = {family.model_type: family for family in (LLAMA, MIXTRAL)}
_lock = threading.Lock()


def register(family: ModelFamily) -> None:
    with _lock:
        existing = _families.get(family.model_type)
        if existing is not None:
            raise RegistryError(
                f"model_type {family.model_type!r} is already registered by {existing.owner}; "
                f"register {family.owner}'s family under another model_type"
            )
        _families[family.model_type] = family


def unregister(model_type: str) -> ModelFamily:
    with _lock:
        if model_type not in _families:
            raise RegistryError(f"model_type {model_type!r} is not registered (registered: {sorted(_families)})")
        return _families.pop(model_type)


def family_for(model_type: str | None) -> ModelFamily:
    """The family that converts checkpoints whose config.json has this model_type."""
    with _lock:
        family = _families.get(model_type) if model_type is not None else None
        if family is None:
            raise ConversionError(
                f"config.json model_type={model_type!r} has no registered adapter (registered: {sorted(_families)})"
            )
        return family


def registered() -> list[str]:
    with _lock:
        return sorted(_families)


@contextmanager
def isolated_registry() -> Iterator[None]:
    """Registrations and removals inside the block are undone on exit (process-wide, not per thread)."""
    with _lock:
        saved = dict(_families)
    try:
        yield
    finally:
        with _lock:
            _families.clear()
            _families.update(saved)
