"""Pretrain a small GPT under remedy: the few lines a user adds to their loop.

Run it supervised (ranks as Ray actors, policy decisions journaled):

    remedy run examples/pretrain_gpt.py:main --chaos examples/chaos/demo.yaml

or alone in one process (the policy engine runs in-process):

    python examples/pretrain_gpt.py --steps 300

The model and corpus are in `gpt_model.py` next to this file. With several
ranks the model is wrapped in DDP, or with `--fsdp` sharded by FSDP2
(`fully_shard` on each block and the root: each rank holds a shard of the
weights and optimizer state); each rank reads its own slice of the batch
stream, so rollback and skipped batches stay exact per rank.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from typing import Any

import torch
import torch.distributed as dist
from gpt_model import GPT, GPTConfig, SyntheticCorpus, cosine_with_warmup, lm_loss

from remedy.rank import Guard, GuardConfig, get_context
from remedy.rank.actions.kv_cache import KVCache, generate, kv_fragmentation_event


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sample-every", type=int, default=100, help="generate evaluation samples every N steps"
    )
    p.add_argument(
        "--activation-cap",
        type=int,
        default=None,
        help="saved-activation bytes per micro-batch above which a step runs out of memory",
    )
    p.add_argument(
        "--amp",
        choices=["auto", "fp16", "off"],
        default="auto",
        help="float16 autocast with a GradScaler: on a GPU (auto), everywhere (fp16: on CPU ~10x "
        "slower, but its overflows are real, for the scaler's faults), or never (off)",
    )
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP")
    p.add_argument(
        "--hsdp", action="store_true", help="with --fsdp: 2 replicas of the shards (HSDP)"
    )
    p.add_argument("--snapshot-every", type=int, default=10)
    p.add_argument("--snapshot-ring", type=int, default=12, help="in-memory snapshots kept")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--checkpoint-keep", type=int, default=3, help="durable checkpoints kept")
    p.add_argument(
        "--skip-batches",
        default="",
        help="comma-separated batch indices never trained on (to reproduce a run that skipped them)",
    )
    p.add_argument("--policy", default=None, help="single-process mode only")
    p.add_argument("--run-dir", default=None, help="single-process mode only")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    ctx = get_context()
    rank, world = (ctx.rank, ctx.world_size) if ctx else (0, 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # Every rank builds the same model from the same seed; DDP keeps them equal.
    torch.manual_seed(args.seed)
    cfg = GPTConfig(block_size=args.block_size, n_layer=args.layers, n_embd=args.width)
    model: torch.nn.Module = GPT(cfg).to(device)
    if world > 1 and dist.is_initialized() and args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 - sharded only
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        # HSDP: shards within each half of the ranks, replicated across the halves.
        mesh = (
            init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
            if args.hsdp
            else None
        )
        for block in model.blocks:  # one all-gather per block; the root holds the rest
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif world > 1 and dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(args.warmup, args.steps)
    )

    # fp16 autocast with a GradScaler pays on GPU; on CPU it is ~10x slower, so train fp32 there
    # unless asked (`--amp fp16`: CPU float16 overflows are real, and the GradScaler's too).
    use_amp = args.amp == "fp16" or (args.amp == "auto" and device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type) if use_amp else None
    corpus = SyntheticCorpus(block_size=args.block_size, batch_size=args.batch_size, seed=args.seed)

    def batch(i: int) -> torch.Tensor:
        # Rank r trains on batches r, r + world, r + 2*world, ... of one deterministic stream.
        return corpus.batch(i * world + rank).to(device, non_blocking=True)

    guard = Guard(
        model,
        optimizer,
        loss_fn=lm_loss,
        data=batch,
        scheduler=scheduler,
        scaler=scaler,
        max_steps=args.steps,
        config=GuardConfig(
            amp_dtype=torch.float16 if use_amp else None,
            activation_cap_bytes=args.activation_cap,
            snapshot_every=args.snapshot_every,
            snapshot_ring=args.snapshot_ring,
            checkpoint_every=args.checkpoint_every,
            checkpoint_keep=args.checkpoint_keep,
            policy=args.policy,
        ),
        run_dir=args.run_dir,
    )
    guard.cursor.skipped.update(int(i) for i in args.skip_batches.split(",") if i)
    samples: dict[int, list[int]] = {}
    for batch_tokens in guard:
        result = guard.step(batch_tokens)
        if ctx is None and result.step % 50 == 0:
            print(f"step {result.step:4d}  loss {result.loss:.4f}  lr {result.lr:.2e}")
        if args.sample_every and (result.step + 1) % args.sample_every == 0:
            samples[result.step + 1] = sample(guard, model, corpus, rank, result.step + 1, device)

    eval_loss = evaluate(model, corpus, device)
    nonfinite = sum(int(not torch.isfinite(p).all()) for p in model.parameters())
    summary = guard.close()
    if ctx is None:
        print(
            f"done: {summary['status']}, {summary['steps_completed']} steps, eval loss {eval_loss:.4f}"
        )
    return {
        "eval_loss": eval_loss,
        "nonfinite_params": nonfinite,
        "samples": samples,
        "kv_allocator": guard.kv_allocator,
        "micro_batches": guard.micro_batches,
        "params_digest": params_digest(model),
    }


def params_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes: data-parallel replicas must end bitwise equal."""
    digest = hashlib.sha256()
    for p in model.parameters():
        # A sharded parameter is gathered whole (a collective: every rank calls this).
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        digest.update(whole.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def sample(
    guard: Guard,
    model: torch.nn.Module,
    corpus: SyntheticCorpus,
    rank: int,
    step: int,
    device: torch.device,
) -> list[int]:
    """Greedy evaluation sample with a KV cache from the Guard's current allocator.

    The cache's fragmentation at the end of generation is reported to the
    policy (`kv_fragmentation`), which may switch the allocator.
    """
    plain = getattr(model, "module", model)  # generate on the module DDP wraps
    prompt = corpus.batch(20_000_000)[:1, :8].to(device)
    new_tokens = 24
    found: list[object] = []

    def watch(n: int, cache: KVCache) -> None:
        guard.track_kv_cache(cache)
        if n == new_tokens:
            found.append(kv_fragmentation_event(cache, rank=rank, step=step))

    out = generate(plain, prompt, new_tokens, allocator=guard.kv_allocator, on_token=watch)
    guard.report_event(found[0] if found else None)
    return [int(t) for t in out[0, 8:]]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, corpus: SyntheticCorpus, device: torch.device, batches: int = 8
) -> float:
    """Mean loss on held-out batch indices far beyond any training index."""
    model.eval()
    losses = [
        float(lm_loss(model, corpus.batch(10_000_000 + i).to(device))) for i in range(batches)
    ]
    model.train()
    return sum(losses) / len(losses)


if __name__ == "__main__":
    main()
