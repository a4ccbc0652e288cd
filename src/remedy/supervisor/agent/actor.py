"""The node agent: one detached Ray actor per node, between that node's ranks and the supervisor.

The ranks of a node send their reports to its agent instead of the
supervisor (the agent answers `report` and `where` as the supervisor does,
so a rank's `RayReporter` works unchanged). The agent does the per-report
work (`supervisor.agent_core.AgentCore`: token, slot and batch number,
validation), sets its ranks' gauges (`remedy.rank.loop.metrics`), writes the
step records to its own metrics file
(`metrics-agent-<node>.jsonl`, merged with `metrics.jsonl` by every reader:
`supervisor.rundata.metrics_files`), and sends upward:

- a batch with anomaly events at once, in one `report_many` call,
  answering the rank only once the supervisor has it;
- one digest of every rank that reported, each `digest_period` (0.5 s, longer
  where there are more than 128 agents, or where the node's ranks report less
  often: `AgentCore.digest_interval`), in one
  `report_many` call: one Ray call per node per interval instead of one per
  rank report. It carries the ranks' outcomes too; a batch with outcomes is
  answered once the digest that carried them is acknowledged.

It carries out the node-local effects of a restart: the supervisor's order to
kill one of its ranks (`kill_rank`) is a SIGKILL by pid from here, at once;
its order to promote a warm spare of this node (`promote`, with the run's
`local_spares`) starts the spare as the rank once the lost process is gone.
Ray's own kill of a process on another node (`ray.kill`) goes through that
node's raylet, which waits its `kill_worker_timeout_milliseconds` (5 s by
default) for a stopped (hung) process before it kills it, and the peers
blocked in a collective with it stay blocked until its sockets close. The
agent kills only a Ray worker of its own node that started when the rank's
process did (the start time the rank gave with its pid), so a pid reused by
another process is left alone.

It also watches its ranks for hangs with the supervisor's `HangWatch`, fed
by each report as it comes: when it suspects one it pings its ranks and,
if one is still stalled, sends the sightings upward at once (`hang_seen`);
the supervisor names the hung or dead rank from every agent's sightings
(`supervisor.core.sightings`).

Every call upward is bounded (`upward_bound`), and the agent keeps the
ranks' watch on the supervisor (`supervisor.liveness`): a rank's reports
go to its agent, which answers most of them itself, so a rank cannot see
a supervisor that is alive but answers nothing; its agent can. An upward
call unanswered for the run's silence bound means a hung supervisor: the
agent kills it as a rank's reporter would (by pid on its own node, through
Ray from another node where it has rank 0), Ray restarts it and retries
the calls in flight against the new process, and the agent notes the
outage to it once it answers again (`note_outage`).

The supervisor answers each call with the commands of every rank in it;
the agent keeps them and hands each rank its own with the answer to its next
report. The agent is named per run and node (`agent_name`), pinned to its
node (node affinity) and restarted by Ray after a crash (`max_restarts=-1`,
with the ranks' calls retried against the new instance). Its state record
(`agent-<node>.json` in the run directory, replaced atomically after every
digest) holds its ranks' slots and last steps, a batch number the supervisor
has not acknowledged counting as not taken. A restarted agent rebuilds itself
from it and takes the calls Ray retries against it again; whatever reaches the
supervisor twice is a duplicate by batch number there, whose slots decide
exactly-once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import psutil
import ray
import structlog
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from remedy.control.hang_watch import DEAD, HangWatchConfig
from remedy.protocol.exceptions import WaitTimeout
from remedy.protocol.spec import NAMESPACE, supervisor_name
from remedy.rank.chaos import process_faults
from remedy.rank.link import liveness
from remedy.rank.loop.logs import configure_logging
from remedy.rank.loop.metrics import RayBackend, RunMetrics
from remedy.rundir.writer import RunDir
from remedy.supervisor import waits
from remedy.supervisor.agent.core import AgentCore
from remedy.supervisor.pings import SPARE_PING_S, ping_actors

log = structlog.get_logger("remedy.agent")

# How often an agent sends its digest (the newest step and tick of each rank, and
# what it owes), at least. Commands reach a rank within about this plus its heartbeat.
DIGEST_S = 0.5
# Digests the supervisor gets a second from all agents together, at most (`digest_period`).
DIGEST_CALLS_PER_S = 256.0
# `promote`: how long the lost rank's process gets to be gone after its kill (a process
# holding GPU memory frees it as it exits).
PROMOTE_GONE_S = 2.0


def digest_period(agents: int) -> float:
    """An agent's digest period when the run has `agents` of them: `DIGEST_S`, or longer so
    that all of them together send at most `DIGEST_CALLS_PER_S` digests a second.

    The supervisor's work grows with the digests it answers (about 1.7 ms of its CPU per
    agent call at 4,096 simulated ranks, `benchmarks/supervisor_load.py --agents`): at
    0.5 s, 512 agents would send 1,024 a second, more than one core answers. Hangs and
    deaths are found by each agent itself, so a longer period costs the supervisor's view
    of progress (status, the straggler check) and the fan-out of commands, not detection.
    """
    return max(DIGEST_S, max(agents, 1) / DIGEST_CALLS_PER_S)


# How often an agent looks at its hang watch (the supervisor's loop polls as often).
HANG_CHECK_S = 0.05
# A rank's first report in a new generation (a restart waits on it) brings the digest forward,
# this long after it, so that the node's other ranks' first reports, a few ms behind, join it.
HURRY_S = 0.02
# How often an agent looks whether the supervisor answers its calls.
LIVENESS_CHECK_S = 0.25
# The Guard's default heartbeat: an agent's silence bound derives from it, as the ranks' and
# the driver's do (`liveness.silence_bound`; the run's `supervisor_timeout_s` wins).
HEARTBEAT_S = 0.5


def upward_bound(silence_s: float, restart_s: float = liveness.RESTART_S) -> float:
    """How long one call to the supervisor may go unanswered before the agent gives it up.

    A healthy supervisor answers in milliseconds, a loaded one within a second or two.
    One silent for `silence_s` is hung: a watcher (this agent, the driver) kills it, Ray
    restarts it within `restart_s` and retries the call on the new process, which needs
    about one bound more to read its journal and answer. Only past all of that, when every
    watcher has given the supervisor up as lost, does the call fail (`WaitTimeout`): sooner,
    a rank would send again what a restarted supervisor is about to take.
    """
    return 2 * silence_s + restart_s


# Characters of a node id in an agent's name and files: unique among a cluster's nodes.
NODE_ID_CHARS = 12


def agent_name(run_id: str, node_id: str) -> str:
    """The Ray actor name of run `run_id`'s agent on node `node_id` (namespace `NAMESPACE`)."""
    return f"remedy-agent-{run_id}-{node_id[:NODE_ID_CHARS]}"


