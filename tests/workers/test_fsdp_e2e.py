"""Sharded (FSDP2) jobs under `remedy run`: real ranks as Ray actors on gloo."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from remedy.cli import resume
from remedy.cli.runner import run_supervised
from remedy.protocol.exceptions import UsageError
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl
from tests.paths import PYTHONPATH
from tests.workers.fsdp_ranks import backends

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent


def test_readme_loop_with_fully_shard_trains_on_two_ranks(
    ray_cluster: None, tmp_path: Path
) -> None:
    """The README's DDP loop with fully_shard in place of DDP completes (it crashed in update_stall)."""
    spec = RunSpec(target=f"{HERE / 'fsdp_train.py'}:main", workers=2, run_dir=str(tmp_path),
                   argv=["30"], threads_per_rank=1)  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary["ranks"]
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [30, 30]
    assert ranks[0]["result"]["params_digest"] == ranks[1]["result"]["params_digest"]


REPO = HERE.parents[1]
GPT = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
POLICY = str(HERE / "fsdp_policy.yaml")
GPT_ARGS = ["--fsdp", "--steps", "40", "--layers", "2", "--width", "32", "--block-size", "16",
            "--batch-size", "4", "--sample-every", "0", "--snapshot-every", "2"]  # fmt: skip


def _gpus(backend: str) -> float:
    """A rank's GPUs: one each on NCCL (the example then trains on CUDA with AMP), else none."""
    return 1.0 if backend == "nccl" else 0.0


def _gpt(
    run_dir: Path, *, faults: list[dict[str, Any]], argv: list[str], backend: str = "gloo"
) -> dict[str, Any]:
    spec = RunSpec(target=GPT, workers=4, run_dir=str(run_dir), faults=faults, policy=POLICY,
                   argv=[*GPT_ARGS, *argv], threads_per_rank=1,
                   gpus_per_rank=_gpus(backend))  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary
    return summary


@pytest.mark.parametrize(
    ("fault", "rule"),
    [
        ({"kind": "nan_loss", "at_step": 25, "rank": 2}, "nan-rollback"),
        (
            {"kind": "loss_spike", "at_step": 25, "rank": 1, "factor": 50.0, "duration": 3},
            "spike-rollback",
        ),
    ],
    ids=["nan", "spike"],
)
@pytest.mark.parametrize("backend", backends(4))
@pytest.mark.slow
def test_four_sharded_ranks_roll_back_and_skip_bitwise(
    ray_cluster: None, tmp_path: Path, fault: dict[str, Any], rule: str, backend: str
) -> None:
    """A fault on one of 4 FSDP2 ranks rolls every shard back; the run ends bitwise equal to a
    fault-free run that skips the same batches."""
    faulty = _gpt(tmp_path / "faulty", faults=[fault], argv=[], backend=backend)
    decisions = read_jsonl(tmp_path / "faulty" / "decisions.jsonl")
    # One rollback applied (the spike's next poisoned step is a repeat, suppressed while cooling down).
    applied = [d for d in decisions if d["action"] == "rollback" and d["outcome"] == "applied"]
    assert [d["rule"] for d in applied] == [rule]
    skipped = faulty["ranks"][0]["skipped_batches"]
    assert skipped and all(r["skipped_batches"] == skipped for r in faulty["ranks"])
    clean = _gpt(
        tmp_path / "clean",
        faults=[],
        argv=["--skip-batches", ",".join(map(str, skipped))],
        backend=backend,
    )
    digests = {r["result"]["params_digest"] for r in faulty["ranks"]}
    assert len(digests) == 1
    assert digests == {r["result"]["params_digest"] for r in clean["ranks"]}
    assert faulty["ranks"][0]["steps_executed"] > clean["ranks"][0]["steps_executed"] == 40


WATCH = {"first_step_s": 4.0}  # the hang watch's first-step allowance, as in the DDP restart tests


