"""What the worker's own decoder (``worker/decoder_model.py``) reads from a model folder's ``config.json``:
a Llama- or Qwen3-style causal LM, or ``Unsupported`` with the reason.

Rules:

- Only what the own decoder computes exactly as transformers (5.23) does is taken: ``model_type``
  ``llama`` or ``qwen3`` (and ``architectures``, when given, naming that family's causal LM), SiLU MLPs,
  full causal attention on every layer (no sliding window), the rotary embedding's ``default`` or
  ``llama3`` frequencies over the whole head, no quantization and no nested text config. Anything
  else is ``Unsupported``: the loader then runs the model through transformers, which knows it.
- A key missing from the file takes transformers' default for it only where ``LlamaConfig`` and
  ``Qwen3Config`` agree on one (``rms_norm_eps``, ``tie_word_embeddings``, the biases, ``hidden_act``;
  Llama's ``head_dim`` is its hidden size over its heads there too). The shape keys (``REQUIRED``) and
  Qwen3's ``head_dim`` must be in the file: a guess that differed from transformers' would load the
  weights and compute something else.
- The rotary parameters are read from either form transformers writes or reads: ``rope_parameters``
  (5.x), or the top-level ``rope_theta`` with an optional ``rope_scaling`` (4.x checkpoints, whose
  type may be under ``type``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

FAMILIES: Final = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES: Final = ("default", "llama3")
LLAMA3_KEYS: Final = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
REQUIRED: Final = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


class Unsupported(ValueError):
    """A configuration the own decoder does not compute exactly; the message says what."""


@dataclass(frozen=True, slots=True)
class RopeSpec:
    theta: float
    # rope_type llama3: scaling factor, low and high frequency factors, original context length;
    # None: the default frequencies
    llama3: tuple[float, float, float, float] | None = None


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    model_type: Literal["llama", "qwen3"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    raw: dict[str, Any]  # the file's mapping, for what reads it (KVGeometry, ShardPlan)

    def to_dict(self) -> dict[str, Any]:
        """The configuration's mapping, as transformers' ``PretrainedConfig.to_dict`` gives it."""
        return dict(self.raw)

    @classmethod
    def from_model_dir(cls, folder: str | Path) -> DecoderSpec:
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise Unsupported(f"{path} is not readable JSON: {e}") from e
        if not isinstance(raw, dict):
            raise Unsupported(f"{path} does not hold a mapping")
        return cls.from_mapping(raw)

    @classmethod
    def from_mapping(cls, raw: dict[str, Any]) -> DecoderSpec:
        model_type = raw.get("model_type")
        if model_type not in FAMILIES:
            raise Unsupported(f"model_type {model_type!r} is not one of {', '.join(FAMILIES)}")
        architectures = raw.get("architectures")
        if architectures is not None and architectures != [FAMILIES[model_type]]:
            raise Unsupported(f"architectures {architectures!r} are not [{FAMILIES[model_type]!r}]")
        for key in ("text_config", "quantization_config"):
            if raw.get(key) is not None:
                raise Unsupported(f"{key} is set")
        missing = [key for key in REQUIRED if not isinstance(raw.get(key), int)]
        if missing:
            raise Unsupported(f"no integer {', '.join(missing)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise Unsupported(f"hidden_act {raw['hidden_act']!r} is not silu")
        heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
        if kv_heads < 1 or heads % kv_heads:
            raise Unsupported(f"{heads} attention heads do not group over {kv_heads} key/value heads")
        if model_type == "qwen3":
            _full_attention_only(raw)
            head_dim = raw.get("head_dim")  # Qwen3Config's default (128) is not hidden / heads
            if not isinstance(head_dim, int):
                raise Unsupported("a Qwen3 config without an integer head_dim")
        else:
            head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),  # both classes' default
            rope=_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),  # both classes' default
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),  # Qwen3's MLP has none
            raw=raw,
        )


def _full_attention_only(raw: dict[str, Any]) -> None:
    if raw.get("use_sliding_window"):
        raise Unsupported("use_sliding_window is set")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise Unsupported("a layer is not full_attention")


def _rope(raw: dict[str, Any]) -> RopeSpec:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise Unsupported(f"rope parameters {params!r} are not one mapping")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if not isinstance(theta, (int, float)):
        raise Unsupported("no rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise Unsupported(f"rope_type {kind!r} is not one of {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise Unsupported(f"partial_rotary_factor {partial}")
    if kind == "default":
        return RopeSpec(float(theta))
    values = [params.get(key) for key in LLAMA3_KEYS]
    if not all(isinstance(v, (int, float)) for v in values):
        raise Unsupported(f"llama3 rope parameters need {', '.join(LLAMA3_KEYS)}")
    factor, low, high, original = (float(v) for v in values)  # type: ignore[arg-type]
    return RopeSpec(float(theta), (factor, low, high, original))
