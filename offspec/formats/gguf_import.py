"""Importing a GGUF file as offspec's weight store, every weight in its own ggml blocks (no re-quantization).

`plan_import` reads the GGUF's metadata (transformers gives the config and the GGUF -> transformers name map)
and decides, per tensor:
- the weights of linear layers and of the token table keep their blocks: a (rows, row_bytes) uint8 tensor, the
  file's bytes (for llama-family q/k projections the rows are reordered as transformers does: a row is a
  whole number of blocks, so the reorder is exact);
- norms, biases and other small tensors become float32 (exact: they are F32/F16 in GGUF files), after the
  architecture's own fix-ups (transformers' tensor processors, e.g. Gemma's norm offset);
- a weight of a type offspec cannot compute with (ggml.KERNEL_TYPES: every type of the GGUF files people run is
  there, IQ and TQ types included) is refused in one line naming the type (`OffspecError`); nothing is ever
  expanded to float32.
A mixture of experts (qwen3moe, qwen2moe, gpt-oss, Mixtral: a llama file with experts) keeps its blocks too: each
stacked `ffn_{gate,up,down}_exps` tensor becomes one tensor per expert (the store lays a layer's experts out expert
by expert: models/convert.py, formats/experts.expert_groups), the router its F32 rows; gpt-oss's stacked expert
biases become one float tensor per expert, stored with the layer's dense part.
Architectures whose GGUF tensors need more than a row reorder (fused or transposed layouts) are not
importable (`ImportUnsupported`); the caller then falls back to a float conversion. A tensor of the file that the
model has no place for is an error, never dropped (the float fallback checks the same:
`check_every_tensor_used`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch import nn

from offspec.errors import OffspecError

from .ggml import KERNEL_TYPES, has_kernel


class ImportUnsupported(Exception):
    """This GGUF cannot be imported block for block (the message says why)."""


# transformers' tensor processors whose changes are a row reorder of q/k (llama) or touch float norms only (qwen2moe
# and qwen3moe's also merge the stacked experts, which this import splits per expert itself, and give the shared
# expert's gate a leading dimension, which its rows have)
_ROW_SAFE_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor", "NemotronTensorProcessor",
                        "Qwen2MoeTensorProcessor")
# a GGUF's stacked experts: ggml's (cols, rows, experts)
_STACKED = re.compile(r"^blk\.(?P<bid>\d+)\.ffn_(?P<w>gate|up|down)_exps\.weight$")
# gpt-oss's stacked expert biases: ggml's (rows, experts)
_STACKED_BIAS = re.compile(r"^blk\.(?P<bid>\d+)\.ffn_(?P<w>gate|up|down)_exps\.bias$")


@dataclass
class TensorPlan:
    """One stored tensor: where it comes from and how it is stored."""

    name: str  # stored name, relative to its decoder layer for layer tensors ("self_attn.q_proj.qweight")
    source: Any  # the gguf ReaderTensor
    lowbit: bool  # True: ggml blocks (rows, row_bytes) uint8; False: a float32 tensor of `shape`
    ggml: int = -1  # stored ggml type id (lowbit)
    rows: int = 0
    cols: int = 0
    shape: tuple[int, ...] = ()  # float tensors
    permute: Optional[tuple[int, int]] = None  # (heads, kv heads): llama q/k row reorder
    expert: int = -1  # the expert of a stacked experts tensor this plan holds (its rows `rows` of each expert)

    def entry(self) -> tuple:
        """The packed-file layout entry of this tensor (offspec.store.packed.plan_layer)."""
        if self.lowbit:
            return (self.name, torch.uint8, (self.rows, KERNEL_TYPES[self.ggml].row_bytes(self.cols)), self.ggml,
                    self.cols)
        return (self.name, torch.float32, self.shape)


@dataclass
class ImportPlan:
    config: Any  # transformers PretrainedConfig
    architecture: str  # the GGUF's general.architecture
    layer_prefix: str  # "model.layers."
    layers: list[list[TensorPlan]]
    other: list[TensorPlan]  # final norm, LM head (and the token table when it is tied to the LM head)
    embed: list[TensorPlan]  # the token table (empty when tied)
    notes: list[str] = field(default_factory=list)
    types: dict[str, int] = field(default_factory=dict)  # stored weight bytes per ggml type name


def _skeleton(config: Any) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def _module_kind(model: nn.Module, hf_name: str) -> str:
    owner_name, _, attr = hf_name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if attr == "weight" and isinstance(owner, nn.Linear):
        return "linear"
    if attr == "weight" and isinstance(owner, nn.Embedding):
        return "embedding"
    if attr == "weight" and type(owner).__name__.endswith("TopKRouter"):
        return "router"  # kept in its blocks (F32 in llama.cpp's files), routed by formats/experts.QRouter
    return "float"


def _stored_name(hf_name: str, kind: str) -> str:
    return hf_name.rpartition(".")[0] + ".qweight" if kind in ("linear", "embedding", "router") else hf_name


def _expert_plans(t: Any, hf_name: str) -> list[TensorPlan]:
    """One plan per expert of the stacked GGUF tensor `t` (ggml's (cols, rows, experts)), named as
    formats/experts.py stores them ("mlp.experts.<e>.gate_proj.qweight", relative to the model)."""
    cols, rows, experts = (int(s) for s in t.shape)
    owner = hf_name.rpartition(".")[0]  # "model.layers.3.mlp.experts"
    proj = _STACKED.match(t.name)["w"] + "_proj"
    return [TensorPlan(f"{owner}.{e}.{proj}.qweight", t, lowbit=True, ggml=int(t.tensor_type), rows=rows, cols=cols,
                       expert=e) for e in range(experts)]


def _expert_bias_plans(t: Any, hf_name: str) -> list[TensorPlan]:
    """One float plan per expert of gpt-oss's stacked bias `t` (ggml's (rows, experts)), named as QExperts store
    them ("mlp.experts.<e>.gate_proj.bias")."""
    rows, experts = (int(s) for s in t.shape)
    owner = hf_name.rpartition(".")[0]  # "model.layers.3.mlp.experts"
    proj = _STACKED_BIAS.match(t.name)["w"] + "_proj"
    return [TensorPlan(f"{owner}.{e}.{proj}.bias", t, lowbit=False, shape=(rows,), expert=e) for e in range(experts)]


def plan_import(gguf_path: Path, config: Any) -> ImportPlan:
    """Decide how each tensor of `gguf_path` is stored; `config` is transformers' config of the file."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    reader = gguf.GGUFReader(str(gguf_path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor_cls = hf_gguf.TENSOR_PROCESSORS.get(arch, hf_gguf.TensorProcessor)
    if processor_cls.__name__ not in _ROW_SAFE_PROCESSORS:
        raise ImportUnsupported(f"{arch} GGUF tensors need transformers' {processor_cls.__name__}")
    model = _skeleton(config)
    name_map = _weights_map(model, processor_cls, config)
    layers_list = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers_list, nn.ModuleList):
        raise ImportUnsupported(f"{config.model_type} has no decoder `layers` list")
    names = {id(m): n for n, m in model.named_modules()}
    prefix = names[id(layers_list)] + "."
    plan = ImportPlan(config, arch, prefix, [[] for _ in layers_list], [], [])
    expected = {k for k in model.state_dict()}
    found: set[str] = set()
    heads = (config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    _refuse_unused(gguf_path, reader, name_map, config)
    for t in reader.tensors:
        hf_name = name_map.get(t.name)
        if hf_name is None:
            continue  # rope factors (`_modelled_elsewhere`)
        found.add(hf_name)
        weights = _STACKED.match(t.name) is not None
        if weights or _STACKED_BIAS.match(t.name):
            experts = _expert_plans(t, hf_name) if weights else _expert_bias_plans(t, hf_name)
            if weights:
                _check_kernel(gguf_path, t)
            for tp in experts:
                if weights:
                    tname = KERNEL_TYPES[tp.ggml].name
                    plan.types[tname] = plan.types.get(tname, 0) + int(tp.rows * KERNEL_TYPES[tp.ggml].row_bytes(
                        tp.cols))
                index, _, tp.name = tp.name[len(prefix):].partition(".")
                plan.layers[int(index)].append(tp)
            continue
        kind = _module_kind(model, hf_name)
        stored = _stored_name(hf_name, kind)
        if kind == "float":
            tp = TensorPlan(stored, t, lowbit=False, shape=tuple(int(s) for s in reversed(list(t.shape))))
        else:
            cols, rows = int(t.shape[0]), int(np.prod([int(s) for s in t.shape[1:]]))
            type_id = _check_kernel(gguf_path, t)
            permute = None
            if processor_cls.__name__ == "LlamaTensorProcessor" and (".attn_q." in t.name or ".attn_k." in t.name):
                permute = (heads[0], heads[0] if ".attn_q." in t.name else heads[1])
            tp = TensorPlan(stored, t, lowbit=True, ggml=type_id, rows=rows, cols=cols, permute=permute)
            tname = KERNEL_TYPES[tp.ggml].name
            plan.types[tname] = plan.types.get(tname, 0) + int(tp.rows * KERNEL_TYPES[tp.ggml].row_bytes(cols))
        if hf_name.startswith(prefix):
            index, _, rest = hf_name[len(prefix):].partition(".")
            tp.name = _stored_name(rest, kind)
            plan.layers[int(index)].append(tp)
        elif kind == "embedding" and not config.tie_word_embeddings:
            plan.embed.append(tp)
        else:
            plan.other.append(tp)
    missing = expected - found
    if config.tie_word_embeddings:
        missing = {k for k in missing if k != _output_name(model)}
    if missing:
        raise ImportUnsupported(f"the GGUF has no tensor for {sorted(missing)[0]}")
    return plan


def _check_kernel(gguf_path: Path, t: Any) -> int:
    """The ggml type id of GGUF tensor `t`, refused in one line where offspec cannot compute with it."""
    type_id = int(t.tensor_type)
    if not has_kernel(type_id):
        raise OffspecError(f"{Path(gguf_path).name}: tensor {t.name} is {t.tensor_type.name}, a ggml type "
                           f"offspec cannot compute with; use a GGUF of another quantization (e.g. Q4_K_M, "
                           f"IQ4_XS, Q8_0)")
    return type_id


def _modelled_elsewhere(name: str) -> bool:
    """GGUF tensors with no weight of their own in transformers' model: llama 3's rope factors (the config's rope
    parameters reproduce them, gguf_config.py) and phi3's longrope factors (not applied; its load line says so)."""
    return name.endswith("rope_freqs.weight") or name.startswith("rope_factors_")


def _refuse_unused(gguf_path: Path, reader: Any, name_map: dict, config: Any) -> None:
    """One OffspecError for the first tensor of the file that transformers' model has no place for: it is never
    dropped, as a model without it computes something else (a Mixtral file read as llama had no experts)."""
    unused = [t.name for t in reader.tensors if t.name not in name_map and not _modelled_elsewhere(t.name)]
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise OffspecError(f"{Path(gguf_path).name}: its tensor {unused[0]}{more} has no place in transformers' "
                           f"{config.model_type} model, so offspec cannot run the file whole; use a GGUF that "
                           f"llama.cpp's convert_hf_to_gguf.py writes for a supported family")


def check_every_tensor_used(gguf_path: Path, config: Any) -> None:
    """The float fallback's check (transformers' own GGUF loader skips a tensor it has no name for)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    reader = gguf.GGUFReader(str(gguf_path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor_cls = hf_gguf.TENSOR_PROCESSORS.get(arch, hf_gguf.TensorProcessor)
    _refuse_unused(gguf_path, reader, _weights_map(_skeleton(config), processor_cls, config), config)


def _weights_map(model: nn.Module, processor_cls: Any, config: Any) -> dict:
    """transformers' GGUF tensor name -> its model's parameter name, for `model` (a skeleton of `config`)."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    processor = processor_cls(config=config.to_dict())
    # a GGUF transformers reads as Mistral or Mixtral is a llama file (gguf-py has no tensor table for either)
    model_type = "llama" if config.model_type in ("mistral", "mixtral") else None
    name_map = hf_gguf.get_gguf_hf_weights_map(model, processor, model_type=model_type)
    params = {n for n, _ in model.named_parameters()}
    for prefix in {n.rpartition(".experts.")[0] for n in params if ".experts." in n}:  # "model.layers.3.mlp"
        bid = prefix.rpartition(".mlp")[0].rpartition(".")[2]
        for w, hf in (("gate", "gate_up_proj"), ("up", "gate_up_proj"), ("down", "down_proj")):
            if f"{prefix}.experts.{hf}" in params:  # Mixtral's, which no processor maps
                name_map.setdefault(f"blk.{bid}.ffn_{w}_exps.weight", f"{prefix}.experts.{hf}")
            if f"{prefix}.experts.{hf}_bias" in params:  # gpt-oss's expert biases
                name_map.setdefault(f"blk.{bid}.ffn_{w}_exps.bias", f"{prefix}.experts.{hf}_bias")
    for name in params:  # gpt-oss's attention sinks: gguf-py's table names them without ".weight"
        if name.endswith(".self_attn.sinks"):
            bid = name.split(".")[-3]
            name_map.setdefault(f"blk.{bid}.attn_sinks.weight", name)
    return name_map


def _output_name(model: nn.Module) -> str:
    out = model.get_output_embeddings()
    return next(n for n, m in model.named_modules() if m is out) + ".weight"


def _processed_float(plan: TensorPlan, processor: Any) -> np.ndarray:
    import gguf

    values = gguf.dequantize(plan.source.data, plan.source.tensor_type)  # float32, exact for F32/F16/BF16
    if plan.expert >= 0:  # one expert's row of a stacked bias (experts, rows)
        values = values.reshape(-1, plan.shape[0])[plan.expert]
    result = processor.process(values, plan.source.name)
    return np.array(np.asarray(result.weights, dtype=np.float32).reshape(plan.shape), copy=True)  # writable


def _row_order(rows: int, heads: int, kv_heads: int) -> np.ndarray:
    """transformers' llama q/k un-permutation, as an order of rows."""
    if heads != kv_heads:
        heads = kv_heads
    idx = np.arange(rows).reshape(heads, rows // heads // 2, 2)
    return idx.swapaxes(2, 1).reshape(rows)


def tensor_data(plan: TensorPlan, processor: Any) -> torch.Tensor:
    """The stored tensor for `plan`: blocks as (rows, row_bytes) uint8 (a copy of the file's bytes), or float32."""
    if not plan.lowbit:
        return torch.from_numpy(_processed_float(plan, processor))
    raw = np.asarray(plan.source.data).view(np.uint8)
    raw = raw.reshape(-1, plan.rows, raw.shape[-1])[plan.expert] if plan.expert >= 0 else raw.reshape(plan.rows, -1)
    if plan.permute is not None:
        raw = raw[_row_order(plan.rows, *plan.permute)]
    return torch.from_numpy(np.array(raw, copy=True))  # owns its memory: the GGUF stays memory-mapped


def tensors_of(plans: list[TensorPlan], processor: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(stored name, tensor) pairs, one at a time (what packed.write_layer consumes)."""
    for p in plans:
        yield p.name, tensor_data(p, processor)


def processor_for(plan: ImportPlan) -> Any:
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    return hf_gguf.TENSOR_PROCESSORS.get(plan.architecture, hf_gguf.TensorProcessor)(config=plan.config.to_dict())
