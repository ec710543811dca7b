"""A ``--module`` factory returning transformers' LlamaForCausalLM from a config (random weights):
the trace of it is compared with the ``--config`` trace of the same config."""

from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def build():
    config = LlamaConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)
