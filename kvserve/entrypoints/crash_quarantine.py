"""Requests that keep crashing the engine are refused.

The server never resubmits a request on its own: a request in flight when the engine dies fails with 503
(clients may retry). A request that was in flight at `max_crashes` engine deaths is then refused with 400,
so a request that crashes the engine (a kernel bug on some input, say) can take it down at most that many
times however often clients resend it. Requests are recognised by a digest of their prompt tokens and
sampling parameters; the table is bounded (oldest entries forgotten first).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

import msgspec

from kvserve.sampling_params import SamplingParams

_encoder = msgspec.msgpack.Encoder()


def request_fingerprint(prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None) -> bytes:
    return hashlib.sha256(_encoder.encode((prompt_token_ids, params, cache_salt))).digest()


class CrashQuarantine:
    def __init__(self, max_crashes: int = 2, capacity: int = 4096) -> None:
        self.max_crashes = max_crashes
        self.capacity = capacity
        self._crashes: OrderedDict[bytes, int] = OrderedDict()   # fingerprint -> engine deaths it was in flight at

    def note_crash(self, in_flight: Iterable[bytes]) -> None:
        for fp in set(in_flight):
            self._crashes[fp] = self._crashes.get(fp, 0) + 1
            self._crashes.move_to_end(fp)
        while len(self._crashes) > self.capacity:
            self._crashes.popitem(last=False)

    def crashes(self, fp: bytes) -> int:
        return self._crashes.get(fp, 0)

    def is_quarantined(self, fp: bytes) -> bool:
        return self.crashes(fp) >= self.max_crashes
