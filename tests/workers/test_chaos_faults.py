"""The faults of a real failure's shape: an fp16 overflow storm through the real GradScaler, a
persistent straggler, a checkpoint write that meets EFBIG; a fault that cannot fire in its
setting is a located error; seeded random schedules and the keys of a chaos scenario."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remedy.rank import Guard, GuardConfig, WorkerContext
from remedy.rank.chaos.faults import (
    ChaosSetting,
    FaultInjector,
    check_setting,
    load_chaos,
    load_scenario,
    parse_chaos,
)
from remedy.rank.exceptions import ChaosConfigError
from remedy.rundir.writer import read_jsonl

# Tiny models: one intra-op thread (faster on 2 loaded cores; nothing here compares across processes).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def chaos_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "chaos.yaml"
    path.write_text(text)
    return path


def mlp_guard(
    tmp_path: Path,
    faults: list[Any],
    *,
    steps: int = 20,
    scaler: torch.amp.GradScaler | None = None,
    amp: torch.dtype | None = None,
    **config: Any,
) -> Guard:
    """A plain DataLoader-free MLP regression under a Guard alone (the default policy)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
        return x, torch.tanh(x @ target)

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(m(b[0]).float(), b[1])

    ctx = WorkerContext(run_dir=tmp_path / "run", faults=list(faults))
    return Guard(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), loss_fn=loss_fn, data=batch,
        max_steps=steps, scaler=scaler, context=ctx,
        config=GuardConfig(amp_dtype=amp, **config),
    )  # fmt: skip


def train(guard: Guard) -> dict[str, Any]:
    for b in guard:
        guard.step(b)
    return guard.close()


# ------------------------------------------------------------------ setting
def test_kill_supervisor_without_a_supervisor_is_a_located_error(tmp_path: Path) -> None:
    """Outside `remedy run` there is no supervisor to kill: the chaos file is refused at load
    time when the setting is known, and by the Guard (at the fault's line) when it is not."""
    path = chaos_file(
        tmp_path,
        "faults:\n  - {kind: nan_loss, at_step: 2}\n  - {kind: kill_supervisor, at_step: 3}\n",
    )
    with pytest.raises(ChaosConfigError) as info:
        load_chaos(path, setting=ChaosSetting(supervised=False))
    (line,) = str(info.value).splitlines()
    assert line.startswith(f"{path}:3:12: error: faults.1.kind: kill_supervisor cannot fire here")
    faults = load_chaos(path)  # the setting unknown: loads
    with pytest.raises(ChaosConfigError, match=rf"^{path}:3:5: error: kill_supervisor at step 3"):
        mlp_guard(tmp_path, faults)


def test_checkpoint_faults_without_durable_checkpoints_are_errors(tmp_path: Path) -> None:
    path = chaos_file(tmp_path, "faults:\n  - {kind: corrupt_checkpoint, at_step: 4}\n"
                                "  - {kind: checkpoint_write_error, at_step: 4}\n")  # fmt: skip
    with pytest.raises(ChaosConfigError) as info:
        mlp_guard(tmp_path, load_chaos(path), checkpoint_every=0)
    lines = str(info.value).splitlines()
    assert [ln.split(": error: ")[0] for ln in lines] == [f"{path}:2:5", f"{path}:3:5"]
    assert all("writes no durable checkpoints" in ln for ln in lines)


def test_slow_rank_needs_peers(tmp_path: Path) -> None:
    path = chaos_file(tmp_path, "faults:\n  - {kind: slow_rank, at_step: 4, seconds: 0.1}\n")
    with pytest.raises(ChaosConfigError, match="slow_rank needs at least 2 ranks"):
        load_chaos(path, world_size=1)
    assert [f.kind for f in load_chaos(path, world_size=2)] == ["slow_rank"]


def test_kill_node_needs_a_supervisor(tmp_path: Path) -> None:
    """kill_node is injectable under `remedy run`; a Guard alone (no supervisor) refuses it in one line."""
    path = chaos_file(tmp_path, "faults:\n  - {kind: kill_node, at_step: 4, rank: 1}\n")
    [fault] = load_chaos(path, world_size=2)
    assert (fault.kind, fault.rank) == ("kill_node", 1)
    with pytest.raises(ChaosConfigError, match="kill_node cannot fire here: a Guard alone"):
        check_setting([fault], ChaosSetting(supervised=False))


