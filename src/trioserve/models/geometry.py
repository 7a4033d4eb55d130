"""A model's KV-cache geometry, read from its ``config.json`` alone (no torch, no weights), so the
engine core can size the block pool before any worker has loaded the model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> KVGeometry:
        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{model_dir} is not a Hugging Face model folder: {exc}") from None
        return cls.from_mapping(config)

    @classmethod
    def from_mapping(cls, cfg: dict[str, Any]) -> KVGeometry:
        cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
        heads = int(cfg["num_attention_heads"])
        return cls(
            num_layers=int(cfg["num_hidden_layers"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        )

    def bytes_per_block(self, block_size: int, dtype: str) -> int:
        """Keys and values of every layer for ``block_size`` tokens."""
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * ITEMSIZE[dtype]

    def blocks_for(self, space_bytes: int, block_size: int, dtype: str) -> int:
        return space_bytes // self.bytes_per_block(block_size, dtype)
