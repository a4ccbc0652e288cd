"""Every wait of a rank on one of its own helper threads has a bound and a named error.

A rank waits on its helpers at a few places: a durable checkpoint's write
(`CheckpointStore`, `DcpStore`), the shard mirror's exchange with the buddy
(`ShardMirror`), the snapshot-buffer pool of the Guard. Each goes through
`result` or `drain`, which raise `WaitTimeout` naming the wait and its bound,
so a stuck disk or peer fails the rank (which the supervisor then replaces)
instead of holding it forever. Waits on other processes are bounded elsewhere:
collectives and the rendezvous by the process group's timeout
(`REMEDY_COLLECTIVE_TIMEOUT_S`), reports and commands by the reporter's own
bounds. `tests/supervisor/test_waits.py` fails on a wait left without one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from remedy.rank.exceptions import WaitTimeout

T = TypeVar("T")

# A durable checkpoint's write and read-back (DCP's background save included).
CHECKPOINT_S = 600.0
# One exchange of a snapshot with the buddy rank (it runs beside the steps).
MIRROR_S = 300.0
# What a closing helper pool still has queued (snapshot buffers, say).
POOL_S = 60.0


def result(future: Future[T], timeout_s: float, what: str) -> T:
    """`future.result()` within `timeout_s`; `WaitTimeout` naming `what` past it."""
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise WaitTimeout(f"{what}: not done within {timeout_s:g}s") from None


def drain(pool: ThreadPoolExecutor, timeout_s: float, what: str) -> None:
    """Wait for what a one-thread pool has queued, within `timeout_s`, then shut it down."""
    with contextlib.suppress(RuntimeError):  # shut down already: nothing is queued behind it
        result(pool.submit(lambda: None), timeout_s, what)
    pool.shutdown(wait=False)
