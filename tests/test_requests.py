"""serve's request models (server/requests.py) on their own: what each wrong body is refused for, and the
field it names. tests/test_serve.py and tests/test_structured_serve.py send the same shapes to a real
server."""

import json

import pytest

from dflash_cli.server.requests import ChatRequest, CompletionRequest, RequestError, read_request

ASK = [{"role": "user", "content": "x"}]


def chat(**fields) -> bytes:
    return json.dumps({"messages": ASK, **fields}).encode()


@pytest.mark.parametrize("raw, param, words", [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "must be a JSON object"),
    (b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}", None, "nested too deeply"),
    (chat(temperature=float("nan")), "temperature", "finite"),
    (chat(temperature=True), "temperature", "number"),
    (chat(temperature="1"), "temperature", 'got "1"'),
    (chat(temperature=2.01), "temperature", "less than or equal to 2"),
    (chat(top_p=0), "top_p", "greater than 0"),
    (chat(max_tokens=1.0), "max_tokens", "integer"),
    (chat(top_k=-2), "top_k", "greater than or equal to -1"),
    (chat(seed=1 << 63), "seed", "less than"),
    (chat(n=True), "n", "integer"),
    (chat(stop=5), "stop", "a string or a list of at most 4 strings"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    (chat(stop=["a", 1]), "stop", "at most 4"),
    (chat(stream="no"), "stream", "boolean"),
    (chat(stream_options={"include_usage": "no"}), "stream_options.include_usage", "boolean"),
    (chat(chat_template_kwargs={"enable_thinking": 1}), "chat_template_kwargs.enable_thinking", "boolean"),
    (json.dumps({"messages": []}).encode(), "messages", "at least 1"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "messages[0].role", "'tool'"),
    (json.dumps({"messages": ASK + [{"role": "user"}]}).encode(), "messages[1].content", "only an assistant's"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
     "messages[0].content", "text only"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode(),
     "messages[0].content", "text only"),
    (chat(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name", "pattern"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
     "tools[0].function.parameters", "an object"),
    (chat(tool_choice="always"), "tool_choice", '"auto", "required", "none"'),
    (chat(parallel_tool_calls="yes"), "parallel_tool_calls", "boolean"),
    (chat(response_format={"type": "xml"}), "response_format.type", "'json_schema'"),
    (chat(response_format={"type": "json_schema"}), "response_format", "needs a 'json_schema'"),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": 5}}),
     "response_format.json_schema.schema", "an object"),
    (chat(structured_outputs={}), "structured_outputs", "exactly one"),
    (chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one"),
    (chat(structured_outputs={"choice": []}), "structured_outputs.choice", "at least 1"),
    (chat(structured_outputs={"json": 5}), "structured_outputs.json", "JSON Schema"),
])
def test_each_wrong_field_is_named_with_what_is_wrong(raw, param, words):
    with pytest.raises(RequestError) as caught:
        read_request(raw, chat=True)
    assert caught.value.param == param
    assert words in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("prompt", ["", ["a", "b"], [], [1, -2], [1, True], 5, None])
def test_a_completion_prompt_of_another_shape_is_refused(prompt):
    with pytest.raises(RequestError) as caught:
        read_request(json.dumps({"prompt": prompt}).encode(), chat=False)
    assert caught.value.param == "prompt"


def test_what_a_request_may_carry_is_read_as_sent():
    tool = {"type": "function", "function": {"name": "get_weather", "description": "d", "strict": True,
                                             "parameters": {"type": "object", "properties": {}}}}
    raw = chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "get_weather"}},
               temperature=1, top_k=-1, seed=-(1 << 63), stop=["a", "b", "c", "d"], user="someone", store=False,
               response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}})
    request = read_request(raw, chat=True)
    assert isinstance(request, ChatRequest)
    assert request.temperature == 1.0 and request.top_k == -1 and request.stop == ["a", "b", "c", "d"]
    assert request.tools is not None and request.tools[0].model_dump(by_alias=True, exclude_unset=True) == tool
    assert request.response_format is not None and request.response_format.json_schema is not None
    assert request.response_format.json_schema.schema_ == {"type": "object"}
    assistant = read_request(json.dumps({"messages": [{"role": "assistant", "content": None, "tool_calls": []}]})
                             .encode(), chat=True)
    assert isinstance(assistant, ChatRequest) and assistant.messages[0].text() == ""
    parts = read_request(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}).encode(), chat=True)
    assert isinstance(parts, ChatRequest) and parts.messages[0].text() == "ab"
    for prompt, kept in (("hi", "hi"), (["hi"], ["hi"]), ([1, 2], [1, 2])):
        completion = read_request(json.dumps({"prompt": prompt}).encode(), chat=False)
        assert isinstance(completion, CompletionRequest) and completion.prompt == kept
