"""Loading a model whose decoder layers are placed under memory budgets (offspec.load's offloading path).

1. a weightless skeleton (transformers model on the meta device; quantized layers get `QuantLinear`s);
2. sizes from it and the config -> a `Placement` (reported as a "placement" progress event);
3. when anything streams or is quantized: the packed per-layer set (built once, "pack"/"quantize" events),
   the resident parts from the original checkpoint, resident layers bound to device buffers, RAM-tier layers
   read into (pinned) host buffers, and a `LayerStreamer` with forward hooks for the streamed ones.
Nothing here puts the whole model in memory at any point.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..errors import OffspecError
from ..paths import cache_dir
from ..progress import ProgressEvent, ProgressFn, no_progress
from .binding import LayerBinding, attach_streaming, skinny_cpu_linears
from .checkpoint import Checkpoint
from .config import WORKSPACE, OffloadConfig
from .diskio import FileReader, aligned_empty
from .estimates import draft_headroom, target_headroom
from .packed import HEADER, PackedSet, ensure_store, mark_corrupt, payload_crc, plan_layer
from .placement import ModelSizes, Placement, forced, plan_placement
from .quant import BLOCKSIZE, quantize_layer_linears, quantize_weight
from .streamer import LayerSource, LayerStreamer


@dataclass
class OffloadHandle:
    """What `load` keeps of the offloading set-up."""

    placement: Placement
    streamer: Optional[LayerStreamer] = None
    packed_dir: Optional[Path] = None

    def summary(self) -> dict:
        out = self.placement.summary()
        out["packed_dir"] = str(self.packed_dir) if self.packed_dir else None
        out["read_mode"] = self.streamer.reader.mode if self.streamer is not None else None
        return out


@dataclass
class Skeleton:
    model: Any  # transformers PreTrainedModel, parameters on the meta device
    layers: nn.ModuleList
    prefix: str  # checkpoint key prefix of the decoder layers, e.g. "model.layers."
    quant: str
    quantized: list[str]  # names (inside a layer) of the linears stored quantized
    plans: list  # LayerSpec per layer (payload layout, no checksums yet)


class _Corrupt(Exception):
    pass


def build_skeleton(path: Path, dtype: torch.dtype, attn_implementation: str, quant: str) -> Skeleton:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..convert import quiet_transformers

    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(str(path))
            with init_empty_weights():  # parameters on meta; buffers (rotary tables) real, on the CPU
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise OffspecError(f"cannot build model {path.name} for offloading: {reason}") from exc
    try:  # eos ids and friends, as from_pretrained would read them
        from transformers import GenerationConfig

        with quiet_transformers():
            model.generation_config = GenerationConfig.from_pretrained(str(path))
    except Exception:
        pass  # no generation_config.json: keep the one derived from the config
    model.eval()
    model.requires_grad_(False)
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise OffspecError(f"cannot offload {path.name}: its decoder has no `layers` list (unsupported architecture)")
    names = {id(m): n for n, m in model.named_modules()}
    prefix = names[id(layers)] + "."
    quantized: list[str] = []
    if quant != "none":
        for layer in layers:
            quantized = quantize_layer_linears(layer, quant, dtype)
    plans = [plan_layer(i, [(n, t.dtype, tuple(t.shape)) for n, t in layer.state_dict(keep_vars=True).items()])
             for i, layer in enumerate(layers)]
    return Skeleton(model, layers, prefix, quant, quantized, plans)


def _other_keys(sk: Skeleton) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sk.model.state_dict(keep_vars=True).items() if not k.startswith(sk.prefix)}


def model_sizes(sk: Skeleton, dtype: torch.dtype, config: OffloadConfig, extra_bytes: int,
                device: torch.device) -> ModelSizes:
    elem = torch.empty((), dtype=dtype).element_size()
    seen, other = set(), 0
    for tensor in _other_keys(sk).values():
        if id(tensor) not in seen:  # tied weights count once
            seen.add(id(tensor))
            other += tensor.numel() * tensor.element_size()
    kv, act = target_headroom(sk.model.config, config.max_context, config.max_budget, elem)
    return ModelSizes(layer_bytes=tuple(p.nbytes for p in sk.plans), file_bytes=max(p.file_bytes for p in sk.plans),
                      other_bytes=other, kv_bytes=kv, activation_bytes=act, extra_bytes=extra_bytes,
                      workspace_bytes=WORKSPACE.get(device.type, WORKSPACE["cpu"]))


# --- the packed set ------------------------------------------------------------------------------
def packed_location(ck: Checkpoint, dtype: torch.dtype, quant: str, root: Optional[Path]) -> tuple[Path, dict]:
    key = {"model": ck.name, "source": ck.fingerprint(), "dtype": str(dtype).removeprefix("torch."), "quant": quant}
    if quant == "nf4":
        key["blocksize"] = BLOCKSIZE
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", ck.name)[:60]
    root = Path(root) if root else cache_dir() / "offload"
    return root / f"{slug}-{key['source'][:12]}-{key['dtype']}-{quant}", key


def _layer_tensors(sk: Skeleton, ck: Checkpoint, index: int, dtype: torch.dtype, qdevice: torch.device):
    """One layer's tensors in the packed format, read from the checkpoint one at a time (quantized when asked):
    yields (name, tensor) pairs so that packing never holds more than one source tensor."""
    quantized = set(sk.quantized)
    sources = []
    for t in sk.plans[index].tensors:
        owner, _, attr = t.name.rpartition(".")
        # quantized linears: qweight/absmax/code (nf4) or CB/SCB (int8) all come from the weight
        name = f"{owner}.weight" if owner in quantized and attr != "bias" else t.name
        if name not in sources:
            sources.append(name)
    for name in sources:
        t = ck.read(f"{sk.prefix}{index}.{name}")
        owner = name.rpartition(".")[0]
        if owner in quantized and name.endswith(".weight"):
            for k, v in quantize_weight(sk.quant, t.to(qdevice, torch.float32)).items():
                yield f"{owner}.{k}", v.to("cpu")
        else:
            yield name, (t.to(dtype) if t.is_floating_point() else t)
        del t


def ensure_packed(sk: Skeleton, ck: Checkpoint, dtype: torch.dtype, config: OffloadConfig, device: torch.device,
                  progress: ProgressFn, rebuild: bool = False) -> PackedSet:
    directory, key = packed_location(ck, dtype, sk.quant, config.offload_dir)
    if rebuild:
        mark_corrupt(directory)
    qdevice = device if device.type == "cuda" else torch.device("cpu")
    step = "pack" if sk.quant == "none" else "quantize"
    verb = "packing" if sk.quant == "none" else f"quantizing ({sk.quant})"
    return ensure_store(directory, key, sk.plans, lambda i: _layer_tensors(sk, ck, i, dtype, qdevice), progress,
                        step, f"{verb} the layers of {ck.name}")


# --- materializing -------------------------------------------------------------------------------
def _load_resident_parts(sk: Skeleton, ck: Checkpoint, device: torch.device, dtype: torch.dtype) -> None:
    """Embeddings, final norm, LM head (and any other non-layer tensor) from the checkpoint onto the device."""
    model = sk.model
    tie = getattr(model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config,
                  "tie_word_embeddings", False)
    out_emb = model.get_output_embeddings()
    keys = sorted(_other_keys(sk), key=lambda k: k not in ck)  # tied tensors (absent from the file) last
    for key in keys:  # one tensor at a time
        owner_name, _, attr = key.rpartition(".")
        owner = model.get_submodule(owner_name)
        if key in ck:
            t = ck.read(key)
            t = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        elif tie and owner is out_emb and attr == "weight":
            t = model.get_input_embeddings().weight  # tied LM head: the same tensor
        else:
            raise OffspecError(f"cannot offload {ck.name}: its checkpoint has no tensor {key!r}")
        if attr in owner._parameters:
            owner._parameters[attr] = t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)
        else:
            owner._buffers[attr] = t
        del t
    for module in model.modules():  # non-persistent buffers (rotary tables) were built on the CPU
        for name, buf in list(module._buffers.items()):
            if buf is not None and not buf.is_meta and buf.device != device:
                module._buffers[name] = buf.to(device)


def _read_checked(reader: FileReader, packed: PackedSet, index: int, into: torch.Tensor) -> torch.Tensor:
    """Read layer `index`'s file into `into` ((file_bytes,) host); returns its payload view; _Corrupt on a bad crc."""
    spec = packed.layers[index]
    reader.read(packed.path(index), into, spec.file_bytes)
    payload = into[HEADER : HEADER + spec.nbytes]
    if payload_crc(payload) != spec.crc32:
        raise _Corrupt(f"{packed.path(index)}: checksum mismatch")
    return payload


