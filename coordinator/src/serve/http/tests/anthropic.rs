//! Anthropic's Messages API: request checks (pure), the SSE event sequence (pure), and the
//! endpoints over the scripted backend (shapes, headers, errors). The `anthropic` client
//! against the real engine is in tests/python/test_anthropic.py.

use super::super::anthropic::{
    parse_turns, Block, Endpoint, Events, MessagesRequest, Reply, Turn, FIELDS,
};
use super::*;

fn body(extra: Value) -> Value {
    let mut b = json!({
        "model": MODEL_ID,
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "Say hello."}],
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn parse(v: Value) -> Result<MessagesRequest, String> {
    MessagesRequest::parse(v.as_object().unwrap(), Endpoint::Create).map_err(|e| e.message)
}

fn refused(v: Value) -> String {
    parse(v).expect_err("a 400")
}

#[test]
fn a_request_maps_to_the_template_and_the_sampler() {
    let r = parse(body(json!({
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "user", "content": [{"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "stop_sequences": ["\n\n", "END"],
        "stream": true,
        "metadata": {"user_id": "u1"},
        "service_tier": "auto",
        "thinking": {"type": "disabled"},
        "cache_control": {"type": "ephemeral"},
        "container": null,
    })))
    .unwrap();
    let roles: Vec<(&str, &str)> = r
        .messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    // Consecutive user turns are one turn, as Anthropic joins them.
    assert_eq!(
        roles,
        [
            ("system", "Be brief."),
            ("user", "Hi\nthere"),
            ("assistant", "Hello!"),
            ("user", "Bye")
        ]
    );
    assert_eq!(r.prefill, None);
    assert_eq!(r.max_tokens, Some(32));
    assert_eq!(r.sampling.temperature, 0.5);
    assert_eq!(r.sampling.top_p, 0.9);
    assert_eq!(r.sampling.top_k, 5);
    assert_eq!(r.stop, ["\n\n", "END"]);
    assert!(r.stream);
    let d = parse(body(json!({}))).unwrap();
    assert_eq!(
        (d.sampling.temperature, d.sampling.top_p, d.sampling.top_k),
        (1.0, 1.0, 0),
        "Anthropic's defaults"
    );
    assert!(!d.stream && d.stop.is_empty() && d.messages.len() == 1);
}

#[test]
fn a_final_assistant_turn_is_a_prefill() {
    let r = parse(body(json!({"messages": [
        {"role": "user", "content": "Count to 3."},
        {"role": "assistant", "content": [{"type": "text", "text": "1, "}, {"type": "text", "text": "2"}]},
    ]})))
    .unwrap();
    assert_eq!(r.prefill.as_deref(), Some("1, 2"));
    assert_eq!(r.messages.len(), 1);
}

#[test]
fn every_field_we_cannot_honour_is_refused_by_name() {
    for (extra, named) in [
        (json!({"frobnicate": 1}), "`frobnicate`"),
        (json!({"n": 2, "logprobs": true}), "`n`, `logprobs`"),
        (
            json!({"thinking": {"type": "enabled", "budget_tokens": 2048}}),
            "`thinking`",
        ),
        (json!({"thinking": {"type": "adaptive"}}), "`thinking`"),
        (json!({"service_tier": "priority"}), "`service_tier`"),
        (json!({"speed": "fast"}), "`speed`"),
        (json!({"container": "c1"}), "`container`"),
        (json!({"mcp_servers": []}), "`mcp_servers`"),
        (json!({"context_management": {}}), "`context_management`"),
        (
            json!({"output_config": {"format": {"type": "json_schema"}}}),
            "`output_config`",
        ),
        (json!({"inference_geo": "us"}), "`inference_geo`"),
        (json!({"diagnostics": {}}), "`diagnostics`"),
        (
            json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            "`web_search_20250305`",
        ),
        (json!({"tool_choice": {"type": "any"}}), "`tool_choice`"),
        (json!({"temperature": 1.5}), "`temperature`"),
        (json!({"top_p": -0.1}), "`top_p`"),
        (json!({"top_k": -1}), "`top_k`"),
        (json!({"max_tokens": 0}), "`max_tokens`"),
        (json!({"max_tokens": null}), "`max_tokens`"),
        (json!({"model": null}), "`model`"),
        (json!({"stop_sequences": "x"}), "`stop_sequences`"),
        (json!({"stop_sequences": [""]}), "`stop_sequences`"),
        (json!({"stream": "yes"}), "`stream`"),
        (json!({"messages": []}), "`messages`"),
        (json!({"system": [{"type": "image"}]}), "`image`"),
    ] {
        let m = refused(body(extra.clone()));
        assert!(m.contains(named), "{extra}: {m}");
    }
    for k in ["n", "logprobs", "frobnicate"] {
        assert!(!FIELDS.contains(&k));
    }
}

#[test]
fn blocks_are_checked_and_others_refused_by_type() {
    let msgs = |content: Value| json!({"messages": [{"role": "user", "content": content}]});
    for (content, named) in [
        (json!([{"type": "image", "source": {}}]), "`image`"),
        (json!([{"type": "document", "source": {}}]), "`document`"),
        (
            json!([{"type": "thinking", "thinking": "", "signature": ""}]),
            "`thinking`",
        ),
        (
            json!([{"type": "text", "text": "x", "citations": [{"type": "char_location"}]}]),
            "`citations`",
        ),
        (
            json!([{"type": "text", "text": "x", "extra": 1}]),
            "`extra`",
        ),
        (json!([{"type": "text"}]), "`text`"),
        (json!([{"text": "x"}]), "`type`"),
        (
            json!([{"type": "tool_use", "id": "t", "name": "f", "input": {}}]),
            "`tool_use`",
        ),
        (json!(7), "`content`"),
    ] {
        let m = refused(body(msgs(content.clone())));
        assert!(m.contains(named), "{content}: {m}");
        assert!(m.contains("messages[0]"), "the place is named: {m}");
    }
    let m = refused(body(
        json!({"messages": [{"role": "system", "content": "x"}]}),
    ));
    assert!(m.contains("`system`"), "{m}");
    let m = refused(body(
        json!({"messages": [{"role": "user", "content": "x", "name": "a"}]}),
    ));
    assert!(m.contains("`name`"), "{m}");
    // Text blocks with no citations are plain text.
    let ok = parse(body(msgs(
        json!([{"type": "text", "text": "x", "citations": null}]),
    )));
    assert!(ok.is_ok());
}

#[test]
fn tool_blocks_parse_into_turns() {
    let turns = parse_turns(Some(&json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": true},
        ]},
    ])))
    .unwrap();
    assert_eq!(turns.len(), 3);
    assert_eq!(
        turns[1],
        Turn {
            assistant: true,
            blocks: vec![
                Block::Text("Looking.".into()),
                Block::ToolUse {
                    id: "toolu_1".into(),
                    name: "weather".into(),
                    input: json!({"city": "Paris"})
                }
            ]
        }
    );
    assert_eq!(
        turns[2].blocks[1],
        Block::ToolResult {
            tool_use_id: "toolu_2".into(),
            content: "boom".into(),
            is_error: true
        }
    );
    // Each in its own role's turns.
    let e = parse_turns(Some(&json!([{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}])))
    .unwrap_err();
    assert!(e.message.contains("user turns"), "{}", e.message);
    let e = parse_turns(Some(&json!([{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": []}]}])))
    .unwrap_err();
    assert!(e.message.contains("`input`"), "{}", e.message);
}

#[test]
fn count_tokens_needs_no_max_tokens() {
    let mut b = body(json!({}));
    b.as_object_mut().unwrap().remove("max_tokens");
    assert!(MessagesRequest::parse(b.as_object().unwrap(), Endpoint::CountTokens).is_ok());
    assert!(refused(b).contains("`max_tokens` is required"));
}

/// The SSE text as (event name, data) pairs, checking the framing.
fn sse_events(text: &str) -> Vec<(String, Value)> {
    assert!(text.ends_with("\n\n"), "{text:?}");
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e.split_once('\n').expect("two lines");
            let name = name.strip_prefix("event: ").expect("an event line");
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], name, "the data's type is the event's name");
            (name.to_string(), data)
        })
        .collect()
}

