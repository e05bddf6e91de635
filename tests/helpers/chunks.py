"""Fake chunk packages of the default pair: files laid out as installed packages `<module>N/data/partNN.bin`,
each with an `__init__.py` that fails if anything imports it (offspec must only locate them)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Sequence

from offspec.models import default_pair
from offspec.models.default_pair import ChunkedModel


def chunk_packages(site: Path, data: bytes, *, module_prefix: str = "fakechunk_part",
                   sizes: Optional[Sequence[int]] = None) -> list[Path]:
    """Split `data` into chunk files under `site` (in order; `sizes` default: three near-equal parts)."""
    if sizes is None:
        third = -(-len(data) // 3)
        sizes = [min(third, max(len(data) - i * third, 0)) for i in range(3)]
    assert sum(sizes) == len(data), (sizes, len(data))
    paths, start = [], 0
    for i, size in enumerate(sizes, start=1):
        path = site / f"{module_prefix}{i}" / "data" / f"part{i:02d}.bin"
        path.parent.mkdir(parents=True)
        (path.parent.parent / "__init__.py").write_text("raise RuntimeError('chunk packages must not be imported')\n")
        path.write_bytes(data[start:start + size])
        start += size
        paths.append(path)
    return paths


def chunked_spec(data: bytes, count: int, *, role: str = "draft", name: str = "Fake Model", stem: str = "fake-model",
                 dist_prefix: str = "fakechunk-part") -> ChunkedModel:
    """A ChunkedModel for `data` split into `count` packages named `<dist_prefix>N` (no Hub pin)."""
    return default_pair._chunked(role, name, stem, dist_prefix, count, "1.0", len(data),
                                 hashlib.sha256(data).hexdigest())


def make_chunks(root: Path, sizes=(1000, 2500, 7)) -> tuple[ChunkedModel, list[Path]]:
    """Fake chunk files of pseudo-random content laid out like installed packages `fakechunk_partN/data/partNN.bin`."""
    data = b"".join((hashlib.sha256(f"chunk{i}".encode()).digest() * (size // 32 + 1))[:size]
                    for i, size in enumerate(sizes, start=1))
    return chunked_spec(data, len(sizes)), chunk_packages(root, data, sizes=sizes)
