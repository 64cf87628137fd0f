//! Ollama's API and the chat page over the scripted backend: NDJSON framing, the final
//! object's counts, `options` onto the sampler (with Ollama's defaults), errors in Ollama's
//! shape, the page's headers and the same-origin rule. The `ollama` client against the real
//! engine is in tests/python/test_ollama.py, the page in a real browser in
//! tests/python/test_chat_page.py.

use super::*;

/// An Ollama-style error with this status; its message.
fn ollama_error(r: &Resp, status: u16) -> String {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    let obj = v.as_object().expect("an object");
    assert_eq!(obj.len(), 1, "only `error`: {v}");
    v["error"].as_str().expect("a string").to_string()
}

/// NDJSON lines, each a JSON object.
pub(super) fn lines(r: &Resp) -> Vec<Value> {
    assert!(r.body.ends_with('\n'), "{:?}", r.body);
    r.body
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect()
}

pub(super) fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

#[test]
fn chat_streams_ndjson_by_default_and_ends_with_counts() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let r = post(
        s.addr,
        "/api/chat",
        &json!({"model": "x", "messages": user("Hi")}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/x-ndjson"));
    let l = lines(&r);
    let text: String = l
        .iter()
        .map(|o| o["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello!");
    // "Hel", "lo", the held-back "!", then the end (the empty token is not a line).
    assert_eq!(l.len(), 4, "{l:?}");
    for o in &l[..3] {
        assert_eq!(o["done"], false);
        assert_eq!(o["message"]["role"], "assistant");
        assert_eq!(o["model"], MODEL_ID);
        assert!(o["created_at"].as_str().unwrap().ends_with('Z'));
    }
    let last = &l[3];
    assert_eq!(last["done"], true);
    assert_eq!(last["done_reason"], "stop");
    assert_eq!(last["message"]["content"], "");
    assert_eq!(last["eval_count"], 4);
    let prompt = s.backend.seen(|r| r[0].prompt.len());
    assert_eq!(last["prompt_eval_count"], prompt);
    for k in [
        "total_duration",
        "load_duration",
        "prompt_eval_duration",
        "eval_duration",
    ] {
        assert!(last[k].is_u64(), "{k}: {last}");
    }
    let total = last["total_duration"].as_u64().unwrap();
    let parts =
        last["prompt_eval_duration"].as_u64().unwrap() + last["eval_duration"].as_u64().unwrap();
    assert!(parts <= total, "{last}");
    // The same template as /v1/chat/completions.
    let expected = vocab()
        .tok
        .encode_pieces(
            &vocab()
                .template
                .render_pieces(&[Message::new("user", "Hi")], true, &|c| {
                    vocab().tok.control_spans(c)
                })
                .unwrap()
                .pieces(),
            false,
        )
        .unwrap();
    assert_eq!(s.backend.seen(|r| r[0].prompt.clone()), expected);
}

#[test]
fn stream_false_is_one_object_and_the_name_is_echoed() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let tagged = format!("{MODEL_ID}:latest");
    let r = post(
        s.addr,
        "/api/chat",
        &json!({"model": tagged, "messages": user("Hi"), "stream": false}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["message"]["content"], "Hello!");
    assert_eq!(v["model"], tagged.as_str());
    assert_eq!(v["done"], true);
    assert_eq!(v["done_reason"], "stop");
    let r = post(
        s.addr,
        "/api/generate",
        &json!({"model": "llama3", "prompt": "Hi", "stream": false}),
    );
    let v = r.json();
    assert_eq!(v["response"], "Hello!");
    assert_eq!(
        v["model"], MODEL_ID,
        "an unknown name answers as the served model"
    );
}

#[test]
fn options_map_onto_the_sampler_with_ollamas_defaults() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let body = json!({"model": "m", "messages": user("Hi"), "stream": false});
    assert_eq!(post(s.addr, "/api/chat", &body).status, 200);
    let options = json!({
        "temperature": 0.0, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "seed": 42,
        "num_predict": 9, "stop": ["a", "b"], "repeat_penalty": 1.3,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "num_ctx": 99999, "num_gpu": 1,
    });
    let body = json!({"prompt": "Hi", "stream": false, "options": options});
    assert_eq!(post(s.addr, "/api/generate", &body).status, 200);
    let body = json!({"prompt": "Hi", "options": {"seed": -1, "num_predict": -1, "top_k": -1}});
    assert_eq!(post(s.addr, "/api/generate", &body).status, 200);
    s.backend.seen(|r| {
        let d = &r[0].sampling;
        assert_eq!(
            (
                d.temperature,
                d.top_k,
                d.top_p,
                d.repetition_penalty,
                d.seed
            ),
            (0.8, 40, 0.9, 1.1, None)
        );
        assert_eq!(r[0].max_tokens, 256 - r[0].prompt.len());
        let o = &r[1].sampling;
        assert_eq!(
            (o.temperature, o.top_p, o.top_k, o.min_p),
            (0.0, 0.5, 7, 0.1)
        );
        assert_eq!((o.repetition_penalty, o.seed), (1.3, Some(42)));
        assert_eq!((o.presence_penalty, o.frequency_penalty), (0.5, -0.5));
        assert_eq!(r[1].max_tokens, 9);
        assert_eq!(r[1].stop, ["a", "b"]);
        assert_eq!((r[2].sampling.seed, r[2].sampling.top_k), (None, 0));
        assert_eq!(r[2].max_tokens, 256 - r[2].prompt.len());
    });
}

#[test]
fn generate_uses_the_template_unless_raw() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let body = json!({"prompt": "Hi", "system": "Be brief.", "stream": false});
    assert_eq!(post(s.addr, "/api/generate", &body).status, 200);
    let body = json!({"prompt": "<|im_start|>user\nHi", "raw": true, "stream": false});
    assert_eq!(post(s.addr, "/api/generate", &body).status, 200);
    let tok = &vocab().tok;
    let msgs = [
        Message::new("system", "Be brief."),
        Message::new("user", "Hi"),
    ];
    let templated = vocab().template.render(&msgs, true).unwrap();
    let raw_ids = tok
        .encode_pieces(
            &[crate::text::tokenizer::Piece::special(
                "<|im_start|>user\nHi",
            )],
            tok.add_bos_default(),
        )
        .unwrap();
    s.backend.seen(|r| {
        assert_eq!(tok.decode_with(&r[0].prompt, true), templated);
        // Raw: the client's special-token texts are control tokens.
        assert_eq!(r[1].prompt, raw_ids);
        assert!(r[1]
            .prompt
            .contains(&tok.piece_to_id("<|im_start|>").unwrap()));
    });
}

