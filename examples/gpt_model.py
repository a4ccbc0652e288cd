"""A small GPT-style decoder and the synthetic corpus it learns.

The model is deliberately ordinary (pre-norm blocks, causal self-attention,
tied embeddings) so that what remedy does to it (rollback, LR changes,
activation checkpointing of its `Block`s, KV-cache allocator switches) is
what it would do to a real pretraining model. Attention accepts an optional
KV cache for generation; any object with `update(layer, k, v) -> (k, v)`
works (see `workers.kv_cache`).

The corpus is generated deterministically from a seed: a lexicon of "words"
(fixed token strings) chained by a sparse word-level Markov chain. It has
real structure, so the loss falls far below its starting value of ln(vocab).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F


class KVCacheLike(Protocol):
    """What attention needs from a KV cache during generation."""

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v of shape (batch, heads, new_tokens, head_dim); return the full k, v."""
        ...


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, cache: KVCacheLike | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k, v = cache.update(self.layer, k, v)
            past = k.shape[2] - t
            # New queries see every cached position and the causal part of their own.
            mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=x.device).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    """One pre-norm transformer block; the unit activation checkpointing wraps."""

    def __init__(self, cfg: GPTConfig, layer: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
        )

    def forward(self, x: torch.Tensor, cache: KVCacheLike | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(
        self, idx: torch.Tensor, cache: KVCacheLike | None = None, start_pos: int = 0
    ) -> torch.Tensor:
        """Logits for every position of `idx` (batch, time)."""
        t = idx.shape[1]
        pos = torch.arange(start_pos, start_pos + t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x, cache)
        return self.head(self.ln_f(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a (batch, block_size + 1) token tensor."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def cosine_with_warmup(warmup: int, total: int) -> Callable[[int], float]:
    """The example's LR multiplier: linear warm-up over `warmup` steps, then cosine decay to 10%
    at `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return factor


class SyntheticCorpus:
    """A deterministic token stream with learnable structure, served as indexed batches.

    `batch(i)` is a pure function of (seed, i): any batch can be re-read after
    a rollback, and a skipped batch index is simply never asked for.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 64,
        block_size: int = 64,
        batch_size: int = 16,
        n_words: int = 96,
        successors: int = 3,
        length: int = 400_000,
        seed: int = 0,
    ) -> None:
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        # Token 0 separates words; words are 2-5 tokens drawn from the rest.
        words = [
            torch.randint(
                1, vocab_size, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen
            )
            for _ in range(n_words)
        ]
        nxt = torch.randint(0, n_words, (n_words, successors), generator=gen).tolist()
        # Each word takes one successor draw. Drawn at once they are the same numbers as one by
        # one (the generator's stream), in a tenth of the time: a replacement rank builds this
        # corpus on the critical path of a restart.
        picks = torch.randint(0, successors, (length // 3 + 1,), generator=gen).tolist()
        spelled = [[*w.tolist(), 0] for w in words]  # token 0 separates words
        tokens: list[int] = []
        word = 0
        for pick in picks:
            if len(tokens) >= length:
                break
            tokens.extend(spelled[word])
            word = nxt[word][pick]
        self.tokens = torch.tensor(tokens[:length], dtype=torch.long)

    def batch(self, index: int) -> torch.Tensor:
        """The `index`-th batch: rows of block_size + 1 tokens at seeded offsets."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        starts = torch.randint(
            0, len(self.tokens) - self.block_size - 1, (self.batch_size,), generator=gen
        )
        return torch.stack([self.tokens[s : s + self.block_size + 1] for s in starts.tolist()])

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.batch(index)

    @property
    def entropy_floor(self) -> float:
        """Rough lower bound on the achievable loss in nats (for sanity checks)."""
        return math.log(3) / 4
