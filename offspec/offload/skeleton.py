"""A weightless transformers model whose modules match how the weights are stored, and the layout of that storage.

Three sources:
- a converted GGUF's weight store (`from_store`): every linear layer and the token table become `QLinear` /
  `QEmbedding` of the ggml type the store holds (offspec/formats); the layouts are the store's own;
- a float checkpoint with `--quant int4|int8` (`from_checkpoint`): the same modules, quantized once into a new
  store (ggml Q4_1 / Q8_0 blocks; LM head and token table Q8_0);
- a float checkpoint with `--quant none|nf4`: float layers (nf4: bitsandbytes `QuantLinear`s, CUDA only), the
  embeddings and LM head loaded from the checkpoint as they are.
Parameters are on the meta device until the loader binds them to payload views.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from offspec.errors import OffspecError
from offspec.formats.experts import EXPERT_NAME, replace_moe
from offspec.formats.modules import QEmbedding, QLinear, replace_embedding, replace_linear
from offspec.formats.quantize import weight_type
from offspec.store.packed import LayerSpec, PackedSet, plan_extra, plan_layer
from offspec.util.hf import quiet_transformers

from .quant import quantize_layer_linears

META = torch.device("meta")


@dataclass
class Skeleton:
    model: Any  # transformers PreTrainedModel, parameters on the meta device
    layers: nn.ModuleList
    prefix: str  # checkpoint key prefix of the decoder layers, e.g. "model.layers."
    quant: str  # "none", "nf4", "int4", "int8", or "ggml" (a converted GGUF)
    quantized: list[str]  # names (inside a layer) of the linears stored quantized
    plans: list  # LayerSpec per layer (payload layout, no checksums yet)
    extras: dict[str, LayerSpec] = field(default_factory=dict)  # "other"/"embed" of a complete store
    tied: bool = False  # the LM head reads the token table

    @property
    def complete_store(self) -> bool:
        """True when every weight (embeddings and LM head included) lives in the packed store."""
        return bool(self.extras)


def _empty_model(path: Path, dtype: torch.dtype, attn_implementation: str) -> Any:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig


    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(str(path))
            with init_empty_weights():  # parameters on meta; buffers (rotary tables) real, on the CPU
                try:
                    model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                             attn_implementation=attn_implementation)
                except ValueError as exc:  # gemma2 has no SDPA (it soft-caps its logits): the runner's attention
                    if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(exc):
                        raise  # (offspec.formats.attention) replaces it either way
                    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise OffspecError(f"cannot build model {path.name} for offloading: {reason}") from exc
    try:  # eos ids and friends, as from_pretrained would read them
        with quiet_transformers():
            model.generation_config = GenerationConfig.from_pretrained(str(path))
    except Exception:
        pass  # no generation_config.json: keep the one derived from the config
    model.eval()
    model.requires_grad_(False)
    return model


def _layers(model: Any, name: str) -> tuple[nn.ModuleList, str]:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise OffspecError(f"cannot offload {name}: its decoder has no `layers` list (unsupported architecture)")
    names = {id(m): n for n, m in model.named_modules()}
    return layers, names[id(layers)] + "."


def _entries(module: nn.Module, prefix: str = "") -> list[tuple]:
    """Layout entries (packed.plan_layer) of a module's tensors; low-bit weights carry their type and columns."""
    out = []
    for name, t in module.state_dict(keep_vars=True).items():
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        if isinstance(owner, (QLinear, QEmbedding)) and name.endswith(".qweight"):
            cols = owner.in_features if isinstance(owner, QLinear) else owner.embedding_dim
            out.append((prefix + name, torch.uint8, tuple(t.shape), owner.type_id, cols))
        else:
            out.append((prefix + name, t.dtype, tuple(t.shape)))
    return out


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def from_store(path: Path, packed: PackedSet, dtype: torch.dtype, attn_implementation: str,
               device: torch.device) -> Skeleton:
    """The skeleton of a converted GGUF whose weight store is `packed`."""
    model = _empty_model(path, dtype, attn_implementation)
    layers, prefix = _layers(model, path.name)
    if len(packed.layers) != len(layers):
        raise OffspecError(f"the weight store of {path.name} has {len(packed.layers)} layers, its config "
                           f"{len(layers)}; delete {path} and start again to rebuild it")
    quantized: list[str] = []
    for layer, spec in zip(layers, packed.layers):
        quantized = []
        moe = _replace_moe(layer, model.config, spec)
        for t in spec.tensors:
            if t.ggml >= 0:
                if t.name not in moe:
                    replace_linear(layer, t.name.removesuffix(".qweight"), t.ggml, META)
                quantized.append(t.name.removesuffix(".qweight"))
    stored = {t.name: t for e in packed.extras.values() for t in e.tensors}
    emb_name = _module_name(model, model.get_input_embeddings())
    head_name = _module_name(model, model.get_output_embeddings())
    emb = stored.get(emb_name + ".qweight")
    if emb is None:
        raise OffspecError(f"the weight store of {path.name} has no token table; delete {path} and start again")
    replace_embedding(model, emb_name, emb.ggml, dtype, device)
    head = stored.get(head_name + ".qweight")
    tied = head is None
    replace_linear(model, head_name, (emb if tied else head).ggml, META)
    return Skeleton(model, layers, prefix, "ggml", quantized, list(packed.layers), dict(packed.extras), tied)


