//! Cluster-file parsing: accepted files, and the message each mistake gets.

use super::*;
use crate::cluster::diagnostics::{closest, edit_distance};

fn parse(text: &str) -> Result<ClusterConfig> {
    parse_str(text, Path::new("dir/cluster.toml"))
}

fn err(text: &str) -> String {
    match parse(text) {
        Ok(c) => panic!("expected an error, got {c:?}"),
        Err(e) => format!("{e:#}"),
    }
}

/// Asserts the message names the file, the line and the field.
fn assert_names(msg: &str, line: usize, field: &str) {
    let prefix = format!("dir/cluster.toml:{line}:");
    assert!(
        msg.starts_with(&prefix),
        "{msg:?} should start with {prefix:?}"
    );
    assert!(
        msg.contains(&format!("`{field}`")),
        "{msg:?} should name field `{field}`"
    );
}

const GOOD: &str = r#"model = "../models/m.gguf"
key = "cluster.key"
ctx = 2048
kv = "f16"

[coordinator]
threads = 2
memory = "4GiB"

[[node]]
name = "a"
address = "127.0.0.1:7701"
layers = "0-8"
memory = "2 GiB"
threads = 1

[[node]]  # the second
name = "b"
address = "[::1]:7702"

[[node]]
name = "master"
local = true
"#;

#[test]
fn good_file() {
    let c = parse(GOOD).unwrap();
    assert_eq!(c.path, Path::new("dir/cluster.toml"));
    assert_eq!(c.model, Path::new("dir/../models/m.gguf"));
    assert_eq!(c.key_file, Path::new("dir/cluster.key"));
    assert_eq!(c.ctx, Some(2048));
    assert_eq!(c.activations.name(), "f32");
    assert_eq!(c.kv, KvType::F16);
    assert_eq!(c.threads, Some(2));
    assert_eq!(c.memory, Some(4 << 30));
    assert_eq!(c.stages.len(), 3);
    let a = &c.stages[0];
    assert_eq!(
        a,
        &StageConfig {
            name: "a".into(),
            address: Some("127.0.0.1:7701".into()),
            local: false,
            layers: Some(0..9),
            memory: Some(2 << 30),
            threads: Some(1),
            transport: None,
            line: 10,
        }
    );
    assert_eq!(c.stages[1].line, 17);
    assert_eq!(c.stages[1].layers, None);
    assert_eq!(c.stages[2].line, 21);
    assert!(c.stages[2].local);
    assert_eq!(c.stages[2].address, None);
}

#[test]
fn minimal_file_defaults() {
    let c =
        parse("model = \"/abs/m.gguf\"\nkey = \"k\"\n[[node]]\nname = \"a\"\naddress = \"h:1\"\n")
            .unwrap();
    assert_eq!(c.model, Path::new("/abs/m.gguf"));
    assert_eq!(c.ctx, None);
    assert_eq!(c.activations.name(), "f32");
    assert_eq!(c.kv, KvType::F32);
    assert_eq!((c.threads, c.memory), (None, None));
    assert_eq!(c.stages[0].line, 3);
    assert!(c.stages.iter().all(|s| !s.local));
}

const HEAD: &str = "model = \"m.gguf\"\nkey = \"k\"\n";

#[test]
fn address_without_port() {
    let m = err(&format!(
        "{HEAD}[[node]]\nname = \"b\"\naddress = \"10.0.0.2\"\n"
    ));
    assert_names(&m, 5, "address");
    assert!(m.contains("node \"b\""), "{m}");
    assert!(
        m.contains("has no port — write it as host:port, e.g. \"10.0.0.2:7701\""),
        "{m}"
    );
}

#[test]
fn bad_addresses() {
    for (addr, want) in [
        ("10.0.0.2:0", "from 1 to 65535"),
        ("10.0.0.2:70000", "from 1 to 65535"),
        ("10.0.0.2:", "has no port"),
        (":7701", "has no host"),
        ("::1", "brackets"),
        ("http://h:7701", "scheme"),
        ("h :7701", "spaces"),
        ("", "is empty"),
    ] {
        let m = err(&format!(
            "{HEAD}[[node]]\nname = \"b\"\naddress = \"{addr}\"\n"
        ));
        assert_names(&m, 5, "address");
        assert!(m.contains(want), "{addr:?}: {m}");
    }
}

