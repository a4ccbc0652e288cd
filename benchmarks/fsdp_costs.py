"""What the Guard costs on a sharded (FSDP2) job: step overhead, snapshot and mirror cost, memory.

Two gloo ranks in fresh processes each train the sharded example GPT
(`fully_shard` on each block and the root) twice from the same weights:
in a plain loop (`zero_grad`, forward, backward, `optimizer.step`,
`scheduler.step`) and through the Guard (default detectors, snapshots every
`--snapshot-every` steps, each mirrored to the buddy rank). Blocks of steps
alternate plain, guarded, plain, ... so load drifts hit both; printed is the
ratio of the median step times, snapshot steps included (the mirror's
helper thread competes for the same cores).

Then, per snapshot on rank 0: `take_snapshot` into recycled buffers, the
mirror's hand-over on the training thread (`push`, which first waits for the
previous exchange), the helper thread's pack and transfer, against a raw copy
of the rank's local shards (model and optimizer state) into preallocated
buffers; and the host memory the mirror holds against the rank's own shard.

    python benchmarks/fsdp_costs.py [--steps 60] [--blocks 6]

Timings on a shared machine are noisy: compare ratios; the load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._smoke import add_check_imports, check_imports  # noqa: E402
from examples.gpt_model import (  # noqa: E402
    GPT,
    GPTConfig,
    SyntheticCorpus,
    cosine_with_warmup,
    lm_loss,
)
from remedy.rank import Guard, GuardConfig  # noqa: E402
from remedy.rank.state import sharding  # noqa: E402
from tests.workers.fsdp_ranks import spawn_ranks  # noqa: E402

CFG = GPTConfig(block_size=64, n_layer=4, n_embd=128)  # the example's defaults


def _build(cfg: GPTConfig = CFG) -> tuple[torch.nn.Module, Any, Any]:
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - in the rank processes

    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(30, 10_000))
    return model, opt, sched


def _rank(
    rank: int, world: int, steps: int, blocks: int, every: int, cfg: GPTConfig
) -> dict[str, Any]:
    corpus = SyntheticCorpus(block_size=cfg.block_size, batch_size=16, seed=0)

    def batch(i: int) -> torch.Tensor:
        return corpus.batch(i * world + rank)

    plain_model, plain_opt, plain_sched = _build(cfg)
    model, opt, sched = _build(cfg)
    guard = Guard(model, opt, loss_fn=lm_loss, data=batch, scheduler=sched,
                  config=GuardConfig(snapshot_every=every))  # fmt: skip
    loop = iter(guard)
    plain_times: list[float] = []
    guard_times: list[float] = []
    i = 0
    for _ in range(blocks):
        for _ in range(steps):
            t0 = time.perf_counter()
            plain_opt.zero_grad(set_to_none=True)
            lm_loss(plain_model, batch(i)).backward()
            plain_opt.step()
            plain_sched.step()
            plain_times.append(time.perf_counter() - t0)
            i += 1
        for _ in range(steps):
            t0 = time.perf_counter()
            guard.step(next(loop))  # next() runs the boundary: snapshots and mirror included
            guard_times.append(time.perf_counter() - t0)
    # Snapshot and mirror, alone, on the trained state (optimizer state present).
    assert guard.mirror is not None
    raw_bufs = [
        torch.empty_like(sharding.local(t))
        for t in [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]
        if isinstance(t, torch.Tensor) and t.dim() > 0
    ]
    sources = [
        sharding.local(t)
        for t in [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]
        if isinstance(t, torch.Tensor) and t.dim() > 0
    ]
    snap_ms, push_ms, raw_ms = [], [], []
    recycled = guard.take_snapshot()
    guard.mirror.exchange_s.clear()
    for _ in range(20):
        t0 = time.perf_counter()
        for dst, src in zip(raw_bufs, sources, strict=True):
            dst.copy_(src)
        raw_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        snap = guard.take_snapshot(into=recycled)
        snap_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        guard.mirror.push(snap)
        push_ms.append((time.perf_counter() - t0) * 1e3)
        guard.mirror.wait()
    exchange_ms = [s * 1e3 for s in guard.mirror.exchange_s]
    shard = sum(t.numel() * t.element_size() for t in sources)
    out = {
        "plain_step_ms": statistics.median(plain_times) * 1e3,
        "guard_step_ms": statistics.median(guard_times) * 1e3,
        "plain_mean_ms": statistics.fmean(plain_times) * 1e3,
        "guard_mean_ms": statistics.fmean(guard_times) * 1e3,
        "raw_copy_ms": statistics.median(raw_ms),
        "snapshot_ms": statistics.median(snap_ms),
        "push_ms": statistics.median(push_ms),
        "exchange_ms": statistics.median(exchange_ms),
        "shard_bytes": shard,
        "mirror_held_bytes": guard.mirror.held_bytes(),
    }
    guard.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="steps per block")
    p.add_argument("--blocks", type=int, default=6, help="alternating blocks of each loop")
    p.add_argument("--snapshot-every", type=int, default=10)
    p.add_argument("--layers", type=int, default=CFG.n_layer)
    p.add_argument("--width", type=int, default=CFG.n_embd)
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports("torch.distributed.fsdp")
        return
    cfg = GPTConfig(block_size=CFG.block_size, n_layer=args.layers, n_embd=args.width)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = spawn_ranks(_rank, 2, Path(tmp), args.steps, args.blocks, args.snapshot_every, cfg,
                            timeout_s=3600)  # fmt: skip
    r = ranks[0]
    load = os.getloadavg()
    params = sum(p.numel() for p in GPT(cfg).parameters())
    print(
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; 2 gloo ranks, GPT of "
        f"{args.layers} layers, width {args.width} ({params / 1e6:.1f}M parameters)"
    )
    print(f"step: plain {r['plain_step_ms']:.2f} ms, guarded {r['guard_step_ms']:.2f} ms "
          f"(median ratio {r['guard_step_ms'] / r['plain_step_ms']:.3f}, "
          f"mean ratio {r['guard_mean_ms'] / r['plain_mean_ms']:.3f}; "
          f"snapshot every {args.snapshot_every})")  # fmt: skip
    on_step = r["snapshot_ms"] + r["push_ms"]
    print(f"per snapshot: raw copy of the shard {r['raw_copy_ms']:.3f} ms; take_snapshot "
          f"{r['snapshot_ms']:.3f} ms + mirror hand-over {r['push_ms']:.3f} ms on the step "
          f"= {on_step / r['raw_copy_ms']:.2f}x raw; helper thread pack + transfer "
          f"{r['exchange_ms']:.3f} ms")  # fmt: skip
    print(f"memory: own shard {r['shard_bytes'] / 1e6:.2f} MB, mirror held "
          f"{r['mirror_held_bytes'] / 1e6:.2f} MB")  # fmt: skip
    print(json.dumps(ranks))


if __name__ == "__main__":
    main()