def _replace_moe(layer: nn.Module, config: Any, spec: LayerSpec) -> set[str]:
    """Give a mixture-of-experts layer its QExperts and QRouter of the stored types; returns the stored names they
    hold (empty for a dense layer)."""
    experts = {t.name: (t.ggml, t.shape[0], t.cols) for t in spec.tensors if EXPERT_NAME.match(t.name)}
    if not experts:
        return set()
    routers = {t.name: t.ggml for t in spec.tensors if t.name.endswith((".gate.qweight", ".router.qweight"))
               and type(layer.get_submodule(t.name.removesuffix(".qweight"))).__name__.endswith("TopKRouter")}
    if len(routers) != 1:
        raise OffspecError(f"a mixture-of-experts layer of the weight store has {len(routers)} stored routers; "
                           f"delete the model's cache entry and start again to rebuild it")
    biased = any(t.name.endswith(".experts.0.gate_proj.bias") for t in spec.tensors)  # gpt-oss
    replace_moe(layer, config, experts, META, next(iter(routers.values())), biased)
    return set(experts) | set(routers)


def from_checkpoint(path: Path, dtype: torch.dtype, attn_implementation: str, quant: str, device: torch.device,
                    checkpoint_keys: Optional[set[str]] = None) -> Skeleton:
    """The skeleton of a float checkpoint stored as `quant` ("none", "nf4", "int4" or "int8")."""
    model = _empty_model(path, dtype, attn_implementation)
    layers, prefix = _layers(model, path.name)
    quantized: list[str] = []
    extras: dict[str, LayerSpec] = {}
    tied = False
    if quant == "nf4":
        for layer in layers:
            quantized = quantize_layer_linears(layer, quant, dtype)
    elif quant in ("int4", "int8"):
        for layer in layers:
            quantized = []
            for name, module in list(layer.named_modules()):
                if isinstance(module, nn.Linear):
                    replace_linear(layer, name, weight_type(quant, module.in_features), META)
                    quantized.append(name)
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        emb_name, head_name = _module_name(model, emb), _module_name(model, head)
        tied = checkpoint_keys is not None and head_name + ".weight" not in checkpoint_keys
        replace_embedding(model, emb_name, weight_type(quant, emb.embedding_dim, head=True), dtype, device)
        replace_linear(model, head_name, weight_type(quant, head.in_features, head=True), META)
        other = [e for e in _entries(model) if not e[0].startswith(prefix)]
        table = [e for e in other if e[0] == emb_name + ".qweight"]
        other = [e for e in other if e[0] != emb_name + ".qweight" and not (tied and e[0] == head_name + ".qweight")]
        extras = {"other": plan_extra("other", other + (table if tied else []))}
        if not tied:
            extras["embed"] = plan_extra("embed", table)
    elif quant != "none":
        raise OffspecError(f"unknown quantization {quant!r}; use none, int4, int8 or nf4")
    plans = [plan_layer(i, _entries(layer)) for i, layer in enumerate(layers)]
    return Skeleton(model, layers, prefix, quant, quantized, plans, extras, tied)
