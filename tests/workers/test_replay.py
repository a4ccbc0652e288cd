"""replay_step on real ranks: a flipped bit, a bad chip and a poisoned batch are told apart.

Two gloo ranks train a small GPT under DDP with a Guard each; the chaos fault
hits step S on one rank, and the same `replay_step` command is applied by both
at the boundary after it (as the supervisor would send it). No policy answers
here (each rank's in-process controller sees only itself), so the ranks wait
`replay_wait_s=0` for an answer and go on; the supervised path, answer
included, is tests/supervisor/test_replay_e2e.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.protocol.commands import Command
from remedy.rank import Guard, GuardConfig
from remedy.rank.chaos.faults import parse_chaos
from remedy.rank.link.context import WorkerContext
from remedy.report.explain import explain
from remedy.rundir.rundata import load_run
from remedy.rundir.writer import read_jsonl
from tests.workers.fsdp_ranks import spawn_ranks

pytestmark = [pytest.mark.timeout(600)]

CFG = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
S = 24  # the step the fault hits (the loss-spike detector needs 20 steps of history)
STEPS = 30
# A policy that answers nothing a clean run raises (the ranks' own controllers see one rank).
QUIET = "version: 1\nrules:\n  - name: quiet\n    when: {anomaly: gpu_ecc}\n    do: [notify]\n"

SCENARIOS: dict[str, dict[str, Any]] = {
    "grad bitflip": {"kind": "bitflip", "target": "grad", "rank": 1},
    "bad chip, gradients": {"kind": "bad_rank", "target": "grad", "rank": 1},
    "poisoned batch": {"kind": "loss_spike", "factor": 10.0, "rank": 0},
    "activation bitflip": {"kind": "bitflip", "target": "activation", "rank": 1},
    "bad chip, activations": {"kind": "bad_rank", "target": "activation", "rank": 1},
}
EXPECTED = {
    "grad bitflip": ("replay_transient", 1),
    "bad chip, gradients": ("replay_rank_specific", 1),
    "poisoned batch": ("replay_reproducible", 0),
    "activation bitflip": ("replay_transient", 1),
    "bad chip, activations": ("replay_rank_specific", 1),
}


def params_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _scenario(rank: int, world: int, fault: dict[str, Any], policy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(GPT(CFG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    corpus = SyntheticCorpus(block_size=16, batch_size=4, seed=0)
    ctx = WorkerContext(
        rank=rank, world_size=world, faults=parse_chaos({"faults": [{**fault, "at_step": S}]})
    )
    guard = Guard(
        model, optimizer, loss_fn=lm_loss, data=lambda i: corpus.batch(i * world + rank),
        max_steps=STEPS, context=ctx, config=GuardConfig(policy=policy, replay_wait_s=0.0),
    )  # fmt: skip
    at_boundary: dict[int, list[str]] = {}
    for batch in guard:
        # The state each step starts from, every time it starts.
        at_boundary.setdefault(guard.step_count, []).append(params_digest(model))
        result = guard.step(batch)
        if result.step == S and guard.tick == S + 1:
            guard.submit(Command("d1", "replay_step", {"tolerance": 0.0}, S + 1, S, S + 1))
    guard.close()
    (outcome,) = [o for o in guard.history if o.decision_id == "d1"]
    return {
        "outcome": outcome.outcome,
        "detail": outcome.detail,
        "verdict": outcome.result.get("verdict"),
        "at_boundary": at_boundary,
        "steps": (guard.step_count, guard.tick),
        "final": params_digest(model),
    }


def _every_scenario(rank: int, world: int, policy: str) -> dict[str, Any]:
    return {name: _scenario(rank, world, fault, policy) for name, fault in SCENARIOS.items()}


@pytest.fixture(scope="module")
def replays(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("replay")
    policy = tmp / "quiet.yaml"
    policy.write_text(QUIET)
    return spawn_ranks(_every_scenario, 2, tmp / "ranks", str(policy))


def _timeless(verdict: dict[str, Any]) -> str:
    """A verdict without the times its replay took (each rank measures its own), as JSON
    (a NaN loss compares equal to itself there)."""
    evidence = {k: v for k, v in verdict["evidence"].items() if k != "replay_s"}
    rest = {k: v for k, v in verdict.items() if k not in ("replay_s", "phases_s")}
    return json.dumps({**rest, "evidence": evidence}, sort_keys=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_fault_gets_its_classification_on_both_ranks(
    replays: list[dict[str, Any]], name: str
) -> None:
    """Both ranks reach the same answer, naming the rank the fault hit (the poisoned batch: its rank)."""
    r0, r1 = replays[0][name], replays[1][name]
    assert r0["outcome"] == r1["outcome"] == "applied", (r0["detail"], r1["detail"])
    assert _timeless(r0["verdict"]) == _timeless(r1["verdict"])
    v = r0["verdict"]
    assert (v["kind"], v["rank"], v["step"]) == (*EXPECTED[name], S), v["reason"]
    assert v["evidence"]["suspect"] == EXPECTED[name][1]
    # Another rank checks the suspect's batch only when the re-run alone shows nothing.
    checked = name in ("poisoned batch", "bad chip, activations")
    assert v["evidence"]["witness"] == (1 - EXPECTED[name][1] if checked else None)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_replay_leaves_every_rank_at_the_state_before_the_step(
    replays: list[dict[str, Any]], name: str
) -> None:
    """After the replay both ranks start step S again from the parameters it first started from.

    Rank 0 saw nothing wrong at S when the fault was on rank 1 (it kept no state of
    its own): it adopts the state rank 1 kept before its update.
    """
    first = replays[0][name]["at_boundary"][S][0]
    for rank in (0, 1):
        starts = replays[rank][name]["at_boundary"][S]
        assert len(starts) == 2, "step S ran once, then once more after the replay"
        assert starts == [first, first]
        completed, executed = replays[rank][name]["steps"]
        # The steps run ahead of the replay (the command comes at the next boundary) are redone.
        assert completed == STEPS and executed == STEPS + 1


@pytest.mark.slow
def test_the_evidence_names_both_digests_and_the_ranks_compared(
    replays: list[dict[str, Any]],
) -> None:
    """A transient gradient flip: rank 1's original and re-run digests differ (no other rank is
    asked). A bad chip in the forward: the re-run repeats it on every replica, and rank 0,
    re-running rank 1's batch alone, gets other numbers than rank 1 does."""
    v = replays[0]["grad bitflip"]["verdict"]
    rows = v["evidence"]["ranks"]
    orig, again = rows["1"]["grads"]
    assert orig != again and rows["1"]["kept"] is True
    assert rows["0"]["kept"] is False, "rank 0 saw nothing and kept nothing"
    assert rows["0"]["grads"][1] == again, "the replicas agree on the re-run"
    assert v["evidence"]["first_difference"] == "tok_emb.weight"
    assert "witness_check" not in v["evidence"]
    bad = replays[0]["bad chip, activations"]["verdict"]["evidence"]
    assert bad["ranks"]["1"]["grads"][0] == bad["ranks"]["1"]["grads"][1], "reproduced"
    check = bad["witness_check"]
    assert check["batch_of"] == 1 and check["grads"][0] != check["grads"][1]
    data = replays[0]["poisoned batch"]["verdict"]["evidence"]["witness_check"]
    assert data["batch_of"] == 0 and data["grads"][0] == data["grads"][1]


