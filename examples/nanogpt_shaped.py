"""nanoGPT's training loop, written as nanoGPT writes it, under remedy's Guard.

The loop keeps what nanoGPT's `train.py` keeps: an iteration number, an LR
set by hand on the optimizer's param groups from it every iteration
(`get_lr(iter_num)`: linear warm-up, then cosine decay), an evaluation on
rank 0 every `eval_interval` iterations that tracks `best_val_loss`, and
gradient accumulation. Two changes make it survive every recovery remedy
makes (a rollback, a replaced rank, a resume from a checkpoint):

- `iter_num` is `guard.next_step`, never a counter of the loop's own: a
  replacement rank starts `main()` from the top, and after a rollback the
  loop trains an earlier step again; the Guard knows which step it is.
- the state the loop keeps besides the model is given to the Guard
  (`state=`, `register_state`): an EMA of the weights, the same on every
  rank (replicated), and rank 0's `best_val_loss` (per rank: only rank 0
  evaluates). Both are snapshotted with the model, rolled back with it,
  checkpointed with it, and adopted by a replacement rank.

Run it supervised, two data-parallel ranks:

    remedy run examples/nanogpt_shaped.py:main --workers 2

or alone: `python examples/nanogpt_shaped.py --max-iters 200`.
The model is a small causal MLP language model on a generated token stream
(CPU-sized); the loop's shape, not the model, is the point.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from remedy.rank import Guard, GuardConfig, get_context


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-iters", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--gradient-accumulation-steps", type=int, default=2)
    # nanoGPT's schedule: warm up to learning_rate, then cosine down to min_lr at lr_decay_iters.
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup-iters", type=int, default=20)
    p.add_argument("--lr-decay-iters", type=int, default=200)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--eval-all-ranks", action="store_true",
                   help="every rank evaluates (as HF's Trainer does), not rank 0 alone")  # fmt: skip
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--snapshot-every", type=int, default=10)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--policy", default=None, help="single-process mode only")
    p.add_argument("--run-dir", default=None, help="single-process mode only")
    return p.parse_args(argv)


def get_lr(it: int, args: argparse.Namespace) -> float:
    """nanoGPT's `get_lr`: linear warm-up, cosine decay to `min_lr`, then `min_lr`."""
    if it < args.warmup_iters:
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    if it > args.lr_decay_iters:
        return float(args.min_lr)
    decay_ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return float(args.min_lr + coeff * (args.learning_rate - args.min_lr))


class TinyLM(nn.Module):
    """A causal language model small enough for CPU: each position sees the tokens before it
    through a cumulative mean of their embeddings, then an MLP predicts the next token."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(
            nn.Linear(2 * width, 2 * width), nn.GELU(), nn.Linear(2 * width, vocab)
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        steps = torch.arange(1, idx.shape[1] + 1, device=idx.device).view(1, -1, 1)
        context = x.cumsum(dim=1) / steps  # causal: position t averages tokens 0..t
        return self.mlp(torch.cat([x, context], dim=-1))


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over a batch of rows of block_size + 1 tokens."""
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
    )


