"""A supervised target whose every forward is over its memory cap: no policy can relieve it."""

from __future__ import annotations

import torch

from remedy.rank import Guard, GuardConfig


def main() -> None:
    """Two ranks' worth of a tiny MLP whose activations never fit `activation_cap_bytes=1`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)

    def loss_fn(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        loss_fn=loss_fn,
        data=batch,
        max_steps=30,
        config=GuardConfig(checkpoint_every=0, activation_cap_bytes=1, oom_give_up_steps=3),
    )
    for b in guard:
        guard.step(b)
    guard.close()
