"""Process faults (hang_rank, kill_rank, slow_collective) fire once per run, not once per process."""

from __future__ import annotations

from pathlib import Path

from remedy.workers.chaos import FaultInjector, parse_chaos

FAULTS = parse_chaos({"faults": [
    {"kind": "hang_rank", "at_step": 3, "rank": 1},
    {"kind": "kill_rank", "at_step": 4, "rank": 2},
    {"kind": "slow_collective", "at_step": 5, "rank": 0, "seconds": 0.0},
]})  # fmt: skip


def test_chaos_files_accept_the_multi_rank_faults() -> None:
    """hang_rank, kill_rank and slow_collective are injectable, each for its own rank."""
    assert [f.kind for f in FAULTS] == ["hang_rank", "kill_rank", "slow_collective"]
    assert [len(FaultInjector(FAULTS, r).faults) for r in range(3)] == [1, 1, 1]


def test_a_replacement_on_the_same_run_dir_does_not_fire_again(tmp_path: Path) -> None:
    """The first process's mark is on disk before the fault acts; its replacement finds it."""
    first = FaultInjector(FAULTS, 2, run_dir=tmp_path)
    assert first.fire_once("kill_rank", 4) is not None  # the process would be SIGKILLed here
    replacement = FaultInjector(FAULTS, 2, run_dir=tmp_path)
    assert replacement.fire_once("kill_rank", 4) is None
    assert FaultInjector(FAULTS, 1, run_dir=tmp_path).fire_once("hang_rank", 3) is not None


def test_slow_collective_delays_once_and_is_noted(tmp_path: Path) -> None:
    """slow_collective fires on its step once per run and lands in the injector's log."""
    inj = FaultInjector(FAULTS, 0, run_dir=tmp_path)
    inj.on_grads(5, [])
    inj.on_grads(5, [])
    assert [e["fault"] for e in inj.drain_log()] == ["slow_collective"]
    assert FaultInjector(FAULTS, 0, run_dir=tmp_path).fire_once("slow_collective", 5) is None
