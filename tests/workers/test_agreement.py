"""The command agreement of a process group (`rank.link.inbox.Agreement`): launched as a step
begins, read in the step's own host sync, applied at the next boundary; no read of its own when
the step read it; the step's one Guard all-reduce, carrying the phases' numbers too."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from remedy.rank.link.inbox import Agreement


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_the_steps_sync_settles_the_agreement_and_the_boundary_reads_nothing_more(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    agreement = Agreement(dist.group.WORLD, torch.device("cpu"))
    assert agreement.agreed(2) == 2, "the group's first boundary agrees there and then"
    agreement.launch(7, late_ms=1200, warming=True)
    values = agreement.for_sync()
    assert values is not None and values.dtype == torch.int64
    # Read stacked with the step's loss, as the Guard's one host sync reads it.
    agreement.settle(torch.cat([torch.tensor([0.5]), values.double()]).tolist()[1:])
    assert agreement.phase == [1200, 1], "the phases' numbers come back as the group's MAX"

    def no_read(*_: Any) -> Any:
        raise AssertionError("the boundary read the agreement again")

    monkeypatch.setattr(torch.Tensor, "item", no_read)
    monkeypatch.setattr(torch.Tensor, "tolist", no_read)
    assert agreement.agreed(9) == 7, "the seq every rank held when it launched, not 9"
    assert agreement.news is False


def test_an_agreement_no_step_read_is_read_at_the_next_boundary(one_rank_group: None) -> None:
    """A step that ended early (a lost peer, an OOM) read nothing: the boundary reads it itself."""
    agreement = Agreement(dist.group.WORLD, torch.device("cpu"))
    agreement.launch(3, news=True)
    assert agreement.agreed(5) == 3
    assert agreement.news is True, "the news travelled with the seq"
    agreement.launch(4)
    agreement.finish()  # the loop ended: the collective completes, nobody applies it
    assert agreement.for_sync() is None


# ------------------------------------------------------------------ real gloo ranks
STEPS = 8


def _rank_main(rank: int, world: int, tmp: str) -> None:
    """One DDP rank under a Guard: count the Python all-reduces each step launches (DDP's own
    bucket all-reduces run in its C++ reducer, not through `dist.all_reduce`)."""
    from remedy import Guard, GuardConfig  # noqa: PLC0415 - in the spawned rank
    from remedy.rank.link.context import WorkerContext  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world
    )
    real = dist.all_reduce
    calls: list[tuple[str, list[int]]] = []

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((str(kwargs.get("op", args[0] if args else "")), tensor.tolist()))
        return real(tensor, *args, **kwargs)  # the real collective, every time

    dist.all_reduce = counted  # type: ignore[assignment]
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    gen = torch.Generator().manual_seed(rank)
    data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen))] * (STEPS + 1)
    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
        data=data,
        max_steps=STEPS,
        config=GuardConfig(detectors=[], snapshot_every=1000, replica_check_every=0),
        context=WorkerContext(),
    )
    at_step: list[int] = []  # the all-reduces launched before each step began
    for batch in guard:
        at_step.append(len(calls))
        guard.step(batch)
    guard.close()
    # From one step's start to the next's: the step and the boundary after it.
    per_step = [b - a for a, b in itertools.pairwise(at_step)]
    Path(tmp, f"rank{rank}.json").write_text(json.dumps({"per_step": per_step, "calls": calls}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort interpreter teardown (see test_detectors_distributed)


@pytest.mark.timeout(180)
def test_a_guarded_step_launches_one_all_reduce_beside_ddps(tmp_path: Path) -> None:
    """Two real gloo DDP ranks under a Guard: each step launches exactly one all-reduce of its
    own (the commands' seq, news and the phases' numbers in one int64 tensor), not one for the
    agreement (at the boundary) and another for the phases (as the step began)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank_main, args=(2, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["per_step"] == [1] * (STEPS - 1), out
        # The first boundary agrees there and then; then one per step, nothing else.
        assert len(out["calls"]) == STEPS + 1, out
        assert all(len(values) == 4 for _, values in out["calls"]), out
