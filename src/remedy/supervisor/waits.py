"""Every wait of the supervisor side on another process has a bound and a named error.

A peer that hangs (a stopped supervisor, spare or rank) must become an error
that the caller handles, not a stall: `get` is `ray.get` with a bound,
`within` is the same for an awaitable; both raise `WaitTimeout`, naming the
wait and its bound. `tests/supervisor/test_waits.py` reads every module of
`supervisor/` and fails on a `ray.get`, `ray.wait` or `asyncio.wait` without a
timeout, or an `asyncio.gather`, `Event.wait` or `await handle.method.remote(...)`
not inside a bounded wait (a `ray.get` of a reference `ray.wait` returned ready
is marked `# ready`; an actor call in a coroutine its caller bounds, `# caller
bounds`; one that lasts the run by design, `# whole run`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import ray

from remedy.protocol.exceptions import WaitTimeout

T = TypeVar("T")


def get(ref: Any, timeout_s: float, what: str) -> Any:
    """`ray.get(ref)` within `timeout_s`; `WaitTimeout` naming `what` past it."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise WaitTimeout(f"{what}: no answer within {timeout_s:g}s") from None


async def within(awaitable: Awaitable[T], timeout_s: float, what: str) -> T:
    """`await awaitable` within `timeout_s`; `WaitTimeout` naming `what` past it."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise WaitTimeout(f"{what}: no answer within {timeout_s:g}s") from None
