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


# -- skip connections and BatchNorm ------------------------------------------------------------
from lightning_pipe.skip import Namespace, pop, skippable, stash  # noqa: E402


@skippable(stash=["skip"])
class Down(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        y = torch.tanh(self.linear(x))
        yield stash("skip", y)
        return y


@skippable(pop=["skip"])
class Up(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        skip = yield pop("skip")
        return torch.tanh(self.linear(x)) + skip


@skippable(stash=["mask"], pop=[])
class MaskStash(nn.Module):
    """Stashes a tensor that does not require grad (a mask) next to the activations."""

    def forward(self, x):
        yield stash("mask", (x > 0).to(x.dtype))
        return x


@skippable(pop=["mask"])
class MaskPop(nn.Module):
    def forward(self, x):
        mask = yield pop("mask")
        return x * (1 + mask)


def unet(width: int = 6, seed: int = 0, dtype=torch.float64) -> nn.Sequential:
    """Down1 Down2 Mid MaskStash Mid MaskPop Up2 Up1: skips reuse one name in two namespaces."""
    torch.manual_seed(seed)
    outer, inner = Namespace(), Namespace()
    return nn.Sequential(
        Down(width).isolate(outer), Down(width).isolate(inner), nn.Linear(width, width), MaskStash(),
        nn.Linear(width, width), MaskPop(), Up(width).isolate(inner), Up(width).isolate(outer),
    ).to(dtype)


class ResidualBN(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x):
        return torch.relu(self.bn(self.linear(x)) + x)


def resnet(width: int = 6, depth: int = 4, seed: int = 0, dtype=torch.float64) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[ResidualBN(width) for _ in range(depth)], nn.Linear(width, 6)).to(dtype)


def regression_data(num_samples: int) -> torch.utils.data.TensorDataset:
    """The data of the test apps trained under DDP and PipeStrategy: 4 features from a fixed generator, the
    target the tanh of their sum (the same on every rank, whatever was drawn before)."""
    x = torch.randn(num_samples, 4, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.TensorDataset(x, x.sum(1).tanh())
