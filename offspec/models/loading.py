"""Loading resolved models (weights + tokenizer) and checking that a draft can serve a target.

Every failure the user can cause or fix (a corrupt or truncated safetensors file, a missing shard, an
unknown architecture, too little memory) becomes one OffspecError line. A draft with another tokenizer is no error:
it proposes through the text mapping (offspec/spec/xvocab.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, TypeVar, Union

import torch

from offspec.errors import OffspecError
from offspec.offload.checkpoint import validate_weights
from offspec.offload.config import OffloadConfig
from offspec.offload.model import StoreDamaged, as_loaded, load_offloaded, load_offloaded_pair
from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.store.entry import converted_dir, verify_entry
from offspec.types import LoadedModel
from offspec.util.hf import quiet_transformers

from .auto_draft import choose_draft, tokenizer_difference
from .convert import failure_reason
from .draft_vocab import reduce_draft_head
from .gguf_tokenizer import gguf_tokenizer
from .self_draft import self_draft_type
from .sources import ResolvedModel, convert_located, locate_model

T = TypeVar("T")


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> "float32"."""
    return str(dtype).removeprefix("torch.")


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_tokenizer(resolved: ResolvedModel) -> Any:
    """The tokenizer of a resolved model, or of a located GGUF (read from its converted entry when that is
    ready, else from the GGUF itself); failures become one OffspecError line."""
    from transformers import AutoTokenizer

    where, cls, from_gguf = str(resolved.path), AutoTokenizer, False
    if resolved.gguf is not None:
        entry = converted_dir(resolved.key)
        if entry.is_dir() and verify_entry(entry) is None:
            where = str(entry)
            if _saved_tokenizer(resolved) is not None:
                # the pipeline offspec saved when it converted the GGUF: loaded as it is, without the per-model
                # class that rebuilds it from Python copies of the vocabulary and merges (which it keeps: 45 MB
                # for Qwen2.5's 151,936 tokens, in the memory a small --device-mem budget has)
                from transformers import PreTrainedTokenizerFast as cls
        else:
            from_gguf = True
    try:
        with quiet_transformers():
            tokenizer = gguf_tokenizer(resolved.gguf) if from_gguf else cls.from_pretrained(where)
    except Exception as exc:
        reason = failure_reason(exc) if from_gguf else _reason(exc)
        raise OffspecError(f"cannot load the tokenizer of {resolved.name} from {resolved.path}: {reason}") from exc
    return tokenizer


def _saved_tokenizer(resolved: ResolvedModel) -> Optional[Path]:
    """The tokenizer.json offspec saved in a GGUF's converted entry (None: there is none yet, or no GGUF)."""
    if resolved.gguf is None:
        return None
    path = converted_dir(resolved.key) / "tokenizer.json"
    return path if path.is_file() else None