fn names(ev: &[(String, Value)]) -> Vec<&str> {
    ev.iter().map(|(n, _)| n.as_str()).collect()
}

#[test]
fn a_stream_is_start_ping_block_deltas_stop_delta_stop() {
    let mut e = Events::new(Reply::new("m".into(), 100, false), 12);
    let mut text = e.start();
    text += &e.text("");
    text += &e.text("Hel");
    text += &e.text("lo");
    text += &e.end("!", Finish::Stop, Some("END"), 3, 5);
    let ev = sse_events(&text);
    assert_eq!(
        names(&ev),
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let start = &ev[0].1["message"];
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    assert_eq!(start["usage"]["input_tokens"], 12);
    assert_eq!(
        ev[2].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    let deltas: String = ev[3..6]
        .iter()
        .map(|(_, d)| {
            assert_eq!(d["index"], 0);
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(deltas, "Hello!");
    assert_eq!(ev[6].1["index"], 0);
    let d = &ev[7].1;
    assert_eq!(
        d["delta"],
        json!({"stop_reason": "stop_sequence", "stop_sequence": "END"})
    );
    assert_eq!(d["usage"]["output_tokens"], 3);
    assert_eq!(
        d["usage"]["input_tokens"], 7,
        "the prompt less the reused prefix"
    );
    assert_eq!(d["usage"]["cache_read_input_tokens"], 5);
}

#[test]
fn an_empty_answer_has_no_block_and_the_stop_reasons_follow_the_finish() {
    let mut e = Events::new(Reply::new("m".into(), 4, false), 3);
    let ev = sse_events(&(e.start() + &e.end("", Finish::Length, None, 4, 0)));
    assert_eq!(
        names(&ev),
        ["message_start", "ping", "message_delta", "message_stop"]
    );
    assert_eq!(ev[2].1["delta"]["stop_reason"], "max_tokens");
    use super::super::anthropic::stop_reason as reason;
    assert_eq!(reason(Finish::Stop, None, 3, 10), "end_turn");
    assert_eq!(reason(Finish::Stop, Some("x"), 3, 10), "stop_sequence");
    assert_eq!(reason(Finish::Length, None, 10, 10), "max_tokens");
    assert_eq!(
        reason(Finish::Length, None, 7, 10),
        "model_context_window_exceeded",
        "the context ended first"
    );
    assert_eq!(reason(Finish::Cancelled, None, 1, 10), "max_tokens");
}

/// An Anthropic error with this status; its `error` object.
fn anthropic_error(r: &Resp, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(r
        .header("request-id")
        .is_some_and(|id| id.starts_with("req_")));
    v["error"].clone()
}

fn post_with(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &Value) -> Resp {
    send(
        addr,
        "POST",
        path,
        headers,
        Some(body.to_string().as_bytes()),
    )
}

#[test]
fn messages_answer_whole_with_usage_and_a_request_id() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let r = post(s.addr, "/v1/messages", &body(json!({"temperature": 0})));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r
        .header("request-id")
        .is_some_and(|id| id.starts_with("req_")));
    let v = r.json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["model"], MODEL_ID);
    assert_eq!(v["content"], json!([{"type": "text", "text": "Hello!"}]));
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["stop_sequence"], Value::Null);
    let prompt = s.backend.seen(|r| r[0].prompt.len());
    assert_eq!(v["usage"]["input_tokens"], prompt - 3);
    assert_eq!(v["usage"]["cache_read_input_tokens"], 3);
    assert_eq!(v["usage"]["output_tokens"], 4);
    s.backend.seen(|r| {
        assert_eq!(r[0].max_tokens, 32);
        assert_eq!(r[0].sampling.temperature, 0.0);
    });
}

