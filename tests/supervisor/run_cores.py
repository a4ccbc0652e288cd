"""A run's core with no ranks reporting yet, for shell tests that need one without Ray."""

from __future__ import annotations

from remedy.control.decide import Controller
from remedy.control.job import JobStateMachine
from remedy.control.run_core import RunCore
from remedy.control.slots import RankSlots
from remedy.policies import Engine, load_policy_text


def empty_core(name: str, *, world: int, incarnation: int) -> RunCore:
    """A core of `world` ranks under a policy with no rules (run id "r"), started at t=1000."""
    policy = f"version: 1\nname: {name}\nrules: []\n"
    engine = Engine(load_policy_text(policy, f"{name}.yaml"), run_id="r")
    controller = Controller(engine, world_size=world)
    slots = RankSlots(world, rejected=controller.rejected)
    return RunCore(controller, JobStateMachine(), slots, incarnation=incarnation, started=1000.0)
