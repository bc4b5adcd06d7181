"""Reading a BERT checkpoint as people have it on disk, whatever wrote it.

- A Hugging Face folder: ``model.safetensors`` or ``pytorch_model.bin``, or either one
  sharded (``model.safetensors.index.json`` / ``pytorch_model.bin.index.json`` and the
  files their ``weight_map`` names), with ``config.json`` beside.
- NVIDIA DeepLearningExamples: a ``.pt`` file holding ``{"model": state_dict, ...}`` (their
  ``ckpt_<step>.pt``, this package's ``bert_nvidia.pt``), with ``bert_config.json`` beside.
- This trainer's checkpoints: ``ckpt_<step>.pt``, or a folder whose ``phase<N>/`` holds them.
- Any single ``.safetensors``, ``.bin`` or ``.pt`` file holding a state dict.

Torch files are read with ``weights_only=True``: tensors, numbers, strings and containers.
DeepLearningExamples' checkpoints of 2020-2022 also hold a pickled data loader (of classes
from their ``run_pretraining.py``); unpickling it would run code the file names, so such a
file is refused in one line naming what it holds, unless ``trust`` (``--trust_checkpoint``)
is given: then it is unpickled, and classes that cannot be imported here become inert
placeholders (the weights are all that is used).
"""

from __future__ import annotations

import io
import json
import pickle
import pickletools
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bert_trainer import checkpoint
from bert_trainer.checkpoint import CheckpointError

MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model.bin.index.json", "bert_nvidia.pt")
CONFIG_FILES = ("config.json", "bert_config.json")
# Globals of torch's own tensor serialization: anything else is a pickled Python object.
_TENSOR_MODULES = {"torch", "torch._utils", "torch._tensor", "collections", "builtins",
                   "_codecs"}


@dataclass
class Source:
    """A checkpoint as read: its tensors, the object around them and the configs beside."""

    path: Path  # what the user named
    files: list[Path]  # the weight files read
    tensors: dict[str, torch.Tensor]
    payload: dict[str, Any] = field(default_factory=dict)  # the torch file's other entries
    configs: list[tuple[Path, dict[str, Any]]] = field(default_factory=list)

    @property
    def is_trainer_checkpoint(self) -> bool:
        return self.payload.get("format") == checkpoint.FORMAT and "config" in self.payload


def read(path: Path, what: str, trust: bool = False, phases: tuple[int, ...] = (1,)
         ) -> Source:
    """The checkpoint at ``path`` (a file or folder; a trainer folder's latest checkpoint of
    the first of ``phases`` that has one).  ``what`` starts every error message."""
    file = _model_file(path, what, phases)
    if file.name.endswith(".index.json"):
        tensors, files = _sharded(file, what, trust), [file]
        payload: dict[str, Any] = {}
    else:
        payload, files = _load(file, what, trust), [file]
        tensors = payload.pop("model") if isinstance(payload.get("model"), dict) else payload
        if tensors is payload:
            payload = {}
    bad = next((k for k, v in tensors.items() if not isinstance(v, torch.Tensor)), None)
    if bad is not None or not tensors:
        raise CheckpointError(f"{what}: {file} holds no state dict of tensors"
                              + (f" ({bad} is a {type(tensors[bad]).__name__})" if bad else ""))
    configs = []
    for name in CONFIG_FILES:
        beside = file.parent / name
        if beside.is_file():
            try:
                values = json.loads(beside.read_text())
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{what}: {beside}: not a readable JSON file "
                                      f"({exc})") from None
            if isinstance(values, dict):
                configs.append((beside, values))
    return Source(path, files, tensors, payload, configs)


def _model_file(path: Path, what: str, phases: tuple[int, ...]) -> Path:
    if path.is_file():
        return path
    for name in MODEL_FILES:
        if (path / name).is_file():
            return path / name
    for folder in [checkpoint.phase_dir(path, phase) for phase in phases] + [path]:
        found = checkpoint.latest(folder)
        if found:
            return found
    where = " or ".join(f"phase{p}/" for p in phases)
    raise CheckpointError(f"{what}: no ckpt_<step>.pt there or in its {where} folder (run "
                          f"phase {phases[-1]} first), nor a model file "
                          f"({', '.join(MODEL_FILES)})")


