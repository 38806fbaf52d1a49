"""`serve`'s structured output through the official openai client: response_format (json_object and
json_schema), vLLM's structured_outputs, and tools answered as tool_calls (whole and streamed), each reply
equal to the engine's own plain constrained reply; bad formats and tools are HTTP 400 naming the field."""

from __future__ import annotations

import json
import re

import httpx2 as httpx
import pytest
from conftest import CHATML, drafter_config, save_random_drafter, save_target, target_config
from support.tiny_tokenizers import byte_level_tokenizer

from dflash_cli.engine.generate import generate
from dflash_cli.engine.output_format import json_format, regex_format, schema_format
from dflash_cli.engine.text import encode_prompt
from dflash_cli.runtime.local import load_runtime
from dflash_cli.server.tools import ToolRequest, read_calls

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from support.live_server import BLOCK, Server  # noqa: E402 - needs openai, uvicorn and starlette, skipped above

# Hermes-style tools, as Qwen3's template renders them (shortened)
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\nCall a function with <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n"
    "{%- endif %}" + CHATML)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None},
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None},
    "properties": {"city": {"type": "string", "maxLength": 8}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None},
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _runtime(root, template):
    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = template
    cfg = target_config("qwen3", vocab_size=400, eos_token_id=tokenizer.eos_token_id,
                        bos_token_id=tokenizer.bos_token_id, max_position_embeddings=2048)
    target = save_target(root / "target", cfg, seed=1, scale=3.0)
    tokenizer.save_pretrained(target)
    drafter = save_random_drafter(root / "drafter", drafter_config(cfg), seed=2)
    return load_runtime(target, drafter, dtype="float32", device="cpu", max_context=2048)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    return _runtime(tmp_path_factory.mktemp("structured-serve"), TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def server(runtime):
    served = Server(runtime, max_tokens=200)
    yield served
    served.stop()


def engine_reply(runtime, fmt, messages=ASK, tools=None):
    ids = encode_prompt(runtime.tokenizer, messages, enable_thinking=False, tools=tools)
    return generate(runtime.target, runtime.drafter, ids, tokenizer=runtime.tokenizer, max_new_tokens=200,
                    block_size=BLOCK, output_format=fmt).text.removesuffix("<|endoftext|>")


def test_response_format_json_schema_whole_and_streamed(server, runtime):
    client = server.client()
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    whole = client.chat.completions.create(model="tiny", messages=ASK, response_format=rf)
    content = whole.choices[0].message.content
    value = json.loads(content)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
    assert whole.choices[0].finish_reason == "stop"
    assert content == engine_reply(runtime, schema_format(SCHEMA))
    streamed = client.chat.completions.create(model="tiny", messages=ASK, response_format=rf, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == content


def test_response_format_json_object(server, runtime):
    reply = server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=400,
                                                    response_format={"type": "json_object"})
    content = reply.choices[0].message.content
    assert content == engine_reply(runtime, json_format(object_only=True)) or reply.choices[0].finish_reason == "length"
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut off by max_tokens: still the start of an object
        assert content.startswith("{")


def test_structured_outputs_regex_and_choice(server, runtime):
    client = server.client()
    reply = client.chat.completions.create(model="tiny", messages=ASK,
                                           extra_body={"structured_outputs": {"regex": "[a-z]{2,5}-[0-9]{2}"}})
    content = reply.choices[0].message.content
    assert re.fullmatch("[a-z]{2,5}-[0-9]{2}", content) and content == engine_reply(
        runtime, regex_format("[a-z]{2,5}-[0-9]{2}"))
    reply = client.chat.completions.create(model="tiny", messages=ASK,
                                           extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})
    assert reply.choices[0].message.content in ("sunny", "rainy")


@pytest.mark.parametrize("choice, names", [("required", {"get_weather", "get_time"}),
                                           ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})])
def test_a_forced_tool_call_comes_back_as_tool_calls(server, runtime, choice, names):
    client = server.client()
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                           parallel_tool_calls=False)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.tool_calls
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == ({"city"} if call.function.name == "get_weather" else {"zone"})
    fmt = ToolRequest([WEATHER, TIME], choice if isinstance(choice, str) else "get_time", False).output_format()
    expected = engine_reply(runtime, fmt, tools=[WEATHER, TIME])
    assert read_calls(expected, ["get_weather", "get_time"])[1][0]["function"]["arguments"] == call.function.arguments
    streamed = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                              parallel_tool_calls=False, stream=True)
    chunks = [c for c in streamed if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == call.function.name and deltas[0].id.startswith("call_")
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert len(deltas) > 2  # the arguments stream as they are written, not in one piece at the end
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_result_turn_is_rendered_for_the_next_answer(server):
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    reply = server.client().chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                                    tool_choice="none", max_tokens=8)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason in ("stop", "length")


def test_read_calls_takes_the_templates_blocks_and_leaves_the_rest():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>')
    content, calls = read_calls(text, ["get_weather"])
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert content.startswith("Let me check.") and "unknown" in content
    assert read_calls("no calls here", ["get_weather"]) == ("no calls here", [])


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strnig"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}, "structured_outputs"),
    ({"tools": {"name": "x"}}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "chat_template_kwargs": {"enable_thinking": True}},
     "chat_template_kwargs"),
])
def test_bad_formats_and_tools_are_400_naming_the_field(server, extra, param):
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, **extra}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert "\n" not in response.json()["error"]["message"]


def test_tools_for_a_template_without_them_are_400(tmp_path):
    runtime = _runtime(tmp_path, CHATML)
    served = Server(runtime)
    try:
        response = httpx.post(served.url + "/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]},
                              timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
        assert "does not take tools" in response.json()["error"]["message"]
    finally:
        served.stop()


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_forced_calls_stream_as_deltas_whatever_the_pieces(step):
    from dflash_cli.server.tools import ForcedCallStream

    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": {"a": [1, 2]}}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    stream, deltas = ForcedCallStream(), []
    for at in range(0, len(text), step):
        deltas += stream.feed(text[at:at + step])
    _, whole = read_calls(text, ["get_weather", "get_time"])
    assert [c["function"] for c in stream.calls] == [c["function"] for c in whole]
    for index, call in enumerate(stream.calls):
        mine = [d for d in deltas if d["index"] == index]
        assert mine[0]["function"]["name"] == call["function"]["name"] and mine[0]["id"] == call["id"]
        assert "".join(d["function"]["arguments"] for d in mine) == call["function"]["arguments"]


def test_tools_reach_the_chat_template_as_sent(server, runtime):
    """Every field of a tool, those this server does not read included, is rendered into the prompt."""
    tool = {"type": "function", "function": {**WEATHER["function"], "description": "Weather now, in a city",
                                             "strict": True}, "x-vendor": {"cache": True}}
    body = {"messages": ASK, "tools": [tool], "tool_choice": "none", "max_tokens": 1}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    ids = encode_prompt(runtime.tokenizer, ASK, enable_thinking=False, tools=[tool])
    assert response.json()["usage"]["prompt_tokens"] == len(ids)
    assert len(ids) > len(encode_prompt(runtime.tokenizer, ASK, enable_thinking=False, tools=[WEATHER]))
