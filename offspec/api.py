"""`offspec.load(...)`: models in, a ready `Generator` out."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from offspec.formats.cpu_linear import speed_up_cpu_linears
from offspec.formats.gpu.choice import cuda_kernels
from offspec.formats.gguf_config import UNVERIFIED, VERIFIED, family_of
from offspec.models.loading import check_same_tokenizer, load_pair, load_target
from offspec.offload.config import OffloadConfig, checked_offload_dir, read_options
from offspec.offload.prefill import chunk_planner
from offspec.profile.auto import apply_auto_budget
from offspec.spec.engine import SpeculativeEngine
from offspec.spec.hybrid import build_drafter
from offspec.spec.runner import PREFILL_CHUNK, ModelRunner
from offspec.spec.xvocab import VocabMapping
from offspec.util.device import (check_device_budget, is_out_of_memory, out_of_memory_error, resolve_device,
                                 resolve_dtype, use_device)
from offspec.util.threads import ThreadGovernor, configure_threads

from .config import (NO_DRAFT, GenerationConfig, LoadConfig, TreeConfig, budget_room_error, draft_vocab_setting,
                     split_auto_budget, split_options)
from .errors import OffspecError
from .generator import Generator
from .progress import ProgressEvent, ProgressFn, no_progress
from .types import LoadedModel, ModelInfo

__all__ = ["load", "resolve_device", "resolve_dtype"]  # resolve_*: offspec.util.device, kept here for callers


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


def _family(config: Any) -> tuple[str, Any]:
    """(family or architecture, True where offspec's conversion of it is verified against a reference, else why
    not)."""
    family = family_of(config)
    if family is None:
        return (str(getattr(config, "model_type", "unknown")),
                f"offspec verifies {', '.join(sorted(VERIFIED))} and not this architecture")
    return family, getattr(config, UNVERIFIED, None) or family in VERIFIED


def load_line(name: str, extra: dict) -> str:
    """What the user sees of how the target runs: its family, its layers (compiled, or transformers' and why), and
    a warning where its conversion is not verified against a reference."""
    layers = ("compiled CPU layer" if extra["layers"] == "compiled"
              else f"transformers' layers ({extra['layers']})")
    line = f"{name}: {extra['family']} family, {layers}"
    if extra["verified"] is not True:
        line += f"; not verified against a reference ({extra['verified']}): check its output"
    return line


@dataclass(frozen=True)
class LoadPlan:
    """Everything `load` decides from its arguments alone, before touching a model."""

    load: LoadConfig  # its `offload` part is what the loader places the target under
    tree: TreeConfig
    generation: GenerationConfig
    auto_budget: bool  # budget="auto": planned after loading
    fixed_budget: bool  # a budget was given
    device: torch.device
    dtype: torch.dtype

    @property
    def offload(self) -> OffloadConfig:
        return self.load.offload


@dataclass
class _Loaded:
    """What loading gave: the target, the draft (None with draft="none"), and the CPU thread governor."""

    target: LoadedModel
    draft: Optional[LoadedModel]
    governor: Optional[ThreadGovernor]
    device_budget: Optional[int]  # what the placement charged to the device (None: the models loaded the plain way)


def check_options(target: Optional[str] = None, draft: Optional[str] = None, **options: Any) -> LoadPlan:
    """Plan: validate `load`'s arguments without loading anything: a bad option is an OffspecError in milliseconds
    (the CLI and the chat call this before they start). The options become typed configs by field name
    (`split_options`); sizes are read as bytes (`read_options`)."""
    options, auto_budget = split_auto_budget(options)  # budget="auto" (the default) is planned after loading
    load_cfg, tree_cfg, gen_cfg = split_options(read_options(dict(options, target=target, draft=draft)),
                                                LoadConfig, TreeConfig, GenerationConfig)
    load_cfg.validate()
    tree_cfg.validate()
    gen_cfg.validate()
    if tree_cfg.budget > load_cfg.max_budget:
        raise budget_room_error(tree_cfg.budget, load_cfg.max_budget)
    checked_offload_dir(load_cfg.offload)  # an unwritable --offload-dir fails here
    # limits left at their defaults may be lowered by the loader where the resident parts would not fit the budget
    offload = replace(load_cfg.offload, fit_limits=tuple(n for n in ("max_budget", "max_context") if n not in options),
                      min_budget=tree_cfg.budget)
    if tree_cfg.drafter in ("model", "hybrid") and load_cfg.draft == NO_DRAFT:
        raise OffspecError(f"drafter {tree_cfg.drafter} needs a draft model; drop --draft none or use --drafter suffix")
    device = resolve_device(load_cfg.device)
    return LoadPlan(replace(load_cfg, offload=offload), tree_cfg, gen_cfg, auto_budget, "budget" in options, device,
                    resolve_dtype(load_cfg.dtype, device))


def load(target: Optional[str] = None, draft: Optional[str] = None, *, progress: Optional[ProgressFn] = None,
         **options: Any) -> Generator:
    """Load a target and a draft model (None = the built-in default pair) and return a `Generator`.

    `draft="none"`: no draft model; the target speculates with suffix drafts alone (any target).
    Options (by field name): LoadConfig (device, dtype, attn_implementation, draft_vocab, threads) with its
    OffloadConfig (max_context, max_budget and the offloading budgets: device_mem, ram_mem, quant, draft_quant,
    offload_dir, stream_head), TreeConfig (budget, max_beams, branch, max_depth, drafter: model, suffix or hybrid;
    default hybrid with a draft model, else suffix) and GenerationConfig (max_new_tokens, speculate).
    Every option is checked (`check_options`) before any model is touched.

    The steps: plan (`check_options`) -> load the models -> build the engine -> warm up -> plan the budget.
    """
    progress = progress or no_progress
    plan = check_options(target, draft, **options)
    loaded = _load_models(plan, progress)
    plan = _fitted_limits(plan, loaded.target, progress)
    fallback = _cuda_kernels_fit(plan, loaded, progress)
    generator = _build_generator(plan, loaded, progress)
    if fallback is not None:
        generator.info.extra["cuda_kernels"] = fallback
    _warm_up(generator, plan, loaded, progress)
    if plan.auto_budget:
        _plan_budget(generator, plan, loaded, progress)
    return generator


def _load_models(plan: LoadPlan, progress: ProgressFn) -> _Loaded:
    """Load: CPU threads sized, the device chosen, then the target (and draft) placed under the offloading budgets
    (OffloadConfig); on a CPU their linears take offspec's kernels. Running out of memory is one line."""
    load_cfg, device = plan.load, plan.device
    # CPU threads: fixed by the user, or sized to the cores other processes leave free (sampled over the load)
    governor = configure_threads(load_cfg.threads) if device.type == "cpu" else None
    use_device(device)  # cuda:N is the current device from here on (pinned memory, events, kernels)
    check_device_budget(device, plan.offload.device_mem)  # a --device-mem above what is free: one line, before loading
    idle_draft = not plan.generation.speculate and load_cfg.draft != NO_DRAFT and plan.tree.drafter is None
    if idle_draft:  # a draft that will not run takes no memory: a call that speculates anyway drafts from suffixes
        progress(ProgressEvent("draft", "no draft model loaded: speculation is off (--no-speculate); a call that "
                               "speculates uses suffix drafts", 1, 1, finished=True))
    try:
        if load_cfg.draft == NO_DRAFT or idle_draft:
            t, d = load_target(load_cfg.target, device=device, dtype=plan.dtype,
                               attn_implementation=load_cfg.attn_implementation, progress=progress,
                               offload=plan.offload), None
        else:
            t, d = load_pair(load_cfg.target, load_cfg.draft, device=device, dtype=plan.dtype,
                             attn_implementation=load_cfg.attn_implementation, progress=progress,
                             offload=plan.offload, draft_vocab=draft_vocab_setting(load_cfg.draft_vocab))
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        raise out_of_memory_error(exc, device, "loading the models", plan.offload.device_mem) from None
    if governor is not None:
        governor.update(force=True)  # before the warm-up and the budget plan, which time passes
    if device.type == "cpu":
        for model in (t.model, d.model) if d is not None else (t.model,):
            speed_up_cpu_linears(model)  # same math, kernels that suit few-token passes on CPU
    return _Loaded(t, d, governor, t.offload.placement.device_budget if t.offload is not None else None)


def _cuda_kernels_fit(plan: LoadPlan, loaded: _Loaded, progress: ProgressFn) -> Optional[str]:
    """On CUDA with offspec's Triton kernels: launch every kernel configuration the models' passes can, once, before
    the engine is built (formats/gpu/probe.py). One that cannot compile or launch on this card makes this process
    use torch's decode + cuBLAS (and transformers' layers) instead: returns that line, also shown as progress (an
    error under OFFSPEC_CUDA_KERNELS=triton). None: the kernels run here (or are not used)."""
    if plan.device.type != "cuda" or cuda_kernels() != "triton":
        return None
    from offspec.formats.gpu.probe import check_models  # Triton: imported on CUDA only

    line = check_models(plan.device, plan.dtype, [m.model for m in (loaded.target, loaded.draft) if m is not None])
    if line is not None:
        progress(ProgressEvent("kernels", line, 1, 1, finished=True))
    return line


def _fitted_limits(plan: LoadPlan, target: LoadedModel, progress: ProgressFn) -> LoadPlan:
    """The plan with the offloading config the target was placed under: its max_context / max_budget lowered
    where the defaults did not fit the device budget (said in one progress line)."""
    fitted = target.offload.config if target.offload is not None else None
    if fitted is None:
        return plan
    load_cfg = plan.load
    if (fitted.max_context, fitted.max_budget) != (load_cfg.max_context, load_cfg.max_budget):
        progress(ProgressEvent("placement", f"max_context {fitted.max_context}, max_budget {fitted.max_budget}: "
                               f"lowered from {load_cfg.max_context} / {load_cfg.max_budget} to fit the device budget "
                               f"(give --max-context / --max-budget to choose)", 1, 1, finished=True))
    return replace(plan, load=replace(load_cfg, offload=fitted))


def _build_generator(plan: LoadPlan, loaded: _Loaded, progress: ProgressFn) -> Generator:
    """Build the engine: a runner per model (caches sized by the limits), the drafter, the engine and the
    `Generator` with its ModelInfo."""
    t, d, device, load_cfg = loaded.target, loaded.draft, plan.device, plan.load
    fitted = t.offload.config if t.offload is not None else None
    model_limit = getattr(t.model.config, "max_position_embeddings", None) or load_cfg.max_context
    max_context = min(load_cfg.max_context, model_limit)
    budget_room = load_cfg.max_budget + 1  # the tree's nodes plus its root
    # exact attention: verification, decoding without a draft and reused conversations compute the same numbers
    target_runner = ModelRunner(t.model, capacity=max_context + budget_room, exact=True)
    # the draft also needs scratch slots for every node it expands while growing a tree
    draft_runner = ModelRunner(d.model, capacity=max_context + 2 * budget_room + 64) if d is not None else None
    if draft_runner is not None and d.borrows_kv:  # a draft made from the target reads the target's own KV cache
        draft_runner.borrow_cache(target_runner)
    if t.offload is not None and t.offload.io is not None:
        target_runner.io = t.offload.io  # offloading: bytes streamed and io wait per pass (PassStats)
    if draft_runner is not None and fitted is not None and fitted.prefill_tokens < PREFILL_CHUNK:
        # the placement reserved the draft's activations for prefill passes this long (offload.estimates)
        draft_runner.prefill_chunk = lambda cached, remaining, most=fitted.prefill_tokens: min(remaining, most)
    if t.offload is not None and t.offload.placement.streams:  # every pass streams the layers: fewest prefill passes
        elem = torch.empty((), dtype=plan.dtype).element_size()
        target_runner.prefill_chunk = chunk_planner(t.model.config, t.offload.placement.sizes.activation_bytes, elem,
                                                    materialized_scores=target_runner.gpu_layers is None)
    # a draft with another tokenizer proposes through text (offspec/spec/xvocab.py); verification is the same
    mapped = d is not None and check_same_tokenizer(t, d) is not None
    mapping = VocabMapping(t.tokenizer, d.tokenizer) if mapped else None
    drafter = build_drafter(draft_runner, device, mapping=mapping)  # model, suffix or hybrid trees, per pass
    tree_cfg = replace(plan.tree, drafter=drafter.check_mode(plan.tree.drafter))
    engine = SpeculativeEngine(target_runner, drafter, max_context=max_context, max_budget=load_cfg.max_budget)
    info = ModelInfo(target=t.name, draft=d.name if d is not None else NO_DRAFT, device=str(device),
                     dtype=str(plan.dtype).replace("torch.", ""), max_context=max_context,
                     default_budget=tree_cfg.budget,
                     extra={"budget_source": "fixed" if plan.fixed_budget else "default",
                            "drafter": tree_cfg.drafter})
    # how each decoder layer runs: one compiled call (offspec.formats.layers), or transformers' modules and why
    info.extra["layers"] = target_runner.layers_unsupported or "compiled"
    info.extra["family"], info.extra["verified"] = _family(t.model.config)
    progress(ProgressEvent("load", load_line(t.name, info.extra), 1, 1, finished=True))
    if draft_runner is not None and draft_runner.vocab_ids is not None:  # the draft's reduced LM head
        info.extra["draft_vocab"] = int(draft_runner.vocab_ids.numel())
    if mapping is not None:
        info.extra["draft_mapping"] = mapping.summary()  # the draft's proposals mapped to the target's tokens
    if t.offload is not None:
        info.extra["placement"] = t.offload.summary()  # offloading: where the target's layers live
    generator = Generator(engine, t.tokenizer, _eos_ids(t.model, t.tokenizer), info, tree_cfg, plan.generation)
    generator.threads = loaded.governor  # keeps the thread count fitting the free cores between passes
    if loaded.governor is not None:
        info.extra["threads"] = loaded.governor.summary()
    return generator


def _out_of_memory(generator: Generator, plan: LoadPlan, loaded: _Loaded, exc: Exception, when: str) -> OffspecError:
    """One line for running out of memory after loading; the generator's buffers (pinned RAM on CUDA) go now."""
    generator.close()
    budget = loaded.device_budget if loaded.device_budget is not None else plan.offload.device_mem
    return out_of_memory_error(exc, plan.device, when, budget)


def _warm_up(generator: Generator, plan: LoadPlan, loaded: _Loaded, progress: ProgressFn) -> None:
    """Warm up: one short generation (kernels, caches, allocator), then forgotten."""
    progress(ProgressEvent("warmup", "warming up", 0, 1))
    try:
        generator.generate("Hi", max_new_tokens=2, budget=min(plan.tree.budget, 4))
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        raise _out_of_memory(generator, plan, loaded, exc, "the warm-up") from None
    generator.engine.forget()  # forget the warm-up conversation (and keep its output out of the session history)
    progress(ProgressEvent("warmup", "warming up", 1, 1, finished=True))


def _plan_budget(generator: Generator, plan: LoadPlan, loaded: _Loaded, progress: ProgressFn) -> None:
    """Plan the budget (budget="auto"): the tree from a matching measured profile, else a quick start-up
    estimate (offspec.profile.auto)."""
    try:
        apply_auto_budget(generator, plan.load, progress)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        raise _out_of_memory(generator, plan, loaded, exc, "the start-up timing of the tree budget") from None
