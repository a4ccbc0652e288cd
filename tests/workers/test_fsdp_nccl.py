"""NCCL-only sharded tests: FSDP2 on one GPU per rank (skipped without enough GPUs).

The NCCL variants of the gloo tests (norms, rollback, remediations and the
scaler, reduce_microbatch, DCP reshard and corrupt fallback, buddy and HSDP
replica restore, NaN/spike rollback, HSDP targeted restart) are those tests'
`nccl` parameters (`fsdp_ranks.backends`); here are the CUDA mirror round
trip and the targeted restart from the buddy under `remedy run`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import fully_shard

from examples.gpt_model import GPT, lm_loss
from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rank import Guard, GuardConfig
from remedy.rank.state import shard_mirror, sharding
from remedy.rundir.writer import read_jsonl
from tests.workers.fsdp_ranks import spawn_ranks
from tests.workers.test_fsdp_e2e import GPT as GPT_TARGET
from tests.workers.test_fsdp_e2e import GPT_ARGS, POLICY
from tests.workers.test_fsdp_guard import CFG, corpus, local_rows

WORLD = 4
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs (one per NCCL rank)"
    ),
]


def _cuda_model(rank: int) -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG).to(f"cuda:{rank}")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def test_nccl_mirror_round_trip_rebuilds_cuda_shards(tmp_path: Path) -> None:
    """A packed snapshot of CUDA shards unpacks into host shards that rebuild on the CUDA mesh."""
    spawn_ranks(_mirror_rank, WORLD, tmp_path, backend="nccl")


def _mirror_rank(rank: int, world: int) -> None:
    model = _cuda_model(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = Guard(model, opt, loss_fn=lm_loss, max_steps=1, config=GuardConfig(detectors=[]),
                  data=lambda i: local_rows(corpus().batch(i), rank, world).cuda())  # fmt: skip
    snap = guard.take_snapshot()
    meta, flat = shard_mirror.pack(snap)
    back = shard_mirror.unpack(meta, flat, next(model.parameters()).device_mesh)  # type: ignore[attr-defined]
    for key, shard in back.model.items():
        rebuilt = shard.rebuild()
        assert rebuilt.device.type == "cuda"
        assert torch.equal(sharding.local(rebuilt), sharding.local(model.state_dict()[key]))
    guard.close()


@pytest.mark.ray
def test_nccl_sharded_rank_is_replaced_from_its_buddy(ray_cluster: None, tmp_path: Path) -> None:
    """4 NCCL FSDP2 ranks under remedy run: a SIGSTOPped rank is replaced, its shard from the buddy."""
    spec = RunSpec(target=GPT_TARGET, workers=WORLD, run_dir=str(tmp_path), policy=POLICY,
                   argv=[*GPT_ARGS, "--snapshot-every", "1", "--checkpoint-every", "8"],
                   gpus_per_rank=1.0, hang_watch={"first_step_s": 4.0},
                   faults=[{"kind": "hang_rank", "at_step": 20, "rank": 1}])  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary
    assert len({r["result"]["params_digest"] for r in summary["ranks"]}) == 1
    restart = [d for d in read_jsonl(tmp_path / "decisions.jsonl") if d["action"] == "restart_rank"]
    applied = [d for d in restart if d["outcome"] == "applied"]
    assert applied and applied[-1]["result"]["shard_restore"]["source"] == "buddy"
