"""A ModelSpec from a model object, without importing torch.

Anything with ``named_parameters()`` yielding (name, tensor-like with ``.shape``) will do.
A Hugging Face model carries its ``config``, which says everything; a plain module says its
shapes: the token embedding gives vocabulary and width, the numbered blocks the depth, and
the remaining choices (family, ffn width, kv heads, head dim, biases, tied head, learned positions) are
those whose parameter count equals the module's, block by block and in total, exactly.
"""

from __future__ import annotations

import itertools
import math
import re

from .errors import MemplanError
from .finetune import _linears
from .hfconfig import model_from_hf_config
from .specs import ModelSpec

_BLOCK = re.compile(r"(?:^|\.)(\d+)\.")


def _shapes(module) -> list[tuple[str, tuple[int, ...]]]:
    try:
        return [(name, tuple(int(d) for d in p.shape)) for name, p in module.named_parameters()]
    except (AttributeError, TypeError):
        raise MemplanError(f"{type(module).__name__} has no named_parameters() yielding shaped tensors") from None


def _count(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _from_config(module, total: int) -> ModelSpec | None:
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    spec = model_from_hf_config(config.to_dict())
    if spec.num_params != total:
        raise MemplanError(
            f"{type(module).__name__}'s config describes {spec.num_params:,} parameters but the "
            f"module holds {total:,}: a layer its config does not describe (adapters, extra heads?)"
        )
    return spec


def _candidates(h: int, vocab: int, layers: int, heads: int, block: list, root: list, arch: str | None):
    dims = sorted({d for _, shape in block for d in shape if d != h})
    positions = [0] + [s[0] for n, s in root if len(s) == 2 and s[1] == h and s[0] != vocab]
    archs = [arch] if arch else ["llama", "gpt2", "neox"]
    kv_heads = [k for k in range(1, heads + 1) if heads % k == 0]
    # a llama q_proj of heads·head_dim rows apart from h: each width the block holds that the heads divide
    head_dims = [0] + [d // heads for d in dims if d % heads == 0]
    for family, ffn, kv, head_dim, pos, tied, bias, qkv_bias in itertools.product(
        archs, dims or [4 * h], kv_heads, head_dims, positions, (True, False), (False, True), (False, True)
    ):
        if (family == "llama") == bias or (family == "gpt2") != (pos > 0) or (head_dim and family != "llama"):
            continue
        try:
            yield ModelSpec(
                name="module",
                arch=family,
                num_layers=layers,
                hidden=h,
                num_heads=heads,
                num_kv_heads=kv if family == "llama" else heads,
                head_dim=head_dim,
                ffn_hidden=ffn,
                vocab_size=vocab,
                tied_embeddings=tied,
                linear_bias=bias,
                qkv_bias=qkv_bias and not bias,
                max_positions=pos,
            )
        except MemplanError:
            continue


def _matrices(spec: ModelSpec) -> list[int]:
    """The sizes of one block's weight matrices (an ffn width and a head dim may trade counts)."""
    return sorted(n_in * n_out for n_in, n_out in _linears(spec).values())


def spec_from_module(
    module,
    *,
    num_heads: int | None = None,
    arch: str | None = None,
    name: str | None = None,
    dropout: float | None = None,
) -> ModelSpec:
    """The ModelSpec whose parameters are exactly the module's (an error says what is not
    understood). Shapes cannot tell dropout: give ``dropout=`` for a module without a config."""
    shapes = _shapes(module)
    total = sum(_count(s) for _, s in shapes)
    spec = _from_config(module, total)
    if spec is None:
        spec = _from_shapes(shapes, total, num_heads=num_heads, arch=arch)
    changes = {k: v for k, v in (("name", name), ("dropout", dropout)) if v is not None}
    return ModelSpec(**{**spec.__dict__, **changes}) if changes else spec


def _from_shapes(shapes, total: int, *, num_heads: int | None, arch: str | None) -> ModelSpec:
    blocks: dict[int, list] = {}
    root: list = []
    for param_name, shape in shapes:
        match = _BLOCK.search(param_name)
        (blocks.setdefault(int(match.group(1)), []) if match else root).append((param_name, shape))
    matrices = [(n, s) for n, s in root if len(s) == 2]
    if not blocks or not matrices:
        raise MemplanError(
            "the module has no numbered blocks (layers.0., h.0., ...) and an embedding matrix: "
            "not a transformer memplan can read from its shapes; pass its config or a ModelSpec"
        )
    if num_heads is None:
        raise MemplanError("from a module without a config, give num_heads= (shapes do not tell the head count)")
    vocab, h = max((s for _, s in matrices), key=lambda s: s[0])
    block = blocks[min(blocks)]
    block_total = sum(_count(s) for _, s in block)
    matrices_of_block = sorted(_count(s) for _, s in block if len(s) == 2)
    for spec in _candidates(h, vocab, len(blocks), num_heads, block, root, arch):
        if spec.block_params() == block_total and spec.num_params == total and _matrices(spec) == matrices_of_block:
            return spec
    listed = ", ".join(f"{n} {list(s)}" for n, s in block)
    raise MemplanError(
        f"no llama/gpt2/neox block of width {h} with {num_heads} heads has these {block_total:,} "
        f"parameters per block ({listed}) and {total:,} in all; pass arch= or a ModelSpec"
    )
