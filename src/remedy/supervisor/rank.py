"""One training rank as a Ray actor that stays reachable while it trains.

Training runs in the actor's default concurrency group (one thread); the
control calls `ping`, `pid`, `regroup` and `abort` are served by their own
group's threads, so the supervisor can reach a rank whose training thread
is blocked in a collective (a ping answers in milliseconds). A rank that
answers nothing, not even a ping, is hung (a stopped or wedged process).

Rank actors are named and detached (see `worker_group`): they outlive a
supervisor that crashes, which finds them again by name when Ray restarts
it, and learns from `result` which of them finished meanwhile.

An actor can be started as a *warm spare* before it is needed: it imports
the training module when it is created, and becomes a rank only when
`run` hands it one, so replacing a rank costs no process start.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import psutil
import ray
import torch
import torch.distributed as dist

from remedy.rank import WorkerContext, set_context
from remedy.rank.chaos.faults import Fault
from remedy.rank.group.membership import Membership, abort_collectives, warm_up
from remedy.rank.link.output import forward_output, supervisor_sink
from remedy.rank.link.reporter import RayReporter
from remedy.rank.loop.config_error import config_error_line
from remedy.rank.loop.logs import configure_logging
from remedy.rank.loop.target import (
    call_target,
    describe_exception,
    load_target,
    picklable_result,
)
from remedy.rundir.rundata import write_fallback_summary
from remedy.supervisor.agent.actor import this_nodes_agent

CONTROL = "control"
# NCCL: on a collective error abort the communicators but keep the process
# (2, "CleanUpOnly"), so remedy's control thread, not NCCL, decides what
# happens to the rank. A value in the environment wins.
NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@ray.remote(num_cpus=0, concurrency_groups={CONTROL: 4})  # type: ignore[call-overload]
class RankActor:
    def __init__(
        self,
        *,
        run_id: str,
        run_dir: str,
        supervisor: Any,
        target: str,
        argv: list[str],
        threads: int | None = None,
        verbose: bool = False,
        token: str = "",
        silence_s: float | None = None,
        node_agents: bool = False,
    ) -> None:
        configure_logging(verbose=verbose)
        os.environ.setdefault(NCCL_ERROR_HANDLING_ENV, "2")
        if threads:
            torch.set_num_threads(threads)
        self.run_id = run_id
        self.run_dir = run_dir
        self.supervisor = supervisor
        self.target = target
        self.argv = list(argv)
        self.token = token  # stamped on every report (the supervisor refuses batches without it)
        self.silence_s = silence_s  # a report unanswered this long: the supervisor is hung
        self.node_agents = node_agents  # report to this node's agent (`supervisor.agent`)
        self.membership: Membership | None = None
        self.ctx: WorkerContext | None = None
        self._result: dict[str, Any] | None = None
        self._fn: Any = None
        try:  # warm up: import the training code now, off the critical path of a restart
            self._fn = load_target(target)
        except Exception:  # reported by `run`, where it fails the rank
            self._fn = None
        warm_up()

    def _reports_to(self) -> Any:
        """This node's agent where the run has agents, else the supervisor."""
        agent = self._find_agent() if self.node_agents else None
        return agent if agent is not None else self.supervisor

    def _find_agent(self) -> Any | None:
        """This node's agent, if it answers to its name yet."""
        return this_nodes_agent(self.run_id)

    # ------------------------------------------------------------- control
    @ray.method(concurrency_group=CONTROL)
    def ping(self) -> dict[str, Any]:
        """This rank's progress, answered while training is blocked."""
        if self.membership is None:
            return {"phase": "idle", "pid": os.getpid(), "tick": -1, "step": 0}
        return self.membership.status()

    @ray.method(concurrency_group=CONTROL)
    def where(self) -> tuple[str, int, str, float]:
        """(node address, pid, Ray node id, the process's start time) of this actor's process:
        a fast kill that cannot hit a reused pid, and its node."""
        return (
            ray.util.get_node_ip_address(),
            os.getpid(),
            ray.get_runtime_context().get_node_id(),
            # Read here, in the actor's process: a module-level value may come from the
            # process that pickled this class.
            psutil.Process().create_time(),
        )

    @ray.method(concurrency_group=CONTROL)
    def regroup(
        self, generation: int, source: int, store_addr: tuple[str, int] | None = None
    ) -> None:
        """The supervisor's order: form `generation` over `store_addr`, adopting rank `source`'s state."""
        if self.membership is not None:
            self.membership.order(generation, source, store_addr)

    @ray.method(concurrency_group=CONTROL)
    def result(self) -> dict[str, Any] | None:
        """This rank's summary once its training ended, else None.

        How a restarted supervisor, which does not own the `run` call of the
        one before it, learns that this rank finished.
        """
        return self._result

    @ray.method(concurrency_group=CONTROL)
    def identity(self) -> dict[str, Any]:
        """Who this rank is in its run, for a supervisor that lost its journal
        (`control.identity`): the run, its generation and step, the highest decision id
        of each supervisor incarnation it applied, the highest command seq it holds, and
        the lowest report number it still awaits an answer to."""
        out: dict[str, Any] = {"run_id": self.run_id, "training": self.membership is not None}
        if self.membership is None or self.ctx is None:
            return out
        out.update(self.membership.status())
        reporter = self.ctx.reporter
        if isinstance(reporter, RayReporter):
            out["incarnation"] = reporter.incarnation
            out["unanswered_from"] = reporter.unanswered_from
        inbox = self.membership.inbox
        if inbox is not None:
            out["applied"] = inbox.latest_applied()
            out["max_seq"] = inbox.max_seq
        return out

    @ray.method(concurrency_group=CONTROL)
    def abort(self) -> None:
        """Abort this rank's NCCL communicators, so a blocked collective returns.

        gloo needs nothing: killing the lost peer fails the blocked collective.
        """
        if self.membership is not None and self.membership.backend == "nccl":
            abort_collectives()

    # ------------------------------------------------------------- training
    def run(
        self,
        *,
        rank: int,
        world_size: int,
        store_addr: tuple[str, int],
        incarnation: int = 1,
        generation: int = 0,
        adopt_from: int | None = None,
        faults: list[dict[str, Any]] | None = None,
        resume_step: int | None = None,
        hold_on_flag: bool = False,
    ) -> dict[str, Any]:
        """Join generation `generation` as `rank` and run the training function; never raises.

        With `resume_step` (a full-group restart) the Guard starts from that durable checkpoint.
        """
        t0 = time.time()
        self.membership = Membership(
            rank=rank,
            world_size=world_size,
            store_addr=store_addr,
            generation=generation,
            adopt_from=adopt_from,
        )
        self.ctx = WorkerContext(
            rank=rank,
            world_size=world_size,
            run_id=self.run_id,
            run_dir=Path(self.run_dir),
            reporter=RayReporter(
                reports_to := self._reports_to(),
                rank=rank,
                incarnation=incarnation,
                token=self.token,
                silence_s=self.silence_s,
                control=self.supervisor,
                to_agent=reports_to is not self.supervisor,
                find_agent=self._find_agent if self.node_agents else None,
            ),
            faults=[Fault.model_validate(f) for f in faults or []],
            argv=list(self.argv),
            membership=self.membership,
            resume_step=resume_step,
            hold_on_flag=hold_on_flag,
        )
        set_context(self.ctx)
        result: Any = None
        failure: dict[str, Any] = {}
        # The user's prints (and the traceback below) reach the driver's display, prefixed by rank.
        rank_log = sys.stderr  # the actor's own stderr: its Ray log, not forwarded
        with forward_output(rank, supervisor_sink(self.supervisor)):
            try:
                self.membership.join()  # rendezvous: bounded by collective_timeout()
                fn = self._fn or load_target(self.target)
                result = call_target(fn, self.ctx.argv)
                status, error = self.ctx.summary.get("status", "completed"), None
            except (Exception, SystemExit) as exc:
                # SystemExit too: an argparse error in the user's code must fail the rank, not kill the actor.
                result, status = None, "failed"
                if isinstance(exc, SystemExit) and exc.code in (None, 0):
                    # `sys.exit()` / `sys.exit(0)` in the training function is a normal end.
                    status, error = self.ctx.summary.get("status", "completed"), None
                else:
                    error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                    failure = describe_exception(exc)
                    line = config_error_line(exc)
                    if line is None:
                        traceback.print_exc()
                    else:  # the user's input is wrong: one line; the traceback in the log only
                        print(line, file=sys.stderr, flush=True)
                        failure["config_error"] = line
                        print(failure.pop("traceback"), file=rank_log, flush=True)
            finally:
                set_context(None)
                if dist.is_initialized():
                    dist.destroy_process_group()
                # The last reports (outcomes included) wait for a supervisor that is
                # restarting, up to `reporter.CLOSE_TIMEOUT_S`.
                if self.ctx.reporter is not None:
                    self.ctx.reporter.close()
        summary = dict(self.ctx.summary)
        lost = getattr(self.ctx.reporter, "supervisor_lost", None)
        if lost:
            # Nobody will write this run's summary: say why where the user looks for it.
            summary["supervisor_lost"] = lost
            if rank == 0:
                write_fallback_summary(
                    self.run_dir, self.run_id, f"the supervisor was lost: {lost}"
                )
        summary.update(
            rank=rank,
            incarnation=incarnation,
            status=status,
            error=error,
            wall_s=time.time() - t0,
            recoveries=self.membership.recoveries,
        )
        summary.update(failure)
        if isinstance(result, dict):
            # Whatever it holds, the return value must not kill the rank on its way back.
            summary["result"], note = picklable_result(result)
            if note:
                summary["result_note"] = note
        self._result = summary
        return summary
