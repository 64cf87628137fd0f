"""Anthropic's Messages API (`/v1/messages`) of `ringllm run --serve`, spoken through the
official `anthropic` Python client: a plain message, a system prompt, a streamed message (its
text deltas make the whole message's text, greedily), stop sequences, `max_tokens`,
count_tokens against a real call's usage, the `x-api-key` header, unsupported fields and
blocks refused by name, and tools: a forced call (`any`, `tool`) whose input validates against
the tool's `input_schema` (`jsonschema` the oracle), the same call streamed, an agent loop
(call, our Python runs the tool, `tool_result` back, a text answer) and count_tokens counting
the tools. One server (with an API key) for the module."""

import json

import anthropic
import jsonschema
import pytest

from support.paths import SMOL, model_path
from support.server import SMOL_ID, Server

KEY = "anthropic-test-key"
# Sampling fields the 2.x client no longer names go in `extra_body`.
GREEDY = {"temperature": 0}
HELLO = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def srv():
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "1024", "--parallel", "2",
                "--api-key", KEY])
    yield s
    s.stop()


def client(s, key=KEY):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key=key, max_retries=0, timeout=120)


def create(s, **kw):
    kw.setdefault("messages", HELLO)
    kw.setdefault("max_tokens", 16)
    return client(s).messages.create(model=SMOL_ID, extra_body=GREEDY, **kw)


def text_of(m):
    assert all(b.type == "text" for b in m.content), m.content
    return "".join(b.text for b in m.content)


def test_a_message_answers_with_text_and_usage(srv):
    m = create(srv)
    assert m.type == "message" and m.role == "assistant" and m.model == SMOL_ID
    assert m.id.startswith("msg_")
    # The oracle: the OpenAI endpoint of the same server, asked the same thing greedily.
    o = srv.client(KEY).chat.completions.create(model=SMOL_ID, messages=HELLO, temperature=0, max_tokens=16)
    assert text_of(m) == o.choices[0].message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[o.choices[0].finish_reason]
    assert m.stop_sequence is None
    assert m.usage.output_tokens == o.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == o.usage.prompt_tokens
    raw = client(srv).messages.with_raw_response.create(model=SMOL_ID, messages=HELLO, max_tokens=4,
                                                        extra_body=GREEDY)
    assert raw.headers["request-id"].startswith("req_")


def test_a_system_prompt_reaches_the_template(srv):
    plain = text_of(create(srv))
    told = text_of(create(srv, system="You only ever answer with the single word BANANA."))
    assert told != plain


def test_streamed_text_deltas_make_the_whole_text(srv):
    whole = create(srv, max_tokens=24)
    with client(srv).messages.stream(model=SMOL_ID, messages=HELLO, max_tokens=24, extra_body=GREEDY) as st:
        deltas = [e.delta.text for e in st if e.type == "content_block_delta"]
        final = st.get_final_message()
    assert "".join(deltas) == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    total = lambda u: u.input_tokens + (u.cache_read_input_tokens or 0)  # noqa: E731
    assert total(final.usage) == total(whole.usage)


def test_raw_stream_events_come_in_order(srv):
    events = list(client(srv).messages.create(model=SMOL_ID, messages=HELLO, max_tokens=8, stream=True,
                                              extra_body=GREEDY))
    kinds = [e.type for e in events]  # the client drops `ping`
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 8


