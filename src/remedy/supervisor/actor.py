"""The supervisor: a named, detached Ray actor that runs the ranks and answers their reports.

It feeds what comes in (the ranks' reports and ends, an operator's stop) to
the run's core (`control.run_core.RunCore`), writes the core's record to
journal.wal (`supervisor.state_records`) and hands the effects to the
`Carrier` (`supervisor.carry`), which carries them out in order. Ranks call
`report` with each batch and get back the commands they owe; `start` begins
the control loop (`supervisor.control_loop`), which runs inside the actor
until every rank has finished, then the summary is written; drivers loop on
`wait`. Being an async actor, it serves calls while the loop runs, on one
event loop, so the core needs no locks.

`launch_supervisor` creates it as `remedy-supervisor-<run_id>` in the
`remedy` namespace, detached, with unbounded restarts and task retries. When
Ray restarts it after a crash, the constructor rebuilds the core from the
last state record (`supervisor.resume`) and resumes the loop by itself; calls
that were in flight are retried by Ray against the new instance, and reports
are deduplicated by (rank, incarnation, seq).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Any, TypeGuard

import ray
import structlog
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from remedy.control.decide import Controller
from remedy.control.end_check import may_end
from remedy.control.hang_watch import HangWatch, HangWatchConfig
from remedy.control.health import final_status
from remedy.control.job import JobStateMachine
from remedy.control.run_core import Ended, Ending, OperatorStop, Report, RunCore, Status
from remedy.control.sightings import Sightings
from remedy.control.slots import RankSlots
from remedy.policies import Engine
from remedy.protocol.spec import NAMESPACE, RunSpec, supervisor_name
from remedy.rank.link import liveness
from remedy.rank.loop.logs import configure_logging
from remedy.rank.loop.metrics import RayBackend, RunMetrics
from remedy.rundir.claim import MARKER, note_supervisor
from remedy.rundir.write_errors import RunDirWriteError
from remedy.rundir.writer import RunDir
from remedy.supervisor import carry, resume, status_view
from remedy.supervisor.agents_start import NodeAgents
from remedy.supervisor.carry import Carrier
from remedy.supervisor.carry_control import RankNodes, carry_control
from remedy.supervisor.control_loop import ControlLoop
from remedy.supervisor.feed import Feed
from remedy.supervisor.intake import Intake
from remedy.supervisor.policy_apply import PolicyApplier
from remedy.supervisor.policy_source import load_policy_source
from remedy.supervisor.quiet_gc import quiet_gc
from remedy.supervisor.state_records import StateRecords
from remedy.supervisor.summary import end_summary
from remedy.supervisor.token_check import TokenCheck
from remedy.supervisor.worker_group import WorkerGroup

log = structlog.get_logger("remedy.supervisor")

# How long an ended run's supervisor stays for late callers (`wait`, `status`,
# `attach`) before it removes itself; a driver that waited kills it at once.
LINGER_S = 60.0


def launch_supervisor(spec: RunSpec) -> Any:
    """Create the supervisor of `spec` (named, detached, restarted by Ray after a crash).

    It runs on the node of the process that calls this (`remedy run`'s), and Ray
    restarts it there: the ranks go to the other nodes (`supervisor.placement`).
    """
    home = ray.get_runtime_context().get_node_id()
    return SupervisorActor.options(  # type: ignore[attr-defined]
        name=supervisor_name(spec.run_id),
        namespace=NAMESPACE,
        lifetime="detached",
        max_restarts=-1,
        max_task_retries=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(home, soft=False),
    ).remote(spec.to_dict())


# Ray records every call of an actor as task events for its dashboard and state API, each
# sent to the GCS, which keeps 100,000 in all and drops the rest. The supervisor takes a call
# per rank report (or per node agent's digest): hundreds a second for weeks, which would
# flood that table and pay the recording on each call. Its calls are journaled by remedy.
@ray.remote(num_cpus=0, enable_task_events=False)  # type: ignore[call-overload]
class SupervisorActor:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = RunSpec(**spec)
        configure_logging(verbose=self.spec.verbose)
        self.run_dir = RunDir(self.spec.run_dir, self.spec.run_id)
        back = resume.read_back(self.spec, self.run_dir)  # journal.wal, and who this one is
        incarnation = 1 + back.lineage.lives
        try:
            note_supervisor(self.run_dir.path, incarnation, os.getpid())
        except OSError as exc:  # the loop ends the run on it, with the summary elsewhere
            self.run_dir.broken = self.run_dir.broken or RunDirWriteError(
                self.run_dir.path / MARKER, exc
            )
        policy = load_policy_source(self.spec.policy)
        engine = Engine(
            policy, run_id=self.spec.run_id, dry_run=self.spec.dry_run, incarnation=incarnation
        )
        self.applier = PolicyApplier(self.spec, self.run_dir, engine, policy)
        # Its effects (journal lines, group actions, notifications) go by `_carry_control`.
        controller = Controller(
            engine, world_size=self.spec.workers, group_actions=True, notify=True,
            started=time.time(),
            nodes=RankNodes(lambda rank: status_view.node_of(self._pids(), self.slots, rank),
                            self.spec.workers),
        )  # fmt: skip
        # The run's state record and its ranks' ends, with the controller, the job's state
        # machine and the rank slots (incarnations): what `write_state` records.
        self.core = RunCore(
            controller,
            JobStateMachine(max_targeted=self.spec.max_targeted_restarts),
            RankSlots(self.spec.workers, rejected=controller.rejected),
            incarnation=incarnation, started=time.time(),
            watch=HangWatch(HangWatchConfig(**self.spec.hang_watch)),  # type: ignore[arg-type]
        )  # fmt: skip
        self.feed = Feed(self.spec.workers)  # what displays poll (see `events`)
        self.metrics = RunMetrics(
            RayBackend(), run_id=self.spec.run_id, checkpoints=self.run_dir.checkpoints
        )
        self.carrier = Carrier(self.core, self.feed, self.metrics, self.run_dir,
                               control=self._carry_control)  # fmt: skip
        self.records = StateRecords(self.core, self.run_dir)
        self.tokens = TokenCheck(self.spec.token, self.spec.run_id, self.core, self.run_dir)
        # The hang watch is the core's (its entries are the record's); the node agents'
        # sightings and the agents are the shell's, as the control loop and its group are.
        self.watch = self.core.watch
        self.sightings = Sightings()
        self.agents = NodeAgents(self.spec, self.run_dir)
        self.loop = ControlLoop(
            self.spec, self.core, self.carrier, run_dir=self.run_dir, agents=self.agents,
            applier=self.applier, records=self.records, sightings=self.sightings,
            write_state=self.write_state, crash_point=self.crash_point,
        )  # fmt: skip
        self._agent_ranks: dict[str, set[int]] = {}  # agent (node) -> the ranks it sent
        # The control loop and its end.
        self._task: asyncio.Task[None] | None = None
        self._done = asyncio.Event()
        self._summary: dict[str, Any] | None = None
        self.intake = Intake(
            self._take_items,
            lambda: self._keep_state(before_reply=True),
            lambda ranks: self.controller.commands_for_ranks(sorted(ranks)),
        )
        if back.lineage.lives:
            self._summary = resume.restore(self.core, self.run_dir, back, self.spec.run_id)
            if self._summary is not None:
                self._done.set()  # the run had ended: `start` answers, then leaves
            resume.took_over(self.core, self.run_dir, back)
            # Nobody else will call `start` on a restarted supervisor: call it ourselves,
            # so the loop resumes with no driver around.
            ray.get_runtime_context().current_actor.start.remote()
        quiet_gc()

    @property
    def controller(self) -> Controller:
        return self.core.controller

    @property
    def slots(self) -> RankSlots:
        return self.core.slots

    @property
    def group(self) -> WorkerGroup | None:
        """The worker group, once the control loop started it."""
        return self.loop.group

    @property
    def state(self) -> str:
        """What `remedy status` says: starting, running, or how the run ended (its status).

        Read from the run, not kept beside it: the job's own phases are `self.core.job`'s."""
        if self._summary is not None:
            return str(self._summary.get("status"))
        return "running" if self.group is not None else "starting"

    def _pids(self) -> status_view.Pids:
        return self.group.pids if self.group is not None else {}

    def _carry_control(self) -> None:
        """Carry out what the controller and the job's state machine asked (`carry_control`);
        a job move is journaled with a state record after it, so a supervisor restarted from
        here resumes from the new phase."""
        if carry_control(
            self.controller, self.core.job, self.run_dir,
            notify=lambda effect: carry.notify(self.applier.notifier, self._pids(), effect),
            group_action=lambda d: carry.group_action(self.carrier.recovery, d),
        ):  # fmt: skip
            self.write_state()

    def write_state(self, *, before_reply: bool = False) -> None:
        """A state record in journal.wal: what a restarted supervisor resumes from
        (`StateRecords.write`; every section is the core's)."""
        self._carry_control()  # its journal lines go first
        self.records.write(before_reply=before_reply)

    def _keep_state(self, *, before_reply: bool = False) -> None:
        """A state record if the controller promised something new since the last one."""
        if self.records.owed():
            self.write_state(before_reply=before_reply)

    def crash_point(self, point: str) -> None:
        """Chaos: SIGKILL this process at `point` if the spec asks for it (once per run).

        The state record comes first, as it would before any effect, so the
        crash tests what a restarted supervisor makes of it; it says the point
        was passed (`RunRecord.crashed`).
        """
        if not self.core.crash_due(point, self.spec.crash_points):
            return
        self.write_state()
        log.warning("crash_injected", point=point)
        os.kill(os.getpid(), signal.SIGKILL)

    async def apply_policy(
        self, data: bytes | str, filename: str, token: str | None = None
    ) -> list[str]:
        """Validate and swap in a new policy atomically; return its errors (old policy kept) or [].

        `data` is untrusted (whatever was saved in the file): every failure is a
        refusal, journaled with its errors, never an exception out of here. A
        caller without the run's token is refused (`Unauthorized`).
        """
        self.tokens.require(token, "apply_policy")
        if self.applier.watched is not None:
            self.applier.watched.forget()
        return self.applier.apply(data, filename)

    async def report(self, batch: Any) -> list[dict[str, Any]] | dict[str, Any]:
        """A rank's report batch in; the commands that rank still owes out.

        To a batch `holding` a flagged step's tick (workers.flag_hold) the reply is
        {"commands": ..., "settled": tick or None}: whether every decision on it is taken.

        A batch without the run's token, or from a replaced incarnation (still
        in flight from a killed process), is refused and counted. Displays,
        dashboards and the hang watch see only what the controller accepted of a
        batch.
        """
        if not self.tokens.ok(batch.pop("token", None) if isinstance(batch, dict) else None,
                              "report"):  # fmt: skip
            return []
        answer = self.carrier.took(self.core.step(Report(batch, now=time.time())), gauges=True)
        if answer is None:
            return []  # refused (its slot or the controller): nothing owed, nothing taken
        commands = self.controller.commands_for(answer.rank)
        if answer.retried:
            return commands  # seen already: answered again, not taken again
        self._keep_state(before_reply=True)  # no rank holds a command the journal lacks
        holding = batch.get("holding") if isinstance(batch, dict) else None
        if self.controller.last_report is not None and _a_tick(holding):
            # A rank holding at a flagged step's boundary (workers.flag_hold): say whether
            # every decision on that step is taken (its commands are in this reply).
            final = batch.get("final") is True  # at its last step: nothing may be owed
            done = self.settled_now(holding, final=final)
            return {"commands": commands, "settled": holding if done else None}
        return commands

    def settled_now(self, tick: int, *, final: bool = False) -> bool:
        """Whether every decision on the step executed at `tick` is taken (`Controller.settled`);
        `final`: ranks at their last step, to whom nothing may be owed (`control.end_check`)."""
        return may_end(self.controller, tick) if final else self.controller.settled(tick)

    async def settled(self, token: Any, tick: Any, rank: Any, final: Any = False) -> dict[str, Any]:
        """A node agent asks for `rank`, holding at a flagged step's boundary (workers.flag_hold)
        or at its last step (`final`, rank.link.end_hold): whether `tick` is settled, and the
        commands `rank` owes, read at the same moment (a decision taken on another node's
        report is in them once it is settled)."""
        if not self.tokens.ok(token, "settled") or not _a_tick(tick) or type(rank) is not int:
            return {"settled": False, "commands": []}
        # A command decided in a call still waiting for its record: one record, shared by
        # the calls waiting together (agents' reports have theirs from `Intake`).
        await self.records.commit(lambda: self._keep_state(before_reply=True))
        done = self.settled_now(tick, final=final is True)
        return {"settled": done, "commands": self.controller.commands_for(rank)}

    async def report_many(self, token: Any, node: Any, items: Any) -> dict[int, list[Any]]:
        """A node agent's call: many ranks' reports in one (`supervisor.agent`).

        Each item is one rank's: its newest header, its events and outcomes,
        its digested step records, and `seqs`, the batch numbers it stands for,
        each taken once by the rank's slot (an item all of whose numbers were
        seen is a duplicate: answered, not ingested again). Returns each item's
        rank -> the commands that rank owes, after every item was taken (a later
        item's event may decide a command for an earlier item's rank), for every
        rank this node's agent has sent: a command decided on another node's
        report reaches this node's ranks with this answer. The step records are
        in the agent's own metrics file already.
        """
        if not self.tokens.ok(token, "report_many") or not isinstance(items, list):
            return {}
        # An anomaly's call is taken ahead of the digests waiting; every call is answered
        # after a state record that covers it: no rank holds a command the journal lacks.
        return await self.intake.call(str(node)[:64], items[: self.spec.workers])

    def _take_items(self, node: str, items: list[Any]) -> set[int]:
        """Take one agent call's items (`Intake`); the ranks its answer covers: every rank
        this node's agent has sent (a command decided on another node's report reaches
        this node's ranks with it)."""
        answer = self._agent_ranks.setdefault(node, set())
        for item in items:
            took = self.carrier.took(self.core.step(Report(item, node, time.time())), gauges=False)
            if took is not None:
                answer.add(took.rank)
        return answer

    async def hang_seen(self, token: Any, node: Any, items: Any) -> None:
        """A node agent suspected one of its ranks and pinged its ranks: what it saw.

        Kept for the hang check (`Recovery.check_hangs`), which names the hung
        or dead rank over every agent's sightings; here only a ping answered from
        inside a rank's loop moves the hang watch, as the supervisor's own pings do.
        """
        if not self.tokens.ok(token, "hang_seen"):
            return
        now = time.monotonic()
        for s in self.sightings.add(str(node)[:64], items, now):
            slot = self.slots.slots.get(s.rank)
            if slot is not None and s.incarnation == slot.incarnation:
                self.watch.answered(s.rank, s.ping, now)

    async def rank_names(self, token: Any, ranks: Any) -> dict[int, tuple[int, str | None]]:
        """A node agent's ask: each rank's current incarnation and its actor's name."""
        if not self.tokens.ok(token, "rank_names") or not isinstance(ranks, list):
            return {}
        names = self.group.names if self.group is not None else {}
        return {
            r: (self.slots.incarnation(r), names.get(r))
            for r in ranks[: self.spec.workers]
            if type(r) is int and r in self.slots.slots
        }

    async def chaos_kill_node(self, token: Any, rank: int, node_id: str) -> dict[str, Any]:
        """Chaos (`kill_node`): may `rank` kill its node `node_id`? Journaled, either way, first.

        Never the node this supervisor runs on, nor the cluster's head node
        (`carry.kill_node_verdict`).
        """
        self.tokens.require(token, "chaos_kill_node")
        record = carry.kill_node_verdict(rank, node_id, self.slots.on_node(node_id))
        self.run_dir.history(record)
        log.warning("chaos_kill_node", **{k: v for k, v in record.items() if k != "type"})
        return {"kill": record["outcome"] == "killing", "reason": record["reason"]}

    async def where(self) -> tuple[str, int, float]:
        """(node address, pid, process start time) of this supervisor's process: what a watcher
        kills when it stops answering (`supervisor.liveness`), and the `kill_supervisor` fault."""
        ident = liveness.Identity.of_this_process(ray.util.get_node_ip_address())
        return ident.node, ident.pid, ident.created

    async def note_outage(self, token: str | None, note: Any) -> dict[str, Any] | None:
        """The driver saw this supervisor not answering, and answering again: journal it.

        Returns the summary (with the outage) if the run has ended, else None.
        """
        self.tokens.require(token, "note_outage")
        self.carrier.outage_notes([note])
        if self._summary is not None:
            # The run ended before the note came (the driver learns of the end from the
            # answer that ends its outage): the summary gets it too.
            self._summary = {**self._summary, **status_view.outage_fields(self.run_dir.path)}
            with contextlib.suppress(OSError):
                self.run_dir.write_summary(self._summary)
        return self._summary

    async def output(self, lines: Any) -> None:
        """Lines the ranks printed, for the displays and the run directory."""
        self.feed.output(lines)
        carry.keep_output(self.run_dir, lines)

    async def events(
        self, cursor: int, token: str | None = None
    ) -> tuple[list[dict[str, Any]], int]:
        """Display events after `cursor` (output, anomalies, decisions, then progress)."""
        self.tokens.require(token, "events")
        self.feed.decisions(self.controller.decisions)
        return self.feed.since(cursor, status_view.progress_fields(self.state, self.core))

    async def status(self, token: str | None = None) -> dict[str, Any]:
        """The run's state, step per rank, counts and the policy in force."""
        self.tokens.require(token, "status")
        return status_view.status(self.spec.run_id, self.state, self.core, self._pids())

    def rank_nodes(self) -> dict[str, str]:
        """rank -> the node label of its current process (`placement.label`), where known."""
        return status_view.rank_nodes(self._pids(), self.slots)

    async def stop(self, token: str | None = None, reason: str = "stopped") -> dict[str, Any]:
        """An operator's stop: a final checkpoint on every rank, then a clean end (`stopped`).

        Returns `{"stopping": bool, "state": ...}`: False when the run has ended
        already or a stop or policy abort is under way.
        """
        self.tokens.require(token, "stop")
        text = " ".join(str(reason).split())[:200] or "stopped"
        stopping = self.state in ("starting", "running") and bool(
            self.core.step(OperatorStop(text))
        )
        if stopping:
            log.warning("stop_requested", reason=text)
            self.run_dir.history({"type": "stop_requested", "reason": text})
        return {"stopping": stopping, "state": self.state}

    async def start(self) -> None:
        """Begin the run (idempotent); returns at once. The loop runs inside this actor."""
        if self._task is None and not self._done.is_set():
            self._task = asyncio.get_running_loop().create_task(self._control())
        elif self._task is None:  # restarted after its run had ended: answer, then leave
            self._task = asyncio.get_running_loop().create_task(asyncio.sleep(0))
            carry.exit_later(LINGER_S)

    async def wait(self, timeout_s: float) -> dict[str, Any] | None:
        """The run's summary once it ended, else None after `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._done.wait(), timeout=max(0.0, timeout_s))
        return self._summary

    async def _control(self) -> None:
        try:
            summary = await self._loop()
        except Exception as exc:
            # Its own files (a full disk, a read-only or deleted directory), or a supervisor
            # bug: end the run as failed, and say why.
            io_error = isinstance(exc, OSError)
            if io_error:
                log.error("run_dir_not_writable", error=str(exc))
                error = str(exc)
            else:
                log.exception("supervisor_failed")
                error = f"the supervisor failed: {exc!r}"
            try:
                summary = self._finish(error=error, io_error=io_error)
            except Exception:  # drivers waiting on `wait` must still get an answer
                log.exception("summary_failed")
                summary = {"run_id": self.spec.run_id, "status": "failed", "error": error}
                if io_error:
                    summary["io_error"] = error
        self._summary = summary
        self._done.set()
        carry.exit_later(LINGER_S)

    async def _loop(self) -> dict[str, Any]:
        self.run_dir.check()  # a run directory that cannot be written: no run
        # Restarted after every rank had ended (their actors are gone): just finish.
        if not self.core.ranks_ended:
            await self.loop.run()
        return self._finish()

    def _finish(self, error: str | None = None, *, io_error: bool = False) -> dict[str, Any]:
        """End the run: its summary, written to the run directory or, where that cannot be
        written (`io_error`: the error is its one line), to `write_errors.fallback_dir`."""
        # A run ending on its run directory's error writes no more state records (each would
        # fail the same way); the summary goes where it can.
        self.records.unwritable = io_error and self.run_dir.broken is not None
        self.controller.finish()
        self._carry_control()
        results = [self.core.results[r] for r in sorted(self.core.results)]
        [ending] = self.core.step(Ending(error))
        self._carry_control()  # the job's last move, journaled before the run's end
        assert isinstance(ending, Status)
        notifier = self.applier.notifier
        notifier.close()  # deliveries still queued get a last chance, then are journaled
        # A run that completed with a rank that stopped learning is degraded (control.health).
        summary = end_summary(
            self.spec, self.core, results, final_status(ending.status, results),
            ended=time.time(), run_path=self.run_dir.path, group=self.group,
            recovery=self.carrier.recovery, sightings=self.sightings,
            notifications=notifier.counts,
        )  # fmt: skip
        self.metrics.goodput(self.controller.goodput, self.core.started, force=True)
        if error is not None:
            summary["error"] = error
        if io_error:
            summary["io_error"] = error
            summary["lines_not_written"] = self.run_dir.dropped
        written = self.run_dir.write_summary(summary)
        self.run_dir.history({"type": "run_ended", "status": summary["status"]})
        self.core.step(Ended(summary["status"]))
        self.write_state()
        self.run_dir.close()
        if written.parent != self.run_dir.path:
            summary["summary_file"] = str(written)  # for the driver to say where it went
        self._summary = summary
        return summary


def _a_tick(value: Any) -> TypeGuard[int]:
    """A tick a rank may name (an int, not a bool, within what JSON carries exactly)."""
    return type(value) is int and 0 <= value < 2**53
