"""remedy's modules import DTensor and torch's checkpoint package only when a sharded model needs
them: the supervisor's process (whose start is a crashed supervisor's outage), the node agents'
and the driver's never do (0.8 s of the supervisor's 3.8 s of imports). A rank's process gets
them anyway from `torch._dynamo`, which it imports ahead of its first DDP step
(`membership.warm_up`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from remedy.rank.state.sharding import is_dtensor

HEAVY = ("torch.distributed.tensor", "torch.distributed.checkpoint")


def loaded(modules: tuple[str, ...], first: str, then: str) -> tuple[list[bool], list[bool]]:
    """Which of `modules` a fresh process has loaded after the imports `first`, then after `then`."""
    check = f"print(json.dumps([m in sys.modules for m in {modules!r}]))\n"
    code = f"import json, sys\n{first}\n{check}{then}\n{check}"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=100
    ).stdout.splitlines()
    return json.loads(out[0]), json.loads(out[1])


@pytest.mark.timeout(120)
def test_remedy_does_not_import_dtensor_or_dcp_until_a_sharded_model_needs_them() -> None:
    before, after = loaded(
        HEAVY,
        "import remedy.supervisor.actor, remedy.supervisor.agent.actor, remedy.supervisor.rank\n"
        "import remedy.rank.guard, remedy.rank.state.checkpoint_store",
        "from remedy.rank.state import dcp_store  # what a sharded model's checkpoints use",
    )
    assert before == [False, False]
    assert after == [True, True]


def test_is_dtensor_is_false_for_plain_tensors_without_importing_dtensor() -> None:
    assert not is_dtensor(torch.zeros(2))
    assert not is_dtensor(object())


@pytest.mark.timeout(120)
def test_a_ranks_process_does_not_import_the_policy_loader_or_engine() -> None:
    """A cold replacement rank's imports are on the critical path of its restart: it takes the
    anomaly records (`remedy.policies._events`) without the policy language's loader, models
    and engine (about 0.4 s of imports here), which only the supervisor and single-process
    mode run."""
    before, after = loaded(
        ("remedy.policies._loader", "remedy.policies._model", "remedy.policies._engine"),
        "import remedy.supervisor.rank, remedy.rank.guard",
        "from remedy.policies import Engine, load_policy_text  # single-process mode's",
    )
    assert before == [False, False, False]
    assert after == [True, True, True]