#[test]
fn missing_address_and_name() {
    let m = err(&format!("{HEAD}\n[[node]]\nname = \"b\"\n"));
    assert_names(&m, 4, "address");
    assert!(m.contains("local = true"), "{m}");
    let m = err(&format!("{HEAD}[[node]]\naddress = \"h:1\"\n"));
    assert_names(&m, 3, "name");
}

#[test]
fn missing_model_and_key() {
    let m = err("key = \"k\"\n[[node]]\nname = \"a\"\naddress = \"h:1\"\n");
    assert!(
        m.starts_with("dir/cluster.toml:") && m.contains("`model`"),
        "{m}"
    );
    let m = err("model = \"m\"\n[[node]]\nname = \"a\"\naddress = \"h:1\"\n");
    assert!(
        m.starts_with("dir/cluster.toml:") && m.contains("`key`"),
        "{m}"
    );
}

#[test]
fn no_nodes() {
    let m = err(HEAD);
    assert!(
        m.starts_with("dir/cluster.toml:") && m.contains("[[node]]"),
        "{m}"
    );
}

#[test]
fn misspelled_field_suggests() {
    let m = err(&format!("{HEAD}[[node]]\nname = \"b\"\nadress = \"h:1\"\n"));
    assert_names(&m, 5, "adress");
    assert!(m.contains("did you mean `address`?"), "{m}");
    let m = err("model = \"m\"\nkey = \"k\"\nctxx = 5\n");
    assert_names(&m, 3, "ctxx");
    assert!(m.contains("did you mean `ctx`?"), "{m}");
    let m = err(&format!("{HEAD}[coordinator]\nthreds = 2\n"));
    assert_names(&m, 4, "threds");
    assert!(
        m.contains("did you mean `threads`?") && m.contains("[coordinator]"),
        "{m}"
    );
}

#[test]
fn top_level_key_after_table() {
    let m = err("key = \"k\"\n[coordinator]\nthreads = 1\nmodel = \"m\"\n");
    assert_names(&m, 4, "model");
    assert!(m.contains("before the first [table]"), "{m}");
}

#[test]
fn syntax_and_type_errors_have_lines() {
    let m = err(&format!(
        "{HEAD}[[node]]\nname = \"b\"\naddress = \"h:1\"\nthreads = \"two\"\n"
    ));
    assert_names(&m, 6, "threads");
    let m = err(&format!("{HEAD}[[node]]\nname = = \"b\"\n"));
    assert!(m.starts_with("dir/cluster.toml:4:"), "{m}");
    let m = err(&format!("{HEAD}[node]\nname = \"b\"\n"));
    assert!(
        m.starts_with("dir/cluster.toml:3:") && m.contains("[[node]]"),
        "{m}"
    );
}

#[test]
fn duplicate_names_and_addresses() {
    let m = err(&format!("{HEAD}[[node]]\nname = \"a\"\naddress = \"h:1\"\n[[node]]\nname = \"a\"\naddress = \"h:2\"\n"));
    assert_names(&m, 6, "name");
    assert!(m.contains("line 3"), "{m}");
    let m = err(&format!("{HEAD}[[node]]\nname = \"a\"\naddress = \"h:1\"\n[[node]]\nname = \"b\"\naddress = \"H:1\"\n"));
    assert_names(&m, 6, "address");
}

#[test]
fn local_rules() {
    let m = err(&format!(
        "{HEAD}[[node]]\nname = \"a\"\nlocal = true\naddress = \"h:1\"\n"
    ));
    assert_names(&m, 6, "address");
    let m = err(&format!(
        "{HEAD}[[node]]\nname = \"a\"\nlocal = true\n[[node]]\nname = \"b\"\nlocal = true\n"
    ));
    assert_names(&m, 6, "local");
}

#[test]
fn numbers_must_be_positive() {
    let m = err(&format!(
        "ctx = 0\n{HEAD}[[node]]\nname = \"a\"\naddress = \"h:1\"\n"
    ));
    assert_names(&m, 1, "ctx");
    let m = err(&format!(
        "{HEAD}[coordinator]\nthreads = 0\n[[node]]\nname = \"a\"\naddress = \"h:1\"\n"
    ));
    assert_names(&m, 4, "threads");
    let m = err(&format!(
        "{HEAD}[[node]]\nname = \"a\"\naddress = \"h:1\"\nthreads = -1\n"
    ));
    assert_names(&m, 6, "threads");
    let m = err(&format!(
        "{HEAD}[[node]]\nname = \"a\"\naddress = \"h:1\"\nmemory = \"2 parsecs\"\n"
    ));
    assert_names(&m, 6, "memory");
    let m = err(&format!(
        "{HEAD}[[node]]\nname = \"a\"\naddress = \"h:1\"\nmemory = 0\n"
    ));
    assert_names(&m, 6, "memory");
    let m = err(&format!("{HEAD}[coordinator]\nmemory = true\n"));
    assert_names(&m, 4, "memory");
}

