//! The server as a server: queue and key refusals, CORS, metrics, health, body limits,
//! clients that leave, shutdown, and slow or idle connections.

use super::*;

#[test]
fn a_full_queue_is_a_429_with_retry_after() {
    let s = start(Scripted::new(Script::Full), None);
    let r = post(s.addr, "/v1/completions", &json!({"prompt": "x"}));
    assert_eq!(r.error(429)["code"], "queue_full");
    assert_eq!(r.header("retry-after"), Some("3"));
}

#[test]
fn an_api_key_guards_all_but_health() {
    let s = start(Scripted::new(Script::Events(hello())), Some("sekrit"));
    let r = get(s.addr, "/v1/models");
    assert_eq!(r.error(401)["code"], "invalid_api_key");
    let r = send(
        s.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer wrong")],
        None,
    );
    r.error(401);
    let r = send(
        s.addr,
        "POST",
        "/v1/completions",
        &[],
        Some(b"{\"prompt\": \"x\"}"),
    );
    r.error(401);
    let r = get(s.addr, "/metrics");
    r.error(401);
    let r = send(
        s.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer sekrit")],
        None,
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["data"][0]["id"], MODEL_ID);
    assert_eq!(get(s.addr, "/health").status, 200);
    assert!(s.backend.seen(|r| r.is_empty()));
}

#[test]
fn cors_preflight_and_headers() {
    let s = start(Scripted::new(Script::Events(hello())), Some("k"));
    let r = send(
        s.addr,
        "OPTIONS",
        "/v1/chat/completions",
        &[
            ("Origin", "http://localhost:3000"),
            ("Access-Control-Request-Method", "POST"),
            (
                "Access-Control-Request-Headers",
                "authorization, content-type",
            ),
        ],
        None,
    );
    assert!(r.status == 200 || r.status == 204, "{}", r.status);
    assert_eq!(r.header("access-control-allow-origin"), Some("*"));
    let methods = r
        .header("access-control-allow-methods")
        .unwrap()
        .to_ascii_uppercase();
    assert!(
        methods.contains("POST") && methods.contains("GET"),
        "{methods}"
    );
    let headers = r
        .header("access-control-allow-headers")
        .unwrap()
        .to_ascii_lowercase();
    assert!(
        headers.contains("authorization") && headers.contains("content-type"),
        "{headers}"
    );
    // Plain responses, errors included, carry the origin header too.
    let r = send(s.addr, "GET", "/v1/models", &[("Origin", "http://x")], None);
    assert_eq!(r.status, 401);
    assert_eq!(r.header("access-control-allow-origin"), Some("*"));
}

#[test]
fn metrics_are_prometheus_text() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let r = get(s.addr, "/metrics");
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/plain"));
    let t = &r.body;
    for (name, kind, value) in [
        ("ringllm_requests_total", "counter", "7"),
        ("ringllm_requests_failed_total", "counter", "1"),
        ("ringllm_prompt_tokens_total", "counter", "70"),
        ("ringllm_completion_tokens_total", "counter", "35"),
        ("ringllm_queue_depth", "gauge", "2"),
        ("ringllm_slots_total", "gauge", "4"),
        ("ringllm_slots_busy", "gauge", "3"),
        ("ringllm_decode_tokens_per_second", "gauge", "12.5"),
        ("ringllm_grammar_masks_total", "counter", "0"),
        ("ringllm_grammar_wait_seconds_total", "counter", "0"),
    ] {
        assert!(t.contains(&format!("# HELP {name} ")), "{name}");
        assert!(t.contains(&format!("# TYPE {name} {kind}\n")), "{name}");
        assert!(t.contains(&format!("\n{name} {value}\n")), "{name}: {t}");
    }
    assert!(t.contains("# TYPE ringllm_node_latency_ms gauge\n"));
    assert!(
        t.contains("\nringllm_node_latency_ms{node=\"node-a\"} 1.5\n"),
        "{t}"
    );
    assert!(
        t.contains("\nringllm_node_latency_ms{node=\"b\\\"1\"} 0.25\n"),
        "{t}"
    );
    // Every sample line is NAME[{labels}] VALUE.
    for line in t.lines().filter(|l| !l.starts_with('#')) {
        let (_, v) = line.rsplit_once(' ').unwrap();
        v.parse::<f64>().unwrap();
    }
}