def agent_files(run_dir: Path, node_id: str) -> tuple[Path, str]:
    """(the agent's state record, the name of its metrics file in the run directory)."""
    short = node_id[:NODE_ID_CHARS]
    return run_dir / f"agent-{short}.json", f"metrics-agent-{short}.jsonl"


def launch_agents(
    spec: dict[str, Any], node_ids: list[str], *, agents: int | None = None
) -> dict[str, Any]:
    """Start (or find) the agent of each node in `node_ids`; returns node id -> handle.

    `agents`: how many the run has with these (default: these), which sets their digest period.
    Returns at once; a handle's `where` answers once its agent has started.
    """
    handles: dict[str, Any] = {}
    digest_s = digest_period(agents if agents is not None else len(node_ids))
    for node_id in node_ids:
        name = agent_name(spec["run_id"], node_id)
        handles[node_id] = NodeAgent.options(  # type: ignore[attr-defined]
            name=name,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            max_task_retries=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(spec, node_id, digest_s)
    return handles


def _not_this_process(pid: int, started: float) -> str | None:
    """None if `pid` is a Ray worker of this agent's node that started at `started`; else why not."""
    try:
        created = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.Error as exc:
        return f"refused: process {pid} cannot be read ({exc})"
    if not math.isclose(created, started, abs_tol=0.01):
        return f"refused: process {pid} started at {created:.2f}, not {started:.2f} (pid reused)"
    here = process_faults.raylet_of(os.getpid())
    if here is None or process_faults.raylet_of(pid) != here:
        return f"refused: process {pid} is not a Ray worker of this node"
    return None


def alive_nodes() -> list[str]:
    """The ids of the Ray cluster's live nodes."""
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def kill_agents(run_id: str, node_ids: list[str]) -> None:
    """Remove a run's agents for good (the run has ended)."""
    for node_id in node_ids:
        with contextlib.suppress(ValueError, ray.exceptions.RayError):
            ray.kill(ray.get_actor(agent_name(run_id, node_id), NAMESPACE), no_restart=True)


def this_nodes_agent(run_id: str) -> Any | None:
    """The agent of the node this process runs on, or None where the run has none."""
    node_id = ray.get_runtime_context().get_node_id()
    try:
        return ray.get_actor(agent_name(run_id, node_id), NAMESPACE)
    except ValueError:
        return None


# No task events for its calls (one per rank report): as for the supervisor's (`actor.py`).
@ray.remote(num_cpus=0, enable_task_events=False)  # type: ignore[call-overload]
class NodeAgent:
    """One node's agent (see the module docstring)."""

    def __init__(self, spec: dict[str, Any], node_id: str, digest_s: float = DIGEST_S) -> None:
        configure_logging(verbose=bool(spec.get("verbose")))
        self.run_id = str(spec["run_id"])
        self.node_id = node_id
        self.digest_s = digest_s  # `digest_period` of the run's agent count
        self.hang_config = HangWatchConfig(**spec.get("hang_watch", {}))
        self.core = AgentCore(
            node=node_id[:NODE_ID_CHARS],
            token=str(spec["token"]),
            world_size=int(spec["workers"]),
            hang_watch=self.hang_config,
        )
        self.run_dir = RunDir(spec["run_dir"], self.run_id)
        # Its ranks' gauges (anomalies, step time), which the supervisor no longer sets.
        self.gauges = RunMetrics(RayBackend(), run_id=self.run_id)
        self._record_path, self._metrics_name = agent_files(self.run_dir.path, node_id)
        self.restored = False
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(self._record_path.read_text())
            if isinstance(record, dict):
                self.core.restore(record)
                self.restored = True
                log.warning("agent_restored", node=self.core.node, ranks=self.core.ranks)
        self.supervisor: Any = ray.get_actor(supervisor_name(self.run_id), NAMESPACE)
        self._token = str(spec["token"])
        self._loop: asyncio.Task[None] | None = None
        # Answers held for the next digest's acknowledgement (batches with outcomes).
        self._waiting: list[asyncio.Future[None]] = []
        # Set by a rank's first report in a new generation: the next digest goes now.
        self._hurry = asyncio.Event()
        self.calls = 0  # report_many calls made (digests and immediate items)
        self._checks: asyncio.Task[None] | None = None
        self._actors: dict[int, tuple[int, Any]] = {}  # rank -> (incarnation, its actor)
        self._learning: set[int] = set()  # ranks whose actor is being looked up
        self._tasks: set[asyncio.Task[None]] = set()  # those look-ups and more (held until done)
        self.pings_sent = 0  # rank pings this agent sent
        self.sightings_sent = 0  # `hang_seen` calls made
        self.kills = 0  # rank processes this agent killed on the supervisor's order
        self.promotions = 0  # spares of this node it made ranks on the supervisor's order
        # This agent's watch on the supervisor's answers (`supervisor.liveness`).
        self.watch = liveness.SilenceWatch(
            f"agent {self.core.node}",
            liveness.silence_bound(HEARTBEAT_S, spec.get("supervisor_timeout_s")),
        )
        self.upward_s = upward_bound(self.watch.bound_s, self.watch.restart_s)
        self._here = ray.util.get_node_ip_address()
        self._ident: liveness.Identity | None = None  # the supervisor's process, once known
        self._out = 0  # upward calls awaiting their answer
        # When the oldest upward call not yet answered went out (one given up stays unanswered).
        self._unanswered_since: float | None = None
        self._liveness: asyncio.Task[None] | None = None

    def _ensure_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop().create_task(self._digests())
        if self._checks is None:
            self._checks = asyncio.get_running_loop().create_task(self._hang_checks())
        if self._liveness is None:
            self._liveness = asyncio.get_running_loop().create_task(self._watch_supervisor())
            self._learn_supervisor()

    async def where(self) -> tuple[str, int, float]:
        """(node address, pid, process start time): what a rank's silence watch kills."""
        self._ensure_loop()
        ident = liveness.Identity.of_this_process(ray.util.get_node_ip_address())
        return ident.node, ident.pid, ident.created

    async def report(self, batch: Any) -> list[dict[str, Any]] | dict[str, Any]:
        """A rank's report batch in; the commands that rank owes out (as the supervisor's).

        A rank holding at a flagged step's boundary (`workers.flag_hold`) is answered
        as the supervisor answers it: {"commands": ..., "settled": tick or None}.
        """
        self._ensure_loop()
        taken = self.core.take(batch)
        rank = batch.get("rank") if isinstance(batch, dict) else None
        if taken.metrics:
            self.run_dir.metrics_many(list(taken.metrics), name=self._metrics_name)
        if taken.ok:
            events = taken.item["events"] if taken.item is not None else []
            self.gauges.observe({"rank": rank, "events": events, "metrics": list(taken.metrics)})
        if taken.item is not None:
            # Events and outcomes: the supervisor has them before the rank is answered, so
            # a rank whose call fails here (`WaitTimeout` included) sends them again.
            replies = await self._up([taken.item])
            self.core.delivered([taken.item])
            self.core.answered(replies)
        else:
            if taken.hurry:  # a restart waits on this rank's step: the digest goes now
                self._hurry.set()
            if taken.held:
                done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._waiting.append(done)
                await done  # raises if the run's supervisor is gone for good: it sends again
        if not (taken.ok or taken.duplicate) or type(rank) is not int:
            return []
        self._learn_actor(rank)
        if taken.holding is not None:
            try:
                answer = await self._ask(
                    self.supervisor.settled.remote(self._token, taken.holding, rank, taken.final),
                    "settled",
                )
            except WaitTimeout:
                answer = None  # not settled yet: a holding rank asks again (`workers.flag_hold`)
            if isinstance(answer, dict) and isinstance(answer.get("commands"), list):
                self.core.answered({rank: answer["commands"]})
            settled = isinstance(answer, dict) and answer.get("settled") is True
            return {
                "commands": self.core.commands(rank),
                "settled": taken.holding if settled else None,
            }
        return self.core.commands(rank)

    async def stats(self) -> dict[str, Any]:
        """What this agent did: batches taken, calls made, refusals by reason."""
        return {
            "node": self.core.node,
            "taken": self.core.taken,
            "calls": self.calls,
            "rejected": dict(self.core.rejected),
            "ranks": self.core.ranks,
            "restored": self.restored,
            "pid": os.getpid(),
            "pings_sent": self.pings_sent,
            "sightings_sent": self.sightings_sent,
            "kills": self.kills,
            "promotions": self.promotions,
        }

    # ---------------------------------------------------------------- kills
    async def kill_rank(self, token: Any, pid: int, started: float) -> str:
        """The supervisor's order: SIGKILL the rank process `pid` of this node, which started at
        `started` (its start time, as psutil reads it: a pid reused since is another process).

        Returns "killed", "gone" (no such process), or why it was refused: a
        wrong token, a process that started at another time, or one that is not
        a Ray worker of this node.
        """
        if token != self._token:
            return "refused: wrong token"
        why = _not_this_process(pid, started)
        if why is not None:
            log.warning("kill_refused", pid=pid, reason=why)
            return why
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return "gone"
        self.kills += 1
        log.warning("rank_killed", pid=pid)
        return "killed"

    async def promote(
        self, token: Any, spare: Any, run: Any, pid: int = 0, started: float = 0.0
    ) -> dict[str, Any]:
        """The supervisor's order: make warm spare `spare` (an actor name) of this node a rank,
        by calling its `run` with `run`, once the lost process `pid` (started at `started`;
        0: none known) is gone, within `PROMOTE_GONE_S`.

        The supervisor sent the lost process's kill (`kill_rank`) before this order, and Ray
        starts one caller's calls in order. Returns {"promoted": True, "gone_s": how long
        the lost process took to go, "s": the whole promotion} or {"promoted": False,
        "why": ...}: a wrong token, no such spare, a spare that does not answer within
        `SPARE_PING_S`, or one on another node. A lost process still there after
        `PROMOTE_GONE_S` is named in the answer (`still_there`); the spare starts anyway.
        """
        if token != self._token:
            return {"promoted": False, "why": "refused: wrong token"}
        if not isinstance(run, dict) or type(run.get("rank")) is not int:
            return {"promoted": False, "why": "refused: no rank to run as"}
        t0 = time.monotonic()
        still_there = await self._gone(int(pid), float(started)) if pid else False
        gone_s = time.monotonic() - t0
        try:
            actor: Any = ray.get_actor(str(spare), NAMESPACE)
            where: Any = await waits.within(actor.where.remote(), SPARE_PING_S, f"spare {spare}")
        except (ValueError, WaitTimeout, ray.exceptions.RayError) as exc:
            return {"promoted": False, "why": f"spare {spare}: {exc}"[:300]}
        if where[2] != self.node_id:
            return {"promoted": False, "why": f"spare {spare} runs on another node"}
        # Its result is not read here: the supervisor follows the rank through `result`, and
        # the rank's run goes on whatever becomes of this process.
        actor.run.remote(**run)
        self.promotions += 1
        log.warning("spare_promoted", spare=spare, rank=run["rank"], gone_s=round(gone_s, 3))
        answer = {
            "promoted": True,
            "gone_s": round(gone_s, 4),
            "s": round(time.monotonic() - t0, 4),
        }
        if still_there:
            answer["still_there"] = pid
        return answer

    async def _gone(self, pid: int, started: float) -> bool:
        """Wait up to `PROMOTE_GONE_S` for the process `pid` that started at `started` to end;
        True if it is still there then."""
        deadline = time.monotonic() + PROMOTE_GONE_S
        while _not_this_process(pid, started) is None:
            if time.monotonic() >= deadline:
                log.warning("promote_lost_process_still_there", pid=pid)
                return True
            await asyncio.sleep(0.01)
        return False

    # ---------------------------------------------------------------- hangs
    async def ping_ranks(self, token: Any) -> list[dict[str, Any]]:
        """The supervisor's ask, judging a stall another node's agent saw: ping this node's
        ranks now and answer with the sightings (`supervisor.core.sightings`)."""
        if token != self._token:
            return []
        self._ensure_loop()
        return await self._ping_round()

    async def _hang_checks(self) -> None:
        """Every `HANG_CHECK_S`: when the watch suspects a rank, ping this node's ranks and,
        when one is still stalled after the ping, send the sightings upward at once."""
        while True:
            await asyncio.sleep(HANG_CHECK_S)
            if not self.core.ping_due():
                continue
            try:
                items = await self._ping_round()
                # Only a stall the ping confirmed goes up: a rank quiet between two reports
                # answers from inside its loop with a newer tick, and that ends it here.
                if any(item["stalled"] for item in items):
                    self.sightings_sent += 1
                    await self._ask(
                        self.supervisor.hang_seen.remote(self._token, self.core.node, items),
                        "hang_seen",
                    )
            except Exception as exc:  # the next round tries again; the loop must go on
                log.warning("sightings_not_sent", error=str(exc)[:300])

    async def _ping_round(self) -> list[dict[str, Any]]:
        """One ping of every rank this agent watches; their sightings."""
        actors = await self._rank_actors(self.core.watched())
        pinged_at = time.time()
        pings: dict[int, Any] = {r: DEAD for r, a in actors.items() if a is None}
        live = {r: a for r, a in actors.items() if a is not None}
        self.pings_sent += len(live)
        cfg = self.hang_config
        pings.update(await ping_actors(live, cfg.ping_timeout_s, patience=cfg.ping_patience))
        return self.core.sightings(pings, pinged_at)

    def _learn_actor(self, rank: int) -> None:
        """A new process of `rank` reports here: learn its actor now, off a hang's path."""
        known = self._actors.get(rank, (-1, None))[0] == self.core.incarnation(rank)
        if known or rank in self._learning:
            return
        self._learning.add(rank)

        async def learn() -> None:
            try:
                await self._rank_actors([rank])
            except (ray.exceptions.RayError, WaitTimeout) as exc:
                log.warning("rank_actor_not_found", rank=rank, error=str(exc)[:200])
            finally:
                self._learning.discard(rank)

        self._spawn(learn())

    async def _rank_actors(self, ranks: list[int]) -> dict[int, Any]:
        """Each rank's actor handle (None: its actor is gone), asking the supervisor for the
        names of incarnations not seen before (a warm spare's name is not the rank's)."""
        unknown = [
            r for r in ranks if self._actors.get(r, (-1, None))[0] != self.core.incarnation(r)
        ]
        if unknown:
            names = await self._ask(
                self.supervisor.rank_names.remote(self._token, unknown), "rank_names"
            )
            for rank in unknown:
                incarnation, name = (names or {}).get(rank, (0, None))
                if incarnation > self.core.incarnation(rank):
                    self.core.replaced(rank)  # a newer process reports wherever it runs
                    continue
                if incarnation != self.core.incarnation(rank):
                    continue  # the supervisor has not taken this process in yet: ask again
                if name is None:
                    continue  # the supervisor has not named it yet: asked again next round
                try:
                    actor = ray.get_actor(str(name), NAMESPACE)
                except ValueError:
                    actor = None  # its actor is gone
                self._actors[rank] = (self.core.incarnation(rank), actor)
        return {
            r: self._actors[r][1]
            for r in ranks
            if r in self._actors and self._actors[r][0] == self.core.incarnation(r)
        }

    async def _up(self, items: list[dict[str, Any]]) -> dict[Any, Any]:
        self.calls += 1
        reply = await self._ask(
            self.supervisor.report_many.remote(self._token, self.core.node, items), "report_many"
        )
        return reply if isinstance(reply, dict) else {}

    # ------------------------------------------------------------ the supervisor's liveness
    async def _ask(self, call: Any, what: str) -> Any:
        """One call to the supervisor (`call`: its `.remote()` reference), bounded by
        `upward_s` (`WaitTimeout` past it) and watched: its silence counts in `_unanswered_since`."""
        sent = time.time()
        if self._unanswered_since is None:
            self._unanswered_since = sent
        self._out += 1
        try:
            answer = await waits.within(call, self.upward_s, f"the supervisor's {what}")
        except ray.exceptions.RayTaskError:
            self._out -= 1
            self._answered(sent)  # an error raised in the supervisor is an answer too
            raise
        except BaseException:
            self._out -= 1
            raise  # unanswered: its silence counts on until another call is answered
        self._out -= 1
        self._answered(sent)
        return answer

    def _answered(self, sent: float) -> None:
        """An answer to a call sent at `sent`: the watch hears of it (an outage ends)."""
        back = self.watch.outage is not None
        self.watch.answered(min(sent, self._unanswered_since or sent))
        # It answers: calls still out count their silence from now, not from before.
        self._unanswered_since = time.time() if self._out else None
        if back:
            self._learn_supervisor()  # restarted: another process

    async def _watch_supervisor(self) -> None:
        """Every `LIVENESS_CHECK_S`: kill a supervisor silent past the bound (Ray restarts it),
        and note each outage that ended to it (`supervisor.liveness`)."""
        while True:
            await asyncio.sleep(LIVENESS_CHECK_S)
            if self.watch.check(self._unanswered_since) == "kill":
                how = liveness.kill(
                    self._ident,
                    self.supervisor,
                    here=self._here,
                    may_ray_kill=0 in self.core.ranks,  # as rank 0's reporter may
                )
                self.watch.killed(how)
            notes = self.watch.take_notes()
            if notes:  # sent off this loop: a supervisor hung again must not stop the watch
                self._spawn(self._note(notes))

    async def _note(self, notes: list[dict[str, Any]]) -> None:
        """Outages this agent saw end, to the supervisor (it journals each: `supervisor_outage`)."""
        for note in notes:
            try:
                await self._ask(
                    self.supervisor.note_outage.remote(self._token, note), "note_outage"
                )
            except (ray.exceptions.RayError, WaitTimeout) as exc:
                log.warning("outage_not_noted", error=str(exc)[:300])

    def _learn_supervisor(self) -> None:
        """Ask which process the supervisor is, off the calls' path: a hung one answers
        nothing, so its pid must be known before it is needed."""

        async def learn() -> None:
            try:
                raw = await waits.within(
                    self.supervisor.where.remote(), self.upward_s, "the supervisor's address"
                )
            except (ray.exceptions.RayError, WaitTimeout) as exc:
                log.warning("supervisor_address_unknown", error=str(exc)[:200])
                return
            self._ident = liveness.Identity.from_wire(raw)

        self._spawn(learn())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` on this agent's loop, held until done."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _digests(self) -> None:
        """Every `digest_s`, or as often as the node's ranks report where that is longer
        (`AgentCore.digest_interval`), or early when a rank reports the first step of a new
        generation of its group, which a restart waits on (`Taken.hurry`): the digest upward,
        the replies kept, the state record written.

        Each agent's first digest comes at a random point of the first interval: agents
        started together would otherwise send theirs together, every interval, and the
        supervisor would take hundreds of digests in one burst (what `supervisor_load.py
        --agents` measures assumes them spread)."""
        await asyncio.sleep(random.uniform(0.0, self.digest_s))
        while True:
            self._hurry.clear()  # before the digest takes its items: a later first report re-sets
            await self._digest()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._hurry.wait(), self.core.digest_interval(self.digest_s))
                await asyncio.sleep(HURRY_S)  # brought forward: the node's other ranks join

    async def _digest(self) -> None:
        waiting, self._waiting = self._waiting, []
        items = self.core.digest()
        if items:
            try:
                self.core.answered(await self._up(items))
                self.core.delivered(items)
            except (ray.exceptions.RayError, WaitTimeout) as exc:
                log.warning("digest_failed", error=str(exc)[:300])
                self.core.put_back(items)
                self._waiting = waiting + self._waiting
                return
        for done in waiting:
            if not done.done():
                done.set_result(None)
        if self.core.changed:
            self._write_record()

    def _write_record(self) -> None:
        """The state record, replaced atomically (a crash leaves the old one or the new)."""
        tmp = self._record_path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.core.record()))
            os.replace(tmp, self._record_path)
        except OSError as exc:
            log.warning("agent_record_not_written", error=str(exc))