#[test]
fn transports_top_level_and_per_node() {
    let c = parse_str(
        &format!(
            "{HEAD}transport = \"udp\"\n[[node]]\nname = \"a\"\naddress = \"h:1\"\n\
             [[node]]\nname = \"b\"\naddress = \"h:2\"\ntransport = \"QUIC\"\n"
        ),
        Path::new("c.toml"),
    )
    .unwrap();
    assert_eq!(c.transport, Some(TransportKind::Udp));
    assert_eq!(c.stages[0].transport, None);
    assert_eq!(c.stages[1].transport, Some(TransportKind::Quic));
    let m = err(&format!(
        "{HEAD}[[node]]\nname = \"a\"\naddress = \"h:1\"\ntransport = \"sctp\"\n"
    ));
    assert_names(&m, 6, "transport");
    assert!(m.contains("node \"a\"") && m.contains("\"uring\""), "{m}");
    let m = err(&format!(
        "{HEAD}[[node]]\nname = \"m\"\nlocal = true\ntransport = \"udp\"\n"
    ));
    assert!(m.contains("local stage"), "{m}");
}

#[test]
fn activations_and_kv() {
    // f16, bf16 and q8 are accepted.
    for a in ["f16", "bf16", "q8", "f32"] {
        let c = parse_str(
            &format!(
                "model = \"m.gguf\"\nkey = \"k\"\nactivations = \"{a}\"\n[[node]]\nname = \"a\"\naddress = \"h:1\"\n"
            ),
            Path::new("c.toml"),
        )
        .unwrap();
        assert_eq!(c.activations.name(), a);
    }
    let m = err(&format!(
        "activations = \"f8\"\n{HEAD}[[node]]\nname = \"a\"\naddress = \"h:1\"\n"
    ));
    assert_names(&m, 1, "activations");
    assert!(m.contains("not an activation type"), "{m}");
    let m = err(&format!(
        "kv = \"q4\"\n{HEAD}[[node]]\nname = \"a\"\naddress = \"h:1\"\n"
    ));
    assert_names(&m, 1, "kv");
}

fn pins(layers: &[Option<&str>]) -> Result<ClusterConfig> {
    let mut t = HEAD.to_string();
    for (i, l) in layers.iter().enumerate() {
        t += &format!("[[node]]\nname = \"n{i}\"\naddress = \"h:{}\"\n", i + 1);
        if let Some(l) = l {
            t += &format!("layers = \"{l}\"\n");
        }
    }
    parse(&t)
}

#[test]
fn good_pins() {
    let c = pins(&[Some("0-3"), Some("4-9"), Some("10-29")]).unwrap();
    let got: Vec<_> = c.stages.iter().map(|s| s.layers.clone()).collect();
    assert_eq!(got, vec![Some(0..4), Some(4..10), Some(10..30)]);
    pins(&[Some("0-3"), None, Some("6-9"), None]).unwrap();
    pins(&[None, None, Some("2-9")]).unwrap();
    pins(&[Some("0-3"), None]).unwrap();
}

