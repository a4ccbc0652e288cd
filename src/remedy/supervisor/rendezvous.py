"""The job's rendezvous store, owned by the supervisor, not by a rank.

A `torch.distributed.TCPStore` server runs in the supervisor actor's
process for the whole run. Generation N of the process group forms over
`PrefixStore(f"gen{N}", store)` (see `workers.membership`), so a rank that
dies, rank 0 included, takes no rendezvous state with it, and a
generation's keys never collide with the next one's.

A targeted restart whose attempt failed (a replacement died while the
group formed) serves a new store for its next attempt (`renew`): the
failed generation's keys name processes that are gone, and closing the old
store fails at once every rank still waiting on it in a rendezvous, which
would otherwise wait for the dead replacement's keys as long as a
collective may take (30 min). Those ranks then take the order to form the
next generation, which names the new store. A rank that gloo holds waiting
for a dead peer's connection is not freed by this (it waits on no store);
the recovery replaces it (`workers.phases.JOINING`).
"""

from __future__ import annotations

import datetime
from typing import Any

import ray
import torch.distributed as dist

from remedy.rank.group.membership import collective_timeout


class Rendezvous:
    """A TCPStore server on this node, on a port the OS picks."""

    def __init__(self, host: str | None = None) -> None:
        self.host = host or ray.util.get_node_ip_address()
        self._store: Any = self._serve()
        self.port = int(self._store.port)

    def _serve(self) -> Any:
        return dist.TCPStore(
            self.host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=max(collective_timeout(), datetime.timedelta(seconds=60)),
        )

    def renew(self) -> tuple[str, int]:
        """Serve a new store and close this one (its clients' waits fail at once); the new address."""
        self._store = self._serve()  # the old server stops as its last reference goes
        self.port = int(self._store.port)
        return self.address

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port
