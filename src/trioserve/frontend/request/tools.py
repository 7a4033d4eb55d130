"""A chat request's tools: what the template shows the model, and what the output must be
(docs/tool_calling.md).

``tool_choice`` (OpenAI's; with tools and no ``tool_choice``, ``"auto"``, as at OpenAI and in vLLM):

- ``"none"``: the tools are rendered into the prompt (as vLLM does by default) and the answer is text;
- ``"auto"``: the model decides; ``--tool-call-parser`` reads its calls out of the text as it streams.
  Needs ``--enable-auto-tool-choice`` (vLLM's rule and error message);
- ``"required"``: a grammar makes the output a JSON array of at least one call, each
  ``{"name": <one of the tools>, "parameters": <that tool's schema>}`` (vLLM's shape), at most one
  with ``parallel_tool_calls: false``;
- ``{"type": "function", "function": {"name": N}}``: a grammar makes the output N's arguments.

``parallel_tool_calls: false`` under ``"auto"`` keeps the first call the model makes and drops the rest
(the grammar cannot hold the model to one there). A function's ``strict: true`` is what ``"required"``
and a named function always do; under ``"auto"`` nothing can hold the model to it, so it is a 400
there. Every shape problem is a 400 naming its path.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from trioserve.config import RequestConfig, ToolCallParserName
from trioserve.frontend.output.tool_calls import ToolFormat
from trioserve.frontend.output.tool_parsers import ForcedParser, NamedParser, auto_parser
from trioserve.frontend.request.errors import ApiError
from trioserve.frontend.request.openai_schema import ChatCompletionRequest
from trioserve.frontend.request.structured import GrammarSource

ChoiceMode = Literal["none", "auto", "required", "named"]
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
MAX_TOOLS = 128  # OpenAI's limit


@dataclass(frozen=True, slots=True)
class ToolsPlan:
    mode: ChoiceMode
    tools: list[dict[str, Any]]  # as the chat template gets them: {"type": "function", "function": {...}}
    grammar: GrammarSource | None  # required, named
    named: str | None = None  # named: the function
    parser: ToolCallParserName | None = None  # auto
    single: bool = False  # parallel_tool_calls: false

    def output_format(self) -> ToolFormat | None:
        """How the response reads calls out of the text (None: ``"none"``, text only)."""
        if self.mode == "auto":
            assert self.parser is not None
            return ToolFormat("auto", partial(auto_parser, self.parser), self.single)
        if self.mode == "required":
            return ToolFormat("required", ForcedParser, self.single)
        if self.mode == "named":
            assert self.named is not None
            return ToolFormat("named", partial(NamedParser, self.named))
        return None


def _function(tool: Any, i: int) -> dict[str, Any]:
    at = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
        raise ApiError(400, f'{at} must be {{"type": "function", "function": {{...}}}}', param=at)
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ApiError(400, f"{at}.function must be an object", param=f"{at}.function")
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise ApiError(400, f"unknown field(s) in {at}.function: {sorted(unknown)}", param=f"{at}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(
            400, f"{at}.function.name must be 1-64 letters, digits, _ or -", param=f"{at}.function.name"
        )
    if not isinstance(fn.get("description", ""), str | None):
        raise ApiError(400, f"{at}.function.description must be a string", param=f"{at}.function.description")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ApiError(
            400, f"{at}.function.parameters must be a JSON schema object", param=f"{at}.function.parameters"
        )
    return fn


def checked_functions(tools: list[Any]) -> list[dict[str, Any]]:
    """The functions of ``tools``, checked (a 400 naming the first problem's path)."""
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"at most {MAX_TOOLS} tools are allowed", param="tools")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    if len({f["name"] for f in functions}) < len(functions):
        raise ApiError(400, "tools must have distinct function names", param="tools")
    return functions


def tools_plan(req: ChatCompletionRequest, limits: RequestConfig) -> ToolsPlan | None:
    """The request's tools plan (None: no tools), or a 400."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    functions = checked_functions(req.tools)
    by_name = {f["name"]: f for f in functions}
    single = req.parallel_tool_calls is False
    tools = list(req.tools)
    if choice is None or choice == "auto":
        if not (limits.enable_auto_tool_choice and limits.tool_call_parser):
            raise ApiError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
                + ("" if choice else ' (it is the default with tools; send tool_choice "none" for text)'),
                param="tool_choice",
            )
        strict = [f["name"] for f in functions if f.get("strict")]
        if strict:  # the model writes its calls freely here: nothing could hold it to the schema
            raise ApiError(
                400,
                f"strict function schemas ({', '.join(strict)}) are enforced only with tool_choice "
                '"required" or a named function (under "auto" the model writes its calls freely)',
                param="tools",
            )
        return ToolsPlan("auto", tools, None, parser=limits.tool_call_parser, single=single)
    if choice == "none":
        return ToolsPlan("none", tools, None)
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "parameters": f.get("parameters") or _EMPTY_PARAMETERS,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if single:
            schema["maxItems"] = 1
        return ToolsPlan(
            "required", tools, GrammarSource("json_schema", json.dumps(schema), "tool_choice"), single=single
        )
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if (
            choice.get("type") != "function"
            or not isinstance(name, str)
            or set(choice) - {"type", "function"}
        ):
            raise ApiError(
                400,
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if name not in by_name:
            raise ApiError(400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        params = by_name[name].get("parameters") or _EMPTY_PARAMETERS
        return ToolsPlan(
            "named", tools, GrammarSource("json_schema", json.dumps(params), "tool_choice"), named=name
        )
    raise ApiError(
        400,
        'tool_choice must be "none", "auto", "required" or {"type": "function", ...}',
        param="tool_choice",
    )


def tool_calls_of(message_calls: Any, index: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked, as the chat template gets them."""
    at = f"messages[{index}].tool_calls"
    if not isinstance(message_calls, list):
        raise ApiError(400, f"{at} must be a list", param=at)
    out = []
    for j, call in enumerate(message_calls):
        where = f"{at}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or call.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise ApiError(
                400,
                f'{where} must be {{"id", "type": "function", '
                '"function": {"name": str, "arguments": str}}',
                param=where,
            )
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": fn["arguments"]},
            }
        )
    return out
