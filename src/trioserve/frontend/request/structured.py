"""What a request asks its output to match, as one llguidance grammar (docs/structured_output.md).

Sources, at most one per request (two are a 400 naming both):

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, object or string), ``regex``,
  ``choice`` (a list of strings), ``grammar`` (Lark, or GBNF/EBNF as llama.cpp and xgrammar write it),
  ``json_object: true``;
- vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.

Rules:

- JSON is written without free whitespace: items separated by ``", "``, keys by ``": "`` (what
  ``json.dumps`` writes). A small model left to choose whitespace can spend ``max_tokens`` on newlines
  inside an object; a schema's own ``x-guidance`` options (llguidance's) override this.
- A schema is enforced whatever ``strict`` says: ``strict: false`` asks less than the server does, so
  it is accepted and enforced like ``true``. A keyword llguidance does not implement is a 400 naming
  it, never ignored (llguidance's ``lenient`` mode stays off unless the schema's own ``x-guidance``
  turns it on).
- The grammar is checked here, where the request can still be refused: llguidance's
  ``validate_grammar``, without the tokenizer (which the worker adds), a 400 with llguidance's
  message when it fails. Checked grammars are kept by their source (``GRAMMAR_CACHE_SIZE``), so a
  repeated schema costs a dictionary lookup; a new one is checked on the renderer pool, off the event
  loop (0.7 ms for a typical schema here, more for large grammars).
- The checked grammar is at most ``MAX_GRAMMAR_BYTES`` (UTF-8): it rides in the request's sampling
  parameters to the worker, and every step's ring slot is sized for ``MAX_GRAMMARS_PER_STEP`` of them.
- ``ignore_eos`` and ``min_tokens`` are refused beside a grammar: a grammar ends the output where it
  is complete (the model's end-of-sequence token is then the only one allowed), which neither can
  change without leaving the grammar.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import llguidance

from trioserve.frontend.compiled_cache import CompiledCache
from trioserve.frontend.request.errors import ApiError
from trioserve.frontend.request.openai_schema import _Sampling
from trioserve.frontend.request.validate import json_depth
from trioserve.protocol.messages import MAX_GRAMMAR_BYTES

GRAMMAR_CACHE_SIZE = 256
MAX_SCHEMA_DEPTH = 128  # llguidance's JSON reader stops there too (serde_json's limit)
_JSON_DEFAULTS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT = '{"type": "object"}'
# structured_outputs' keys: the constraints (one of them) and the options accepted at any value.
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_OPTIONS_ANY = {
    "disable_fallback": "one grammar engine here: there is nothing to fall back to",
    "disable_any_whitespace": "JSON is written without free whitespace whatever it says",
}
_OPTIONS_NEUTRAL = {  # accepted at null (or false) only
    "disable_additional_properties": "set additionalProperties: false in the schema instead",
    "whitespace_pattern": "JSON is written without free whitespace",
    "structural_tag": "structural tags are not supported",
    "backend": "the grammar engine is llguidance",
}


class GrammarSource(NamedTuple):
    """A constraint as the request gave it: llguidance's format name and the text."""

    format: str  # "json_schema", "regex", "choice", "grammar"
    text: str
    param: str  # the request parameter it came from (errors name it)


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        if json_depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise ApiError(400, f"`{param}` nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param)
        return json.dumps(value)
    raise ApiError(400, f"`{param}` must be a JSON schema (an object, or a string holding one)", param=param)


def _choice_text(value: Any, param: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise ApiError(400, f"`{param}` must be a non-empty list of strings", param=param)
    return json.dumps(value)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"`{param}` must be a non-empty string", param=param)
    return value


def _from_response_format(rf: dict[str, Any]) -> GrammarSource | None:
    kind = rf.get("type")
    if kind == "text" and len(rf) == 1:
        return None
    if kind == "json_object" and len(rf) == 1:
        return GrammarSource("json_schema", _ANY_OBJECT, "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        extra = set(rf) - {"type", "json_schema"}
        if not isinstance(spec, dict) or extra:
            raise ApiError(
                400,
                'response_format of type "json_schema" needs a `json_schema` object (and nothing else)',
                param="response_format",
            )
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise ApiError(
                400,
                f"unknown field(s) in response_format.json_schema: {sorted(unknown)}",
                param="response_format",
            )
        if not isinstance(spec.get("name", ""), str) or not isinstance(
            spec.get("strict", False), bool | None
        ):
            raise ApiError(
                400,
                "response_format.json_schema: `name` is a string, `strict` a boolean",
                param="response_format",
            )
        # OpenAI's SDK always sends a schema; a missing one allows any JSON object, as vLLM's does.
        schema = spec.get("schema")
        text = _ANY_OBJECT if schema is None else _schema_text(schema, "response_format.json_schema.schema")
        return GrammarSource("json_schema", text, "response_format")
    raise ApiError(
        400,
        'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
        '"json_schema": {...}}',
        param="response_format",
    )


def _from_structured_outputs(so: dict[str, Any]) -> GrammarSource | None:
    param = "structured_outputs"
    for key, value in so.items():
        if key in _CONSTRAINTS or key in _OPTIONS_ANY:
            continue
        if key in _OPTIONS_NEUTRAL:
            if value not in (None, False):
                why = _OPTIONS_NEUTRAL[key]
                raise ApiError(400, f"`{param}.{key}` is not supported here ({why})", param=f"{param}.{key}")
            continue
        raise ApiError(400, f"unknown field `{param}.{key}`", param=f"{param}.{key}")
    given = [k for k in _CONSTRAINTS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise ApiError(400, f"`{param}` takes one constraint, got {given}", param=param)
    if not given:
        return None
    key = given[0]
    value = so[key]
    name = f"{param}.{key}"
    if key == "json":
        return GrammarSource("json_schema", _schema_text(value, name), name)
    if key == "json_object":
        if value is not True:
            raise ApiError(400, f"`{name}` is a boolean", param=name)
        return GrammarSource("json_schema", _ANY_OBJECT, name)
    if key == "choice":
        return GrammarSource("choice", _choice_text(value, name), name)
    return GrammarSource(key, _text(value, name), name)


def grammar_source(req: _Sampling) -> GrammarSource | None:
    """The request's constraint (None: free text), or a 400 for a malformed or doubled one."""
    found: list[GrammarSource] = []
    if req.response_format is not None:
        rf = _from_response_format(req.response_format)
        if rf is not None:
            found.append(rf)
    if req.structured_outputs is not None:
        so = _from_structured_outputs(req.structured_outputs)
        if so is not None:
            found.append(so)
    if req.guided_json is not None:
        found.append(
            GrammarSource("json_schema", _schema_text(req.guided_json, "guided_json"), "guided_json")
        )
    if req.guided_regex is not None:
        found.append(GrammarSource("regex", _text(req.guided_regex, "guided_regex"), "guided_regex"))
    if req.guided_choice is not None:
        found.append(
            GrammarSource("choice", _choice_text(req.guided_choice, "guided_choice"), "guided_choice")
        )
    if req.guided_grammar is not None:
        found.append(GrammarSource("grammar", _text(req.guided_grammar, "guided_grammar"), "guided_grammar"))
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(f"`{s.param}`" for s in found)
        raise ApiError(400, f"a request takes one output constraint, got {names}", param=found[1].param)
    return found[0]


def refuse_beside_grammar(req: _Sampling, source: GrammarSource) -> None:
    """The 400 for what a grammar cannot be combined with (the module's last rule)."""
    for name, bad in (("ignore_eos", req.ignore_eos), ("min_tokens", req.min_tokens > 0)):
        if bad:
            raise ApiError(
                400,
                f"`{name}` cannot be combined with `{source.param}`: the grammar ends the output where it is "
                "complete",
                param=name,
            )


class GrammarError(ValueError):
    """A constraint llguidance cannot compile; the message is its own."""


def build_grammar(source: GrammarSource) -> str:
    """llguidance's grammar for ``source``, checked (``GrammarError`` if it does not compile)."""
    try:
        if source.format == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source.text, defaults=_JSON_DEFAULTS)
        else:
            grammar = llguidance.grammar_from(source.format, source.text)  # type: ignore[arg-type]
    except ValueError as exc:  # not JSON, or a GBNF text the converter cannot read
        raise GrammarError(str(exc)) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(messages[0] if messages else "the grammar does not compile")
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"it is too large once compiled: at most {MAX_GRAMMAR_BYTES} bytes")
    return grammar


class GrammarCache(CompiledCache[GrammarSource, str]):
    """Checked grammars by their source (``checked_grammar`` refuses sources over
    ``MAX_GRAMMAR_BYTES`` characters before they are built, and ``build_grammar`` grammars over that
    many bytes, so what is kept stays bounded)."""

    def __init__(self, size: int = GRAMMAR_CACHE_SIZE) -> None:
        super().__init__(build_grammar, size, MAX_GRAMMAR_BYTES, lambda s: len(s.text))


def checked_grammar(cache: GrammarCache, source: GrammarSource) -> str:
    """``source``'s grammar from ``cache`` (building it on a miss), or the 400 saying why not; run on the
    renderer pool on a miss."""
    if len(source.text) > MAX_GRAMMAR_BYTES:
        raise ApiError(
            400, f"`{source.param}` is too large: at most {MAX_GRAMMAR_BYTES} characters", param=source.param
        )
    try:
        return cache.get(source)
    except GrammarError as exc:
        raise ApiError(400, f"`{source.param}` cannot be used: {exc}", param=source.param) from None
