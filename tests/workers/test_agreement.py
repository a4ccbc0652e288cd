"""The command agreement of a process group (`workers.inbox.Agreement`): launched at a boundary,
read in the step's own host sync, applied at the next boundary; no read of its own when the step
read it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

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
    agreement.launch(7)
    seq = agreement.for_sync()
    assert seq is not None and seq.dtype == torch.int64
    agreement.settle(float(torch.stack([torch.tensor(0.5), seq.double().reshape(())])[1]))

    def no_read(_: torch.Tensor) -> float:
        raise AssertionError("the boundary read the agreement again")

    monkeypatch.setattr(torch.Tensor, "item", no_read)
    assert agreement.agreed(9) == 7, "the seq every rank held when it launched, not 9"


def test_an_agreement_no_step_read_is_read_at_the_next_boundary(one_rank_group: None) -> None:
    """A step that ended early (a lost peer, an OOM) read nothing: the boundary reads it itself."""
    agreement = Agreement(dist.group.WORLD, torch.device("cpu"))
    agreement.launch(3)
    assert agreement.agreed(5) == 3
    agreement.launch(4)
    agreement.finish()  # the loop ended: the collective completes, nobody applies it
    assert agreement.for_sync() is None
