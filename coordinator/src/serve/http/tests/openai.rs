//! The OpenAI endpoints on a scripted backend: answers, streams, usage, logprobs, errors.

use super::*;

#[test]
fn chat_answers_with_the_text_usage_and_the_templated_prompt() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let r = post(s.addr, "/v1/chat/completions", &chat_body(json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("application/json"));
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], MODEL_ID);
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(
        c["message"],
        json!({"role": "assistant", "content": "Hello!"})
    );
    assert_eq!(c["finish_reason"], "stop");
    assert!(c["logprobs"].is_null());
    // The prompt is the template's rendering, tokenized without an extra BOS.
    let v2 = vocab();
    let text = v2
        .template
        .render(
            &[
                Message::new("system", "Be brief."),
                Message::new("user", "Say hello."),
            ],
            true,
        )
        .unwrap();
    let want = v2.tok.encode(&text, false).unwrap();
    let (prompt, max_tokens, temperature) = s.backend.seen(|r| {
        (
            r[0].prompt.clone(),
            r[0].max_tokens,
            r[0].sampling.temperature,
        )
    });
    assert_eq!(prompt, want);
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], want.len());
    assert_eq!(u["completion_tokens"], 4);
    assert_eq!(u["total_tokens"], want.len() + 4);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 3);
    assert!(u.get("resumed").is_none() && u.get("resume_ms").is_none());
    // No max_tokens: what the context leaves; OpenAI's default temperature.
    assert_eq!(max_tokens, 256 - want.len());
    assert_eq!(temperature, 1.0);
}

#[test]
fn request_fields_reach_the_backend() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let body = json!({
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}],
        "max_tokens": 50,
        "max_completion_tokens": 9,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 7,
        "min_p": 0.1,
        "repeat_penalty": 1.2,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "seed": 42,
        "stop": ["\n\n", "END", ""],
        "logprobs": true,
        "top_logprobs": 4,
        "user": "ignored",
        "tools": [],
    });
    let r = post(s.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let msg = [Message::new("user", "one\ntwo")];
    let want = vocab()
        .tok
        .encode(&vocab().template.render(&msg, true).unwrap(), false)
        .unwrap();
    s.backend.seen(|seen| {
        let r = &seen[0];
        assert_eq!(r.prompt, want);
        assert_eq!(r.max_tokens, 9);
        let p = &r.sampling;
        assert_eq!(
            (
                p.temperature,
                p.top_p,
                p.top_k,
                p.min_p,
                p.repetition_penalty
            ),
            (0.0, 0.5, 7, 0.1, 1.2)
        );
        assert_eq!(
            (p.frequency_penalty, p.presence_penalty, p.seed),
            (0.5, -0.5, Some(42))
        );
        assert_eq!(r.stop, ["\n\n", "END"]);
        assert_eq!(r.logprobs, Some(4));
    });
    // Completions: a string prompt gets the model's BOS choice; token ids go as they are.
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Once upon", "max_tokens": 1000, "logprobs": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": [[5, 6, 7]], "stop": "x"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    s.backend.seen(|seen| {
        let want = vocab()
            .tok
            .encode("Once upon", vocab().tok.add_bos_default())
            .unwrap();
        assert_eq!(seen[1].prompt, want);
        assert_eq!(
            seen[1].max_tokens,
            256 - want.len(),
            "clamped to the context"
        );
        assert_eq!(seen[1].logprobs, Some(2));
        assert_eq!(seen[2].prompt, [5, 6, 7]);
        assert_eq!(seen[2].stop, ["x"]);
        assert_eq!(seen[2].logprobs, None);
    });
}

#[test]
fn completion_answers_with_text_and_finish_reasons() {
    let events = vec![token("Hi"), token(" there"), done(Finish::Length, 2)];
    let s = start(Scripted::new(Script::Events(events)), None);
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Say", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["choices"][0]["text"], "Hi there");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 2);

    // A stop string ends the text: finish_reason "stop".
    let events = vec![token("Hi"), done(Finish::Stop, 2)];
    let s = start(Scripted::new(Script::Events(events)), None);
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Say", "stop": ["!"]}),
    );
    assert_eq!(r.json()["choices"][0]["finish_reason"], "stop");
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Say", "stop": ["!"], "stream": true}),
    );
    let chunks = r.chunks();
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
}

#[test]
fn chat_streams_sse_chunks_ending_with_done() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body(json!({"stream": true})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    assert_eq!(r.header("cache-control"), Some("no-cache"));
    let chunks = r.chunks();
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
        assert!(c.get("usage").is_none(), "no usage unless asked: {c}");
    }
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    // The empty token is not sent; the text released at the end is.
    let deltas: Vec<&str> = chunks[1..chunks.len() - 1]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, ["Hel", "lo", "!"]);
    for c in &chunks[..chunks.len() - 1] {
        assert!(c["choices"][0]["finish_reason"].is_null());
    }
    let last = &chunks[chunks.len() - 1]["choices"][0];
    assert_eq!(last["delta"], json!({}));
    assert_eq!(last["finish_reason"], "stop");
}