def _materialize(sk: Skeleton, ck: Checkpoint, packed: PackedSet, placement: Placement, device: torch.device,
                 dtype: torch.dtype, config: OffloadConfig, progress: ProgressFn, name: str) -> Optional[LayerStreamer]:
    _load_resident_parts(sk, ck, device, dtype)
    reader = FileReader(config.direct_io)
    cuda = device.type == "cuda"
    # (file_bytes,) host buffer for the resident layers' reads; pageable: nothing stays pinned after loading (issue 12)
    staging = aligned_empty(max(s.file_bytes for s in packed.layers)) if cuda else None
    sources, bindings = [], []
    n = len(sk.layers)
    for i, (layer, tier) in enumerate(zip(sk.layers, placement.tiers)):
        progress(ProgressEvent("load", f"loading {name}", i, n))
        spec = packed.layers[i]
        binding = LayerBinding(layer, spec)
        if tier == "device":
            if cuda:
                payload = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)  # (nbytes,) resident layer
                payload.copy_(_read_checked(reader, packed, i, staging))  # blocking copy: staging is reused next
            else:
                payload = _read_checked(reader, packed, i, aligned_empty(spec.file_bytes))  # host memory is the device
            binding.bind(payload)
        elif tier == "ram":
            buf = aligned_empty(spec.file_bytes, pin=cuda, device=device)  # (file_bytes,) host copy, pinned on CUDA
            sources.append(LayerSource(i, spec, ram=_read_checked(reader, packed, i, buf)))
            bindings.append(binding)
        else:
            if not any(s.path for s in sources):
                reader.probe(packed.path(i))  # O_DIRECT, or buffered where the file system refuses it
            sources.append(LayerSource(i, spec, path=packed.path(i)))
            bindings.append(binding)
        if device.type == "cpu" and dtype == torch.float32:
            skinny_cpu_linears(layer)
    progress(ProgressEvent("load", f"loading {name}", n, n, finished=True))
    if not sources:
        return None

    def on_corrupt() -> str:
        mark_corrupt(packed.directory)
        return f"the set in {packed.directory} will be rebuilt on the next start"

    streamer = LayerStreamer(device, sources, ring_slots=config.ring_slots, staging_buffers=config.staging_buffers,
                             reader=reader, set_id=packed.set_id, verify=config.verify, on_corrupt=on_corrupt)
    for src, binding in zip(sources, bindings):
        attach_streaming(sk.layers[src.index], src.index, streamer, binding)
    return streamer


