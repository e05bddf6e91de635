"""`offspec.load(...)`: models in, a ready `Generator` out."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .cpu_linear import speed_up_cpu_linears
from .config import GenerationConfig, LoadConfig, TreeConfig, split_auto_budget, split_options
from .device import (check_device_budget, is_out_of_memory, out_of_memory_error, resolve_device, resolve_dtype,
                     use_device)
from .drafter import TreeDrafter
from .engine import SpeculativeEngine
from .errors import OffspecError
from .generator import Generator
from .offload.config import OffloadConfig
from .progress import ProgressEvent, ProgressFn, no_progress
from .runner import ModelRunner
from .types import ModelInfo

__all__ = ["load", "resolve_device", "resolve_dtype"]  # resolve_*: offspec.device, kept here for callers


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    # end-of-text tokens that converted GGUF configs can leave out (Qwen's upstream config stops on both)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>") if t in vocab)
    return ids


def load(target: Optional[str] = None, draft: Optional[str] = None, *, progress: Optional[ProgressFn] = None,
         **options: Any) -> Generator:
    """Load a target and a draft model (None = the built-in default pair) and return a `Generator`.

    Options (by field name): LoadConfig (device, dtype, max_context, max_budget, attn_implementation),
    TreeConfig (budget, max_beams, branch, max_depth) and GenerationConfig (max_new_tokens, speculate).
    """
    from .loading import load_pair  # heavy imports only when loading

    progress = progress or no_progress
    options, auto_budget = split_auto_budget(options)  # budget="auto" (the default) is planned after loading
    load_cfg, tree_cfg, gen_cfg = split_options(dict(options, target=target, draft=draft),
                                                LoadConfig, TreeConfig, GenerationConfig)
    load_cfg.validate()
    tree_cfg.validate()
    gen_cfg.validate()
    if tree_cfg.budget > load_cfg.max_budget:
        raise OffspecError(f"budget {tree_cfg.budget} is above max_budget {load_cfg.max_budget}; raise max_budget")
    offload = OffloadConfig.from_load_config(load_cfg)  # offloading budgets; bad sizes fail here, before loading
    device = resolve_device(load_cfg.device)
    dtype = resolve_dtype(load_cfg.dtype, device)
    use_device(device)  # cuda:N is the current device from here on (pinned memory, events, kernels)
    check_device_budget(device, offload.device_mem)  # a --device-mem above what is free: one line, before loading
    try:
        t, d = load_pair(load_cfg.target, load_cfg.draft, device=device, dtype=dtype,
                         attn_implementation=load_cfg.attn_implementation, progress=progress, offload=offload)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        raise out_of_memory_error(exc, device, "loading the models", offload.device_mem) from None

    if device.type == "cpu":
        for model in (t.model, d.model):
            speed_up_cpu_linears(model)  # same math, kernels that suit few-token passes on CPU

    model_limit = getattr(t.model.config, "max_position_embeddings", None) or load_cfg.max_context
    max_context = min(load_cfg.max_context, model_limit)
    budget_room = load_cfg.max_budget + 1  # the tree's nodes plus its root
    target_runner = ModelRunner(t.model, capacity=max_context + budget_room)
    # the draft also needs scratch slots for every node it expands while growing a tree
    draft_runner = ModelRunner(d.model, capacity=max_context + 2 * budget_room + 64)
    if t.offload is not None and t.offload.streamer is not None:
        target_runner.io = t.offload.streamer  # offloading: bytes streamed and io wait per pass (PassStats)
    if t.offload is not None and t.offload.placement.streams:  # every pass streams the layers: fewest prefill passes
        from .offload.prefill import chunk_planner

        elem = torch.empty((), dtype=dtype).element_size()
        target_runner.prefill_chunk = chunk_planner(t.model.config, t.offload.placement.sizes.activation_bytes, elem)
    engine = SpeculativeEngine(target_runner, TreeDrafter(draft_runner), max_context=max_context,
                               max_budget=load_cfg.max_budget)
    info = ModelInfo(target=t.name, draft=d.name, device=str(device), dtype=str(dtype).replace("torch.", ""),
                     max_context=max_context, default_budget=tree_cfg.budget,
                     extra={"budget_source": "fixed" if "budget" in options else "default"})
    if t.offload is not None:
        info.extra["placement"] = t.offload.summary()  # offloading: where the target's layers live
    generator = Generator(engine, t.tokenizer, _eos_ids(t.model, t.tokenizer), info, tree_cfg, gen_cfg)

    budget = t.offload.placement.device_budget if t.offload is not None else offload.device_mem

    def out_of_memory(exc: Exception, when: str) -> OffspecError:
        generator.close()  # the streamed target's buffers (pinned RAM on CUDA) go now
        return out_of_memory_error(exc, device, when, budget)

    progress(ProgressEvent("warmup", "warming up", 0, 1))
    try:
        generator.generate("Hi", max_new_tokens=2, budget=min(tree_cfg.budget, 4))
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        raise out_of_memory(exc, "the warm-up") from None
    engine.tokens = []  # forget the warm-up conversation
    engine.target.cache.truncate(0)
    draft_runner.cache.truncate(0)
    progress(ProgressEvent("warmup", "warming up", 1, 1, finished=True))
    if auto_budget:  # budget="auto": plan the tree from a matching measured profile, else a quick start-up estimate
        from .profile.auto import apply_auto_budget

        try:
            apply_auto_budget(generator, load_cfg, progress)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            raise out_of_memory(exc, "the start-up timing of the tree budget") from None
    return generator
