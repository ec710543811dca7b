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
    with pytest.raises(MemplanError, match="seq-len 1024 exceeds bert-base-uncased's 512"):
        Job(model=bert, train=TrainSpec(seq_len=1024))
