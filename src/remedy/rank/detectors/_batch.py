"""Finding the token ids (and the attention mask) in a user's batch.

Batches come as a token tensor, a tuple or list whose first integer tensor
holds the ids, or a mapping (`input_ids`, `attention_mask`, as Hugging Face
collators build them). Detectors that look at batches accept a `tokens_fn`
for anything else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

TokensFn = Callable[[Any], "torch.Tensor | None"]


def _is_ids(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex()


def default_tokens(batch: Any) -> torch.Tensor | None:
    """The (rows, tokens) id tensor of a batch, or None when there is none to find."""
    found: Any = None
    if _is_ids(batch):
        found = batch
    elif isinstance(batch, Mapping):
        found = batch.get("input_ids")
        if not _is_ids(found):
            found = next((v for v in batch.values() if _is_ids(v)), None)
    elif isinstance(batch, tuple | list):
        found = next((v for v in batch if _is_ids(v)), None)
    if found is None or found.dtype == torch.bool:
        return None
    return found if found.dim() >= 2 else found.reshape(1, -1)


def attention_mask(batch: Any, key: str | None) -> torch.Tensor | None:
    """The batch's attention mask under `key` (1 = real token), if it is a mapping that has one."""
    if key is None or not isinstance(batch, Mapping):
        return None
    mask = batch.get(key)
    return mask if isinstance(mask, torch.Tensor) else None
