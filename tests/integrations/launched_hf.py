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


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Counting sequences from a random start: learnable, one per index."""

    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = int(torch.randint(0, 64, (1,), generator=torch.Generator().manual_seed(i)))
        ids = (start + torch.arange(16)) % 64
        return {"input_ids": ids, "labels": ids.clone()}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    training = transformers.TrainingArguments(
        output_dir=str(Path(args.run_dir) / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1000,
        dataloader_num_workers=0,
    )
    callback = RemedyCallback(run_dir=args.run_dir, snapshot_every=5)
    transformers.Trainer(
        model=model, args=training, train_dataset=Tokens(), callbacks=[callback]
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
