"""A chaos `nan_loss` with `repeat`: a fault tied to its step, back each time the step runs again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from remedy.rank.chaos.faults import FaultInjector, parse_chaos
from remedy.rank.exceptions import ChaosConfigError


def _injector(tmp_path: Path | None, **fault: object) -> FaultInjector:
    faults = parse_chaos({"faults": [{"kind": "nan_loss", "at_step": 5, **fault}]})
    return FaultInjector(faults, 0, run_dir=tmp_path)


def test_repeat_makes_the_step_nan_each_time_it_runs(tmp_path: Path) -> None:
    """With `repeat: 3`, the first three runs of step 5 are NaN (shared through the run
    directory, as a replaced process would see), the fourth is clean; other steps never."""
    loss = torch.tensor(1.5)
    runs = []
    for _ in range(4):
        injector = _injector(tmp_path, repeat=3)  # a fresh process each time
        assert torch.isfinite(injector.on_loss(4, 4, loss))
        runs.append(bool(torch.isnan(injector.on_loss(5, 5, loss))))
    assert runs == [True, True, True, False]


def test_without_repeat_the_fault_fires_once_and_keeps_its_name() -> None:
    """The default fires once per run, and a fault's name does not depend on `repeat` then."""
    injector = _injector(None)
    loss = torch.tensor(1.5)
    assert torch.isnan(injector.on_loss(5, 5, loss))
    assert torch.isfinite(injector.on_loss(5, 5, loss))
    once = parse_chaos({"faults": [{"kind": "nan_loss", "at_step": 5}]})[0]
    assert "repeat" not in once.key(0)
    assert once.key(0) != parse_chaos(
        {"faults": [{"kind": "nan_loss", "at_step": 5, "repeat": 2}]}
    )[0].key(0)


def test_repeat_is_refused_on_other_kinds() -> None:
    """`repeat` is a nan_loss parameter: another kind names it as an unknown key."""
    with pytest.raises(ChaosConfigError, match="repeat"):
        parse_chaos({"faults": [{"kind": "nan_grad", "at_step": 5, "repeat": 2}]})
