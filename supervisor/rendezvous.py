"""The job's rendezvous store, owned by the supervisor, not by a rank.

A `torch.distributed.TCPStore` server runs in the supervisor actor's
process for the whole run. Generation N of the process group forms over
`PrefixStore(f"gen{N}", store)` (see `workers.membership`), so a rank that
dies, rank 0 included, takes no rendezvous state with it, and a
generation's keys never collide with the next one's.
"""

from __future__ import annotations

import datetime
from typing import Any

import ray
import torch.distributed as dist

from remedy.workers.membership import collective_timeout


class Rendezvous:
    """A TCPStore server on this node, on a port the OS picks."""

    def __init__(self, host: str | None = None) -> None:
        self.host = host or ray.util.get_node_ip_address()
        self._store: Any = dist.TCPStore(
            self.host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=max(collective_timeout(), datetime.timedelta(seconds=60)),
        )
        self.port = int(self._store.port)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port