#[test]
fn bad_pins() {
    // Overlap: the second [[node]] is on line 7 of the generated text.
    let m = format!("{:#}", pins(&[Some("0-4"), Some("3-8")]).unwrap_err());
    assert_names(&m, 7, "layers");
    assert!(
        m.contains("node \"n1\"") && m.contains("node \"n0\""),
        "{m}"
    );
    // Out of order.
    let m = format!("{:#}", pins(&[None, Some("5-9"), Some("0-3")]).unwrap_err());
    assert_names(&m, 10, "layers");
    assert!(m.contains("layer order"), "{m}");
    // A hole between two adjacent pins.
    let m = format!("{:#}", pins(&[Some("0-4"), Some("6-9")]).unwrap_err());
    assert_names(&m, 7, "layers");
    assert!(m.contains("layers 5-5"), "{m}");
    // The first pin must start at 0.
    let m = format!("{:#}", pins(&[Some("1-4")]).unwrap_err());
    assert_names(&m, 3, "layers");
    assert!(m.contains("start at layer 0"), "{m}");
    // No room for the unpinned node in between.
    let m = format!("{:#}", pins(&[Some("0-4"), None, Some("5-9")]).unwrap_err());
    assert_names(&m, 10, "layers");
    assert!(m.contains("at least one layer"), "{m}");
    // Bad syntax.
    let m = format!("{:#}", pins(&[Some("8-0")]).unwrap_err());
    assert_names(&m, 6, "layers");
}

#[test]
fn inline_node_array_lines() {
    let c = parse(&format!("{HEAD}node = [\n  {{ name = \"a\", address = \"h:1\" }},\n  {{ name = \"b\", address = \"h:2\" }},\n]\n")).unwrap();
    assert_eq!(c.stages.len(), 2);
    assert!(
        c.stages.iter().all(|s| (3..=5).contains(&s.line)),
        "{:?}",
        c.stages
    );
}

#[test]
fn layers_syntax() {
    assert_eq!(parse_layers("0-8"), Ok(0..9));
    assert_eq!(parse_layers(" 3 - 5 "), Ok(3..6));
    assert_eq!(parse_layers("5"), Ok(5..6));
    assert_eq!(parse_layers("0-0"), Ok(0..1));
    for bad in ["8-0", "a-b", "", "-3", "3-", "0..8", "1-2-3"] {
        assert!(parse_layers(bad).is_err(), "{bad:?}");
    }
    assert!(parse_layers("8-0").unwrap_err().contains("\"0-8\""));
}

