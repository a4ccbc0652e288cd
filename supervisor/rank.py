"""One training rank as a Ray actor.

The actor joins the job's `torch.distributed` process group (gloo on CPU,
NCCL when it has a GPU), installs the worker context the Guard reads, and
calls the user's training function. It returns the rank's summary.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from remedy.supervisor.output import forward_output, supervisor_sink
from remedy.supervisor.reporter import RayReporter
from remedy.supervisor.target import (
    call_target,
    describe_exception,
    load_target,
    picklable_result,
)
from remedy.workers import WorkerContext, set_context
from remedy.workers.chaos import Fault
from remedy.workers.logs import configure_logging

# How long a rank waits for its peers to join the process group.
INIT_TIMEOUT_S = 120


@ray.remote(num_cpus=0)
class RankActor:
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        run_id: str,
        run_dir: str,
        supervisor: Any,
        faults: list[dict[str, Any]],
        argv: list[str],
        threads: int | None = None,
        verbose: bool = False,
    ) -> None:
        configure_logging(verbose=verbose)
        if threads:
            torch.set_num_threads(threads)
        self.rank = rank
        self.world_size = world_size
        self.supervisor = supervisor
        self.ctx = WorkerContext(
            rank=rank,
            world_size=world_size,
            run_id=run_id,
            run_dir=Path(run_dir),
            reporter=RayReporter(supervisor),
            faults=[Fault.model_validate(f) for f in faults],
            argv=list(argv),
        )

    def node_address(self) -> tuple[str, int]:
        """An address and a free port on this node, for the process group's rendezvous."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def pid(self) -> int:
        return os.getpid()

    def init_process_group(self, addr: str, port: int) -> None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)
        os.environ.update(
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
        )
        dist.init_process_group(
            backend,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S),
        )

    def run(self, target: str) -> dict[str, Any]:
        """Run the training function; return this rank's summary (never raises)."""
        t0 = time.time()
        set_context(self.ctx)
        failure: dict[str, Any] = {}
        # The user's prints (and the traceback below) reach the driver's display, prefixed by rank.
        with forward_output(self.rank, supervisor_sink(self.supervisor)):
            try:
                result = call_target(load_target(target), self.ctx.argv)
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
                    traceback.print_exc()
            finally:
                set_context(None)
                if dist.is_initialized():
                    dist.destroy_process_group()
        summary = dict(self.ctx.summary)
        summary.update(rank=self.rank, status=status, error=error, wall_s=time.time() - t0)
        summary.update(failure)
        if isinstance(result, dict):
            # Whatever it holds, the return value must not kill the rank on its way back.
            summary["result"], note = picklable_result(result)
            if note:
                summary["result_note"] = note
        return summary
