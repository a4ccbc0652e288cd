"""Fault injection for chaos tests: faults scheduled by step and rank.

A chaos file is YAML: `faults: [{kind: nan_loss, at_step: 150, rank: 0}, ...]`.
Each fault perturbs the real training step (the loss, the gradients, the
loader, memory), so detection and remediation are exercised end to end.

Two kinds of fault model two kinds of real trouble:
- transient faults (`nan_loss`, `nan_grad`, `grad_explosion`, `oom`) fire
  once, the first time their step executes: a replay after a rollback is
  clean, as it is after a flipped bit or a one-off kernel error;
- data faults (`loss_spike`) poison the batches they first hit: whenever a
  poisoned batch is trained on again, the spike comes back. Only skipping
  those batches cures it, as with the bad-data spikes of large runs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from remedy.workers import process_faults
from remedy.workers.exceptions import ChaosConfigError

FaultKind = Literal[
    "nan_loss",
    "nan_grad",
    "loss_spike",
    "grad_explosion",
    "scaler_overflow_storm",
    "memory_leak",
    "oom",
    "slow_loader",
    "hang_rank",
    "kill_rank",
    "slow_collective",
    "corrupt_checkpoint",
    "kill_supervisor",
]

# What each fault does, for `remedy chaos list`; faults the running version
# cannot inject are refused when the chaos file is loaded.
FAULT_DESCRIPTIONS: dict[str, str] = {
    "nan_loss": "the loss of one step becomes NaN (once)",
    "nan_grad": "one parameter's gradient becomes NaN after backward (once)",
    "loss_spike": "the batches of `duration` steps are poisoned: their loss is scaled by `factor` "
    "every time they are trained on",
    "grad_explosion": "every gradient is scaled by `factor` for one step (once)",
    "memory_leak": "each step from `at_step` keeps `bytes` more memory alive for `duration` steps",
    "oom": "the step raises an out-of-memory error (once)",
    "slow_loader": "fetching each batch sleeps `seconds` for `duration` steps",
    "kill_rank": "the rank's process is killed (SIGKILL) at the start of the step (once per run)",
    "hang_rank": "the rank's process is stopped (SIGSTOP) at the start of the step (once per run)",
    "slow_collective": "the rank reaches its collectives after the step's backward `seconds` late "
    "(once per run)",
}
SUPPORTED_FAULTS = frozenset(FAULT_DESCRIPTIONS)


class Fault(BaseModel):
    """One scheduled fault."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: FaultKind
    at_step: int = Field(ge=0)
    rank: int | None = Field(default=0, ge=0, description="rank to hit; null means every rank")
    duration: int = Field(default=1, ge=1)
    factor: float | None = Field(default=None, gt=0)
    seconds: float = Field(default=0.5, ge=0)
    bytes: int = Field(default=8 << 20, ge=0)

    def hits(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


class ChaosPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    faults: list[Fault] = Field(default_factory=list)


def load_chaos(path: str | os.PathLike[str]) -> list[Fault]:
    """Read and validate a chaos file; raise ChaosConfigError naming the bad entry."""
    path = Path(path)
    try:
        data = YAML(typ="safe").load(path.read_text())
    except (OSError, YAMLError) as exc:
        raise ChaosConfigError(f"{path}: cannot read chaos file: {exc}") from exc
    return parse_chaos(data or {}, source=str(path))


def parse_chaos(data: Any, *, source: str = "<chaos>") -> list[Fault]:
    try:
        plan = ChaosPlan.model_validate(data)
    except ValidationError as exc:
        msgs = [f"{source}: {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise ChaosConfigError("\n".join(msgs)) from None
    for i, fault in enumerate(plan.faults):
        if fault.kind not in SUPPORTED_FAULTS:
            raise ChaosConfigError(
                f"{source}: faults.{i}.kind: fault {fault.kind!r} cannot be injected by this version; "
                f"supported: {', '.join(sorted(SUPPORTED_FAULTS))}"
            )
    return plan.faults


class FaultInjector:
    """Applies the faults scheduled for one rank to the running step."""

    def __init__(self, faults: Iterable[Fault], rank: int) -> None:
        self.rank = rank
        self.faults = [f for f in faults if f.hits(rank)]
        self._fired: set[int] = set()
        self._poisoned: dict[int, float] = {}  # batch index -> loss factor
        # A spike fault poisons the batch seen at each step of its window the
        # first time that step runs, keyed by (fault, step).
        self._fired_spikes: set[tuple[int, int]] = set()
        self._leak: list[torch.Tensor] = []
        self.log: list[dict[str, Any]] = []  # what was injected, for the metrics stream

    def _window(self, kind: str, step: int) -> list[tuple[int, Fault]]:
        if not self.faults:  # the common case: every hook is a no-op
            return []
        return [
            (i, f)
            for i, f in enumerate(self.faults)
            if f.kind == kind and f.at_step <= step < f.at_step + f.duration
        ]

    def _once(self, kind: str, step: int) -> Fault | None:
        for i, f in self._window(kind, step):
            if i not in self._fired:
                self._fired.add(i)
                return f
        return None

    def _note(self, kind: str, step: int, **info: Any) -> None:
        self.log.append({"fault": kind, "step": step, **info})

    def drain_log(self) -> list[dict[str, Any]]:
        out, self.log = self.log, []
        return out

    def before_batch(self, step: int) -> None:
        """Loader-side faults: slow batches."""
        for _, f in self._window("slow_loader", step):
            time.sleep(f.seconds)
            self._note("slow_loader", step, seconds=f.seconds)

    def before_step(self, step: int) -> None:
        """Process-level faults at the start of a step: leaks, OOM, a killed rank."""
        for _, f in self._window("memory_leak", step):
            self._leak.append(torch.empty(f.bytes, dtype=torch.uint8).fill_(1))
            self._note("memory_leak", step, bytes=f.bytes)
        if self._once("oom", step) is not None:
            self._note("oom", step)
            raise torch.OutOfMemoryError(f"chaos: injected out-of-memory at step {step}")
        if self._once("kill_rank", step) is not None:
            process_faults.kill(self.rank, step)
        if self._once("hang_rank", step) is not None:
            process_faults.hang(self.rank, step)

    def on_loss(self, step: int, batch_index: int, loss: torch.Tensor) -> torch.Tensor:
        """Loss-side faults: NaN and poisoned (spiking) batches."""
        if self._once("nan_loss", step) is not None:
            self._note("nan_loss", step)
            return loss * float("nan")
        for i, f in self._window("loss_spike", step):
            if (i, step) not in self._fired_spikes:
                self._fired_spikes.add((i, step))
                self._poisoned[batch_index] = f.factor or 10.0
        factor = self._poisoned.get(batch_index)
        if factor is not None:
            self._note("loss_spike", step, batch_index=batch_index, factor=factor)
            return loss * factor
        return loss

    def on_grads(self, step: int, params: list[torch.nn.Parameter]) -> None:
        """Gradient-side faults: a NaN gradient or an explosion; a late all-reduce."""
        f = self._once("slow_collective", step)
        if f is not None and process_faults.slow(self.rank, step, f.seconds):
            self._note("slow_collective", step, seconds=f.seconds)
        if self._once("nan_grad", step) is not None:
            for p in params:
                if p.grad is not None:
                    p.grad.view(-1)[0] = float("nan")
                    break
            self._note("nan_grad", step)
        f = self._once("grad_explosion", step)
        if f is not None:
            factor = f.factor or 1e6
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(factor)
            self._note("grad_explosion", step, factor=factor)

    @property
    def poisoned_batches(self) -> list[int]:
        return sorted(self._poisoned)
