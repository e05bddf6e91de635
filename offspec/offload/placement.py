"""Placing the target's decoder layers under a device budget and a host RAM budget.

Tiers, best first: "device" (resident), "ram" (a host copy, pinned on CUDA, copied in every pass), "ssd"
(the packed file, read ahead every pass). Embeddings, final norm, LM head, the KV caches, the activations
of the largest tree and the whole draft are resident and charged to the device budget first, then a ring of
slots for streamed layers; what is left holds resident layers. Resident and RAM layers are spread evenly
over the depth so that the link keeps streaming while resident layers compute. On a CPU, SSD files are read
straight into the slots (offspec.offload.streamer): each slot then holds a whole packed file, and the staging
budget buys more slots.

On a CPU device the host RAM *is* the device: the device budget caps all of offspec's process memory
(slots, SSD staging buffers and the Python runtime measured at load included: `ModelSizes.workspace_bytes`);
the RAM tier is only used when a RAM budget is given. Where the resident parts do not fit even with every layer
streamed, a CPU streams the LM head too (offspec/offload/head.py: `OffloadConfig.stream_head`), in chunks through
two read buffers, like one more layer.

A mixture of experts whose layers do not fit: every layer's dense part (attention, norms, router, a shared
expert) is resident, and its experts go into one expert cache on the device that holds what the budget has left,
when that is at least one layer's experts, as the router picks them. They come from host RAM where the RAM budget
holds all of them (pinned on CUDA, copied over the link: offspec/offload/ram_experts.py), else, on a CPU, from SSD
(offspec/offload/experts.py). Otherwise (a GPU whose RAM budget cannot hold the experts) its layers stream whole
like any other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

from offspec.errors import OffspecError
from offspec.store.packed import HEADER
from offspec.util.sizes import format_size

from .config import ASSUMED_BANDWIDTH, CPU_HEADROOM, FREE_FRACTION, HOST_RESERVE, OffloadConfig
from .hostmem import page_round

TIERS = ("device", "ram", "ssd")


@dataclass(frozen=True)
class ModelSizes:
    """Bytes that decide a placement (compute dtype, layers in their packed format)."""

    layer_bytes: tuple[int, ...]  # per decoder layer, as streamed (packed payload)
    file_bytes: int  # the largest packed layer file (header and padding included): one SSD staging buffer
    other_bytes: int  # embeddings, final norm, LM head
    kv_bytes: int  # the target's KV cache at full capacity
    activation_bytes: int  # the largest tree's activations (estimate)
    extra_bytes: int = 0  # other resident things: the draft's weights, KV cache and activations
    workspace_bytes: int = 0  # allocator slack, kernel workspaces, Python objects (config.WORKSPACE; on a CPU
    # also the process's anonymous memory measured at load: Python, torch, transformers, the tokenizer)
    head_bytes: int = 0  # the LM head's part of other_bytes, where it may be streamed instead (0: it may not)
    head_buffer_bytes: int = 0  # one of the two read buffers a streamed head needs
    headroom_bytes: int = 0  # a CPU budget given: the share of it left unplanned (config.CPU_HEADROOM)
    # per decoder layer, the draft's bytes that go where the layer is resident (a draft made from the target runs
    # the target's resident layers instead of its copies of them: `Placement.shared_layers`); () for other drafts
    shared_bytes: tuple[int, ...] = ()
    # a mixture of experts: per decoder layer the bytes of its experts (the payload past its dense part: 0 for a
    # dense layer), the largest expert's range (page-rounded: one expert cache slot) and the most experts a layer has
    expert_bytes: tuple[int, ...] = ()
    expert_unit: int = 0
    experts_per_layer: int = 0
    experts_used: int = 0  # experts a token is routed to in each layer (the predicted pass reads that many)

    @property
    def dense_bytes(self) -> tuple[int, ...]:
        """Per decoder layer, its bytes without its experts (a dense layer's: all of them)."""
        if not self.expert_bytes:
            return self.layer_bytes
        return tuple(b - e for b, e in zip(self.layer_bytes, self.expert_bytes))


@dataclass(frozen=True)
class Placement:
    device: str  # "cuda" or "cpu" (the device type)
    tiers: tuple[str, ...]  # per decoder layer: "device" | "ram" | "ssd"
    sizes: ModelSizes
    device_budget: int
    ram_budget: int
    ring_bytes: int  # device slots for streamed layers (0 when nothing streams)
    staging_bytes: int  # host buffers for SSD reads (0 when nothing is on SSD)
    quant: str = "none"
    budget_source: str = "given"  # "given" or "free memory"
    bandwidth: dict = field(default_factory=dict)  # assumed bytes/s (link, disk, memory) for the prediction
    head_streamed: bool = False  # the LM head is read from SSD in every pass (offspec/offload/head.py)
    shares: bool = False  # a draft made from the target runs the resident layers as the target's own
    # a mixture of experts: the bytes of the expert cache its experts are read into as routed (0: none; then every
    # resident layer holds its experts), and the host RAM that holds all its experts for it (0: they come from SSD)
    expert_cache_bytes: int = 0
    expert_host_bytes: int = 0

    @property
    def experts_cached(self) -> bool:
        return self.expert_cache_bytes > 0

    @property
    def placed_bytes(self) -> tuple[int, ...]:
        """Per decoder layer, the bytes its tier holds: a layer whose experts are cached holds its dense part."""
        return self.sizes.dense_bytes if self.experts_cached else self.sizes.layer_bytes

    @property
    def shared_layers(self) -> tuple[int, ...]:
        """The layers a draft made from the target runs as the target's own, not its copies: the resident ones,
        where the target does not fit whole beside the copy (one that does keeps the copy: it drafts cheaper)."""
        return tuple(i for i, t in enumerate(self.tiers) if t == "device") if self.shares else ()

    @property
    def shared_bytes(self) -> int:
        """The draft's bytes it lets go for `shared_layers`."""
        return sum(self.sizes.shared_bytes[i] for i in self.shared_layers)

    def count(self, tier: str) -> int:
        return sum(t == tier for t in self.tiers)

    def bytes_in(self, tier: str) -> int:
        return sum(b for t, b in zip(self.tiers, self.placed_bytes) if t == tier)

    @property
    def streams(self) -> bool:
        return any(t != "device" for t in self.tiers)

    @property
    def streamed_head_bytes(self) -> int:
        """LM head bytes read from SSD in every pass (0 when the head is resident)."""
        return self.sizes.head_bytes if self.head_streamed else 0

    @property
    def bytes_per_pass(self) -> int:
        """Weight bytes moved to the device in every forward pass."""
        return self.bytes_in("ram") + self.bytes_in("ssd") + self.streamed_head_bytes

    @property
    def resident_bytes(self) -> int:
        return resident_total(self.sizes, self.head_streamed)

    @property
    def device_bytes(self) -> int:
        """Planned use of the device budget."""
        host_is_device = self.device == "cpu"
        return (self.resident_bytes + self.bytes_in("device") - self.shared_bytes + self.ring_bytes
                + (self.staging_bytes if host_is_device else 0) + self.expert_cache_bytes)

    def device_breakdown(self) -> dict[str, int]:
        """What the planned device bytes are made of (the values sum to `device_bytes`; zero parts left out)."""
        s, host_is_device = self.sizes, self.device == "cpu"
        head_buffers = 2 * s.head_buffer_bytes if self.head_streamed else 0
        draft = "draft" if not self.shares else f"draft (its copies of {len(self.shared_layers)} layers: the target's)"
        layers = f"{self.count('device')} layers" + (" (their dense parts)" if self.experts_cached else "")
        parts = {layers: self.bytes_in("device"), "expert cache": self.expert_cache_bytes,
                 draft: s.extra_bytes - self.shared_bytes,
                 "embeddings and LM head" if not self.head_streamed else "embeddings and norms":
                     s.other_bytes - self.streamed_head_bytes,
                 "KV cache and activations": s.kv_bytes + s.activation_bytes,
                 "streaming slots": self.ring_bytes + (self.staging_bytes if host_is_device else 0) + head_buffers,
                 "workspace": s.workspace_bytes, "headroom": s.headroom_bytes}
        return {name: n for name, n in parts.items() if n > 0}

    @property
    def host_bytes(self) -> int:
        """Planned use of the RAM budget (a RAM-tier layer holds its whole packed file: `ram_bytes`)."""
        ram = sum(ram_bytes(b) for t, b in zip(self.tiers, self.sizes.layer_bytes) if t == "ram")
        return ram + (0 if self.device == "cpu" else self.staging_bytes) + self.expert_host_bytes

    @property
    def predicted_pass_seconds(self) -> float:
        """Small-tree pass time: the larger of moving the streamed weights and reading every weight once."""
        bw = self.bandwidth or ASSUMED_BANDWIDTH.get(self.device, ASSUMED_BANDWIDTH["cpu"])
        stream = max(self.bytes_per_pass / bw["link"], (self.bytes_in("ssd") + self.streamed_head_bytes) / bw["disk"])
        routed = len(self.tiers) * self.sizes.experts_used * self.sizes.expert_unit if self.experts_cached else 0
        compute = (sum(self.placed_bytes) + routed + self.sizes.other_bytes) / bw["memory"]  # a one-token pass
        return max(stream, compute)

    def summary(self) -> dict:
        """JSON-friendly view (ModelInfo.extra["placement"])."""
        return {
            "device": self.device, "quant": self.quant, "budget_source": self.budget_source,
            "layers": {t: self.count(t) for t in TIERS}, "tiers": list(self.tiers),
            "device_budget": self.device_budget, "ram_budget": self.ram_budget,
            "device_bytes": self.device_bytes, "host_bytes": self.host_bytes,
            "resident_bytes": self.resident_bytes, "ring_bytes": self.ring_bytes, "staging_bytes": self.staging_bytes,
            "bytes_per_pass": self.bytes_per_pass, "predicted_pass_seconds": round(self.predicted_pass_seconds, 4),
            "head_streamed": self.head_streamed, "shared_layers": len(self.shared_layers),
            "expert_cache_bytes": self.expert_cache_bytes, "expert_host_bytes": self.expert_host_bytes,
            "assumed_bandwidth": dict(self.bandwidth), "sizes": asdict(self.sizes),
            "device_breakdown": self.device_breakdown(),
        }

    def describe(self) -> str:
        """One line for the progress display."""
        n = len(self.tiers)
        where = f"{self.count('device')}/{n} layers on {self.device}"
        if self.streams:
            where += f", {self.count('ram')} from RAM, {self.count('ssd')} from SSD"
        if self.head_streamed:
            where += ", LM head from SSD"
        if self.experts_cached:
            where += f", experts from {'RAM' if self.expert_host_bytes else 'SSD'} as routed"
        fmt = "" if self.quant == "none" else f" ({self.quant})"
        t = self.predicted_pass_seconds
        when = f"{t:.2f} s" if t >= 1 else f"{t * 1000:.3g} ms"
        parts = ", ".join(f"{name} {format_size(n)}" for name, n in self.device_breakdown().items())
        return (f"placement: {where}{fmt}; {format_size(self.bytes_per_pass)} per pass, predicted {when} per pass; "
                f"device {format_size(self.device_bytes)} of {format_size(self.device_budget)} ({parts})")


def _suggest_budget(need: int, sizes: ModelSizes) -> str:
    """The --device-mem that holds `need` planned bytes, where `need` counts the headroom of the budget tried and a
    larger budget has a larger headroom."""
    if sizes.headroom_bytes:
        need = math.ceil((need - sizes.headroom_bytes) / (1 - CPU_HEADROOM))
    return _suggest(need)


def _suggest(n: float) -> str:
    """A size flag value >= n (rounded up to 3 significant digits), e.g. "3.22MB"."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1)):
        if n >= scale or unit == "B":
            value = n / scale
            digits = max(0, 2 - int(math.floor(math.log10(value)))) if value > 0 else 0
            return f"{math.ceil(value * 10**digits) / 10**digits:g}{unit}"
    return f"{int(n)}B"


def _draft_hint(sizes: ModelSizes) -> str:
    """The end of a too-small-budget message where a resident draft takes part of the budget."""
    if sizes.extra_bytes <= 0:
        return ""
    return (f" (the draft takes {format_size(sizes.extra_bytes)} of them: a smaller --draft-vocab frees some, "
            f"--draft none all)")


def ram_bytes(payload: int) -> int:
    """Host bytes a RAM-tier layer really takes (and pins on CUDA): its packed file (header + payload padded
    to 4 KiB), page-rounded (offspec.offload.hostmem allocates whole pages, never powers of two)."""
    return page_round(HEADER + -(-payload // HEADER) * HEADER)


def spread(n: int, k: int) -> list[int]:
    """k indices of range(n), evenly spaced (k <= n)."""
    return [int((i + 0.5) * n / k) for i in range(k)] if k > 0 else []


def stream_buffers(sizes: ModelSizes, config: OffloadConfig, host_is_device: bool, has_ssd: bool) -> tuple[int, int]:
    """(ring bytes, staging bytes) the streamer allocates. On a CPU with layers on SSD it reads the files into
    the slots (ring_slots + staging_buffers of them, a page-rounded file each); the split is kept for reports."""
    if host_is_device and has_ssd:
        file = page_round(sizes.file_bytes)
        return config.ring_slots * file, config.staging_buffers * file
    staging = max(1, config.staging_buffers) * page_round(sizes.file_bytes) if has_ssd else 0
    return config.ring_slots * max(sizes.layer_bytes), staging


def _fit(sizes: list[int], candidates: list[int], room: int) -> list[int]:
    """The most evenly spread subset of `candidates` (indices into sizes) whose bytes fit in `room`."""
    k = len(candidates)
    while k > 0:
        chosen = [candidates[i] for i in spread(len(candidates), k)]
        if sum(sizes[i] for i in chosen) <= room:
            return chosen
        k -= 1
    return []


def default_budgets(device: torch.device, already_allocated: int = 0) -> tuple[int, int]:
    """(device budget, RAM budget) from what is free now; `already_allocated` (e.g. the draft) is added back."""
    import psutil

    available = psutil.virtual_memory().available
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)  # sync-free driver query
        return int(free * FREE_FRACTION) + already_allocated, int(max(0, available - HOST_RESERVE) * FREE_FRACTION)
    # CPU: host RAM is the device; streamed layers come from SSD unless a RAM budget is given
    return int(available * FREE_FRACTION) + already_allocated, 0


def resident_total(sizes: ModelSizes, head_streamed: bool) -> int:
    """Bytes charged to the device budget before any layer: a streamed head's two read buffers instead of it."""
    head = sizes.head_bytes - 2 * sizes.head_buffer_bytes if head_streamed else 0
    return (sizes.other_bytes - head + sizes.kv_bytes + sizes.activation_bytes + sizes.extra_bytes
            + sizes.workspace_bytes + sizes.headroom_bytes)


def plan_placement(sizes: ModelSizes, device: torch.device, config: OffloadConfig,
                   already_allocated: int = 0) -> Placement:
    """Place every decoder layer, and on a CPU the LM head (streamed where config.stream_head says "always", or
    "auto" and the resident parts do not fit with it); a budget too small is a one-line OffspecError."""
    streamable = device.type == "cpu" and sizes.head_bytes > 0
    if streamable and config.stream_head == "always":
        return _plan(sizes, device, config, already_allocated, head_streamed=True)
    try:
        return _plan(sizes, device, config, already_allocated, head_streamed=False)
    except OffspecError:
        if not streamable or config.stream_head != "auto":
            raise
    return _plan(sizes, device, config, already_allocated, head_streamed=True)


def _plan(sizes: ModelSizes, device: torch.device, config: OffloadConfig, already_allocated: int,
          head_streamed: bool) -> Placement:
    dev_default = ram_default = 0
    if config.device_mem is None or config.ram_mem is None:
        dev_default, ram_default = default_budgets(device, already_allocated)
    device_budget = config.device_mem if config.device_mem is not None else dev_default
    ram_budget = config.ram_mem if config.ram_mem is not None else ram_default
    source = "given" if config.device_mem is not None else "free memory"
    host_is_device = device.type == "cpu"
    layer = list(sizes.layer_bytes)
    n = len(layer)
    # what a resident layer costs the budget: its bytes, less the draft's copy of it that then goes (a self draft)
    net = [b - c for b, c in zip(layer, sizes.shared_bytes)] if sizes.shared_bytes else layer
    resident = resident_total(sizes, head_streamed)
    base = dict(device=device.type, sizes=sizes, device_budget=device_budget, ram_budget=ram_budget,
                quant=config.quant, budget_source=source, head_streamed=head_streamed,
                bandwidth=dict(ASSUMED_BANDWIDTH.get(device.type, ASSUMED_BANDWIDTH["cpu"])))

    if resident + sum(layer) <= device_budget:  # a self draft keeps its whole copy then
        return Placement(tiers=("device",) * n, ring_bytes=0, staging_bytes=0, **base)
    base["shares"] = bool(sizes.shared_bytes)
    if resident + sum(net) <= device_budget:  # whole only where the self draft runs the target's own layers
        return Placement(tiers=("device",) * n, ring_bytes=0, staging_bytes=0, **base)
    cache, held = (_expert_cache(sizes, device_budget - resident, ram_budget, host_is_device)
                   if config.experts == "auto" else (0, 0))
    if cache:  # a mixture: the dense parts resident, the experts read as routed into what is left
        return Placement(tiers=("device",) * n, ring_bytes=0, staging_bytes=0, expert_cache_bytes=cache,
                         expert_host_bytes=held, **{**base, "shares": False})

    ring, _ = stream_buffers(sizes, config, host_is_device, has_ssd=False)  # RAM-tier layers only
    ssd_ring, staging = stream_buffers(sizes, config, host_is_device, has_ssd=True)  # some layers on SSD
    room = device_budget - resident - ring
    if room < 0:
        need = _least(resident + (ssd_ring + staging if host_is_device and ram_budget < sum(layer) else ring),
                      sizes, resident, config, host_is_device, ram_budget)
        raise OffspecError(
            f"device memory budget {format_size(device_budget)} is too small: the resident parts need "
            f"{format_size(resident)} (embeddings, LM head, KV caches, activations, draft, workspace, headroom) plus "
            f"{format_size(ring)} for {config.ring_slots} streaming slots; use --device-mem "
            f"{_suggest_budget(need, sizes)} or more, or lower --max-context / --max-budget{_draft_hint(sizes)}")
    everything = list(range(n))

    host = [ram_bytes(b) for b in layer]  # what each layer would really take in RAM

    def place(dev_room: int, ram_room: int) -> tuple[list[int], list[int]]:
        on_device = _fit(net, everything, dev_room)
        rest = [i for i in everything if i not in on_device]
        return on_device, _fit(host, rest, ram_room)

    on_device, in_ram = place(room, ram_budget)
    if len(on_device) + len(in_ram) < n:  # some layers go to SSD: staging buffers are needed
        if host_is_device:
            room -= staging + ssd_ring - ring
            if room < 0:
                least = _least(resident + ssd_ring + staging, sizes, resident, config, True, ram_budget)
                raise OffspecError(
                    f"device memory budget {format_size(device_budget)} is too small: resident parts, streaming "
                    f"slots and SSD staging buffers need {format_size(resident + ssd_ring + staging)}; use "
                    f"--device-mem {_suggest_budget(least, sizes)} or more, "
                    f"give a --ram-mem for the streamed layers, or lower --max-context / --max-budget"
                    f"{_draft_hint(sizes)}")
            on_device, in_ram = place(room, ram_budget)
        else:
            if ram_budget < staging:
                raise OffspecError(
                    f"RAM budget {format_size(ram_budget)} is too small for the SSD staging buffers "
                    f"({format_size(staging)}); use --ram-mem {_suggest(staging)} or more")
            on_device, in_ram = place(room, ram_budget - staging)
    tiers = tuple("device" if i in on_device else "ram" if i in in_ram else "ssd" for i in range(n))
    ring, staging = stream_buffers(sizes, config, host_is_device, has_ssd="ssd" in tiers)
    return Placement(tiers=tiers, ring_bytes=ring, staging_bytes=staging, **base)


def _least(need: int, sizes: ModelSizes, resident: int, config: OffloadConfig, host_is_device: bool,
           ram_budget: int) -> int:
    """The smaller of `need` (layers streamed whole) and what a mixture's experts read as routed need: the dense
    parts and one layer's experts beside the resident parts."""
    if config.experts != "auto" or not _reads_experts(sizes, host_is_device, ram_budget):
        return need
    return min(need, resident + sum(sizes.dense_bytes) + sizes.experts_per_layer * sizes.expert_unit)


def expert_host_bytes(sizes: ModelSizes) -> int:
    """Host RAM that holds all of a mixture's experts: each layer's in one buffer of whole pages."""
    return sum(page_round(b) for b in sizes.expert_bytes if b)


def _reads_experts(sizes: ModelSizes, host_is_device: bool, ram_budget: int) -> bool:
    """Can this model's experts be read as routed: a mixture, on a CPU (from SSD or RAM) or where the RAM budget
    holds all its experts (a GPU copies them from there), not sharing its layers with a draft made from it (not
    yet)."""
    if not sizes.expert_unit or sizes.shared_bytes:
        return False
    return host_is_device or expert_host_bytes(sizes) <= ram_budget


def _expert_cache(sizes: ModelSizes, room: int, ram_budget: int, host_is_device: bool) -> tuple[int, int]:
    """(expert cache bytes, host bytes of the experts) of a mixture whose dense parts are all resident in `room`:
    the cache is what is left of it, in whole slots (`expert_unit`), and the experts are held in RAM where
    `ram_budget` holds them all (0: read from SSD); (0, 0) where the cache would be less than one layer's experts,
    or its experts cannot be read as routed (`_reads_experts`)."""
    if not _reads_experts(sizes, host_is_device, ram_budget):
        return 0, 0
    slots = (room - sum(sizes.dense_bytes)) // sizes.expert_unit
    if slots < sizes.experts_per_layer:
        return 0, 0
    held = expert_host_bytes(sizes)
    return slots * sizes.expert_unit, held if held <= ram_budget else 0


def forced(sizes: ModelSizes, device: torch.device, tiers: tuple[str, ...], config: OffloadConfig) -> Placement:
    """A placement with the given tiers (tests and benchmarks); budgets are reported as planned use."""
    ring, staging = stream_buffers(sizes, config, device.type == "cpu", has_ssd="ssd" in tiers)
    p = Placement(device=device.type, tiers=tiers, sizes=sizes, device_budget=0, ram_budget=0,
                  ring_bytes=ring if any(t != "device" for t in tiers) else 0, staging_bytes=staging,
                  quant=config.quant, budget_source="forced",
                  bandwidth=dict(ASSUMED_BANDWIDTH.get(device.type, ASSUMED_BANDWIDTH["cpu"])))
    return replace(p, device_budget=p.device_bytes, ram_budget=p.host_bytes)