def load_offloaded(resolved: Any, *, device: torch.device, dtype: torch.dtype, attn_implementation: str,
                   config: OffloadConfig, progress: ProgressFn = no_progress, extra_bytes: int = 0,
                   already_allocated: int = 0, tiers: Optional[Union[str, tuple[str, ...]]] = None,
                   report: bool = True) -> tuple[Optional[Any], OffloadHandle]:
    """Place and (when needed) build `resolved`'s model under `config`'s budgets.

    Returns (model, handle); model is None when every layer fits and nothing is quantized (load it the usual
    way). `tiers` forces a placement (a tier per layer, or one tier for all: tests, benchmarks, a quantized draft);
    `extra_bytes` are other resident bytes (the draft).
    """
    device = torch.device(device)
    ck = Checkpoint(resolved.path, resolved.name)
    sk = build_skeleton(resolved.path, dtype, attn_implementation, config.quant)
    sizes = model_sizes(sk, dtype, config, extra_bytes, device)
    if isinstance(tiers, str):
        tiers = (tiers,) * len(sk.layers)
    placement = forced(sizes, device, tiers, config) if tiers is not None else \
        plan_placement(sizes, device, config, already_allocated)
    if report:
        progress(ProgressEvent("placement", placement.describe(), 1, 1, finished=True))
    if not placement.streams and config.quant == "none" and not config.pack_always:
        return None, OffloadHandle(placement)
    packed = ensure_packed(sk, ck, dtype, config, device, progress)
    try:
        streamer = _materialize(sk, ck, packed, placement, device, dtype, config, progress, resolved.name)
    except _Corrupt:  # a resident or RAM layer failed its checksum: rebuild the set once
        sk = build_skeleton(resolved.path, dtype, attn_implementation, config.quant)
        packed = ensure_packed(sk, ck, dtype, config, device, progress, rebuild=True)
        try:
            streamer = _materialize(sk, ck, packed, placement, device, dtype, config, progress, resolved.name)
        except _Corrupt as exc:
            raise OffspecError(f"packed layers of {resolved.name} are corrupt right after rebuilding ({exc}); "
                               f"check the disk, or use another --offload-dir") from None
    trim_heap()  # packing and loading freed many temporaries
    return sk.model, OffloadHandle(placement, streamer, packed.directory)


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc keeps mid-sized frees, e.g. packing's per-tensor buffers)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def _param_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen and not t.is_meta:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def load_offloaded_pair(target_res: Any, draft_res: Any, target_tok: Any, draft_tok: Any, *, device: torch.device,
                        dtype: torch.dtype, attn_implementation: str, config: OffloadConfig,
                        progress: ProgressFn = no_progress, load_model: Optional[Callable] = None):
    """offspec.loading.load_pair with offloading: the draft first (resident, quantized if asked), then the
    target placed under the budgets with the draft counted as resident. Returns (target, draft) LoadedModels."""
    from ..loading import LoadedModel
    from ..loading import load_model as plain_load

    load_model = load_model or plain_load
    device = torch.device(device)
    if config.draft_quant == "none":
        draft = load_model(draft_res, device=device, dtype=dtype, attn_implementation=attn_implementation,
                           progress=progress, tokenizer=draft_tok)
    else:
        model, _ = load_offloaded(draft_res, device=device, dtype=dtype, attn_implementation=attn_implementation,
                                  config=replace(config, quant=config.draft_quant), progress=progress,
                                  tiers="device", report=False)  # resident, quantized, from its packed set
        draft = LoadedModel(name=draft_res.name, path=draft_res.path, model=model, tokenizer=draft_tok)
    elem = torch.empty((), dtype=dtype).element_size()
    draft_bytes = _param_bytes(draft.model)
    extra = draft_bytes + draft_headroom(draft.model.config, config.max_context, config.max_budget, elem)
    model, handle = load_offloaded(target_res, device=device, dtype=dtype, attn_implementation=attn_implementation,
                                   config=config, progress=progress, extra_bytes=extra, already_allocated=draft_bytes)
    if model is None:
        target = load_model(target_res, device=device, dtype=dtype, attn_implementation=attn_implementation,
                            progress=progress, tokenizer=target_tok)
    else:
        target = LoadedModel(name=target_res.name, path=target_res.path, model=model, tokenizer=target_tok)
    target.offload = handle
    return target, draft