# ------------------------------------------------------------------ overflow storm
@pytest.mark.timeout(120)
def test_overflow_storm_goes_through_the_real_grad_scaler(tmp_path: Path) -> None:
    """30 steps of float16 overflow on CPU: the real GradScaler skips each and backs off, the
    scaler_overflow detector fires and the default policy rescues the scale; training goes on."""
    faults = parse_chaos(
        {"faults": [{"kind": "scaler_overflow_storm", "at_step": 5, "duration": 30}]}
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = mlp_guard(tmp_path, faults, steps=60, scaler=scaler, amp=torch.float16)
    summary = train(guard)
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    skipped = [m["step"] for m in metrics if m["optimizer_skipped"]]
    assert skipped == list(range(5, 35)), skipped
    stormy = [
        m for m in metrics if any(c["fault"] == "scaler_overflow_storm" for c in m.get("chaos", []))
    ]
    assert len(stormy) == 30
    scales = [m["loss_scale"] for m in metrics]
    assert scales[5] < scales[4], "the scaler backed off on the first overflow"
    anomalies = [a["kind"] for a in read_jsonl(tmp_path / "run" / "anomalies.jsonl")]
    assert "scaler_overflow" in anomalies and "nonfinite_grad" not in anomalies
    decisions = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    assert [d["action"] for d in decisions if d["anomaly"]["kind"] == "scaler_overflow"] == [
        "rescale_grad_scaler"
    ]
    assert summary["updates_skipped"] == 30 and summary["steps_completed"] == 60


def test_overflow_storm_without_float16_is_refused_not_silent(tmp_path: Path) -> None:
    """A scaler but a float32 backward: the storm's gradient is finite there, the scaler skips
    nothing, and the first storm step says so instead of pretending."""
    faults = parse_chaos(
        {"faults": [{"kind": "scaler_overflow_storm", "at_step": 2, "duration": 5}]}
    )
    guard = mlp_guard(tmp_path, faults, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(
        ChaosConfigError, match="did not overflow: this backward does not run in float16"
    ):
        train(guard)
    with pytest.raises(ChaosConfigError, match="no enabled GradScaler"):
        mlp_guard(tmp_path / "b", faults)


# ------------------------------------------------------------------ slow rank
def test_slow_rank_slows_every_step_of_its_window_each_time_it_runs() -> None:
    faults = parse_chaos(
        {"faults": [{"kind": "slow_rank", "at_step": 3, "duration": 2, "seconds": 0.05, "rank": 1}]}
    )
    slow, other = FaultInjector(faults, 1), FaultInjector(faults, 0)
    took = []
    for step in [2, 3, 4, 5, 3]:  # step 3 again: a replay after a rollback is slow again
        t0 = time.perf_counter()
        slow.before_step(step)
        other.before_step(step)
        took.append(time.perf_counter() - t0)
    assert [t >= 0.05 for t in took] == [False, True, True, False, True]
    assert [e["fault"] for e in slow.drain_log()] == ["slow_rank"] * 3


# ------------------------------------------------------------ checkpoint write error
@pytest.mark.timeout(120)
def test_checkpoint_write_error_is_a_real_efbig_journaled_and_survived(tmp_path: Path) -> None:
    """The checkpoint of step 10 meets a file-size limit of 0: every retry fails with EFBIG, the
    store raises CheckpointError, the Guard reports checkpoint_write_failed, the policy notifies,
    and training goes on to write the next checkpoint."""
    faults = parse_chaos({"faults": [{"kind": "checkpoint_write_error", "at_step": 7}]})
    guard = mlp_guard(tmp_path, faults, steps=22, checkpoint_every=5)
    summary = train(guard)
    assert summary["status"] == "completed" and summary["steps_completed"] == 22
    [event] = [a for a in read_jsonl(tmp_path / "run" / "anomalies.jsonl")
               if a["kind"] == "checkpoint_write_failed"]  # fmt: skip
    assert event["details"]["checkpoint_step"] == 10
    assert "File too large" in event["details"]["error"]
    assert "could not be written after 4 attempts" in event["details"]["error"]
    [notice] = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    assert notice["action"] == "notify" and notice["outcome"] == "applied"
    assert "(the checkpoint of step 10 could not be written)" in notice["reason"]
    steps = sorted(
        int(p.name[5:13]) for p in (tmp_path / "run" / "checkpoints").glob("step-*.json")
    )
    assert 10 not in steps and 15 in steps and 20 in steps
    import resource  # noqa: PLC0415

    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY, "limit lifted"


# ------------------------------------------------------------------ random schedules
RANDOM = """
random:
  seed: {seed}
  rate: 0.2
  from_step: 10
  until_step: 60
  mix: {{nan_loss: 3, kill_rank: 1, slow_loader: 1}}
"""


def test_a_seeded_random_schedule_is_the_same_for_the_same_seed(tmp_path: Path) -> None:
    a = load_chaos(chaos_file(tmp_path, RANDOM.format(seed=7)), world_size=4)
    b = load_chaos(chaos_file(tmp_path, RANDOM.format(seed=7)), world_size=4)
    c = load_chaos(chaos_file(tmp_path, RANDOM.format(seed=8)), world_size=4)
    assert a == b and a != c
    assert 3 <= len(a) <= 20
    assert all(10 <= f.at_step < 60 and f.rank in range(4) for f in a)
    assert {f.kind for f in a} <= {"nan_loss", "kill_rank", "slow_loader"}
    assert all(f.source == f"{tmp_path / 'chaos.yaml'}:2:1" for f in a)


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        (
            "random: {rate: 2, until_step: 5, mix: {nan_loss: 1}}",
            "1:16",
            "random.rate: expected faults per step in (0, 1]",
        ),
        (
            "random: {rate: 0.5, until_step: 5, mix: {nan_lose: 1}}",
            "1:42",
            "unknown or not injectable fault 'nan_lose'",
        ),
        (
            "random: {rate: 0.5, from_step: 5, until_step: 5, mix: {oom: 1}}",
            "1:47",
            "random.until_step: expected a step after",
        ),
        (
            "random: {rate: 1, until_step: 5, mix: {kill_supervisor: 1}}",
            "1:1",
            "kill_supervisor cannot fire here",
        ),
        ("workers: 0\n", "1:10", "workers: expected a whole number from 1"),
        ("args: [--steps, {a: 1}]\n", "1:7", "args: expected a list"),
    ],
)
def test_bad_scenario_keys_are_located_errors(
    tmp_path: Path, text: str, where: str, message: str
) -> None:
    path = chaos_file(tmp_path, text)
    with pytest.raises(ChaosConfigError) as info:
        load_chaos(path, setting=ChaosSetting(supervised=False))
    (line,) = str(info.value).splitlines()
    assert line.startswith(f"{path}:{where}: error: ") and message in line, line


