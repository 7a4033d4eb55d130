"""``worker/decoder_spec.py``: which ``config.json`` files the own decoder takes, what it reads from them
(transformers' own reading of the same files is the reference), and the reason it gives for the rest."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from trioserve.worker.decoder_model import inv_freq
from trioserve.worker.decoder_spec import DecoderSpec, RopeSpec, Unsupported

SHAPE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_what_transformers_writes_is_read_as_transformers_reads_it() -> None:
    for config in (LlamaConfig(**SHAPE, tie_word_embeddings=True), Qwen3Config(**SHAPE, head_dim=16)):
        raw = config.to_dict()
        spec = DecoderSpec.from_mapping(raw)
        assert spec.model_type == config.model_type
        assert spec.head_dim == (16 if config.model_type == "qwen3" else 64 // 4)
        assert spec.num_key_value_heads == 2
        assert spec.rms_norm_eps == config.rms_norm_eps
        assert spec.rope == RopeSpec(config.rope_parameters["rope_theta"])
        assert spec.tie_word_embeddings is config.tie_word_embeddings
        assert spec.to_dict() == raw


def test_llama3_frequencies_are_transformers() -> None:
    config = LlamaConfig(**SHAPE, rope_parameters=dict(LLAMA3))
    spec = DecoderSpec.from_mapping(config.to_dict())
    assert spec.rope.llama3 is not None
    expected = LlamaRotaryEmbedding(config).inv_freq
    assert torch.equal(inv_freq(spec.rope, spec.head_dim), expected)
    # and it differs from the unscaled frequencies (the test would pass on those otherwise)
    assert not torch.equal(inv_freq(RopeSpec(LLAMA3["rope_theta"]), spec.head_dim), expected)


def test_a_4x_style_config() -> None:
    """transformers 4.x wrote ``rope_theta`` at the top and the scaling, if any, as ``rope_scaling``
    (its type sometimes under ``type``)."""
    raw = {"model_type": "llama", **SHAPE, "rope_theta": 10000.0, "rope_scaling": None}
    assert DecoderSpec.from_mapping(raw).rope == RopeSpec(10000.0)
    scaling = {k: v for k, v in LLAMA3.items() if k not in ("rope_type", "rope_theta")}
    raw = {**raw, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **scaling}}
    rope = DecoderSpec.from_mapping(raw).rope
    assert rope.theta == 500000.0 and rope.llama3 == (32.0, 1.0, 4.0, 8192.0)


LLAMA: dict[str, Any] = {"model_type": "llama", **SHAPE, "rope_theta": 10000.0}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"model_type": "mistral"}, "model_type 'mistral'"),
        ({"architectures": ["Qwen3ForCausalLM"]}, "architectures"),
        ({"num_key_value_heads": None}, "no integer num_key_value_heads"),
        ({"num_key_value_heads": 3}, "do not group"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_theta": None}, "no rope_theta"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope parameters need"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"text_config": {"model_type": "llama"}}, "text_config"),
        ({"model_type": "qwen3", "head_dim": 16, "use_sliding_window": True}, "use_sliding_window"),
        (
            {"model_type": "qwen3", "head_dim": 16, "layer_types": ["full_attention", "sliding_attention"]},
            "not full_attention",
        ),
        ({"model_type": "qwen3"}, "without an integer head_dim"),
    ],
)
def test_what_it_does_not_take_says_why(change: dict[str, Any], reason: str) -> None:
    raw = {key: value for key, value in {**LLAMA, **change}.items() if value is not None}
    with pytest.raises(Unsupported, match=reason):
        DecoderSpec.from_mapping(raw)


def test_a_folder_without_a_readable_config(tmp_path: Any) -> None:
    with pytest.raises(Unsupported, match="not readable JSON"):
        DecoderSpec.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(Unsupported, match="does not hold a mapping"):
        DecoderSpec.from_model_dir(tmp_path)
