"""What the journal says of a rank process that died: the line of Ray's error that says why."""

from __future__ import annotations

import ray

from remedy.supervisor.carry import why_gone


def test_a_dead_node_is_named_as_the_cause() -> None:
    exc = ray.exceptions.RayError(
        "The actor died unexpectedly before finishing this task.\n"
        "\tclass_name: RankActor\n\tpid: 24759\n"
        "The actor died because its node has died. Node Id: a42f44\n"
        "\tthe actor's node was terminated unexpectedly"
    )
    assert why_gone(exc) == "RayError: The actor died because its node has died. Node Id: a42f44"


def test_without_a_cause_line_the_first_line_is_kept_and_bounded() -> None:
    exc = ray.exceptions.RayError("\nThe actor is temporarily unavailable: " + "x" * 400)
    why = why_gone(exc)
    assert why.startswith("RayError: The actor is temporarily unavailable: xxx")
    assert len(why) == len("RayError: ") + 160
