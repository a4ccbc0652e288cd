"""benchmarks/gpu_check.py: its dry run imports no Ray; the parts that run on CPU do; on a GPU it passes."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from examples.gpt_model import GPTConfig

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # This checkout's remedy first; what the environment adds (carried wheels, say) after it.
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


@pytest.mark.timeout(180)
def test_dry_run_checks_imports_without_ray() -> None:
    """`--dry-run` imports the whole GPU path, loads the default policy, lists every check and
    exits 0; no `ray` module is imported on the way (`-X importtime` lists every import)."""
    proc = run_script("-X", "importtime", str(SCRIPT), "--dry-run", timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "remedy.rank.guard" in imported and "torch" in imported
    assert not [m for m in imported if m == "ray" or m.startswith("ray.")]
    assert "ray not imported" in proc.stdout
    listed = [
        ln.split(":")[0].split()[-1]
        for ln in proc.stdout.splitlines()
        if ln.startswith("would run")
    ]
    assert listed == [c.name for c in gpu_check.CHECKS]
    # No NVIDIA driver here: the real NVML reader says it is off, in one line, and nothing breaks.
    if not torch.cuda.is_available():
        assert "nvml: off (" in proc.stdout


def test_bad_arguments_are_one_located_line(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown check name is a usage error naming the checks, exit status 2."""
    with pytest.raises(SystemExit) as info:
        gpu_check.parse(["--only", "nvml,bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unknown check 'bogus'" in err and "cuda_oom" in err
    assert gpu_check.parse(["--only", "nvml"]).selected == ["nvml"]


def test_overhead_loop_interleaves_guarded_and_plain_on_cpu() -> None:
    """The guard_overhead check's loop on CPU: both sides train, ten chunk ratios, an interval
    around them."""
    setup = gpu_check.Setup("tiny", GPTConfig(n_layer=2, n_embd=64, block_size=32), 8)
    r = gpu_check.guarded_vs_plain(setup, torch.device("cpu"), pairs=10, warmup=2)
    assert len(r["chunk_ratios"]) == 10
    assert all(
        math.isfinite(r[k]) and r[k] > 0 for k in ("plain_ms", "guarded_ms", "ratio", "mean_ratio")
    )
    assert min(r["chunk_ratios"]) <= r["low"] <= r["high"] <= max(r["chunk_ratios"])


@pytest.mark.timeout(180)
def test_scaler_storm_check_passes_with_the_cpu_scaler() -> None:
    """The grad_scaler_fp16 check's run and assertions, with GradScaler("cpu") in float16."""
    line = gpu_check.scaler_storm(torch.device("cpu"))
    assert "rescale_grad_scaler" in line and "steps 35-59 all updated" in line


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_every_gpu_check_passes() -> None:
    """On a CUDA machine: every check prints PASS and the script exits 0."""
    proc = run_script(str(SCRIPT), timeout=590)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASS ") == len(gpu_check.CHECKS)
