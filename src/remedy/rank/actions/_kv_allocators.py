"""Where a KV cache keeps its keys and values: the allocator strategies.

A store holds the keys and values of one batch of sequences that all have the
same length, for every layer. Three strategies:

- `FixedChunkStore` ("fixed"): one contiguous buffer per cache, grown in
  fixed chunks of tokens (1024 by default), copying on growth.
- `Pow2Store` ("pow2"): one contiguous buffer, capacity grown to the next
  power of two, copying on growth.
- `PagedStore` ("paged"): fixed-size blocks of tokens taken from a
  preallocated `BlockPool` shared by many caches, with a block table per
  sequence, as paged attention does. Nothing is copied on growth, and a
  sequence wastes at most one partly filled block.

The reserved-but-unused share of a store is what `KVCache.fragmentation()`
reports; the pool additionally reports how scattered its free blocks are.
"""

from __future__ import annotations

import functools
import heapq
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

ALLOCATORS: tuple[str, ...] = ("fixed", "pow2", "paged")


class KVPoolExhaustedError(RuntimeError):
    """The block pool has fewer free blocks than a sequence needs."""


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's keys and values: layers, heads, head size, dtype, device."""

    n_layer: int
    n_head: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"

    @functools.cached_property
    def token_bytes(self) -> int:
        """Bytes that one token of one sequence occupies (keys and values, every layer)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.n_layer * 2 * self.n_head * self.head_dim * elem

    @classmethod
    def for_model(cls, model: nn.Module) -> KVLayout:
        """The layout of a model with a GPT-style `cfg` (n_layer, n_head, n_embd)."""
        cfg = getattr(model, "cfg", None)
        if cfg is None:
            raise ValueError("model has no `cfg`; pass an explicit KVLayout")
        param = next(model.parameters())
        return cls(cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, param.dtype, param.device)


class KVStore(ABC):
    """Storage for the keys and values of `batch` equal-length sequences."""

    name: str = ""

    def __init__(self, layout: KVLayout, batch: int) -> None:
        self.layout = layout
        self.batch = batch
        self.allocations = 0  # buffers (contiguous) or blocks (paged) handed to this store
        self.copied_bytes = 0  # moved when a contiguous buffer grows; paged never copies

    @property
    @abstractmethod
    def reserved_tokens(self) -> int:
        """Token slots reserved per sequence."""

    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved for the whole batch."""
        return self.reserved_tokens * self.batch * self.layout.token_bytes

    @abstractmethod
    def reserve(self, tokens: int) -> None:
        """Make room for at least `tokens` tokens per sequence."""

    @abstractmethod
    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (batch, heads, t, head_dim) at positions start..start+t of `layer`."""

    @abstractmethod
    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of `layer` as (batch, heads, length, head_dim)."""

    @abstractmethod
    def release(self) -> None:
        """Give the storage back; the store is empty afterwards."""


class ContiguousStore(KVStore):
    """One buffer (layers, k/v, batch, heads, capacity, head_dim), copied when it grows."""

    def __init__(self, layout: KVLayout, batch: int) -> None:
        super().__init__(layout, batch)
        self._buf: torch.Tensor | None = None

    @abstractmethod
    def capacity_for(self, tokens: int) -> int:
        """The capacity this strategy reserves to hold `tokens` tokens."""

    @property
    def reserved_tokens(self) -> int:
        return 0 if self._buf is None else self._buf.shape[4]

    def reserve(self, tokens: int) -> None:
        if tokens <= self.reserved_tokens:
            return
        lay = self.layout
        cap = self.capacity_for(tokens)
        shape = (lay.n_layer, 2, self.batch, lay.n_head, cap, lay.head_dim)
        # Slots past the length are never read, so they need not be zeroed.
        buf = torch.empty(shape, dtype=lay.dtype, device=lay.device)
        if self._buf is not None:
            buf.narrow(4, 0, self._buf.shape[4]).copy_(self._buf)
            self.copied_bytes += self._buf.nbytes
        self._buf = buf
        self.allocations += 1

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self._buf is not None, "reserve() before write()"
        kv = self._buf[layer]
        kv[0].narrow(2, start, k.shape[2]).copy_(k)
        kv[1].narrow(2, start, v.shape[2]).copy_(v)

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._buf is not None, "reserve() before read()"
        kv = self._buf[layer]
        return kv[0].narrow(2, 0, length), kv[1].narrow(2, 0, length)

    def release(self) -> None:
        self._buf = None


class FixedChunkStore(ContiguousStore):
    """Grows in whole chunks of `chunk_tokens` tokens."""

    name = "fixed"

    def __init__(self, layout: KVLayout, batch: int, *, chunk_tokens: int = 1024) -> None:
        super().__init__(layout, batch)
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens

    def capacity_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.chunk_tokens) * self.chunk_tokens


class Pow2Store(ContiguousStore):
    """Grows to the next power of two, starting at `min_tokens`."""

    name = "pow2"

    def __init__(self, layout: KVLayout, batch: int, *, min_tokens: int = 16) -> None:
        super().__init__(layout, batch)
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be at least 1, got {min_tokens}")
        self.min_tokens = min_tokens

    def capacity_for(self, tokens: int) -> int:
        return max(self.min_tokens, 1 << max(tokens - 1, 0).bit_length())


