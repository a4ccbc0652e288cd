"""The example's synthetic corpus: the same tokens as drawing each word's successor one call at a
time (how it was built until the picks were drawn at once, 20x faster)."""

from __future__ import annotations

import pytest
import torch

from examples.gpt_model import SyntheticCorpus


def _one_by_one(
    *, vocab_size: int, n_words: int, successors: int, length: int, seed: int
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    words = [
        torch.randint(
            1, vocab_size, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen
        )
        for _ in range(n_words)
    ]
    nxt = torch.randint(0, n_words, (n_words, successors), generator=gen)
    pieces, total, word = [], 0, 0
    sep = torch.zeros(1, dtype=torch.long)
    while total < length:
        pieces.extend((words[word], sep))
        total += len(words[word]) + 1
        word = int(nxt[word, int(torch.randint(0, successors, (1,), generator=gen))])
    return torch.cat(pieces)[:length]


@pytest.mark.parametrize(
    ("n_words", "successors", "length", "seed"),
    [(96, 3, 60_000, 0), (96, 3, 10_007, 3), (50, 2, 30_000, 1), (5, 1, 999, 9)],
)
def test_the_corpus_is_the_one_drawn_word_by_word(
    n_words: int, successors: int, length: int, seed: int
) -> None:
    corpus = SyntheticCorpus(n_words=n_words, successors=successors, length=length, seed=seed)
    expected = _one_by_one(
        vocab_size=64, n_words=n_words, successors=successors, length=length, seed=seed
    )
    assert corpus.tokens.dtype == torch.long
    assert torch.equal(corpus.tokens, expected)
