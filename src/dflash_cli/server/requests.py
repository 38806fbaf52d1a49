"""The request bodies `serve` takes, described once as typed models (pydantic), as vLLM's and
llama-cpp-python's servers describe theirs.

A body is validated from its JSON text (`read_request`): strict types as JSON has them (a string is not a
number, a number is not a boolean, NaN is not a number), ranges, and nesting no deeper than the parser's
limit. The first problem becomes a 400 whose `param` names the field as a path (`messages[0].role`).
Fields of other vendors are ignored, as vLLM ignores them; the OpenAI fields this server cannot honour are
typed here and refused with a 422 by server/protocol.py.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

Number = Annotated[float, Field(allow_inf_nan=False)]
INT64 = 1 << 63


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, populate_by_name=True)


class _Open(_Strict):
    """A part whose unknown fields are kept (a tool's definition goes to the chat template as sent)."""

    model_config = ConfigDict(extra="allow")


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = Field(None, validate_default=True)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None

    @field_validator("content")
    @classmethod
    def _content_given(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and info.data.get("role", "assistant") != "assistant":  # only a turn that called
            # tools has none
            raise ValueError("only an assistant's content may be null")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class TemplateKwargs(_Open):
    enable_thinking: StrictBool | None = None


class JsonSchemaSpec(_Strict):
    name: StrictStr | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, json_object, or json_schema with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema needs a 'json_schema' object with its 'schema'")
        return self


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one of a JSON Schema, a regex, a grammar (Lark or GBNF), choices."""

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: Annotated[StrictStr, Field(min_length=1)] | None = None
    grammar: Annotated[StrictStr, Field(min_length=1)] | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputs:
        if sum(v is not None for v in (self.json_, self.regex, self.grammar, self.choice)) != 1:
            raise ValueError("set exactly one of json, regex, grammar or choice")
        return self


class FunctionDef(_Open):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class _Request(_Strict):
    """What both endpoints take."""

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, lt=1 << 31)] | None = None  # -1: off
    seed: Annotated[StrictInt, Field(ge=-INT64, lt=INT64)] | None = None
    n: Annotated[StrictInt, Field(ge=1)] = 1
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[Number, Field(gt=0, le=10)] = 1.0
    # OpenAI's, not honoured here: refused unless absent or empty (server/protocol.py)
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    functions: Any = None
    function_call: Any = None
    suffix: Any = None
    echo: Any = None
    best_of: Any = None


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "required", "none"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: TemplateKwargs | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_Request):
    prompt: (Annotated[StrictStr, Field(min_length=1)] | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
             | Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)])


# a field whose value may take several shapes: what to say when it takes none of them
SHAPES = {
    "stop": "a string or a list of at most 4 strings",
    "content": "a string or a list of text parts (this server reads text only)",
    "prompt": "a non-empty string (or one string, or a list of token ids)",
    "tool_choice": '"auto", "required", "none" or {"type": "function", "function": {"name": ...}}',
    "json": "a JSON Schema (an object, or its text)",
}


class RequestError(ValueError):
    """A body that is not a request of this shape: the message, and the field as a path (None: the body)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def read_request(raw: bytes, *, chat: bool) -> ChatRequest | CompletionRequest:
    """The request in `raw` (JSON text), or RequestError naming the first field that is wrong."""
    kind: type[ChatRequest | CompletionRequest] = ChatRequest if chat else CompletionRequest
    try:
        return kind.model_validate_json(raw)
    except ValidationError as e:
        raise _first_problem(e) from None


def _first_problem(error: ValidationError) -> RequestError:
    errors = error.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        deep = "recursion limit" in str(detail)
        return RequestError("the request body is nested too deeply" if deep
                            else f"the request body is not valid JSON ({detail})", None)
    if not first["loc"]:
        return RequestError("the request body must be a JSON object", None)
    path, shape_of = _path(first["loc"])
    if shape_of is not None:  # a value of none of a field's shapes: one error per shape, say it once
        return RequestError(f"'{path}' must be {SHAPES.get(shape_of, 'another kind of value')}", path)
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "missing":
        return RequestError(f"'{path}' is required", path)
    given = first.get("input")
    if isinstance(given, (str, int, float)) and len(shown := json.dumps(given)) <= 40:
        message += f", got {shown}"
    return RequestError(f"'{path}': {message[:1].lower()}{message[1:]}", path or None)


def _path(loc: tuple[int | str, ...]) -> tuple[str, str | None]:
    """The field path of an error location, and, when the location went into one of the shapes a field
    may take (pydantic names the shape: `str`, `list[str]`, ...), that field's name."""
    path, last = "", ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_shape(part):
            return path, last
        else:
            name = "json" if part == "json_" else "schema" if part == "schema_" else part
            path += ("." if path else "") + name
            last = name
    return path, None


def _is_shape(part: str) -> bool:
    """A union member's tag in an error location (`str`, `list[str]`, `literal['auto','none']`,
    `NamedToolChoice`, `constrained-str`), never one of the request's field names."""
    return part in ("str", "int", "float", "bool", "dict", "list") or "[" in part or part[:1].isupper() or \
        part.startswith(("constrained-", "function-"))
