"""A ``--module`` factory whose input is not token ids: ``example_input(batch, seq)`` makes it
(keyword arguments of the forward); no nn.ModuleList, so DDP only."""

import torch
from torch import nn

FEATURES = 16


def build():
    return nn.Sequential(nn.Linear(FEATURES, 4 * FEATURES), nn.GELU(), nn.Linear(4 * FEATURES, 1))


def example_input(batch, seq):
    return {"input": torch.randn(batch, seq, FEATURES)}
