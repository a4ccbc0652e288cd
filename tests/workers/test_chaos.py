"""Chaos files validate strictly; faults fire at their step and rank, once or per poisoned batch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from remedy.workers.chaos import FaultInjector, load_chaos, parse_chaos
from remedy.workers.exceptions import ChaosConfigError


def test_load_demo_chaos_file() -> None:
    """The demo's chaos file loads into two faults."""
    faults = load_chaos(Path(__file__).resolve().parents[2] / "examples" / "chaos" / "demo.yaml")
    assert [f.kind for f in faults] == ["nan_loss", "loss_spike"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"faults": [{"kind": "nan_lose", "at_step": 1}]}, "faults.0.kind"),
        ({"faults": [{"kind": "nan_loss"}]}, "at_step"),
        ({"faults": [{"kind": "nan_loss", "at_step": -1}]}, "at_step"),
        ({"faults": [{"kind": "nan_loss", "at_step": 1, "colour": "red"}]}, "colour"),
        ({"fault": []}, "fault"),
        ({"faults": [{"kind": "kill_supervisor", "at_step": 3}]}, "cannot be injected"),
    ],
)
def test_bad_chaos_is_rejected_by_name(data: object, message: str) -> None:
    """A malformed chaos plan raises ChaosConfigError naming the bad entry."""
    with pytest.raises(ChaosConfigError, match=message):
        parse_chaos(data)


def test_nan_loss_fires_once_on_its_rank() -> None:
    """nan_loss hits only its rank and only the first execution of its step."""
    faults = parse_chaos({"faults": [{"kind": "nan_loss", "at_step": 5, "rank": 1}]})
    other, hit = FaultInjector(faults, rank=0), FaultInjector(faults, rank=1)
    loss = torch.tensor(2.0)
    assert float(other.on_loss(5, 5, loss)) == 2.0
    assert math.isnan(float(hit.on_loss(5, 5, loss)))
    assert float(hit.on_loss(5, 5, loss)) == 2.0  # replay after a rollback is clean


def test_loss_spike_poisons_batches() -> None:
    """A spike poisons the batches it hits; they spike again whenever retrained, others never."""
    inj = FaultInjector(
        parse_chaos(
            {"faults": [{"kind": "loss_spike", "at_step": 10, "duration": 2, "factor": 4}]}
        ),
        0,
    )
    loss = torch.tensor(1.0)
    assert float(inj.on_loss(9, 9, loss)) == 1.0
    assert float(inj.on_loss(10, 10, loss)) == 4.0
    assert float(inj.on_loss(11, 11, loss)) == 4.0
    assert inj.poisoned_batches == [10, 11]
    # After a rollback, steps 10 and 11 read other batches (10 and 11 were skipped).
    assert float(inj.on_loss(10, 40, loss)) == 1.0
    assert float(inj.on_loss(12, 10, loss)) == 4.0


def test_grad_faults() -> None:
    """nan_grad puts a NaN in one gradient; grad_explosion scales every gradient."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    inj = FaultInjector(
        parse_chaos(
            {
                "faults": [
                    {"kind": "nan_grad", "at_step": 1},
                    {"kind": "grad_explosion", "at_step": 2, "factor": 100},
                ]
            }
        ),
        0,
    )
    inj.on_grads(1, [p])
    assert math.isnan(float(p.grad[0]))
    p.grad = torch.ones(3)
    inj.on_grads(2, [p])
    assert torch.equal(p.grad, torch.full((3,), 100.0))


def test_oom_fault_raises_out_of_memory() -> None:
    """The oom fault raises torch.OutOfMemoryError once."""
    inj = FaultInjector(parse_chaos({"faults": [{"kind": "oom", "at_step": 3}]}), 0)
    with pytest.raises(torch.OutOfMemoryError):
        inj.before_step(3)
    inj.before_step(3)
