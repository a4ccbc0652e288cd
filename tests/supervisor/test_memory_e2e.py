"""Memory remediations end to end: real supervisor actor, real ranks, the bundled default policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rank.actions.activation_checkpointing import SavedActivationMeter
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
ARGS = [
    "--steps",
    "60",
    "--layers",
    "2",
    "--width",
    "64",
    "--batch-size",
    "8",
    "--sample-every",
    "20",
]


def full_batch_saved_bytes() -> int:
    """Saved-activation bytes of one full batch of the job's model, measured the same way the cap is."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64))
    batch = SyntheticCorpus(batch_size=8).batch(0)
    with SavedActivationMeter() as meter:
        lm_loss(model, batch)
    return meter.peak


@pytest.fixture(scope="module")
def memory_run(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("memory")
    cap = int(full_batch_saved_bytes() * 0.6)
    spec = RunSpec(
        target=TARGET,
        policy="default",
        run_dir=str(run_dir),
        argv=[*ARGS, "--activation-cap", str(cap)],
    )
    return run_dir, run_supervised(spec)


def test_oom_recovered_through_supervisor(memory_run: tuple[Path, dict[str, Any]]) -> None:
    """The capped step runs out of memory; the policy checkpoints and halves micro-batches; nothing is lost."""
    run_dir, summary = memory_run
    assert summary["status"] == "completed"
    assert summary["steps_completed"] == summary["steps_executed"] == 60
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    oom = [d for d in decisions if d["anomaly"]["kind"] == "oom"]
    assert [(d["action"], d["outcome"]) for d in oom] == [
        ("enable_activation_checkpointing", "applied"),
        ("reduce_microbatch", "applied"),
    ]
    result = summary["ranks"][0]["result"]
    assert result["micro_batches"] == 2
    assert result["nonfinite_params"] == 0


def test_kv_fragmentation_switches_to_paged(memory_run: tuple[Path, dict[str, Any]]) -> None:
    """Sampling with 1024-token chunks reports kv_fragmentation; the policy switches to paged for good."""
    run_dir, summary = memory_run
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    (switch,) = [d for d in decisions if d["action"] == "switch_kv_allocator"]
    assert switch["outcome"] == "applied"
    assert switch["anomaly"]["kind"] == "kv_fragmentation"
    assert switch["anomaly"]["value"] > 0.9  # 32 tokens held in a 1024-token chunk
    assert summary["ranks"][0]["result"]["kv_allocator"] == "paged"
    kv_events = [
        a for a in read_jsonl(run_dir / "anomalies.jsonl") if a["kind"] == "kv_fragmentation"
    ]
    assert len(kv_events) == 1, "the paged allocator does not fragment, so no second event"
