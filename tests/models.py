"""Small models shared by the tests; every rank builds the same one from a seed."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipe import SequentialModel


def mlp(num_layers: int = 8, width: int = 6, seed: int = 0, dtype=torch.float64) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for i in range(num_layers):
        layers.append(nn.Linear(width, width))
        layers.append(nn.Tanh())
    return nn.Sequential(*layers).to(dtype)


class ScaleByIndex(nn.Module):
    """Takes (x, index) and returns (x * weight[index], index): an int tensor passes through."""

    def __init__(self, width: int, vocab: int = 5) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.weight = nn.Embedding(vocab, width)

    def forward(self, x, index):
        return torch.tanh(self.linear(x)) * self.weight(index), index


class Split(nn.Module):
    """One input, two outputs (x, index) where index is derived as an int tensor."""

    def forward(self, x):
        return x, (x[:, 0] > 0).long()


class Merge(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.out = nn.Linear(width, 3)

    def forward(self, x, index):
        return self.out(x) + index.unsqueeze(1).to(x.dtype)


def multi_io(width: int = 6, seed: int = 0, dtype=torch.float64) -> SequentialModel:
    torch.manual_seed(seed)
    return SequentialModel(Split(), ScaleByIndex(width), ScaleByIndex(width), ScaleByIndex(width), Merge(width)).to(dtype)
