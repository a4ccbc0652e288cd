"""The README's DDP loop with the Guard alone, as a launcher runs it (torchrun, Ray Train).

    torchrun --nproc_per_node 2 tests/workers/launched_train.py --run-dir runs/t --steps 60
    TorchTrainer(ray_train_loop, train_loop_config={"run_dir": ..., "steps": 60}, ...)

Under torchrun the script forms the process group itself (gloo, from the
environment torchrun sets); under Ray Train `train_loop_per_worker` calls
`train` inside the group Ray Train formed. Each rank writes its parameters
and its summary to the run directory's `out/` when the loop ends, for the
tests to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from remedy import Guard, GuardConfig, get_context

SAMPLES, FEATURES = 4096, 16


def make_data(seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    y = (x @ torch.randn(FEATURES, 1, generator=gen)).tanh() + 0.1 * torch.randn(
        SAMPLES, 1, generator=gen
    )
    return TensorDataset(x, y)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


class LoopState:
    """The loop's own counter (Stateful); `broken` makes its `load_state_dict` raise."""

    def __init__(self, broken: bool) -> None:
        self.trained, self.broken = 0, broken

    def state_dict(self) -> dict[str, int]:
        return {"trained": self.trained}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.broken:
            raise RuntimeError("this rank's loop state refuses to load")
        self.trained = state["trained"]


def train(
    run_dir: str,
    steps: int,
    seed: int = 0,
    policy: str | None = None,
    broken_state_rank: int | None = None,
) -> dict[str, Any]:
    """The loop: every rank builds the same model, DDP keeps it equal, each reads its shard.
    Its counter of steps trained is registered `state=`; on `broken_state_rank` it cannot load."""
    ctx = get_context()
    rank, world = (ctx.rank, ctx.world_size) if ctx else (0, 1)
    torch.manual_seed(seed)  # the same initial weights on every rank
    model: nn.Module = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
    if world > 1 and dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(model)
    dataset = make_data(seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=seed)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loop_state = LoopState(broken=rank == broken_state_rank)
    guard = Guard(
        model,
        optimizer,
        loss_fn=loss_fn,
        data=loader,
        epochs=100,
        max_steps=steps,
        run_dir=run_dir,
        config=GuardConfig(snapshot_every=5, checkpoint_every=10, policy=policy),
        state={"loop": loop_state},
    )
    for batch in guard:
        guard.step(batch)
        loop_state.trained += 1
    summary = guard.close()
    out = Path(run_dir) / "out"
    out.mkdir(exist_ok=True)
    torch.save(model.state_dict(), out / f"params.rank{rank}.pt")
    (out / f"summary.rank{rank}.json").write_text(json.dumps(summary, default=str))
    outcomes = [o.to_dict() for o in guard.history]  # every command this rank applied, and where
    (out / f"outcomes.rank{rank}.json").write_text(json.dumps(outcomes, default=str))
    (out / f"trained.rank{rank}.json").write_text(json.dumps(loop_state.trained))
    return summary


def init_group() -> None:
    """The gloo group from torchrun's environment, its keys under this attempt's prefix.

    After torchrun's elastic agent restarts the workers, the store they share
    still holds the first attempt's keys, and a group formed on it can read
    the dead workers' addresses (seen with torch 2.13: "Connection refused" in
    connectFullMesh; pytorch/pytorch#167288 reports the same with NCCL).
    """
    from torch.distributed.rendezvous import rendezvous  # noqa: PLC0415

    store, rank, world = next(rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank, world_size=world
    )


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--policy", default=None, help="a policy file or bundled name")
    p.add_argument("--broken-state-rank", type=int, default=None,
                   help="the rank whose loop state refuses to load")  # fmt: skip
    args = p.parse_args(argv)
    init_group()
    try:
        train(
            args.run_dir, args.steps, policy=args.policy, broken_state_rank=args.broken_state_rank
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])


def ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's `train_loop_per_worker`: the same loop, in the group Ray Train formed."""
    if config.get("chaos"):
        os.environ["REMEDY_CHAOS"] = config["chaos"]
    train(config["run_dir"], config["steps"])
