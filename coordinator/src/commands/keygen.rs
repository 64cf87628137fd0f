//! `ringllm keygen FILE`: a new random cluster key, written readable by its owner only.

use crate::cli::KeygenArgs;
use anyhow::{bail, Context, Result};
use ringllm_protocol::ClusterKey;
use std::process::ExitCode;

pub fn keygen(args: KeygenArgs) -> Result<ExitCode> {
    if args.file.exists() && !args.force {
        bail!(
            "{} exists; use --force to replace it (every node then needs the new key)",
            args.file.display()
        );
    }
    let text = ClusterKey::generate_text()?;
    write_private(&args.file, text.as_bytes())
        .with_context(|| format!("writing {}", args.file.display()))?;
    let key = ClusterKey::from_bytes(text.as_bytes())?;
    eprintln!(
        "wrote a new cluster key to {} (cluster id {}); copy it to every machine of the ring",
        args.file.display(),
        key.id_hex()
    );
    Ok(ExitCode::SUCCESS)
}

fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)?;
        f.write_all(bytes)
    }
    #[cfg(not(unix))]
    {
        std::fs::write(path, bytes)
    }
}
