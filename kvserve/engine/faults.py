"""Fault injection, for crash-recovery tests and drills; inert unless its environment variable is set.

KVSERVE_FAULT_CRASH_ON_TOKEN=<token id>: the engine process kills itself with SIGKILL (as the OOM killer
would: no cleanup, no goodbye message) when it receives a request whose prompt contains that token id.
Only the engine *process* reads it (never the thread mode, which would take the server down with it).
"""
from __future__ import annotations

import os
import signal

ENV_CRASH_ON_TOKEN = "KVSERVE_FAULT_CRASH_ON_TOKEN"


def crash_token() -> int | None:
    value = os.environ.get(ENV_CRASH_ON_TOKEN)
    return int(value) if value else None


def maybe_crash(prompt_token_ids: list[int], token: int | None) -> None:
    if token is not None and token in prompt_token_ids:
        os.kill(os.getpid(), signal.SIGKILL)
