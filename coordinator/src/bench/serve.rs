//! `ringllm bench serve URL --concurrency 1,2,4,8`: a load generator for a running server.
//! Each client sends streaming completions one after another; per concurrency level it
//! reports the aggregate decode tokens/s, the mean per-request tokens/s, and time to first
//! token (p50/p99). Plain HTTP/1.1 over a socket: no client library between us and the server.

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use serde::Serialize;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Serialize)]
struct Level {
    concurrency: usize,
    requests: usize,
    aggregate_tokens_per_s: f64,
    per_request_tokens_per_s: f64,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
}

struct One {
    ttft: Duration,
    tokens: usize,
    decode: Duration,
}

fn host_port(url: &str) -> Result<String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("bench serve takes http://HOST:PORT, not '{url}'"))?;
    Ok(rest
        .trim_end_matches('/')
        .trim_end_matches("/v1")
        .to_string())
}

/// One streaming completion; returns time to first token, tokens and the decode time after it.
fn request(
    addr: &str,
    key: Option<&str>,
    model: &str,
    prompt: &str,
    max_tokens: usize,
    format: Option<&serde_json::Value>,
) -> Result<One> {
    let mut body = serde_json::json!({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": true,
        "temperature": 0.8, "seed": 1, "stream_options": {"include_usage": true},
    });
    if let Some(f) = format {
        body["response_format"] = f.clone();
    }
    let body = body.to_string();
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut r = BufReader::new(s);
    let mut status = String::new();
    r.read_line(&mut status)?;
    if !status.contains(" 200 ") {
        bail!("server answered {}", status.trim());
    }
    let mut first: Option<Instant> = None;
    let mut tokens = 0usize;
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            break;
        }
        let Some(data) = line.trim_end().strip_prefix("data: ") else {
            continue; // headers, chunk sizes, blank lines
        };
        if data == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
        if let Some(u) = v.get("usage").and_then(|u| u.get("completion_tokens")) {
            tokens = u.as_u64().unwrap_or(0) as usize;
        }
        let has_text = v["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty());
        if has_text && first.is_none() {
            first = Some(Instant::now());
        }
    }
    let end = Instant::now();
    let first = first.unwrap_or(end);
    Ok(One {
        ttft: first - t0,
        tokens,
        decode: end - first,
    })
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// `ringllm bench serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeBenchArgs {
    /// The server: http://HOST:PORT.
    pub url: String,
    /// Concurrent clients: one measure per value.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 2, 4, 8])]
    pub concurrency: Vec<usize>,
    /// Tokens each request generates.
    #[arg(short = 'n', long = "gen", default_value_t = 64)]
    pub gen: usize,
    /// Requests each client sends, one after another.
    #[arg(short = 'r', long, default_value_t = 5)]
    pub repeat: usize,
    /// The server's API key.
    #[arg(long, env = "RINGLLM_API_KEY")]
    pub api_key: Option<String>,
    /// Print results as JSON.
    #[arg(long)]
    pub json: bool,
    /// Every request's `response_format` (a JSON value, e.g. `{"type": "json_schema",
    /// "json_schema": {"schema": {...}}}`): the speed of constrained decoding.
    #[arg(long, value_name = "JSON")]
    pub response_format: Option<String>,
}

/// `--response-format`, read.
fn response_format(args: &ServeBenchArgs) -> Result<Option<serde_json::Value>> {
    args.response_format
        .as_deref()
        .map(serde_json::from_str)
        .transpose()
        .context("--response-format is not JSON")
}

