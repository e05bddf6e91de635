"""A draft made from the target (`--draft self`) runs the target's resident layers as they are (SubSpec's scheme).

Its copies of the layers the placement keeps resident go once the layers are placed and before the target's layers
load (no moment holds both), and the target's very modules take their places after: the same weights, bits and
kernels (a draft's `kernels.as_draft` marks were made on the copies, never on them). The placement counted each
resident layer as its bytes less its copy's (`ModelSizes.shared_bytes`, `Placement.shared_layers`).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from offspec.errors import OffspecError

from .hostmem import trim_heap
from .placement import Placement


class LentLayers:
    def __init__(self, draft_model: Any, target_name: str, resident_bytes: Callable[[nn.Module], int], precise: bool):
        self.copies = draft_model.get_decoder().layers  # the draft's decoder layers: its copies, until lent
        self.copy_bytes = tuple(resident_bytes(c) for c in self.copies)  # (layers,) ModelSizes.shared_bytes
        self.target_name, self.precise = target_name, precise
        self.shared: tuple[int, ...] = ()  # the layers lent, once placed

    def on_placed(self, placement: Placement) -> None:
        """Let the copies of `placement.shared_layers` go (load_offloaded's `on_placed`)."""
        if len(placement.tiers) != len(self.copies):
            raise OffspecError(f"the self draft has {len(self.copies)} layers and {self.target_name} "
                               f"{len(placement.tiers)}: remove its copy (offspec models rm) and load again to build "
                               f"it anew")
        self.shared = placement.shared_layers
        for i in self.shared:
            self.copies[i] = nn.Identity()  # until the target's layer i has loaded; the copy's pages go with it
        trim_heap(self.precise)

    def lend(self, target_model: Any) -> None:
        """The target's own layer modules in the draft, where its copies were let go."""
        layers = target_model.get_decoder().layers
        for i in self.shared:
            self.copies[i] = layers[i]