#[test]
fn no_messages_or_prompt_is_a_load_reply() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let v = post(s.addr, "/api/chat", &json!({"model": "m", "messages": []})).json();
    assert_eq!(
        (v["done"].clone(), v["done_reason"].clone()),
        (json!(true), json!("load"))
    );
    assert_eq!(v["message"]["content"], "");
    let v = post(
        s.addr,
        "/api/generate",
        &json!({"model": "m", "keep_alive": 0}),
    )
    .json();
    assert_eq!(v["done_reason"], "unload");
    assert_eq!(v["response"], "");
    assert!(s.backend.seen(|r| r.is_empty()));
}

#[test]
fn errors_have_ollamas_shape() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let send_raw = |path: &str, body: &[u8]| send(s.addr, "POST", path, &[], Some(body));
    let m = ollama_error(&send_raw("/api/chat", b"{not json"), 400);
    assert!(m.contains("not valid"), "{m}");
    let cases = [
        (
            json!({"messages": user("x"), "tools": [{"type": "function"}]}),
            "tools",
        ),
        (json!({"messages": user("x"), "format": "yaml"}), "format"),
        (json!({"messages": user("x"), "format": 3}), "format"),
        (json!({"messages": user("x"), "think": true}), "thinking"),
        (
            json!({"messages": [{"role": "robot", "content": "x"}]}),
            "role `robot`",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}),
            "images",
        ),
        (
            json!({"messages": user("x"), "options": {"temperature": 5}}),
            "options.temperature",
        ),
        (
            json!({"messages": user("x"), "options": {"num_predict": 0}}),
            "num_predict",
        ),
        (
            json!({"messages": user("x"), "options": {"temperature": "hot"}}),
            "not valid",
        ),
    ];
    for (body, says) in cases {
        let m = ollama_error(&post(s.addr, "/api/chat", &body), 400);
        assert!(m.contains(says), "{body}: {m}");
    }
    for (body, says) in [
        (json!({"prompt": "x", "suffix": "y"}), "suffix"),
        (
            json!({"prompt": "x", "template": "{{ .Prompt }}"}),
            "template",
        ),
        (json!({"prompt": "x", "context": [1, 2]}), "context"),
    ] {
        let m = ollama_error(&post(s.addr, "/api/generate", &body), 400);
        assert!(m.contains(says), "{body}: {m}");
    }
    assert!(
        s.backend.seen(|r| r.is_empty()),
        "nothing invalid was submitted"
    );
    let m = ollama_error(&get(s.addr, "/api/pull"), 404);
    assert!(m.contains("/api/pull"), "{m}");
    ollama_error(&get(s.addr, "/api/chat"), 405);
    // The OpenAI side keeps its own shape.
    get(s.addr, "/v1/nope").error(404);

    let full = start(Scripted::new(Script::Full), None);
    let r = post(full.addr, "/api/chat", &json!({"messages": user("x")}));
    ollama_error(&r, 429);
    assert_eq!(r.header("retry-after"), Some("3"));
}

