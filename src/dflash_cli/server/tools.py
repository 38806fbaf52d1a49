"""OpenAI's `tools` and `tool_choice` for `serve`, in the tool-call format of the chat templates that take
tools in Hermes' style (Qwen2.5, Qwen3, Qwen3.5, ...): the model writes

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_choice` "required" or a named function forces such blocks with a grammar (engine/constraint.py keeps
speculation lossless under it); "auto" lets the model choose, and any blocks it writes are read back as
`tool_calls`; "none" keeps the tools in the prompt and reads nothing back. Pure text: no torch here.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from dflash_cli.engine.output_format import OutputFormat
from dflash_cli.server.requests import ChatRequest, NamedToolChoice, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
# what a forced call's grammar (ToolRequest.output_format) makes the model write, up to its arguments
_HEAD = re.compile(r'\s*' + re.escape(OPEN) + r'\n\{"name": "([^"]+)", "arguments": ')
_END = "}\n" + CLOSE  # after the arguments: the call object closes, then the block


class ToolError(ValueError):
    """`tools` or `tool_choice` of the wrong shape; the message names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # as the client sent them (the chat template renders them)
    choice: str  # "auto", "required", "none", or the one function's name
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def output_format(self) -> OutputFormat | None:
        """The grammar of a forced reply: one tool-call block (more when parallel calls are allowed) of the
        allowed functions, each call's arguments following the function's parameter schema."""
        if not self.forced:
            return None
        allowed = [t["function"] for t in self.tools if self.choice in ("required", t["function"]["name"])]
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": f["name"]},
                                 "arguments": f.get("parameters") or {"type": "object"}}} for f in allowed]
        schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        # as Qwen's templates show the model its calls (json.dumps' separators): the likeliest text
        schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                           "key_separator": ": "}}
        more = ' ("\\n" block)*' if self.parallel and self.choice == "required" else ""
        lark = (f"start: block{more}\nblock: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\n"
                f"call: %json {json.dumps(schema)}\n")
        return OutputFormat("grammar", lark, "(tool call)")


def tool_request(request: ChatRequest) -> ToolRequest | None:
    """The request's tools and tool_choice (their shapes checked by server/requests.py), checked against each
    other; None when it has no tools."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    names = [tool.function.name for tool in request.tools]
    if len(set(names)) != len(names):
        raise ToolError("two tools have the same name", "tools")
    chosen = choice.function.name if isinstance(choice, NamedToolChoice) else choice or "auto"
    if isinstance(choice, NamedToolChoice) and chosen not in names:
        raise ToolError(f"'tool_choice' names {chosen!r}, which is not among the tools", "tool_choice.function.name")
    return ToolRequest(_as_sent(request.tools), chosen, request.parallel_tool_calls)


def _as_sent(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools as the client sent them (fields this server does not read included), for the chat template."""
    return [tool.model_dump(mode="json", by_alias=True, exclude_unset=True) for tool in tools]


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` and has the model answer in <tool_call> blocks."""
    return template is not None and "tools" in template and OPEN in template


def read_calls(text: str, names: list[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text outside the calls or None, OpenAI tool_calls) from a reply; blocks that are not a JSON
    call of one of `names` stay in the text."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or call.get("name") not in names:
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)}})
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


class ForcedCallStream:
    """A forced reply's tool calls as OpenAI's streamed deltas, while the model writes them: the call's id and
    name once its head is complete, then its arguments as they come (holding back what may be the start of
    the block's end). Exact for the text ToolRequest.output_format's grammar allows, where the arguments
    (JSON without raw newlines) cannot hold the end marker."""

    def __init__(self) -> None:
        self.held, self.index, self.in_arguments = "", -1, False
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.held += text
        deltas: list[dict[str, Any]] = []
        while True:
            if not self.in_arguments:
                head = _HEAD.match(self.held)
                if head is None:
                    return deltas
                self.index += 1
                call: dict[str, Any] = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                        "function": {"name": head.group(1), "arguments": ""}}
                self.calls.append(call)
                deltas.append({"index": self.index, **call, "function": dict(call["function"])})  # a copy: the
                # call's arguments grow below
                self.held, self.in_arguments = self.held[head.end():], True
                continue
            end = self.held.find(_END)
            keep = len(self.held) if end >= 0 else max(0, len(self.held) - len(_END) + 1)
            piece = self.held[: end if end >= 0 else keep]
            if piece:
                self.calls[-1]["function"]["arguments"] += piece
                deltas.append({"index": self.index, "function": {"arguments": piece}})
            if end < 0:
                self.held = self.held[keep:]
                return deltas
            self.held, self.in_arguments = self.held[end + len(_END):], False
