//! `canarygate hash-key`: the SHA-256 of a client key, for `auth.client_keys`.

use anyhow::{Context, anyhow};

/// Reads a key from standard input and prints its hash.
pub fn run() -> anyhow::Result<()> {
    let mut key = String::new();
    std::io::stdin()
        .read_line(&mut key)
        .context("cannot read the key from standard input")?;
    if key.trim().is_empty() {
        return Err(anyhow!("no key on standard input"));
    }
    println!("{}", canarygate_proxy::client_key_hash(&key));
    Ok(())
}
