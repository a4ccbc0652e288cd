"""Process faults (hang_rank, kill_rank, slow_collective) fire once per run, not once per process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remedy.rank.chaos import process_faults
from remedy.rank.chaos.faults import FaultInjector, parse_chaos

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


def test_kill_rank_with_a_duration_kills_that_many_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`duration: 3`: the first process at its step, then each of the next two replacements
    as it joins; a fourth process, and a replacement after a `duration: 1` kill, run on."""
    killed: list[int] = []
    monkeypatch.setattr(process_faults, "kill", lambda: killed.append(len(killed)))
    faults = parse_chaos({"faults": [
        {"kind": "kill_rank", "at_step": 4, "rank": 2, "duration": 3},
        {"kind": "kill_rank", "at_step": 4, "rank": 1},
    ]})  # fmt: skip
    FaultInjector(faults, 2, run_dir=tmp_path).on_join()
    assert killed == []  # nothing fired yet: a replacement for another reason runs on
    assert FaultInjector(faults, 2, run_dir=tmp_path).fire_once("kill_rank", 4) is not None
    for _ in range(3):  # each replacement is a new process reading the record from disk
        FaultInjector(faults, 2, run_dir=tmp_path).on_join()
    assert killed == [0, 1]
    assert FaultInjector(faults, 1, run_dir=tmp_path).fire_once("kill_rank", 4) is not None
    FaultInjector(faults, 1, run_dir=tmp_path).on_join()
    assert killed == [0, 1]


def test_slow_collective_delays_once_and_is_noted(tmp_path: Path) -> None:
    """slow_collective fires on its step once per run and lands in the injector's log."""
    inj = FaultInjector(FAULTS, 0, run_dir=tmp_path)
    inj.on_grads(5, [])
    inj.on_grads(5, [])
    assert [e["fault"] for e in inj.drain_log()] == ["slow_collective"]
    assert FaultInjector(FAULTS, 0, run_dir=tmp_path).fire_once("slow_collective", 5) is None


def test_node_tree_is_found_from_proc_and_no_raylet_means_no_kill() -> None:
    """`tree` lists a process and everything below it; outside Ray no raylet is an ancestor,
    so `kill_node` refuses (kills nothing) rather than kill some other tree."""
    code = "import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while len(process_faults.tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        below = process_faults.tree(parent.pid)
        assert below[0] == parent.pid and len(below) == 2
        assert process_faults.raylet_of(parent.pid) is None
        assert process_faults.node_pids() == []
        with pytest.raises(ProcessLookupError, match="no raylet"):
            process_faults.kill_node()
    finally:
        for pid in reversed(process_faults.tree(parent.pid)):
            os.kill(pid, signal.SIGKILL)
        parent.wait()
