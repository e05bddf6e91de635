"""`offspec serve`'s settings: one frozen dataclass, every default in one place. The CLI builds it by field name."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Optional

from offspec.errors import OffspecError

# where a reasoning model's reasoning goes (llama.cpp's names): "deepseek", apart in `reasoning_content`; "none", left
# in `content` as the model wrote it (markers included). A request's `reasoning_format` may choose the other.
REASONING_FORMATS = ("deepseek", "none")


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port (the one bound is printed at start)
    api_key: Optional[str] = None  # when set, every /v1 request needs `Authorization: Bearer <api_key>`
    insecure: bool = False  # allow a non-loopback host without an API key
    max_waiting: int = 8  # requests waiting behind the running one; one more gets 429 + Retry-After
    model_name: Optional[str] = None  # the model id clients use; None = the target's name
    shutdown_grace_seconds: float = 30.0  # Ctrl-C: how long the cancelled generation may take to end its pass
    reasoning_format: str = "deepseek"  # one of REASONING_FORMATS: the default of requests that do not say

    def validate(self) -> "ServeConfig":
        if not 0 <= self.port <= 65535:
            raise OffspecError(f"port must be in 0..65535, got {self.port}")
        if self.reasoning_format not in REASONING_FORMATS:
            raise OffspecError(f"reasoning format must be {' or '.join(REASONING_FORMATS)}, got "
                               f"{self.reasoning_format!r}")
        if self.max_waiting < 0:
            raise OffspecError(f"queue size must be >= 0, got {self.max_waiting}")
        if self.api_key is not None and not self.api_key.strip():
            raise OffspecError("the API key is empty; pass a non-empty --api-key or none")
        if self.api_key is None and not self.insecure and not is_loopback(self.host):
            raise OffspecError(f"refusing to serve on {self.host} without an API key: anyone on the network could "
                               f"use it; pass --api-key KEY (or set OFFSPEC_API_KEY), or --insecure to allow it")
        return self


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: it may resolve to any interface
