"""Property: no batch without the run's token changes a live run, however it is built.

Hypothesis throws batches at a real supervisor while it supervises a real
run: some well-formed and carrying a NaN that would roll the run back,
some malformed, each with another run's token, none, or a token of the
wrong type. Every one is refused and counted under `rejected["token"]`;
the run completes and the NaNs they carried caused nothing.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remedy.protocol.spec import RunSpec
from remedy.supervisor.actor import launch_supervisor

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
TINY = f"{REPO / 'tests' / 'robustness' / 'targets' / 'tiny.py'}:main"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def foreign_tokens(real: str) -> st.SearchStrategy[Any]:
    """Anything but the run's own token: another run's, a near miss, none, the wrong type."""
    return (
        st.just(secrets.token_hex(16))
        | st.just(real[:-1])
        | st.just(real.upper() if real != real.upper() else real + "0")
        | st.just(real.encode())
        | st.none()
        | json_values
    ).filter(lambda t: t != real)


def batches(real: str) -> st.SearchStrategy[Any]:
    nan = {"kind": "nonfinite_loss", "rank": 0, "step": 5, "severity": "critical"}
    plausible = st.fixed_dictionaries(
        {
            "rank": st.just(0) | st.integers(-2, 3),
            "step": st.integers(0, 50),
            "tick": st.integers(0, 50),
            "events": st.just([nan]) | st.lists(json_values, max_size=3),
            "metrics": st.lists(json_values, max_size=3),
        },
        optional={
            "token": foreign_tokens(real),
            "seq": st.integers(0, 10),
            "incarnation": st.integers(0, 3),
        },
    )
    return plausible | json_values


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_batches_without_the_runs_token_change_nothing(tmp_path: Path) -> None:
    """Foreign-token and token-less batches sent mid-run are all refused and counted; the run
    completes, and the NaNs they carried caused nothing."""
    spec = RunSpec(
        target=TINY, run_dir=str(tmp_path / "run"), argv=["--steps", "800", "--sleep", "0.01"]
    )
    sup = launch_supervisor(spec)
    try:
        ray.get(sup.start.remote())
        deadline = time.monotonic() + 120
        while not dict(ray.get(sup.status.remote(spec.token))["step"]):
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        sent = 0

        @settings(
            max_examples=100,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        )
        @given(batch=batches(spec.token))
        def throw(batch: Any) -> None:
            nonlocal sent
            assert ray.get(sup.report.remote(batch)) == []
            sent += 1

        throw()
        status = ray.get(sup.status.remote(spec.token))
        assert status["state"] == "running", "the batches were sent while the run trained"
        summary = ray.get(sup.wait.remote(240), timeout=300)
    finally:
        ray.kill(sup, no_restart=True)
    assert summary is not None and summary["status"] == "completed"
    assert summary["rejected"] == {"token": sent}
    # The NaNs in the foreign batches were never seen: no rollback, no NaN counted.
    assert "nonfinite_loss" not in summary["anomalies"] and "rollback" not in summary["actions"]
    assert summary["steps_completed"] == 800
    assert sent >= 50