#[test]
fn a_stop_sequence_is_reported() {
    let events = vec![
        token("Hi"),
        GenEvent::Done {
            finish: Finish::Stop,
            text: String::new(),
            prompt_tokens: 0,
            completion_tokens: 2,
            cached_tokens: 0,
            resume: Default::default(),
            stop_sequence: Some("\n".into()),
        },
    ];
    let s = start(Scripted::new(Script::Events(events)), None);
    let r = post(
        s.addr,
        "/v1/messages",
        &body(json!({"stop_sequences": ["\n"]})),
    );
    let v = r.json();
    assert_eq!(v["stop_reason"], "stop_sequence", "{v}");
    assert_eq!(v["stop_sequence"], "\n");
    assert_eq!(s.backend.seen(|r| r[0].stop.clone()), ["\n"]);
}

#[test]
fn messages_stream_named_events() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let r = post(s.addr, "/v1/messages", &body(json!({"stream": true})));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert!(r.header("request-id").is_some());
    let ev = sse_events(&r.body);
    assert_eq!(ev.first().map(|e| e.0.as_str()), Some("message_start"));
    assert_eq!(ev.last().map(|e| e.0.as_str()), Some("message_stop"));
    let text: String = ev
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, "Hello!");
}

#[test]
fn an_engine_failure_mid_stream_is_an_error_event() {
    let events = vec![
        token("Hi"),
        GenEvent::Error {
            message: "a node went away".into(),
            retry_after_s: Some(2),
        },
    ];
    let s = start(Scripted::new(Script::Events(events)), None);
    let r = post(s.addr, "/v1/messages", &body(json!({"stream": true})));
    let ev = sse_events(&r.body);
    let (name, data) = ev.last().unwrap();
    assert_eq!(name, "error");
    assert_eq!(data["error"]["type"], "overloaded_error");
    assert_eq!(data["error"]["message"], "a node went away");
}

