"""Property: one firing carries out each step of its chain at most once, as on_failure says."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remedy.policies import load_policy_text
from remedy.policies.testing import run_stream, stream

# Actions of the chain under test; the escalations use other actions (abort,
# dump_diagnostics) so the expected sequence can be told apart and modelled exactly.
_ACTIONS = {
    "checkpoint_now": "checkpoint_now:",
    "rollback": "rollback: {steps_back: 5}",
    "shrink_lr": "shrink_lr: {factor: 0.5}",
    "reduce_microbatch": "reduce_microbatch:",
    "skip_batches": "skip_batches: {count: 1}",
}
_ON_FAILURE = {
    None: None,
    "next": "next",
    "abort": "abort",
    "rule": "{rule: fallback}",
}

Chain = list[tuple[str, str | None]]


def _policy_text(chain: Chain) -> str:
    lines = ["version: 1", "rules:", "  - name: main", "    when: {anomaly: loss_spike}", "    do:"]
    for action, on_failure in chain:
        lines.append(f"      - {_ACTIONS[action]}")
        if on_failure is not None:
            lines.append(f"        on_failure: {_ON_FAILURE[on_failure]}")
    lines += ["  - name: fallback", "    do: [dump_diagnostics]"]
    if all(on_failure != "rule" for _, on_failure in chain):
        lines.append("    when: {anomaly: data_stall}")  # a rule nothing escalates to needs one
    return "\n".join(lines) + "\n"


def _expected(chain: Chain, failing: set[str]) -> list[str]:
    """What a healthy dispatcher carries out: each step once, in order, until one ends it."""
    out: list[str] = []
    for action, on_failure in chain:
        out.append(action)
        if action not in failing or on_failure == "next":
            continue
        if on_failure == "rule":
            out.append("dump_diagnostics")
        elif on_failure == "abort":
            out.append(on_failure)
        break
    return out


chains = st.lists(
    st.tuples(st.sampled_from(sorted(_ACTIONS)), st.sampled_from(list(_ON_FAILURE))),
    min_size=1,
    max_size=6,
)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains, failing=st.sets(st.sampled_from(sorted(_ACTIONS))))
def test_no_step_of_a_chain_runs_twice(chain: Chain, failing: set[str]) -> None:
    """Random chains, on_failure modes and outcomes: each step is carried out at most once."""
    policy = load_policy_text(_policy_text(chain))
    outcomes = {(10, action): "failed" for action in failing}
    decisions = [
        d
        for d in run_stream(policy, stream("loss_spike", "_x9 1.0"), outcomes=outcomes)
        if not d.suppressed
    ]
    main = [
        (d.chain_id, d.chain_index) for d in decisions if d.rule == "main" and d.action in _ACTIONS
    ]
    assert len(main) == len(set(main)), [d.action for d in decisions]
    assert [d.action for d in decisions] == _expected(chain, failing)
