"""What the gateway asks when a client sends `model: "auto"`: which of the two configured models serves it."""
from __future__ import annotations

from typing import Literal, Protocol


class AutoRouter(Protocol):
    def choose(self, prompt_text: str) -> Literal["small", "large"]: ...
