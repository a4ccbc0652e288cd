"""The state of every RNG a training step may draw from: captured at every step boundary.

A rank captures it before each step (`actions.replay.Replays.mark`: a
survivor that loses a step to a failed collective trains it again from
there) and in every snapshot, so its cost is on the per-step path.
numpy's `get_state` is most of that cost: it copies the Mersenne Twister's
624 words into a new array and builds a tuple around it. Most loops never
draw from numpy's global generator inside a step, so its raw state (the
2,500 bytes `MT19937.ctypes.state_address` points at, read in one
`memcpy`) is compared with the raw state of the last full capture, and
that capture is given again while they are equal.

The raw words and position are not the whole legacy state: `RandomState`
also caches the second value of a Gaussian pair (`has_gauss`, `gauss`)
outside them, and drawing that cached value moves no word. A capture that
held a cached Gaussian is therefore never given again; without one, the
cache can only fill by drawing, which moves the words.
"""

from __future__ import annotations

import ctypes
import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
    np = None  # type: ignore[assignment]

# mt19937_state: uint32_t key[624]; int pos.
_MT_BYTES = 624 * 4 + 4


class _NumpyCapture:
    """numpy's global generator's state, captured again only when its raw state moved."""

    def __init__(self) -> None:
        self._generator: Any = None
        self._address = 0
        self._raw = b""
        self._state: Any = None

    def __call__(self) -> Any:
        assert np is not None
        generator = np.random.mtrand._rand._bit_generator
        if generator is not self._generator:  # numpy's global generator was replaced
            self._generator, self._raw, self._state = generator, b"", None
            self._address = int(generator.ctypes.state_address) if _is_mt(generator) else 0
        if not self._address:
            return np.random.get_state()
        raw = ctypes.string_at(self._address, _MT_BYTES)
        if raw == self._raw and self._state is not None and not self._state[3]:
            return self._state  # unmoved, and no cached Gaussian that could have been drawn
        self._raw, self._state = raw, np.random.get_state()
        return self._state


def _is_mt(generator: Any) -> bool:
    return type(generator).__name__ == "MT19937"


_numpy = _NumpyCapture()


def capture_rng() -> dict[str, Any]:
    """The state of every RNG a training step may draw from.

    numpy's state is the very object of the previous capture while that
    generator has not moved: treat the captured states as read-only.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        state["numpy"] = _numpy()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put every RNG back to `state` (a `capture_rng`)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])