def same_saved_tokenizer(a: ResolvedModel, b: ResolvedModel) -> bool:
    """Whether two GGUFs' converted entries saved byte-identical tokenizers (a Qwen2.5 pair does): the second one
    need not be loaded (~40 MB, and a 100 MB parse on the way)."""
    pa, pb = _saved_tokenizer(a), _saved_tokenizer(b)
    if pa is None or pb is None or pa.stat().st_size != pb.stat().st_size:
        return False
    same = all((pa.parent / n).read_bytes() == (pb.parent / n).read_bytes() if (pa.parent / n).is_file()
               else not (pb.parent / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json"))
    return same


def load_model(resolved: ResolvedModel, *, device: Union[torch.device, str], dtype: torch.dtype,
               attn_implementation: str = "sdpa", progress: ProgressFn = no_progress,
               tokenizer: Optional[Any] = None) -> LoadedModel:
    """Load weights (and the tokenizer unless given) of `resolved` onto `device` in `dtype`."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    message = f"loading {resolved.name}"
    progress(ProgressEvent("load", message))
    validate_weights(resolved.path)
    if tokenizer is None:
        tokenizer = load_tokenizer(resolved)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn_implementation}
    if device.type != "cpu":
        kwargs["device_map"] = {"": device}  # straight onto the device, no host copy
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(str(resolved.path), **kwargs)
        model = model.to(device)
    except (MemoryError, torch.OutOfMemoryError) as exc:
        raise OffspecError(f"out of memory loading {resolved.name} on {device} in {dtype_name(dtype)}; "
                           f"free memory, or use a smaller model or dtype") from exc
    except Exception as exc:
        raise OffspecError(f"cannot load model {resolved.name} from {resolved.path}: {_reason(exc)}") from exc
    model.eval()
    model.requires_grad_(False)
    progress(ProgressEvent("load", message, finished=True))
    return LoadedModel(name=resolved.name, path=resolved.path, model=model, tokenizer=tokenizer)


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> Optional[str]:
    """None when target and draft have the same vocabulary and eos/bos ids, else how they differ: such a draft
    proposes through the text mapping (offspec/spec/xvocab.py), it is not refused."""
    if draft.tokenizer is target.tokenizer:
        return None
    return tokenizer_difference(target.tokenizer, draft.tokenizer)


def _check_quant(located: ResolvedModel, quant: str, flag: str, device: torch.device) -> None:
    if quant == "none":
        return
    if located.gguf is not None or located.weights == "ggml":
        raise OffspecError(f"{flag} {quant} applies to float (safetensors) models; {located.name} is a GGUF and "
                           f"keeps its own quantization: drop {flag}")
    if quant == "nf4" and device.type != "cuda":
        raise OffspecError(f"{flag} nf4 needs a CUDA GPU (bitsandbytes' NF4 runs 10-30x slower than float on a "
                           f"CPU); use {flag} int4, which offspec's CPU kernels run fast")


def _is_default(spec: Optional[str]) -> bool:
    return spec is None or spec.strip().lower() in ("", "default")


def load_pair(target_spec: Optional[str], draft_spec: Optional[str], *, device: Union[torch.device, str],
              dtype: torch.dtype, attn_implementation: str = "sdpa",
              progress: ProgressFn = no_progress, offload: Optional[OffloadConfig] = None,
              draft_vocab: Union[str, int] = "auto") -> tuple[LoadedModel, Optional[LoadedModel]]:
    """Locate, check, convert and load a target and its draft.

    A target the user named without a draft gets one (offspec/models/auto_draft.py: a cached model with its
    tokenizer, else the default draft, else none: then the draft returned is None, suffix drafts only). A draft with
    another tokenizer loads with its own, and proposes through the text mapping (offspec/spec/xvocab.py). Tokenizers
    are read before anything is converted or loaded. A converted GGUF always loads through its weight store (its ggml
    blocks), placed under `offload` (None: float models load the plain way and a GGUF under the defaults;
    offspec.load always passes one, from its LoadConfig). The draft's LM head keeps the rows `draft_vocab` asks for
    (offspec/models/draft_vocab.py) before the target is placed, so placement counts what stays."""
    target_loc = locate_model(target_spec, "target", progress=progress)
    if offload is not None:
        _check_quant(target_loc, offload.quant, "--quant", torch.device(device))
    target_tok = load_tokenizer(target_loc)
    draft_tok = None
    is_self = self_draft_type(draft_spec) is not None  # its runner reads the target's KV cache (offspec.api)
    if draft_spec is None and not _is_default(target_spec):  # a target of the user's and no draft named: choose one
        choice = choose_draft(target_loc, target_tok, load_tokenizer, progress=progress)
        progress(ProgressEvent("draft", choice.line, 1, 1, finished=True))
        if choice.draft is None:
            return _load_located_target(target_loc, target_tok, device=device, dtype=dtype,
                                        attn_implementation=attn_implementation, progress=progress,
                                        offload=offload), None
        draft_loc, draft_tok = choice.draft, choice.tokenizer
    else:
        draft_loc = locate_model(draft_spec, "draft", progress=progress, target=target_loc)
        if is_self:
            draft_tok = target_tok  # the target's own tokenizer, copied key for key
    if offload is not None:
        _check_quant(draft_loc, offload.draft_quant, "--draft-quant", torch.device(device))
    if draft_tok is None:
        draft_tok = target_tok if same_saved_tokenizer(target_loc, draft_loc) else load_tokenizer(draft_loc)
    if tokenizer_difference(target_tok, draft_tok) is None:
        draft_tok = target_tok  # the same vocabulary and ids: one tokenizer serves both (a Qwen2.5 one holds ~100 MB)
    else:
        progress(ProgressEvent("draft", f"draft {draft_loc.name} (another tokenizer: proposals mapped through text)",
                               1, 1, finished=True))
    if offload is None and (target_loc.gguf is not None or draft_loc.gguf is not None
                            or draft_loc.weights == "ggml"):
        offload = OffloadConfig()
    kwargs = dict(device=device, dtype=dtype, attn_implementation=attn_implementation, progress=progress)

    def draft_head(model: Any, source: Optional[torch.Tensor] = None) -> None:
        # `source`: the full head memory-mapped from the draft's store (offload.model.load_offloaded_pair)
        line = reduce_draft_head(model, draft_tok, draft_vocab, source, source_mapped=source is not None)
        if line is not None:
            progress(ProgressEvent("load", line, 1, 1, finished=True))

    def convert_and_load() -> tuple[LoadedModel, LoadedModel]:
        target_res, draft_res = convert_located(target_loc, progress), convert_located(draft_loc, progress)
        if offload is None:
            target = load_model(target_res, tokenizer=target_tok, **kwargs)
            draft = load_model(draft_res, tokenizer=draft_tok, **kwargs)
            draft.borrows_kv = is_self
            draft_head(draft.model)
            return target, draft
        # offloading (offspec/offload): the draft loads first, then the target's decoder layers are placed under
        # the device/RAM budgets of `offload` and streamed as needed
        return load_offloaded_pair(target_res, draft_res, target_tok, draft_tok, device=torch.device(device),
                                   dtype=dtype, attn_implementation=attn_implementation, config=offload,
                                   progress=progress, load_model=load_model, draft_head=draft_head,
                                   self_draft=is_self)

    return _rebuilding_once(convert_and_load, progress)


def load_target(target_spec: Optional[str], *, device: Union[torch.device, str], dtype: torch.dtype,
                attn_implementation: str = "sdpa", progress: ProgressFn = no_progress,
                offload: Optional[OffloadConfig] = None) -> LoadedModel:
    """Locate, convert and load a target without a draft model (`--draft none`: suffix drafts only)."""
    located = locate_model(target_spec, "target", progress=progress)
    if offload is not None:
        _check_quant(located, offload.quant, "--quant", torch.device(device))
    return _load_located_target(located, load_tokenizer(located), device=device, dtype=dtype,
                                attn_implementation=attn_implementation, progress=progress, offload=offload)


def _load_located_target(located: ResolvedModel, target_tok: Any, *, device: Union[torch.device, str],
                         dtype: torch.dtype, attn_implementation: str, progress: ProgressFn,
                         offload: Optional[OffloadConfig]) -> LoadedModel:
    if offload is None and located.gguf is not None:
        offload = OffloadConfig()
    kwargs = dict(device=device, dtype=dtype, attn_implementation=attn_implementation, progress=progress)

    def convert_and_load() -> LoadedModel:
        resolved = convert_located(located, progress)
        if offload is None:
            return load_model(resolved, tokenizer=target_tok, **kwargs)
        # the target's layers placed under the budgets of `offload`, nothing else resident
        model, handle = load_offloaded(resolved, device=torch.device(device), dtype=dtype,
                                       attn_implementation=attn_implementation, config=offload, progress=progress)
        return as_loaded(resolved, model, handle, target_tok, load_model, **kwargs)

    return _rebuilding_once(convert_and_load, progress)


def _rebuilding_once(convert_and_load: Callable[[], T], progress: ProgressFn) -> T:
    """Run `convert_and_load`; where a weight store turns out damaged while loading (the entry is then marked),
    run it once more: converting again rebuilds the entry."""
    try:
        return convert_and_load()
    except StoreDamaged as exc:
        progress(ProgressEvent("convert", f"{exc}; rebuilding now"))
        return convert_and_load()
