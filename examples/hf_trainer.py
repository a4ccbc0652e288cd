"""Train a tiny GPT-2 with Hugging Face's `Trainer` under remedy: one callback.

    python examples/hf_trainer.py --run-dir runs/hf     # then: remedy report runs/hf

The model is built from a config (no download) and trains on generated
tokens; `--nan-at N` makes the N-th forward's loss NaN, to watch remedy drop
that update, roll back and cut the LR. Needs the extra: pip install "remedy[hf]".
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from remedy.integrations.hf import RemedyCallback


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Deterministic random token sequences; the labels are the inputs (causal LM)."""

    def __init__(self, n: int, length: int = 32, vocab: int = 64, seed: int = 0) -> None:
        self.n, self.length, self.vocab, self.seed = n, length, vocab, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(
            0,
            self.vocab,
            (self.length,),
            generator=torch.Generator().manual_seed(self.seed * 1_000_003 + i),
        )
        return {"input_ids": ids, "labels": ids.clone()}


def main(argv: list[str] | None = None) -> dict[str, int]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--nan-at", type=int, default=50, help="the forward whose loss is NaN; 0: none")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/hf")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64, n_positions=64)
    )
    forwards = [0]

    def chaos(module: torch.nn.Module, inputs: object, output: object) -> object:
        forwards[0] += 1
        if forwards[0] == args.nan_at:
            output.loss = output.loss * float("nan")  # type: ignore[attr-defined]
        return output

    model.register_forward_hook(chaos)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=f"{args.run_dir}/hf-output",
            max_steps=args.steps,
            per_device_train_batch_size=8 // args.grad_accum,
            gradient_accumulation_steps=args.grad_accum,
            max_grad_norm=1.0,  # the Trainer's default: remedy still sees the norm before clipping
            learning_rate=1e-3,
            seed=args.seed,
            logging_steps=25,
            save_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
        ),
        train_dataset=Tokens(8 * args.steps, seed=args.seed),
        callbacks=[RemedyCallback(run_dir=args.run_dir)],  # the one line remedy needs
    )
    trainer.train()
    print(f"done: {trainer.state.global_step} steps; journal in {args.run_dir}/decisions.jsonl")
    return {"global_step": int(trainer.state.global_step)}


if __name__ == "__main__":
    main()
