"""Action parameters: defaults filled in, ranges and conflicts checked."""

from __future__ import annotations

import pytest

from remedy.policies import PolicyError, load_policy_text
from remedy.policies._params import ACTION_PARAMS, params_dict
from remedy.policies._rules import thaw
from remedy.policies._vocab import ACTIONS


def _step(step: str) -> dict[str, object]:
    policy = load_policy_text(
        f"version: 1\nrules:\n  - name: r\n    when: {{anomaly: oom}}\n    do: [{step}]\n"
    )
    params: dict[str, object] = thaw(policy.rules[0].steps[0].params)
    return params


@pytest.mark.timeout(10)
def test_every_action_has_a_params_model() -> None:
    """The vocabulary and the parameter models list the same actions."""
    assert set(ACTION_PARAMS) == set(ACTIONS)


@pytest.mark.parametrize(
    ("step", "params"),
    [
        ("rollback", {"steps_back": 100, "skip_batches": 0}),
        ("shrink_lr", {"factor": 0.5, "min_lr": 0.0}),
        ("reduce_microbatch", {"factor": 2}),
        ("notify", {"message": None}),
        ("restart_rank", {}),
        ("'switch_kv_allocator: {to: pow2}'", {"to": "pow2"}),
        ("'skip_batches: {count: 3}'", {"count": 3}),
        (
            "'enable_activation_checkpointing: {modules: [Block], fraction: 0.5}'",
            {"modules": ["Block"], "pattern": None, "fraction": 0.5},
        ),
    ],
)
@pytest.mark.timeout(10)
def test_defaults_are_filled(step: str, params: dict[str, object]) -> None:
    """Decisions carry every parameter, defaults included."""
    assert _step(step.strip("'")) == params


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ("rollback: {steps_back: -1}", "expected an integer >= 0"),
        ("rollback: {steps_back: 1.5}", "expected an integer >= 0"),
        ("shrink_lr: {factor: 0}", "0 < x < 1"),
        ("shrink_lr: {factor: true}", "expected a number"),
        ("rescale_grad_scaler: {scale: 1.0, factor: 0.5}", "give `scale` or `factor`, not both"),
        ("rescale_grad_scaler: {growth_factor: 1.0}", "> 1"),
        ("enable_activation_checkpointing: {fraction: 1.5}", "0 < x <= 1"),
        ("enable_activation_checkpointing: {modules: []}", "non-empty list"),
        ("switch_kv_allocator: {to: slab}", "unknown allocator 'slab'"),
        ("switch_kv_allocator: {}", "missing required key 'to'"),
        ("skip_batches: {count: 0}", ">= 1"),
        ("reduce_microbatch: {factor: 1}", ">= 2"),
        ("notify: {message: 5}", "expected a string or null"),
        ("restart_rank: {rank: 3}", "takes no parameters"),
    ],
)
@pytest.mark.timeout(10)
def test_invalid_params(step: str, message: str) -> None:
    """Bad parameters are refused with a message naming what is allowed."""
    with pytest.raises(PolicyError) as info:
        _step(step)
    assert message in str(info.value)


@pytest.mark.timeout(10)
def test_params_dict_is_plain_json() -> None:
    """params_dict gives plain JSON values."""
    assert params_dict(ACTION_PARAMS["rollback"](steps_back=5)) == {
        "steps_back": 5,
        "skip_batches": 0,
    }
