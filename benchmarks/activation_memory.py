"""Activation memory of the example GPT with no, half, or all blocks checkpointed.

For each setting one training step (forward and backward) of the example
model is measured: the bytes autograd saves for backward
(`SavedActivationMeter`, on any device), the step time, and where CUDA is
available the peak CUDA memory allocated during the step. This is the
trade the `enable_activation_checkpointing` action makes: less saved memory
for recomputation time.

    python benchmarks/activation_memory.py [--batch-size 16] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from benchmarks._smoke import add_check_imports, check_imports
from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.rank.actions.activation_checkpointing import (
    SavedActivationMeter,
    checkpointed_modules,
    disable_activation_checkpointing,
    enable_activation_checkpointing,
)


def measure(
    model: GPT, batch: torch.Tensor, fraction: float | None, repeats: int
) -> tuple[int, int | None, float]:
    """Saved bytes, peak CUDA bytes (None on CPU) and seconds of one step, for `fraction`."""
    disable_activation_checkpointing(model)
    if fraction is not None:
        enable_activation_checkpointing(model, fraction=fraction)
    cuda = batch.device.type == "cuda"
    lm_loss(model, batch).backward()  # warm-up: kernels, allocator pools
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(repeats):
        with SavedActivationMeter() as meter:
            loss = lm_loss(model, batch)
        loss.backward()
        # Keep the gradients alive across repeats, as a training loop does until step().
        del loss
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    peak = torch.cuda.max_memory_allocated() if cuda else None
    model.zero_grad(set_to_none=True)
    return meter.bytes, peak, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n-layer", type=int, default=GPTConfig.n_layer)
    parser.add_argument("--n-embd", type=int, default=GPTConfig.n_embd)
    parser.add_argument("--block-size", type=int, default=GPTConfig.block_size)
    add_check_imports(parser)
    args = parser.parse_args()
    if args.check_imports:
        check_imports()
        return

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, block_size=args.block_size)
    model = GPT(cfg).to(args.device)
    corpus = SyntheticCorpus(
        vocab_size=cfg.vocab_size, block_size=cfg.block_size, batch_size=args.batch_size,
        length=50_000,
    )  # fmt: skip
    batch = corpus.batch(0).to(args.device)
    print(
        f"example GPT: {cfg.n_layer} blocks, n_embd {cfg.n_embd}, block_size {cfg.block_size}, "
        f"batch {args.batch_size}, {model.num_params():,} parameters, on {args.device}"
    )
    header = (
        f"{'checkpointed blocks':<20} {'saved MiB':>10} {'vs none':>8} "
        f"{'peak CUDA MiB':>14} {'ms/step':>8}"
    )
    print(header)
    print("-" * len(header))
    baseline = 0
    for label, fraction in (("none", None), ("half", 0.5), ("all", 1.0)):
        saved, peak, seconds = measure(model, batch, fraction, args.repeats)
        baseline = baseline or saved
        label = f"{label} ({len(checkpointed_modules(model))} of {cfg.n_layer})"
        peak_text = "-" if peak is None else f"{peak / 2**20:.1f}"
        print(
            f"{label:<20} {saved / 2**20:>10.2f} {saved / baseline:>7.0%} "
            f"{peak_text:>14} {1000 * seconds:>8.1f}"
        )


if __name__ == "__main__":
    main()
