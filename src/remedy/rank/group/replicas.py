"""Replicas that must agree: a cheap periodic check of data-parallel ranks' state.

With data parallelism every replica holds bitwise-equal parameters and
optimizer state after each step. A flipped bit in one rank's weights may raise
no NaN and no spike: training goes on with replicas that no longer agree, and
every all-reduce from then on averages gradients of different models. Every
`GuardConfig.replica_check_every` steps, at a step boundary, each rank folds
the bit sums of its parameters and of its optimizer state into two int64s
(`workers.digests`: exact, in any summation order) and one all-gather of those
compares them across the replica group. A rank whose digest is not the
majority's (with two replicas: not the lowest rank's, see `digests.odd_ones`)
reports `replica_divergence` itself, with every rank's digests and the first
tensor that differs (a second all-gather of one number per tensor, made only
when they disagree).

The replica group: under DDP every rank; under HSDP the ranks that hold the
same shard (the mesh's replicate dimension), compared within each such group;
a sharded model without replicas (plain FSDP) has nothing to compare.

What it costs: reading every parameter and optimizer state element once (the
bit sums) and a 16-byte all-gather. `benchmarks/replica_check.py` measures it
against the example's step; `DEFAULT_EVERY` keeps it a small part of the
Guard's 1% (see docs/benchmarks.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist

from remedy.rank.state import sharding
from remedy.rank.state.digests import bit_sums, hex64, odd_ones

if TYPE_CHECKING:
    from remedy.policies import AnomalyEvent
    from remedy.rank.guard import Guard

log = structlog.get_logger("remedy.replicas")

# Steps between two checks by default (docs/benchmarks.md: the check costs 2-5% of the
# example's step on these CPUs, so every 50 steps it adds under 0.1%).
DEFAULT_EVERY = 50
# Ranks whose digests an event lists (its details are bounded).
LISTED_RANKS = 8


def replica_group(guard: Guard) -> Any | None:
    """The process group of the ranks that must hold the same state as this one (None: none)."""
    if guard.group is None:
        return None
    if not guard.sharded:
        return guard.group
    for p in guard.params:
        if sharding.is_dtensor(p):
            spec: Any = p
            dims = [i for i, pl in enumerate(spec.placements) if pl.is_replicate()]
            if len(dims) == 1 and spec.device_mesh.size(dims[0]) > 1:
                return spec.device_mesh.get_group(dims[0])
            return None
    return None


def state_tensors(guard: Guard) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    """(parameters, optimizer state tensors, the names of both), in a fixed order."""
    named = [(n, p) for n, p in unwrap_ddp(guard.model).named_parameters() if p.requires_grad]
    params: list[torch.Tensor] = [p for _, p in named]
    names = [n for n, _ in named]
    optim: list[torch.Tensor] = []
    for name, p in named:
        state = guard.optimizer.state.get(p, {})
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                optim.append(value)
                names.append(f"{name} ({key})")
    return params, optim, names


def unwrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """The module a DDP wrapper holds (the same parameters, names without `module.`; its
    forward runs no collective), else the model itself."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


@dataclass
class ReplicaCheck:
    """Runs the check every `every` steps (0: never); remembers the last step replicas agreed."""

    every: int
    last_agreed: int | None = None
    last_s: float = 0.0  # how long the latest check took here

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def check(self, guard: Guard) -> AnomalyEvent | None:
        """Compare this rank's state with its replicas' (every rank of the group calls this);
        the event this rank must report, if it is the odd one."""
        group = replica_group(guard)
        if group is None:
            return None
        t0 = time.perf_counter()
        params, optim, names = state_tensors(guard)
        device = _device_of(group)
        mine = torch.stack(
            [
                bit_sums(params).sum().to(device),
                bit_sums(optim).sum().to(device)
                if optim
                else torch.zeros((), dtype=torch.int64, device=device),
            ]
        )
        ranks = dist.get_process_group_ranks(group)
        gathered = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(gathered, mine, group=group)
        digests = {
            r: tuple(int(v) for v in t.tolist()) for r, t in zip(ranks, gathered, strict=True)
        }
        odd = odd_ones(digests)
        self.last_s = time.perf_counter() - t0
        step = guard.step_count
        if not odd:
            self.last_agreed = step
            return None
        where = self._first_difference(params + optim, names, group, ranks, odd, digests)
        if guard.rank not in odd:
            log.warning("replicas_differ", step=step, odd=odd, first_difference=where)
            return None
        return self._event(guard, step, ranks, odd, digests, where)

    def _first_difference(
        self,
        tensors: list[torch.Tensor],
        names: list[str],
        group: Any,
        ranks: list[int],
        odd: list[int],
        digests: dict[int, tuple[int, ...]],
    ) -> str | None:
        """The first tensor whose bits differ between the first odd rank and the reference."""
        mine = bit_sums(tensors).to(_device_of(group))
        gathered = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(gathered, mine, group=group)
        by_rank = dict(zip(ranks, gathered, strict=True))
        reference = next(r for r in ranks if r not in odd)
        differ = (by_rank[odd[0]] != by_rank[reference]).nonzero()
        return names[int(differ[0])] if len(differ) else None

    def _event(
        self,
        guard: Guard,
        step: int,
        ranks: list[int],
        odd: list[int],
        digests: dict[int, tuple[int, ...]],
        where: str | None,
    ) -> AnomalyEvent:
        from remedy.policies import AnomalyEvent  # noqa: PLC0415 - only when replicas disagree

        reference = next(r for r in ranks if r not in odd)
        listed = [*odd, reference, *(r for r in ranks if r not in odd and r != reference)]
        rows = {
            str(r): {"params": hex64(digests[r][0]), "optimizer": hex64(digests[r][1])}
            for r in listed[:LISTED_RANKS]
        }
        mine, ref = rows[str(guard.rank)], rows[str(reference)]
        reason = (
            f"rank {guard.rank}'s parameters/optimizer state ({mine['params']}/"
            f"{mine['optimizer']}) differ from rank {reference}'s ({ref['params']}/"
            f"{ref['optimizer']})"
        )
        if where:
            reason += f", first at {where}"
        if self.last_agreed is not None:
            reason += f"; they agreed at step {self.last_agreed}"
        return AnomalyEvent(
            kind="replica_divergence",
            rank=guard.rank,
            step=step,
            tick=guard.tick,
            value=float(len(odd)),
            severity="critical",
            ts=time.time(),
            details={
                "odd": odd,
                "reference": reference,
                "group": ranks,
                "digests": rows,
                "first_difference": where,
                "checked_every": self.every,
                "last_agreed_step": self.last_agreed,
                "reason": reason,
            },
        )


def _device_of(group: Any) -> torch.device:
    """Where a collective of `group` takes its tensors: CUDA for NCCL, the host for gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