class Corpus:
    """Generated text with structure to learn: each token follows from the two before it.

    `batch(i)` is a pure function of (seed, i), so any batch is read again exactly after a
    rollback or by a replacement rank.
    """

    vocab = 32

    def __init__(self, *, block_size: int, batch_size: int, seed: int) -> None:
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randint(0, self.vocab, (self.vocab, self.vocab), generator=gen)

    def batch(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        rows = torch.randint(0, self.vocab, (self.batch_size, self.block_size + 1), generator=gen)
        noise = torch.rand(rows.shape, generator=gen) < 0.1  # a tenth of the tokens are random
        for t in range(2, rows.shape[1]):
            rows[:, t] = torch.where(
                noise[:, t], rows[:, t], self.table[rows[:, t - 2], rows[:, t - 1]]
            )
        return rows


class EMA:
    """An exponential moving average of the weights: replicated state (equal on every rank).

    `update(model, step)` folds in the weights trained by every step before `step` once:
    a step a recovery discarded, then trained again, is not counted twice.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.step = 0  # the weights after steps 0..step-1 are folded in
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        if step <= self.step:
            return
        for k, v in model.state_dict().items():
            self.shadow[k].mul_(self.decay).add_(v.detach(), alpha=1 - self.decay)
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}


class EvalState:
    """Rank 0's evaluation record: per-rank state (only rank 0 evaluates)."""

    def __init__(self) -> None:
        self.best_val_loss = float("inf")
        self.history: list[tuple[int, float]] = []

    def record(self, step: int, val_loss: float) -> None:
        """One eval at `step`; an eval of a step recorded before (a step a recovery discarded,
        trained again) replaces that one."""
        self.history = [h for h in self.history if h[0] < step] + [(step, val_loss)]
        self.best_val_loss = min(self.best_val_loss, val_loss)

    def state_dict(self) -> dict[str, Any]:
        return {"best_val_loss": self.best_val_loss, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_val_loss = float(state["best_val_loss"])
        self.history = [tuple(h) for h in state["history"]]  # type: ignore[misc]


@torch.no_grad()
def estimate_loss(model: nn.Module, corpus: Corpus, iters: int) -> float:
    """Mean loss on held-out batches (indices no training step reads); no RNG is drawn."""
    model.eval()
    losses = [float(lm_loss(model, corpus.batch(50_000_000 + k))) for k in range(iters)]
    model.train()
    return sum(losses) / len(losses)


def digest(tensors: dict[str, torch.Tensor] | nn.Module) -> str:
    """SHA-256 of the tensors' bytes: replicas, and a run and its fault-free twin, compare equal."""
    items = tensors.state_dict() if isinstance(tensors, nn.Module) else tensors
    h = hashlib.sha256()
    for k in sorted(items):
        h.update(items[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    ctx = get_context()
    rank, world = (ctx.rank, ctx.world_size) if ctx else (0, 1)
    master_process = rank == 0

    torch.manual_seed(args.seed)  # every rank builds the same model; DDP keeps them equal
    raw_model = TinyLM(Corpus.vocab, args.width)
    model: nn.Module = raw_model
    if world > 1 and dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(raw_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95))
    corpus = Corpus(block_size=args.block_size, batch_size=args.batch_size, seed=args.seed)

    def batch(i: int) -> torch.Tensor:
        # Rank r trains on batches r, r + world, ... of one stream: its own shard.
        return corpus.batch(i * world + rank)

    ema = EMA(raw_model, args.ema_decay)
    evals = EvalState()
    guard = Guard(
        model,
        optimizer,
        loss_fn=lm_loss,
        data=batch,
        max_steps=args.max_iters,
        config=GuardConfig(
            # nanoGPT's gradient accumulation: each batch is split into this many micro-batches.
            micro_batches=args.gradient_accumulation_steps,
            snapshot_every=args.snapshot_every,
            checkpoint_every=args.checkpoint_every,
            policy=args.policy,
        ),
        run_dir=args.run_dir,
        state={"ema": ema},  # replicated: a replacement adopts the survivor's
    )
    # Per rank: a replacement takes its rank's own copy, never a peer's.
    guard.register_state("evals", evals, per_rank=True)

    for X in guard:
        # nanoGPT's loop body, with iter_num from the Guard: right after a rollback, in a
        # replacement rank, after a resume.
        iter_num = guard.next_step
        lr = get_lr(iter_num, args)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % args.eval_interval == 0 and (master_process or args.eval_all_ranks):
            # On the module DDP wraps: no collective the other ranks would miss.
            val_loss = estimate_loss(raw_model, corpus, args.eval_iters)
            evals.record(iter_num, val_loss)  # nanoGPT: best_val_loss = min(...)
            if ctx is None:
                print(f"step {iter_num}: val loss {val_loss:.4f}, lr {lr:.2e}")
        guard.step(X)
        ema.update(raw_model, guard.next_step)  # a discarded step leaves next_step where it was

    summary = guard.close()
    if ctx is None:
        print(f"done: {summary['status']}, {summary['steps_completed']} steps, best val loss "
              f"{evals.best_val_loss:.4f}")  # fmt: skip
    return {
        "params_digest": digest(raw_model),
        "ema_digest": digest(ema.shadow),
        "ema_step": ema.step,
        "best_val_loss": evals.best_val_loss,
        "evals": evals.history,
    }


if __name__ == "__main__":
    main()