def test_a_scenario_names_its_job(tmp_path: Path) -> None:
    path = chaos_file(tmp_path, (
        "description: a NaN, rolled back\ntarget: examples/pretrain_gpt.py:main\nworkers: 2\n"
        "steps: 40\nargs: [--layers, 1]\npolicy: llm-pretrain\nloss_tolerance: 0.05\n"
        "faults: [{kind: nan_loss, at_step: 20, rank: 1}]\n"
    ))  # fmt: skip
    s = load_scenario(path)
    assert (s.description, s.target, s.workers, s.steps, s.args, s.policy, s.loss_tolerance) == (
        "a NaN, rolled back", "examples/pretrain_gpt.py:main", 2, 40, ("--layers", "1"),
        "llm-pretrain", 0.05,
    )  # fmt: skip
    assert [(f.kind, f.rank) for f in s.faults] == [("nan_loss", 1)]
    with pytest.raises(ChaosConfigError, match="rank 1 is outside the world of 1"):
        load_chaos(path, world_size=1)  # the world given wins over the file's `workers`


def test_a_fault_past_the_last_step_is_a_warning_at_the_end(tmp_path: Path) -> None:
    """A fault scheduled after the run's last step never fires: the rank's summary and a
    warning at the end say so; one that fired is not named."""
    import structlog  # noqa: PLC0415

    faults = parse_chaos(
        {"faults": [{"kind": "nan_loss", "at_step": 3}, {"kind": "nan_loss", "at_step": 50}]}
    )
    with structlog.testing.capture_logs() as logs:
        summary = train(mlp_guard(tmp_path, faults, steps=20))
    assert summary["chaos_not_reached"] == [
        "nan_loss at step 50 (rank 0): the run ended after step 19, so it never fired"
    ]
    (warning,) = [r for r in logs if r["event"] == "chaos_fault_not_reached"]
    assert warning["log_level"] == "warning"