@pytest.mark.slow
def test_after_a_transient_fault_the_replicas_end_equal(replays: list[dict[str, Any]]) -> None:
    """The flipped bit is gone after the replay: both ranks finish with the same weights."""
    for name in ("grad bitflip", "poisoned batch", "activation bitflip"):
        assert replays[0][name]["final"] == replays[1][name]["final"], name


# ----------------------------------------------------------- one process
POLICY = """
version: 1
rules:
  - name: replay-first
    when: {anomaly: [nonfinite_loss, nonfinite_grad, loss_spike]}
    do: [replay_step]
  - name: chip
    when: {anomaly: [replay_transient, replay_rank_specific]}
    do: [notify]
  - name: data
    when: {anomaly: replay_reproducible}
    do:
      - rollback: {steps_back: 5, skip_batches: 8}
"""


class _Rows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return x, x.sum(0, keepdim=True)


def _mlp_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _one_process(tmp: Path, shape: str, fault: dict[str, Any]) -> tuple[Guard, list[Any]]:
    """A single-process run of `shape` with its in-process policy; (guard, decisions)."""
    torch.manual_seed(0)
    policy = tmp / "policy.yaml"
    policy.write_text(POLICY)
    faults = parse_chaos({"faults": [fault]})
    run_dir = tmp / shape
    config = GuardConfig(policy=str(policy), snapshot_every=5)
    if shape == "dataloader":  # an MLP on a DataLoader (a plain iterable), StepLR
        model: nn.Module = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scheduler: Any = torch.optim.lr_scheduler.StepLR(optimizer, 10, 0.9)
        data: Any = torch.utils.data.DataLoader(_Rows(), batch_size=16, shuffle=True)
        loss_fn: Any = _mlp_loss
        scaler = None
    else:  # "amp": the GPT with fp16 autocast and a GradScaler on CPU
        model = GPT(CFG)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        scheduler = None
        corpus = SyntheticCorpus(block_size=16, batch_size=4, seed=0)
        data, loss_fn = corpus.batch, lm_loss
        scaler = torch.amp.GradScaler("cpu")
        config.amp_dtype = torch.float16
    guard = Guard(
        model, optimizer, loss_fn=loss_fn, data=data, scheduler=scheduler, scaler=scaler,
        max_steps=STEPS + 6, config=config, context=WorkerContext(run_dir=run_dir, faults=faults),
    )  # fmt: skip
    for batch in guard:
        guard.step(batch)
    guard.close()
    return guard, read_jsonl(run_dir / "decisions.jsonl")


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    ("shape", "target", "seen"),
    [
        ("dataloader", "grad", "nonfinite_grad"),
        # With a GradScaler an inf gradient is an overflow the scaler skips, not an anomaly:
        # the flipped bit goes into an activation, and the loss shows it.
        ("amp", "activation", "nonfinite_loss"),
    ],
)
def test_alone_a_flipped_bit_is_transient_and_the_policy_answers(
    tmp_path: Path, shape: str, target: str, seen: str
) -> None:
    """One process, other loop shapes: the replay says transient, the policy's notify is the
    answer the loop waited for, and nothing is rolled back."""
    guard, decisions = _one_process(
        tmp_path, shape, {"kind": "bitflip", "at_step": S, "target": target}
    )
    replay, told = decisions
    assert (replay["action"], replay["outcome"]) == ("replay_step", "applied")
    assert replay["anomaly"]["kind"] == seen
    assert replay["result"]["verdict"]["kind"] == "replay_transient"
    assert (told["action"], told["anomaly"]["kind"]) == ("notify", "replay_transient")
    assert told["anomaly"]["details"]["replay_decision"] == replay["decision_id"]
    answers = [o for o in guard.history if o.decision_id.endswith("-answer")]
    assert [o.detail for o in answers] == ["answer: notify (chip); training goes on"]
    assert guard.summary["steps_completed"] == STEPS + 6


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("shape", ["dataloader", "amp"])
def test_alone_a_poisoned_batch_is_reproducible_and_rolled_back(tmp_path: Path, shape: str) -> None:
    """The poisoned batch spikes again on the re-run: reproducible, then the rollback and skip."""
    guard, decisions = _one_process(
        tmp_path, shape, {"kind": "loss_spike", "at_step": S, "factor": 20.0}
    )
    kinds = [(d["action"], d["anomaly"]["kind"]) for d in decisions]
    assert kinds[:2] == [("replay_step", "loss_spike"), ("rollback", "replay_reproducible")]
    assert decisions[0]["result"]["verdict"]["kind"] == "replay_reproducible"
    assert decisions[1]["outcome"] == "applied"
    # The rollback happens inside the wait for the answer, before the answer itself.
    order = [o.decision_id for o in guard.history]
    assert order.index(decisions[1]["decision_id"]) < order.index(
        decisions[0]["decision_id"] + "-answer"
    )


@pytest.mark.usefixtures("one_torch_thread")
def test_explain_shows_the_replays_evidence(tmp_path: Path) -> None:
    """`remedy explain` of the replay and of the decision its answer led to: both digests of
    each rank compared, the batch checked on the other rank, the first gradient that differs."""
    _one_process(tmp_path, "dataloader", {"kind": "bitflip", "at_step": S, "target": "grad"})
    run = load_run(tmp_path / "dataloader")
    replay, told = run.decisions
    for d in (replay, told):
        text = explain(run, decision=d["decision_id"])
        assert "the replay's evidence (replay_transient on rank 0):" in text, text
        orig, again = (
            d["result"]["verdict"]["evidence"]["ranks"]["0"]["grads"]
            if d is replay
            else (told["anomaly"]["details"]["evidence"]["ranks"]["0"]["grads"])
        )
        assert f"gradients {orig} then {again}" in text
        assert "first gradient that differs: 0.weight" in text
