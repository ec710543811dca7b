"""Encoders (BERT, RoBERTa): parameter counts against the modules transformers builds, the
config.json heads, and the refusals."""

import pytest

from memplan import catalog
from memplan.errors import MemplanError
from memplan.hfconfig import model_from_hf_config
from memplan.specs import Job, TrainSpec

BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
ROBERTA = dict(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1)
CONFIGS = [
    ("bert", "BertForMaskedLM", {}),
    ("bert", "BertForSequenceClassification", BERT_LARGE | {"num_labels": 2}),
    ("roberta", "RobertaForMaskedLM", ROBERTA | {"num_hidden_layers": 2}),
    ("roberta", "RobertaForSequenceClassification", ROBERTA | {"num_hidden_layers": 2, "num_labels": 5}),
]


@pytest.mark.parametrize("model_type,architecture,keys", CONFIGS, ids=[c[1] for c in CONFIGS])
def test_config_json_counts_what_transformers_builds(model_type, architecture, keys):
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    config = tf.AutoConfig.for_model(model_type, architectures=[architecture], **keys)
    with torch.device("meta"):
        module = getattr(tf, architecture)(config)
    spec = model_from_hf_config(config.to_dict())
    assert spec.arch == "bert" and spec.num_labels == (config.num_labels if "Sequence" in architecture else 0)
    assert spec.num_params == sum(p.numel() for p in module.parameters())


def test_published_bert_large_row_is_the_two_label_classifier():
    # ../shared/published: bert-large-uncased + seq-classification head (2 labels), 335143938
    cfg = {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "vocab_size": 30522, **BERT_LARGE}
    assert model_from_hf_config(cfg).num_params == 335143938


@pytest.mark.parametrize("model_type", ["deberta", "deberta-v2"])
def test_deberta_is_refused_with_its_reason(model_type):
    with pytest.raises(MemplanError, match="disentangled attention"):
        model_from_hf_config({"model_type": model_type, "hidden_size": 768})


def test_an_encoder_head_memplan_does_not_describe_is_refused():
    with pytest.raises(MemplanError, match="BertForQuestionAnswering"):
        model_from_hf_config({"model_type": "bert", "architectures": ["BertForQuestionAnswering"]})


def test_seq_len_beyond_the_learned_positions_is_refused():
    bert = catalog.model_preset("bert-base-uncased")
    with pytest.raises(MemplanError, match="seq_len 1024 exceeds bert-base-uncased's 512"):
        Job(model=bert, train=TrainSpec(seq_len=1024))


# -- what autograd saves, read with saved-tensor hooks on transformers' own modules -----------


def measured_bert_saved(model, train, hf_type: str) -> tuple[int, int]:
    """Bytes autograd saves in one BertLayer / RobertaLayer, and in the one-layer model outside
    it (parameters, buffers, the input ids and the labels excluded)."""
    torch = pytest.importorskip("torch")
    from calibrate.loops import LoopLM
    from calibrate.wrappers import DTYPES
    from memplan.precision import POLICIES
    from validation.saved import saved_bytes

    policy = POLICIES[train.precision]
    dtype = DTYPES[policy.param_dtype]
    lm = LoopLM(model, hf_type=hf_type, attention=train.attention)
    lm.hf.to(dtype).train()
    torch.manual_seed(0)
    ids = torch.randint(2, model.vocab_size, (train.micro_batch, train.seq_len))  # no padding id
    labels = ids[:, 0] % model.num_labels if model.num_labels else ids
    autocast = torch.autocast("cpu", dtype=DTYPES[policy.compute_dtype], enabled=policy.autocast)
    options = dict(skip=(*lm.hf.parameters(), *lm.hf.buffers(), ids, labels), autocast=autocast, scalars=False)
    x = torch.randn(train.micro_batch, train.seq_len, model.hidden, dtype=dtype, requires_grad=True) + 0  # not a leaf
    block = saved_bytes(lambda: lm.layers[0](x), **options)
    return block, saved_bytes(lambda: lm.hf(input_ids=ids, labels=labels), **options) - block


# six cases cover every precision, attention, dropout and head in the fast lane; the whole grid is slow
FAST = {
    ("fp32", "sdpa", 0.1, 0),
    ("fp32", "eager", 0.0, 3),
    ("amp-bf16", "sdpa", 0.0, 0),
    ("amp-bf16", "eager", 0.1, 3),
    ("bf16", "sdpa", 0.1, 3),
    ("bf16", "eager", 0.0, 0),
}
SAVED_CASES = [
    pytest.param(*case, marks=() if case in FAST else pytest.mark.slow)
    for case in (
        (p, a, dropout, labels)
        for p in ("fp32", "amp-bf16", "bf16")
        for a in ("sdpa", "eager")
        for dropout in (0.0, 0.1)
        for labels in (0, 3)
    )
]


@pytest.mark.parametrize("precision,attention,dropout,labels", SAVED_CASES)
def test_bert_saved_bytes_match_autograd(precision, attention, dropout, labels):
    from memplan.activations import block_saved, loss_saved, model_saved
    from memplan.specs import ModelSpec

    model = ModelSpec(
        arch="bert",
        num_layers=1,
        hidden=128,
        num_heads=8,
        ffn_hidden=344,
        vocab_size=1000,
        linear_bias=True,
        tied_embeddings=True,
        max_positions=128,
        type_vocab_size=2,
        num_labels=labels,
        dropout=dropout,
    )
    train = TrainSpec(seq_len=64, micro_batch=2, precision=precision, attention=attention, device="cpu")
    pre, post = model_saved(model, train)
    outside = [s for s in pre + post + loss_saved(model, train)[0] if s.key not in ("logits", "loss.logits_fp32")]
    estimated = (sum(s.bytes for s in block_saved(model, train)), sum(s.bytes for s in outside))
    assert estimated == measured_bert_saved(model, train, "bert")


def test_arch_bert_by_shapes_is_bert_for_masked_lm_with_bert_config_defaults():
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    from memplan.inputs import resolve_model
    from memplan.request import ModelRequest

    spec = resolve_model(ModelRequest(arch="bert", layers=2, hidden=256, heads=4, ffn=1024, vocab=1000)).spec
    config = tf.BertConfig(
        vocab_size=1000, num_hidden_layers=2, hidden_size=256, num_attention_heads=4, intermediate_size=1024
    )
    with torch.device("meta"):
        module = tf.BertForMaskedLM(config)
    assert spec.num_params == sum(p.numel() for p in module.parameters())
