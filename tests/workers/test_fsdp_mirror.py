"""The buddy ring on 4 FSDP2 gloo ranks: a replaced rank's shard from its buddy, a replica, or DCP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from examples.gpt_model import GPT, lm_loss
from remedy.rank import Guard, GuardConfig
from remedy.rank.group import regroup
from remedy.rank.link.context import WorkerContext
from remedy.rank.state import shard_mirror, sharding
from remedy.rank.state.snapshots import Snapshot
from tests.workers.fsdp_ranks import backends, rank_device, spawn_ranks
from tests.workers.test_fsdp_dcp import _rank_dir
from tests.workers.test_fsdp_guard import CFG, corpus, full_digest, local_rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, LOST_AT = 10, 6


def _model(*, hsdp: bool, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    device = rank_device()
    model = GPT(CFG).to(device)
    mesh = (
        init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else None
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _guard(rank: int, world: int, workdir: Path, model: GPT) -> Guard:
    data = corpus()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctx = WorkerContext(rank=rank, world_size=world, run_dir=_rank_dir(workdir, rank))
    return Guard(model, opt, loss_fn=lm_loss, max_steps=STEPS, context=ctx,
                 config=GuardConfig(detectors=[], snapshot_every=1, checkpoint_every=4,
                                    grad_clip=1.0),
                 data=lambda i: local_rows(data.batch(i), rank, world))  # fmt: skip


def _ring_rank(rank: int, world: int, workdir: str, lose: tuple[int, ...], hsdp: bool) -> Any:
    root = Path(workdir)
    (root / "checkpoints").mkdir(parents=True, exist_ok=True)
    guard = _guard(rank, world, root, _model(hsdp=hsdp))
    loop = iter(guard)
    for _ in range(LOST_AT):
        guard.step(next(loop))
    guard._boundary()  # the boundary of step LOST_AT: snapshot and mirror
    assert guard.mirror is not None
    guard.mirror.wait()
    out: dict[str, Any] = {"held_bytes": guard.mirror.held_bytes(), "info": None}
    if lose:
        # The lost ranks' processes are gone; every rank forms the next generation.
        store = dist.distributed_c10d._get_default_store()
        backend = dist.get_backend()
        dist.destroy_process_group()
        dist.init_process_group(backend, store=dist.PrefixStore("gen1", store), rank=rank,
                                world_size=world)  # fmt: skip
        if rank in lose:  # a fresh process: other weights, no optimizer state, nothing mirrored
            guard.close()
            guard = _guard(rank, world, root, _model(hsdp=hsdp, seed=123))
            loop = iter(guard)
            out["info"] = shard_mirror.restore_group(guard, fresh=True)
        else:
            regroup.new_groups(guard)  # agree on commands in the new generation, rebind shards
            out["info"] = shard_mirror.restore_group(guard, fresh=False)
    for batch in loop:
        guard.step(batch)
    out["full"] = full_digest(guard.model)
    out["summary"] = guard.close()
    return out


def test_pack_round_trip_keeps_every_shard_and_value() -> None:
    """A packed snapshot unpacks to the same tensors, shard layout and plain values."""
    snap = Snapshot(step=3, tick=4, cursor=3, model={"w": torch.arange(6.0).reshape(2, 3)},
                    optimizer={"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{}]},
                    scheduler=None, scaler=None, rng={"torch": torch.get_rng_state()})  # fmt: skip
    meta, flat = shard_mirror.pack(snap)
    back = shard_mirror.unpack(meta, flat, mesh=None)
    assert back.step == 3 and back.cursor == 3
    assert torch.equal(back.model["w"], snap.model["w"])
    assert torch.equal(back.rng["torch"], snap.rng["torch"])
    assert flat.numel() == sharding.shard_bytes(snap.to_state())


@pytest.mark.parametrize(
    ("lose", "hsdp", "source", "steps_lost"),
    [((1,), False, "buddy", 0), ((1, 2), False, "dcp", 2), ((1,), True, "replica", 0)],
    ids=["buddy", "buddy-lost-too", "hsdp-replica"],
)
@pytest.mark.parametrize("backend", backends(4))
def test_replaced_rank_takes_its_shard_and_the_run_ends_bitwise_equal(
    tmp_path: Path, lose: tuple[int, ...], hsdp: bool, source: str, steps_lost: int, backend: str
) -> None:
    """A fresh rank restores its shard (buddy, HSDP replica, or DCP when its buddy is lost too);
    the survivors keep theirs; the run ends bitwise equal to a fault-free one."""
    clean = spawn_ranks(_ring_rank, 4, tmp_path / "clean", str(tmp_path / "c"), (), hsdp,
                        backend=backend)  # fmt: skip
    lost = spawn_ranks(_ring_rank, 4, tmp_path / "lost", str(tmp_path / "l"), lose, hsdp,
                       backend=backend)  # fmt: skip
    for rank in range(4):
        info = lost[rank]["info"]
        assert info["source"] == source, info
        assert info["fresh"] == list(lose)
        if source != "dcp":
            assert info["steps_lost"] == steps_lost and info["step"] == LOST_AT
        else:
            assert info["step"] == LOST_AT - steps_lost
        assert lost[rank]["full"] == clean[0]["full"]
        assert clean[rank]["held_bytes"] > 0
