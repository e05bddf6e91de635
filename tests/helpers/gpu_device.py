"""The marks of the CUDA-only suites: the `cuda` marker, skipped with the reason shown where torch sees no CUDA
GPU (and, for the Triton kernels, where Triton is missing)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

NO_GPU = (f"needs a CUDA GPU: torch.cuda.is_available() is False here (torch {torch.__version__}); "
          "run `python -m pytest -m cuda` on a machine with one")
GPU = torch.device("cuda", 0) if torch.cuda.is_available() else None


def cuda_marks(triton: bool = False) -> list:
    """pytestmark for a CUDA-only module; `triton`: its tests also need Triton."""
    marks = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]
    if triton:
        marks.append(pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                        reason="needs Triton (pip install triton)"))
    return marks
