"""Memory sizes as people write them: "22GB", "512MiB", "1.5g", "0", "4096" (bytes)."""

from __future__ import annotations

import re
from typing import Optional

from offspec.errors import OffspecError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-zA-Z]*)\s*$")


def parse_size(text: object, what: str = "size") -> int:
    """Bytes from "22GB" (10^9), "512MiB" (2^20), "1.5g", "0" or a plain integer. Raises a one-line OffspecError."""
    if isinstance(text, bool):
        raise OffspecError(f"{what} must be a size like 22GB or 512MiB, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        unit = match["unit"].lower() if match else None
        if match is None or unit not in _UNITS:
            flag = "--" + what.replace("_", "-")
            raise OffspecError(f"cannot read {what} {text!r}: use a size like 22GB, 512MiB or 0 "
                               f"(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. {flag} 8GB")
        value = int(float(match["num"]) * _UNITS[unit])
    if value < 0:
        raise OffspecError(f"{what} must not be negative, got {text!r}")
    return value


def parse_optional_size(text: Optional[object], what: str) -> Optional[int]:
    return None if text is None else parse_size(text, what)


def format_size(n: float) -> str:
    """Human bytes in powers of 1000: 1.23 GB, 512 MB, 4 KB, 12 B."""
    n = float(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"
