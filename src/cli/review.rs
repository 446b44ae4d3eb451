//! `canarygate audit ui`: the review page ([`canarygate_review`]) over one
//! data directory, until Ctrl-C or SIGTERM.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Context;
use canarygate_audit::SampleKey;
use canarygate_review::{ADMIN_TOKEN_ENV, ReviewOptions, ReviewServer, token_from_env};

use super::common::{announce, runtime, shutdown_signal};

/// Serves the review page for the store in `dir` on `listen`; the admin
/// token comes from `$CANARYGATE_ADMIN_TOKEN`, the sample key from `$key_env`.
pub fn run(dir: &Path, listen: SocketAddr, key_env: &str) -> anyhow::Result<()> {
    let token = token_from_env()?;
    let sample_key = SampleKey::from_env(key_env).with_context(|| format!("${key_env}"))?;
    if sample_key.is_none() {
        tracing::info!(
            "review page: ${key_env} is not set: encrypted samples are shown as unreadable"
        );
    }
    if !listen.ip().is_loopback() {
        tracing::warn!(
            "review page: listening on {listen}, beyond this machine, over plain HTTP: the \
             admin token and decrypted prompts cross the network in clear; put a TLS proxy \
             in front of it"
        );
    }
    runtime()?.block_on(async move {
        let server = ReviewServer::bind(ReviewOptions {
            data_dir: dir.to_owned(),
            listen,
            token,
            sample_key,
            key_env: key_env.to_owned(),
        })
        .await?;
        let address = server.local_addr()?;
        announce(&format!(
            "canarygate review page listening on http://{address}"
        ));
        tracing::info!("review page: log in with the token in ${ADMIN_TOKEN_ENV}");
        server.run(shutdown_signal()).await?;
        Ok(())
    })
}
