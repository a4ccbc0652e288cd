"""Tests for workers.kv_cache: allocators, fragmentation measures, switches, generation."""

from __future__ import annotations

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig
from remedy.policies._events import AnomalyEvent
from remedy.rank.actions._kv_allocators import PagedStore
from remedy.rank.actions.kv_cache import (
    BlockPool,
    KVCache,
    KVLayout,
    KVPoolExhaustedError,
    combined_fragmentation,
    generate,
    kv_fragmentation_event,
    migrate,
)

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(60)]

TINY = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=32)
# One layer, one head of size 2, fp32: 1 * 2 (k, v) * 1 * 2 * 4 = 16 bytes per token.
SMALL = KVLayout(n_layer=1, n_head=1, head_dim=2)
# Small chunks and blocks (`chunk_tokens=4, min_tokens=1, block_tokens=4` below) so that
# 16 tokens cross several growth and block boundaries.


@pytest.fixture
def tiny_model() -> GPT:
    """A seeded tiny GPT whose weights are large enough for varied greedy output."""
    torch.manual_seed(0)
    model = GPT(TINY)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.5)
    return model.eval()


@pytest.fixture
def prompts() -> torch.Tensor:
    """A batch of three 4-token prompts."""
    return torch.randint(0, TINY.vocab_size, (3, 4), generator=torch.Generator().manual_seed(1))


