"""Structured output: `response_format` on the OpenAI API (through the official client, its
`parse` helper included) and `format` on Ollama's (through the `ollama` client), on SmolLM2 —
a 135M model that writes invalid JSON on its own, so validity comes from the grammar. Every
output is checked by `jsonschema` (the oracle); a schema the server cannot compile, or a field
it does not support, is a 400 naming it; the ring gives the single process's bytes.

`scripts/bench-structured` runs the same schema set at ≥ 200 requests and measures speed."""

import concurrent.futures
import json
import re
from typing import Annotated

import jsonschema
import ollama
import pydantic
import pytest

from support.nodes import Nodes
from support.paths import KEY, SMOL, model_path
from support.schemas import PROMPTS, SCHEMAS
from support.server import SMOL_ID, Server


@pytest.fixture(scope="module")
def srv():
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "2048", "--parallel", "4"])
    yield s
    s.stop()


def ask(s, schema, prompt, temperature, seed, stream=False, max_tokens=160):
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    kw = dict(model=SMOL_ID, messages=[{"role": "user", "content": prompt}], temperature=temperature, seed=seed,
              max_tokens=max_tokens, response_format=rf)
    if not stream:
        r = s.client().chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in s.client().chat.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_every_output_validates_over_the_schema_set(srv):
    """Each schema of the set, greedy whole and sampled streamed, 4 requests at once (the
    ≥ 200-request run is scripts/bench-structured)."""
    jobs = []
    for name, schema in SCHEMAS.items():
        for k, (temp, stream) in enumerate([(0.0, False), (0.9, True)]):
            jobs.append((name, schema, PROMPTS[name], temp, 100 + k, stream))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda j: (j, ask(srv, j[1], j[2], j[3], j[4], j[5])), jobs))
    for (name, schema, _, temp, seed, stream), (text, finish) in results:
        assert finish == "stop", f"{name} (temp {temp}, seed {seed}): cut at max_tokens: {text!r}"
        value = json.loads(text)
        jsonschema.validate(value, schema)
    assert len(results) == 2 * len(SCHEMAS)
    m = srv.metrics()
    assert m["ringllm_grammar_masks_total"] > 0
    # The masks are computed beside the forward pass: waiting for them is a small part of
    # the time spent computing them (not a timing assertion: both are sums over the run).
    assert m["ringllm_grammar_wait_seconds_total"] <= m["ringllm_grammar_mask_seconds_total"] + 1.0


def test_greedy_constrained_output_is_deterministic_and_the_unconstrained_one_is_not_json(srv):
    schema = SCHEMAS["weather"]
    a, _ = ask(srv, schema, PROMPTS["weather"], 0.0, 1)
    b, _ = ask(srv, schema, PROMPTS["weather"], 0.0, 2, stream=True)
    assert a == b
    # Without the grammar the same model, asked the same, does not give valid JSON of the
    # schema: the grammar is what makes the answer valid.
    r = srv.client().chat.completions.create(model=SMOL_ID, messages=[{"role": "user", "content": PROMPTS["weather"]}],
                                             temperature=0, max_tokens=160)
    free = r.choices[0].message.content
    try:
        jsonschema.validate(json.loads(free), schema)
        pytest.fail(f"unconstrained output already valid, the test proves nothing: {free!r}")
    except (ValueError, jsonschema.ValidationError):
        pass


Short = Annotated[str, pydantic.StringConstraints(max_length=30)]


class City(pydantic.BaseModel):
    name: Short
    country: Short
    population_millions: float = pydantic.Field(ge=0, le=100)
    landmarks: list[Short] = pydantic.Field(max_length=3)