#[test]
fn options_that_are_not_an_object_are_a_400_naming_options() {
    // serde reads an array into a struct field by field: `[1.9, 0.1]` was a temperature of
    // 1.9 and a top_p of 0.1.
    let s = start(Scripted::new(Script::Events(hello())), None);
    for options in [
        json!([1.9, 0.1]),
        json!([]),
        json!("hot"),
        json!(0.5),
        json!(true),
    ] {
        for (path, body) in [
            (
                "/api/chat",
                json!({"messages": user("x"), "options": options}),
            ),
            ("/api/generate", json!({"prompt": "x", "options": options})),
        ] {
            let m = ollama_error(&post(s.addr, path, &body), 400);
            assert!(
                m.contains("`options` must be a JSON object") && m.contains("temperature"),
                "{path} {options}: {m}"
            );
        }
    }
    assert!(s.backend.seen(|r| r.is_empty()), "nothing was submitted");
    // null is no options.
    let body = json!({"prompt": "x", "stream": false, "options": null});
    assert_eq!(post(s.addr, "/api/generate", &body).status, 200);
}

#[test]
fn the_api_key_guards_ollamas_api_too() {
    let s = start(Scripted::new(Script::Events(hello())), Some("sekrit"));
    for (method, path) in [
        ("GET", "/api/tags"),
        ("GET", "/api/version"),
        ("GET", "/api/ps"),
        ("POST", "/api/show"),
        ("POST", "/api/chat"),
        ("POST", "/api/generate"),
    ] {
        let body = json!({"messages": user("x"), "prompt": "x"}).to_string();
        let r = send(s.addr, method, path, &[], Some(body.as_bytes()));
        let m = ollama_error(&r, 401);
        assert!(m.contains("API key"), "{path}: {m}");
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        let r = send(
            s.addr,
            method,
            path,
            &[("Authorization", "Bearer sekrit")],
            Some(body.as_bytes()),
        );
        assert_eq!(r.status, 200, "{path}: {}", r.body);
    }
}