def uncached_greedy(model: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding that reruns the full sequence every step (no cache)."""
    with torch.no_grad():
        for _ in range(n):
            idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


def fill(cache: KVCache, tokens: int) -> None:
    """Append `tokens` tokens of recognisable values to every layer, one at a time."""
    lay = cache.layout
    for _ in range(tokens):
        for layer in range(lay.n_layer):
            base = float(cache.length * 10 + layer)
            k = torch.full((cache.batch, lay.n_head, 1, lay.head_dim), base)
            cache.append(layer, k, -k)


def tables(cache: KVCache) -> list[list[int]]:
    """The block table of each sequence of a paged cache."""
    assert isinstance(cache.store, PagedStore)
    return cache.store.tables


@pytest.mark.parametrize("allocator", ["fixed", "pow2", "paged"])
def test_every_allocator_matches_uncached_greedy(
    tiny_model: GPT, prompts: torch.Tensor, allocator: str
) -> None:
    """Cached greedy decoding with each allocator equals uncached full-sequence decoding."""
    expected = uncached_greedy(tiny_model, prompts, 12)
    got = generate(
        tiny_model, prompts, 12, allocator=allocator, chunk_tokens=4, min_tokens=1, block_tokens=4
    )
    assert torch.equal(got, expected)
    assert len(set(expected[:, 4:].flatten().tolist())) > 3  # the output is not degenerate


def test_default_allocator_options_match_uncached_greedy(tiny_model: GPT) -> None:
    """With default chunk and block sizes and a 1-D prompt, the output is the same too."""
    prompt = torch.tensor([1, 2, 3])
    expected = uncached_greedy(tiny_model, prompt[None], 10)[0]
    for allocator in ("fixed", "pow2", "paged"):
        assert torch.equal(generate(tiny_model, prompt, 10, allocator=allocator), expected)


@pytest.mark.parametrize(
    ("start", "to"),
    [
        ("fixed", "paged"),
        ("pow2", "paged"),
        ("paged", "fixed"),
        ("fixed", "pow2"),
        ("paged", "pow2"),
        ("pow2", "fixed"),
    ],
)
def test_switch_mid_generation_keeps_tokens(
    tiny_model: GPT, prompts: torch.Tensor, start: str, to: str
) -> None:
    """Switching allocator after 5 generated tokens leaves every generated token the same."""
    seen: list[str] = []
    expected = uncached_greedy(tiny_model, prompts, 12)
    got = generate(
        tiny_model,
        prompts,
        12,
        allocator=start,
        switch_at=5,
        switch_to=to,
        on_token=lambda n, cache: seen.append(cache.allocator),
        chunk_tokens=4,
        min_tokens=1,
        block_tokens=4,
    )
    assert torch.equal(got, expected)
    assert seen == [start] * 5 + [to] * 7


def test_sampling_is_identical_across_a_switch(tiny_model: GPT, prompts: torch.Tensor) -> None:
    """Seeded sampling gives the same tokens whether or not the allocator is switched."""
    plain, switched = (
        generate(
            tiny_model,
            prompts,
            10,
            greedy=False,
            generator=torch.Generator().manual_seed(7),
            switch_at=switch_at,
            switch_to=switch_to,
            chunk_tokens=4,
            min_tokens=1,
            block_tokens=4,
        )
        for switch_at, switch_to in ((None, None), (3, "paged"))
    )
    assert torch.equal(plain, switched)


def test_fixed_fragmentation_hand_computed() -> None:
    """5 tokens in 4-token chunks reserve 8 slots: 3/8 unused, 2 allocations, 4 tokens copied."""
    cache = KVCache(SMALL, 2, "fixed", chunk_tokens=4)
    fill(cache, 5)
    stats = cache.stats()
    assert (stats.tokens, stats.reserved_tokens, stats.allocations) == (5, 8, 2)
    assert stats.used_bytes == 5 * 2 * 16
    assert stats.reserved_bytes == stats.peak_reserved_bytes == 8 * 2 * 16
    assert cache.fragmentation() == pytest.approx(3 / 8)
    assert stats.copied_bytes == 4 * 2 * 16
    assert stats.free_runs is None


def test_pow2_fragmentation_hand_computed() -> None:
    """Power-of-two capacity goes 1, 2, 4, 8, 16; at 9 tokens 7/16 is unused."""
    cache = KVCache(SMALL, 1, "pow2", min_tokens=1)
    capacities = []
    for _ in range(9):
        fill(cache, 1)
        capacities.append(cache.store.reserved_tokens)
    assert capacities == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert cache.allocations == 5
    assert cache.fragmentation() == pytest.approx(7 / 16)


def test_paged_fragmentation_and_pool_scatter_hand_computed() -> None:
    """Blocks go lowest id first; freeing a middle cache leaves two free runs."""
    pool = BlockPool(SMALL, 8, block_tokens=4)
    a, b, c = (KVCache(SMALL, 1, "paged", pool=pool) for _ in range(3))
    fill(a, 5)
    fill(b, 8)
    fill(c, 1)
    assert [tables(a), tables(b), tables(c)] == [[[0, 1]], [[2, 3]], [[4]]]
    assert [a.fragmentation(), b.fragmentation(), c.fragmentation()] == [3 / 8, 0.0, 3 / 4]
    b.release()
    stats = a.stats()
    assert (stats.free_blocks, stats.free_runs, stats.largest_free_run) == (5, 2, 3)
    assert pool.free_runs() == [2, 3]
    assert combined_fragmentation([a, c]) == pytest.approx((3 + 3) / (8 + 4))
    assert pool.allocations == 5
    assert pool.peak_used_blocks == 5


def test_paged_batch_has_one_block_table_per_sequence() -> None:
    """Each row of a batch gets its own blocks and reads back exactly what it wrote."""
    pool = BlockPool(SMALL, 8, block_tokens=4)
    cache = KVCache(SMALL, 2, "paged", pool=pool)
    k = torch.arange(2 * 5 * 2, dtype=torch.float32).view(2, 1, 5, 2)
    k_all, v_all = cache.update(0, k, k + 100)
    rows = tables(cache)
    assert len(rows) == 2
    assert all(len(t) == 2 for t in rows)
    assert not set(rows[0]) & set(rows[1])
    assert torch.equal(k_all, k)
    assert torch.equal(v_all, k + 100)
    assert cache.stats().allocations == 4


def test_pool_exhaustion_raises_and_keeps_cache_intact() -> None:
    """Asking for more blocks than are free raises and allocates nothing."""
    pool = BlockPool(SMALL, 2, block_tokens=4)
    cache = KVCache(SMALL, 1, "paged", pool=pool)
    fill(cache, 8)
    with pytest.raises(KVPoolExhaustedError, match="num_blocks"):
        fill(cache, 1)
    assert cache.store.reserved_tokens == 8
    assert pool.free_blocks == 0


def test_migrate_moves_tokens_and_frees_the_source() -> None:
    """migrate() returns an equal cache under the new allocator and empties the old one."""
    pool = BlockPool(SMALL, 8, block_tokens=4)
    old = KVCache(SMALL, 2, "paged", pool=pool)
    fill(old, 6)
    before = old.store.read(0, 6)
    new = migrate(old, "pow2")
    assert new.allocator == "pow2"
    assert new.length == 6
    assert old.length == 0
    assert pool.free_blocks == 8
    after = new.store.read(0, 6)
    assert torch.equal(before[0], after[0])
    assert torch.equal(before[1], after[1])
    assert new.switches == 1
    assert new.allocations == 4 + 1  # four blocks, then one pow2 buffer
    assert new.copied_bytes == 6 * 2 * 16  # the held tokens, once


def test_failed_switch_leaves_the_cache_usable() -> None:
    """A switch into a pool too small for the held tokens raises and changes nothing."""
    cache = KVCache(SMALL, 1, "fixed", chunk_tokens=4)
    fill(cache, 6)
    before = cache.store.read(0, 6)[0].clone()
    with pytest.raises(KVPoolExhaustedError):
        cache.switch_allocator("paged", pool=BlockPool(SMALL, 1, block_tokens=4))
    assert cache.allocator == "fixed"
    assert cache.pool is None
    assert torch.equal(cache.store.read(0, 6)[0], before)
    fill(cache, 1)
    assert cache.length == 7


def test_switch_to_paged_without_pool_uses_max_tokens() -> None:
    """A cache built with max_tokens can switch to paged without being handed a pool."""
    cache = KVCache(SMALL, 1, "fixed", chunk_tokens=4, max_tokens=20)
    fill(cache, 5)
    cache.switch_allocator("paged")
    assert cache.allocator == "paged"
    assert isinstance(cache.store, PagedStore)
    assert cache.store.pool.num_blocks == 2
    with pytest.raises(ValueError, match="max_tokens"):
        KVCache(SMALL, 1, "fixed").switch_allocator("paged")


def test_switch_refused_mid_forward() -> None:
    """Switching while layers hold different lengths (mid-forward) raises."""
    layout = KVLayout(n_layer=2, n_head=1, head_dim=2)
    cache = KVCache(layout, 1, "fixed")
    cache.append(0, torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    assert not cache.at_safe_point()
    with pytest.raises(RuntimeError, match="mid-forward"):
        cache.switch_allocator("pow2")


def test_update_rejects_wrong_shape() -> None:
    """k, v whose batch, heads or head size do not match the layout are refused."""
    cache = KVCache(SMALL, 2, "fixed")
    with pytest.raises(ValueError, match="shape"):
        cache.update(0, torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))


def test_kv_fragmentation_event_above_threshold_only() -> None:
    """An event is returned only above the threshold, and it survives the wire format."""
    cache = KVCache(SMALL, 1, "fixed", chunk_tokens=8)
    fill(cache, 3)  # 5/8 unused
    event = kv_fragmentation_event(cache, rank=1, step=40, threshold=0.5, ts=1.0)
    assert event is not None
    assert (event.kind, event.rank, event.step, event.threshold) == ("kv_fragmentation", 1, 40, 0.5)
    assert event.value == pytest.approx(5 / 8)
    assert event.details["allocators"] == ["fixed"]
    assert AnomalyEvent.from_dict(event.to_dict()) == event
    fill(cache, 2)  # 3/8 unused
    assert kv_fragmentation_event(cache, rank=1, step=41, threshold=0.5) is None


def test_kv_fragmentation_event_over_a_pool_reports_scatter() -> None:
    """For several paged caches the event aggregates them and adds the pool's free runs."""
    pool = BlockPool(SMALL, 6, block_tokens=4)
    caches = [KVCache(SMALL, 1, "paged", pool=pool) for _ in range(3)]
    for cache in caches:
        fill(cache, 1)
    caches[1].release()
    event = kv_fragmentation_event(caches, rank=0, step=3, threshold=0.1)
    assert event is not None
    assert event.value == pytest.approx(6 / 8)
    assert (event.details["free_blocks"], event.details["free_runs"]) == (4, 2)


def test_generate_rejects_bad_arguments(tiny_model: GPT, prompts: torch.Tensor) -> None:
    """Too many tokens for the block size, or half a switch, are refused."""
    with pytest.raises(ValueError, match="block_size"):
        generate(tiny_model, prompts, 13)
    with pytest.raises(ValueError, match="together"):
        generate(tiny_model, prompts, 4, switch_at=2)
    with pytest.raises(ValueError, match="switch_at"):
        generate(tiny_model, prompts, 4, switch_at=4, switch_to="paged")
    with pytest.raises(ValueError, match="unknown KV allocator"):
        generate(tiny_model, prompts, 4, allocator="buddy")


def test_generate_restores_training_mode(tiny_model: GPT, prompts: torch.Tensor) -> None:
    """generate() runs in eval mode and puts the model back in the mode it found."""
    tiny_model.train()
    generate(tiny_model, prompts, 2)
    assert tiny_model.training