#[test]
fn models_health_and_unknown_paths() {
    // Through `router` alone, as an embedder would serve it.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(
        Arc::new(Scripted::new(Script::Silent)),
        &ServeOptions::default(),
    )
    .unwrap();
    rt.spawn(async move { axum::serve(listener, app).await });
    let v = get(addr, "/v1/models").json();
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 1);
    assert_eq!(data[0]["id"], MODEL_ID);
    assert_eq!(data[0]["object"], "model");
    assert_eq!(data[0]["owned_by"], "ringllm");
    assert_eq!(
        get(addr, &format!("/v1/models/{MODEL_ID}")).json()["id"],
        MODEL_ID
    );
    let r = get(addr, "/health");
    assert_eq!((r.status, r.json()), (200, json!({"status": "ok"})));
    let r = get(addr, "/v1/nothing-here");
    assert_eq!(r.error(404)["code"], "not_found");
    let r = get(addr, "/v1/chat/completions");
    r.error(405);
    rt.shutdown_timeout(Duration::from_secs(1));
}

#[test]
fn a_body_over_the_limit_is_a_json_413() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    // Only the headers: the server answers from Content-Length without reading the body (so
    // the client never writes into a closed connection).
    let mut c = TcpStream::connect(s.addr).unwrap();
    let head =
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                Content-Length: 5242880\r\n\r\n";
    c.write_all(head.as_bytes()).unwrap();
    let mut raw = Vec::new();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.read_to_end(&mut raw).unwrap();
    assert_eq!(parse(&raw).error(413)["code"], "request_too_large");
}

#[test]
fn a_client_leaving_a_stream_cancels_it() {
    let s = start(Scripted::new(Script::Trickle), None);
    let body = json!({"prompt": "Tell a long story.", "stream": true}).to_string();
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.write_all(&raw_request(
        "POST",
        "/v1/completions",
        &[],
        Some(body.as_bytes()),
    ))
    .unwrap();
    let mut buf = [0u8; 256];
    let n = c.read(&mut buf).unwrap();
    assert!(std::str::from_utf8(&buf[..n])
        .unwrap()
        .starts_with("HTTP/1.1 200"));
    assert!(!s.backend.wait_cancelled_quickly(0));
    drop(c);
    assert!(s.backend.wait_cancelled(0), "the stream's drop sets cancel");
}

#[test]
fn a_client_leaving_a_whole_response_cancels_it() {
    let s = start(Scripted::new(Script::Silent), None);
    let body = json!({"prompt": "Tell a long story."}).to_string();
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.write_all(&raw_request(
        "POST",
        "/v1/completions",
        &[],
        Some(body.as_bytes()),
    ))
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.backend.seen(|r| r.is_empty()) {
        assert!(Instant::now() < deadline, "never submitted");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!s.backend.wait_cancelled_quickly(0));
    drop(c);
    assert!(
        s.backend.wait_cancelled(0),
        "the handler's drop sets cancel"
    );
}

impl Scripted {
    /// Whether the flag gets set within 100 ms (it must not be, while the client waits).
    fn wait_cancelled_quickly(&self, i: usize) -> bool {
        std::thread::sleep(Duration::from_millis(100));
        self.seen(|s| s[i].cancel.load(Ordering::SeqCst))
    }
}

