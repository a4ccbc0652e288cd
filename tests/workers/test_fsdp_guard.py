"""The Guard on a `fully_shard`-ed model, 2 gloo ranks: global norms, local-shard snapshots, rollback."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.protocol.commands import Command
from remedy.rank import Guard, GuardConfig
from remedy.rank.loop.measure import GradNorm, module_grad_norms
from remedy.rank.state import sharding
from tests.workers.fsdp_ranks import backends, rank_device, spawn_ranks

pytestmark = [pytest.mark.timeout(300)]

CFG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
GLOBAL_BATCH = 8


def build(*, shard: bool, hsdp: bool = False) -> GPT:
    """The same initial weights on every rank; sharded per block and at the root (FSDP2).

    `hsdp`: on a (2, world / 2) mesh, sharded within each half of the ranks and
    replicated across the halves.
    """
    torch.manual_seed(0)
    model = GPT(CFG)
    if shard:
        device = rank_device()
        model.to(device)
        world = dist.get_world_size()
        mesh = (
            init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
            if hsdp
            else None
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def corpus() -> SyntheticCorpus:
    return SyntheticCorpus(block_size=CFG.block_size, batch_size=GLOBAL_BATCH, seed=0)


def local_rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's part of a global batch, on its device: the global batch stays the same at any
    world size."""
    return batch.chunk(world)[rank].to(rank_device())


