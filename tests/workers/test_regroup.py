"""The one regroup: what each kind of membership does with a boundary and with a failed collective."""

from __future__ import annotations

import types

import pytest

from remedy.rank.exceptions import GroupLostError
from remedy.rank.group.launched import LaunchedGroup
from remedy.rank.group.membership import Membership
from remedy.rank.group.regroup import regroup

LOST_PEER = RuntimeError("Connection closed by peer")


def _guard(membership: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        membership=membership, rank=1, step_count=4, reporter=None, send_report=lambda **_: None
    )


def test_a_guard_without_a_group_never_regroups() -> None:
    """No membership (one process): nothing to enter, and a failed collective is the caller's to raise."""
    guard = _guard(None)
    assert regroup(guard) is False  # type: ignore[arg-type]
    assert regroup(guard, LOST_PEER, in_step=True) is False  # type: ignore[arg-type]


def test_under_another_launcher_a_lost_peer_ends_the_rank() -> None:
    """torchrun's group: nothing joins at a boundary; a lost peer raises GroupLostError naming the launcher."""
    guard = _guard(LaunchedGroup("torchrun"))
    assert regroup(guard) is False  # type: ignore[arg-type]
    assert regroup(guard, ValueError("a bug in the loss")) is False  # type: ignore[arg-type]
    with pytest.raises(GroupLostError, match="under torchrun remedy cannot replace a rank"):
        regroup(guard, LOST_PEER)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("world_size", "error"),
    [(2, ValueError("a bug in the loss")), (1, LOST_PEER)],
    ids=["not-a-group-failure", "alone"],
)
def test_a_survivor_leaves_errors_that_are_not_a_lost_peer_to_its_caller(
    world_size: int, error: BaseException
) -> None:
    """An error that is not a peer's loss, or a group of one: no regroup, the membership untouched."""
    m = Membership(rank=0, world_size=world_size, store_addr=("127.0.0.1", 1), backend="gloo")
    assert regroup(_guard(m), error) is False  # type: ignore[arg-type]
    assert (m.generation, m.recoveries, m.phase) == (0, 0, "starting")


def test_a_rank_that_is_not_a_replacement_has_nothing_to_adopt_at_a_boundary() -> None:
    """Only a replacement's first boundary adopts the group's state."""
    m = Membership(rank=0, world_size=2, store_addr=("127.0.0.1", 1), backend="gloo")
    assert regroup(_guard(m)) is False  # type: ignore[arg-type]
    assert "adopting" not in m.timeline
