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
from remedy.supervisor.spec import RunSpec
from remedy.supervisor.worker_group import WorkerGroup
from remedy.workers.control import Controller
from remedy.workers.logs import configure_logging
from remedy.workers.metrics import RayBackend, RunMetrics
from remedy.workers.rundir import RunDir

log = structlog.get_logger("remedy.supervisor")

POLL_S = 0.05
# A refused policy's errors journaled (and returned) at most; the count is logged in full.
MAX_REFUSAL_LINES = 50


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
        self.slots = RankSlots(self.spec.workers, rejected=self.controller.rejected)
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

    async def apply_policy(self, data: bytes | str, filename: str) -> list[str]:
        """Validate and swap in a new policy atomically; return its errors (old policy kept) or [].

        `data` is untrusted (whatever was saved in the file): every failure is a
        refusal, journaled with its errors, never an exception out of here.
        """
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
            await self.apply_policy(data, name)

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

        A batch from a replaced incarnation (still in flight from a killed
        process) is refused and counted. Displays, dashboards and the hang
        watch see only what the controller accepted of a batch.
        """
        # >>> minimal token check until the supervisor's `_authorized` lands:
        # a batch stamped with another run's token is refused and counted.
        if (
            isinstance(batch, dict)
            and "token" in batch
            and not (
                isinstance(batch["token"], str)
                and secrets.compare_digest(batch["token"], self.spec.token)
            )
        ):
            self.controller.rejected["token"] += 1
            return []
        # <<< end of the minimal token check
        if isinstance(batch, dict) and not self.slots.accept(
            batch.get("rank"), batch.get("incarnation"), batch.get("seq")
        ):
            return []
        commands = self.controller.ingest(batch)
        report = self.controller.last_report
        if report is not None:
            valid = report.as_batch()
            self.feed.observe(valid)
            self.metrics.observe(valid)
            times = [
                m["step_time_s"]
                for m in report.metrics
                if isinstance(m.get("step_time_s"), int | float)
                and not isinstance(m["step_time_s"], bool)
            ]
            self.watch.beat(report.rank, report.tick, time.monotonic(), times)
        self.feed.decisions(self.controller.decisions)
        self.metrics.decisions(self.controller.decisions)
        return commands

    async def output(self, lines: Any) -> None:
        """Lines the ranks printed, for the displays."""
        self.feed.output(lines)

    async def events(self, cursor: int) -> tuple[list[dict[str, Any]], int]:
        """Display events after `cursor` (output, anomalies, decisions, then progress)."""
        self.feed.decisions(self.controller.decisions)
        return self.feed.since(cursor, await self.status())

    async def status(self) -> dict[str, Any]:
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
            "wall_s": round(time.time() - self.started, 1),
            "policy": self.controller.engine.policy.name,
            "job": self.job.state.to_dict(),
            "slots": self.slots.records(),
        }

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
        if c.abort_reason is not None:
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
