"""Type checks for values that come from JSON, YAML or Python callers.

Python counts True as the int 1, so `max_tokens=True` would pass a bare isinstance check and generate one token;
every config and request validator asks these instead.
"""
from __future__ import annotations

import math


def is_int(x: object) -> bool:
    """An integer, and not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """An int or float, and not a bool (NaN and infinities included)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_finite(x: object) -> bool:
    """A number that is neither NaN nor infinite. Every int is finite; math.isfinite would raise on one too
    large for a float."""
    return is_int(x) or (isinstance(x, float) and math.isfinite(x))