#[test]
fn shutdown_ends_open_streams_properly_then_returns() {
    let mut s = start(Scripted::new(Script::Trickle), None);
    let addr = s.addr;
    let client = std::thread::spawn(move || {
        post(
            addr,
            "/v1/chat/completions",
            &chat_body(json!({"stream": true})),
        )
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.backend.seen(|r| r.is_empty()) {
        assert!(Instant::now() < deadline, "never submitted");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    s.shutdown().expect("clean shutdown");
    let r = client.join().unwrap();
    let chunks = r.chunks();
    assert!(chunks.len() > 2);
    let last = &chunks.last().unwrap()["choices"][0];
    assert_eq!(last["finish_reason"], "length");
    assert!(
        s.backend.shut.load(Ordering::SeqCst),
        "backend.shutdown() was called"
    );
    // Nothing listens any more.
    assert!(TcpStream::connect(addr).is_err());
}

fn unavailable() -> GenEvent {
    GenEvent::Error {
        message: "node 'n2' (10.0.0.2:7701) stopped answering".into(),
        retry_after_s: Some(5),
    }
}

#[test]
fn an_engine_that_cannot_serve_now_is_a_503_with_retry_after() {
    let s = start(Scripted::new(Script::Events(vec![unavailable()])), None);
    for stream in [false, true] {
        let r = post(
            s.addr,
            "/v1/completions",
            &json!({"prompt": "x", "stream": stream}),
        );
        let e = r.error(503);
        assert!(e["message"].as_str().unwrap().contains("'n2'"), "{e}");
        assert_eq!(e["code"], "engine_unavailable");
        assert_eq!(r.header("retry-after"), Some("5"), "stream: {stream}");
    }
    // After a token, a whole response is still a 503; a stream ends with an error chunk.
    let s = start(
        Scripted::new(Script::Events(vec![token("Hi"), unavailable()])),
        None,
    );
    let r = post(s.addr, "/v1/completions", &json!({"prompt": "x"}));
    r.error(503);
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "stream": true}),
    );
    assert_eq!(r.status, 200);
    assert!(r.chunks()[1]["error"]["message"].is_string());
}

#[test]
fn health_reflects_the_ring() {
    let down = Health {
        ready: false,
        nodes: Vec::new(),
        missing: vec!["n1 (10.0.0.1:7701)".into(), "n2 (10.0.0.2:7701)".into()],
        error: Some("node(s) 'n1', 'n2' do not answer".into()),
    };
    let s = start(Scripted::new(Script::Silent).health(down), Some("k"));
    let r = get(s.addr, "/health");
    assert_eq!(r.status, 503);
    assert_eq!(r.header("retry-after"), Some("5"));
    let v = r.json();
    assert_eq!(v["status"], "unavailable");
    assert_eq!(v["missing"][1], "n2 (10.0.0.2:7701)");
    assert!(v["error"].as_str().unwrap().contains("do not answer"));
    let degraded = Health {
        ready: true,
        nodes: vec!["n1 (10.0.0.1:7701)".into()],
        missing: vec!["n2 (10.0.0.2:7701)".into()],
        error: Some("the ring runs without n2 (10.0.0.2:7701)".into()),
    };
    let s = start(Scripted::new(Script::Silent).health(degraded), None);
    let r = get(s.addr, "/health");
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["status"], "degraded");
    assert_eq!(r.json()["nodes"][0], "n1 (10.0.0.1:7701)");
}

#[test]
fn cross_origin_only_with_a_key_or_a_named_origin() {
    let preflight = [
        ("Origin", "http://evil.example"),
        ("Access-Control-Request-Method", "POST"),
        ("Access-Control-Request-Headers", "content-type"),
    ];
    let body = json!({"prompt": "x"}).to_string();
    // No key, no --cors: no CORS headers, and a page's request is refused before it runs.
    let s = start(Scripted::new(Script::Events(hello())), None);
    let r = send(s.addr, "OPTIONS", "/v1/completions", &preflight, None);
    assert_eq!(
        r.header("access-control-allow-origin"),
        None,
        "{}",
        r.status
    );
    let r = send(
        s.addr,
        "POST",
        "/v1/completions",
        &[("Origin", "http://evil.example")],
        Some(body.as_bytes()),
    );
    assert_eq!(r.error(403)["code"], "origin_not_allowed");
    assert!(s.backend.seen(|r| r.is_empty()), "nothing was generated");
    // Clients that are not browsers send no Origin.
    assert_eq!(
        post(s.addr, "/v1/completions", &json!({"prompt": "x"})).status,
        200
    );
    // --cors names the origins allowed.
    let opts = ServeOptions {
        cors: vec!["http://localhost:3000".into()],
        ..ServeOptions::default()
    };
    let s = start_with(Scripted::new(Script::Events(hello())), opts);
    let ok = [("Origin", "http://localhost:3000")];
    let r = send(
        s.addr,
        "POST",
        "/v1/completions",
        &ok,
        Some(body.as_bytes()),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://localhost:3000")
    );
    let r = send(s.addr, "OPTIONS", "/v1/completions", &preflight, None);
    assert_eq!(r.header("access-control-allow-origin"), None);
    let r = send(
        s.addr,
        "POST",
        "/v1/completions",
        &[("Origin", "http://evil.example")],
        Some(body.as_bytes()),
    );
    r.error(403);
}

