"""What the torchrun-launched callback jobs (launched_hf.py, launched_lightning.py) share: their
command line, and what each rank leaves in the run directory's `out/` when training ends for
test_callbacks_torchrun.py to compare (its parameters and every command it applied)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch


def parse_args(argv: list[str], description: str) -> argparse.Namespace:
    """`--run-dir` (required) and `--steps` (30)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    return p.parse_args(argv)


def write_rank_out(run_dir: str, callback: Any, state_dict: dict[str, Any]) -> None:
    """This rank's `params.rank<N>.pt` and `outcomes.rank<N>.json` (every command its callback's
    Guard applied, and where) under `run_dir/out`."""
    guard = callback.guard
    assert guard is not None, "the callback never started its Guard"
    out = Path(run_dir) / "out"
    out.mkdir(parents=True, exist_ok=True)
    torch.save(state_dict, out / f"params.rank{guard.rank}.pt")
    outcomes = [o.to_dict() for o in guard.history]
    (out / f"outcomes.rank{guard.rank}.json").write_text(json.dumps(outcomes, default=str))
