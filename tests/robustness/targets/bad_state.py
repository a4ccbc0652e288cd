"""A training function whose Guard is given a state without state_dict (a configuration error)."""

from __future__ import annotations

import torch

from remedy import Guard


def main() -> None:
    """Give `state=` an object the Guard cannot keep."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [torch.zeros(1, 2)]
    guard = Guard(model, opt, loss_fn=lambda m, b: m(b).sum(), data=data, state={"x": object()})
    for batch in guard:
        guard.step(batch)
