"""Pointing a decoder layer's parameters at a packed payload, and the forward hooks that stream it.

`ModelRunner` keeps calling `model.get_decoder()(...)` unchanged: a streamed layer's pre-hook acquires its
slot from the streamer and binds every parameter (and quantized buffer) as a view into that slot; its
post-hook puts the weightless placeholders back and releases the slot.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from .packed import LayerSpec, dtype_of


class LayerBinding:
    """The tensors of one decoder layer, by owner module and attribute, with their place in a payload."""

    def __init__(self, layer: nn.Module, spec: LayerSpec):
        self.entries = []  # (store dict, attribute, offset, nbytes, dtype, shape)
        self.placeholders = []  # what the attribute held before binding (meta tensors)
        for t in spec.tensors:
            owner_name, _, attr = t.name.rpartition(".")
            owner = layer.get_submodule(owner_name) if owner_name else layer
            store = owner._parameters if attr in owner._parameters else owner._buffers
            if attr not in store:
                raise KeyError(f"layer {spec.index} has no tensor {t.name}")
            self.entries.append((store, attr, t.offset, t.nbytes, dtype_of(t.dtype), torch.Size(t.shape)))
            self.placeholders.append(store[attr])

    def bind(self, payload: torch.Tensor) -> None:
        """Make the layer use views into `payload` ((nbytes,) uint8 on the compute device). No copies."""
        for store, attr, offset, nbytes, dtype, shape in self.entries:
            store[attr] = payload[offset : offset + nbytes].view(dtype).view(shape)

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
    """The CPU engine's faster few-row matmul (offspec.cpu_linear) for a layer whose weights are bound later."""
    from ..cpu_linear import _skinny_forward

    for module in layer.modules():
        if isinstance(module, nn.Linear):
            module.forward = types.MethodType(_skinny_forward, module)
