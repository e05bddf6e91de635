"""What loading a model gives: the module, its tokenizer and (for a streamed target) its offloading."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class LoadedModel:
    """A model ready to run: eval mode, on its device, no gradients."""

    name: str
    path: Path
    model: Any  # transformers.PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    offload: Any = None  # offloading (offspec.offload.OffloadHandle): placement and layer streamer of a target
