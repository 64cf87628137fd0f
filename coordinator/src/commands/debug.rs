//! `ringllm debug`: dumps for the correctness oracles (tests/python).

use crate::cli::{DebugArgs, DebugCommand, SynthArgs};
use anyhow::{anyhow, bail, Context, Result};
use ringllm::engine::{default_threads, open_gguf};
use ringllm_kernels::{kernels, GgmlType};
use ringllm_model::forward::{Observed, StepObserver};
use ringllm_model::synth::{
    shape_names, synth_model, write_shape_model, ShapeSpec, SynthArch, SynthSpec, WeightMix,
};
use ringllm_model::{LoadOptions, Model, Runner};
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

pub fn debug(args: DebugArgs) -> Result<ExitCode> {
    match args.command {
        DebugCommand::Dequant {
            model,
            tensor,
            output,
        } => {
            let file = open_gguf(&model)?;
            let t = file
                .tensor(&tensor)
                .ok_or_else(|| anyhow!("{} has no tensor '{tensor}'", model.display()))?
                .clone();
            let n = t.n_elements() as usize;
            let mut out = vec![0f32; n];
            (kernels(t.ty).dequantize)(file.tensor_data(&t), &mut out);
            let bytes: Vec<u8> = out.iter().flat_map(|v| v.to_le_bytes()).collect();
            std::fs::write(&output, bytes)
                .with_context(|| format!("writing {}", output.display()))?;
        }
        DebugCommand::Forward {
            model,
            tokens,
            dump,
            steps,
        } => {
            if tokens.is_empty() {
                bail!("--tokens is empty");
            }
            let file = open_gguf(&model.model)?;
            let m = Model::load(
                file,
                &LoadOptions {
                    repack: !model.layout.no_repack
                        && model.layout.backend == ringllm_model::BackendChoice::Cpu,
                    ..LoadOptions::default()
                },
            )?;
            let (d, vocab) = (m.hp.d_model, m.hp.vocab);
            let n_layer = m.hp.n_layer;
            let n = tokens.len();
            let ctx = model.ctx.unwrap_or(n.max(1));
            let threads = model.threads.unwrap_or_else(default_threads);
            let kv_type = model.kv;
            let mut runner = Runner::new(Arc::new(m), threads, model.batch, ctx);
            ringllm::engine::set_backend(&mut runner, model.layout.backend)?;
            let mut kv = runner.new_cache(ctx, kv_type);
            std::fs::create_dir_all(&dump)?;
            let mut x = vec![0f32; n * d];
            runner.embed(&tokens, &mut x)?;
            write_npy(&dump.join("embd.npy"), &x, &[n, d])?;
            let mut per_layer: Vec<Vec<f32>> = vec![Vec::with_capacity(n * d); n_layer];
            // Per (layer, step, buffer), in the order the steps ran: the rows of every chunk.
            let mut per_step: Vec<(usize, &'static str, &'static str, usize, Vec<f32>)> =
                Vec::new();
            for chunk in x.chunks_mut(model.batch * d) {
                let rows = chunk.len() / d;
                if steps {
                    let mut k = 0;
                    let first = per_step.is_empty();
                    let mut obs = StepObserver(|o: &Observed<'_>| {
                        if first {
                            per_step.push((o.layer, o.step, o.buf, o.width, Vec::new()));
                        }
                        if let Some(e) = per_step.get_mut(k) {
                            e.4.extend_from_slice(o.rows);
                        }
                        k += 1;
                    });
                    runner.layers(chunk, rows, &mut kv, Some(&mut obs))?;
                } else {
                    let mut obs = |il: usize, h: &[f32]| per_layer[il].extend_from_slice(h);
                    runner.layers(chunk, rows, &mut kv, Some(&mut obs))?;
                }
            }
            // With --steps, the layer outputs are each layer's last residual stream (the
            // `ffn_residual` step's, or a later step's where the layer has more).
            for (il, _, _, _, v) in per_step.iter().filter(|e| e.2 == "x") {
                per_layer[*il].clone_from(v);
            }
            for (il, h) in per_layer.iter().enumerate() {
                write_npy(&dump.join(format!("layer.{il}.npy")), h, &[n, d])?;
            }
            if steps {
                let mut names = Vec::with_capacity(per_step.len());
                for (il, step, buf, width, v) in &per_step {
                    let name = format!("layer.{il}.{step}.{buf}");
                    write_npy(&dump.join(format!("{name}.npy")), v, &[n, *width])?;
                    names.push(name);
                }
                std::fs::write(dump.join("steps.json"), serde_json::to_string(&names)?)
                    .with_context(|| format!("writing {}", dump.join("steps.json").display()))?;
            }
            runner.final_norm(&mut x, n)?;
            write_npy(&dump.join("final_norm.npy"), &x, &[n, d])?;
            let mut logits = vec![0f32; n * vocab];
            for (i, rows) in x.chunks(model.batch * d).enumerate() {
                let r = rows.len() / d;
                let off = i * model.batch * vocab;
                runner.logits(rows, r, &mut logits[off..off + r * vocab])?;
            }
            write_npy(&dump.join("logits.npy"), &logits, &[n, vocab])?;
        }
        DebugCommand::Tokenize {
            model,
            prompt,
            texts,
            bos,
        } => {
            let file = open_gguf(&model)?;
            let spec = ringllm::text::tokenizer::TokenizerSpec::from_gguf(file.metadata())?;
            let tok = ringllm::text::tokenizer::Tokenizer::new(&spec)?;
            let add_bos = bos && tok.add_bos_default();
            if let Some(path) = texts {
                let src = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let list: Vec<String> = serde_json::from_str(&src)
                    .with_context(|| format!("{} is not a JSON list of strings", path.display()))?;
                let ids = list
                    .iter()
                    .map(|t| tok.encode(t, add_bos))
                    .collect::<Result<Vec<_>, _>>()?;
                outln!("{}", serde_json::to_string(&ids)?);
            } else if let Some(p) = prompt {
                outln!("{}", serde_json::to_string(&tok.encode(&p, add_bos)?)?);
            }
        }
        DebugCommand::Synth(a) => synth(a)?,
        DebugCommand::DelayProxy {
            listen,
            to,
            delay_ms,
        } => {
            if !(0.0..=10_000.0).contains(&delay_ms) {
                bail!("--delay-ms must be between 0 and 10000");
            }
            crate::bench::proxy::run_delay_proxy(
                &listen,
                &to,
                std::time::Duration::from_secs_f64(delay_ms / 1000.0),
            )?;
        }
        DebugCommand::KmodHold { port, tag, seconds } => kmod_hold(port, tag, seconds)?,
        DebugCommand::UdpFlood { to, tag, seconds } => udp_flood(to, tag, seconds)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `debug udp-flood`: about 10,000 datagrams a second of magic, tag and a refused header.
fn udp_flood(to: std::net::SocketAddr, tag: u32, seconds: u64) -> Result<()> {
    let sock = std::net::UdpSocket::bind(if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" })?;
    let mut d = Vec::with_capacity(100);
    d.extend_from_slice(&ringllm_protocol::kmod::MAGIC.to_le_bytes());
    d.extend_from_slice(&tag.to_le_bytes());
    d.resize(100, 0xee);
    let end = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    let mut n = 0u64;
    while std::time::Instant::now() < end {
        for _ in 0..10 {
            // A refused port (ICMP) or a full queue loses a datagram: that is fine here.
            if sock.send_to(&d, to).is_ok() {
                n += 1;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    outln!("sent {n} datagrams to {to}");
    Ok(())
}

/// `debug kmod-hold`: a context on `port`, blocked in WAIT_DATA until `seconds` pass.
fn kmod_hold(port: u16, tag: u32, seconds: u64) -> Result<()> {
    use ringllm_protocol::kmod::{Device, KmodConfig};
    let dev = Device::open(KmodConfig {
        banks: 1,
        slots: 64,
        tx_bytes: 4096,
    })?;
    dev.set_port(port, tag)?;
    eprintln!("holding /dev/ringllm on UDP port {port} (tag {tag:#x})");
    let end = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    let mut seen = 0;
    while let Some(left) = end.checked_duration_since(std::time::Instant::now()) {
        let now = dev.wait_data(seen, left)?;
        if now != seen {
            seen = now;
            // Take what arrived (nothing checks seals here), so the bank frees.
            dev.drain(|_| {}, |_| true)?;
            outln!("{:?}", dev.stats()?);
        }
    }
    outln!("{:?}", dev.stats()?);
    Ok(())
}

/// `debug synth`: a small model in memory, or a real-size shape streamed to `output`.
fn synth(a: SynthArgs) -> Result<()> {
    let SynthArgs {
        arch,
        shape,
        ty,
        layers,
        vocab,
        router_skew,
        seed,
        output,
    } = a;
    let output = output.as_path();
    let Some(name) = shape else {
        if layers.is_some() || vocab.is_some() || router_skew != 0.0 {
            bail!("--layers, --vocab and --router-skew apply to a --shape; the --arch models are fixed");
        }
        let name = arch.as_deref().unwrap_or("");
        let Some(arch) = SynthArch::from_name(name) else {
            let known: Vec<&str> = SynthArch::SMALL.iter().map(|a| a.cli_name()).collect();
            bail!("--arch must be one of {}, not '{name}'", known.join(", "));
        };
        let ty = ty.ok_or_else(|| anyhow!("--type is required with --arch"))?;
        let ty = GgmlType::from_name(&ty).ok_or_else(|| anyhow!("unknown type '{ty}'"))?;
        let bytes = synth_model(&SynthSpec::new(arch, ty, seed))?;
        std::fs::write(output, bytes).with_context(|| format!("writing {}", output.display()))?;
        return Ok(());
    };
    let base = ringllm_model::synth::shape(&name).ok_or_else(|| {
        anyhow!(
            "unknown shape '{name}' (known: {})",
            shape_names().join(", ")
        )
    })?;
    let ty = ty.unwrap_or_else(|| "q4_k_m".to_string());
    let mix = WeightMix::from_name(&ty).ok_or_else(|| {
        anyhow!("unknown weight type '{ty}' (q4_k_m, q3_k_m, q2_k, iq4_xs or a type such as q8_0)")
    })?;
    let mut spec = ShapeSpec::new(base, mix, seed);
    if let Some(n) = layers {
        spec.shape.n_layer = n;
    }
    if let Some(v) = vocab {
        spec.shape.vocab = v;
    }
    if !(0.0..=4.0).contains(&router_skew) {
        bail!("--router-skew must be between 0 and 4, not {router_skew}");
    }
    if router_skew > 0.0 && spec.shape.experts().is_none() {
        bail!("--router-skew needs a mixture-of-experts shape; {name} has no experts");
    }
    spec.router_skew = router_skew;
    let started = std::time::Instant::now();
    let file =
        std::fs::File::create(output).with_context(|| format!("creating {}", output.display()))?;
    let n = match write_shape_model(&spec, std::io::BufWriter::with_capacity(1 << 20, file)) {
        Ok(n) => n,
        Err(e) => {
            // No half-written model left behind (a full disk, a refused shape); never
            // remove what is not a regular file (`-o /dev/null`).
            if std::fs::metadata(output).is_ok_and(|m| m.is_file()) {
                let _ = std::fs::remove_file(output);
            }
            return Err(e).with_context(|| format!("writing {}", output.display()));
        }
    };
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "wrote {} ({} layers, vocab {}, {}): {:.2} GB in {secs:.1} s",
        output.display(),
        spec.shape.n_layer,
        spec.shape.vocab,
        mix.name(),
        n as f64 / 1e9
    );
    Ok(())
}

/// Writes a little-endian f32 array in NumPy's .npy format (version 1.0).
pub fn write_npy(path: &Path, data: &[f32], shape: &[usize]) -> Result<()> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_s = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_s}, }}");
    // Magic (6) + version (2) + length (2) + header + '\n' is a multiple of 64.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    f.write_all(b"\x93NUMPY\x01\x00")?;
    f.write_all(&(header.len() as u16).to_le_bytes())?;
    f.write_all(header.as_bytes())?;
    for v in data {
        f.write_all(&v.to_le_bytes())?;
    }
    f.flush()?;
    Ok(())
}
