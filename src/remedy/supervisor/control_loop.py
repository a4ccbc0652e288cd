"""The supervisor's control loop: the group started (or adopted), watched until every rank ended.

It runs inside the supervisor actor, on the actor's event loop, beside the
calls the actor serves. It starts the node agents and the worker group (or,
in a supervisor Ray restarted, adopts the ranks the one before it ran),
then passes every `POLL_S` until no rank's process runs: a rank's run call
that ended, an adopted rank's result, a node Ray calls dead or one that
joined, a hang, the policy file saved over, a state record owed. Each pass
steps the run's core with what it found (`supervisor.carry` brings the
inputs back) and hands the effects to the `Carrier`. When the ranks have
all ended it waits for Ray's verdict on silent nodes, settles a restart
still under way and records the ranks' results; the actor then writes the
summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import ray

from remedy.control.hang_watch import DEAD
from remedy.control.job import Phase
from remedy.control.run_core import GroupStarted, Pass, RanksAllEnded, RunCore, Watching
from remedy.control.sightings import Sightings
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import RunDir
from remedy.supervisor import carry
from remedy.supervisor.agent.actor import kill_agents
from remedy.supervisor.agents_start import NodeAgents
from remedy.supervisor.carry import Carrier, RankOver
from remedy.supervisor.node_watch import NodeWatch
from remedy.supervisor.policy_apply import PolicyApplier
from remedy.supervisor.recovery import Recovery
from remedy.supervisor.rendezvous import Rendezvous
from remedy.supervisor.state_records import StateRecords
from remedy.supervisor.worker_group import WorkerGroup, kill_run_actors

POLL_S = 0.05
# How often a restarted supervisor asks the ranks it adopted whether they finished.
RESULT_POLL_S = 0.5


class ControlLoop:
    """Runs the run's ranks to their end; owns the worker group and the rendezvous store.

    `write_state` writes a state record (the actor's: what a restarted
    supervisor resumes from), `crash_point` is the chaos crash the actor
    injects after one.
    """

    def __init__(
        self,
        spec: RunSpec,
        core: RunCore,
        carrier: Carrier,
        *,
        run_dir: RunDir,
        agents: NodeAgents,
        applier: PolicyApplier,
        records: StateRecords,
        sightings: Sightings,
        write_state: Callable[[], None],
        crash_point: Callable[[str], None],
    ) -> None:
        self.spec = spec
        self.core = core
        self.carrier = carrier
        self.run_dir = run_dir
        self.agents = agents
        self.applier = applier
        self.records = records
        self.sightings = sightings
        self.write_state = write_state
        self.crash_point = crash_point
        self.node_watch = NodeWatch()
        self.rendezvous = Rendezvous()
        self.group: WorkerGroup | None = None

    def _step(self, inp: RankOver | None) -> None:
        """Step the core with what an I/O of `supervisor.carry` brought back; carry its effects."""
        if inp is not None:
            self.carrier.carry(self.core.step(inp))

    async def run(self) -> None:
        """Start (or adopt) the group and watch it until every rank ended; kill what is left."""
        if self.core.group is None:
            # This supervisor's first state record, before it starts anything: one restarted
            # from here knows a run had begun (and starts its group over, see `_begin`).
            self.write_state()
        await self.agents.start()
        group = self.group = WorkerGroup(
            self.spec, supervisor=ray.get_runtime_context().current_actor,
            rendezvous=self.rendezvous, slots=self.core.slots, step=self.core.step,
        )  # fmt: skip
        group.agents = self.agents.handles  # they kill their node's ranks by pid
        # A policy that replays: ranks hold at a flagged step's boundary for its decision.
        group.hold_on_flag = self.core.controller.engine.policy.uses("replay_step")
        recovery = self.carrier.recovery = Recovery(
            group, spec=self.spec, run_dir=self.run_dir, controller=self.core.controller,
            job=self.core.job, slots=self.core.slots, watch=self.core.watch,
            sightings=self.sightings, step=self.core.step, core=self.core,
            write_state=self.write_state, crash_point=self.crash_point,
            check_nodes=self.check_nodes,
        )  # fmt: skip
        try:
            await self._begin(group, recovery)
            next_poll = 0.0
            while group.run_refs() or group.adopted or self._restart_pending():
                next_poll = await self._pass(group, recovery, next_poll)
                await asyncio.sleep(POLL_S)
            await carry.node_verdicts(recovery, self.node_watch, group, self.check_nodes)
            await recovery.settle(self.core.results)
            # Before the ranks are killed: a supervisor restarted from here on finishes
            # from these results instead of looking for the actors.
            self.run_dir.history({"type": "ranks_ended", "results": self.core.results})
            self.core.step(RanksAllEnded())
            self.write_state()
        finally:
            group.shutdown()
            with contextlib.suppress(ray.exceptions.RayError):
                kill_run_actors(self.spec.run_id)  # any a crash left out of the records
            kill_agents(self.spec.run_id, self.agents.nodes)

    async def _begin(self, group: WorkerGroup, recovery: Recovery) -> None:
        """Start the group, or, after a restart of the supervisor, adopt the one it had."""
        # Every rank into the hang watch: with the start-up allowance, or, after a restart of
        # the supervisor, as the one before watched it (its tick and step time: a rank that
        # hung while no supervisor watched is found within its own timeout, not the start-up one).
        self.core.step(Watching(time.monotonic()))
        self.run_dir.history(
            {
                "type": "supervisor_started",
                "incarnation": self.core.incarnation,
                "policy": self.spec.policy,  # what `explain` loads while the run goes on
            }
        )
        restored = self.core.group
        if restored is None:
            if self.core.incarnation > 1:
                # Died while starting the group, before a state record held it: start
                # over (the actors it had created carry names a new group would reuse).
                kill_run_actors(self.spec.run_id)
                self.core.restart_job()
            await group.start()
            self.core.step(GroupStarted(0))
        else:
            restarts = [d for d in self.core.controller.deferred.values()
                        if d.action == "restart_rank"]  # fmt: skip
            # Every rank, ended ones too: their `result()` is how this supervisor learns them.
            for rank in await group.adopt(restored, sorted(self.core.slots.slots)):
                self._step(carry.adopted_result(group, self.core.slots, rank, DEAD))
            await carry.watch_from_marks(group, self.core.watch)
            for d in restarts:  # a restart the crashed supervisor had begun: go on
                recovery.resume(d)
        self.write_state()

    async def _pass(self, group: WorkerGroup, recovery: Recovery, next_poll: float) -> float:
        """One pass: ranks that ended, nodes lost or joined, hangs, the policy file, a state
        record if one is owed or due. Returns when to poll the adopted ranks next."""
        slots = self.core.slots
        running = group.run_refs()
        ready, _ = ray.wait(running, num_returns=len(running), timeout=0)
        for ref in ready:
            config = self.core.watch.config
            self._step(await carry.rank_finished(group, ref, slots, config, self.check_nodes))
        if group.adopted and time.monotonic() >= next_poll:
            next_poll = time.monotonic() + RESULT_POLL_S
            for rank, result in (await group.poll_adopted()).items():
                self._step(carry.adopted_result(group, slots, rank, result))
        await self.check_nodes(group)
        await self.agents.for_new()
        if self.core.job.state.phase in (Phase.RUNNING, Phase.DEGRADED):
            await recovery.check_hangs()
            recovery.check_back()
        self.carrier.carry(self.core.step(Pass()))
        self.run_dir.check()  # a write failed (in a report too), or the directory is gone
        self.applier.poll()
        if self.records.due() or self.records.owed():  # due: or a full record put off by a reply
            self.write_state()
        return next_poll

    async def check_nodes(self, group: WorkerGroup, *, now: bool = False) -> None:
        """On a cluster of several nodes: the nodes of the run Ray calls dead lose their ranks."""
        recovery = self.carrier.recovery
        if len(group.cluster) <= 1 or recovery is None:
            return
        dead = await self.node_watch.new_dead(group.watched_nodes(), now=now)
        if dead:
            recovery.nodes_lost(dead)

    def _restart_pending(self) -> bool:
        """A restart runs while no rank's process does (a node that held every rank was lost):
        the loop goes on until it starts the new ones. Not once every rank completed the run:
        a restart still waiting on the group then ends with it (`Recovery.settle`)."""
        recovery = self.carrier.recovery
        if recovery is None or not recovery.running():
            return False
        return not self.core.all_completed()