def test_the_openai_clients_parse_helper_gets_its_pydantic_model(srv):
    r = srv.client().chat.completions.parse(model=SMOL_ID, temperature=0, max_tokens=200, response_format=City,
                                            messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    city = r.choices[0].message.parsed
    assert isinstance(city, City)
    jsonschema.validate(json.loads(r.choices[0].message.content), City.model_json_schema())


def test_json_object_regex_and_lark(srv):
    c = srv.client()
    r = c.chat.completions.create(model=SMOL_ID, messages=[{"role": "user", "content": "A JSON object about cats."}],
                                  temperature=0.7, seed=3, max_tokens=120, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    r = c.chat.completions.create(model=SMOL_ID, messages=[{"role": "user", "content": "Is water wet? Then a year."}],
                                  temperature=1.0, seed=4, max_tokens=20,
                                  response_format={"type": "regex", "regex": "(Yes|No), [12][0-9]{3}"})
    assert re.fullmatch("(Yes|No), [12][0-9]{3}", r.choices[0].message.content)
    lark = 'start: "The answer is " ANSWER "."\nANSWER: /[0-9]+/ | "unknown"'
    r = c.completions.create(model=SMOL_ID, prompt="What is 6 times 7?", temperature=0, max_tokens=20,
                             extra_body={"response_format": {"type": "lark", "lark": lark}})
    assert re.fullmatch(r"The answer is ([0-9]+|unknown)\.", r.choices[0].text)


def test_ollama_format_schema_and_json(srv):
    c = ollama.Client(host=f"http://127.0.0.1:{srv.port}", timeout=120)
    for name in ("weather", "inventory", "contact"):
        schema = SCHEMAS[name]
        r = c.chat(model=SMOL_ID, messages=[{"role": "user", "content": PROMPTS[name]}], format=schema,
                   options={"temperature": 0.8, "seed": 5, "num_predict": 160}, stream=False)
        jsonschema.validate(json.loads(r.message.content), schema)
        text = "".join(part.response for part in c.generate(model=SMOL_ID, prompt=PROMPTS[name], format=schema,
                                                            options={"temperature": 0, "num_predict": 160},
                                                            stream=True))
        jsonschema.validate(json.loads(text), schema)
    r = c.chat(model=SMOL_ID, messages=[{"role": "user", "content": "Tell me about dogs, as JSON."}], format="json",
               options={"temperature": 0, "num_predict": 120}, stream=False)
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)


def test_what_cannot_compile_is_a_400_naming_it(srv):
    cases = [
        ({"type": "object", "if": {"required": ["a"]}, "then": {}}, "if"),
        ({"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                    {"type": "object", "properties": {"b": {"type": "string"}}}]}, "oneOf"),
        ({"type": "strnig"}, "strnig"),
        ({"$ref": "#/$defs/nowhere"}, "nowhere"),
    ]
    for schema, word in cases:
        body = {"model": SMOL_ID, "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
        status, _, out = srv.request("POST", "/v1/chat/completions", body)
        err = json.loads(out)["error"]
        assert status == 400 and err["param"] == "response_format" and word in err["message"], (schema, err)
        status, _, out = srv.request("POST", "/api/chat", {"model": SMOL_ID, "format": schema, "stream": False,
                                                          "messages": [{"role": "user", "content": "x"}]})
        assert status == 400 and word in json.loads(out)["error"], (schema, out)
    for rf, word in [({"type": "xml"}, "xml"), ({"type": "json_schema"}, "json_schema"),
                     ({"type": "regex", "regex": "("}, "regex"), ({"type": "lark", "lark": "start: nope"}, "nope")]:
        status, _, out = srv.request("POST", "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "x"}], "response_format": rf})
        assert status == 400 and word in json.loads(out)["error"]["message"], (rf, out)


# Every field the OpenAI endpoints refuse (the server's UNSUPPORTED list), each with a value
# that asks for something.
UNSUPPORTED_OPENAI = {
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "logit_bias": {"1": 5},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {"search_context_size": "low"},
    "grammar": "root ::= \"a\"",
    "store": True,
    "n": 2,
}


def test_every_unsupported_field_is_a_400_naming_it(srv):
    for field, value in UNSUPPORTED_OPENAI.items():
        for path in ("/v1/chat/completions", "/v1/completions"):
            body = {"model": SMOL_ID, "messages": [{"role": "user", "content": "x"}], "prompt": "x", field: value}
            status, _, out = srv.request("POST", path, body)
            err = json.loads(out)["error"]
            assert status == 400 and err["param"] == field and field in err["message"], (path, field, err)
    # Asking for nothing passes: null, false, text-only modalities.
    for field, value in [("logit_bias", None), ("store", False), ("modalities", ["text"])]:
        status, _, out = srv.request("POST", "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, field: value})
        assert status == 200, (field, out)


def test_the_ring_gives_the_single_process_bytes(srv):
    """Constrained greedy decoding over a 2-node ring equals one process."""
    with Nodes(2) as nodes:
        ring = Server(["up", "-m", model_path(SMOL.name), "--key", KEY, *nodes.node_flags(), "--threads", "1",
                       "-c", "2048", "--parallel", "2"])
        try:
            for name in ("order", "matrix"):
                one, _ = ask(srv, SCHEMAS[name], PROMPTS[name], 0.0, 1)
                two, finish = ask(ring, SCHEMAS[name], PROMPTS[name], 0.0, 1, stream=name == "order")
                assert finish == "stop" and two == one, name
                jsonschema.validate(json.loads(two), SCHEMAS[name])
        finally:
            ring.stop()
