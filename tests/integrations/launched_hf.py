"""A Hugging Face `Trainer` job with remedy's callback, as torchrun runs it (no remedy supervisor).

    torchrun --nproc_per_node 2 tests/integrations/launched_hf.py --run-dir runs/t --steps 30

Accelerate forms the gloo group from torchrun's environment and wraps the
model in DDP; the callback finds the group and no supervisor, so rank 0
decides for both ranks. Each rank writes its parameters and the commands it
applied to the run directory's `out/` when training ends, for
test_callbacks_torchrun.py to compare.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

from remedy.integrations.hf import RemedyCallback
from tests.integrations.hf_builders import CountingTokens, cpu_args, tiny_gpt2
from tests.integrations.launched_job import parse_args, write_rank_out


def main(argv: list[str]) -> None:
    args = parse_args(argv, __doc__.splitlines()[0])
    torch.set_num_threads(1)
    model = tiny_gpt2()
    callback = RemedyCallback(run_dir=args.run_dir, snapshot_every=5)
    transformers.Trainer(
        model=model,
        args=cpu_args(Path(args.run_dir) / "trainer", args.steps),
        train_dataset=CountingTokens(1024),
        callbacks=[callback],
    ).train()
    write_rank_out(args.run_dir, callback, model.state_dict())


if __name__ == "__main__":
    main(sys.argv[1:])
