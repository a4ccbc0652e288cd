"""The ranks of one job as Ray actors: start them, ping them, replace one, stop them.

Each rank slot (`RankSlots`) is filled by one `RankActor` at a time; the
group keeps warm spares (actors started and warmed up before they are
needed) so a replacement costs no process start, and refills them off the
critical path. Replacing a rank kills only its process (by pid when it runs
on this node: `ray.kill` of a stopped process waits the raylet's
`kill_worker_timeout_milliseconds` first), starts the spare as that rank
in the next generation, and orders every survivor to regroup.

Spares are of two kinds. `RunSpec.spares` sit where the fewest actors are,
and a replacement is taken from one on another node than the rank it
replaces: they cover a lost node. `RunSpec.local_spares` sit on each node
that holds ranks: a rank whose process is lost while its node lives is
replaced on its own node, so the job keeps its layout (ranks per node).
Where the run has node agents, the node's agent promotes the spare
(`NodeAgent.promote`): it waits for the lost process to be gone (on a GPU
node, its memory freed) and then starts the spare's `run`. That call is the
agent's, so the supervisor follows the rank's end as an adopted rank's,
through `result` (`poll_adopted`): the rank's run does not depend on the
agent's process, which Ray may restart meanwhile.

The actors themselves (their names, creation, the spare pool, where each
runs, kills) are `supervisor.ranks`' mechanism; this module is the group's
life cycle. Every actor is named and detached, so it outlives a supervisor
that crashes: the group sends its `section()` to the run's core at each change (`GroupMoved`:
the supervisor's state record holds it), and a restarted supervisor
`adopt`s the actors again by name. It does not own their `run`
calls, so it learns that an adopted rank finished from `RankActor.result`
(`poll_adopted`). The supervisor kills every actor of its run at the end
(`shutdown`, then `kill_run_actors` for any a crash left unrecorded).

Where each actor runs is planned over the cluster's alive nodes
(`supervisor.placement`): ranks off the supervisor's node where there is
another, spread or packed, spares where the fewest actors are, and a
replacement from a spare on another node than the rank it replaces. Each
rank's Ray node id is learnt with its pid (`where`) and kept in its slot.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import ray

from remedy.control.run_core import GroupMoved
from remedy.control.sections import GroupSection
from remedy.control.slots import RankSlots
from remedy.protocol.exceptions import WaitTimeout
from remedy.protocol.spec import NAMESPACE, RunSpec
from remedy.supervisor import placement
from remedy.supervisor import ranks as rank_actors
from remedy.supervisor.pings import ping_actors

# The actors' names and the run's kill, here where callers have long found them.
from remedy.supervisor.ranks import (
    kill_run_actors,
    rank_name,
    run_actor_names,
    spare_name,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from remedy.control.run_core import Effect, Input
    from remedy.supervisor.rendezvous import Rendezvous

__all__ = [
    "RESULT_TIMEOUT_S",
    "WHERE_TIMEOUT_S",
    "WorkerGroup",
    "kill_run_actors",
    "rank_name",
    "run_actor_names",
    "spare_name",
]

# How long a rank gets to answer `result()` before it counts as still running.
RESULT_TIMEOUT_S = 2.0
# How long started actors get to say where they run (node, pid): a process start
# takes seconds, tens of seconds for a whole group on a loaded node (30 s was too
# short for 4 ranks and a spare at load average 30), a wedged one forever.
WHERE_TIMEOUT_S = 120.0


class WorkerGroup:
    """The job's rank actors through their life: started, replaced, adopted, stopped."""

    def __init__(
        self,
        spec: RunSpec,
        *,
        supervisor: Any,
        rendezvous: Rendezvous,
        slots: RankSlots,
        step: Callable[[Input], list[Effect]],
    ) -> None:
        """`step`: the run's core, which holds the group's section of the record: each change
        of the group's generation, names, spares or dead nodes is sent to it (`GroupMoved`)."""
        self.spec = spec
        self.step = step
        self._sent: GroupSection | None = None  # the section the core holds
        self.supervisor = supervisor
        self.rendezvous = rendezvous
        self.slots = slots
        self.generation = 0
        self.actors: dict[int, Any] = {}
        # rank -> (node address, pid, the process's start time as psutil reads it; 0.0: unknown)
        self.pids: dict[int, tuple[str, int, float]] = {}
        self.spares = rank_actors.Spares()
        self.names: dict[int, str] = {}  # rank -> the name of the actor that is it now
        self.pings_sent = 0  # rank pings this supervisor sent (hang checks and restarts)
        # Ranks whose spare their node's agent promoted (`NodeAgent.promote`): followed.
        self.promoted: set[int] = set()
        # Ranks of an earlier supervisor: running, but whose `run` this one does not own.
        self.adopted: set[int] = set()
        self.followed: set[int] = set()  # of those, ranks this supervisor started (`follow`)
        # rank -> (the actor asked, its `result` call still out): `poll_adopted`.
        self._result_calls: dict[int, tuple[Any, ray.ObjectRef]] = {}
        self._refs: dict[ray.ObjectRef, tuple[int, int]] = {}  # run ref -> (rank, incarnation)
        self._retired: set[ray.ObjectRef] = set()  # runs of processes remedy killed itself
        self._node = ray.util.get_node_ip_address()
        # The ranks hold at a flagged step's boundary for its decision (workers.flag_hold).
        self.hold_on_flag = False
        self._abandoned: int | None = None  # the last generation whose store was closed
        # Placement: the supervisor's node, the alive nodes as last listed (minus those
        # found dead since).
        self.home = ray.get_runtime_context().get_node_id()
        self.cluster: list[placement.Node] = []
        self.dead_nodes: set[str] = set()
        self.used_nodes: set[str] = set()  # every node an actor of this group was placed on
        # Under node agents: node id -> its agent, which kills a rank of its node by pid.
        self.agents: dict[str, Any] = {}
        self.agent_kills = 0  # kills of ranks ordered through their node's agent
        self.promotions = 0  # local spares promoted by their node's agent

    @property
    def store_addr(self) -> tuple[str, int]:
        """The rendezvous store the next generation forms over."""
        return self.rendezvous.address

    def refresh_nodes(self) -> list[placement.Node]:
        """List the cluster's alive nodes again (one call to Ray's GCS)."""
        listed = placement.nodes_from_ray(ray.nodes())
        self.cluster = [n for n in listed if n.node_id not in self.dead_nodes]
        return self.cluster

    def node_died(self, node_id: str) -> None:
        """Ray calls `node_id` dead: nothing is placed there again, and its spares are dropped."""
        self.dead_nodes.add(node_id)
        self.cluster = [n for n in self.cluster if n.node_id != node_id]
        for name in self.spares.on_node(node_id):
            rank_actors.kill_quietly(self.spares.take(name=name)[0])
        self._moved()
        # Refilled on the surviving nodes once the restart is done (`refill_spares`): a spare
        # started now would be cold when the restart looks for one.

    def watched_nodes(self) -> set[str]:
        """The nodes the run's ranks and spares run or ran on, not yet found dead.

        Ran on too: a rank found lost on its own and replaced before Ray's verdict on
        its node leaves that node, whose loss is still to be journaled.
        """
        spares = {n for n in self.spares.nodes.values() if n is not None}
        return (self.used_nodes | set(self.rank_nodes().values()) | spares) - self.dead_nodes

    def rank_nodes(self) -> dict[int, str]:
        """rank -> the Ray node id its current process runs on, where known."""
        return {r: s.node for r, s in self.slots.slots.items() if s.node is not None}

    def _new_actor(self, name: str, node: str | None = None) -> Any:
        return rank_actors.new_actor(
            self.spec, self.supervisor, name, node, pin=len(self.cluster) > 1
        )

    def _new_rank(
        self, rank: int, node: str | None = None, *, avoid: set[str] | None = None
    ) -> tuple[Any, str]:
        """A new actor for `rank`: on `node`, else on the least loaded node not in `avoid`."""
        name = rank_name(self.spec.run_id, rank, self.slots.incarnation(rank))
        if node is None:
            used = [n for r, n in self.rank_nodes().items() if r != rank]
            node = rank_actors.pick_node(
                self.cluster, used, home=self.home, avoid=(avoid or set()) | self.dead_nodes
            )
        return self._new_actor(name, node), name

    def _new_spare(self, node: str | None = None, *, local: bool = False) -> None:
        """A spare where the fewest actors are, or, `local`, one on `node` for that node's ranks."""
        self.spares.last += 1
        name = spare_name(self.spec.run_id, self.spares.last)
        if not local:
            used = [*self.rank_nodes().values(), *(n for n in self.spares.nodes.values() if n)]
            node = rank_actors.pick_node(self.cluster, used, home=self.home, avoid=self.dead_nodes)
        self.spares.add(self._new_actor(name, node), name, node, local=local)
        self._moved()

    def _local_spare(self, node: str | None) -> str | None:
        """The name of a local spare on `node` (on a one-node cluster, any local spare)."""
        if node in self.dead_nodes:
            return None
        return self.spares.local_on(node, any_node=len(self.cluster) <= 1)

    def _take_spare(
        self, avoid: set[str] | None = None, name: str | None = None
    ) -> tuple[Any, str]:
        """Spare `name`; else the first spare not on a node of `avoid` (or a dead one), else the
        first spare."""
        taken = self.spares.take(name=name, shun=(avoid or set()) | self.dead_nodes)
        self._moved()
        return taken

    def _run_args(
        self, rank: int, *, generation: int, adopt_from: int | None, resume_step: int | None
    ) -> dict[str, Any]:
        """The keyword arguments of `RankActor.run` that make an actor `rank` now."""
        return rank_actors.run_args(
            self.spec, rank, incarnation=self.slots.incarnation(rank), store_addr=self.store_addr,
            generation=generation, adopt_from=adopt_from, resume_step=resume_step,
            hold_on_flag=self.hold_on_flag,
        )  # fmt: skip

    def _launch(
        self,
        rank: int,
        actor: Any,
        name: str,
        *,
        generation: int,
        adopt_from: int | None,
        resume_step: int | None = None,
    ) -> ray.ObjectRef:
        args = self._run_args(
            rank, generation=generation, adopt_from=adopt_from, resume_step=resume_step
        )
        ref = actor.run.remote(**args)
        self.actors[rank] = actor
        self.names[rank] = name
        self._moved()
        self.adopted.discard(rank)
        self.followed.discard(rank)
        self.promoted.discard(rank)
        self._refs[ref] = (rank, args["incarnation"])
        return ref

    async def start(self) -> None:
        """Create every rank (and the warm spares) and start training in generation 0."""
        resume = self.spec.resume.get("step")  # --resume-from: every rank starts from it
        self.refresh_nodes()
        where = placement.plan(
            self.cluster, self.spec.workers, strategy=self.spec.placement, home=self.home
        )
        for rank in range(self.spec.workers):
            node = where[rank] if where else None
            self.slots.slots[rank].node = node  # planned; `_learn_pids` sets where it landed
            self._launch(
                rank, *self._new_rank(rank, node), generation=0, adopt_from=None,
                resume_step=resume,
            )  # fmt: skip
        self.refill_spares()
        await self._learn_pids(list(self.actors))

    # ---------------------------------------------------------- restart
    def section(self) -> GroupSection:
        """What a restarted supervisor needs to find this group again: its section of the
        run's record."""
        return GroupSection(
            generation=self.generation,
            names=dict(self.names),
            spares=tuple(self.spares.names),
            next_spare=self.spares.last,
            spare_nodes=dict(self.spares.nodes),
            local_spares=frozenset(self.spares.local),
            dead_nodes=frozenset(self.dead_nodes),
        )

    def _moved(self) -> None:
        """The group changed: its section goes to the run's core, where it is the record's."""
        section = self.section()
        if section != self._sent:
            self._sent = section
            self.step(GroupMoved(section))

    async def adopt(self, record: GroupSection, ranks: list[int]) -> list[int]:
        """Find the actors of `record` (the restored section) by name; return the `ranks`
        whose actor is gone.

        Spares started after the record was written are found by their names.
        """
        self.generation = record.generation
        self.spares.last = record.next_spare
        self.dead_nodes = set(record.dead_nodes)
        placed = record.spare_nodes
        local = set(record.local_spares)
        self.refresh_nodes()
        names = dict(record.names)
        missing = []
        for rank in ranks:
            try:
                self.actors[rank] = ray.get_actor(names[rank], namespace=NAMESPACE)
            except (KeyError, ValueError):
                missing.append(rank)
                continue
            self.names[rank] = names[rank]
            self.adopted.add(rank)
        for name, actor in rank_actors.find_spares(self.spec.run_id, set(names.values())):
            self.spares.add(actor, name, placed.get(name), local=name in local)
            self.spares.last = max(self.spares.last, int(name.rsplit("-", 1)[1]))
        self._moved()
        live = [r for r in ranks if r not in missing]
        # A rank that answers nothing (stopped, wedged) leaves only its own pid unknown.
        with contextlib.suppress(ray.exceptions.RayError, WaitTimeout):
            await self._learn_pids(live, timeout_s=RESULT_TIMEOUT_S)
        return missing

    def follow(self, rank: int) -> None:
        """Learn `rank`'s end from `result` calls (`poll_adopted`), as an adopted rank's: its
        `run` call lost touch with a process that may still be running."""
        if rank in self.actors:
            self.adopted.add(rank)
            self.followed.add(rank)

    async def poll_adopted(self) -> dict[int, Any]:
        """Adopted ranks that ended: their summary, or `DEAD` if the actor is gone.

        Never waits: each adopted rank has one `result` call out at a time, looked
        at here and sent again once answered None (still training). A rank that
        answers nothing (stopped, wedged) holds only its own call, not the
        supervisor's loop, and its calls do not pile up.
        """
        out = rank_actors.ended(self.actors, self.adopted, self._result_calls)
        self.adopted -= set(out)
        return out

    async def _learn_pids(self, ranks: list[int], timeout_s: float = WHERE_TIMEOUT_S) -> None:
        """Where each of `ranks` runs (node, pid), kept as each answers: one that does not
        answer in `timeout_s` (`WaitTimeout`) or whose actor failed (its Ray error, raised
        after the others are kept) costs the others nothing."""
        found, failed = await rank_actors.where(self.actors, ranks, timeout_s)
        for rank, at in found.items():
            self.pids[rank] = (at.address, at.pid, at.started)
            self.slots.slots[rank].pid = at.pid
            if at.node is not None:  # an actor of an older version says no node id
                self.slots.slots[rank].node = at.node
                self.used_nodes.add(at.node)
        if failed is not None:
            raise failed

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

    async def ping_all(
        self, timeout_s: float, ranks: list[int] | None = None, *, patience: float = 0.0
    ) -> dict[int, Any]:
        """Every rank's status, `NO_ANSWER` if it did not answer in time, or `DEAD`.

        In time: within `timeout_s`, or `patience` times the slowest answer
        received, when that is longer (on a loaded node every answer is slow).
        """
        chosen = self.actors if ranks is None else {r: self.actors[r] for r in ranks}
        self.pings_sent += len(chosen)
        return await ping_actors(chosen, timeout_s, patience=patience)

    def kill(self, rank: int) -> None:
        """Kill `rank`'s process now (`ranks.kill_process`): by pid or by its node's agent,
        and through Ray; its run's end is expected from here on."""
        actor = self.actors.pop(rank, None)
        self.adopted.discard(rank)
        self.followed.discard(rank)
        self.promoted.discard(rank)
        self._result_calls.pop(rank, None)
        for ref, (r, _inc) in self._refs.items():
            if r == rank:
                self._retired.add(ref)
        slot = self.slots.slots.get(rank)
        node = slot.node if slot is not None else None
        agent = self.agents.get(node) if node is not None and node != self.home else None
        self.agent_kills += rank_actors.kill_process(
            actor, self.pids.pop(rank, None), node=node, home=self.home, here=self._node,
            agent=agent, token=self.spec.token,
        )  # fmt: skip

    async def replace(
        self, ranks: list[int], *, source: int, retry: bool = False
    ) -> dict[str, Any]:
        """Kill `ranks`, start their replacements in the next generation, order survivors to regroup.

        `retry`: after a failed attempt, with new actors (not spares) over a new
        store (`abandon_generation`). The failed generation is not formed again:
        its rendezvous keys name processes that are gone, and survivors that
        formed it with a replacement that then died wait for an order past it.
        """
        t0 = time.perf_counter()
        # Each replacement goes to another node than the one its rank was lost on, but for
        # one from a local spare of that node (`local_spares`) while the node lives.
        old = {r: self.slots.slots[r].node for r in ranks}
        gone = {r: self.pids.get(r) for r in ranks}  # the processes the kills below end
        self._next_generation(ranks, retry=retry)
        how: dict[int, str] = {}
        skipped: list[str] = []
        promoted: dict[str, Any] = {}  # rank -> the agent's answer (`NodeAgent.promote`)
        for rank in ranks:
            self.slots.replace(rank)
            avoid = {n for n in [old[rank]] if n is not None}
            if retry:
                (actor, name), how[rank] = self._new_rank(rank, avoid=avoid), "new actor"
            else:
                local = await self._local_replacement(
                    rank, old[rank], gone[rank], source, skipped, promoted
                )
                if local is not None:
                    how[rank] = local
                    continue
                (actor, name), how[rank] = await self._spare_or_new(rank, skipped, avoid)
            self._launch(rank, actor, name, generation=self.generation, adopt_from=source)
        self._order_regroup(ranks, source)
        await self._learn_pids(ranks)
        info = {
            "generation": self.generation,
            "source": source,
            "replacements": {str(r): how[r] for r in ranks},
            "skipped_spares": skipped,
            "launch_s": round(time.perf_counter() - t0, 4),
        }
        if promoted:
            info["promoted"] = promoted  # how long each lost process took to go, and the whole
        return info

    async def _local_replacement(
        self,
        rank: int,
        node: str | None,
        gone: tuple[str, int, float] | None,
        source: int,
        skipped: list[str],
        promoted: dict[str, Any],
    ) -> str | None:
        """`rank` replaced by a local spare of `node`, where it was lost; how, or None if none
        is there (or its promotion failed: that spare is killed and named in `skipped`). The
        agent's answer to a promotion goes into `promoted` under the rank.

        Where the node has an agent, it promotes the spare (`NodeAgent.promote`) once `gone`,
        the lost process, has ended, and the rank's end is followed through `result`
        (`follow`), as an adopted rank's; without one the supervisor starts the spare's
        `run` itself.
        """
        name = self._local_spare(node) if self.spec.local_spares else None
        if name is None:
            return None
        actor, name = self._take_spare(name=name)
        agent = self.agents.get(node) if node is not None else None
        if agent is None:
            self._launch(rank, actor, name, generation=self.generation, adopt_from=source)
            return "local spare"
        args = self._run_args(rank, generation=self.generation, adopt_from=source, resume_step=None)
        figures = await rank_actors.promote(agent, self.spec.token, actor, name, args, gone, node)
        if figures is None:
            skipped.append(name)
            return None
        promoted[str(rank)] = figures
        self.actors[rank] = actor
        self.names[rank] = name
        self._moved()
        self.promoted.add(rank)
        self.follow(rank)
        self.promotions += 1
        return "local spare, promoted by its node's agent"

    def abandon_generation(self) -> None:
        """The current generation failed: serve a new store for the next one, once.

        Closing the failed generation's store fails at once every rank still
        waiting on it in its rendezvous. It does not free a rank that gloo holds
        waiting for a dead peer's connection (`workers.phases.JOINING`):
        the recovery replaces those.
        """
        if self._abandoned != self.generation:
            self.rendezvous.renew()
            self._abandoned = self.generation

    def _next_generation(self, ranks: list[int], *, retry: bool = False) -> None:
        """Kill `ranks` and open the next generation (`retry`: over a new store)."""
        for rank in ranks:
            self.kill(rank)
        if len(self.cluster) > 1:
            self.refresh_nodes()
        if retry:
            self.abandon_generation()
        self.generation += 1
        self._moved()

    def _order_regroup(self, new: list[int], source: int) -> None:
        """Order every rank but the `new` ones to form the current generation from `source`."""
        for rank, actor in self.actors.items():
            if rank not in new:
                # With the store: after a supervisor restart or a failed attempt it is not
                # the one they joined.
                actor.regroup.remote(self.generation, source, self.store_addr)

    async def restart_all(self, resume_step: int | None) -> dict[str, Any]:
        """Kill every rank and start the whole group afresh in the next generation.

        Warm spares become ranks first, then new actors; each rank's Guard
        resumes from durable checkpoint `resume_step` (None: from the start).
        """
        t0 = time.perf_counter()
        ranks = list(range(self.spec.workers))
        self._next_generation(ranks)
        how: dict[int, str] = {}
        skipped: list[str] = []
        for rank in ranks:
            self.slots.replace(rank)
            (actor, name), how[rank] = await self._spare_or_new(rank, skipped)
            self._launch(rank, actor, name, generation=self.generation, adopt_from=None,
                         resume_step=resume_step)  # fmt: skip
        await self._learn_pids(ranks)
        return {
            "generation": self.generation,
            "resume_step": resume_step,
            "replacements": {str(r): how[r] for r in ranks},
            "skipped_spares": skipped,
            "launch_s": round(time.perf_counter() - t0, 4),
        }

    def kill_all(self) -> None:
        """Kill every rank's process (the run is ending)."""
        for rank in list(self.actors):
            self.kill(rank)

    async def _spare_or_new(
        self, rank: int, skipped: list[str], avoid: set[str] | None = None
    ) -> tuple[tuple[Any, str], str]:
        """(actor, its name) of a warm spare that answers a ping, else of a new actor; and which.

        Spares on another node than those of `avoid` (the lost rank's) are taken first.

        A spare that does not answer within `SPARE_PING_S` is killed and its name
        added to `skipped`; a fresh spare replaces it (off the critical path: it
        is not taken for this rank, being cold).
        """
        warm = await self.spares.take_answering((avoid or set()) | self.dead_nodes, skipped)
        self._moved()
        if skipped:
            self._refill_apart()
        return (warm, "warm spare") if warm else (self._new_rank(rank, avoid=avoid), "new actor")

    def refill_spares(self) -> None:
        """Start spares up to the configured counts (their start is off the critical path):
        `spares` where the fewest actors are, `local_spares` on each node holding ranks."""
        self._refill_apart()
        if not self.spec.local_spares:
            return
        nodes = sorted(set(self.rank_nodes().values()) - self.dead_nodes)
        for node in nodes if len(self.cluster) > 1 else [None]:
            for _ in range(self.spec.local_spares - self.spares.kept_on(node)):
                self._new_spare(node, local=True)

    def _refill_apart(self) -> None:
        while self.spares.apart < (self.spec.spares or 0):
            self._new_spare()

    def shutdown(self) -> None:
        """Kill every rank and spare: the run is over."""
        for actor in [*self.actors.values(), *self.spares.clear()]:
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        self._moved()
        self.promoted.clear()
        self.adopted.clear()
        self.followed.clear()
