"""Run a function on N gloo ranks in fresh processes (no Ray) and collect what each returns.

The sharded tests need real process groups; spawning ranks directly is the
cheapest way on these machines. Each rank's return value comes back through
a file in `workdir`; a rank that raises fails the call with its traceback.

The same bodies run on NCCL, one GPU per rank: `backends(world)` are the
parameters of a test that takes `backend`, and a rank puts its model and
batches on `rank_device()`.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def backends(world: int) -> list[Any]:
    """gloo on the CPU, and NCCL on `world` GPUs (marked `gpu`; skipped with fewer GPUs)."""
    nccl = pytest.param(
        "nccl",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                torch.cuda.device_count() < world,
                reason=f"needs {world} CUDA GPUs (one per NCCL rank)",
            ),
        ],
    )
    return ["gloo", nccl]


def rank_device() -> torch.device:
    """Where this rank's model and batches live: its GPU on NCCL (set by `spawn_ranks`), else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _entry(
    rank: int,
    world: int,
    workdir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str,
) -> None:
    torch.set_num_threads(1)
    out = Path(workdir) / f"result.rank{rank}.pt"
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank
    dist.init_process_group(
        backend, init_method=f"file://{workdir}/store", rank=rank, world_size=world
    )
    try:
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    torch.save(result, out)
    # Leave together, then skip interpreter teardown: a gloo thread torn down while a peer
    # is still leaving aborts the process ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def spawn_ranks(
    fn: Callable[..., Any],
    world: int,
    workdir: Path,
    *args: Any,
    timeout_s: float = 240,
    backend: str = "gloo",
) -> list[Any]:
    """`fn(rank, world, *args)` on `world` ranks (gloo, or NCCL with a GPU each); results by rank."""
    workdir.mkdir(parents=True, exist_ok=True)
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        ctx = mp.start_processes(
            _entry, args=(world, str(workdir), fn, args, backend), nprocs=world, join=False,
            start_method="spawn",
        )  # fmt: skip
        import time  # noqa: PLC0415 - only here

        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks did not finish within {timeout_s:g}s")
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    results = []
    for rank in range(world):
        status, value = torch.load(workdir / f"result.rank{rank}.pt", weights_only=False)
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        results.append(value)
    return results
