"""Reason sentences: what was seen, which rule, why this action."""

from __future__ import annotations

import pytest

from remedy.policies import AnomalyEvent, Engine, load_policy, load_policy_text
from remedy.policies._params import ACTION_PARAMS, params_dict
from remedy.policies._reasons import action_phrase, ranks_text
from remedy.policies._vocab import ACTIONS


@pytest.mark.parametrize(
    ("ranks", "text"),
    [([3], "rank 3"), ([0, 1, 2, 3], "ranks 0-3"), ([0, 1, 5, 7, 8], "ranks 0-1, 5, 7-8")],
)
@pytest.mark.timeout(10)
def test_ranks_text(ranks: list[int], text: str) -> None:
    """Consecutive ranks collapse into ranges."""
    assert ranks_text(ranks) == text


@pytest.mark.timeout(10)
def test_reason_is_one_sentence_like_the_contract() -> None:
    """A fired decision's reason reads like the documented example."""
    policy = load_policy_text(
        "version: 1\nrules:\n  - name: nan-rollback\n    when: {anomaly: nonfinite_loss}\n"
        "    do:\n      - rollback: {steps_back: 50, skip_batches: 20}\n"
        "    max_fires: 3\n    fires_within: 1000\n"
    )
    (d,) = Engine(policy).decide([AnomalyEvent("nonfinite_loss", 0, 150)])
    assert d.reason == (
        "nonfinite_loss on rank 0 at step 150 matched rule 'nan-rollback' (1 within 1 step); "
        "rolling back 50 steps and skipping 20 batches, fire 1 of 3 within 1000 steps."
    )
    assert d.reason.count(".") == 1


@pytest.mark.parametrize(
    ("action", "params", "phrase"),
    [
        ("shrink_lr", {"factor": 0.5, "min_lr": 0}, "shrinking the learning rate x0.5"),
        ("rescale_grad_scaler", {"scale": 1024.0}, "setting the loss scale to 1024"),
        ("rescale_grad_scaler", {"factor": 0.25}, "multiplying the loss scale by 0.25"),
        ("switch_kv_allocator", {"to": "paged"}, "switching the KV cache allocator to paged"),
        ("skip_batches", {"count": 7}, "skipping 7 batches"),
        ("reduce_microbatch", {"factor": 2}, "dividing the micro-batch size by 2"),
        ("abort", {"reason": None}, "aborting the run"),
    ],
)
@pytest.mark.timeout(10)
def test_action_phrases(action: str, params: dict[str, object], phrase: str) -> None:
    """Each action is described in words with its parameters."""
    assert action_phrase(action, params) == phrase


@pytest.mark.timeout(10)
def test_value_and_threshold_are_shown() -> None:
    """The measured value and threshold appear in what was seen."""
    policy = load_policy_text(
        "version: 1\nrules:\n  - {name: r, when: {anomaly: loss_spike}, do: [notify]}\n"
    )
    (d,) = Engine(policy).decide([AnomalyEvent("loss_spike", 2, 9, value=12.5, threshold=4.0)])
    assert d.reason.startswith("loss_spike (value 12.5, threshold 4) on rank 2 at step 9")


@pytest.mark.parametrize("action", [a for a in ACTIONS if a != "abort"])
@pytest.mark.timeout(10)
def test_only_abort_says_it_aborts(action: str) -> None:
    """Every action other than `abort` is described as what it does, never as aborting the run."""
    given = {
        "switch_kv_allocator": {"to": "paged"},
        "skip_batches": {"count": 3},
        "configure_cuda_allocator": {"expandable_segments": True},
    }.get(action, {})
    params = params_dict(ACTION_PARAMS[action](**given))
    assert "abort" not in action_phrase(action, params)


@pytest.mark.timeout(10)
def test_default_policy_reasons_are_true_for_the_allocator() -> None:
    """The bundled default policy's allocator decision says it configures the allocator."""
    (d, *_) = Engine(load_policy("default")).decide(
        [AnomalyEvent("memory_fragmentation", 0, 40, value=0.6, threshold=0.3)]
    )
    assert d.action == "configure_cuda_allocator"
    assert "aborting" not in d.reason
    assert "expandable segments" in d.reason
