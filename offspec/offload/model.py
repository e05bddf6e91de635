"""Loading a model through the packed store, its decoder layers placed under memory budgets.

This is how offspec.load loads a converted GGUF (always: its weights stay in their ggml blocks), and a float
checkpoint that is quantized or does not fit.

1. a weightless skeleton whose modules match the stored format (skeleton.py);
2. sizes from it -> a `Placement` (reported as a "placement" progress event);
3. the packed store: a converted GGUF's own (layers, `other` and `embed` payloads), or one built once from the
   float checkpoint ("pack"/"quantize" events; with int4/int8 also the LM head and token table);
4. materializing (materialize.py): the resident parts (the `other` payload, or the checkpoint's non-layer
   tensors), the token table memory-mapped from `embed.bin` (only the rows a pass asks for are read), resident
   layers bound to buffers, RAM-tier layers read into (pinned) host buffers, and a `LayerStreamer` with forward
   hooks for the rest.
Nothing here puts a whole model in memory, or any weight in a float format it was not stored in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from offspec.errors import OffspecError
from offspec.formats import kernels
from offspec.formats.gpu.choice import WORKSPACE_BYTES as GPU_WORKSPACE_BYTES
from offspec.formats.gpu.choice import cuda_kernels
from offspec.formats.gpu.support import cuda_layers
from offspec.formats.modules import QEmbedding, QLinear, weight_format_summary
from offspec.formats.quantize import quantize_rows
from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.store.entry import MANIFEST, store_key
from offspec.store.packed import HEADER, LayerSpec, PackedSet, StoreInvalid, ensure_store, mark_corrupt, open_store
from offspec.types import LoadedModel
from offspec.util.paths import cache_dir

from .checkpoint import Checkpoint
from .config import CPU_HEADROOM, WORKSPACE, OffloadConfig
from .estimates import draft_headroom, target_headroom
from .experts import ExpertSlots
from .head import StreamedHead, head_bytes_per_read
from .hostmem import MADV_DONTNEED, advise, bound_heap, page_round, trim_heap
from .hostmem import runtime_bytes as measured_runtime
from .lent_layers import LentLayers
from .materialize import CorruptPart, head_entry, mapped_tensor, materialize, owner_of
from .placement import ModelSizes, Placement, forced, plan_placement
from .quant import BLOCKSIZE, quantize_weight
from .skeleton import Skeleton, from_checkpoint, from_store
from .streamer import LayerStreamer


@dataclass
class OffloadHandle:
    """What `load` keeps of the offloading set-up."""

    placement: Placement
    streamer: Optional[LayerStreamer] = None
    packed_dir: Optional[Path] = None
    weights: Optional[dict] = None  # {ggml type name: bytes} of the low-bit weights, None for float models
    config: Optional[OffloadConfig] = None  # the config placed under (its limits lowered to fit: fit_limits)
    packed: Optional[PackedSet] = None  # the weight store it was materialized from
    head: Optional[StreamedHead] = None  # the LM head, where it is read from SSD in every pass
    experts: Optional[ExpertSlots] = None  # a mixture's experts, where they are read as routed

    @property
    def io(self) -> Any:
        """What the target's runner reads its per-pass I/O from (`counters()`, `loading()`, `close()`): the layer
        streamer, the streamed head, the expert cache, or their sum; None when nothing streams."""
        parts = [p for p in (self.streamer, self.head, self.experts) if p is not None]
        return None if not parts else parts[0] if len(parts) == 1 else JointIO(parts)

    def summary(self) -> dict:
        out = self.placement.summary()
        out["packed_dir"] = str(self.packed_dir) if self.packed_dir else None
        out["read_mode"] = self.streamer.reader.mode if self.streamer is not None else None
        if self.experts is not None:
            out["experts"] = self.experts.stats()
        out["weight_formats"] = self.weights
        return out


class JointIO:
    """Streamed layers and a streamed head as one source of I/O counters."""

    def __init__(self, parts: list):
        self.parts = parts

    def counters(self) -> tuple[int, float]:
        """(bytes streamed, seconds waited), summed over the parts."""
        totals = [p.counters() for p in self.parts]
        return sum(b for b, _ in totals), sum(w for _, w in totals)

    def expert_counters(self) -> tuple[int, int]:
        """The expert cache's (experts routed to, cache hits), where a part is one (ExpertSlots)."""
        parts = [p.expert_counters() for p in self.parts if hasattr(p, "expert_counters")]
        return (sum(a for a, _ in parts), sum(h for _, h in parts))

    def loading(self) -> bool:
        """Whether a part's next layer is still on its way (LayerStreamer.loading)."""
        return any(part.loading() for part in self.parts)

    def close(self) -> None:
        for part in self.parts:
            part.close()