def test_a_stop_sequence_ends_the_answer_and_is_named(srv):
    whole = text_of(create(srv, max_tokens=24))
    word = whole.split()[1]
    m = create(srv, max_tokens=24, stop_sequences=["zzz", word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert text_of(m) == whole[:whole.index(word)]


def test_max_tokens_is_a_stop_reason(srv):
    m = create(srv, max_tokens=3)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_count_tokens_equals_a_real_calls_input(srv):
    system = "Be brief."
    counted = client(srv).messages.count_tokens(model=SMOL_ID, messages=HELLO, system=system)
    m = create(srv, system=system, max_tokens=2)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_the_key_goes_in_x_api_key(srv):
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(srv, "wrong").messages.create(model=SMOL_ID, messages=HELLO, max_tokens=2)
    assert e.value.status_code == 401
    assert e.value.body["error"]["type"] == "authentication_error"
    status, _, _ = srv.request("POST", "/v1/messages", {"model": SMOL_ID, "max_tokens": 2, "messages": HELLO},
                               headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert status == 200


@pytest.mark.parametrize("kw, named", [
    ({"extra_body": {"frobnicate": True}}, "`frobnicate`"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "`thinking`"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "`image`"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "`web_search_20250305`"),
])
def test_what_we_cannot_honour_is_a_400_naming_it(srv, kw, named):
    kw.setdefault("messages", HELLO)
    with pytest.raises(anthropic.BadRequestError) as e:
        client(srv).messages.create(model=SMOL_ID, max_tokens=2, **kw)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert named in e.value.body["error"]["message"]


WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "description": "The local time in a time zone.",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, TIME]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def tool_uses(m):
    return [b for b in m.content if b.type == "tool_use"]


def check_call(block, tools=TOOLS):
    """A `tool_use` block of a declared tool whose input keeps its schema."""
    assert block.id.startswith("toolu_") and len(block.id) == 30, block.id
    schema = {t["name"]: t["input_schema"] for t in tools}
    assert block.name in schema, block.name
    jsonschema.validate(block.input, schema[block.name])


def test_any_forces_a_valid_call_of_a_declared_tool(srv):
    m = create(srv, messages=ASK_WEATHER, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=80)
    calls = tool_uses(m)
    assert len(calls) == 1, m.content
    check_call(calls[0])
    assert m.stop_reason == "tool_use"


def test_a_streamed_call_is_the_same_call(srv):
    kw = dict(messages=ASK_WEATHER, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=80)
    whole = create(srv, **kw)
    with client(srv).messages.stream(model=SMOL_ID, extra_body=GREEDY, **kw) as st:
        events = list(st)
        final = st.get_final_message()
    assert final.stop_reason == "tool_use" == whole.stop_reason
    [a], [b] = tool_uses(whole), tool_uses(final)
    check_call(b)
    assert (b.name, b.input) == (a.name, a.input)
    # The input came as one `input_json_delta` after a `tool_use` start with an empty input.
    deltas = [e.delta for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(deltas) == 1 and json.loads(deltas[0].partial_json) == b.input


def test_a_named_tool_is_the_one_called(srv):
    m = create(srv, messages=ASK_WEATHER, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"},
               max_tokens=80)
    [call] = tool_uses(m)
    assert call.name == "get_time"
    check_call(call)
    assert m.stop_reason == "tool_use"


def run_tool(name, args):
    """Our side of the agent loop: the tools, run."""
    if name == "get_weather":
        return json.dumps({"city": args["city"], "sky": "sunny", "temperature": 21, "unit": args["unit"]})
    return json.dumps({"zone": args["zone"], "time": "14:05"})


def test_an_agent_loop_ends_with_a_text_answer(srv):
    """Call (forced), our Python runs the tool, its result goes back, and so on until the model
    answers in text (`auto` after the first call; a few rounds at most)."""
    messages = list(ASK_WEATHER)
    choice = {"type": "any"}
    for _ in range(3):
        m = create(srv, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=80)
        calls = tool_uses(m)
        if not calls:
            break
        assert m.stop_reason == "tool_use"
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        results = []
        for call in calls:
            check_call(call)
            results.append({"type": "tool_result", "tool_use_id": call.id, "content": run_tool(call.name, call.input)})
        messages.append({"role": "user", "content": results})
        choice = {"type": "auto"}
    else:
        # Still calling after three rounds: the tools stay declared (a history with tool
        # blocks needs them) and `none` asks for the answer now.
        m = create(srv, messages=messages, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=80)
    assert len(messages) >= 3, "at least one call was made and answered"
    assert m.stop_reason in ("end_turn", "max_tokens"), m
    assert not tool_uses(m) and text_of(m).strip()


def test_count_tokens_counts_the_tools(srv):
    c = client(srv).messages
    without = c.count_tokens(model=SMOL_ID, messages=ASK_WEATHER).input_tokens
    with_tools = c.count_tokens(model=SMOL_ID, messages=ASK_WEATHER, tools=TOOLS,
                                tool_choice={"type": "any"}).input_tokens
    assert with_tools > without
    m = create(srv, messages=ASK_WEATHER, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=80)
    assert with_tools == m.usage.input_tokens + m.usage.cache_read_input_tokens
