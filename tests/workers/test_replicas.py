"""The replica check: data-parallel ranks compare exact digests; the odd one is named.

Real ranks (gloo, spawned) train with a Guard each; chaos flips one low bit of
a weight on one rank (no NaN, no spike: nothing else notices), and the check
that follows names that rank, with the tensor that differs. Under HSDP it
compares only the ranks that hold the same shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.rank import Guard, GuardConfig
from remedy.rank.chaos.faults import parse_chaos
from remedy.rank.group.replicas import ReplicaCheck, replica_group
from remedy.rank.link.context import WorkerContext
from remedy.rank.state.digests import bit_sums, digest, odd_ones
from tests.workers.fsdp_ranks import spawn_ranks

CFG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
FLIP_AT = 7
EVERY = 5


def test_a_flipped_bit_anywhere_changes_the_bit_sum_and_order_does_not() -> None:
    """Every single-bit change of any element changes the digest; permuting the elements does not."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        t = torch.randn(257).to(dtype)
        base = int(bit_sums([t])[0])
        width = t.element_size() * 8
        for bit in range(width):
            changed = t.clone()
            as_int = changed.view(
                {8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]
            )
            as_int[100] ^= (1 << bit) if bit < width - 1 else -(1 << bit)
            assert int(bit_sums([changed])[0]) != base, (dtype, bit)
        assert int(bit_sums([t[torch.randperm(257)]])[0]) == base
    a = digest([torch.ones(3), torch.zeros(2)])
    assert a.same(digest([torch.ones(3), torch.zeros(2)]))
    assert not a.same(digest([torch.ones(3), torch.tensor([0.0, 1e-30])]))
    assert a.same(digest([torch.ones(3) * (1 + 1e-7), torch.zeros(2)]), tolerance=1e-6)


def test_the_odd_rank_is_the_one_off_the_majority_and_ties_keep_the_lowest() -> None:
    """Three replicas: the one that differs. Two: the one that is not the lowest, unless the
    lowest is the one suspected."""
    assert odd_ones({0: "a", 1: "b", 2: "a"}) == [1]
    assert odd_ones({0: "b", 1: "a", 2: "a"}) == [0]
    assert odd_ones({0: "a", 1: "a"}) == []
    assert odd_ones({0: "a", 1: "b"}) == [1]
    assert odd_ones({0: "a", 1: "b"}, prefer=[0]) == [0]
    assert odd_ones({0: "a", 1: "b", 2: "c", 3: "c"}) == [0, 1]


def _train_and_check(rank: int, world: int, hsdp: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model: nn.Module = GPT(CFG)
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:  # type: ignore[attr-defined]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    corpus = SyntheticCorpus(block_size=16, batch_size=4, seed=0)
    # The last rank's weight goes wrong: rank 2 of 3 (DDP), rank 3 of the 2x2 mesh (HSDP).
    fault = {"kind": "bitflip", "at_step": FLIP_AT, "rank": world - 1, "target": "param", "bit": 3}
    guard = Guard(
        model, optimizer, loss_fn=lm_loss, data=lambda i: corpus.batch(i * world + rank),
        max_steps=2 * EVERY + 1, context=WorkerContext(
            rank=rank, world_size=world, faults=parse_chaos({"faults": [fault]})),
        config=GuardConfig(replica_check_every=0),
    )  # fmt: skip
    check = ReplicaCheck(EVERY)
    found: dict[int, Any] = {}
    for batch in guard:
        if check.due(guard.step_count):
            event = check.check(guard)
            found[guard.step_count] = event.to_dict() if event is not None else None
        guard.step(batch)
    guard.close()
    group = replica_group(guard)
    members = torch.distributed.get_process_group_ranks(group) if group is not None else []
    return {"found": found, "group": members, "last_agreed": check.last_agreed}


@pytest.mark.timeout(300)
def test_a_flipped_weight_on_one_of_three_ddp_ranks_is_named_by_the_next_check(
    tmp_path: Path,
) -> None:
    """They agree at step 5; rank 2's weight flips at step 7; at step 10 rank 2 reports itself."""
    ranks = spawn_ranks(_train_and_check, 3, tmp_path, False)
    assert [r["found"][EVERY] for r in ranks] == [None, None, None]
    assert ranks[0]["found"][2 * EVERY] is None and ranks[1]["found"][2 * EVERY] is None
    event = ranks[2]["found"][2 * EVERY]
    assert (event["kind"], event["rank"], event["step"]) == ("replica_divergence", 2, 2 * EVERY)
    details = event["details"]
    assert details["odd"] == [2] and details["reference"] == 0 and details["group"] == [0, 1, 2]
    assert details["last_agreed_step"] == EVERY
    assert details["first_difference"] == "tok_emb.weight"
    digests = details["digests"]
    assert digests["0"] == digests["1"] != digests["2"]
    assert ranks[0]["last_agreed"] == EVERY, "no event on the others, and they did not agree"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_under_hsdp_only_the_ranks_holding_the_same_shard_are_compared(tmp_path: Path) -> None:
    """A 2x2 mesh: ranks {0, 2} and {1, 3} hold the same shards; rank 3's flipped weight is named
    against rank 1 only, and ranks 0 and 2 still agree."""
    ranks = spawn_ranks(_train_and_check, 4, tmp_path, True)
    assert [r["group"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["found"][2 * EVERY] is None for r in ranks] == [True, True, True, False]
    details = ranks[3]["found"][2 * EVERY]["details"]
    assert (details["odd"], details["reference"], details["group"]) == ([3], 1, [1, 3])
    assert ranks[0]["last_agreed"] == ranks[2]["last_agreed"] == 2 * EVERY
