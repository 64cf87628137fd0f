//! `ringllm keygen FILE`: a new random cluster key, written readable by its owner only.
//! `ringllm keygen --node NAME --key KEYFILE FILE`: a node key (its own Ed25519 key pair and
//! a certificate signed with the cluster key; see `ringllm_protocol::ident`).
//! `ringllm revoke NAME --key KEYFILE`: adds NAME to `KEYFILE.revoked`, the list every
//! coordinator loading that key refuses and sends to its nodes.

use crate::cli::{KeygenArgs, RevokeArgs};
use anyhow::{bail, Context, Result};
use ringllm_protocol::ident::{revocation_path, NodeIdentity, Revocations};
use ringllm_protocol::ClusterKey;
use std::process::ExitCode;

pub fn keygen(args: KeygenArgs) -> Result<ExitCode> {
    if args.file.exists() && !args.force {
        bail!(
            "{} exists; use --force to replace it (every node then needs the new key)",
            args.file.display()
        );
    }
    if let (Some(name), Some(key_path)) = (&args.node, &args.key) {
        return node_keygen(&args, name, key_path);
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

fn node_keygen(args: &KeygenArgs, name: &str, key_path: &std::path::Path) -> Result<ExitCode> {
    let key = ClusterKey::load(key_path)?;
    if key.is_revoked(name) {
        bail!(
            "node name {name:?} is revoked in {}: choose another name",
            revocation_path(key_path).display()
        );
    }
    let id = NodeIdentity::generate(&key, name)?;
    write_private(&args.file, id.to_text().as_bytes())
        .with_context(|| format!("writing {}", args.file.display()))?;
    eprintln!(
        "wrote a node key for {name:?} (serial {:016x}, cluster id {}) to {}; start that node \
         with --node-key {}",
        id.cert.serial,
        key.id_hex(),
        args.file.display(),
        args.file.display()
    );
    Ok(ExitCode::SUCCESS)
}

pub fn revoke(args: RevokeArgs) -> Result<ExitCode> {
    // The key must be there: a list beside a mistyped path would guard nothing.
    let key = ClusterKey::load(&args.key)?;
    let path = revocation_path(&args.key);
    let mut list = Revocations::load(&path)?;
    if !list.insert(&args.name)? {
        eprintln!("{:?} is already revoked ({})", args.name, path.display());
        return Ok(ExitCode::SUCCESS);
    }
    write_private(&path, list.to_text().as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!(
        "revoked {:?} in {} (cluster id {}, {} name(s)); coordinators using {} refuse it and \
         tell their nodes to at their next connection",
        args.name,
        path.display(),
        key.id_hex(),
        list.len(),
        args.key.display()
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