/// A request resumed after a node loss says so in `usage`, streamed or not.
#[test]
fn a_resumed_request_reports_it_in_usage() {
    let mut events = hello();
    if let Some(GenEvent::Done { resume, .. }) = events.last_mut() {
        *resume = crate::serve::ResumeStats {
            resumed: 1,
            resume_ms: 812.345,
        };
    }
    let s = start(Scripted::new(Script::Events(events)), None);
    let r = post(s.addr, "/v1/chat/completions", &chat_body(json!({})));
    let u = &r.json()["usage"];
    assert_eq!(u["resumed"], 1);
    assert_eq!(u["resume_ms"], 812.3);
    let body = chat_body(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let chunks = post(s.addr, "/v1/chat/completions", &body).chunks();
    let u = &chunks[chunks.len() - 1]["usage"];
    assert_eq!(
        (u["resumed"].clone(), u["resume_ms"].clone()),
        (json!(1), json!(812.3))
    );
}

#[test]
fn include_usage_adds_a_usage_chunk_before_done() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let body = chat_body(json!({
            "prompt": "Hi", "stream": true, "stream_options": {"include_usage": true}}));
        let r = post(s.addr, path, &body);
        let chunks = r.chunks();
        let (usage, rest) = chunks.split_last().unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["completion_tokens"], 4);
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
        let n = usage["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(usage["usage"]["total_tokens"], n + 4);
        for c in rest {
            assert!(
                c["usage"].is_null(),
                "usage is null before the last chunk: {c}"
            );
        }
        assert_eq!(rest.last().unwrap()["choices"][0]["finish_reason"], "stop");
        if path == "/v1/completions" {
            assert_eq!(rest[0]["object"], "text_completion");
            let text: String = rest
                .iter()
                .map(|c| c["choices"][0]["text"].as_str().unwrap())
                .collect();
            assert_eq!(text, "Hello!");
        }
    }
}

fn lp(token: &str, logprob: f32, top: &[(&str, f32)]) -> TokenLogprob {
    TokenLogprob {
        token: token.into(),
        logprob,
        bytes: token.as_bytes().to_vec(),
        top: top
            .iter()
            .map(|&(t, l)| TopLogprob {
                token: t.into(),
                logprob: l,
                bytes: t.as_bytes().to_vec(),
            })
            .collect(),
    }
}

fn scored() -> Vec<GenEvent> {
    vec![
        GenEvent::Token {
            id: 10,
            text: "Hé".into(),
            logprob: Some(lp("Hé", -0.5, &[("Hé", -0.5), ("Ho", -1.5)])),
        },
        // Text held back (a possible stop string) still carries its log-probability.
        GenEvent::Token {
            id: 11,
            text: String::new(),
            logprob: Some(lp(" w", -0.25, &[(" w", -0.25), (" x", -2.0)])),
        },
        GenEvent::Token {
            id: 12,
            text: " wo".into(),
            logprob: Some(lp("o", -0.125, &[("o", -0.125), ("a", -3.0)])),
        },
        done(Finish::Length, 3),
    ]
}

#[test]
fn logprobs_have_openai_shapes() {
    let s = start(Scripted::new(Script::Events(scored())), None);
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body(json!({"logprobs": true, "top_logprobs": 2})),
    );
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len(), 3);
    assert_eq!(
        content[0],
        json!({"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169],
               "top_logprobs": [{"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169]},
                                {"token": "Ho", "logprob": -1.5, "bytes": [72, 111]}]})
    );
    // Streamed: one entry per chunk, also for a chunk whose text is held back.
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body(json!({"logprobs": true, "top_logprobs": 2, "stream": true})),
    );
    let chunks = r.chunks();
    let per_chunk: Vec<Value> = chunks[1..4]
        .iter()
        .map(|c| c["choices"][0]["logprobs"]["content"][0].clone())
        .collect();
    assert_eq!(per_chunk, content);
    assert_eq!(chunks[2]["choices"][0]["delta"]["content"], "");

    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "logprobs": 2}),
    );
    let v = r.json();
    let l = &v["choices"][0]["logprobs"];
    assert_eq!(l["tokens"], json!(["Hé", " w", "o"]));
    assert_eq!(l["token_logprobs"], json!([-0.5, -0.25, -0.125]));
    assert_eq!(l["top_logprobs"][0], json!({"Hé": -0.5, "Ho": -1.5}));
    assert_eq!(l["text_offset"], json!([0, 2, 2]));
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "logprobs": 2, "stream": true}),
    );
    let chunks = r.chunks();
    assert_eq!(chunks[1]["choices"][0]["logprobs"]["tokens"], json!([" w"]));
    assert_eq!(
        chunks[1]["choices"][0]["logprobs"]["text_offset"],
        json!([2])
    );
}

