"""A Guard over a DataLoader of an IterableDataset: a NaN is rolled back and the run trains on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from remedy.rank import Guard, GuardConfig
from remedy.rank.chaos.faults import parse_chaos
from remedy.rank.link.context import WorkerContext

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Samples generated on the fly: no length, no indexing, cannot go back."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(8, 1, generator=g)
        while True:
            x = torch.randn(8, generator=g)
            yield x, x @ w


def test_nan_under_an_iterable_dataset_is_rolled_back_and_training_goes_on(
    tmp_path: Path,
) -> None:
    """Chaos NaN at step 15: rollback applied (data not rewound, said so), 30 logical steps trained."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    loader = torch.utils.data.DataLoader(Stream(), batch_size=16)
    faults = parse_chaos({"faults": [{"kind": "nan_loss", "at_step": 15, "rank": 0}]})
    guard = Guard(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
        data=loader,
        max_steps=30,
        config=GuardConfig(checkpoint_every=0),
        context=WorkerContext(faults=faults, run_dir=tmp_path),
    )
    for batch in guard:
        guard.step(batch)
    summary = guard.close()
    rollback = next(o for o in guard.history if "restored_step" in o.result)
    assert rollback.outcome == "applied"
    assert rollback.result["data_rewound"] is False
    assert "not rewound" in rollback.detail
    assert summary["steps_completed"] == 30
    assert summary["steps_executed"] > 30
    assert all(torch.isfinite(p).all() for p in model.parameters())