def _sharded(index: Path, what: str, trust: bool) -> dict[str, torch.Tensor]:
    """The tensors of every shard a ``*.index.json`` names, each key from its own file."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        wanted = {str(key): index.parent / str(name) for key, name in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{what}: {index}: not a readable shard index ({exc})") from None
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(wanted.values())):
        if not shard.is_file():
            raise CheckpointError(f"{what}: {index} names {shard.name}, which is not there")
        loaded = _load(shard, what, trust)
        for key, file in wanted.items():
            if file == shard:
                if key not in loaded:
                    raise CheckpointError(f"{what}: {index} puts {key} in {shard.name}, "
                                          "which lacks it")
                tensors[key] = loaded[key]
    return tensors


def _load(file: Path, what: str, trust: bool) -> dict[str, Any]:
    """A safetensors or torch file's top-level object (a dict)."""
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(file)))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{what}: {file}: not a readable safetensors file "
                                  f"({exc})") from None
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        foreign = pickled_objects(file)
        if not foreign:
            raise CheckpointError(f"{what}: {file}: not a readable checkpoint "
                                  f"({str(exc).splitlines()[0]})") from None
        if not trust:
            shown = ", ".join(foreign[:3]) + (" …" if len(foreign) > 3 else "")
            raise CheckpointError(
                f"{what}: {file} holds pickled Python objects besides the weights ({shown}); "
                "unpickling runs code the file names: if you trust the file, pass "
                "--trust_checkpoint") from None
        loaded = _load_trusted(file, what)
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{what}: {file}: not a readable checkpoint "
                              f"({str(exc).splitlines()[0] if str(exc) else exc})") from None
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{what}: {file} holds a {type(loaded).__name__}, not a state "
                              "dict or a checkpoint with one")
    return loaded


def pickled_objects(file: Path) -> list[str]:
    """``module.name`` of every class or function a torch file's pickle names, apart from
    torch's tensor machinery (read from the opcodes: nothing is unpickled)."""
    try:
        with zipfile.ZipFile(file) as archive:
            data = next(archive.read(n) for n in archive.namelist() if n.endswith("/data.pkl"))
    except (zipfile.BadZipFile, StopIteration, OSError):
        try:
            data = file.read_bytes()  # torch's legacy format: several pickles in a row
        except OSError:
            return []
    names: list[str] = []
    strings: list[str] = []
    stream = io.BytesIO(data)
    while True:
        try:
            for opcode, arg, _ in pickletools.genops(stream):
                if opcode.name == "GLOBAL":
                    names.append(".".join(str(arg).split(" ", 1)))
                elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                    names.append(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(arg, str):
                    strings.append(arg)
        except Exception:  # past the pickles: raw tensor bytes
            break
        if stream.tell() >= len(data):
            break
    return sorted({n for n in names if n.rsplit(".", 1)[0] not in _TENSOR_MODULES})


class Unimportable:
    """What a pickled object of a class that cannot be imported here becomes (trusted files
    only): it keeps its arguments and state and does nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: object) -> None:
        self.state = state


class _LenientUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (Unimportable,), {"__module__": module})


class _LenientPickle:
    """A ``pickle_module`` for ``torch.load``: pickle's, with the lenient unpickler."""

    Unpickler = _LenientUnpickler
    load = staticmethod(pickle.load)


def _load_trusted(file: Path, what: str) -> Any:
    try:
        with warnings.catch_warnings():  # the objects' own complaints (a data loader's workers)
            warnings.simplefilter("ignore")
            return torch.load(file, map_location="cpu", weights_only=False,
                              pickle_module=_LenientPickle)
    except Exception as exc:  # whatever the file's own code raises
        raise CheckpointError(f"{what}: {file}: unpickling it failed "
                              f"({type(exc).__name__}: {exc})") from None
