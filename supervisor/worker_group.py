"""The ranks of one job as Ray actors: start them, join their process group, stop them."""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from remedy.supervisor.rank import RankActor
from remedy.supervisor.spec import RunSpec


class WorkerGroup:
    def __init__(self, spec: RunSpec, *, supervisor: Any) -> None:
        self.spec = spec
        self.supervisor = supervisor
        self.actors: dict[int, Any] = {}
        self._refs: dict[ray.ObjectRef, int] = {}

    def _make_actor(self, rank: int) -> Any:
        options: dict[str, Any] = {"name": f"remedy-{self.spec.run_id}-rank{rank}"}
        if self.spec.gpus_per_rank:
            options["num_gpus"] = self.spec.gpus_per_rank
        return RankActor.options(**options).remote(  # type: ignore[attr-defined]
            rank=rank,
            world_size=self.spec.workers,
            run_id=self.spec.run_id,
            run_dir=self.spec.run_dir,
            supervisor=self.supervisor,
            faults=[f for f in self.spec.faults if f.get("rank") in (None, rank)],
            argv=self.spec.argv,
            threads=self.spec.threads_per_rank,
            verbose=self.spec.verbose,
        )

    async def start(self) -> None:
        """Create every rank, form the process group, and start training."""
        for rank in range(self.spec.workers):
            self.actors[rank] = self._make_actor(rank)
        addr, port = await self.actors[0].node_address.remote()
        await asyncio.gather(
            *(a.init_process_group.remote(addr, port) for a in self.actors.values())
        )
        for rank, actor in self.actors.items():
            self._refs[actor.run.remote(self.spec.target)] = rank

    def run_refs(self) -> list[ray.ObjectRef]:
        return list(self._refs)

    def rank_of(self, ref: ray.ObjectRef) -> int:
        return self._refs[ref]

    def shutdown(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        self.actors.clear()
