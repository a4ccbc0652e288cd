"""KV-cache allocators under a serving-like workload: how much reserved memory holds no token.

Requests with long-tailed prompt and output lengths (seeded log-normal draws)
arrive as a Poisson stream, wait for one of `--max-live` slots, are prefilled,
decode one token per tick, and leave. The same request schedule is replayed
through each allocator ("fixed" chunks, "pow2" growth, "paged" blocks from one
shared pool); after every tick the reserved-but-unused share of the KV bytes of
all live requests is sampled. The table reports its average over ticks, the
number of allocations (buffers for contiguous stores, blocks for paged), the
bytes copied when contiguous buffers grow, the peak reserved bytes of the live
requests together, the peak number of tokens they held, and for the pool the
average number of runs its free blocks form (how scattered free memory is).

    python benchmarks/kv_allocators.py [--requests 400] [--seed 0]

Runs in well under a minute on two CPU cores with the defaults.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from benchmarks._smoke import add_check_imports, check_imports
from remedy.rank.actions.kv_cache import BlockPool, KVCache, KVLayout, combined_fragmentation

# A small real layout: the share of wasted bytes does not depend on the bytes per token,
# and small tensors keep the run short. fp16 as in serving: 512 bytes per token.
LAYOUT = KVLayout(n_layer=2, n_head=4, head_dim=16, dtype=torch.float16)


@dataclass(frozen=True)
class Request:
    arrival: int  # tick at which the request arrives
    prompt: int  # tokens prefilled at once
    output: int  # tokens decoded one per tick


@dataclass
class Result:
    allocator: str
    avg_fragmentation: float
    allocations: int
    copied_bytes: int
    peak_reserved_bytes: int
    peak_tokens: int
    avg_free_runs: float | None
    wall_s: float


def make_requests(n: int, seed: int, rate: float) -> list[Request]:
    """Seeded requests: log-normal lengths (median 256 prompt, 128 output tokens), clipped."""
    rng = random.Random(seed)
    out, tick = [], 0.0
    for _ in range(n):
        tick += rng.expovariate(rate)
        prompt = min(3072, max(8, round(rng.lognormvariate(math.log(256), 1.0))))
        output = min(1024, max(4, round(rng.lognormvariate(math.log(128), 1.0))))
        out.append(Request(int(tick), prompt, output))
    return out


def run(
    allocator: str, requests: list[Request], *, max_live: int, chunk_tokens: int, block_tokens: int
) -> Result:
    """Replay `requests` through `allocator`; sample fragmentation after every tick."""
    longest = max(r.prompt + r.output for r in requests)
    pool = None
    if allocator == "paged":
        pool = BlockPool.for_tokens(LAYOUT, max_live, longest, block_tokens=block_tokens)
    zeros = torch.zeros(1, LAYOUT.n_head, longest, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    one = zeros[:, :, :1]
    pending = list(reversed(requests))
    waiting: list[Request] = []
    live: list[tuple[KVCache, int]] = []  # cache, tokens still to decode
    samples: list[float] = []
    free_runs: list[int] = []
    allocations = copied = peak_reserved = peak_tokens = tick = 0
    start = time.perf_counter()
    while pending or waiting or live:
        while pending and pending[-1].arrival <= tick:
            waiting.append(pending.pop())
        while waiting and len(live) < max_live:
            req = waiting.pop(0)
            cache = KVCache(LAYOUT, 1, allocator, chunk_tokens=chunk_tokens, pool=pool)
            for layer in range(LAYOUT.n_layer):
                cache.append(layer, zeros[:, :, : req.prompt], zeros[:, :, : req.prompt])
            live.append((cache, req.output))
        still: list[tuple[KVCache, int]] = []
        for cache, left in live:
            for layer in range(LAYOUT.n_layer):
                cache.append(layer, one, one)
            if left > 1:
                still.append((cache, left - 1))
            else:
                allocations += cache.allocations
                copied += cache.copied_bytes
                cache.release()
        live = still
        caches = [c for c, _ in live]
        if caches:
            samples.append(combined_fragmentation(caches))
            peak_reserved = max(peak_reserved, sum(c.store.reserved_bytes for c in caches))
            peak_tokens = max(peak_tokens, sum(c.length for c in caches))
            if pool is not None:
                free_runs.append(len(pool.free_runs()))
        tick += 1
    return Result(
        allocator=allocator,
        avg_fragmentation=sum(samples) / len(samples),
        allocations=allocations,
        copied_bytes=copied,
        peak_reserved_bytes=peak_reserved,
        peak_tokens=peak_tokens,
        avg_free_runs=sum(free_runs) / len(free_runs) if free_runs else None,
        wall_s=time.perf_counter() - start,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-live", type=int, default=32, help="concurrent sequences")
    parser.add_argument("--rate", type=float, default=0.25, help="arrivals per decode tick")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="growth of 'fixed'")
    parser.add_argument("--block-tokens", type=int, default=16, help="block size of 'paged'")
    add_check_imports(parser)
    args = parser.parse_args()
    if args.check_imports:
        check_imports()
        return
    # The tensors are tiny; extra threads only add overhead (and contend on a busy machine).
    torch.set_num_threads(1)

    requests = make_requests(args.requests, args.seed, args.rate)
    lengths = sorted(r.prompt + r.output for r in requests)
    print(
        f"{len(requests)} requests (seed {args.seed}), up to {args.max_live} live; "
        f"tokens per request: median {lengths[len(lengths) // 2]}, "
        f"p95 {lengths[int(len(lengths) * 0.95)]}, max {lengths[-1]}; "
        f"{LAYOUT.token_bytes} KV bytes per token"
    )
    labels = {
        "fixed": f"fixed ({args.chunk_tokens}-token chunks)",
        "pow2": "pow2 (power-of-two growth)",
        "paged": f"paged ({args.block_tokens}-token blocks)",
    }
    header = (
        f"{'allocator':<28} {'avg frag %':>10} {'allocations':>11} {'copied':>10} "
        f"{'peak reserved':>14} {'peak tokens':>11} {'free runs':>9} {'wall s':>6}"
    )
    print(header)
    print("-" * len(header))
    for name in ("fixed", "pow2", "paged"):
        r = run(
            name,
            requests,
            max_live=args.max_live,
            chunk_tokens=args.chunk_tokens,
            block_tokens=args.block_tokens,
        )
        runs = "-" if r.avg_free_runs is None else f"{r.avg_free_runs:.1f}"
        print(
            f"{labels[name]:<28} {100 * r.avg_fragmentation:>10.1f} {r.allocations:>11} "
            f"{r.copied_bytes / 2**20:>6.1f} MiB "
            f"{r.peak_reserved_bytes / 2**20:>10.2f} MiB {r.peak_tokens:>11} {runs:>9} "
            f"{r.wall_s:>6.1f}"
        )


if __name__ == "__main__":
    main()