class BlockPool:
    """A preallocated pool of fixed-size token blocks shared by many paged caches.

    One block id covers the same token positions in every layer (keys and
    values). Free blocks are handed out lowest id first, so the free list's
    scatter after requests come and go is reproducible.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, *, block_tokens: int = 16) -> None:
        if num_blocks < 1 or block_tokens < 1:
            raise ValueError("num_blocks and block_tokens must be at least 1")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        shape = (layout.n_layer, 2, num_blocks * block_tokens, layout.n_head, layout.head_dim)
        # Flat slots per layer (slot = block * block_tokens + offset): paged attention's slot map.
        self.storage = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        self._free = list(range(num_blocks))
        # Mirrors `_free` so that counting free runs is one vectorised pass, cheap enough per step.
        self._is_free = torch.ones(num_blocks, dtype=torch.bool)
        self.allocations = 0
        self.peak_used_blocks = 0

    @classmethod
    def for_tokens(
        cls, layout: KVLayout, sequences: int, tokens: int, *, block_tokens: int = 16
    ) -> BlockPool:
        """A pool just big enough for `sequences` sequences of `tokens` tokens each."""
        return cls(layout, sequences * math.ceil(tokens / block_tokens), block_tokens=block_tokens)

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.layout.token_bytes

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks; raise `KVPoolExhaustedError` if there are not enough."""
        if n > len(self._free):
            raise KVPoolExhaustedError(
                f"KV block pool exhausted: need {n} blocks, {len(self._free)} of "
                f"{self.num_blocks} free; build the pool with a larger `num_blocks`"
            )
        blocks = [heapq.heappop(self._free) for _ in range(n)]
        self._is_free[blocks] = False
        self.allocations += n
        self.peak_used_blocks = max(self.peak_used_blocks, self.used_blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool."""
        for b in blocks:
            heapq.heappush(self._free, b)
        self._is_free[blocks] = True

    def free_runs(self) -> list[int]:
        """Lengths of the runs of consecutive free block ids (many short runs = scattered)."""
        edges = torch.zeros(self.num_blocks + 2, dtype=torch.int8)
        edges[1:-1] = self._is_free.to(torch.int8)
        step = edges.diff()
        starts, ends = (step == 1).nonzero(), (step == -1).nonzero()
        return (ends - starts).flatten().tolist()


class PagedStore(KVStore):
    """Blocks from a shared `BlockPool`, one block table per sequence."""

    name = "paged"

    def __init__(self, layout: KVLayout, batch: int, *, pool: BlockPool) -> None:
        super().__init__(layout, batch)
        if pool.layout != layout:
            raise ValueError(f"pool layout {pool.layout} does not match cache layout {layout}")
        self.pool = pool
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        self._slots = torch.empty(batch, 0, dtype=torch.long, device=layout.device)

    @property
    def reserved_tokens(self) -> int:
        return len(self.tables[0]) * self.pool.block_tokens

    def reserve(self, tokens: int) -> None:
        need = math.ceil(tokens / self.pool.block_tokens) - len(self.tables[0])
        if need <= 0:
            return
        new = self.pool.allocate(need * self.batch)  # all or nothing, so rows stay equal
        for row, table in enumerate(self.tables):
            table.extend(new[row * need : (row + 1) * need])
        self.allocations += need * self.batch
        bt = self.pool.block_tokens
        ids = torch.tensor(self.tables, dtype=torch.long, device=self.layout.device)
        offsets = torch.arange(bt, device=self.layout.device)
        self._slots = (ids[:, :, None] * bt + offsets).reshape(self.batch, -1)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self._slots[:, start : start + k.shape[2]].reshape(-1)
        # (batch, heads, t, dim) -> one row of (heads, dim) per slot, batch-major like `slots`.
        heads, dim = self.layout.n_head, self.layout.head_dim
        storage = self.pool.storage
        storage[layer, 0].index_copy_(0, slots, k.transpose(1, 2).reshape(-1, heads, dim))
        storage[layer, 1].index_copy_(0, slots, v.transpose(1, 2).reshape(-1, heads, dim))

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self._slots[:, :length]
        return (
            self.pool.storage[layer, 0][slots].transpose(1, 2),
            self.pool.storage[layer, 1][slots].transpose(1, 2),
        )

    def release(self) -> None:
        for table in self.tables:
            self.pool.free(table)
        self.tables = [[] for _ in range(self.batch)]
        self._slots = self._slots[:, :0]


def make_store(
    name: str,
    layout: KVLayout,
    batch: int,
    *,
    chunk_tokens: int = 1024,
    min_tokens: int = 16,
    pool: BlockPool | None = None,
) -> KVStore:
    """Build the store for allocator `name` ("fixed", "pow2" or "paged")."""
    if name == "fixed":
        return FixedChunkStore(layout, batch, chunk_tokens=chunk_tokens)
    if name == "pow2":
        return Pow2Store(layout, batch, min_tokens=min_tokens)
    if name == "paged":
        if pool is None:
            raise ValueError("the paged allocator needs a BlockPool: pass `pool=`")
        return PagedStore(layout, batch, pool=pool)
    raise ValueError(f"unknown KV allocator {name!r}; choose one of {', '.join(ALLOCATORS)}")