#[test]
fn tags_show_version_and_ps_describe_the_served_model() {
    let card = crate::serve::http::ModelCard {
        architecture: "llama".into(),
        parameters: 134_515_008,
        quantization: "Q4_1".into(),
        size: 98_362_432,
        modified: Some(std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000)),
        digest: "00ff".into(),
        context_length: 8192,
    };
    let opts = ServeOptions {
        model: card,
        ..ServeOptions::default()
    };
    let s = start_with(Scripted::new(Script::Events(hello())), opts);
    let tags = get(s.addr, "/api/tags").json();
    let m = &tags["models"][0];
    let tagged = format!("{MODEL_ID}:latest");
    assert_eq!(m["name"], tagged.as_str());
    assert_eq!(m["model"], tagged.as_str());
    assert_eq!(m["size"], 98_362_432);
    assert_eq!(m["digest"], "00ff");
    assert_eq!(m["modified_at"], "2023-11-14T22:13:20.000000000Z");
    let details = json!({
        "parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
        "parameter_size": "134.52M", "quantization_level": "Q4_1",
    });
    assert_eq!(m["details"], details);
    let show = post(s.addr, "/api/show", &json!({"model": "anything"})).json();
    assert_eq!(show["details"], details);
    assert_eq!(show["model_info"]["general.architecture"], "llama");
    assert_eq!(show["model_info"]["llama.context_length"], 8192);
    assert_eq!(show["capabilities"], json!(["completion", "tools"]));
    assert!(show["template"].as_str().unwrap().contains("<|im_start|>"));
    let v = get(s.addr, "/api/version").json();
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    let ps = get(s.addr, "/api/ps").json();
    assert_eq!(ps["models"][0]["context_length"], 256);
}

#[test]
fn the_chat_page_is_served_with_its_types_and_a_csp() {
    let s = start(Scripted::new(Script::Events(hello())), Some("sekrit"));
    for (path, ty, has) in [
        ("/", "text/html; charset=utf-8", "<script src=\"/chat.js\""),
        (
            "/chat.js",
            "text/javascript; charset=utf-8",
            "/v1/chat/completions",
        ),
        ("/chat.css", "text/css; charset=utf-8", ".msg"),
    ] {
        // The page itself needs no key (the API calls it makes do).
        let r = get(s.addr, path);
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(r.header("content-type"), Some(ty));
        let csp = r.header("content-security-policy").unwrap();
        assert!(csp.contains("default-src 'none'") && csp.contains("script-src 'self'"));
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
        assert!(r.body.contains(has), "{path}");
    }
    // No inline script or style: the CSP would block it.
    let html = get(s.addr, "/").body;
    assert!(!html.contains("<script>") && !html.contains("style=") && !html.contains("onclick"));
}

