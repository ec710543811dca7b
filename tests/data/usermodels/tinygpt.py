"""A small GPT written here, not a transformers model: the ``--module`` factory of the trace
tests (``memplan calibrate run --mode trace --module tinygpt:build``, run from this folder)."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, BLOCKS = 128, 64, 4, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, WIDTH))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build():
    return TinyGPT()


def train_step(model, batch, optimizer):
    """A user's own step: next-token cross-entropy, backward, optimizer step."""
    (ids,), _ = batch
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def not_a_module():
    return torch.zeros(1)


def flat():
    """No nn.ModuleList: nothing to shard as FSDP2 units."""
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB))


def no_input():
    """No nn.Embedding and no example_input here: no input can be made for it."""
    return nn.Linear(WIDTH, WIDTH)