#[test]
fn count_tokens_counts_the_rendered_prompt() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let b = body(json!({"system": "Be brief."}));
    let r = post(s.addr, "/v1/messages/count_tokens", &b);
    assert_eq!(r.status, 200, "{}", r.body);
    let n = r.json()["input_tokens"].as_u64().unwrap();
    assert_eq!(s.backend.seen(|r| r.len()), 0, "nothing is generated");
    post(s.addr, "/v1/messages", &b);
    assert_eq!(s.backend.seen(|r| r[0].prompt.len()) as u64, n);
}

#[test]
fn errors_have_anthropics_shape_and_type() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let tool = json!({"tools": [{"name": "f", "input_schema": {"type": "string"}}]});
    let e = anthropic_error(&post(s.addr, "/v1/messages", &body(tool)), 400);
    assert_eq!(e["type"], "invalid_request_error");
    assert!(e["message"].as_str().unwrap().contains("`input_schema`"));
    let e = anthropic_error(
        &send(s.addr, "POST", "/v1/messages", &[], Some(b"{nope")),
        400,
    );
    assert_eq!(e["type"], "invalid_request_error");
    let e = anthropic_error(&post(s.addr, "/v1/messages/batches", &json!({})), 404);
    assert_eq!(e["type"], "not_found_error");
    let e = anthropic_error(&get(s.addr, "/v1/messages"), 405);
    assert_eq!(e["type"], "invalid_request_error");
    let b = body(json!({}));
    let ok = post_with(
        s.addr,
        "/v1/messages",
        &[("anthropic-version", "2023-06-01")],
        &b,
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
    let r = post_with(
        s.addr,
        "/v1/messages",
        &[("anthropic-version", "latest")],
        &b,
    );
    let e = anthropic_error(&r, 400);
    assert!(e["message"].as_str().unwrap().contains("anthropic-version"));
    let full = start(Scripted::new(Script::Full), None);
    let r = post(full.addr, "/v1/messages", &b);
    assert_eq!(anthropic_error(&r, 429)["type"], "rate_limit_error");
    assert!(r.header("retry-after").is_some());
}