class StoreDamaged(OffspecError):
    """A converted GGUF's weight store failed a checksum while loading; its entry was marked for a rebuild."""


def model_sizes(sk: Skeleton, dtype: torch.dtype, config: OffloadConfig, extra_bytes: int,
                device: torch.device, runtime_bytes: int = 0, shared_bytes: tuple[int, ...] = ()) -> ModelSizes:
    """What the placement weighs; `runtime_bytes` is the process memory already in use outside the models (a CPU
    device's budget holds it too); `shared_bytes`: ModelSizes.shared_bytes (a draft made from the target)."""
    elem = torch.empty((), dtype=dtype).element_size()
    if sk.complete_store:  # the `other` payload is resident; the memory-mapped token table is not charged
        other = sk.extras["other"].nbytes
    else:
        seen, other = set(), 0
        for key, tensor in sk.model.state_dict(keep_vars=True).items():
            if not key.startswith(sk.prefix) and id(tensor) not in seen:  # tied weights count once
                seen.add(id(tensor))
                other += tensor.numel() * tensor.element_size()
    scores = cuda_layers(sk.model, device, dtype) is not None  # offspec's CUDA layers never materialize them
    kv, act = target_headroom(sk.model.config, config.max_context, config.max_budget, elem, config.prefill_tokens,
                              scores)
    entry = head_entry(sk)
    head = entry[1] if entry is not None else None  # its TensorSpec in `other`, where a CPU may stream it
    head_bytes = head.nbytes if head is not None else 0
    head_buffer = (head_bytes_per_read(head.nbytes // head.shape[0], head.shape[0], HEADER + head.offset)
                   if head is not None else 0)
    return ModelSizes(layer_bytes=tuple(p.nbytes for p in sk.plans), file_bytes=max(p.file_bytes for p in sk.plans),
                      other_bytes=other, kv_bytes=kv, activation_bytes=act, extra_bytes=extra_bytes,
                      workspace_bytes=WORKSPACE.get(device.type, WORKSPACE["cpu"]) + _decode_workspace(sk, device)
                      + (runtime_bytes if device.type == "cpu" else 0),
                      head_bytes=head_bytes, head_buffer_bytes=head_buffer,
                      headroom_bytes=int(config.device_mem * CPU_HEADROOM) if _precise(device, config) else 0,
                      shared_bytes=tuple(shared_bytes), **_expert_sizes(sk.plans, sk.model.config))


def _expert_sizes(plans: list, config: Any) -> dict:
    """ModelSizes' expert fields from the layers' ranges (their dense part first, then one per expert)."""
    if not any(p.ranges for p in plans):
        return {}
    experts = [p.ranges[1:] for p in plans]
    return dict(expert_bytes=tuple(sum(n for _, n, _ in e) for e in experts),
                expert_unit=max((page_round(n) for e in experts for _, n, _ in e), default=0),
                experts_per_layer=max(len(e) for e in experts),
                experts_used=int(getattr(config, "num_experts_per_tok", 0) or 0))


def _decode_workspace(sk: Skeleton, device: torch.device) -> int:
    """Bytes of weights decoded at a time: on CUDA the Triton linears' workspace (formats/gpu), or where torch decodes
    (formats.kernels: CUDA without Triton, a CPU without the compiled kernels) its bands. NF4 decodes a whole
    (out, in) weight in the compute dtype: its largest one (bitsandbytes' fallback for many rows)."""
    if sk.quant == "nf4":
        return max((m.in_features * m.out_features * 2 for layer in sk.layers for m in layer.modules()
                    if hasattr(m, "in_features") and hasattr(m, "out_features")), default=0)
    if sk.quant in ("ggml", "int4", "int8") and device.type == "cuda" and cuda_kernels() == "triton":
        return GPU_WORKSPACE_BYTES  # the Triton linears' split partials (formats/gpu/choice.py)
    if sk.quant in ("ggml", "int4", "int8") and (device.type != "cpu" or kernels.compiled() is None):
        return kernels.DECODE_WORKSPACE
    return 0


# --- packing a float checkpoint ------------------------------------------------------------------
def packed_location(ck: Checkpoint, dtype: torch.dtype, quant: str, root: Optional[Path]) -> tuple[Path, dict]:
    key = {"model": ck.name, "source": ck.fingerprint(), "dtype": str(dtype).removeprefix("torch."), "quant": quant}
    if quant == "nf4":
        key["blocksize"] = BLOCKSIZE
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", ck.name)[:60]
    root = Path(root) if root else cache_dir() / "offload"
    return root / f"{slug}-{key['source'][:12]}-{key['dtype']}-{quant}", key


def _stored_tensors(root: nn.Module, spec: LayerSpec, read: Callable[[str], torch.Tensor], dtype: torch.dtype,
                    qdevice: torch.device):
    """(name, tensor) pairs of `spec` in their stored format, read one source tensor at a time from `read(name)`
    (checkpoint names relative to `root`)."""
    nf4_done = set()
    for t in spec.tensors:
        owner, attr = owner_of(root, t.name)
        if isinstance(owner, (QLinear, QEmbedding)) and attr == "qweight":
            src = read(t.name.removesuffix(".qweight") + ".weight")
            yield t.name, quantize_rows(src, t.ggml)  # ggml blocks (int4 -> Q4_1, int8 -> Q8_0)
        elif type(owner).__name__ == "QuantLinear":  # nf4: qweight/absmax/code all come from the weight
            base = t.name.rpartition(".")[0]
            if attr == "bias":
                yield t.name, read(t.name).to(dtype)
            elif base not in nf4_done:
                nf4_done.add(base)
                for k, v in quantize_weight("nf4", read(base + ".weight").to(qdevice, torch.float32)).items():
                    yield f"{base}.{k}", v.to("cpu")
        else:
            src = read(t.name)
            yield t.name, (src.to(getattr(torch, t.dtype)) if src.is_floating_point() else src)


def ensure_packed(sk: Skeleton, ck: Checkpoint, dtype: torch.dtype, config: OffloadConfig, device: torch.device,
                  progress: ProgressFn, rebuild: bool = False) -> PackedSet:
    directory, key = packed_location(ck, dtype, sk.quant, config.offload_dir)
    if rebuild:
        mark_corrupt(directory)
    qdevice = device if device.type == "cuda" else torch.device("cpu")
    step = "pack" if sk.quant == "none" else "quantize"
    verb = "packing" if sk.quant == "none" else f"quantizing ({sk.quant})"

    def layer(i: int):
        return _stored_tensors(sk.layers[i], sk.plans[i], lambda n: ck.read(f"{sk.prefix}{i}.{n}"), dtype, qdevice)

    def extra(name: str):
        spec = sk.extras[name]
        return lambda: _stored_tensors(sk.model, spec, ck.read, dtype, qdevice)

    extras = {name: (spec, extra(name)) for name, spec in sk.extras.items()}
    return ensure_store(directory, key, sk.plans, layer, progress, step, f"{verb} the layers of {ck.name}", extras)


# --- materializing -------------------------------------------------------------------------------

def _open_source(resolved: Any, dtype: torch.dtype, attn_implementation: str, config: OffloadConfig,
                 device: torch.device) -> tuple[Skeleton, Optional[Checkpoint], Optional[PackedSet]]:
    """The skeleton, the checkpoint (float sources) and the store (converted GGUFs) of `resolved`."""
    store = getattr(resolved, "store", None)
    if store is not None:
        try:
            packed = open_store(store, store_key(Path(resolved.path).name))
        except StoreInvalid as exc:
            _damaged(resolved, str(exc))
        return from_store(Path(resolved.path), packed, dtype, attn_implementation, device), None, packed
    ck = Checkpoint(resolved.path, resolved.name)
    sk = from_checkpoint(Path(resolved.path), dtype, attn_implementation, config.quant, device, set(ck.where))
    return sk, ck, None


def _damaged(resolved: Any, reason: str):
    try:
        (Path(resolved.path) / MANIFEST).unlink()  # the entry is rebuilt from its GGUF
    except OSError:
        pass
    raise StoreDamaged(f"the converted weights of {resolved.name} in {resolved.path} are damaged ({reason}); "
                       f"they are rebuilt from the GGUF on the next load")


def _plan_fitting(sk: Skeleton, dtype: torch.dtype, config: OffloadConfig, extra_bytes: Union[int, Callable],
                  device: torch.device, already_allocated: int, runtime: int = 0,
                  shared_bytes: tuple[int, ...] = ()) -> tuple[Placement, OffloadConfig]:
    """Plan under `config`; where the resident parts do not fit, lower the limits the user left at their defaults
    (config.fit_limits) step by step until they do. Returns the placement and the config it was made for."""
    while True:
        extra = extra_bytes(config) if callable(extra_bytes) else extra_bytes
        try:
            return plan_placement(model_sizes(sk, dtype, config, extra, device, runtime, shared_bytes), device,
                                  config, already_allocated + runtime), config
        except OffspecError:
            smaller = config.smaller_limits()
            if smaller is None:
                raise
            config = smaller


def load_offloaded(resolved: Any, *, device: torch.device, dtype: torch.dtype, attn_implementation: str,
                   config: OffloadConfig, progress: ProgressFn = no_progress,
                   extra_bytes: Union[int, Callable[[OffloadConfig], int]] = 0,
                   already_allocated: int = 0, tiers: Optional[Union[str, tuple[str, ...]]] = None,
                   report: bool = True, runtime: Optional[int] = None, shared_bytes: tuple[int, ...] = (),
                   on_placed: Optional[Callable[[Placement], None]] = None) -> tuple[Optional[Any], OffloadHandle]:
    """Place and (when needed) build `resolved`'s model under `config`'s budgets.

    Returns (model, handle); model is None for a float checkpoint when every layer fits and nothing is quantized
    (load it the usual way). `tiers` forces a placement (a tier per layer, or one tier for all: tests,
    benchmarks, a resident draft); `extra_bytes` are other resident bytes (the draft), or a function of the
    config (its max_context / max_budget) when limits may be lowered to fit (config.fit_limits). `runtime`: the
    process memory in use outside the models (None: measured now), which a CPU's budget holds too.
    `shared_bytes`: a draft made from the target, its bytes per layer that go where the layer is resident
    (ModelSizes.shared_bytes); `on_placed(placement)` is called once the layers are placed, before any is loaded.
    """
    device = torch.device(device)
    sk, ck, packed = _open_source(resolved, dtype, attn_implementation, config, device)
    if isinstance(tiers, str):
        tiers = (tiers,) * len(sk.layers)
    if tiers is not None:
        extra = extra_bytes(config) if callable(extra_bytes) else extra_bytes
        placement = forced(model_sizes(sk, dtype, config, extra, device), device, tiers, config)
    else:
        if runtime is None:  # measured once the model's code is imported (building the skeleton did that)
            runtime = _runtime(device, config)
        placement, config = _plan_fitting(sk, dtype, config, extra_bytes, device, already_allocated, runtime,
                                          shared_bytes)
    if sk.quant == "ggml":
        placement = replace(placement, quant="ggml")
    if report:
        progress(ProgressEvent("placement", placement.describe(), 1, 1, finished=True))
    if on_placed is not None:
        on_placed(placement)
    if packed is None and not placement.streams and config.quant == "none" and not config.pack_always:
        return None, OffloadHandle(placement, config=config)
    if packed is None:
        packed = ensure_packed(sk, ck, dtype, config, device, progress)
    try:
        streamer, experts = materialize(sk, ck, packed, placement, device, dtype, config, progress, resolved.name)
    except CorruptPart as exc:  # a resident part failed its checksum
        if ck is None:
            _damaged(resolved, str(exc))
        sk = from_checkpoint(Path(resolved.path), dtype, attn_implementation, config.quant, device, set(ck.where))
        packed = ensure_packed(sk, ck, dtype, config, device, progress, rebuild=True)
        try:
            streamer, experts = materialize(sk, ck, packed, placement, device, dtype, config, progress,
                                            resolved.name)
        except CorruptPart as exc2:
            raise OffspecError(f"packed layers of {resolved.name} are corrupt right after rebuilding ({exc2}); "
                               f"check the disk, or use another --offload-dir") from None
    trim_heap(_precise(device, config))  # packing and loading freed many temporaries
    head = sk.model.get_output_embeddings()
    return sk.model, OffloadHandle(placement, streamer, packed.directory, weight_format_summary(sk.model), config,
                                   packed, head if isinstance(head, StreamedHead) else None, experts)


def _runtime(device: torch.device, config: OffloadConfig) -> int:
    """The process's own memory, which a CPU budget holds beside the models (0 elsewhere), with the heap trimmed
    first; from then on, large freed blocks go back to the OS (`bound_heap`)."""
    if device.type != "cpu":
        return 0
    bound_heap()
    trim_heap(_precise(device, config))
    return measured_runtime()


def _precise(device: torch.device, config: OffloadConfig) -> bool:
    """Whether a load counts every byte: a CPU budget given (--device-mem), which holds the whole process."""
    return device.type == "cpu" and config.device_mem is not None


def resident_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s tensors held in memory (a memory-mapped token table is not counted)."""
    seen, total = set(), 0
    mapped = {id(m.qweight) for m in model.modules() if isinstance(m, QEmbedding)}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen and not t.is_meta and id(t) not in mapped:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def load_offloaded_pair(target_res: Any, draft_res: Any, target_tok: Any, draft_tok: Any, *, device: torch.device,
                        dtype: torch.dtype, attn_implementation: str, config: OffloadConfig,
                        load_model: Callable, progress: ProgressFn = no_progress,
                        draft_head: Optional[Callable[[nn.Module, Optional[torch.Tensor]], None]] = None,
                        self_draft: bool = False):
    """offspec.models.loading.load_pair with offloading: the draft first (resident; quantized if asked or stored so),
    then the target placed under the budgets with the draft counted as resident. Returns (target, draft).
    `load_model` is offspec.models.loading.load_model (the plain load of a float model that needs no offloading);
    `draft_head(model, source)` may reduce the draft's LM head before its bytes are counted (offspec/models/draft_vocab.py);
    `source` is the full head memory-mapped from the draft's store (None for a draft loaded the plain way).
    `self_draft`: the draft is made from the target (`--draft self`): it reads the target's KV cache and keeps
    none, and where the target streams, it runs the target's resident layers as they are (its copies of them go
    before the target's layers load: the placement counts a resident layer as its bytes less its copy's)."""
    device = torch.device(device)
    # the process's own memory (Python, torch, transformers, the tokenizer) before any weight: measured after the
    # draft, it also held what loading the draft left in the heap (180 MB of a Qwen2.5 0.5B's), besides the draft's
    # own bytes, which are counted below (`resident_bytes`: its weights, but the memory-mapped token table)
    if device.type == "cpu":
        import transformers.modeling_utils  # noqa: F401  the model classes' imports first (torch._dynamo: 120 MB)
    runtime = _runtime(device, config)
    source = None  # the draft's full LM head, memory-mapped from its store
    if getattr(draft_res, "store", None) is None and config.draft_quant == "none":
        draft = load_model(draft_res, device=device, dtype=dtype, attn_implementation=attn_implementation,
                           progress=progress, tokenizer=draft_tok)
    else:
        model, handle = load_offloaded(draft_res, device=device, dtype=dtype, attn_implementation=attn_implementation,
                                       config=replace(config, quant=config.draft_quant, interleave_head=False),
                                       progress=progress, tiers="device", report=False)  # resident, from its store
        draft = LoadedModel(name=draft_res.name, path=draft_res.path, model=model, tokenizer=draft_tok)
        kernels.as_draft(model)  # its products as a draft's (a block's lanes summed as integers first)
        head = model.get_output_embeddings()
        head_name = next((f"{n}.qweight" for n, m in model.named_modules() if m is head), None)
        if isinstance(head, QLinear) and handle.packed is not None and head_name is not None:
            source = mapped_tensor(handle.packed, head_name)
    precise = _precise(device, config)
    trim_heap(precise)
    if draft_head is not None:
        draft_head(draft.model, source)
        if source is not None:  # the rows gathered let go as they went (SubsetHead); later admissions read a few
            advise(source, MADV_DONTNEED)
        trim_heap(precise)
    head, table = draft.model.get_output_embeddings(), getattr(draft.model.get_input_embeddings(), "qweight", None)
    tied = table is not None and isinstance(head, QLinear) and head.qweight.data_ptr() == table.data_ptr()
    if device.type == "cpu" and isinstance(head, QLinear) and not tied:  # a whole head of its own, as a target's is
        kernels.interleave(head)  # (a tied one is the token table, which the embeddings read row-major)
    elem = torch.empty((), dtype=dtype).element_size()
    draft_bytes = resident_bytes(draft.model)
    rows = getattr(draft.model.get_output_embeddings(), "ids", None)  # a reduced head's token ids
    scores = cuda_layers(draft.model, device, dtype) is not None  # offspec's CUDA layers never materialize them

    def extra(cfg: OffloadConfig) -> int:  # the draft's weights, KV cache and activations under cfg's limits
        return draft_bytes + draft_headroom(draft.model.config, cfg.max_context, cfg.max_budget, elem,
                                            cfg.prefill_tokens, None if rows is None else int(rows.numel()), scores,
                                            own_cache=not self_draft)

    lent = LentLayers(draft.model, target_res.name, resident_bytes, precise) if self_draft else None
    model, handle = load_offloaded(target_res, device=device, dtype=dtype, attn_implementation=attn_implementation,
                                   config=config, progress=progress, extra_bytes=extra, already_allocated=draft_bytes,
                                   runtime=runtime, shared_bytes=lent.copy_bytes if lent is not None else (),
                                   on_placed=lent.on_placed if lent is not None else None)
    target = as_loaded(target_res, model, handle, target_tok, load_model, device=device, dtype=dtype,
                       attn_implementation=attn_implementation, progress=progress)
    if lent is not None:
        lent.lend(target.model)
    draft.borrows_kv = self_draft
    return target, draft


def as_loaded(resolved: Any, model: Optional[Any], handle: OffloadHandle, tokenizer: Any, load_model: Callable,
              **load_kwargs: Any):
    """A LoadedModel from `load_offloaded`'s result (model None: a float model loaded the plain way,
    `load_model(resolved, tokenizer=..., **load_kwargs)`), with its offloading handle."""
    if model is None:
        loaded = load_model(resolved, tokenizer=tokenizer, **load_kwargs)
    else:
        loaded = LoadedModel(name=resolved.name, path=resolved.path, model=model, tokenizer=tokenizer)
    loaded.offload = handle
    return loaded
