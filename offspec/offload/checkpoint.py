"""Reading a model's original safetensors checkpoint a few tensors at a time (never all of it at once)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from offspec.errors import OffspecError
from offspec.store.entry import MANIFEST


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _redo_hint(directory: Path) -> str:
    if (directory / MANIFEST).is_file():  # our own converted cache entry
        return f"delete {directory} and start again to rebuild it"
    return "delete it and download or convert the model again"


def validate_weights(directory: Path) -> list[Path]:
    """Check that the weight files of `directory` are present and their safetensors headers readable.

    Returns the safetensors files. Cheap: only headers are parsed (safetensors also checks that the
    file is long enough for every tensor the header declares, so truncation is caught).
    """
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise OffspecError(f"cannot read model weights index {index}: {_reason(exc)}; "
                               f"{_redo_hint(directory)}") from exc
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise OffspecError(f"model weights {', '.join(missing)} missing from {directory}; {_redo_hint(directory)}")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        if any(directory.glob("pytorch_model*.bin")):
            return []  # legacy pickle weights: transformers reads them, we cannot cheaply check them
        raise OffspecError(f"no model weights (*.safetensors) in {directory}; expected a Hugging Face model "
                           f"directory with config.json and *.safetensors")
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as exc:  # SafetensorError, OSError, ...
            raise OffspecError(f"cannot read model weights {file}: {_reason(exc)}; {_redo_hint(directory)}") from exc
    return files


class Checkpoint:
    """Key -> file of a Hugging Face safetensors checkpoint; reads open the file only for what they need."""

    def __init__(self, directory: Path, name: str):
        from safetensors import safe_open

        self.directory, self.name = Path(directory), name
        files = validate_weights(self.directory)
        if not files:
            raise OffspecError(f"offloading {name} needs safetensors weights, but {directory} has only "
                               f"pytorch_model*.bin files; convert them to safetensors first")
        self.files = files
        self.where: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    self.where[key] = file

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def read(self, key: str) -> torch.Tensor:
        """One CPU tensor. The file is opened (mmap) only for this read, so its pages are let go right after."""
        from safetensors import safe_open

        if key not in self.where:
            raise OffspecError(f"cannot offload {self.name}: its checkpoint has no tensor {key!r} "
                               f"(an unsupported checkpoint layout)")
        with safe_open(str(self.where[key]), framework="pt", device="cpu") as f:
            return f.get_tensor(key).clone()  # own the memory: the mmap closes with the file

    def fingerprint(self) -> str:
        """Changes when the weights or the config change (file names, sizes, modification times, config text)."""
        h = hashlib.sha256()
        for file in self.files:
            st = file.stat()
            h.update(json.dumps([file.name, st.st_size, st.st_mtime_ns]).encode())
        config = self.directory / "config.json"
        if config.is_file():
            h.update(config.read_bytes())
        return h.hexdigest()[:24]