#[test]
fn x_api_key_is_a_key() {
    let s = start(Scripted::new(Script::Events(hello())), Some("sekrit"));
    let b = body(json!({}));
    let ok = post_with(s.addr, "/v1/messages", &[("x-api-key", "sekrit")], &b);
    assert_eq!(ok.status, 200, "{}", ok.body);
    let bearer = post_with(
        s.addr,
        "/v1/messages",
        &[("Authorization", "Bearer sekrit")],
        &b,
    );
    assert_eq!(bearer.status, 200, "{}", bearer.body);
    let r = post_with(s.addr, "/v1/messages", &[("x-api-key", "wrong")], &b);
    assert_eq!(anthropic_error(&r, 401)["type"], "authentication_error");
    let r = post(s.addr, "/v1/messages", &b);
    assert_eq!(anthropic_error(&r, 401)["type"], "authentication_error");
    // The other APIs take it too, with their own error shapes.
    let r = post_with(
        s.addr,
        "/v1/chat/completions",
        &[("x-api-key", "sekrit")],
        &chat_body(json!({})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = post_with(
        s.addr,
        "/v1/chat/completions",
        &[("x-api-key", "nope")],
        &chat_body(json!({})),
    );
    r.error(401);
}

mod tools {
    use super::super::super::anthropic::tools::{
        has_tool_blocks, tool_history, tool_reply, tool_request, tool_use_id, ToolRequest,
    };
    use super::super::super::generate::Collected;
    use super::super::super::openai::Usage;
    use super::*;
    use crate::text::tools::{Tool, ToolCall, ToolChoice, ToolFormat};

    fn weather() -> Value {
        json!([{"name": "weather", "description": "The weather in a city.",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
                "cache_control": {"type": "ephemeral"}}])
    }

    /// A conversation that called `weather` and has its result.
    fn history() -> Value {
        json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
            ]},
        ])
    }

    #[test]
    fn tools_and_tool_choice_map_to_the_engines_types() {
        let r = tool_request(Some(&weather()), None).unwrap().unwrap();
        assert_eq!(
            r,
            ToolRequest {
                tools: vec![Tool {
                    name: "weather".into(),
                    description: Some("The weather in a city.".into()),
                    parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
                }],
                choice: ToolChoice::Auto,
                parallel: false,
            }
        );
        // One call per reply unless `disable_parallel_tool_use` is explicitly false.
        for (choice, want, parallel) in [
            (json!({"type": "auto"}), ToolChoice::Auto, false),
            (
                json!({"type": "auto", "disable_parallel_tool_use": false}),
                ToolChoice::Auto,
                true,
            ),
            (
                json!({"type": "any", "disable_parallel_tool_use": true}),
                ToolChoice::Required,
                false,
            ),
            (json!({"type": "any"}), ToolChoice::Required, false),
            (
                json!({"type": "tool", "name": "weather"}),
                ToolChoice::Named("weather".into()),
                false,
            ),
            (json!({"type": "none"}), ToolChoice::None, false),
        ] {
            let r = tool_request(Some(&weather()), Some(&choice))
                .unwrap()
                .unwrap();
            assert_eq!((r.choice, r.parallel), (want, parallel), "{choice}");
        }
        assert_eq!(
            tool_request(None, Some(&json!({"type": "none"}))).unwrap(),
            None
        );
        assert_eq!(tool_request(Some(&json!([])), None).unwrap(), None);
        // A tool with no description has none.
        let bare = json!([{"name": "f", "input_schema": {"type": "object"}}]);
        let r = tool_request(Some(&bare), None).unwrap().unwrap();
        assert_eq!(r.tools[0].description, None);
        assert_eq!(r.tools[0].parameters, json!({"type": "object"}));
        for (tools, choice, named) in [
            (
                json!([{"type": "bash_20250124", "name": "bash"}]),
                Value::Null,
                "`bash_20250124`",
            ),
            (
                json!([{"name": "a b", "input_schema": {"type": "object"}}]),
                Value::Null,
                "`name`",
            ),
            (json!([{"name": "f"}]), Value::Null, "`input_schema`"),
            (
                json!([{"name": "f", "input_schema": {"type": "string"}}]),
                Value::Null,
                "object",
            ),
            (
                json!([{"name": "f", "input_schema": {"type": "object"}, "strict": true}]),
                Value::Null,
                "`strict`",
            ),
            (
                json!([{"name": "f", "description": 3, "input_schema": {"type": "object"}}]),
                Value::Null,
                "`description`",
            ),
            (
                weather(),
                json!({"type": "tool", "name": "other"}),
                "`other`",
            ),
            (weather(), json!({"type": "maybe"}), "`tool_choice`"),
            (
                weather(),
                json!({"type": "any", "disable_parallel_tool_use": "yes"}),
                "`tool_choice.disable_parallel_tool_use`",
            ),
            (json!([]), json!({"type": "any"}), "`tool_choice`"),
        ] {
            let choice = (!choice.is_null()).then_some(&choice);
            let e = tool_request(Some(&tools), choice).unwrap_err();
            assert!(
                e.message.contains(named),
                "{tools} {choice:?}: {}",
                e.message
            );
        }
        let twice = json!([{"name": "f", "input_schema": {"type": "object"}},
                           {"name": "f", "input_schema": {"type": "object"}}]);
        assert!(tool_request(Some(&twice), None)
            .unwrap_err()
            .message
            .contains("twice"));
    }

    #[test]
    fn tool_use_and_tool_result_blocks_become_calls_and_tool_messages() {
        let turns = parse_turns(Some(&json!([
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Rome"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no data", "is_error": true},
                {"type": "text", "text": "Thanks."},
            ]},
        ])))
        .unwrap();
        assert!(has_tool_blocks(&turns));
        let m = tool_history(&turns).unwrap();
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "tool", "tool", "user"]);
        assert_eq!(m[1].content, "Looking.");
        assert_eq!(
            m[1].tool_calls[1],
            ToolCall {
                id: "toolu_2".into(),
                name: "weather".into(),
                arguments: json!({"city": "Rome"})
            }
        );
        assert_eq!(
            m[3],
            Message {
                tool_call_id: Some("toolu_2".into()),
                name: Some("weather".into()),
                ..Message::new("tool", "Error: no data")
            }
        );
        assert_eq!(m[4], Message::new("user", "Thanks."));
        let orphan = parse_turns(Some(&json!([{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}])))
        .unwrap();
        assert!(tool_history(&orphan)
            .unwrap_err()
            .message
            .contains("`toolu_9`"));
    }

    #[test]
    fn a_request_with_tools_carries_them_and_its_history() {
        let r = parse(body(json!({
            "tools": weather(),
            "tool_choice": {"type": "tool", "name": "weather"},
            "messages": history(),
        })))
        .unwrap();
        let t = r.tools.expect("tools");
        assert_eq!(t.choice, ToolChoice::Named("weather".into()));
        let roles: Vec<&str> = r.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "tool"]);
        assert_eq!(
            r.messages[1].tool_calls[0].arguments,
            json!({"city": "Paris"})
        );
        // As Anthropic wants: a history with tool blocks needs the tools declared.
        let m = refused(body(json!({"messages": history()})));
        assert!(m.contains("need `tools`"), "{m}");
        assert!(parse(body(json!({}))).unwrap().tools.is_none());
    }

    #[test]
    fn call_ids_look_like_anthropics() {
        assert_eq!(tool_use_id("call_AbC123"), "toolu_AbC123");
        for odd in ["call_", "x", ""] {
            let id = tool_use_id(odd);
            let tail = id.strip_prefix("toolu_").expect("toolu_");
            assert_eq!(tail.len(), 24, "{id}");
            assert!(tail.bytes().all(|b| b.is_ascii_alphanumeric()), "{id}");
        }
        assert_ne!(tool_use_id("x"), tool_use_id("x"), "fresh each time");
    }

    /// A SmolLM2 (Hermes) reply: a sentence, then a call.
    const CALLING: &str = "Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": \
                           {\"city\": \"Paris\"}}\n</tool_call>";

    fn collected(text: &str, finish: Finish) -> Collected {
        Collected {
            text: text.into(),
            logprobs: Vec::new(),
            finish,
            stop_sequence: None,
            usage: Usage {
                prompt_tokens: 20,
                completion_tokens: 9,
                cached_tokens: 0,
                resume: Default::default(),
            },
            first_token: None,
        }
    }

    #[test]
    fn a_whole_reply_with_a_call_is_text_then_tool_use() {
        // `max_tokens` 9, the tokens `collected` made.
        let reply = Reply::new("m".into(), 9, false).tools(Some(ToolFormat::Hermes));
        let v = reply.whole(&collected(CALLING, Finish::Stop));
        assert_eq!(v["stop_reason"], "tool_use", "{v}");
        let content = v["content"].as_array().unwrap();
        assert_eq!(content.len(), 2, "{v}");
        assert_eq!(content[0], json!({"type": "text", "text": "Let me look."}));
        assert_eq!(content[1]["type"], "tool_use");
        assert_eq!(content[1]["name"], "weather");
        assert_eq!(content[1]["input"], json!({"city": "Paris"}));
        let id = content[1]["id"].as_str().unwrap();
        assert!(id.starts_with("toolu_") && id.len() == 30, "{id}");
        // Cut short, it is still `max_tokens`; a call alone has no text block.
        let call_only = &CALLING["Let me look.\n".len()..];
        let v = reply.whole(&collected(call_only, Finish::Length));
        assert_eq!(v["stop_reason"], "max_tokens");
        assert_eq!(v["content"].as_array().unwrap().len(), 1, "{v}");
        assert_eq!(v["content"][0]["type"], "tool_use");
        // Not read for calls (no tools, or `tool_choice` none): all of it is text.
        let plain = Reply::new("m".into(), 100, false).whole(&collected(CALLING, Finish::Stop));
        assert_eq!(plain["stop_reason"], "end_turn");
        assert_eq!(plain["content"], json!([{"type": "text", "text": CALLING}]));
        // Text only, read for calls: the text.
        let v = reply.whole(&collected("It is sunny.", Finish::Stop));
        assert_eq!(
            v["content"],
            json!([{"type": "text", "text": "It is sunny."}])
        );
        assert_eq!(v["stop_reason"], "end_turn");
    }

    #[test]
    fn a_streamed_call_is_a_tool_use_block_after_the_text() {
        let mut e = Events::new(
            Reply::new("m".into(), 100, false).tools(Some(ToolFormat::Hermes)),
            5,
        );
        let mut text = e.start();
        // Token by token (3 bytes each: the marker arrives in pieces).
        let bytes = CALLING.as_bytes();
        for chunk in bytes.chunks(3) {
            text += &e.text(std::str::from_utf8(chunk).unwrap());
        }
        text += &e.end("", Finish::Stop, None, 9, 0);
        let ev = sse_events(&text);
        let n = names(&ev);
        assert_eq!(n[..3], ["message_start", "ping", "content_block_start"]);
        assert_eq!(
            n[n.len() - 6..],
            [
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        let said: String = ev
            .iter()
            .filter(|(_, d)| d["delta"]["type"] == "text_delta")
            .map(|(_, d)| {
                assert_eq!(d["index"], 0);
                d["delta"]["text"].as_str().unwrap().to_string()
            })
            .collect();
        assert_eq!(said, "Let me look.");
        let start = &ev[n.len() - 5].1;
        assert_eq!(start["index"], 1);
        let block = &start["content_block"];
        assert_eq!(
            (&block["type"], &block["name"]),
            (&json!("tool_use"), &json!("weather"))
        );
        assert_eq!(block["input"], json!({}));
        assert!(block["id"].as_str().unwrap().starts_with("toolu_"));
        let delta = &ev[n.len() - 4].1["delta"];
        assert_eq!(delta["type"], "input_json_delta");
        let input: Value = serde_json::from_str(delta["partial_json"].as_str().unwrap()).unwrap();
        assert_eq!(input, json!({"city": "Paris"}));
        assert_eq!(ev[n.len() - 2].1["delta"]["stop_reason"], "tool_use");
    }

    #[test]
    fn calls_become_tool_use_blocks_whole_and_streamed() {
        let call = ToolCall {
            id: "toolu_1".into(),
            name: "weather".into(),
            arguments: json!({"city": "Paris"}),
        };
        let (content, used) = tool_reply("Let me look.", std::slice::from_ref(&call));
        assert!(used);
        assert_eq!(
            content,
            json!([{"type": "text", "text": "Let me look."},
                   {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}])
        );
        assert_eq!(
            tool_reply("Hi", &[]),
            (json!([{"type": "text", "text": "Hi"}]), false)
        );
        let mut e = Events::new(Reply::new("m".into(), 100, false), 5);
        let text = e.start()
            + &e.text("Let me look.")
            + &e.call(&call)
            + &e.end("", Finish::Stop, None, 9, 0);
        let ev = sse_events(&text);
        assert_eq!(
            names(&ev),
            [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(ev[5].1["index"], 1);
        assert_eq!(
            ev[5].1["content_block"],
            json!({"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}})
        );
        let delta = &ev[6].1["delta"];
        assert_eq!(delta["type"], "input_json_delta");
        let input: Value = serde_json::from_str(delta["partial_json"].as_str().unwrap()).unwrap();
        assert_eq!(input, call.arguments);
    }

    #[test]
    fn the_tools_and_the_history_reach_the_prompt_and_count_tokens() {
        let s = start(Scripted::new(Script::Events(hello())), None);
        let count = |b: &Value| {
            let r = post(s.addr, "/v1/messages/count_tokens", b);
            assert_eq!(r.status, 200, "{}", r.body);
            r.json()["input_tokens"].as_u64().unwrap()
        };
        let without = count(&body(json!({})));
        let with = count(&body(json!({"tools": weather()})));
        assert!(with > without + 20, "{with} vs {without}");
        // `none` renders the tools but reads no calls (and needs no grammar).
        let b = body(json!({"tools": weather(), "tool_choice": {"type": "none"},
                            "messages": history()}));
        let n = count(&b);
        let r = post(s.addr, "/v1/messages", &b);
        assert_eq!(r.status, 200, "{}", r.body);
        let prompt = s.backend.seen(|r| r[0].prompt.clone());
        assert_eq!(prompt.len() as u64, n, "count_tokens counts what runs");
        let text = vocab().tok.decode_with(&prompt, true);
        assert!(text.contains("\"weather\""), "the tools: {text}");
        assert!(
            text.contains(
                "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}"
            ),
            "the call: {text}"
        );
        assert!(
            text.contains("<tool_response>\n18 C\n</tool_response>"),
            "the result: {text}"
        );
    }

    /// The scripted model writes `CALLING` in three pieces.
    fn calling() -> Vec<GenEvent> {
        let (a, rest) = CALLING.split_at(15);
        let (b, c) = rest.split_at(20);
        vec![
            token(a),
            token(b),
            GenEvent::Done {
                finish: Finish::Stop,
                text: c.into(),
                prompt_tokens: 0,
                completion_tokens: 9,
                cached_tokens: 0,
                resume: Default::default(),
                stop_sequence: None,
            },
        ]
    }

    #[test]
    fn a_forced_call_is_constrained_and_answers_with_tool_use() {
        let s = start(Scripted::new(Script::Events(calling())), None);
        let b = body(json!({"tools": weather(), "tool_choice": {"type": "any"}}));
        let r = post(s.addr, "/v1/messages", &b);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["stop_reason"], "tool_use", "{v}");
        assert_eq!(v["content"][1]["input"], json!({"city": "Paris"}), "{v}");
        assert!(
            s.backend.seen(|r| r[0].constrained),
            "the grammar went along"
        );
        let mut sb = b.clone();
        sb["stream"] = json!(true);
        let ev = sse_events(&post(s.addr, "/v1/messages", &sb).body);
        let start = ev
            .iter()
            .find(|(_, d)| d["content_block"]["type"] == "tool_use")
            .expect("a tool_use block");
        assert_eq!(start.1["content_block"]["name"], "weather");
        let (_, delta) = &ev[ev.len() - 2];
        assert_eq!(delta["delta"]["stop_reason"], "tool_use");
        // `none`: no grammar, and the same text is only text.
        let b = body(json!({"tools": weather(), "tool_choice": {"type": "none"}}));
        let v = post(s.addr, "/v1/messages", &b).json();
        assert_eq!(
            v["content"],
            json!([{"type": "text", "text": CALLING}]),
            "{v}"
        );
        assert_eq!(v["stop_reason"], "end_turn");
        assert!(!s.backend.seen(|r| r[2].constrained));
    }
}
