"""`remedy run --resume-from`: which checkpoint of an earlier run a new run starts from, and its seed."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remedy.cli import resume
from remedy.protocol.exceptions import UsageError
from remedy.rank.state.checkpoint_store import CheckpointStore
from remedy.rank.state.snapshots import Snapshot

REPO = Path(__file__).resolve().parents[2]


def _snap(step: int, value: float) -> Snapshot:
    return Snapshot(step=step, tick=step, cursor=step, model={"w": torch.full((4,), value)},
                    optimizer={"state": {}, "param_groups": [{}]}, scheduler=None, scaler=None,
                    rng={"torch": torch.get_rng_state()})  # fmt: skip


def _plain_run(run_dir: Path, ranks: int, steps: list[int]) -> Path:
    """Plain checkpoints of `ranks` ranks at `steps`, written by the real store."""
    folder = run_dir / "checkpoints"
    for rank in range(ranks):
        store = CheckpointStore(folder, rank=rank, keep=10)
        for step in steps:
            store.save_now(_snap(step, float(step)))
        store.close()
    return folder


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_newest_step_every_writer_committed_and_at_most_its_writers(tmp_path: Path) -> None:
    """The newest checkpoint committed by every rank is chosen; more --workers than wrote it is
    refused, saying how many wrote it; fewer resume."""
    folder = _plain_run(tmp_path / "src", 3, [10, 20, 30])
    (folder / "step-00000030.rank0.json").unlink()  # rank 0 never committed step 30
    point = resume.find(tmp_path / "src", 2, given="--resume-from src")
    assert (point.step, point.writers, point.steps) == (20, 3, (10, 20))
    with pytest.raises(UsageError, match=r"step 20\) was written by 3 rank\(s\); a run of 4"):
        resume.find(tmp_path / "src", 4, given="--resume-from src")
    with pytest.raises(UsageError, match="no checkpoints/ folder"):
        resume.locate(str(tmp_path), 1)
    with pytest.raises(UsageError, match="no such directory"):
        resume.locate(str(tmp_path / "missing"), 1)


def test_manifests_that_are_not_a_store_s_are_no_checkpoint(tmp_path: Path) -> None:
    """Hand-edited or damaged manifests (not JSON, a list, a world size that is no number) make
    no step resumable, and say so instead of failing."""
    folder = _plain_run(tmp_path / "src", 1, [10, 20, 30])
    (folder / "step-00000010.rank0.json").write_text("not json")
    (folder / "step-00000020.rank0.json").write_text("[1, 2]")
    manifest = json.loads((folder / "step-00000030.rank0.json").read_text())
    (folder / "step-00000030.rank0.json").write_text(json.dumps({**manifest, "world_size": "4"}))
    with pytest.raises(UsageError, match="holds no checkpoint committed by every rank"):
        resume.find(tmp_path / "src", 1, given="--resume-from src")


def test_seed_links_the_steps_and_the_new_run_never_writes_through_them(tmp_path: Path) -> None:
    """The new run's checkpoints/ gets the usable steps; its store writing the same step again
    (a rollback that reaches it again) leaves the source's files as they were."""
    source = _plain_run(tmp_path / "src", 2, [10, 20])
    before = _digests(source)
    point = resume.find(tmp_path / "src", 2, given="--resume-from src")
    resume.seed(point, tmp_path / "new")
    seeded = tmp_path / "new" / "checkpoints"
    assert _digests(seeded) == {n: h for n, h in before.items() if n.startswith("step-")}
    store = CheckpointStore(seeded, rank=0, keep=10)
    assert float(store.load(20).model["w"][0]) == 20.0
    store.save_now(_snap(20, -1.0))
    store.close()
    assert float(CheckpointStore(seeded, rank=0).load(20).model["w"][0]) == -1.0
    assert _digests(source) == before


def test_cli_refuses_a_bad_resume_before_starting_ray(tmp_path: Path) -> None:
    """`remedy run --resume-from` a folder with no run: exit 2 and one line saying why."""
    proc = subprocess.run(
        [sys.executable, "-m", "remedy.cli", "run", "examples/pretrain_gpt.py:main",
         "--resume-from", str(tmp_path), "--run-dir", str(tmp_path / "new")],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"--resume-from {tmp_path}: has no checkpoints/ folder" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "new").exists()
