"""Read `pytorch_model.bin` (a `torch.save` zip archive of tensors) without torch and without running
pickled code.

A pickle can call any importable function while it loads, so a downloaded .bin is code, not data.
This unpickler resolves only the handful of globals a state dict needs (tensor rebuilding, the typed
storages of float dtypes, OrderedDict) to local numpy stand-ins, and refuses every other global with an
error naming it. Tensor bytes come from the archive's `data/<key>` entries; each tensor is cut out of
its storage with its offset, size and stride, then widened to fp32 like the safetensors reader.
Legacy (pre-1.6, non-zip) torch files are refused: re-save them, or convert them to safetensors first.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_core.convert.errors import ConversionError
from model_core.storage import bf16_bits_to_float32

# torch storage class name -> (numpy dtype of its bytes, whether those bytes are bf16 bit patterns)
_STORAGES = {
    "FloatStorage": (np.dtype("<f4"), False),
    "HalfStorage": (np.dtype("<f2"), False),
    "BFloat16Storage": (np.dtype("<u2"), True),
    "DoubleStorage": (np.dtype("<f8"), False),
}


@dataclass(frozen=True)
class _StorageType:
    name: str


@dataclass(frozen=True)
class _Storage:
    values: np.ndarray  # fp32, one element per storage element


def _rebuild_tensor(storage: _Storage, offset: int, size: tuple, stride: tuple, *_ignored) -> np.ndarray:
    """torch._utils._rebuild_tensor_v2: a strided view of the storage, copied out."""
    last = offset + sum((extent - 1) * step for extent, step in zip(size, stride)) if all(size) else offset - 1
    if offset < 0 or last >= storage.values.size or any(step < 0 for step in stride):
        raise ConversionError(
            f"a tensor of size {tuple(size)} reaches outside its storage of {storage.values.size} elements"
        )
    itemsize = storage.values.itemsize
    view = np.lib.stride_tricks.as_strided(
        storage.values[offset:], shape=tuple(size), strides=tuple(step * itemsize for step in stride), writeable=False
    )
    return np.array(view)


def _rebuild_parameter(data: np.ndarray, *_ignored) -> np.ndarray:
    """torch._utils._rebuild_parameter: a Parameter is its data."""
    return data


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): OrderedDict,
    **{("torch", name): _StorageType(name) for name in _STORAGES},
}


class _StateDictUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, origin: Path):
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.origin = archive, prefix, origin
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str):
        allowed = _ALLOWED.get((module, name))
        if allowed is None:
            raise ConversionError(
                f"{self.origin}: refusing to unpickle {module}.{name}; only tensors, their float storages and "
                "dicts are allowed (a pickle can run arbitrary code)"
            )
        return allowed

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise ConversionError(f"{self.origin}: unsupported persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if key not in self.storages:
            dtype, is_bf16 = _STORAGES[storage_type.name]
            raw = np.frombuffer(self.archive.read(f"{self.prefix}data/{key}"), dtype=dtype)
            if raw.size < numel:
                raise ConversionError(
                    f"{self.origin}: storage {key} holds {raw.size} elements, the pickle says {numel}"
                )
            self.storages[key] = _Storage(bf16_bits_to_float32(raw) if is_bf16 else raw.astype(np.float32))
        return self.storages[key]


def load_torch_state_dict(path: str | Path) -> dict[str, np.ndarray]:
    """{name: fp32 array} from a `torch.save`d state dict, executing nothing from the file."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise ConversionError(
            f"{path} is not a zip-format torch file (saved by torch < 1.6, or not a torch file); "
            "re-save it with a recent torch or convert it to safetensors"
        )
    with zipfile.ZipFile(path) as archive:
        pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise ConversionError(f"{path}: expected one data.pkl in the archive, found {len(pickles)}")
        prefix = pickles[0].removesuffix("data.pkl")
        if f"{prefix}byteorder" in archive.namelist() and archive.read(f"{prefix}byteorder") != b"little":
            raise ConversionError(f"{path}: big-endian torch files are not supported")
        try:
            state = _StateDictUnpickler(archive.read(pickles[0]), archive, prefix, path).load()
        except ConversionError:
            raise
        except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as error:
            raise ConversionError(f"{path}: not a readable state dict ({error})") from error
    if not isinstance(state, dict) or not all(isinstance(value, np.ndarray) for value in state.values()):
        raise ConversionError(f"{path}: expected a flat dict of tensor names to tensors (a state dict)")
    return dict(state)
