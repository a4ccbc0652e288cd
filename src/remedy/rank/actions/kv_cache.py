"""The KV cache used for generation, its allocator switch, and its fragmentation signal.

`KVCache` serves the model's `update(layer, k, v) -> (k_all, v_all)` protocol
for one batch of sequences generated in lockstep (equal lengths). Where the
keys and values live is decided by a pluggable store (`workers._kv_allocators`):
"fixed" chunks, "pow2" growth, or "paged" blocks from a pool that many caches
share; sequences of different lengths are different caches on one pool.

This module also measures what the allocator wastes (`fragmentation()`),
moves live caches to another allocator at a safe point (`switch_allocator`,
`migrate`: the `switch_kv_allocator` action), decodes with the cache
(`generate`), and turns the measure into a `kv_fragmentation` anomaly.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from remedy.policies._events import AnomalyEvent
from remedy.rank.actions._kv_allocators import (
    ALLOCATORS,
    BlockPool,
    KVLayout,
    KVPoolExhaustedError,
    KVStore,
    PagedStore,
    make_store,
)

__all__ = [
    "ALLOCATORS",
    "BlockPool",
    "KVCache",
    "KVCacheStats",
    "KVLayout",
    "KVPoolExhaustedError",
    "combined_fragmentation",
    "generate",
    "kv_fragmentation_event",
    "migrate",
]


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of one cache's memory use; the pool fields are None for contiguous stores."""

    allocator: str
    batch: int
    tokens: int
    reserved_tokens: int
    used_bytes: int
    reserved_bytes: int
    fragmentation: float
    allocations: int
    copied_bytes: int
    peak_reserved_bytes: int
    free_blocks: int | None = None
    free_runs: int | None = None
    largest_free_run: int | None = None


class KVCache:
    """Keys and values of `batch` equal-length sequences, kept by a switchable allocator.

    `max_tokens` (e.g. the model's block size) only sizes a private block pool
    when the cache is switched to "paged" without being given one.
    """

    def __init__(
        self,
        layout: KVLayout,
        batch: int = 1,
        allocator: str | KVStore = "fixed",
        *,
        chunk_tokens: int = 1024,
        min_tokens: int = 16,
        pool: BlockPool | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.layout = layout
        self.batch = batch
        self.chunk_tokens = chunk_tokens
        self.min_tokens = min_tokens
        self.pool = pool
        self.max_tokens = max_tokens
        if isinstance(allocator, KVStore):
            self.store = allocator
        else:
            self.store = self._new_store(allocator, pool)
        self._lengths = [0] * layout.n_layer
        # Counted by stores this cache has since switched away from.
        self._past_allocations = self._past_copied = 0
        self.peak_reserved_bytes = self.store.reserved_bytes
        self.switches = 0

    @property
    def allocator(self) -> str:
        return self.store.name

    @property
    def length(self) -> int:
        """Tokens held per sequence (the furthest layer, if called mid-forward)."""
        return max(self._lengths)

    @property
    def allocations(self) -> int:
        """Allocations over the cache's life: buffers (contiguous) or blocks (paged)."""
        return self._past_allocations + self.store.allocations

    @property
    def copied_bytes(self) -> int:
        """Bytes copied over the cache's life by buffer growth and allocator switches."""
        return self._past_copied + self.store.copied_bytes

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (batch, heads, new_tokens, head_dim) to `layer`; return all of it."""
        self.append(layer, k, v)
        return self.store.read(layer, self._lengths[layer])

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append without reading back (for callers that only account memory)."""
        want = (self.batch, self.layout.n_head, k.shape[2], self.layout.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"k and v must have shape {want}, got {tuple(k.shape)}")
        start = self._lengths[layer]
        self.store.reserve(start + k.shape[2])
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.store.reserved_bytes)
        self.store.write(layer, start, k, v)
        self._lengths[layer] = start + k.shape[2]

    @property
    def used_bytes(self) -> int:
        return self.length * self.batch * self.layout.token_bytes

    def fragmentation(self) -> float:
        """Share of the reserved KV bytes that hold no token (0.0 when nothing is reserved)."""
        reserved = self.store.reserved_bytes
        return (reserved - self.used_bytes) / reserved if reserved else 0.0

    def stats(self) -> KVCacheStats:
        """Current memory use, allocation count and, for paged stores, free-block scatter."""
        free_blocks = free_runs = largest = None
        if isinstance(self.store, PagedStore):
            runs = self.store.pool.free_runs()
            free_blocks, free_runs, largest = sum(runs), len(runs), max(runs, default=0)
        return KVCacheStats(
            allocator=self.allocator,
            batch=self.batch,
            tokens=self.length,
            reserved_tokens=self.store.reserved_tokens,
            used_bytes=self.used_bytes,
            reserved_bytes=self.store.reserved_bytes,
            fragmentation=self.fragmentation(),
            allocations=self.allocations,
            copied_bytes=self.copied_bytes,
            peak_reserved_bytes=self.peak_reserved_bytes,
            free_blocks=free_blocks,
            free_runs=free_runs,
            largest_free_run=largest,
        )

    def at_safe_point(self) -> bool:
        """True between forwards, when every layer holds the same tokens."""
        return len(set(self._lengths)) == 1

    def switch_allocator(self, to: str, *, pool: BlockPool | None = None) -> None:
        """Move the held tokens to allocator `to` in place, bit for bit, at a safe point."""
        if not self.at_safe_point():
            raise RuntimeError(
                f"cannot switch the KV allocator mid-forward (layer lengths {self._lengths}); "
                "switch between generation steps"
            )
        pool = pool or self.pool
        if to == "paged" and pool is None:
            if self.max_tokens is None:
                raise ValueError(
                    "switching to 'paged' needs `pool=` or a cache built with max_tokens"
                )
            pool = BlockPool.for_tokens(self.layout, self.batch, self.max_tokens)
        new = self._new_store(to, pool)
        n = self.length
        new.reserve(n)  # may raise (pool exhausted) before anything has changed
        for layer in range(self.layout.n_layer):
            new.write(layer, 0, *self.store.read(layer, n))
        self._past_allocations += self.store.allocations
        self._past_copied += self.store.copied_bytes + self.used_bytes
        self.store.release()
        self.store, self.pool = new, pool
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, new.reserved_bytes)
        self.switches += 1

    def release(self) -> None:
        """Free the storage (blocks go back to the pool); the cache is empty afterwards."""
        self.store.release()
        self._lengths = [0] * self.layout.n_layer

    def _new_store(self, name: str, pool: BlockPool | None) -> KVStore:
        return make_store(
            name,
            self.layout,
            self.batch,
            chunk_tokens=self.chunk_tokens,
            min_tokens=self.min_tokens,
            pool=pool,
        )


