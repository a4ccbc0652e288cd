"""The ranks of one job as Ray actors: start them, ping them, replace one, stop them.

Each rank slot (`RankSlots`) is filled by one `RankActor` at a time; the
group keeps warm spares (actors started and warmed up before they are
needed) so a replacement costs no process start, and refills them off the
critical path. Replacing a rank kills only its process (by pid when it runs
on this node: `ray.kill` of a stopped process waits the raylet's
`kill_worker_timeout_milliseconds` first), starts the spare as that rank
in the next generation, and orders every survivor to regroup.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Any

import ray
import structlog

from remedy.supervisor.hang_watch import DEAD, NO_ANSWER
from remedy.supervisor.rank import RankActor
from remedy.supervisor.rank_slots import RankSlots
from remedy.supervisor.spec import RunSpec

log = structlog.get_logger("remedy.worker_group")


class WorkerGroup:
    def __init__(
        self,
        spec: RunSpec,
        *,
        supervisor: Any,
        store_addr: tuple[str, int],
        slots: RankSlots,
    ) -> None:
        self.spec = spec
        self.supervisor = supervisor
        self.store_addr = store_addr
        self.slots = slots
        self.generation = 0
        self.actors: dict[int, Any] = {}
        self.pids: dict[int, tuple[str, int]] = {}  # rank -> (node address, pid)
        self.spares: list[Any] = []
        self._refs: dict[ray.ObjectRef, tuple[int, int]] = {}  # run ref -> (rank, incarnation)
        self._retired: set[ray.ObjectRef] = set()  # runs of processes remedy killed itself
        self._node = ray.util.get_node_ip_address()
        self._refilling: asyncio.Task[None] | None = None

    def _new_actor(self) -> Any:
        options: dict[str, Any] = {}
        if self.spec.gpus_per_rank:
            options["num_gpus"] = self.spec.gpus_per_rank
        return RankActor.options(**options).remote(  # type: ignore[attr-defined]
            run_id=self.spec.run_id,
            run_dir=self.spec.run_dir,
            supervisor=self.supervisor,
            target=self.spec.target,
            argv=self.spec.argv,
            threads=self.spec.threads_per_rank,
            verbose=self.spec.verbose,
            token=self.spec.token,
        )

    def _faults(self, rank: int) -> list[dict[str, Any]]:
        return [f for f in self.spec.faults if f.get("rank", 0) in (None, rank)]

    def _launch(
        self, rank: int, actor: Any, *, generation: int, adopt_from: int | None
    ) -> ray.ObjectRef:
        incarnation = self.slots.incarnation(rank)
        ref = actor.run.remote(
            rank=rank,
            world_size=self.spec.workers,
            store_addr=self.store_addr,
            incarnation=incarnation,
            generation=generation,
            adopt_from=adopt_from,
            faults=self._faults(rank),
        )
        self.actors[rank] = actor
        self._refs[ref] = (rank, incarnation)
        return ref

    async def start(self) -> None:
        """Create every rank (and the warm spares) and start training in generation 0."""
        for rank in range(self.spec.workers):
            self._launch(rank, self._new_actor(), generation=0, adopt_from=None)
        self.spares = [self._new_actor() for _ in range(self.spec.spares or 0)]
        await self._learn_pids(list(self.actors))

    async def _learn_pids(self, ranks: list[int]) -> None:
        found = await asyncio.gather(*(self.actors[r].where.remote() for r in ranks))
        for rank, (node, pid) in zip(ranks, found, strict=True):
            self.pids[rank] = (node, pid)
            self.slots.slots[rank].pid = pid

    def run_refs(self) -> list[ray.ObjectRef]:
        return list(self._refs)

    def owner(self, ref: ray.ObjectRef) -> tuple[int, int]:
        """(rank, incarnation) whose training `ref` is."""
        return self._refs[ref]

    def retired(self, ref: ray.ObjectRef) -> bool:
        """True for the run of a process remedy killed (its error is expected)."""
        return ref in self._retired

    def forget(self, ref: ray.ObjectRef) -> None:
        self._refs.pop(ref, None)
        self._retired.discard(ref)

    async def ping_all(self, timeout_s: float, ranks: list[int] | None = None) -> dict[int, Any]:
        """Every rank's status, `NO_ANSWER` if it did not answer within `timeout_s`, or `DEAD`."""

        async def one(actor: Any) -> Any:
            try:
                return await actor.ping.remote()
            except ray.exceptions.RayActorError:
                return DEAD

        chosen = self.actors if ranks is None else {r: self.actors[r] for r in ranks}
        tasks = {rank: asyncio.ensure_future(one(a)) for rank, a in chosen.items()}
        await asyncio.wait(tasks.values(), timeout=timeout_s)
        out: dict[int, Any] = {}
        for rank, task in tasks.items():
            if task.done():
                out[rank] = task.result()
            else:
                task.cancel()
                out[rank] = NO_ANSWER
        return out

    def kill(self, rank: int) -> None:
        """Kill `rank`'s process now: by pid on this node, and through Ray everywhere."""
        actor = self.actors.pop(rank, None)
        for ref, (r, _inc) in self._refs.items():
            if r == rank:
                self._retired.add(ref)
        where = self.pids.pop(rank, None)
        if where is not None and where[0] == self._node:
            with contextlib.suppress(ProcessLookupError):
                os.kill(where[1], signal.SIGKILL)
        if actor is not None:
            ray.kill(actor, no_restart=True)

    async def replace(self, ranks: list[int], *, source: int) -> dict[str, Any]:
        """Kill `ranks`, start their replacements in the next generation, order survivors to regroup."""
        t0 = time.perf_counter()
        for rank in ranks:
            self.kill(rank)
        self.generation += 1
        generation = self.generation
        how: dict[int, str] = {}
        new: list[int] = []
        for rank in ranks:
            self.slots.replace(rank)
            if self.spares:
                actor, how[rank] = self.spares.pop(0), "warm spare"
            else:
                actor, how[rank] = self._new_actor(), "new actor"
            self._launch(rank, actor, generation=generation, adopt_from=source)
            new.append(rank)
        for rank, actor in self.actors.items():
            if rank not in new:
                actor.regroup.remote(generation, source)
        await self._learn_pids(new)
        return {
            "generation": generation,
            "source": source,
            "replacements": {str(r): how[r] for r in ranks},
            "launch_s": round(time.perf_counter() - t0, 4),
        }

    async def relaunch(self, ranks: list[int], *, source: int) -> dict[str, Any]:
        """Start new actors for replacements that failed, into the same generation."""
        t0 = time.perf_counter()
        for rank in ranks:
            self.kill(rank)
            self.slots.replace(rank)
            self._launch(rank, self._new_actor(), generation=self.generation, adopt_from=source)
        await self._learn_pids(ranks)
        return {
            "generation": self.generation,
            "source": source,
            "replacements": {str(r): "new actor" for r in ranks},
            "launch_s": round(time.perf_counter() - t0, 4),
        }

    def refill_spares(self) -> None:
        """Start spares up to the configured count (their start is off the critical path)."""
        while len(self.spares) < (self.spec.spares or 0):
            self.spares.append(self._new_actor())

    def shutdown(self) -> None:
        for actor in [*self.actors.values(), *self.spares]:
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        self.spares.clear()
