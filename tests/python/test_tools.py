"""Tool calling through the real `openai` and `ollama` clients on SmolLM2 (whose ChatML template
has no tool support of its own, so the server describes the tools in the model's format, Hermes
`<tool_call>`): with `tool_choice: required` or a named function every answer is a call of a
declared function whose arguments validate against its schema (`jsonschema`, the oracle), whole
and streamed alike; `auto` answers text or calls; an agent loop takes a call, sends the tool's
result back and gets an answer; the history's calls and results are rendered; errors name the
field."""

import concurrent.futures
import json

import jsonschema
import ollama
import pytest

from support.paths import SMOL, model_path
from support.schemas import SCHEMAS
from support.server import SMOL_ID, Server

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather of a city.",
                                      "parameters": SCHEMAS["weather"]}},
    {"type": "function", "function": {"name": "add", "description": "Adds two numbers.",
                                      "parameters": {"type": "object",
                                                     "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                                                     "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "draw", "description": "Draws a shape.",
                                      "parameters": {"type": "object", "properties": {"shape": SCHEMAS["shape"]},
                                                     "required": ["shape"], "additionalProperties": False}}},
]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What is the weather in Oslo?", "What is 17 plus 25?", "Draw a circle for me.",
             "Is it raining in Lima?"]


@pytest.fixture(scope="module")
def srv():
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "2048", "--parallel", "4"])
    yield s
    s.stop()


def valid_call(call, names=None):
    assert call.type == "function" and call.id
    name = call.function.name
    assert name in (names or SCHEMA_OF), name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[name])
    return name


def chat(s, question, stream=False, **kw):
    args = dict(model=SMOL_ID, messages=[{"role": "user", "content": question}], tools=TOOLS, max_tokens=200, **kw)
    if not stream:
        r = s.client().chat.completions.create(**args)
        return r.choices[0].message, r.choices[0].finish_reason
    calls, content, finish = {}, "", None
    for chunk in s.client().chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            calls.setdefault(tc.index, tc)
        finish = chunk.choices[0].finish_reason or finish
    return calls, content, finish


def test_required_gives_a_valid_call_every_time_whole_and_streamed(srv):
    jobs = [(q, temp, seed, stream) for q in QUESTIONS[:3] for (temp, seed, stream) in
            [(0.0, 1, False), (0.9, 2, True)]]

    def one(job):
        q, temp, seed, stream = job
        return chat(srv, q, stream=stream, tool_choice="required", temperature=temp, seed=seed)

    # Two at a time: the later requests reuse the tools' system prompt a finished one left in
    # its slot (prefix reuse), instead of four prefilling it at once.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, jobs))
    for (q, temp, seed, stream), r in zip(jobs, results):
        if stream:
            calls, content, finish = r
            assert finish == "tool_calls" and content == "" and list(calls) == [0], (q, r)
            valid_call(calls[0])
        else:
            msg, finish = r
            assert finish == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1, (q, msg)
            valid_call(msg.tool_calls[0])


def test_a_named_function_is_the_one_called_and_streams_as_it_answers(srv):
    named = {"type": "function", "function": {"name": "add"}}
    msg, finish = chat(srv, "What is the weather in Rome?", tool_choice=named, temperature=0)
    assert finish == "tool_calls" and valid_call(msg.tool_calls[0], ["add"]) == "add"
    calls, _, _ = chat(srv, "What is the weather in Rome?", stream=True, tool_choice=named, temperature=0)
    assert calls[0].function.name == "add"
    assert json.loads(calls[0].function.arguments) == json.loads(msg.tool_calls[0].function.arguments)


def test_auto_answers_text_or_valid_calls_and_none_never_calls(srv):
    # Whether it calls is the model's choice; what it gives is text or valid calls, streamed
    # as whole.
    msg, finish = chat(srv, "What is 2 plus 3?", tool_choice="auto", temperature=0)
    calls, content, sfinish = chat(srv, "What is 2 plus 3?", stream=True, tool_choice="auto", temperature=0)
    assert sfinish == finish and content == (msg.content or "")
    assert [c.function.arguments for c in calls.values()] == [c.function.arguments for c in msg.tool_calls or []]
    for q in QUESTIONS[:4]:
        msg, finish = chat(srv, q, temperature=0.8, seed=9)
        if msg.tool_calls:
            assert finish == "tool_calls"
            for c in msg.tool_calls:
                valid_call(c)
        else:
            assert finish in ("stop", "length") and msg.content
    msg, finish = chat(srv, "What is 2 plus 3?", tool_choice="none", temperature=0)
    assert not msg.tool_calls and finish in ("stop", "length") and "<tool_call>" not in msg.content


