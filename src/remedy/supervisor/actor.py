"""The supervisor: a named, detached Ray actor that runs the ranks and answers their reports.

It owns the worker group and the `Controller` (engine, journal, command
queue). Ranks call `report` with each batch and get back the commands they
owe. `start` begins the control loop, which runs inside the actor: it
starts the group, watches it until every rank has finished, and writes the
summary; drivers loop on `wait`. Being an async actor, it serves reports
while the loop runs, on one event loop, so controller state needs no locks.

`launch_supervisor` creates it as `remedy-supervisor-<run_id>` in the
`remedy` namespace, detached, with unbounded restarts and task retries. Its
state lives in `journal.wal`, which holds nothing else (`supervisor.core.run_state`):
a state record is written before any reply that carries a new promise
leaves, at each move of the job's state, and every `STATE_EVERY_S`; what it
did along the way goes to `history.jsonl`. When Ray restarts the actor after
a crash, the constructor runs again with the same spec, finds that the run
had started, rebuilds itself from the last state record, and resumes the
loop by itself: it finds the rank actors again by name, learns from their
`result()` which finished meanwhile, and carries on. Calls that were in
flight (reports, `wait`) are retried by Ray against the new instance;
reports are deduplicated by (rank, incarnation, seq).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import secrets
import signal
import threading
import time
from pathlib import Path
from typing import Any, TypeGuard

import ray
import structlog
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from remedy.control import decide_state as control_state
from remedy.control import progress_marks, stuck_at
from remedy.control.decide import Controller
from remedy.control.effects import Notify, log_notify
from remedy.control.end_check import may_end
from remedy.control.hang_watch import DEAD, HangWatch, HangWatchConfig, step_times
from remedy.control.health import final_status
from remedy.control.identity import Lineage, RankResume, journal_behind, plan_resume, with_rank_ids
from remedy.control.job import (
    JobState,
    JobStateMachine,
    Phase,
)
from remedy.control.record import RunRecord, StateLog
from remedy.control.run_core import (
    Answer,
    BatchesLost,
    Dropped,
    Effect,
    Ended,
    Ending,
    GroupStarted,
    Joined,
    NotReplaced,
    OperatorStop,
    OutageNotes,
    Pass,
    RankDied,
    RankEnded,
    RankReturned,
    RanksAllEnded,
    ReplacementFailed,
    Report,
    RunCore,
    Status,
    StopAsked,
    Taken,
    ToPolicy,
    Watching,
)
from remedy.control.sections import GroupSection
from remedy.control.sightings import Sightings
from remedy.control.slots import RankSlots
from remedy.policies import Decision, Engine, Policy, PolicyError
from remedy.protocol.exceptions import Unauthorized
from remedy.protocol.spec import NAMESPACE, RunSpec, supervisor_name
from remedy.rank.link import liveness
from remedy.rank.loop.logs import configure_logging
from remedy.rank.loop.metrics import RayBackend, RunMetrics
from remedy.rundir.claim import MARKER, claimed_supervisors, note_supervisor
from remedy.rundir.journals import goodput_of, last_written, read_journal
from remedy.rundir.write_errors import RunDirWriteError
from remedy.rundir.writer import RunDir
from remedy.supervisor import placement
from remedy.supervisor.agent.actor import alive_nodes, kill_agents, launch_agents
from remedy.supervisor.carry_control import RankNodes, carry_control
from remedy.supervisor.death_cause import describe
from remedy.supervisor.feed import Feed
from remedy.supervisor.intake import Intake
from remedy.supervisor.lineage import (
    applied_ids,
    ask_ranks,
    death_of,
    take_over,
    was_restarted,
)
from remedy.supervisor.lineage import read_lineage as lineage_of
from remedy.supervisor.node_watch import ASK_TIMEOUT_S, NodeWatch, verdict_window_s
from remedy.supervisor.node_watch import POLL_S as NODE_POLL_S
from remedy.supervisor.notify import NOTIFICATIONS_FILE, Notifier, env_sinks
from remedy.supervisor.policy_source import (
    PolicyWatch,
    is_policy_file,
    load_policy_source,
    policy_from_bytes,
)
from remedy.supervisor.recovery import Recovery
from remedy.supervisor.rendezvous import Rendezvous
from remedy.supervisor.worker_group import WorkerGroup, kill_run_actors

log = structlog.get_logger("remedy.supervisor")

POLL_S = 0.05
# A state record at least this often, besides the one before each new promise
# (which keeps it exact; this one only refreshes steps and losses).
STATE_EVERY_S = 30.0
# How often a restarted supervisor asks the ranks it adopted whether they finished.
RESULT_POLL_S = 0.5
# A refused policy's errors journaled (and returned) at most; the count is logged in full.
MAX_REFUSAL_LINES = 50
# How long an ended run's supervisor stays for late callers (`wait`, `status`,
# `attach`) before it removes itself; a driver that waited kills it at once.
LINGER_S = 60.0
# How long the node agents may take to start.
AGENT_START_S = 120.0
# How often the supervisor looks for nodes that joined the cluster after its agents started.
NEW_NODES_S = 2.0
# Decisions `status` shows, newest last.
RECENT_DECISIONS = 5


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


# The supervisor's collector: the youngest generation is collected after this many net
# allocations (CPython's default is 700). See `_quiet_gc`.
GC_YOUNG = 50_000


def _quiet_gc() -> None:
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
        self._skipped: list[int] = []  # journal.wal's lines skipped as damaged
        self._unwritable = False  # ending on the run directory's write error: no state records
        journal = read_journal(self.run_dir.path / "journal.wal", self._skipped)
        state, tail = control_state.split_at_last_state(journal)
        run = RunRecord.from_record(state) if state is not None else None  # older ones migrated
        older = control_state.older_tail(journal, tail)
        # Supervisors of this run before this one, by the highest count of any source that
        # remembers (`control.identity`): the newest state record's (or, in a journal of
        # schema 7 or older, its `supervisor_started` records), the claim, the decision ids
        # given, Ray; where the journal is lost or behind, the ranks too. 0 for a new run.
        lineage, self._takeover = self._lineage(
            max(run.incarnation if run is not None else 0, older.lives),
            run.controller.get("seq", 0) if run is not None else 0,
        )
        lives = lineage.lives
        incarnation = 1 + lives
        try:
            note_supervisor(self.run_dir.path, incarnation, os.getpid())
        except OSError as exc:  # the loop ends the run on it, with the summary elsewhere
            self.run_dir.broken = self.run_dir.broken or RunDirWriteError(
                self.run_dir.path / MARKER, exc
            )
        policy = load_policy_source(self.spec.policy)
        engine = Engine(
            policy,
            run_id=self.spec.run_id,
            dry_run=self.spec.dry_run,
            incarnation=incarnation,
        )
        self.notifier = self._notifier(policy)
        controller = Controller(
            engine,
            world_size=self.spec.workers,
            # Its effects are carried out by `_carry_control`: a group action by
            # `_group_action`, a `notify` decision's by `_notify` (logged, and queued for the
            # policy's sinks and REMEDY_NOTIFY_WEBHOOK, see `supervisor.notify`).
            group_actions=True,
            notify=True,
            started=time.time(),
            nodes=RankNodes(self._node_of, self.spec.workers),
        )
        # The run's state record and its ranks' ends, with the controller, the job's state
        # machine and the rank slots (incarnations): what `write_state` records.
        self.core = RunCore(
            controller,
            JobStateMachine(max_targeted=self.spec.max_targeted_restarts),
            RankSlots(self.spec.workers, rejected=controller.rejected),
            incarnation=incarnation,
            started=time.time(),
            watch=HangWatch(HangWatchConfig(**self.spec.hang_watch)),  # type: ignore[arg-type]
        )
        self.feed = Feed(self.spec.workers)  # what displays poll (see `events`)
        self.metrics = RunMetrics(
            RayBackend(), run_id=self.spec.run_id, checkpoints=self.run_dir.checkpoints
        )
        # Multi-rank lifecycle: the rendezvous store, the hang watch (the core's: its entries
        # are the record's), and targeted restarts.
        self.watch = self.core.watch
        self.node_watch = NodeWatch()
        # Under node agents: what the agents saw when they pinged their ranks (core.sightings).
        self.sightings = Sightings()
        self.rendezvous = Rendezvous()
        self.group: WorkerGroup | None = None
        self.recovery: Recovery | None = None
        # A policy given as a file is watched: saving it applies it to the running job.
        self._watched = (
            PolicyWatch(Path(self.spec.policy)) if is_policy_file(self.spec.policy) else None
        )
        self._token_refusals: dict[str, int] = {}  # refused calls by method, for the journal
        self._token_journaled: dict[str, int] = {}
        # The control loop and its end.
        self._task: asyncio.Task[None] | None = None
        self._done = asyncio.Event()
        self._summary: dict[str, Any] | None = None
        self._state_changes = -1  # controller changes covered by the last state record
        self._state_log = StateLog()  # full state records, and deltas between them
        self._state_at = 0.0
        self.agent_nodes: list[str] = []  # nodes with an agent of this run (or one starting)
        self.agent_handles: dict[str, Any] = {}  # node id -> its agent, once started
        self._new_nodes_at = 0.0  # when to look for nodes that joined since (`_agents_for_new`)
        self._agents_starting: set[asyncio.Task[None]] = set()
        self._agent_ranks: dict[str, set[int]] = {}  # agent (node) -> the ranks it sent
        self._committing: asyncio.Future[None] | None = None  # the state record calls await
        self.intake = Intake(
            self._take_items,
            lambda: self._keep_state(before_reply=True),
            lambda ranks: self.controller.commands_for_ranks(sorted(ranks)),
        )
        if lives:
            self._restore(run, older, tail)
            self._took_over(lineage)
            # Nobody else will call `start` on a restarted supervisor: call it ourselves,
            # so the loop resumes with no driver around.
            ray.get_runtime_context().current_actor.start.remote()
        _quiet_gc()

    @property
    def controller(self) -> Controller:
        return self.core.controller

    @property
    def job(self) -> JobStateMachine:
        return self.core.job

    @property
    def slots(self) -> RankSlots:
        return self.core.slots

    @property
    def incarnation(self) -> int:
        return self.core.incarnation

    @property
    def started(self) -> float:
        return self.core.started

    @property
    def state(self) -> str:
        """What `remedy status` says: starting, running, or how the run ended (its status).

        Read from the run, not kept beside it: the job's own phases are `self.job`'s."""
        if self._summary is not None:
            return str(self._summary.get("status"))
        return "running" if self.group is not None else "starting"

    # ------------------------------------------------------------ restore
    def _lineage(
        self, journal_lives: int, journal_seq: int
    ) -> tuple[Lineage, tuple[RankResume | None, dict[str, Any]] | None]:
        """Who this supervisor is (`control.identity`), and, where journal.wal is lost or
        older than the run, what the ranks told (a plan to take them over, or None, and the
        journal record saying so)."""
        lineage = lineage_of(self.run_dir.path, journal_lives, restarted=was_restarted())
        if not lineage.lives:
            return lineage, None
        answers = ask_ranks(self.spec.run_id)
        lineage = with_rank_ids(lineage, applied_ids(answers))
        behind = journal_behind(journal_seq, answers)
        if not (lineage.journal_lost or behind):
            return lineage, None
        plan = plan_resume(self.spec.workers, answers)
        record: dict[str, Any] = {
            "type": "journal_lost",
            "why": "journal.wal is older than the run" if behind and not lineage.journal_lost
            else "journal.wal holds fewer supervisors than the run had",
            "sources": lineage.sources(),
            "ranks_answered": sorted(answers),
            "resumed_from_ranks": plan is not None,
        }  # fmt: skip
        if plan is not None:
            record.update(generation=plan.generation, steps={str(r): s for r, s in plan.steps.items()},
                          command_seq=plan.command_seq)  # fmt: skip
        return lineage, (plan, record)

    def _took_over(self, lineage: Lineage) -> None:
        """Journal how the supervisor before this one died (as Ray says) and how this one knew
        it was not new; take the ranks over where the journal was lost or behind and they
        could say where they are."""
        pid = claimed_supervisors(self.run_dir.path).get(lineage.lives)
        death = death_of(pid) if pid is not None else describe(None, None, (False, None))
        self.run_dir.history({
            "type": "supervisor_died", "incarnation": lineage.lives, "pid": pid, **death,
        })  # fmt: skip
        if self._takeover is None:
            return
        plan, record = self._takeover
        if plan is not None:
            take_over(self.core, plan)
        record["incarnation"] = lineage.incarnation
        self.run_dir.history(record)
        log.warning("journal_lost", **{k: v for k, v in record.items() if k != "type"})

    def _restore(self, run: RunRecord | None, older: control_state.OlderTail,
                 tail: list[dict[str, Any]]) -> None:  # fmt: skip
        """Rebuild from journal.wal's newest state record (`run`; and, from a journal of
        schema 7 or older, what `older` and `tail` hold besides)."""
        ended = run.ended if run is not None and run.ended is not None else older.ended
        if ended is not None:
            self.core.ended = ended
            self._summary = {"status": ended, **self._read_summary(ended)}
            self._done.set()
            return
        c = self.controller
        if run is not None:
            self.core.restore(run, time.time())
        if not self.core.ranks_ended and older.ranks_ended is not None:
            self.core.results_ended(older.ranks_ended)
        abandoned = control_state.replay_tail(c, tail)  # a journal of schema 7 or older
        if older.job is not None:
            self.job.state = JobState.from_dict(older.job)
        c.restore_decisions(read_journal(self.run_dir.path / "decisions.jsonl"))
        abandoned += control_state.abandoned(c, read_journal(self.run_dir.path / "history.jsonl"))
        # The goodput ledger from the journals; the outage, from when the supervisor that
        # died last wrote something (a report's metrics, a journal record) until now.
        c.goodput = goodput_of(self.run_dir.path)
        heard = [last_written(self.run_dir.path / n)
                 for n in ("metrics.jsonl", "journal.wal", "history.jsonl")]  # fmt: skip
        back = time.time()
        down_since = max((t for t in heard if t is not None), default=back)
        outage = {
            "incarnation": self.incarnation,
            "down_since": round(down_since, 3),
            "back_at": round(back, 3),
            "down_s": round(max(back - down_since, 0.0), 3),
        }
        c.goodput.outage(outage)
        self.run_dir.history(
            {
                "type": "supervisor_restored",
                "incarnation": self.incarnation,
                "from_state": run is not None,
                "tail_records": len(tail),
                # Damaged lines of journal.wal skipped (line numbers, from 1).
                "skipped_records": list(self._skipped),
                "abandoned": sorted(set(abandoned)),
                "pending": sorted(c.pending),
                "job": self.job.state.to_dict(),
                "outage": outage,
            }
        )
        log.warning(
            "supervisor_restored",
            incarnation=self.incarnation,
            pending=len(c.pending),
            abandoned=len(abandoned),
        )

    def _carry_control(self) -> None:
        """Carry out what the controller and the job's state machine asked (`carry_control`);
        a job move is journaled with a state record after it, so a supervisor restarted from
        here resumes from the new phase."""
        if carry_control(self.controller, self.job, self.run_dir,
                         notify=self._notify, group_action=self._group_action):  # fmt: skip
            self.write_state()

    def _read_summary(self, status: str) -> dict[str, Any]:
        try:
            summary = json.loads((self.run_dir.path / "summary.json").read_text())
        except (OSError, ValueError):
            summary = None
        if not isinstance(summary, dict):
            summary = {"run_id": self.spec.run_id, "status": status}
        return summary

    def write_state(self, *, before_reply: bool = False) -> None:
        """A state record in journal.wal: what a restarted supervisor resumes from.

        `before_reply`: a call waits for it, so a full record that only bounds the
        journal's tail is put off to the loop's next pass (`StateLog.entry`).
        """
        self._carry_control()  # its journal lines go first
        if self._unwritable:
            return  # the run ends on its run directory's write error (`_finish`)
        # Every section is the core's: the group and the restart send theirs as they change.
        state = self.core.record(time.time())
        self.run_dir.wal(self._state_log.entry(state.to_record(), defer_full=before_reply))
        self._state_changes = self.controller.changes
        self._state_at = time.monotonic()

    def _keep_state(self, *, before_reply: bool = False) -> None:
        """A state record if the controller promised something new since the last one."""
        if self.controller.changes != self._state_changes:
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

    # ------------------------------------------------------------------ auth
    def _authorized(self, token: Any, call: str = "call") -> bool:
        """True for this run's token; a refusal is counted in `rejected["token"]` and journaled.

        The journal gets the 1st, 10th, 100th, ... refusal of each call: a flood
        of foreign batches must not flood the journal too.
        """
        if isinstance(token, str) and secrets.compare_digest(
            token.encode("utf-8", "replace"), self.spec.token.encode()
        ):
            return True
        rejected = self.controller.rejected
        rejected["token"] += 1
        self._token_refusals[call] = count = self._token_refusals.get(call, 0) + 1
        if count >= self._token_journaled.get(call, 0) * 10:
            self._token_journaled[call] = max(count, 1)
            log.warning("call_refused", call=call, reason="token", count=count)
            self.run_dir.history(
                {"type": "refused", "call": call, "reason": "token", "count": count}
            )
        return False

    def _require(self, token: Any, call: str) -> None:
        if not self._authorized(token, call):
            raise Unauthorized(f"{call} refused: not run {self.spec.run_id}'s token")

    async def apply_policy(
        self, data: bytes | str, filename: str, token: str | None = None
    ) -> list[str]:
        """Validate and swap in a new policy atomically; return its errors (old policy kept) or [].

        `data` is untrusted (whatever was saved in the file): every failure is a
        refusal, journaled with its errors, never an exception out of here. A
        caller without the run's token is refused (`Unauthorized`).
        """
        self._require(token, "apply_policy")
        if self._watched is not None:
            self._watched.forget()
        return self._apply_policy(data, filename)

    def _apply_policy(self, data: bytes | str, filename: str) -> list[str]:
        try:
            policy = policy_from_bytes(data, filename)
        except PolicyError as exc:
            return self._refuse(filename, exc)
        old = self.controller.engine.policy.name
        self.controller.engine.reload(policy)
        if policy.notify != self.notifier_sinks:
            # The old sinks finish what they hold in the background; new notifies go to the new.
            previous, self.notifier = self.notifier, self._notifier(policy)
            threading.Thread(target=previous.close, daemon=True).start()
        self.run_dir.history(
            {"type": "policy_reloaded", "file": filename, "from": old, "to": policy.name}
        )
        log.warning("policy_reloaded", file=filename, name=policy.name)
        return []

    async def _watch_policy(self) -> None:
        if self._watched is None:
            return
        try:
            saved = self._watched.poll()
        except PolicyError as exc:
            # Unreadable now (replaced by a folder, permissions): refuse, keep the old policy.
            self._refuse(str(self._watched.path), exc)
            return
        if saved is not None:
            self._apply_policy(*saved)

    def _refuse(self, filename: str, exc: PolicyError) -> list[str]:
        """Journal a refused policy (the one in force stays); its error lines, capped."""
        errors = [d.format() for d in exc.diagnostics][:MAX_REFUSAL_LINES]
        log.warning("policy_refused", file=filename, errors=len(exc.diagnostics))
        self.run_dir.history(
            {
                "type": "policy_refused",
                "file": filename,
                "kept": self.controller.engine.policy.name,
                "errors": errors,
            }
        )
        return errors

    async def report(self, batch: Any) -> list[dict[str, Any]] | dict[str, Any]:
        """A rank's report batch in; the commands that rank still owes out.

        To a batch `holding` a flagged step's tick (workers.flag_hold) the reply is
        {"commands": ..., "settled": tick or None}: whether every decision on it is taken.

        A batch without the run's token, or from a replaced incarnation (still
        in flight from a killed process), is refused and counted. Displays,
        dashboards and the hang watch see only what the controller accepted of a
        batch.
        """
        if not self._authorized(batch.pop("token", None) if isinstance(batch, dict) else None,
                                "report"):  # fmt: skip
            return []
        answer = self._took(self.core.step(Report(batch, now=time.time())), gauges=True)
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
        if not self._authorized(token, "settled") or not _a_tick(tick) or type(rank) is not int:
            return {"settled": False, "commands": []}
        await self._commit()  # a command decided in a call still waiting for its record
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
        if not self._authorized(token, "report_many") or not isinstance(items, list):
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
            took = self._took(self.core.step(Report(item, node, time.time())), gauges=False)
            if took is not None:
                answer.add(took.rank)
        return answer

    async def hang_seen(self, token: Any, node: Any, items: Any) -> None:
        """A node agent suspected one of its ranks and pinged its ranks: what it saw.

        Kept for the hang check (`Recovery.check_hangs`), which names the hung
        or dead rank over every agent's sightings; here only a ping answered from
        inside a rank's loop moves the hang watch, as the supervisor's own pings do.
        """
        if not self._authorized(token, "hang_seen"):
            return
        now = time.monotonic()
        for s in self.sightings.add(str(node)[:64], items, now):
            slot = self.slots.slots.get(s.rank)
            if slot is not None and s.incarnation == slot.incarnation:
                self.watch.answered(s.rank, s.ping, now)

    async def rank_names(self, token: Any, ranks: Any) -> dict[int, tuple[int, str | None]]:
        """A node agent's ask: each rank's current incarnation and its actor's name."""
        if not self._authorized(token, "rank_names") or not isinstance(ranks, list):
            return {}
        names = self.group.names if self.group is not None else {}
        return {
            r: (self.slots.incarnation(r), names.get(r))
            for r in ranks[: self.spec.workers]
            if type(r) is int and r in self.slots.slots
        }

    async def _commit(self) -> None:
        """A state record covering every change so far, shared by the calls waiting together
        (`settled`; agents' reports have theirs from `Intake`).

        Each call that needs one waits for one record written after it; the
        calls Ray has queued meanwhile are taken first, so under load one record
        answers many calls instead of one each.
        """
        if self.controller.changes == self._state_changes:
            return
        if self._committing is None:
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()
            self._committing = done

            def flush() -> None:
                self._committing = None
                try:
                    self._keep_state(before_reply=True)
                except Exception as exc:  # the waiting calls fail; their senders send again
                    done.set_exception(exc)
                else:
                    done.set_result(None)

            loop.call_soon(flush)
        await asyncio.shield(self._committing)

    def _took(self, effects: list[Effect], *, gauges: bool) -> Answer | None:
        """Carry out what the core made of one report (`Report`): the hang watch, a restart
        waiting on the group and the displays see what the controller accepted; returns
        whom to answer. `gauges=False`: an agent's item, whose per-rank gauges its agent set."""
        self._carry_control()
        answer = None
        for effect in effects:
            match effect:
                case Taken(rank, tick, report, ending, failed):
                    if ending:
                        self.watch.forget(rank)
                    if failed and self.recovery is not None:
                        self.recovery.alarm(rank)
                    valid = report.as_batch()
                    self.feed.observe(valid)
                    if gauges:
                        self.metrics.observe(valid)
                    self.metrics.goodput(self.controller.goodput, self.started)
                    self.watch.beat(rank, tick, time.monotonic(), step_times(report.metrics))
                    if self.recovery is not None:
                        self.recovery.progress(rank, tick)
                case Answer():
                    answer = effect
                case _:
                    self._carry([effect])
        self.feed.decisions(self.controller.decisions)
        self.metrics.decisions(self.controller.decisions)
        return answer

    async def chaos_kill_node(self, token: Any, rank: int, node_id: str) -> dict[str, Any]:
        """Chaos (`kill_node`): may `rank` kill its node `node_id`? Journaled, either way, first.

        Never the node this supervisor runs on, nor the cluster's head node: the
        fault takes a worker node away, as a real node loss does.
        """
        self._require(token, "chaos_kill_node")
        home = ray.get_runtime_context().get_node_id()
        listing = {str(n.get("NodeID")): n for n in ray.nodes()}
        node = listing.get(node_id, {})
        name = placement.label(node_id, node.get("NodeManagerAddress"))
        reason = f"rank {rank} asked to kill its node {name}"
        if node_id == home:
            kill, reason = False, f"{reason}: refused, the supervisor runs on that node"
        elif "node:__internal_head__" in (node.get("Resources") or {}):
            kill, reason = False, f"{reason}: refused, it is the cluster's head node"
        else:
            kill = True
        record = {
            "type": "chaos_kill_node", "rank": rank, "node": name, "node_id": node_id,
            "ranks": self.slots.on_node(node_id), "outcome": "killing" if kill else "refused",
            "reason": reason, "at": round(time.time(), 4),
        }  # fmt: skip
        self.run_dir.history(record)
        log.warning("chaos_kill_node", **{k: v for k, v in record.items() if k != "type"})
        return {"kill": kill, "reason": reason}

    async def where(self) -> tuple[str, int, float]:
        """(node address, pid, process start time) of this supervisor's process: what a watcher
        kills when it stops answering (`supervisor.liveness`), and the `kill_supervisor` fault."""
        ident = liveness.Identity.of_this_process(ray.util.get_node_ip_address())
        return ident.node, ident.pid, ident.created

    async def note_outage(self, token: str | None, note: Any) -> dict[str, Any] | None:
        """The driver saw this supervisor not answering, and answering again: journal it.

        Returns the summary (with the outage) if the run has ended, else None.
        """
        self._require(token, "note_outage")
        self._outage_notes([note])
        if self._summary is not None:
            # The run ended before the note came (the driver learns of the end from the
            # answer that ends its outage): the summary gets it too.
            self._summary = {**self._summary, **self._outage_fields()}
            with contextlib.suppress(OSError):
                self.run_dir.write_summary(self._summary)
        return self._summary

    def _outage_notes(self, notes: Any) -> None:
        """Journal the outages a rank or the driver saw end (untrusted: each note is checked)."""
        for raw in notes[: liveness.MAX_NOTES] if isinstance(notes, list) else [notes]:
            note = liveness.valid_note(raw)
            if note is None:
                self.controller.rejected["outage_note"] += 1
                continue
            self.run_dir.history({"type": "supervisor_outage", "note": note})
            log.warning("supervisor_outage", **note)

    def _skipped_records(self) -> int:
        """journal.wal's damaged lines skipped by every restore of this run (the history's)."""
        restored = [r for r in read_journal(self.run_dir.path / "history.jsonl")
                    if r.get("type") == "supervisor_restored"]  # fmt: skip
        return sum(len(r.get("skipped_records") or []) for r in restored)

    def _outage_fields(self) -> dict[str, Any]:
        """The summary's outages so far, merged from every watcher's notes in the journal (read
        once): the supervisor's with their total, and the node agents' their ranks noticed."""
        history = read_journal(self.run_dir.path / "history.jsonl")
        notes = [r["note"] for r in history if r.get("type") == "supervisor_outage"]
        outages = liveness.merge_outages(notes)
        return {
            "supervisor_outages": outages,
            "supervisor_outage_s": round(sum(o["duration_s"] for o in outages), 3),
            # A node agent its ranks found silent (a crash and Ray's restart of it, a hang).
            "agent_outages": liveness.merge_outages(notes, "agent"),
        }

    async def output(self, lines: Any) -> None:
        """Lines the ranks printed, for the displays and the run directory."""
        self.feed.output(lines)
        kept = [
            {k: x.get(k) for k in ("ts", "rank", "stream", "line")}
            for x in lines if isinstance(x, dict) and isinstance(x.get("line"), str)
        ] if isinstance(lines, list) else []  # fmt: skip
        try:
            self.run_dir.output(kept)
        except OSError as exc:  # a full disk loses the copy, never the run
            log.warning("output_not_written", error=str(exc))

    async def events(
        self, cursor: int, token: str | None = None
    ) -> tuple[list[dict[str, Any]], int]:
        """Display events after `cursor` (output, anomalies, decisions, then progress)."""
        self._require(token, "events")
        self.feed.decisions(self.controller.decisions)
        return self.feed.since(cursor, self._progress_fields())

    async def status(self, token: str | None = None) -> dict[str, Any]:
        """The run's state, step per rank, counts and the policy in force."""
        self._require(token, "status")
        return self._status()

    async def stop(self, token: str | None = None, reason: str = "stopped") -> dict[str, Any]:
        """An operator's stop: a final checkpoint on every rank, then a clean end (`stopped`).

        Returns `{"stopping": bool, "state": ...}`: False when the run has ended
        already or a stop or policy abort is under way.
        """
        self._require(token, "stop")
        text = " ".join(str(reason).split())[:200] or "stopped"
        stopping = self.state in ("starting", "running") and bool(
            self.core.step(OperatorStop(text))
        )
        if stopping:
            log.warning("stop_requested", reason=text)
            self.run_dir.history({"type": "stop_requested", "reason": text})
        return {"stopping": stopping, "state": self.state}

    def _progress_fields(self) -> dict[str, Any]:
        """The part of `_status` a display's progress line reads (`Feed.progress`): the poll
        every half second leaves out the per-rank slot records and nodes (at 4,096 ranks
        they were most of what a poll cost, and blocked the supervisor's loop meanwhile)."""
        c = self.controller
        return {
            "state": self.state,
            "step": dict(c.step_of),
            "anomalies": dict(c.anomaly_counts),
            "actions": dict(c.action_counts),
            "wall_s": round(time.time() - self.started, 1),
        }

    def _status(self) -> dict[str, Any]:
        c = self.controller
        return {
            "run_id": self.spec.run_id,
            **self._progress_fields(),
            "loss": c.final_loss(),
            "decisions": len(c.decisions),
            "rejected_events": c.rejected_events,
            "rejected": dict(c.rejected),
            "stop_reason": c.stop_reason,
            "recent_decisions": [_brief(d) for d in c.decisions[-RECENT_DECISIONS:]],
            "policy": self.controller.engine.policy.name,
            "job": self.job.state.to_dict(),
            "slots": self.slots.records(),
            "nodes": self.rank_nodes(),
        }

    async def start(self) -> None:
        """Begin the run (idempotent); returns at once. The loop runs inside this actor."""
        if self._task is None and not self._done.is_set():
            self._task = asyncio.get_running_loop().create_task(self._control())
        elif self._task is None:  # restarted after its run had ended: answer, then leave
            self._task = asyncio.get_running_loop().create_task(asyncio.sleep(0))
            self._exit_later()

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
        self._exit_later()

    def _exit_later(self) -> None:
        """Remove this detached actor `LINGER_S` after its run ended (no restart)."""

        def leave() -> None:
            with contextlib.suppress(Exception):
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

        asyncio.get_running_loop().call_later(LINGER_S, leave)

    async def _loop(self) -> dict[str, Any]:
        self.run_dir.check()  # a run directory that cannot be written: no run
        if self.core.ranks_ended:
            # Restarted after every rank had ended (their actors are gone): just finish.
            return self._finish()
        me = ray.get_runtime_context().current_actor
        if self.core.group is None:
            # This supervisor's first state record, before it starts anything: one restarted
            # from here knows a run had begun (and starts its group over, see below).
            self.write_state()
        await self._start_agents()
        group = self.group = WorkerGroup(
            self.spec, supervisor=me, rendezvous=self.rendezvous, slots=self.slots,
            step=self.core.step,
        )  # fmt: skip
        group.agents = self.agent_handles  # they kill their node's ranks by pid
        # A policy that replays: ranks hold at a flagged step's boundary for its decision.
        group.hold_on_flag = self.controller.engine.policy.uses("replay_step")
        self.recovery = Recovery(
            group,
            spec=self.spec,
            run_dir=self.run_dir,
            controller=self.controller,
            job=self.job,
            slots=self.slots,
            watch=self.watch,
            sightings=self.sightings,
            step=self.core.step,
            core=self.core,
            write_state=self.write_state,
            crash_point=self.crash_point,
            check_nodes=self.check_nodes,
        )
        try:
            self._watch_from_start()
            self.run_dir.history(
                {
                    "type": "supervisor_started",
                    "incarnation": self.incarnation,
                    "policy": self.spec.policy,  # what `explain` loads while the run goes on
                }
            )
            restored = self.core.group
            if restored is None:
                if self.incarnation > 1:
                    # Died while starting the group, before a state record held it: start
                    # over (the actors it had created carry names a new group would reuse).
                    kill_run_actors(self.spec.run_id)
                    self.core.restart_job()
                await group.start()
                self.core.step(GroupStarted(0))
            else:
                restarts = [d for d in self.controller.deferred.values()
                            if d.action == "restart_rank"]  # fmt: skip
                await self._adopt(group, restored)
                await self._watch_from_marks(group)
                for d in restarts:  # a restart the crashed supervisor had begun: go on
                    self.recovery.resume(d)
            self.write_state()
            next_poll = 0.0
            while group.run_refs() or group.adopted or self._restart_pending():
                running = group.run_refs()
                ready, _ = ray.wait(running, num_returns=len(running), timeout=0)
                for ref in ready:
                    await self._rank_finished(group, ref)
                if group.adopted and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + RESULT_POLL_S
                    for rank, result in (await group.poll_adopted()).items():
                        self._adopted_result(rank, result)
                await self.check_nodes(group)
                await self._agents_for_new()
                if self.job.state.phase in (Phase.RUNNING, Phase.DEGRADED):
                    await self.recovery.check_hangs()
                    self.recovery.check_back()
                self._carry(self.core.step(Pass()))
                self.run_dir.check()  # a write failed (in a report too), or the directory is gone
                await self._watch_policy()
                due = time.monotonic() - self._state_at >= STATE_EVERY_S
                if due or self._state_log.full_due:  # a full record put off by a reply
                    self.write_state()
                else:
                    self._keep_state()
                await asyncio.sleep(POLL_S)
            await self._node_verdicts(group)
            await self.recovery.settle(self.core.results)
            # Before the ranks are killed: a supervisor restarted from here on finishes
            # from these results instead of looking for the actors.
            self.run_dir.history({"type": "ranks_ended", "results": self.core.results})
            self.core.step(RanksAllEnded())
            self.write_state()
        finally:
            group.shutdown()
            with contextlib.suppress(ray.exceptions.RayError):
                kill_run_actors(self.spec.run_id)  # any a crash left out of the records
            kill_agents(self.spec.run_id, self.agent_nodes)
        return self._finish()

    async def check_nodes(self, group: WorkerGroup, *, now: bool = False) -> None:
        """On a cluster of several nodes: the nodes of the run Ray calls dead lose their ranks."""
        if len(group.cluster) <= 1 or self.recovery is None:
            return
        dead = await self.node_watch.new_dead(group.watched_nodes(), now=now)
        if dead:
            self.recovery.nodes_lost(dead)

    async def _node_verdicts(self, group: WorkerGroup) -> None:
        """The run ended soon after a node's ranks were all found lost: wait for Ray's
        verdict on that node, at most its health-check time (`node_watch.verdict_window_s`),
        so the journal says whether the node was lost (`node_lost`) and why.

        A peer's failed collective finds a dead node's ranks gone and has them
        replaced within a second; Ray's GCS calls the node dead after its
        health checks fail (1.5 s on the test clusters, 15 s or more with Ray's
        defaults), and a run that ends first would not say so otherwise.
        """
        if self.recovery is None or len(group.cluster) <= 1:
            return
        waiting = self.recovery.silent_nodes() - self.node_watch.reported
        if not waiting:
            return
        window = verdict_window_s()
        deadline = time.monotonic() + window
        while waiting and time.monotonic() < deadline:
            await self.check_nodes(group, now=True)
            waiting -= self.node_watch.reported
            if waiting:
                await asyncio.sleep(NODE_POLL_S)
        if waiting:
            log.info("node_verdict_not_given", nodes=sorted(waiting), waited_s=round(window, 1))

    async def _start_agents(self) -> None:
        """Resolve `node_agents` (auto: on with more than one node) and start them if on.

        One agent on every live node: placement is Ray's, so any node may get
        ranks. The ranks' actors read the resolved mode from the spec.
        """
        nodes = alive_nodes()
        mode = self.spec.node_agents
        on = mode == "on" or (mode == "auto" and len(nodes) > 1)
        self.spec.node_agents = "on" if on else "off"
        if not on:
            return
        self.agent_nodes = nodes
        handles = launch_agents(self.spec.to_dict(), nodes)
        await asyncio.wait_for(
            asyncio.gather(*(h.where.remote() for h in handles.values())), AGENT_START_S
        )
        self.agent_handles.update(handles)
        self.run_dir.history({"type": "agents_started", "nodes": nodes})

    async def _agents_for_new(self) -> None:
        """A node that joined the cluster since the agents started gets one too (every
        `NEW_NODES_S`), so that ranks placed there later (a lost node's replacements on the
        node that took its place) report through it, not to the supervisor directly."""
        if self.spec.node_agents != "on" or time.monotonic() < self._new_nodes_at:
            return
        self._new_nodes_at = time.monotonic() + NEW_NODES_S
        try:
            nodes = await asyncio.wait_for(asyncio.to_thread(alive_nodes), ASK_TIMEOUT_S)
        except (TimeoutError, ray.exceptions.RayError) as exc:
            log.warning("node_table_unread", error=repr(exc)[:200])
            return
        new = [n for n in nodes if n not in self.agent_nodes]
        if not new:
            return
        self.agent_nodes.extend(new)  # not started twice while this one starts
        task = asyncio.ensure_future(self._start_late_agents(new))
        self._agents_starting.add(task)
        task.add_done_callback(self._agents_starting.discard)

    async def _start_late_agents(self, nodes: list[str]) -> None:
        handles = launch_agents(self.spec.to_dict(), nodes, agents=len(self.agent_nodes))
        try:
            await asyncio.wait_for(
                asyncio.gather(*(h.where.remote() for h in handles.values())), AGENT_START_S
            )
        except (TimeoutError, ray.exceptions.RayError) as exc:
            # Looked for again at the next round; meanwhile its ranks report directly.
            for node in nodes:
                self.agent_nodes.remove(node)
            log.warning("agents_not_started", nodes=nodes, error=repr(exc)[:200])
            return
        self.agent_handles.update(handles)  # the group's too: it holds this dict
        log.info("agents_started", nodes=nodes, joined_late=True)
        self.run_dir.history({"type": "agents_started", "nodes": nodes, "joined_late": True})

    def _watch_from_start(self) -> None:
        """Every rank into the hang watch: with the start-up allowance, or, after a restart of
        the supervisor, as the one before watched it (its tick and step time: a rank that hung
        while no supervisor watched is found within its own timeout, not the start-up one)."""
        self.core.step(Watching(time.monotonic()))

    async def _watch_from_marks(self, group: WorkerGroup) -> None:
        """Back after a restart: each rank's stall judged from its own progress mark (one ping
        round, `control.progress_marks`), so a rank that hung while no supervisor watched is
        found within its usual timeout, not after a start-up allowance."""
        config = self.watch.config
        pings = await group.ping_all(config.ping_timeout_s, patience=config.ping_patience)
        for rank, mark in progress_marks.marks(
            pings, wall=time.time(), now=time.monotonic()
        ).items():
            self.watch.marked(rank, mark.tick, mark.since, mark.ran)

    async def _adopt(self, group: WorkerGroup, record: GroupSection) -> None:
        """Take over the ranks of the supervisor before this one."""
        # Every rank, ended ones too: their `result()` is how this supervisor learns them.
        missing = await group.adopt(record, sorted(self.slots.slots))
        for rank in missing:
            self._adopted_result(rank, DEAD)

    def _adopted_result(self, rank: int, result: Any) -> None:
        """An adopted rank ended (its summary) or is gone (`DEAD`); or one this supervisor
        started and follows the same way (`WorkerGroup.follow`)."""
        followed = self.group is not None and rank in self.group.followed
        promoted = self.group is not None and rank in self.group.promoted
        if self.group is not None:
            self.group.followed.discard(rank)
            self.group.promoted.discard(rank)
        if result == DEAD:
            when = (
                "(a spare its node's agent started)" if promoted
                else "after its run call lost touch" if followed
                else "while the supervisor was away"
            )  # fmt: skip
            self._carry(self.core.step(RankDied(
                rank, self.slots.incarnation(rank), f"rank process died {when}",
                f"rank {rank}'s process is gone", time.time(),
            )))  # fmt: skip
            return
        incarnation = result.get("incarnation")
        if type(incarnation) is int:
            self._carry(self.core.step(RankReturned(rank, incarnation, result)))

    def _notifier(self, policy: Policy) -> Notifier:
        """The policy's sinks, plus `REMEDY_NOTIFY_WEBHOOK` from `remedy run`'s environment."""
        self.notifier_sinks = policy.notify
        return Notifier(
            [*policy.notify, *env_sinks(self.spec.notify_env)],
            run_id=self.spec.run_id,
            env=self.spec.notify_env,
            journal=self.run_dir.path / NOTIFICATIONS_FILE,
        )

    def _notify(self, effect: Notify) -> tuple[str, str]:
        """A notify effect: logged, and queued for every sink; returns at once."""
        outcome, detail = log_notify(effect)
        d = effect.decision
        if d is None:
            return outcome, detail
        pids = self.group.pids if self.group is not None else {}
        nodes = {r: pids[r][0] for r in d.ranks if r in pids}
        if d.anomaly.node is not None:
            # Where the fault was seen: the rank may have been replaced elsewhere since.
            nodes[d.anomaly.rank] = d.anomaly.node
        sent = self.notifier.submit(d, nodes)
        return outcome, f"{detail}; {sent}" if sent else detail

    def _node_of(self, rank: int) -> str | None:
        """The node `rank`'s current process runs on, once the group has learnt it.

        Its Ray node id's first 8 hex digits and its address (`placement.label`),
        or the address alone where the node id is not known.
        """
        where = self.group.pids.get(rank) if self.group is not None else None
        if where is None:
            return None
        slot = self.slots.slots.get(rank)
        return placement.label(slot.node, where[0]) if slot and slot.node else where[0]

    def rank_nodes(self) -> dict[str, str]:
        """rank -> the node label of its current process (`placement.label`), where known."""
        out = {}
        for rank in sorted(self.slots.slots):
            node = self._node_of(rank)
            if node is not None:
                out[str(rank)] = node
        return out

    def _group_action(self, d: Decision) -> tuple[str, str] | None:
        """restart_rank: replace the decision's ranks asynchronously (resolved when done)."""
        if d.action != "restart_rank":
            return "failed", f"{d.action} is not a group action"
        if self.recovery is None:
            return "failed", "restart_rank needs a running worker group; none is attached"
        self.recovery.start(d)
        return None

    async def _peers_at(self, group: WorkerGroup, rank: int) -> dict[str, int]:
        """Where the peers of `rank`, which died, wait (`control.stuck_at.front` of one ping
        round): the step its loss is recorded at, which its last report lags."""
        peers = [r for r in group.actors if r != rank]
        if not peers:
            return {}
        config = self.watch.config
        pings = await group.ping_all(config.ping_timeout_s, ranks=peers,
                                     patience=config.ping_patience)  # fmt: skip
        where = stuck_at.front(pings)
        return {} if where is None else {"step": where[0], "tick": where[1]}

    async def _rank_finished(self, group: WorkerGroup, ref: ray.ObjectRef) -> None:
        rank, incarnation = group.owner(ref)
        retired = group.retired(ref)
        group.forget(ref)
        try:
            result = await ref
        except ray.exceptions.RayError as exc:
            if retired:
                return  # remedy killed this process itself to replace it
            if isinstance(exc, ray.exceptions.ActorUnavailableError):
                # Not known to be dead (`supervisor.pings`): its end is learnt from `result`
                # calls, as an adopted rank's, and the hang watch judges its silence.
                if incarnation == self.slots.incarnation(rank):
                    log.warning("rank_unreachable", rank=rank, error=str(exc)[:200])
                    group.follow(rank)
                return
            # Its node may be what died: then the node's loss is what is reported (for all its
            # ranks at once), and this rank's own loss is a part of it. While that look is out,
            # a restart may replace this rank (its node found lost meanwhile): the loss below
            # is about the incarnation that ran here, and dropped if that one is replaced.
            await self.check_nodes(group, now=True)
            at = await self._peers_at(group, rank)
            self._carry(self.core.step(RankDied(
                rank, incarnation, f"rank process died: {exc}",
                f"rank {rank}'s process died ({_why_gone(exc)})", time.time(),
                {"error": str(exc)[:300], "incarnation": incarnation, **at},
            )))  # fmt: skip
            return
        self._carry(self.core.step(RankReturned(rank, incarnation, result)))

    def _carry(self, effects: list[Effect]) -> None:
        """Carry out what the run's core returned."""
        self._carry_control()
        for effect in effects:
            match effect:
                case Dropped() | ReplacementFailed() | Joined() | ToPolicy() | NotReplaced():
                    assert self.recovery is not None  # ranks end only once the loop built it
                    self.recovery.carry_losses([effect])
                case RankEnded(rank, status):
                    self.feed.set_rank_state(rank, status)
                case BatchesLost(rank, node, count, records):
                    self.run_dir.history({"type": "batches_lost", "rank": rank, "node": node,
                                          "count": count, "records": records})  # fmt: skip
                case OutageNotes(notes):
                    self._outage_notes(notes)
                case Status() | Answer() | Taken() | StopAsked():
                    pass  # read by whoever stepped the core

    def _restart_pending(self) -> bool:
        """A restart runs while no rank's process does (a node that held every rank was lost):
        the loop goes on until it starts the new ones. Not once every rank completed the run:
        a restart still waiting on the group then ends with it (`Recovery.settle`)."""
        if self.recovery is None or not self.recovery.running():
            return False
        return not self.core.all_completed()

    def _finish(self, error: str | None = None, *, io_error: bool = False) -> dict[str, Any]:
        """End the run: its summary, written to the run directory or, where that cannot be
        written (`io_error`: the error is its one line), to `write_errors.fallback_dir`."""
        c = self.controller
        # A run ending on its run directory's error writes no more state records (each would
        # fail the same way); the summary goes where it can.
        self._unwritable = io_error and self.run_dir.broken is not None
        c.finish()
        self._carry_control()
        results = [self.core.results[r] for r in sorted(self.core.results)]
        [ending] = self.core.step(Ending(error))
        self._carry_control()  # the job's last move, journaled before the run's end
        assert isinstance(ending, Status)
        # A run that completed with a rank that stopped learning is degraded (control.health).
        status, degraded = final_status(ending.status, results)
        self.notifier.close()  # deliveries still queued get a last chance, then are journaled
        lead = results[0] if results else {}
        completed = int(lead.get("steps_completed", 0))
        ended = time.time()
        # Every execution counts, the ones a rollback or a restart from a checkpoint redid
        # too; an update that was skipped (an unrelieved OOM, a non-finite step) kept nothing.
        goodput = c.goodput.summary(
            started=self.started,
            ended=ended,
            completed=completed,
            fallback_executed=int(lead.get("steps_executed", 0)),
            fallback_skipped=int(lead.get("updates_skipped", 0) or 0),
        )
        self.metrics.goodput(c.goodput, self.started, force=True)
        summary = {
            "run_id": self.spec.run_id,
            "status": status,
            "degraded_reason": degraded,
            "abort_reason": c.abort_reason,
            "stop_reason": c.stop_reason,
            "steps_completed": completed,
            **goodput,
            "final_loss": lead.get("final_loss"),
            "actions": dict(c.action_counts),
            "anomalies": dict(c.anomaly_counts),
            "outcomes": dict(c.outcome_counts),
            "notifications": dict(self.notifier.counts),
            "decisions": len(c.decisions),
            "rejected_events": c.rejected_events,
            "rejected_batches": c.rejected_batches,
            "rejected": dict(c.rejected),  # refused report input, by reason
            "refused_stale_reports": self.slots.refused_stale,
            "skipped_batches": lead.get("skipped_batches", []),
            "policy": self.spec.policy,
            "workers": self.spec.workers,
            "job": self.job.state.to_dict(),
            "recoveries": self.recovery.records if self.recovery is not None else [],
            # Rank pings the supervisor sent itself (none behind node agents in steady state).
            "supervisor_pings": self.group.pings_sent if self.group is not None else 0,
            "agent_sighting_calls": self.sightings.calls,  # node agents' ping rounds taken in
            # Rank processes killed by pid by their node's agent, on the supervisor's order.
            "agent_kills": self.group.agent_kills if self.group is not None else 0,
            "agent_promotions": self.group.promotions if self.group is not None else 0,
            "resumed_from": self.spec.resume or None,
            "supervisor_restarts": self.incarnation - 1,
            # Damaged journal.wal lines the restarted supervisors skipped (`supervisor_restored`).
            "journal_skipped_records": self._skipped_records(),
            **self._outage_fields(),
            "wall_s": round(ended - self.started, 2),
            # Where each rank's last process ran, and the nodes lost meanwhile.
            "nodes": self.rank_nodes(),
            "ranks": results,
        }
        if error is not None:
            summary["error"] = error
        if io_error:
            summary["io_error"] = error
            summary["lines_not_written"] = self.run_dir.dropped
        written = self.run_dir.write_summary(summary)
        self.run_dir.history({"type": "run_ended", "status": status})
        self.core.step(Ended(status))
        self.write_state()
        self.run_dir.close()
        if written.parent != self.run_dir.path:
            summary["summary_file"] = str(written)  # for the driver to say where it went
        self._summary = summary
        return summary


def _brief(d: dict[str, Any]) -> dict[str, Any]:
    """A journaled decision as `status` shows it."""
    keys = ("decision_id", "step", "rule", "action", "outcome", "reason")
    return {k: d.get(k) for k in keys}


def _a_tick(value: Any) -> TypeGuard[int]:
    """A tick a rank may name (an int, not a bool, within what JSON carries exactly)."""
    return type(value) is int and 0 <= value < 2**53


def _why_gone(exc: ray.exceptions.RayError) -> str:
    """A rank process's end in a few words: the error's type and the line of Ray's text that
    says why (its node died, it was killed, ...), else its first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    why = next((line for line in lines if line.startswith("The actor died because")), None)
    return f"{type(exc).__name__}: {(why or (lines[0] if lines else ''))[:160]}"