#[test]
fn the_page_may_call_its_own_server_without_cors() {
    // No key, no --cors: other origins are refused, the page's own origin is let in when
    // its host is one of the server's own names (its address, localhost, --allow-host),
    // which a stranger's DNS cannot take over.
    let opts = ServeOptions {
        allow_hosts: vec!["gpu-box".into(), "gpu-box.local".into()],
        ..ServeOptions::default()
    };
    let s = start_with(Scripted::new(Script::Events(hello())), opts);
    let body = chat_body(json!({}));
    let call = |host: &str, origin: &str| {
        send(
            s.addr,
            "POST",
            "/v1/chat/completions",
            &[("Host", host), ("Origin", origin)],
            Some(body.to_string().as_bytes()),
        )
    };
    for (host, origin) in [
        ("127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("[::1]:8080", "http://[::1]:8080"),
        ("localhost:8080", "http://localhost:8080"),
        ("gpu-box:8080", "http://gpu-box:8080"),
        ("gpu-box.local", "http://gpu-box.local"),
    ] {
        assert_eq!(call(host, origin).status, 200, "{origin}");
    }
    // Names it was not given are refused as hosts before their origin is looked at (the
    // `.local`, `.home.arpa`, `.internal` and dotless names were let in, and an mDNS or
    // LLMNR answer on the LAN can point them anywhere); so is another machine's address.
    for (host, origin) in [
        ("other-box.local", "http://other-box.local"),
        ("gpu-box.home.arpa:8080", "http://gpu-box.home.arpa:8080"),
        ("printer:8080", "http://printer:8080"),
        ("192.168.1.20:8080", "https://192.168.1.20:8080"),
    ] {
        assert_eq!(call(host, origin).error(403)["code"], "host_not_allowed");
    }
    for (host, origin) in [
        ("127.0.0.1:8080", "http://127.0.0.1:9999"),
        ("127.0.0.1:8080", "http://evil.example"),
        ("gpu-box:8080", "http://gpu-box.evil.example:8080"),
        ("127.0.0.1:8080", "null"),
    ] {
        assert_eq!(call(host, origin).error(403)["code"], "origin_not_allowed");
    }
    let r = send(
        s.addr,
        "POST",
        "/api/chat",
        &[("Host", "127.0.0.1"), ("Origin", "http://evil.example")],
        Some(json!({"messages": user("x")}).to_string().as_bytes()),
    );
    assert!(ollama_error(&r, 403).contains("--cors"));
    assert_eq!(
        s.backend.seen(|r| r.len()),
        5,
        "only the page's own requests ran"
    );
}

#[test]
fn a_client_leaving_an_ndjson_stream_or_a_whole_answer_cancels_it() {
    for (i, (path, body)) in [
        ("/api/chat", json!({"messages": user("Tell a long story.")})),
        (
            "/api/generate",
            json!({"prompt": "Tell a long story.", "stream": false}),
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let s = start(Scripted::new(Script::Trickle), None);
        let body = body.to_string();
        let mut c = TcpStream::connect(s.addr).unwrap();
        c.write_all(&raw_request("POST", path, &[], Some(body.as_bytes())))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.backend.seen(|r| r.is_empty()) {
            assert!(Instant::now() < deadline, "{path}: never submitted");
            std::thread::sleep(Duration::from_millis(5));
        }
        if i == 0 {
            let mut buf = [0u8; 256];
            let n = c.read(&mut buf).unwrap();
            assert!(std::str::from_utf8(&buf[..n])
                .unwrap()
                .starts_with("HTTP/1.1 200"));
        }
        drop(c);
        assert!(s.backend.wait_cancelled(0), "{path}: the drop sets cancel");
    }
}

/// A reply holding a call in the model's format (Hermes on SmolLM2's template) comes back as
/// Ollama's `tool_calls`, whole and as a line of its own when streamed; the text around it
/// stays content.
#[test]
fn calls_in_the_reply_are_ollamas_tool_calls() {
    let call =
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n</tool_call>";
    let mut events: Vec<GenEvent> = ["Sure. ", &call[..9], &call[9..30], &call[30..]]
        .iter()
        .map(|t| token(t))
        .collect();
    events.push(done(Finish::Stop, 20));
    let s = start(Scripted::new(Script::Events(events)), None);
    let tools = json!([{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]);
    let body = json!({"model": "x", "messages": user("2+3?"), "tools": tools, "stream": false});
    let r = post(s.addr, "/api/chat", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["message"]["content"], "Sure.");
    assert_eq!(
        v["message"]["tool_calls"],
        json!([{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}])
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let l = lines(&post(s.addr, "/api/chat", &streamed));
    let with_calls: Vec<&Value> = l
        .iter()
        .filter(|o| o["message"].get("tool_calls").is_some())
        .collect();
    assert_eq!(with_calls.len(), 1, "{l:?}");
    assert_eq!(
        with_calls[0]["message"]["tool_calls"],
        v["message"]["tool_calls"]
    );
    let text: String = l
        .iter()
        .filter_map(|o| o["message"]["content"].as_str())
        .collect();
    assert_eq!(text, "Sure.");
    // The tools were described to the model: its prompt holds the schema.
    let prompt = s.backend.seen(|r| r[0].prompt.clone());
    assert!(vocab().tok.decode(&prompt).contains("\"add\""));
}
