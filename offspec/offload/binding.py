"""Pointing a decoder layer's parameters at a packed payload, and the forward hooks that stream it.

`ModelRunner` keeps calling `model.get_decoder()(...)` unchanged: a streamed layer's pre-hook acquires its
slot from the streamer and binds every parameter (and quantized buffer) as a view into that slot; its
post-hook puts the weightless placeholders back and releases the slot.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
from torch import nn

from offspec.formats.cpu_linear import _skinny_forward
from offspec.store.packed import LayerSpec, dtype_of


def as_compute(view: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """A parameter stored in another float dtype than the compute dtype (the float32 norms and biases of a weight
    store, bfloat16 compute) is converted: a small copy. Callers apply this to parameters only: buffers (low-bit
    blocks, NF4 scales) are used as they are stored."""
    if dtype is not None and view.is_floating_point() and view.dtype != dtype:
        return view.to(dtype)
    return view


class LayerBinding:
    """The tensors of one decoder layer, by owner module and attribute, with their place in a payload."""

    def __init__(self, layer: nn.Module, spec: LayerSpec, dtype: Optional[torch.dtype] = None):
        self.entries = []  # (store dict, attribute, offset, nbytes, dtype, shape, is a parameter)
        self.placeholders = []  # what the attribute held before binding (meta tensors)
        self.dtype = dtype  # the compute dtype
        for t in spec.tensors:
            owner_name, _, attr = t.name.rpartition(".")
            owner = layer.get_submodule(owner_name) if owner_name else layer
            store = owner._parameters if attr in owner._parameters else owner._buffers
            if attr not in store:
                raise KeyError(f"layer {spec.index} has no tensor {t.name}")
            self.entries.append((store, attr, t.offset, t.nbytes, dtype_of(t.dtype), torch.Size(t.shape),
                                 store is owner._parameters))
            self.placeholders.append(store[attr])

    @staticmethod
    def views(payload: torch.Tensor, spec: LayerSpec) -> dict[str, torch.Tensor]:
        """{tensor name: view into `payload`}."""
        return {t.name: payload[t.offset : t.offset + t.nbytes].view(dtype_of(t.dtype)).view(t.shape)
                for t in spec.tensors}

    def bind(self, payload: torch.Tensor) -> None:
        """Make the layer use views into `payload` ((nbytes,) uint8 on the compute device). No copies, except
        plain floats stored in another float dtype than the compute dtype (norms, biases: small)."""
        for store, attr, offset, nbytes, dtype, shape, param in self.entries:
            view = payload[offset : offset + nbytes].view(dtype).view(shape)
            store[attr] = as_compute(view, self.dtype) if param else view

    def unbind(self) -> None:
        for (store, attr, *_), placeholder in zip(self.entries, self.placeholders):
            store[attr] = placeholder


def attach_streaming(layer: nn.Module, index: int, streamer, binding: LayerBinding) -> list:
    """Forward hooks that stream `layer` through `streamer`; returns the hook handles."""

    def before(module, args):
        binding.bind(streamer.acquire(index))

    def after(module, args, output):
        binding.unbind()
        streamer.release(index)

    return [layer.register_forward_pre_hook(before), layer.register_forward_hook(after, always_call=True)]


def skinny_cpu_linears(layer: nn.Module) -> None:
    """The CPU engine's faster few-row matmul (offspec.formats.cpu_linear) for a layer whose weights are bound later."""
    for module in layer.modules():
        if isinstance(module, nn.Linear):
            module.forward = types.MethodType(_skinny_forward, module)
