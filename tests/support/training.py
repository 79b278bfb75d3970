"""What tests of training steps share: a plain reference step, a model no graph can replay, a HuggingFace-style one."""

from __future__ import annotations

import torch
from torch import nn


def reference_step(model, loss_fn, optimizer, x, y):
    """The training step written out here, not the library's: what every faster step is checked against."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


class Branchy(nn.Module):
    """Data-dependent control flow: no graph can replay it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(x) if x.mean() > 0 else -self.fc(x)


def branchy_batch(g: torch.Generator):
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


class TinyHF(nn.Module):
    """HuggingFace-style: keyword forward with ``labels=None``, a dict output with ``loss`` and ``logits``."""

    def __init__(self, vocab: int = 20, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, classes)

    def forward(self, input_ids, attention_mask, labels=None):
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        logits = self.head(pooled)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out