def migrate(cache: KVCache, to: str, *, pool: BlockPool | None = None) -> KVCache:
    """A new cache holding `cache`'s tokens under allocator `to`; `cache` is left empty."""
    new = copy.copy(cache)
    new._lengths = list(cache._lengths)
    new.switch_allocator(to, pool=pool)
    # The old store was released by the switch; what remains is a valid empty cache.
    cache._lengths = [0] * cache.layout.n_layer
    return new


def combined_fragmentation(caches: Sequence[KVCache]) -> float:
    """Reserved-but-unused share of the KV bytes of several caches together."""
    reserved = sum(c.store.reserved_bytes for c in caches)
    used = sum(c.used_bytes for c in caches)
    return (reserved - used) / reserved if reserved else 0.0


def kv_fragmentation_event(
    cache: KVCache | Sequence[KVCache],
    *,
    rank: int,
    step: int,
    threshold: float = 0.5,
    ts: float | None = None,
) -> AnomalyEvent | None:
    """A `kv_fragmentation` event when the wasted share of KV bytes exceeds `threshold`."""
    caches = [cache] if isinstance(cache, KVCache) else list(cache)
    value = combined_fragmentation(caches)
    if value <= threshold:
        return None
    details: dict[str, object] = {
        "allocators": sorted({c.allocator for c in caches}),
        "caches": len(caches),
        "reserved_bytes": sum(c.store.reserved_bytes for c in caches),
        "used_bytes": sum(c.used_bytes for c in caches),
        "allocations": sum(c.allocations for c in caches),
    }
    pools = {id(c.store.pool): c.store.pool for c in caches if isinstance(c.store, PagedStore)}
    if pools:
        runs = [r for p in pools.values() for r in p.free_runs()]
        details.update(free_blocks=sum(runs), free_runs=len(runs))
    return AnomalyEvent(
        kind="kv_fragmentation",
        rank=rank,
        step=step,
        value=value,
        threshold=threshold,
        ts=time.time() if ts is None else ts,
        details=details,
    )


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    allocator: str = "fixed",
    greedy: bool = True,
    switch_at: int | None = None,
    switch_to: str | None = None,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    pool: BlockPool | None = None,
    chunk_tokens: int = 1024,
    min_tokens: int = 16,
    block_tokens: int = 16,
    on_token: Callable[[int, KVCache], None] | None = None,
) -> torch.Tensor:
    """Decode `max_new_tokens` after `prompt_ids` ((time,) or (batch, time)) with a KV cache.

    With `switch_at=n, switch_to=name` the cache moves to allocator `name` once
    n tokens have been generated; the output does not change. `on_token(n,
    cache)` is called after each generated token (to measure the cache).
    Returns the prompt followed by the generated tokens, in the prompt's shape.
    """
    if (switch_at is None) != (switch_to is None):
        raise ValueError("pass switch_at and switch_to together")
    if switch_at is not None and not 0 <= switch_at < max_new_tokens:
        raise ValueError(f"switch_at must be in [0, {max_new_tokens}), got {switch_at}")
    idx = prompt_ids if prompt_ids.dim() == 2 else prompt_ids[None]
    batch, total = idx.shape[0], idx.shape[1] + max_new_tokens
    block_size = getattr(getattr(model, "cfg", None), "block_size", None)
    if block_size is not None and total > block_size:
        raise ValueError(f"prompt + max_new_tokens = {total} exceeds block_size {block_size}")
    layout = KVLayout.for_model(model)
    if pool is None and "paged" in (allocator, switch_to):
        pool = BlockPool.for_tokens(layout, batch, total, block_tokens=block_tokens)
    cache = KVCache(
        layout, batch, allocator, chunk_tokens=chunk_tokens, min_tokens=min_tokens,
        pool=pool, max_tokens=total,
    )  # fmt: skip
    was_training = model.training
    model.eval()
    try:
        out, step_in, pos = idx, idx, 0
        for n in range(max_new_tokens):
            if n == switch_at and switch_to is not None:
                cache.switch_allocator(switch_to)
            logits = model(step_in, cache=cache, start_pos=pos)[:, -1]
            pos += step_in.shape[1]
            if greedy:
                step_in = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                step_in = torch.multinomial(probs, 1, generator=generator)
            out = torch.cat([out, step_in], dim=1)
            if on_token is not None:
                on_token(n + 1, cache)
    finally:
        model.train(was_training)
        cache.release()
    return out if prompt_ids.dim() == 2 else out[0]
