"""The supervisor process's garbage collector, tuned for a heap of long-lived objects.

The supervisor actor calls `quiet_gc` once it is built: what it holds then
is frozen, and the youngest generation is collected far less often than
CPython's default (see the function for the measured why).
"""

from __future__ import annotations

import gc

# The supervisor's collector: the youngest generation is collected after this many net
# allocations (CPython's default is 700). See `quiet_gc`.
GC_YOUNG = 50_000


def quiet_gc() -> None:
    """Fewer, cheaper garbage collections in the supervisor's process.

    Each report allocates thousands of short-lived objects (the batch Ray
    unpickled, its validated records, the reply), while the process holds a
    large heap of long-lived ones (Ray's worker state, the controller's
    per-rank maps, the journaled decisions). At CPython's default thresholds
    the collections that walk that heap cost more than the reports: through
    node agents at 4,096 simulated ranks, 2.0 ms of CPU per agent call with the
    defaults, 0.85 ms at these (`benchmarks/supervisor_load.py --agents
    --profile 4096`). Objects alive once the supervisor is built are frozen
    (never walked again), and the youngest generation is collected every
    `GC_YOUNG` allocations; reference counting still frees everything that
    is not in a cycle at once, so memory does not grow with the threshold.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG, older, oldest)
