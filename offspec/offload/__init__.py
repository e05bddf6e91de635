"""Offloading: run a target bigger than the device by streaming its decoder layers from RAM or SSD.

- config.py     the user's offloading options read into an OffloadConfig (offspec.config), memory constants
- estimates.py  KV-cache and activation headroom from a model config
- placement.py  Placement: each decoder layer on the device, in (pinned) RAM or on SSD, under the budgets
- quant.py      NF4 / int8 weights through bitsandbytes, and the QuantLinear that computes with them
- hostmem.py    page-aligned host buffers of exact size, pinned with cudaHostRegister, unpinned when freed
- diskio.py     O_DIRECT reads into those buffers (buffered where a file system refuses O_DIRECT)
- streams.py    device-generic copy stream and events (CUDA streams; synchronous shims on CPU)
- streamer.py   LayerStreamer: ring of device slots, copier and SSD read-ahead threads, io counters
- binding.py    forward hooks binding a layer's parameters to views into its slot
- head.py       StreamedHead: a CPU's LM head read from SSD in row chunks in every pass, where the budget is short
- checkpoint.py reading the original safetensors a few tensors at a time
- model.py      load_offloaded / load_offloaded_pair: what offspec.load calls
- prefill.py    how many prompt tokens one prefill pass of a streamed target may hold

The packed per-layer files it streams are offspec/store/packed.py; sizes ("22GB" -> bytes) are offspec/util/sizes.py;
`offspec bench offload` is offspec/cli/bench_offload.py.
"""

from offspec.util.sizes import format_size, parse_size

from .config import OffloadConfig

__all__ = ["OffloadConfig", "format_size", "parse_size"]