#[test]
fn size_syntax() {
    assert_eq!(parse_size("4GiB"), Ok(4 << 30));
    assert_eq!(parse_size("512 MiB"), Ok(512 << 20));
    assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
    assert_eq!(parse_size("1.5G"), Ok(3 << 29));
    assert_eq!(parse_size("123456"), Ok(123_456));
    assert_eq!(parse_size("10b"), Ok(10));
    assert_eq!(parse_size("1k"), Ok(1024));
    assert_eq!(parse_size("1kb"), Ok(1000));
    assert_eq!(parse_size("1KIB"), Ok(1024));
    assert_eq!(parse_size("3m"), Ok(3 << 20));
    assert_eq!(parse_size("2T"), Ok(2 << 40));
    assert_eq!(parse_size("1TB"), Ok(1_000_000_000_000));
    assert_eq!(parse_size("0.5 KiB"), Ok(512));
    for bad in [
        "",
        "GiB",
        "-1G",
        "1.5",
        "1.2.3G",
        "4 parsecs",
        "99999999999999999999",
        "20000000T",
    ] {
        assert!(parse_size(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn edit_distances() {
    assert_eq!(edit_distance("adress", "address"), 1);
    assert_eq!(edit_distance("", "abc"), 3);
    assert_eq!(edit_distance("kitten", "sitting"), 3);
    assert_eq!(closest("memroy", &["name", "memory"]), Some("memory"));
    assert_eq!(closest("zzzzzz", &["name", "memory"]), None);
}

#[test]
fn shipped_cluster_configs_parse() {
    for (name, text) in [
        (
            "loopback-2.toml",
            include_str!("../../../../cluster-configs/loopback-2.toml"),
        ),
        (
            "loopback-3.toml",
            include_str!("../../../../cluster-configs/loopback-3.toml"),
        ),
        (
            "netns-3.toml",
            include_str!("../../../../cluster-configs/netns-3.toml"),
        ),
        (
            "homelab.example.toml",
            include_str!("../../../../cluster-configs/homelab.example.toml"),
        ),
    ] {
        let path = Path::new("cluster-configs").join(name);
        let c = parse_str(text, &path).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert!(!c.stages.is_empty(), "{name}");
        assert_eq!(c.activations.name(), "f32", "{name}");
        if name != "homelab.example.toml" {
            assert_eq!(
                c.key_file,
                Path::new("cluster-configs/../tests/fixtures/test-cluster.key"),
                "{name}"
            );
        }
    }
}

#[test]
fn oversized_threads_and_ctx_are_refused_with_the_line() {
    let e = err(
        "model = \"m.gguf\"\nkey = \"k\"\n[[node]]\nname = \"n\"\naddress = \"a:1\"\nthreads = 4294967295\n",
    );
    assert!(
        e.contains("dir/cluster.toml:6:") && e.contains("at most 1024"),
        "{e}"
    );
    let e = err("model = \"m.gguf\"\nkey = \"k\"\nctx = 100000000000\n[[node]]\nname = \"n\"\naddress = \"a:1\"\n");
    assert!(
        e.contains("dir/cluster.toml:3:") && e.contains("ctx"),
        "{e}"
    );
}

#[test]
fn discover_allows_a_file_without_nodes_and_checks_its_wait() {
    let c =
        parse("model = \"m.gguf\"\nkey = \"k\"\ndiscover = true\ndiscover_wait = 1.5\n").unwrap();
    assert!(c.discover);
    assert!(c.stages.is_empty());
    assert_eq!(
        c.discover_wait,
        Some(std::time::Duration::from_millis(1500))
    );
    let c = parse("model = \"m.gguf\"\nkey = \"k\"\ndiscover = true\n").unwrap();
    assert_eq!(c.discover_wait, None);
    // Without discovery a file still needs its nodes.
    let m = err("model = \"m.gguf\"\nkey = \"k\"\ndiscover = false\n");
    assert!(
        m.contains("no [[node]] tables") && m.contains("discover = true"),
        "{m}"
    );
    let m = err("model = \"m.gguf\"\nkey = \"k\"\ndiscover = true\ndiscover_wait = 0\n");
    assert_names(&m, 4, "discover_wait");
    let m = err("model = \"m.gguf\"\nkey = \"k\"\ndiscover = true\ndiscover_wait = \"3s\"\n");
    assert_names(&m, 4, "discover_wait");
}

#[test]
fn activations_names_aliases_and_the_default() {
    let parse_a = |a: &str| {
        parse(&format!(
            "{HEAD}activations = \"{a}\"\n[[node]]\nname = \"a\"\naddress = \"h:1\"\n"
        ))
        .map(|c| c.activations)
    };
    assert_eq!(parse_a("q8_0").ok(), Some(Activations::Q8));
    assert_eq!(parse_a(" BF16 ").ok(), Some(Activations::Bf16));
    assert_eq!(Activations::default(), DEFAULT_ACTIVATIONS);
    assert_eq!(DEFAULT_ACTIVATIONS.dtype(), ringllm_protocol::Dtype::F32);
    // The message names the real default.
    let m = err(&format!(
        "{HEAD}activations = \"f8\"\n[[node]]\nname = \"a\"\naddress = \"h:1\"\n"
    ));
    assert!(m.contains("\"f32\" (the default)"), "{m}");
    assert!(!m.contains("\"f16\" (the default)"), "{m}");
    // The flag reads the same table.
    assert_eq!("Q8_0".parse::<Activations>(), Ok(Activations::Q8));
}

/// A folder under the system's temporary one, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("ringllm-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_file_over_the_size_cap_is_refused_by_its_size_before_it_is_read() {
    let dir = TempDir::new("cluster-cap");
    // 10 MB, sparse: reading it took 12.8 s and 401 MB before its parse error.
    let big = dir.0.join("big.toml");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(10_000_000)
        .unwrap();
    let t0 = std::time::Instant::now();
    let m = format!("{:#}", load(&big).unwrap_err());
    assert!(
        m.contains(&big.display().to_string()) && m.contains("10000000") && m.contains("1048576"),
        "the message names the file, its size and the cap: {m}"
    );
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(2),
        "{:?}",
        t0.elapsed()
    );
    // A file of exactly the cap is read (a good file padded with a comment).
    let padded = dir.0.join("padded.toml");
    let mut text = format!("{GOOD}#");
    text.push_str(&"x".repeat(MAX_FILE_BYTES as usize - text.len() - 1));
    text.push('\n');
    std::fs::write(&padded, &text).unwrap();
    assert_eq!(load(&padded).unwrap().stages.len(), 3);
    // One byte more is refused.
    text.insert(GOOD.len() + 1, 'x');
    std::fs::write(&padded, &text).unwrap();
    let m = format!("{:#}", load(&padded).unwrap_err());
    assert!(m.contains("1048577 bytes"), "{m}");
}