#[test]
fn an_engine_error_is_a_500_or_an_error_chunk() {
    let events = vec![
        token("Hi"),
        GenEvent::Error {
            message: "node 2 is gone".into(),
            retry_after_s: None,
        },
    ];
    let s = start(Scripted::new(Script::Events(events)), None);
    let r = post(s.addr, "/v1/completions", &json!({"prompt": "x"}));
    let e = r.error(500);
    assert_eq!(e["message"], "node 2 is gone");
    assert_eq!(e["type"], "server_error");
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "stream": true}),
    );
    let chunks = r.chunks();
    assert_eq!(chunks[0]["choices"][0]["text"], "Hi");
    assert_eq!(chunks[1]["error"]["message"], "node 2 is gone");
}

#[test]
fn malformed_and_invalid_bodies_are_openai_400s() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let chat = "/v1/chat/completions";
    let r = send(s.addr, "POST", chat, &[], Some(b"{not json"));
    let e = r.error(400);
    assert_eq!(e["type"], "invalid_request_error");
    let r = send(s.addr, "POST", chat, &[], Some(b""));
    r.error(400);
    let r = post(s.addr, chat, &json!({"model": MODEL_ID}));
    assert_eq!(r.error(400)["param"], "messages");
    let r = post(s.addr, chat, &json!({"messages": "hi"}));
    r.error(400);
    let r = post(s.addr, "/v1/completions", &json!({"max_tokens": 3}));
    assert_eq!(r.error(400)["param"], "prompt");
    let cases = [
        (json!({"temperature": 2.5}), "temperature"),
        (json!({"top_p": -0.1}), "top_p"),
        (json!({"presence_penalty": 3}), "presence_penalty"),
        (json!({"frequency_penalty": -2.5}), "frequency_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"n": 2}), "n"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (
            json!({"top_logprobs": 21, "logprobs": true}),
            "top_logprobs",
        ),
        (json!({"stop": vec!["a"; 17]}), "stop"),
        (json!({"stop": 5}), "stop"),
        (
            json!({"messages": [{"role": "robot", "content": "x"}]}),
            "messages",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
            "messages",
        ),
    ];
    for (extra, param) in cases {
        let r = post(s.addr, chat, &chat_body(extra.clone()));
        assert_eq!(r.error(400)["param"], param, "{extra}");
    }
    for (body, param) in [
        (json!({"prompt": "x", "echo": true}), "echo"),
        (json!({"prompt": "x", "logprobs": 6}), "logprobs"),
        (json!({"prompt": ["a", "b"]}), "prompt"),
        (json!({"prompt": [1, "b"]}), "prompt"),
        (json!({"prompt": [99_999_999]}), "prompt"),
        (json!({"prompt": ""}), "prompt"),
    ] {
        let r = post(s.addr, "/v1/completions", &body);
        assert_eq!(r.error(400)["param"], param, "{body}");
    }
    assert!(
        s.backend.seen(|r| r.is_empty()),
        "nothing invalid was submitted"
    );
}

#[test]
fn an_unknown_model_name_gets_the_served_model() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    // As llama-server does: any name is the one model served (with a warning in the log).
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body(json!({"model": "gpt-4o"})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], MODEL_ID);
    assert_eq!(r.json()["choices"][0]["message"]["content"], "Hello!");
    // Absent or empty: the served model.
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "model": ""}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(s.backend.seen(|r| r.len()), 2);
    // Looking a model up by name is not a request to run one: an unknown name is an error.
    let r = get(s.addr, "/v1/models/other");
    assert_eq!(r.error(400)["code"], "model_not_found");
}

#[test]
fn a_prompt_that_fills_the_context_is_a_400_with_both_numbers() {
    let s = start(Scripted::new(Script::Events(hello())).ctx(16), None);
    let long = "word ".repeat(40);
    let n = vocab()
        .tok
        .encode(&long, vocab().tok.add_bos_default())
        .unwrap()
        .len();
    let r = post(s.addr, "/v1/completions", &json!({"prompt": long}));
    let e = r.error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    let m = e["message"].as_str().unwrap();
    assert!(m.contains("16") && m.contains(&n.to_string()), "{m}");
    // A prompt of ctx - 1 tokens leaves room for one.
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": (0..15).collect::<Vec<u32>>()}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(s.backend.seen(|r| r[0].max_tokens), 1);
}

#[test]
fn no_template_is_a_400_that_says_so() {
    let mut b = Scripted::new(Script::Events(hello()));
    b.has_template = false;
    let s = start(b, None);
    let r = post(s.addr, "/v1/chat/completions", &chat_body(json!({})));
    assert!(r.error(400)["message"]
        .as_str()
        .unwrap()
        .contains("template"));
}
