"""The supervisor: a Ray actor that runs the ranks and answers their reports.

It owns the worker group and the `Controller` (engine, journal, command
queue). Ranks call `report` with each batch and get back the commands they
owe; `run` starts the group, watches it until every rank has finished, and
writes the summary. Being an async actor, it serves reports while `run`
waits, on one event loop, so controller state needs no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from pathlib import Path
from typing import Any

import ray
import structlog

from remedy.policies import Decision, Engine, PolicyError
from remedy.supervisor.exceptions import Unauthorized
from remedy.supervisor.feed import Feed
from remedy.supervisor.hang_watch import HangWatch, HangWatchConfig
from remedy.supervisor.job_state import JobStateMachine, Phase, RanksEnded, Started, TransitionError
from remedy.supervisor.policy_source import (
    is_policy_file,
    load_policy_source,
    policy_from_bytes,
    read_policy_bytes,
)
from remedy.supervisor.rank_slots import RankSlots
from remedy.supervisor.recovery import Recovery
from remedy.supervisor.rendezvous import Rendezvous
from remedy.supervisor.spec import NAMESPACE, RunSpec, supervisor_name
from remedy.supervisor.worker_group import WorkerGroup
from remedy.workers.control import Controller
from remedy.workers.logs import configure_logging
from remedy.workers.metrics import RayBackend, RunMetrics
from remedy.workers.rundir import RunDir

log = structlog.get_logger("remedy.supervisor")

POLL_S = 0.05
# A refused policy's errors journaled (and returned) at most; the count is logged in full.
MAX_REFUSAL_LINES = 50
# How long an ended run's supervisor stays for late callers (minimal lifecycle block).
LINGER_S = 60.0
# Decisions `status` shows, newest last.
RECENT_DECISIONS = 5


@ray.remote(num_cpus=0)
class SupervisorActor:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = RunSpec(**spec)
        configure_logging(verbose=self.spec.verbose)
        self.run_dir = RunDir(self.spec.run_dir, self.spec.run_id)
        engine = Engine(
            load_policy_source(self.spec.policy), run_id=self.spec.run_id, dry_run=self.spec.dry_run
        )
        self.controller = Controller(
            engine,
            world_size=self.spec.workers,
            run_dir=self.run_dir,
            group_action=self._group_action,
        )
        self.started = time.time()
        self.state = "starting"
        self.rank_results: dict[int, dict[str, Any]] = {}
        self.feed = Feed(self.spec.workers)  # what displays poll (see `events`)
        self.metrics = RunMetrics(
            RayBackend(), run_id=self.spec.run_id, checkpoints=self.run_dir.checkpoints
        )
        # Multi-rank lifecycle: slots with incarnations, the job's state machine,
        # the rendezvous store, the hang watch, and targeted restarts.
        self.slots = RankSlots(self.spec.workers)
        self.job = JobStateMachine(
            journal=self.run_dir.wal, max_targeted=self.spec.max_targeted_restarts
        )
        self.watch = HangWatch(HangWatchConfig(**self.spec.hang_watch))  # type: ignore[arg-type]
        self.rendezvous = Rendezvous()
        self.group: WorkerGroup | None = None
        self.recovery: Recovery | None = None
        # A policy given as a file is watched: saving it applies it to the running job.
        self._watched = Path(self.spec.policy) if is_policy_file(self.spec.policy) else None
        self._watched_mtime = self._watched.stat().st_mtime_ns if self._watched else 0
        self._token_refusals: dict[str, int] = {}  # refused calls by method, for the journal
        self._token_journaled: dict[str, int] = {}

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
            self.run_dir.wal({"type": "refused", "call": call, "reason": "token", "count": count})
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
        return self._apply_policy(data, filename)

    def _apply_policy(self, data: bytes | str, filename: str) -> list[str]:
        try:
            policy = policy_from_bytes(data, filename)
        except PolicyError as exc:
            return self._refuse(filename, exc)
        old = self.controller.engine.policy.name
        self.controller.engine.reload(policy)
        self.run_dir.wal(
            {"type": "policy_reloaded", "file": filename, "from": old, "to": policy.name}
        )
        log.warning("policy_reloaded", file=filename, name=policy.name)
        return []

    async def _watch_policy(self) -> None:
        if self._watched is None:
            return
        try:
            mtime = self._watched.stat().st_mtime_ns
        except OSError:
            return
        if mtime != self._watched_mtime:
            self._watched_mtime = mtime
            try:
                data, name = read_policy_bytes(str(self._watched))
            except PolicyError as exc:
                # Unreadable now (replaced by a folder, permissions): refuse, keep the old policy.
                self._refuse(str(self._watched), exc)
                return
            self._apply_policy(data, name)

    def _refuse(self, filename: str, exc: PolicyError) -> list[str]:
        """Journal a refused policy (the one in force stays); its error lines, capped."""
        errors = [d.format() for d in exc.diagnostics][:MAX_REFUSAL_LINES]
        log.warning("policy_refused", file=filename, errors=len(exc.diagnostics))
        self.run_dir.wal(
            {
                "type": "policy_refused",
                "file": filename,
                "kept": self.controller.engine.policy.name,
                "errors": errors,
            }
        )
        return errors

    async def report(self, batch: Any) -> list[dict[str, Any]]:
        """A rank's report batch in; the commands that rank still owes out.

        A batch without the run's token, or from a replaced incarnation (still
        in flight from a killed process), is refused and counted.
        """
        if not self._authorized(batch.pop("token", None) if isinstance(batch, dict) else None,
                                "report"):  # fmt: skip
            return []
        if isinstance(batch, dict) and not self.slots.accept(
            batch.get("rank"), batch.get("incarnation"), batch.get("seq")
        ):
            return []
        self.feed.observe(batch)
        self.metrics.observe(batch)
        commands = self.controller.ingest(batch)
        self.feed.decisions(self.controller.decisions)
        self.metrics.decisions(self.controller.decisions)
        if isinstance(batch, dict):
            rank, tick = batch.get("rank"), batch.get("tick")
            if rank in self.slots.slots and type(tick) is int:
                times = [
                    m["step_time_s"]
                    for m in batch.get("metrics") or []
                    if isinstance(m, dict) and isinstance(m.get("step_time_s"), int | float)
                ]
                self.watch.beat(rank, tick, time.monotonic(), times)
        return commands

    async def output(self, lines: Any) -> None:
        """Lines the ranks printed, for the displays."""
        self.feed.output(lines)

    async def events(
        self, cursor: int, token: str | None = None
    ) -> tuple[list[dict[str, Any]], int]:
        """Display events after `cursor` (output, anomalies, decisions, then progress)."""
        self._require(token, "events")
        self.feed.decisions(self.controller.decisions)
        return self.feed.since(cursor, self._status())

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
        stopping = self.state in ("starting", "running") and self.controller.stop(text)
        if stopping:
            log.warning("stop_requested", reason=text)
            self.run_dir.wal({"type": "stop_requested", "reason": text})
        return {"stopping": stopping, "state": self.state}

    def _status(self) -> dict[str, Any]:
        c = self.controller
        return {
            "run_id": self.spec.run_id,
            "state": self.state,
            "step": dict(c.step_of),
            "loss": c.final_loss(),
            "anomalies": dict(c.anomaly_counts),
            "actions": dict(c.action_counts),
            "decisions": len(c.decisions),
            "rejected_events": c.rejected_events,
            "rejected": dict(c.rejected),
            "stop_reason": c.stop_reason,
            "recent_decisions": [_brief(d) for d in c.decisions[-RECENT_DECISIONS:]],
            "wall_s": round(time.time() - self.started, 1),
            "policy": self.controller.engine.policy.name,
            "job": self.job.state.to_dict(),
            "slots": self.slots.records(),
        }

    # ---- BEGIN minimal lifecycle (issue 13, cli branch) ------------------------------
    # The smallest `start`/`wait` the CLI needs to be built and tested against; the
    # daemon branch owns the real lifecycle (control loop inside the actor, restarts,
    # restore). At merge keep the daemon branch's versions of these two methods and of
    # `launch_supervisor` below, and drop this block.
    async def start(self) -> None:
        """Begin the run (idempotent); returns at once."""
        if getattr(self, "_task", None) is None:
            self._task: asyncio.Task[dict[str, Any]] = asyncio.ensure_future(self._run_then_exit())

    async def wait(self, timeout_s: float) -> dict[str, Any] | None:
        """The summary once the run ended, else None after `timeout_s`."""
        task = getattr(self, "_task", None)
        if task is None:
            await asyncio.sleep(max(0.0, min(float(timeout_s), 60.0)))
            return None
        done, _ = await asyncio.wait({task}, timeout=max(0.0, float(timeout_s)))
        return task.result() if done else None

    async def _run_then_exit(self) -> dict[str, Any]:
        try:
            return await self.run()
        finally:
            # A detached supervisor outlives its driver: once the run ended it stays a
            # while for late `wait`/`events` callers, then removes itself.
            asyncio.get_running_loop().call_later(LINGER_S, self._exit)

    def _exit(self) -> None:
        with contextlib.suppress(Exception):
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # ---- END minimal lifecycle ------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        me = ray.get_runtime_context().current_actor
        group = self.group = WorkerGroup(
            self.spec, supervisor=me, store_addr=self.rendezvous.address, slots=self.slots
        )
        self.recovery = Recovery(self, group)
        self.state = "running"
        try:
            now = time.monotonic()
            for rank in range(self.spec.workers):
                self.watch.started(rank, now)
            await group.start()
            self.job.step(Started(0))
            while group.run_refs():
                running = group.run_refs()
                ready, _ = ray.wait(running, num_returns=len(running), timeout=0)
                for ref in ready:
                    await self._rank_finished(group, ref)
                if self.job.state.phase is Phase.RUNNING:
                    await self.recovery.check_hangs()
                await self._watch_policy()
                await asyncio.sleep(POLL_S)
            await self.recovery.settle()
        finally:
            group.shutdown()
        return self._finish()

    def _group_action(self, d: Decision) -> tuple[str, str] | None:
        """restart_rank: replace the decision's ranks asynchronously (resolved when done)."""
        if d.action != "restart_rank":
            return "failed", f"{d.action} is not a group action"
        if self.recovery is None:
            return "failed", "restart_rank needs a running worker group; none is attached"
        self.recovery.start(d)
        return None

    async def _rank_finished(self, group: WorkerGroup, ref: ray.ObjectRef) -> None:
        rank, incarnation = group.owner(ref)
        retired = group.retired(ref)
        group.forget(ref)
        try:
            result = await ref
        except ray.exceptions.RayError as exc:
            if retired:
                return  # remedy killed this process itself to replace it
            result = {"rank": rank, "status": "failed", "error": f"rank process died: {exc}"}
            self.rank_results[rank] = result
            assert self.recovery is not None
            self.recovery.lost(rank, "rank_dead", f"rank {rank}'s process died", details={
                "error": str(exc)[:300], "incarnation": incarnation,
            })  # fmt: skip
            return
        if incarnation != self.slots.incarnation(rank):
            return  # a replaced incarnation's late result
        self.rank_results[rank] = result
        self.feed.set_rank_state(rank, str(result.get("status")))
        if result.get("status") == "failed" and self.recovery is not None:
            self.recovery.replacement_failed(rank, str(result.get("error")))
        self.slots.end(rank)

    def _finish(self) -> dict[str, Any]:
        c = self.controller
        c.finish()
        results = [self.rank_results[r] for r in sorted(self.rank_results)]
        if c.stop_reason is not None:
            status = "stopped"
        elif c.abort_reason is not None:
            status = "aborted"
        elif (
            len(results) == self.spec.workers
            and all(r.get("status") == "completed" for r in results)
            and self.job.state.phase is Phase.RUNNING
        ):
            status = "completed"
        else:
            status = "failed"
        with contextlib.suppress(TransitionError):  # ended already
            self.job.step(RanksEnded(status))
        lead = results[0] if results else {}
        completed = int(lead.get("steps_completed", 0))
        executed = int(lead.get("steps_executed", 0))
        summary = {
            "run_id": self.spec.run_id,
            "status": status,
            "abort_reason": c.abort_reason,
            "stop_reason": c.stop_reason,
            "steps_completed": completed,
            "steps_executed": executed,
            "goodput": round(completed / executed, 4) if executed else 0.0,
            "final_loss": lead.get("final_loss"),
            "actions": dict(c.action_counts),
            "anomalies": dict(c.anomaly_counts),
            "outcomes": dict(c.outcome_counts),
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
            "wall_s": round(time.time() - self.started, 2),
            "ranks": results,
        }
        self.run_dir.write_summary(summary)
        self.run_dir.close()
        self.state = status
        return summary


def _brief(d: dict[str, Any]) -> dict[str, Any]:
    """A journaled decision as `status` shows it."""
    keys = ("decision_id", "step", "rule", "action", "outcome", "reason")
    return {k: d.get(k) for k in keys}


# ---- BEGIN minimal lifecycle (issue 13, cli branch): keep the daemon branch's version ----
def launch_supervisor(spec: RunSpec) -> Any:
    """Create the run's supervisor: named `remedy-supervisor-<run_id>` in namespace `remedy`,
    detached (it outlives the driver that started it)."""
    return SupervisorActor.options(  # type: ignore[attr-defined]
        name=supervisor_name(spec.run_id),
        namespace=NAMESPACE,
        lifetime="detached",
    ).remote(spec.to_dict())


# ---- END minimal lifecycle ---------------------------------------------------------------
