"""Anthropic's Messages API (`/v1/messages`) of `ringllm run --serve`, spoken through the
official `anthropic` Python client: a plain message, a system prompt, a streamed message (its
text deltas make the whole message's text, greedily), stop sequences, `max_tokens`,
count_tokens against a real call's usage, the `x-api-key` header, and unsupported fields and
blocks refused by name. One server (with an API key) for the module."""

import anthropic
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
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "`tools`"),
])
def test_what_we_cannot_honour_is_a_400_naming_it(srv, kw, named):
    kw.setdefault("messages", HELLO)
    with pytest.raises(anthropic.BadRequestError) as e:
        client(srv).messages.create(model=SMOL_ID, max_tokens=2, **kw)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert named in e.value.body["error"]["message"]