/// A connection that has sent `bytes` and then nothing.
fn stalled(addr: SocketAddr, bytes: &str) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(bytes.as_bytes()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c
}

/// Reads until the server closes the connection (an error if it does not within the read
/// timeout); what it sent.
fn until_closed(c: &mut TcpStream) -> std::io::Result<String> {
    let mut raw = Vec::new();
    c.read_to_end(&mut raw)?;
    Ok(String::from_utf8_lossy(&raw).into_owned())
}

#[test]
fn a_request_head_that_never_ends_is_cut_off() {
    let opts = ServeOptions {
        header_timeout: Duration::from_millis(200),
        ..ServeOptions::default()
    };
    let s = start_with(Scripted::new(Script::Events(hello())), opts);
    let mut c = stalled(s.addr, "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n");
    until_closed(&mut c).expect("the server closes a connection whose head never ends");
    // Idle between requests counts the same.
    let mut c = stalled(s.addr, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    let got = until_closed(&mut c).expect("an idle kept-alive connection is closed");
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
}

#[test]
fn a_body_that_never_arrives_is_a_408() {
    let opts = ServeOptions {
        body_timeout: Duration::from_millis(300),
        ..ServeOptions::default()
    };
    let s = start_with(Scripted::new(Script::Events(hello())), opts);
    let mut c = stalled(
        s.addr,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 50\r\n\r\n{\"pro",
    );
    let got = until_closed(&mut c).unwrap();
    assert_eq!(parse(got.as_bytes()).error(408)["code"], "body_timeout");
}

#[test]
fn at_the_connection_cap_idle_connections_make_room_and_busy_ones_stay() {
    let opts = ServeOptions {
        max_connections: 4,
        ..ServeOptions::default()
    };
    let s = start_with(Scripted::new(Script::Silent), opts);
    let mut slow: Vec<TcpStream> = (0..4)
        .map(|_| stalled(s.addr, "GET /v1/models HTTP/1.1\r\n"))
        .collect();
    // Each connection is registered before the next is accepted; a request still goes through.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(get(s.addr, "/health").status, 200);
    // It took the place of the oldest stalled connection.
    until_closed(&mut slow[0]).expect("the oldest idle connection is closed");
    // Four requests in progress fill the cap; a fifth connection is refused with a 503.
    let body = json!({"prompt": "x"}).to_string();
    let busy: Vec<TcpStream> = (0..4)
        .map(|_| {
            let c = stalled(s.addr, "");
            let mut c2 = c.try_clone().unwrap();
            c2.write_all(&raw_request(
                "POST",
                "/v1/completions",
                &[],
                Some(body.as_bytes()),
            ))
            .unwrap();
            c
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.backend.seen(|r| r.len()) < 4 {
        assert!(Instant::now() < deadline, "never submitted");
        std::thread::sleep(Duration::from_millis(5));
    }
    let r = get(s.addr, "/health");
    assert_eq!(r.error(503)["code"], "too_many_connections");
    assert_eq!(r.header("retry-after"), Some("1"));
    drop(busy);
}

/// A GET with this `Host`.
fn get_for(addr: SocketAddr, host: &str, path: &str) -> Resp {
    send(addr, "GET", path, &[("Host", host)], None)
}

#[test]
fn a_server_without_a_key_answers_only_to_its_own_host_names() {
    // DNS rebinding: a page of evil.example points its name at this server once loaded; its
    // requests then carry `Host: evil.example:PORT`.
    let c = Counter::start();
    let view = ClusterView {
        key: ringllm_protocol::ClusterKey::from_bytes(b"test key").unwrap(),
        nodes: vec![("n1".into(), c.addr.to_string())],
    };
    let s = start(Scripted::new(Script::Silent).cluster(view.clone()), None);
    let port = s.addr.port();
    for path in ["/metrics", "/v1/models", "/v1/cluster", "/health", "/"] {
        let r = get_for(s.addr, &format!("evil.example:{port}"), path);
        let e = r.error(403);
        assert_eq!(e["code"], "host_not_allowed", "{path}");
        let m = e["message"].as_str().unwrap();
        assert!(
            m.contains("evil.example") && m.contains("--allow-host evil.example"),
            "{path}: {m}"
        );
    }
    let r = get_for(s.addr, "evil.example", "/api/tags");
    assert_eq!(r.status, 403);
    assert!(r.json()["error"].as_str().unwrap().contains("--allow-host"));
    assert_eq!(c.count(), 0, "no node was asked for a refused request");
    // Its own address, and localhost since it listens on loopback.
    for host in [format!("127.0.0.1:{port}"), format!("localhost:{port}")] {
        assert_eq!(get_for(s.addr, &host, "/v1/models").status, 200, "{host}");
        assert_eq!(get_for(s.addr, &host, "/api/tags").status, 200, "{host}");
    }
    // Names given with --allow-host.
    let opts = ServeOptions {
        allow_hosts: vec!["gpu-box.local".into()],
        ..ServeOptions::default()
    };
    let s = start_with(Scripted::new(Script::Silent), opts);
    assert_eq!(
        get_for(s.addr, "gpu-box.local:8080", "/metrics").status,
        200
    );
    assert_eq!(get_for(s.addr, "GPU-box.local.", "/metrics").status, 200);
    get_for(s.addr, "evil.example", "/metrics").error(403);
    // With an API key the key guards the data, whatever the name.
    let s = start(Scripted::new(Script::Silent), Some("sekrit"));
    get_for(s.addr, "evil.example", "/metrics").error(401);
    let r = send(
        s.addr,
        "GET",
        "/metrics",
        &[
            ("Host", "llm.example.com"),
            ("Authorization", "Bearer sekrit"),
        ],
        None,
    );
    assert_eq!(r.status, 200);
}

/// A listener that counts the connections made to it and closes each at once (a node that
/// refuses every status question).
struct Counter {
    addr: SocketAddr,
    count: Arc<std::sync::atomic::AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Counter {
    fn start() -> Counter {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (n, stopped) = (Arc::clone(&count), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            while !stopped.load(Ordering::SeqCst) {
                match l.accept() {
                    Ok((c, _)) => {
                        n.fetch_add(1, Ordering::SeqCst);
                        drop(c);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Counter {
            addr,
            count,
            stop,
            thread: Some(thread),
        }
    }

    fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn cluster_status_asks_the_nodes_at_most_once_a_second_whatever_the_request_rate() {
    let (a, b) = (Counter::start(), Counter::start());
    let view = ClusterView {
        key: ringllm_protocol::ClusterKey::from_bytes(b"test key").unwrap(),
        nodes: vec![
            ("n1".into(), a.addr.to_string()),
            ("n2".into(), b.addr.to_string()),
        ],
    };
    let s = start(Scripted::new(Script::Silent).cluster(view), None);
    // 48 requests from 8 clients at once.
    let t0 = Instant::now();
    let answers: Vec<Value> = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..8)
            .map(|_| {
                scope.spawn(|| {
                    (0..6)
                        .map(|_| {
                            let r = get(s.addr, "/v1/cluster");
                            assert_eq!(r.status, 200, "{}", r.body);
                            r.json()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        clients
            .into_iter()
            .flat_map(|c| c.join().unwrap())
            .collect()
    });
    let seconds = t0.elapsed().as_secs() as usize;
    for v in &answers {
        assert_eq!(v["coordinator"]["model"], MODEL_ID);
        let nodes = v["nodes"].as_array().unwrap();
        assert_eq!(nodes.len(), 2, "{v}");
        // The nodes refused: each keeps the name the cluster gave it.
        assert_eq!(
            (&nodes[0]["name"], &nodes[1]["name"]),
            (&json!("n1"), &json!("n2"))
        );
        assert_eq!(nodes[0]["health"], "error", "{v}");
    }
    // Once a second at most (one more for a refresh across a second's boundary); before,
    // every request asked every node: 48 each.
    for (name, c) in [("n1", &a), ("n2", &b)] {
        assert!(
            (1..=seconds + 2).contains(&c.count()),
            "{name} was asked {} times in {seconds} s for {} requests",
            c.count(),
            answers.len()
        );
    }
    // Older than a second: asked again.
    let before = a.count();
    std::thread::sleep(super::super::cluster::FRESH + Duration::from_millis(100));
    assert_eq!(get(s.addr, "/v1/cluster").status, 200);
    assert!(a.count() > before, "stale answers are refreshed");
}
