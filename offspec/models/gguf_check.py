"""A GGUF file's architecture and tensor types, checked before anything is converted or written to the cache.

An architecture no code path runs, or a tensor of a type no code path reads, is one `error:` line naming it, said
before the conversion starts (which would otherwise fail minutes in, or, for a type, only where the tensor is
reached). Architectures: the families offspec runs (offspec.formats.gguf_config.FAMILIES; llama.cpp writes
Mistral as llama), and the others transformers reads from a GGUF (converted too, said on the load line as not
verified). Mixtures of experts: qwen3moe, qwen2moe, gpt-oss and Mixtral (llama.cpp writes it as llama with stacked
experts, which offspec reads as Mixtral) run; any other (deepseek2, glm4moe, ...) is refused whatever transformers
reads, and so is a llama file with experts but without the metadata llama.cpp needs to route them.
Types: those the kernels compute with, and those gguf can decode exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from offspec.errors import OffspecError
from offspec.formats.ggml import has_kernel
from offspec.formats.gguf_config import FAMILIES

from .convert import failure_reason

# the GGUF architecture names of offspec's families (transformers' model type "gemma3_text" is gguf's "gemma3";
# llama.cpp writes mistral and mixtral as llama)
_GGUF_ARCH = {"gemma3_text": "gemma3", "mistral": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe",
              "qwen2_moe": "qwen2moe", "gpt_oss": "gpt-oss"}
FAMILY_ARCHS = frozenset(_GGUF_ARCH.get(a, a) for a in FAMILIES)
MOE_ARCHS = ("qwen3moe", "qwen2moe", "gpt-oss", "llama")  # the mixtures offspec runs (llama: Mixtral)


def _readable(type_id: int) -> bool:
    """Can a weight of ggml type `type_id` be read: a kernel computes with it, or gguf decodes it exactly."""
    import gguf

    if has_kernel(type_id):
        return True
    qt = gguf.GGMLQuantizationType(type_id)
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    try:
        gguf.dequantize(np.zeros(nbytes, dtype=np.uint8), qt)  # one block of zeros
    except (NotImplementedError, KeyError, ValueError, TypeError):
        return False
    return True


def expert_count(reader, arch: str) -> int:
    """Experts a layer of a mixture-of-experts GGUF holds (its `<arch>.expert_count`, else the experts of its first
    `ffn_*_exps` tensor), 0 for a dense model."""
    field = reader.fields.get(f"{arch}.expert_count")
    if field is not None and int(field.contents()) > 0:  # a dense file may say 0
        return int(field.contents())
    stacked = next((t for t in reader.tensors if "_exps." in t.name or ".ffn_gate_inp." in t.name), None)
    if stacked is None:
        return 0
    return int(stacked.shape[-1])  # ggml's last dimension: (hidden, experts) for a router, (.., .., experts) stacked


def check_gguf(path: Path, role: str) -> str:
    """Return the GGUF architecture of `path`, or raise OffspecError (one line) where offspec cannot run it."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = gguf.GGUFReader(str(path))
    except ValueError as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if "GGMLQuantizationType" in text:  # a type id this gguf package does not know
            raise OffspecError(f"{role} model {path.name} holds tensors of a ggml type offspec cannot read ({text}); "
                               f"use a GGUF of a common type (Q4_K_M, Q5_K_M, Q8_0, ...)") from exc
        raise OffspecError(f"cannot read {role} model {path}: {failure_reason(exc)}") from exc
    except Exception as exc:
        raise OffspecError(f"cannot read {role} model {path}: {failure_reason(exc)}") from exc
    field = reader.fields.get("general.architecture")
    arch = str(field.contents()) if field is not None else ""
    experts = expert_count(reader, arch)
    if experts and arch not in MOE_ARCHS:
        raise OffspecError(f"{role} model {path.name} is a mixture of experts ({arch}, {experts} experts a layer), "
                           f"which offspec cannot run yet; it runs qwen3moe, qwen2moe, gpt-oss and Mixtral mixtures, "
                           f"and dense GGUFs (e.g. Qwen2.5, Llama 3, Gemma 3)")
    missing = [k for k in ("expert_count", "expert_used_count") if experts and f"{arch}.{k}" not in reader.fields]
    if missing:
        kind = "a llama file with experts (Mixtral, as llama.cpp writes it)" if arch == "llama" else arch
        raise OffspecError(f"{role} model {path.name} is a mixture of experts ({kind}, {experts} experts a layer) "
                           f"without its {arch}.{missing[0]} metadata, which routing needs; convert it again with "
                           f"llama.cpp's convert_hf_to_gguf.py")
    if arch not in FAMILY_ARCHS and arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise OffspecError(f"{role} model {path.name} has the architecture {arch or '(none)'!r}, which offspec cannot "
                           f"run; it runs {', '.join(sorted(FAMILY_ARCHS | {'mistral'}))} GGUFs")
    seen: set[int] = set()
    for tensor in reader.tensors:
        type_id = int(tensor.tensor_type)
        if type_id in seen:
            continue
        seen.add(type_id)
        if not _readable(type_id):
            raise OffspecError(f"{role} model {path.name} holds {tensor.name} as {tensor.tensor_type.name}, a ggml "
                               f"type no offspec code path can read; use a GGUF of a common type (Q4_K_M, Q5_K_M, "
                               f"Q8_0, ...)")
    return arch
