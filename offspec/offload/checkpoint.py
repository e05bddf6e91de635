"""Reading a model's original safetensors checkpoint a few tensors at a time (never all of it at once)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import OffspecError


class Checkpoint:
    """Key -> file of a Hugging Face safetensors checkpoint; reads open the file only for what they need."""

    def __init__(self, directory: Path, name: str):
        from safetensors import safe_open

        from ..loading import validate_weights

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
