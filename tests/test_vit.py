"""Issue 11, bug 4: a ViT is modelled as an image classifier, not as a causal LM."""

import pytest

from memplan.activations import loss_saved, model_saved
from memplan.catalog import model_preset
from memplan.errors import MemplanError
from memplan.memory import estimate
from memplan.specs import Job, ModelSpec, TrainSpec
from memplan.throughput import flops_per_token

VIT_L = model_preset("vit-large-patch16-224")


def test_vit_job_takes_its_token_count_whatever_the_default_seq_len():
    job = Job(model=VIT_L, train=TrainSpec(micro_batch=8))
    # 224-pixel images in 16-pixel patches: 14² patches + the class token
    assert job.train.seq_len == (224 // 16) ** 2 + 1 == VIT_L.max_positions
    assert job.train.tokens_per_micro_batch == 8 * VIT_L.max_positions


def test_vit_refuses_a_seq_len_that_is_not_its_token_count():
    refusal = r"seq-len 512 does not apply to vit-large-patch16-224 \(vit\): .*197 tokens \(196 patches"
    with pytest.raises(MemplanError, match=refusal):
        Job(model=VIT_L, train=TrainSpec(seq_len=512))


def test_vit_needs_a_square_patch_grid_plus_the_class_token():
    with pytest.raises(MemplanError, match=r"vit max_positions must be its patch count \+ 1 .* got 0"):
        ModelSpec(arch="vit", num_layers=1, hidden=64, num_heads=4, ffn_hidden=128, vocab_size=10)


def test_vit_head_and_loss_scale_with_rows_not_tokens():
    train = TrainSpec(micro_batch=4, precision="fp32")
    b, V = train.micro_batch, VIT_L.vocab_size
    _, post = model_saved(VIT_L, train)
    logits = [s for s in post if s.name.startswith("logits")]
    assert [s.bytes for s in logits] == [4 * b * V]  # b × num_labels fp32, not b·s·V
    forward, backward = loss_saved(VIT_L, train)
    assert sum(s.bytes for s in forward + backward) == 4 * 4 * b * V  # log_softmax kept, 2 gradients


def test_vit_flops_count_its_tokens():
    job = Job(model=VIT_L, train=TrainSpec(micro_batch=8, precision="amp-bf16"))
    m, s = VIT_L, VIT_L.max_positions
    # PaLM's 6·N + 12·L·h·s per token (memplan.throughput.flops_per_token), s = patches + 1
    assert flops_per_token(job) == 6 * m.num_params + 12 * m.num_layers * m.hidden * s


def test_vit_estimate_does_not_depend_on_how_seq_len_was_given():
    default = estimate(Job(model=VIT_L, train=TrainSpec(micro_batch=8)))
    given = estimate(Job(model=VIT_L, train=TrainSpec(micro_batch=8, seq_len=VIT_L.max_positions)))
    assert default.allocated_bytes == given.allocated_bytes