/// `ringllm bench serve URL`: see the module.
pub fn bench_serve(args: &ServeBenchArgs) -> Result<ExitCode> {
    if args.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    let url = args.url.as_str();
    let addr = host_port(url)?;
    let format = response_format(args)?;
    let format = format.as_ref();
    // The model id from /v1/models.
    let model = {
        let mut s = TcpStream::connect(&addr).with_context(|| format!("connecting to {addr}"))?;
        let auth = args
            .api_key
            .as_deref()
            .map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
        write!(
            s,
            "GET /v1/models HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n"
        )?;
        let mut text = String::new();
        std::io::Read::read_to_string(&mut s, &mut text)?;
        let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
        let v: serde_json::Value =
            serde_json::from_str(body).map_err(|e| anyhow!("GET /v1/models: not JSON ({e})"))?;
        v["data"][0]["id"]
            .as_str()
            .ok_or_else(|| anyhow!("GET /v1/models lists no model"))?
            .to_string()
    };
    let gen = args.gen.max(1);
    let per_client = args.repeat.max(1);
    let mut levels = Vec::new();
    for &c in &args.concurrency {
        let c = c.max(1);
        let t0 = Instant::now();
        let results: Vec<Result<Vec<One>>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..c)
                .map(|i| {
                    let (addr, model) = (&addr, &model);
                    let key = args.api_key.as_deref();
                    sc.spawn(move || {
                        (0..per_client)
                            .map(|j| {
                                let prompt = format!("Story {i}-{j}: once upon a time");
                                request(addr, key, model, &prompt, gen, format)
                            })
                            .collect::<Result<Vec<One>>>()
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow!("client thread panicked")))
                })
                .collect()
        });
        let wall = t0.elapsed().as_secs_f64();
        let mut all = Vec::new();
        for r in results {
            all.extend(r?);
        }
        let tokens: usize = all.iter().map(|o| o.tokens).sum();
        let mut ttft: Vec<f64> = all.iter().map(|o| o.ttft.as_secs_f64() * 1e3).collect();
        let per_req: Vec<f64> = all
            .iter()
            .filter(|o| o.tokens > 1)
            .map(|o| (o.tokens - 1) as f64 / o.decode.as_secs_f64().max(1e-9))
            .collect();
        levels.push(Level {
            concurrency: c,
            requests: all.len(),
            aggregate_tokens_per_s: tokens as f64 / wall,
            per_request_tokens_per_s: per_req.iter().sum::<f64>() / per_req.len().max(1) as f64,
            ttft_p50_ms: percentile(&mut ttft, 0.5),
            ttft_p99_ms: percentile(&mut ttft, 0.99),
        });
    }
    // Time to first token of a short prompt, idle and while 4 long streams decode.
    let short = |n: usize| -> Result<Vec<f64>> {
        (0..n)
            .map(|i| {
                request(
                    &addr,
                    args.api_key.as_deref(),
                    &model,
                    &format!("Hi {i}"),
                    1,
                    None,
                )
                .map(|o| o.ttft.as_secs_f64() * 1e3)
            })
            .collect()
    };
    let mut idle = short(5)?;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let busy_ttft = std::thread::scope(|sc| -> Result<Vec<f64>> {
        let bg: Vec<_> = (0..4)
            .map(|i| {
                let (addr, model, stop) = (&addr, &model, &stop);
                let key = args.api_key.as_deref();
                sc.spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let _ = request(addr, key, model, &format!("Long story {i}:"), 256, None);
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(1500));
        let r = short(5);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for h in bg {
            let _ = h.join();
        }
        r
    })?;
    let mut busy = busy_ttft;
    let (idle50, busy50) = (percentile(&mut idle, 0.5), percentile(&mut busy, 0.5));
    if args.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "levels": levels,
                "ttft_idle_p50_ms": idle50,
                "ttft_under_4_streams_p50_ms": busy50,
            }))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    let base = levels.first().map_or(1.0, |l| l.aggregate_tokens_per_s);
    outln!("| clients | requests | aggregate t/s | vs 1 client | per request t/s | TTFT p50 ms | TTFT p99 ms |");
    outln!("| ------: | -------: | ------------: | ----------: | --------------: | ----------: | ----------: |");
    for l in &levels {
        outln!(
            "| {:>7} | {:>8} | {:>13.1} | {:>10.2}x | {:>15.1} | {:>11.0} | {:>11.0} |",
            l.concurrency,
            l.requests,
            l.aggregate_tokens_per_s,
            l.aggregate_tokens_per_s / base.max(1e-9),
            l.per_request_tokens_per_s,
            l.ttft_p50_ms,
            l.ttft_p99_ms
        );
    }
    outln!(
        "time to first token of a short prompt: {idle50:.0} ms idle, {busy50:.0} ms while 4 streams decode ({:.2}x)",
        busy50 / idle50.max(1e-9)
    );
    Ok(ExitCode::SUCCESS)
}
