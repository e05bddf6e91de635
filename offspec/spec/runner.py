"""Runs a transformers causal LM over arbitrary token sets with a slot KV cache and a 4D mask.

The decoder body gives hidden states; the LM head is applied separately, only where logits are
needed (a 4096-node tree times a 152k vocabulary would be gigabytes of logits).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional, Sequence

import torch

from offspec.formats import kernels
from offspec.formats.attention import exact as exact_attention
from offspec.formats.attention import install as install_attention
from offspec.formats.attention import layer_windows, windowed
from offspec.formats.gpu.choice import cuda_kernels
from offspec.formats.layer_stack import install_final_norm, stack_forward
from offspec.formats.layers import active as compiled_layers
from offspec.formats.layers import install as install_layers
from offspec.formats.modules import QLinear

from .kvcache import BorrowedKVCache, SlotKVCache

PREFILL_CHUNK = 512  # tokens per prefill pass of a resident model (bounds its activation memory)
# the most tokens of a pass that runs compiled layers on a runner without exact attention (a draft): longer passes
# (a prompt's catch-up) run faster on transformers' layers with SDPA (1050 tokens: 10.7-12.5 s against 14.2-16.5 s)
COMPILED_MAX_TOKENS = 64


def compute_device_and_dtype(model) -> tuple[torch.device, torch.dtype]:
    """Where and in which float dtype `model` computes. A low-bit model says so on its token table (its weights
    are uint8 blocks, and a streamed layer's parameters are meta placeholders between passes)."""
    emb = model.get_input_embeddings()
    if getattr(emb, "compute_device", None) is not None:
        return emb.compute_device, emb.compute_dtype
    return emb.weight.device, emb.weight.dtype


def _kv_geometry(runner: "ModelRunner") -> tuple:
    """What a runner's cache buffers look like: (layers, key-value heads, head size, windows, dtype, device)."""
    config = runner.model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (config.num_hidden_layers, heads, head_dim, tuple(runner.windows), str(runner.dtype), str(runner.device))


class ModelRunner:
    """`exact`: every pass attends per query over its visible keys only (offspec.formats.attention). With the
    row-invariant low-bit kernels this makes each token's result a function of the tokens before it alone, however
    the tokens are batched (prefill chunk, one token, tree): the target's runner, so that verification, decoding
    without a draft and a reused conversation all compute the same numbers."""

    def __init__(self, model, capacity: int, exact: bool = False):
        self.model = model
        self.body = model.get_decoder()
        head = model.get_output_embeddings()
        # a draft's reduced head (offspec/models/draft_vocab.py) computes the rows of `vocab_ids` only, and takes a row for
        # every token the runner is given (`extend`)
        self.subset_head = head if hasattr(head, "subset") and hasattr(head, "admit") else None
        self.lm_head = head.subset if self.subset_head is not None else head
        self.device, self.dtype = compute_device_and_dtype(model)
        self.exact = exact
        install_attention(model)  # SDPA, or exact attention within `exact_attention(True)`
        # None: every pass runs each decoder layer in one compiled call (exact attention included), else why not
        self.layers_unsupported = install_layers(model, self.device, self.dtype)
        if self.layers_unsupported is None:  # a plain body's final norm as its layers' stack computes it
            install_final_norm(self.body)
        # CUDA: offspec's own layers (formats/gpu/layer.py: batch-invariant, tree attention without a dense mask)
        self.gpu_layers = None  # that module where its layers run this model, else None
        self.gpu_layers_unsupported = "not on CUDA"  # None, or why transformers' layers run on CUDA
        if self.device.type == "cuda":
            from offspec.formats.gpu import layer as gpu_layer  # lazy: a CPU never imports Triton

            self.gpu_layers_unsupported = gpu_layer.install(model, self.device, self.dtype)
            self.gpu_layers = gpu_layer if self.gpu_layers_unsupported is None else None
        self.capacity = capacity
        self.cache = SlotKVCache(model.config.num_hidden_layers, capacity)
        # sliding windows (None: a layer sees every visible key); a model whose layers differ (gemma2/3, qwen with
        # sliding layers) takes one mask per layer type (transformers' `layer_types`), the others one for all
        self.windows = layer_windows(model.config)
        self._layer_types = getattr(model.config, "layer_types", None) if len(set(self.windows)) > 1 else None
        # gemma2's final logit soft-capping, which transformers applies in the LM's forward (not in its head)
        self.logit_softcap = float(getattr(model.config, "final_logit_softcapping", None) or 0.0)
        # transformers >= 5.2x names the cache argument `cache` (warning on `past_key_values`); earlier 5.x do not
        self._cache_arg = "cache" if "cache" in inspect.signature(self.body.forward).parameters else "past_key_values"
        self._min = torch.finfo(self.dtype).min
        # an offloading streamer with `counters() -> (bytes streamed, seconds waited)` and `loading() -> bool`, if any
        self.io = None
        # (tokens cached, tokens left to prefill) -> tokens in the next prefill pass; a streamed target takes the
        # largest chunk its activation reserve allows (offspec.offload.prefill), as each pass streams every layer
        self.prefill_chunk: Callable[[int, int], int] = lambda cached, remaining: min(remaining, PREFILL_CHUNK)

    def io_counters(self) -> tuple[int, float]:
        """Cumulative (weight bytes streamed, seconds spent waiting for weights); zeros when nothing streams."""
        return self.io.counters() if self.io is not None else (0, 0.0)

    def expert_counters(self) -> tuple[int, int]:
        """Cumulative (experts routed to, of them found in the expert cache) over the layers whose experts are read
        as routed (offspec/offload/experts.py); zeros for every other model."""
        counters = getattr(self.io, "expert_counters", None)
        return counters() if counters is not None else (0, 0)

    def weights_loading(self) -> bool:
        """Whether the next pass's first streamed layer is still being read (False when nothing streams)."""
        return self.io is not None and self.io.loading()

    def borrow_cache(self, owner: "ModelRunner") -> None:
        """Read `owner`'s keys and values of the committed tokens instead of keeping a cache of its own (a draft
        made from the target, offspec.spec.kvcache.BorrowedKVCache); its capacity becomes the owner's."""
        mine, theirs = _kv_geometry(self), _kv_geometry(owner)
        if mine != theirs:
            raise ValueError(f"a draft borrows the target's cache only with the same layers, heads, dtype and device "
                             f"(layers, key-value heads, head size, windows, dtype, device): {mine} against {theirs}")
        self.cache = BorrowedKVCache(owner.cache)
        self.capacity = owner.capacity

    @property
    def borrows(self) -> bool:
        """Whether this runner reads another runner's cache (`borrow_cache`)."""
        return isinstance(self.cache, BorrowedKVCache)

    def adopt(self, tokens: Sequence[int]) -> None:
        """A borrowing runner takes the owner's committed tokens (`tokens`' first owner.length) as its own, without
        running them; a reduced head admits the ones it had not seen."""
        owner = self.cache.owner.length
        if self.subset_head is not None and owner > self.cache.length:
            self.subset_head.admit(tokens[self.cache.length : owner])
        self.cache.follow()

    @property
    def length(self) -> int:
        """Committed tokens held in the cache (slots [0, length))."""
        return self.cache.length

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        """Run q tokens; return their (q, hidden) final hidden states.

        tokens, positions, slots: (q,) long. `slots` are where their keys/values are written.
        visible: (q, kv_len) bool: which cache slots each token attends to (its own slot included). Every token sees
        the committed slots [0, length) (the callers' invariant; offspec's CUDA layers take them as a shared prefix).
        """
        q, kv_len = visible.shape
        self.cache.prepare(slots, kv_len, positions)
        if self.gpu_layers is not None:  # the CUDA layers read the pass's TailKeys, never a dense mask
            tail = self.gpu_layers.TailKeys.of(visible, min(self.cache.length, kv_len))
            with self.gpu_layers.active(tail):
                out = self.body(input_ids=tokens[None], position_ids=positions[None],
                                attention_mask=visible[None, None], use_cache=True, **{self._cache_arg: self.cache})
            return out.last_hidden_state[0]
        # each window's visible keys: {window: (q, kv_len) bool}, None the whole `visible`
        keys = self.cache.positions[:kv_len]
        visibles = {w: windowed(visible, positions, keys, w) for w in set(self.windows)}
        # a target's passes all run one path (exact attention either way); a draft's long passes run transformers'
        compiled = self.layers_unsupported is None and (self.exact or q <= COMPILED_MAX_TOKENS)
        if compiled:  # all the layers in one compiled call where the family allows (not where a layer streams)
            hidden = stack_forward(self.body, tokens, positions, self.cache, visibles)
            if hidden is not None:
                return hidden
        masks = {w: self._additive(v) for w, v in visibles.items()}  # (1, 1, q, kv_len) each
        if self._layer_types is None:
            mask = masks[self.windows[0]]
        else:  # one per layer type, as transformers' own masks for these models are given
            mask = {t: masks[w] for t, w in zip(self._layer_types, self.windows)}
        with exact_attention(self.exact), compiled_layers(visibles if compiled else None):
            out = self.body(input_ids=tokens[None], position_ids=positions[None], attention_mask=mask,
                            use_cache=True, **{self._cache_arg: self.cache})
        return out.last_hidden_state[0]

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """(1, 1, q, kv_len) additive mask in the model's dtype: 0 where visible, dtype-min elsewhere."""
        mask = torch.zeros((1, 1, *visible.shape), dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible[None, None], self._min)

    @functools.cached_property
    def head_is_row_invariant(self) -> bool:
        """Does the LM head give each row the same bits whatever the batch? offspec's compiled CPU kernels and its
        CUDA kernels (formats/gpu) do; a GEMM (cuBLAS, torch's CPU matmul) may round by batch shape. Fixed once the
        model is loaded."""
        if not isinstance(self.lm_head, QLinear):
            return False
        if self.device.type == "cuda":
            return cuda_kernels() == "triton"
        return self.device.type == "cpu" and kernels.compiled() is not None

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., vocab) logits; with a reduced head (`vocab_ids` set: a draft), (..., n) logits of
        the tokens `vocab_ids` (map an index i back with `token_ids`)."""
        logits = self.lm_head(hidden)
        if self.logit_softcap:  # tanh(logits / cap) * cap, as gemma2's forward does (each value from itself alone)
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    @functools.cached_property
    def vocab_size(self) -> int:
        """The width of `logits`' last dimension (the rows of the LM head)."""
        head = self.lm_head
        size = getattr(head, "out_features", None)
        return int(size) if size is not None else int(head.weight.shape[0])

    @property
    def vocab_ids(self) -> Optional[torch.Tensor]:
        """(n,) the token ids `logits` scores, in its order, for a reduced head; None for a whole one."""
        return None if self.subset_head is None else self.subset_head.token_ids

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Token ids of indices into `logits`' last dimension (the same where the head is whole)."""
        return indices if self.subset_head is None else self.subset_head.ids[indices]

    def forget_tokens(self) -> None:
        """A reduced head drops the rows it took for the conversation's tokens (a new session)."""
        if self.subset_head is not None:
            self.subset_head.forget()

    def refresh_tokens(self, kept: Sequence[int]) -> None:
        """The conversation changed and keeps the cached tokens `kept`: a reduced head more than half full of rows
        for earlier conversations' tokens starts over from these (later tokens are admitted as they come)."""
        head = self.subset_head
        if head is not None and head.n - head.static > (head.rows.shape[0] - head.static) // 2:
            head.forget()
            head.admit(kept)

    @torch.inference_mode()
    def extend(self, tokens: list[int], chunk: Optional[int] = None) -> torch.Tensor:
        """Append committed tokens causally (prefill / catch-up) in passes of `chunk` tokens (None: as
        `prefill_chunk` says); return the last token's hidden state (hidden,)."""
        hidden = None
        start = 0
        if self.subset_head is not None:
            self.subset_head.admit(tokens)  # tokens the conversation uses can be drafted from now on
        while start < len(tokens):
            base = self.cache.length
            size = chunk if chunk is not None else max(1, self.prefill_chunk(base, len(tokens) - start))
            part = tokens[start : start + size]
            start += len(part)
            q = len(part)
            ids = torch.tensor(part, dtype=torch.long, device=self.device)  # (q,)
            pos = torch.arange(base, base + q, device=self.device)  # (q,) slot == position for committed tokens
            visible = torch.ones((q, base + q), dtype=torch.bool, device=self.device)  # (q, base+q)
            if q > 1:  # causal among the new tokens (one token sees all)
                visible[:, base:] = torch.ones((q, q), dtype=torch.bool, device=self.device).tril()
            hidden = self.forward(ids, pos, pos, visible)[-1]
            self.cache.length = base + q
        return hidden