def _restartable(
    run_dir: Path,
    faults: list[dict[str, Any]],
    *,
    extra: tuple[str, ...] | list[str] = (),
    backend: str = "gloo",
    node_agents: str = "off",
) -> dict[str, Any]:
    spec = RunSpec(target=GPT, workers=4, run_dir=str(run_dir), faults=faults, policy=POLICY,
                   argv=[*GPT_ARGS, "--snapshot-every", "1", "--checkpoint-every", "8", *extra],
                   threads_per_rank=1, hang_watch=WATCH, spares=2,
                   gpus_per_rank=_gpus(backend), node_agents=node_agents)  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary
    return summary


@pytest.fixture(scope="module")
def clean_sharded(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The whole parameters' digest of the fault-free sharded run the restart tests compare to."""
    summary = _restartable(tmp_path_factory.mktemp("clean"), [])
    digests = {r["result"]["params_digest"] for r in summary["ranks"]}
    assert len(digests) == 1 and summary["recoveries"] == []
    return digests.pop()


@pytest.mark.parametrize(
    ("lost", "source"), [((1,), "buddy"), ((1, 2), "dcp")], ids=["buddy", "adjacent-dcp"]
)
@pytest.mark.slow
def test_stopped_sharded_rank_is_replaced_from_its_buddy_or_dcp(
    clean_sharded: str, tmp_path: Path, lost: tuple[int, ...], source: str
) -> None:
    """SIGSTOPped ranks are replaced; the shard comes from the buddy (at most the step in flight
    lost) or, with the buddy lost too, from the DCP checkpoint; the journal names the source; the
    run ends bitwise equal to a clean one."""
    faults = [{"kind": "hang_rank", "at_step": 20, "rank": r} for r in lost]
    summary = _restartable(tmp_path, faults)
    assert {r["result"]["params_digest"] for r in summary["ranks"]} == {clean_sharded}
    restart = [d for d in read_jsonl(tmp_path / "decisions.jsonl") if d["action"] == "restart_rank"]
    applied = [d for d in restart if d["outcome"] == "applied"]
    assert applied, restart
    restore = applied[-1]["result"]["shard_restore"]
    assert restore["source"] == source, restore
    assert f"shards from {source}" in applied[-1]["detail"]
    if source == "buddy":
        # The fault fires right after a boundary, while the exchange of that boundary's snapshot
        # may still be in flight (it runs beside the step): the buddy then holds the snapshot
        # before it and one step is redone. Both happen here, as the race goes.
        assert restore["steps_lost"] in (0, 1), restore
        assert restore["step"] == 20 - restore["steps_lost"]
    else:
        assert restore["step"] == 16  # the newest checkpoint committed by every rank


@pytest.mark.parametrize("backend", backends(4))
@pytest.mark.slow
def test_hsdp_rank_is_replaced_from_its_replica(
    ray_cluster: None, tmp_path: Path, backend: str
) -> None:
    """HSDP (2 x 2 mesh): a SIGSTOPped rank takes its shard from its live replica peer, 0 steps lost,
    and the run ends bitwise equal to a fault-free HSDP run.

    Rank 1 stops mid-step: the survivors' steps fail half-way, and they must forget FSDP's
    half-done iteration before they step again with the replacement (it hung here, then the
    retried step added the failed one's gradients)."""
    clean = _restartable(tmp_path / "clean", [], extra=["--hsdp"], backend=backend)
    hung = _restartable(tmp_path / "hung", [{"kind": "hang_rank", "at_step": 20, "rank": 1}],
                        extra=["--hsdp"], backend=backend)  # fmt: skip
    digest = {r["result"]["params_digest"] for r in clean["ranks"]}
    assert len(digest) == 1
    assert {r["result"]["params_digest"] for r in hung["ranks"]} == digest
    restart = [d for d in read_jsonl(tmp_path / "hung" / "decisions.jsonl")
               if d["action"] == "restart_rank" and d["outcome"] == "applied"]  # fmt: skip
    restore = restart[-1]["result"]["shard_restore"]
    assert restore["source"] == "replica" and restore["from"] == {"1": 3}
    assert restore["steps_lost"] == 0


@pytest.mark.parametrize(("extra", "source"), [((), "buddy"), (("--hsdp",), "replica")],
                         ids=["fsdp", "hsdp"])  # fmt: skip
@pytest.mark.slow
def test_a_killed_sharded_rank_is_found_through_the_node_agent_and_replaced(
    ray_cluster: None, tmp_path: Path, extra: tuple[str, ...], source: str
) -> None:
    """Under node agents, a SIGKILLed FSDP2 (or HSDP) rank fails its peers' collective: their
    failed collective's alarm goes through the agent, the rank is replaced once with its shard
    from its buddy (replica), and the run ends bitwise equal to a fault-free run."""
    clean = _restartable(tmp_path / "clean", [], extra=extra)
    killed = _restartable(tmp_path / "killed", [{"kind": "kill_rank", "at_step": 20, "rank": 1}],
                          extra=extra, node_agents="on")  # fmt: skip
    digest = {r["result"]["params_digest"] for r in clean["ranks"]}
    assert len(digest) == 1
    assert {r["result"]["params_digest"] for r in killed["ranks"]} == digest
    decisions = read_jsonl(tmp_path / "killed" / "decisions.jsonl")
    assert [(d["action"], d["outcome"], d["anomaly"]["kind"]) for d in decisions] == [
        ("restart_rank", "applied", "rank_dead")
    ]
    assert decisions[0]["result"]["shard_restore"]["source"] == source
    assert list(tmp_path.glob("killed/metrics-agent-*.jsonl"))  # the ranks reported through it


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


@pytest.mark.slow
def test_sharded_run_resumes_on_fewer_ranks_with_resume_from(
    ray_cluster: None, tmp_path: Path
) -> None:
    """`remedy run --workers 2 --resume-from RUN_DIR` of a 4-rank FSDP2 run (a job restarted on
    fewer nodes): both ranks load the 4 ranks' newest DCP checkpoint, resharded, and train on to
    the end; the source run's directory is left as it was."""
    four = tmp_path / "four"
    _gpt(four, faults=[], argv=["--steps", "16", "--checkpoint-every", "8"])
    source = _files(four / "checkpoints")
    with pytest.raises(UsageError, match=r"step 16\) was written by 4 rank\(s\); a run of 5"):
        resume.locate(str(four), 5)
    two = tmp_path / "two"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PYTHONPATH=PYTHONPATH,
        HOME=str(tmp_path),
        REMEDY_HOME=str(tmp_path / ".remedy"),
    )
    argv = ["run", GPT, "--workers", "2", "--resume-from", str(four), "--run-dir", str(two),
            "--policy", POLICY, "--", *GPT_ARGS, "--steps", "24",
            "--checkpoint-every", "8"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "remedy.cli", *argv], env=env, text=True,
                          capture_output=True, timeout=500, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from step 16 of {four} (written by 4 rank(s))" in proc.stderr
    summary = json.loads((two / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == 16 and summary["resumed_from"]["writers"] == 4
    for rank in summary["ranks"]:
        assert rank["resumed"]["step"] == 16, rank["resumed"]
        assert rank["steps_completed"] == 24
    assert len({r["result"]["params_digest"] for r in summary["ranks"]}) == 1
    steps = {(m["rank"], m["step"]) for m in read_jsonl(two / "metrics.jsonl")}
    assert steps == {(r, s) for r in (0, 1) for s in range(16, 24)}
    # Written by the 2 ranks in their own directory; the source's files are untouched.
    assert (
        json.loads((two / "checkpoints" / "step-00000024.rank1.json").read_text())["world_size"]
        == 2
    )
    assert _files(four / "checkpoints") == source
