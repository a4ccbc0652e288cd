"""Every RNG a step draws from is captured and restored exactly; numpy's only when it moved."""

from __future__ import annotations

import random

import numpy as np
import torch

from remedy.rank.state.rng import capture_rng, restore_rng


def draws() -> tuple[float, float, float, float]:
    return (
        torch.rand(1).item(),
        random.random(),
        float(np.random.rand()),
        float(np.random.randn()),
    )


def test_a_restore_gives_the_same_draws_from_every_generator() -> None:
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    state = capture_rng()
    first = draws()
    draws()
    restore_rng(state)
    assert draws() == first


def test_numpys_state_is_captured_again_only_when_its_generator_moved() -> None:
    np.random.seed(5)
    a, b = capture_rng(), capture_rng()
    assert a["numpy"] is b["numpy"]  # unmoved: the previous capture, not a new copy
    torch.rand(1), random.random()  # other generators moving does not matter to numpy's
    assert capture_rng()["numpy"] is a["numpy"]
    np.random.rand()
    c = capture_rng()
    assert c["numpy"] is not a["numpy"]
    restore_rng(a)
    assert capture_rng()["numpy"][2] == a["numpy"][2]


def test_a_cached_gaussian_drawn_without_moving_the_words_is_still_captured() -> None:
    """numpy's legacy generator draws Gaussians in pairs and caches the second: drawing it moves
    none of the raw words the fast path compares, so a capture holding a cached value is always
    taken again."""
    np.random.seed(7)
    np.random.randn()  # draws a pair, caches the second
    held = capture_rng()
    assert held["numpy"][3] == 1
    cached = float(np.random.randn())  # the cached value: the raw words do not move
    after = capture_rng()
    assert after["numpy"] is not held["numpy"]
    assert after["numpy"][3] == 0
    restore_rng(held)
    assert float(np.random.randn()) == cached
    restore_rng(after)
    assert float(np.random.randn()) != cached
