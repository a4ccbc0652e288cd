"""The supervisor: a Ray actor that runs the ranks and answers their reports.

It owns the worker group and the `Controller` (engine, journal, command
queue). Ranks call `report` with each batch and get back the commands they
owe; `run` starts the group, watches it until every rank has finished, and
writes the summary. Being an async actor, it serves reports while `run`
waits, on one event loop, so controller state needs no locks.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import ray
import structlog

from remedy.policies import AnomalyEvent, Engine, PolicyError
from remedy.supervisor.feed import Feed
from remedy.supervisor.policy_source import (
    is_policy_file,
    load_policy_source,
    policy_from_bytes,
    read_policy_bytes,
)
from remedy.supervisor.spec import RunSpec
from remedy.supervisor.worker_group import WorkerGroup
from remedy.workers.control import Controller
from remedy.workers.logs import configure_logging
from remedy.workers.metrics import RayBackend, RunMetrics
from remedy.workers.rundir import RunDir

log = structlog.get_logger("remedy.supervisor")

POLL_S = 0.2
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
        self.controller = Controller(engine, world_size=self.spec.workers, run_dir=self.run_dir)
        self.started = time.time()
        self.state = "starting"
        self.rank_results: dict[int, dict[str, Any]] = {}
        self.feed = Feed(self.spec.workers)  # what displays poll (see `events`)
        self.metrics = RunMetrics(
            RayBackend(), run_id=self.spec.run_id, checkpoints=self.run_dir.checkpoints
        )
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
        """A rank's report batch in; the commands that rank still owes out."""
        self.feed.observe(batch)
        self.metrics.observe(batch)
        commands = self.controller.ingest(batch)
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
        }

    async def run(self) -> dict[str, Any]:
        me = ray.get_runtime_context().current_actor
        group = WorkerGroup(self.spec, supervisor=me)
        self.state = "running"
        try:
            await group.start()
            running = group.run_refs()
            while running:
                ready, running = ray.wait(running, num_returns=len(running), timeout=0)
                for ref in ready:
                    await self._rank_finished(group, ref)
                await self._watch_policy()
                await asyncio.sleep(POLL_S)
        finally:
            group.shutdown()
        return self._finish()

    async def _rank_finished(self, group: WorkerGroup, ref: ray.ObjectRef) -> None:
        rank = group.rank_of(ref)
        try:
            result = await ref
        except ray.exceptions.RayError as exc:
            # The rank's process died: report it as an anomaly so the policy sees it.
            result = {"rank": rank, "status": "failed", "error": f"rank process died: {exc}"}
            ev = AnomalyEvent(
                kind="rank_dead",
                rank=rank,
                step=self.controller.step_of.get(rank, 0),
                tick=self.controller.tick_of.get(rank, 0),
                severity="critical",
                source="supervisor",
                ts=time.time(),
                details={"error": str(exc)[:300]},
            )
            self.controller.ingest(
                {"rank": rank, "step": ev.step, "tick": ev.tick, "events": [ev.to_dict()]}
            )
        self.rank_results[rank] = result
        self.feed.set_rank_state(rank, str(result.get("status")))

    def _finish(self) -> dict[str, Any]:
        c = self.controller
        c.finish()
        results = [self.rank_results[r] for r in sorted(self.rank_results)]
        if c.abort_reason is not None:
            status = "aborted"
        elif results and all(r.get("status") == "completed" for r in results):
            status = "completed"
        else:
            status = "failed"
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
            "skipped_batches": lead.get("skipped_batches", []),
            "policy": self.spec.policy,
            "workers": self.spec.workers,
            "wall_s": round(time.time() - self.started, 2),
            "ranks": results,
        }
        self.run_dir.write_summary(summary)
        self.run_dir.close()
        self.state = status
        return summary