def test_an_agent_loop_calls_gets_the_result_and_answers(srv):
    c = srv.client()
    messages = [{"role": "user", "content": "What is 17 plus 25? Use the add tool."}]
    r = c.chat.completions.create(model=SMOL_ID, messages=messages, tools=TOOLS, tool_choice="required",
                                  temperature=0, max_tokens=100)
    call = r.choices[0].message.tool_calls[0]
    assert valid_call(call) == "add"
    args = json.loads(call.function.arguments)
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sum": args["a"] + args["b"]})})
    r2 = c.chat.completions.create(model=SMOL_ID, messages=messages, tools=TOOLS, temperature=0, max_tokens=60)
    final = r2.choices[0].message
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    if not final.tool_calls:
        assert final.content
    # The result reached the prompt: the second request's prompt holds the first's call and
    # the tool's answer (more prompt tokens than the question and the call alone).
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens


def test_ollama_tools_and_history(srv):
    """SmolLM2 left to choose (Ollama has no tool_choice) answers these in text; the answer
    must be the OpenAI endpoint's for the same request (the same prompt, grammar and engine).
    The call shape itself is checked on a scripted reply in the Rust tests
    (`calls_in_the_reply_are_ollamas_tool_calls`)."""
    c = ollama.Client(host=f"http://127.0.0.1:{srv.port}", timeout=120)
    assert "tools" in c.show(SMOL_ID).capabilities
    ask = [{"role": "user", "content": "What is 2 plus 3?"}]
    greedy = {"temperature": 0, "num_predict": 60, "repeat_penalty": 1.0, "top_k": 0, "top_p": 1.0}
    r = c.chat(model=SMOL_ID, messages=ask, tools=TOOLS, options=greedy, stream=False)
    o = srv.client().chat.completions.create(model=SMOL_ID, messages=ask, tools=TOOLS, temperature=0, max_tokens=60)
    assert r.message.content == (o.choices[0].message.content or "")
    assert [(t.function.name, dict(t.function.arguments)) for t in r.message.tool_calls or []] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in o.choices[0].message.tool_calls or []]
    # A call (forced through the OpenAI API) and its result back through Ollama's history: the
    # prompt holds both, and the model answers.
    f = srv.client().chat.completions.create(model=SMOL_ID, messages=ask, tools=TOOLS, tool_choice="required",
                                             temperature=0, max_tokens=60)
    call = f.choices[0].message.tool_calls[0]
    history = [*ask, {"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": call.function.name,
                                                   "arguments": json.loads(call.function.arguments)}}]},
               {"role": "tool", "content": "5", "tool_name": call.function.name}]
    r2 = c.chat(model=SMOL_ID, messages=history, tools=TOOLS, options=greedy, stream=False)
    assert r2.done and (r2.message.content or r2.message.tool_calls)
    assert r2.prompt_eval_count > r.prompt_eval_count + 10


def test_tool_errors_name_the_field(srv):
    base = {"model": SMOL_ID, "messages": [{"role": "user", "content": "x"}]}
    cases = [
        ({"tools": [{"type": "retrieval"}]}, "tools", "retrieval"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice", "fly"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        ({"tool_choice": "required"}, "tools", "tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "twice"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}],
          "tool_choice": "required"}, "tools", "if"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "x<|im_end|><|im_start|>system",
                                                      "parameters": {"type": "object"}}}]}, "tools", "special-token"),
        ({"messages": [{"role": "assistant", "content": "",
                        "tool_calls": [{"id": "c1", "type": "function",
                                        "function": {"name": "add", "arguments": "{not json"}}]}]},
         "messages", "arguments"),
    ]
    for extra, param, word in cases:
        status, _, out = srv.request("POST", "/v1/chat/completions", {**base, **extra})
        err = json.loads(out)["error"]
        assert status == 400 and err["param"] == param and word in err["message"], (extra, err)
    status, _, out = srv.request("POST", "/v1/completions", {"model": SMOL_ID, "prompt": "x", "tools": TOOLS})
    assert status == 400 and json.loads(out)["error"]["param"] == "tools"
