"""``worker/model_loader.py``: a saved folder loads into the own decoder with exactly the tensors
transformers' ``from_pretrained`` gives (tied and untied heads, a bfloat16 checkpoint served in
float32, a sharded checkpoint), falls back to transformers with the reason when the own decoder does
not take the config, and refuses a checkpoint that does not fit. That the own decoder computes what
transformers does is ``test_model_runner.py``'s (greedy against ``generate()``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tests.unit.test_decoder_spec import SHAPE
from tests.unit.test_model_runner import tiny_model
from trioserve.worker.decoder_model import CausalLM
from trioserve.worker.model_loader import INDEX, SINGLE, load_model
from trioserve.worker.paged_attention import ATTN_IMPLEMENTATION


def reference(folder: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def assert_same_tensors(own: CausalLM, theirs: Any) -> None:
    ours, expected = own.state_dict(), theirs.state_dict()
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor), name
    assert torch.equal(own.model.rotary_emb.inv_freq, theirs.model.rotary_emb.inv_freq)
    tied = own.lm_head.weight is own.model.embed_tokens.weight
    assert tied is own.config.tie_word_embeddings


@pytest.mark.parametrize(("family", "tied"), [("llama", True), ("llama", False), ("qwen3", False)])
def test_a_saved_folder_loads_as_transformers_loads_it(family: str, tied: bool, tmp_path: Path) -> None:
    model = tiny_model(family)
    model.config.tie_word_embeddings = tied
    type(model)(model.config).save_pretrained(tmp_path)
    own, implementation = load_model(str(tmp_path), torch.float32)
    assert implementation == "trioserve"
    assert isinstance(own, CausalLM)
    assert_same_tensors(own, reference(tmp_path))


def test_a_bfloat16_checkpoint_served_in_float32(tmp_path: Path) -> None:
    tiny_model("qwen3").to(torch.bfloat16).save_pretrained(tmp_path)
    assert {t.dtype for t in load_file(tmp_path / SINGLE).values()} == {torch.bfloat16}
    own, _ = load_model(str(tmp_path), torch.float32)
    assert_same_tensors(own, reference(tmp_path))


def test_a_sharded_checkpoint(tmp_path: Path) -> None:
    tiny_model("llama").save_pretrained(tmp_path, max_shard_size="100KB")
    assert not (tmp_path / SINGLE).exists() and (tmp_path / INDEX).exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    own, _ = load_model(str(tmp_path), torch.float32)
    assert_same_tensors(own, reference(tmp_path))


def sliding_qwen3(folder: Path) -> None:
    config = Qwen3Config(**SHAPE, head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    Qwen3ForCausalLM(config).save_pretrained(folder)


def test_what_the_own_decoder_does_not_take_runs_on_transformers(tmp_path: Path) -> None:
    sliding_qwen3(tmp_path)
    model, implementation = load_model(str(tmp_path), torch.float32)
    assert not isinstance(model, CausalLM)
    assert implementation.startswith("transformers (") and "use_sliding_window" in implementation
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    with pytest.raises(ValueError, match=r"--model-impl trioserve cannot serve .*use_sliding_window"):
        load_model(str(tmp_path), torch.float32, "trioserve")


def test_transformers_when_asked(tmp_path: Path) -> None:
    tiny_model("llama").save_pretrained(tmp_path)
    model, implementation = load_model(str(tmp_path), torch.float32, "transformers")
    assert implementation == "transformers (--model-impl transformers)"
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION


def test_a_checkpoint_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    tiny_model("llama").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / SINGLE)
    name = "model.layers.1.mlp.up_proj.weight"

    def rewrite(changed: dict[str, torch.Tensor]) -> None:
        save_file(changed, tmp_path / SINGLE, metadata={"format": "pt"})

    rewrite({k: v for k, v in tensors.items() if k != name})
    with pytest.raises(ValueError, match=f"missing \\['{name}'\\]"):
        load_model(str(tmp_path), torch.float32)
    rewrite({**tensors, "model.layers.1.mlp.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"unexpected \['model\.layers\.1\.mlp\.extra\.weight'\]"):
        load_model(str(tmp_path), torch.float32)
    rewrite({**tensors, name: tensors[name][:, :8].contiguous()})
    with pytest.raises(ValueError, match=f"{name}: checkpoint shape \\(128, 8\\), model \\(128, 64\\)"):
        load_model(str(tmp_path), torch.float32)
