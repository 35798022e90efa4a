"""Spreads a burst of new requests over turns of the event loop.

Thousands of clients connecting at once make thousands of request tasks ready in the same loop turn; each
parses, validates and tokenizes its request before its first real wait, so that one turn lasts seconds and
nothing else (/health, chunks of running streams) runs until it ends. A LoopPacer lets at most `per_turn`
callers through per turn; the others wait in arrival order, doing nothing, and the loop polls its sockets
between turns."""
from __future__ import annotations

import asyncio
from collections import deque


class LoopPacer:
    def __init__(self, per_turn: int) -> None:
        self.per_turn = per_turn
        self._waiters: deque[asyncio.Future] = deque()
        self._passed = 0            # callers let through since the last turn began
        self._scheduled = False     # a _next_turn callback is pending

    async def turn(self) -> None:
        """Return now if this turn has room and nobody is queued, else on a later turn, in FIFO order."""
        loop = asyncio.get_running_loop()
        if self._passed < self.per_turn and not self._waiters:
            self._passed += 1
            self._schedule(loop)
            return
        fut = loop.create_future()
        self._waiters.append(fut)
        self._schedule(loop)
        try:
            await fut
        except asyncio.CancelledError:
            if not fut.done():
                self._waiters.remove(fut)
            raise

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        # A callback scheduled now runs on the loop's next turn, after it has polled its sockets.
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._next_turn, loop)

    def _next_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled = False
        self._passed = 0
        while self._waiters and self._passed < self.per_turn:
            fut = self._waiters.popleft()
            if not fut.done():  # a cancelled waiter gives its place to the next
                fut.set_result(None)
                self._passed += 1
        if self._waiters or self._passed:
            self._schedule(loop)
