"""A Hugging Face `Trainer` job with remedy's callback, as torchrun runs it (no remedy supervisor).

    torchrun --nproc_per_node 2 tests/integrations/launched_hf.py --run-dir runs/t --steps 30

Accelerate forms the gloo group from torchrun's environment and wraps the
model in DDP; the callback finds the group and no supervisor, so rank 0
decides for both ranks. Each rank writes its parameters and the commands it
applied to the run directory's `out/` when training ends, for
test_callbacks_torchrun.py to compare.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

from remedy.integrations.hf import RemedyCallback
from tests.integrations.hf_builders import CountingTokens, cpu_args, tiny_gpt2


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = tiny_gpt2()
    callback = RemedyCallback(run_dir=args.run_dir, snapshot_every=5)
    transformers.Trainer(
        model=model,
        args=cpu_args(Path(args.run_dir) / "trainer", args.steps),
        train_dataset=CountingTokens(1024),
        callbacks=[callback],
    ).train()
    guard = callback.guard
    assert guard is not None
    out = Path(args.run_dir) / "out"
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / f"params.rank{guard.rank}.pt")
    outcomes = [o.to_dict() for o in guard.history]  # every command this rank applied, and where
    (out / f"outcomes.rank{guard.rank}.json").write_text(json.dumps(outcomes, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