def shard_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(sharding.local(p).detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def full_digest(model: torch.nn.Module) -> str:
    """Digest of the whole parameters, gathered (a collective): equal on every rank of a sound run."""
    digest = hashlib.sha256()
    for p in model.parameters():
        whole = p.full_tensor() if sharding.is_dtensor(p) else p  # type: ignore[attr-defined]
        digest.update(whole.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------ global norms
def _norms_rank(rank: int, world: int, hsdp: bool) -> dict[str, Any]:
    model = build(shard=True, hsdp=hsdp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = corpus()
    guard = Guard(model, opt, loss_fn=lm_loss, max_steps=1, config=GuardConfig(detectors=[]),
                  data=lambda i: local_rows(data.batch(i), rank, world))  # fmt: skip
    result = next(guard.step(b) for b in guard)
    # Step 0's gradients are still there (the optimizer step does not free them).
    per_module = guard.module_grad_norms()
    if rank == 1:  # a NaN in one shard only, on one rank
        sharding.local(model.blocks[1].attn.proj.weight.grad).view(-1)[0] = float("nan")
    culprit = sharding.first_nonfinite_param(model)
    guard.close()
    return {"norm": result.grad_norm, "modules": per_module, "culprit": culprit}


@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (4, True)], ids=["fsdp", "hsdp-2x2"])
@pytest.mark.parametrize("backend", backends(4))
@pytest.mark.slow
def test_global_grad_norm_and_culprit_equal_the_unsharded_model(
    tmp_path: Path, world: int, hsdp: bool, backend: str
) -> None:
    """The sharded norm, per-module norms and culprit layer are those of the unsharded model on the
    same global batch: FSDP on 2 ranks, and HSDP on a 2 x 2 mesh, whose replicas are not summed
    twice (each rank trains on its own quarter of the batch; a NaN lands in one replica only)."""
    ranks = spawn_ranks(_norms_rank, world, tmp_path, hsdp, backend=backend)
    # Only the order of float32 additions differs (reduce-scatter, shard sums); the GPU's
    # kernels also sum in another order than the CPU reference does.
    rel = 1e-5 if backend == "gloo" else 1e-4
    torch.manual_seed(0)
    plain = build(shard=False)
    lm_loss(plain, corpus().batch(0)).backward()
    expected = float(GradNorm(list(plain.parameters()))())
    expected_modules = module_grad_norms(plain)
    for got in ranks:
        assert got["norm"] == pytest.approx(expected, rel=rel)
        assert got["modules"].keys() == expected_modules.keys()
        for name, value in expected_modules.items():
            assert got["modules"][name] == pytest.approx(value, rel=max(rel, 1e-4), abs=1e-9)
        assert got["culprit"] == "blocks.1.attn.proj.weight"


# ----------------------------------------------- snapshots and rollback
def _train_rank(rank: int, world: int, steps: int, rollback_at: int | None) -> dict[str, Any]:
    model = build(shard=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = corpus()
    guard = Guard(model, opt, loss_fn=lm_loss, max_steps=steps,
                  config=GuardConfig(detectors=[], snapshot_every=4, grad_clip=1.0),
                  data=lambda i: local_rows(data.batch(i), rank, world))  # fmt: skip
    info: dict[str, Any] = {}
    losses = []
    for batch in guard:
        result = guard.step(batch)
        losses.append(result.loss)
        if rollback_at is not None and result.step == rollback_at and "rolled" not in info:
            snap = guard.snapshots.newest_at_or_before(4)
            assert snap is not None
            shards = [v for v in snap.model.values() if isinstance(v, sharding.LocalShard)]
            info["snapshot"] = {
                "all_local": len(shards) == len(snap.model),
                "local_numel": sum(s.local.numel() for s in shards),
                "full_numel": sum(s.shape.numel() for s in shards),
                "optimizer_local": all(
                    isinstance(v, sharding.LocalShard)
                    for st in snap.optimizer["state"].values()
                    for k, v in st.items() if k != "step"
                ),
            }  # fmt: skip
            guard.submit(Command("rb-1", "rollback", {"steps_back": result.step - 4}, 0,
                                 result.step))  # fmt: skip
            info["rolled"] = True
    info.update(losses=losses, shard=shard_digest(model), full=full_digest(model),
                summary=guard.close())  # fmt: skip
    return info


@pytest.mark.parametrize("backend", backends(2))
def test_rollback_restores_every_shard_and_ranks_agree(tmp_path: Path, backend: str) -> None:
    """Snapshots hold local shards only; after a rollback the run ends bitwise equal to a fault-free one."""
    clean = spawn_ranks(_train_rank, 2, tmp_path / "clean", 12, None, backend=backend)
    rolled = spawn_ranks(_train_rank, 2, tmp_path / "rolled", 12, 9, backend=backend)
    full_numel = sum(t.numel() for t in build(shard=False).state_dict().values())
    for rank in (0, 1):
        snap = rolled[rank]["snapshot"]
        assert snap["all_local"] and snap["optimizer_local"]
        assert snap["local_numel"] < snap["full_numel"]
        assert rolled[rank]["summary"]["steps_executed"] == 12 + 6
        assert rolled[rank]["shard"] == clean[rank]["shard"]
        assert rolled[rank]["losses"][-8:] == clean[rank]["losses"][-8:]
    # Each rank held a different part; together exactly the whole state dict, never gathered.
    assert sum(r["snapshot"]["local_numel"] for r in rolled) == full_numel
    assert rolled[0]["shard"] != rolled[1]["shard"]
    assert rolled[0]["full"] == rolled[1]["full"] == clean[0]["full"]


# ------------------------------------------------------------ remediations
def _remedy_rank(rank: int, world: int, case: str) -> dict[str, Any]:
    from remedy.rank.actions.activation_checkpointing import enable_activation_checkpointing  # noqa: PLC0415
    from remedy.rank.chaos.faults import Fault  # noqa: PLC0415
    from remedy.rank.link.context import WorkerContext  # noqa: PLC0415

    model = build(shard=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = corpus()
    config = GuardConfig(detectors=[], micro_batches=2 if case == "micro" else 1)
    scaler = None
    faults = []
    if case == "scaler":
        config.amp_dtype = torch.float16
        scaler = torch.amp.GradScaler(rank_device().type, init_scale=2.0**10)
        faults = [Fault(kind="nan_grad", at_step=2, rank=1)]  # one rank's shard only
    if case == "checkpointing":
        enable_activation_checkpointing(model)
    ctx = WorkerContext(rank=rank, world_size=world, faults=faults)
    guard = Guard(model, opt, loss_fn=lm_loss, max_steps=4, scaler=scaler, config=config,
                  context=ctx, data=lambda i: local_rows(data.batch(i), rank, world))  # fmt: skip
    if case == "shrink":
        guard.submit(Command("cut-1", "shrink_lr", {"factor": 0.5}, 0, 0))
        guard.submit(Command("skip-1", "skip_batches", {"count": 2}, 0, 0))
    out = [guard.step(b) for b in guard]
    guard.close()
    return {
        "norms": [r.grad_norm for r in out],
        "losses": [r.loss for r in out],
        "skipped": [r.optimizer_skipped for r in out],
        "lrs": [r.lr for r in out],
        "scaler": type(guard.scaler).__name__ if guard.scaler is not None else None,
        "scale": float(guard.scaler.get_scale()) if guard.scaler is not None else None,
        "skipped_batches": guard.close()["skipped_batches"],
        "full": full_digest(model),
    }


@pytest.mark.parametrize("backend", backends(2))
@pytest.mark.slow
def test_remediations_on_a_sharded_model(tmp_path: Path, backend: str) -> None:
    """Micro-batches keep the global batch, checkpointing keeps FSDP's hooks, LR cuts and skips apply."""
    base = spawn_ranks(_remedy_rank, 2, tmp_path / "base", "base", backend=backend)
    micro = spawn_ranks(_remedy_rank, 2, tmp_path / "micro", "micro", backend=backend)
    ckpt = spawn_ranks(_remedy_rank, 2, tmp_path / "ckpt", "checkpointing", backend=backend)
    cut = spawn_ranks(_remedy_rank, 2, tmp_path / "cut", "shrink", backend=backend)
    for rank in (0, 1):
        # Two micro-batches of the same rows: the same gradient up to float32 summation order.
        assert micro[rank]["norms"] == pytest.approx(base[rank]["norms"], rel=1e-5)
        assert micro[rank]["losses"] == pytest.approx(base[rank]["losses"], rel=1e-5)
        # Recomputed activations are the same numbers: the checkpointed run is bitwise the same.
        assert ckpt[rank]["norms"] == base[rank]["norms"]
        assert ckpt[rank]["full"] == base[rank]["full"]
        assert cut[rank]["lrs"] == pytest.approx([lr * 0.5 for lr in base[rank]["lrs"]])
        assert cut[rank]["skipped_batches"] == [0, 1]
    assert cut[0]["full"] == cut[1]["full"] != base[0]["full"]


@pytest.mark.parametrize("backend", backends(2))
def test_gradscaler_becomes_sharded_and_ranks_skip_together(tmp_path: Path, backend: str) -> None:
    """A NaN in one rank's gradient shard: with the Guard's sharded scaler both ranks skip and back off."""
    ranks = spawn_ranks(_remedy_rank, 2, tmp_path, "scaler", backend=backend)
    for got in ranks:
        assert got["scaler"] == "ShardedGradScaler"
        assert got["skipped"][2] is True
    assert ranks[0]["skipped"] == ranks[1]["skipped"]
    assert ranks[0]["scale"] == ranks[1]["scale"]
    assert ranks[0]["full"] == ranks[1]["full"]


# ------------------------------------------------- reduce_microbatch, sent
POLICY = str(Path(__file__).with_name("fsdp_policy.yaml"))
OOM_AT, COMMAND_AT = 2, 3


def _micro_rank(rank: int, world: int, halve: bool) -> dict[str, Any]:
    """5 steps; with `halve`, the policy halves the micro-batch after an OOM in step OOM_AT's
    backward, and a command sent by hand halves it again at step COMMAND_AT."""
    model = build(shard=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = corpus()
    guard = Guard(model, opt, loss_fn=lm_loss, max_steps=5,
                  config=GuardConfig(detectors=[], policy=POLICY),
                  data=lambda i: local_rows(data.batch(i), rank, world))  # fmt: skip
    armed = [halve]

    def out_of_memory(grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("test: out of memory in block 0's backward")

    def arm(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        # Every rank, half-way through the backward: FSDP has reduced block 1's gradients
        # and holds the rest gathered when the error comes.
        if armed[0] and guard.step_count == OOM_AT:
            armed[0] = False
            output.register_hook(out_of_memory)

    model.blocks[0].register_forward_hook(arm)
    out = []
    for batch in guard:
        out.append(guard.step(batch))
        if halve and out[-1].step == COMMAND_AT - 1:  # applied at the next boundary
            guard.submit(Command("mb-1", "reduce_microbatch", {"factor": 2}, COMMAND_AT, 0))
    summary = guard.close()
    return {
        "norms": [r.grad_norm for r in out],
        "losses": [r.loss for r in out],
        "micro_batches": guard.micro_batches,
        "applied": [(o.decision_id, o.step) for o in guard.history if o.outcome == "applied"],
        "steps_executed": summary["steps_executed"],
        "full": full_digest(model),
    }


@pytest.mark.parametrize("backend", backends(2))
@pytest.mark.slow
def test_reduce_microbatch_on_a_sharded_model_keeps_the_global_batch(
    tmp_path: Path, backend: str
) -> None:
    """The policy's reduce_microbatch after an OOM in the backward, then a reduce_microbatch
    command, split each rank's 4 rows into 2 then 4 micro-batches; every step's loss and global
    gradient norm stay those of the run that never split, and the ranks end equal.

    Tolerance: the chunks' gradients are summed in float32 before the reduce-scatter, in another
    order than one backward sums the rows (at most 1.2e-7 relative here); steps before the split
    are bitwise."""
    base = spawn_ranks(_micro_rank, 2, tmp_path / "base", False, backend=backend)
    got = spawn_ranks(_micro_rank, 2, tmp_path / "halved", True, backend=backend)
    for rank in (0, 1):
        assert base[rank]["micro_batches"] == 1 and got[rank]["micro_batches"] == 4
        assert [step for _, step in got[rank]["applied"]] == [OOM_AT, COMMAND_AT]
        assert got[rank]["applied"][1][0] == "mb-1"
        assert got[rank]["steps_executed"] == 5  # the OOM's attempt is retried, not counted
        assert got[rank]["norms"][:OOM_AT] == base[rank]["norms"][:OOM_AT]
        # Before the fix, a sharded model never reduced a gradient again after the OOM (norm 0).
        assert got[rank]["norms"] == pytest.approx(base[rank]["norms"], rel=1e-5)
        assert got[rank]["losses"] == pytest.approx(base[rank]["losses"], rel=1e-5)
    assert got[0]["full"] == got[1]["full"]
