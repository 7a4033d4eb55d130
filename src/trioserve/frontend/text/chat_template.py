"""Chat templates: compiled in the sandbox transformers uses for a model's own, rendered, and cached.

Rules:

- Every template is compiled by one environment: the model's own, the server's ``--chat-template``
  and a request's ``chat_template`` alike go through transformers' builder (jinja2's
  ``ImmutableSandboxedEnvironment`` with the globals Hugging Face templates expect: ``raise_exception``,
  ``tojson``, ``strftime_now``, ``namespace``, loop controls). A template given to the server can do
  no more than the model's own could.
- Rendering is what ``PreTrainedTokenizer.apply_chat_template(tokenize=False)`` does for a text
  conversation: keys whose value is null are dropped from each message, the tokenizer's special tokens
  (``eos_token``, ...) are variables, ``chat_template_kwargs`` override them, and ``messages``,
  ``add_generation_prompt``, ``tools`` and ``documents`` are set last (tests/unit/test_chat_template.py
  checks the two agree).
- ``continue_final_message``: the rendered prompt ends exactly where the final message's text ends,
  so the model continues that text instead of starting a new turn (no end-of-turn token after it).
  The text is located by rendering it with a marker appended; a template that does not render the
  text as written (drops or rewrites it) cannot be continued and is a ``ValueError``.
- Every failure is a ``ValueError`` with a one-line message (the caller's 400, or the command line's
  exit 2): a template that does not compile, or one that fails on the conversation it is given.
- A request's templates are compiled once per distinct text and kept in a small LRU
  (``ChatTemplateCache``), safe to share between renderer threads; texts over ``MAX_CACHED_CHARS``
  are compiled for each request and never kept, so the cache's memory stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, cast

import jinja2
from transformers.utils import chat_template_utils

from trioserve.frontend.compiled_cache import CompiledCache

__all__ = [
    "ChatTemplate",
    "ChatTemplateCache",
    "TemplateRenderError",
    "compile_chat_template",
    "read_chat_template",
]

# Appended to the final message's text to find where it ends in the rendered prompt: no whitespace
# (templates trim and strip) and no character that JSON or HTML escaping would rewrite.
_CONTINUE_MARK: Final = "TRIOSERVE_CONTINUE_FINAL_MESSAGE_9c4f1b"
MAX_CACHED_CHARS: Final = 64 * 1024

# transformers' own (uncached) builder of the sandboxed environment: the one that compiles the
# model's template inside ``apply_chat_template``. Its cached wrapper keeps 128 templates of any size,
# too many for texts that clients send, hence the cache below.
_compile: Callable[[str], jinja2.Template] = cast(Any, chat_template_utils)._cached_compile_jinja_template


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class TemplateRenderError(ValueError):
    """The template failed on the conversation it was given (it raised, or lost the text to continue)."""


class ChatTemplate:
    """One compiled template; ``render`` may run on several renderer threads at once."""

    __slots__ = ("_compiled", "source")

    def __init__(self, source: str, compiled: jinja2.Template) -> None:
        self.source = source
        self._compiled = compiled

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for text ``messages`` (every content a string or null)."""
        chat = [{key: value for key, value in m.items() if value is not None} for m in messages]
        if continue_final_message:
            if not chat:
                raise ValueError("continue_final_message needs a final message to continue")
            text = chat[-1].get("content")
            if not isinstance(text, str):
                raise ValueError("continue_final_message needs the final message to have text content")
            chat[-1] = {**chat[-1], "content": text + _CONTINUE_MARK}
        context = {
            "tools": None,
            "documents": None,
            **(variables or {}),
            "messages": chat,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            rendered = self._compiled.render(context)
        except Exception as exc:
            # The template runs on the client's data (and may be the client's own): whatever it
            # raises -- a TemplateError from raise_exception, a TypeError from adding a list to a
            # string, a RecursionError from a recursive macro -- is the request's, not a server bug.
            raise TemplateRenderError(f"chat template rejected the messages: {_one_line(exc)}") from exc
        if not continue_final_message:
            return rendered
        at = rendered.rfind(_CONTINUE_MARK)
        if at < 0:
            raise TemplateRenderError(
                "continue_final_message: the chat template does not render the final message's text "
                "as written, so it cannot be continued"
            )
        return rendered[:at]


def compile_chat_template(source: str) -> ChatTemplate:
    """Compile ``source``; ``ValueError`` (one line, with jinja's line number) if it does not."""
    try:
        return ChatTemplate(source, _compile(source))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not compile: line {exc.lineno}: {exc.message}") from None
    except Exception as exc:  # anything else the parser trips on (deep nesting: RecursionError)
        raise ValueError(f"the chat template does not compile: {_one_line(exc)}") from None


def read_chat_template(value: str) -> str:
    """``--chat-template``'s value: the text of the file it names if one exists, else the template
    itself (as vLLM reads the flag)."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # too long for a file name, or a NUL in it: a template
        is_file = False
    if not is_file:
        return value
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{value}: {_one_line(exc)}") from None


class ChatTemplateCache(CompiledCache[str, ChatTemplate]):
    """Compiled request templates by their text: the ``size`` most recently used."""

    def __init__(self, size: int = 16) -> None:
        super().__init__(compile_chat_template, size, MAX_CACHED_CHARS, len)
