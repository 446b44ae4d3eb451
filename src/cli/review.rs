//! The review page ([`canarygate_review`]): `canarygate audit ui` serves it
//! alone until Ctrl-C or SIGTERM; `canarygate serve --review-listen ADDR`
//! serves it beside the proxy, in the same process (its store handle sits
//! beside the proxy's audit log: redb's multi-writer mode, see the crate's
//! docs).

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Context;
use canarygate_audit::SampleKey;
use canarygate_review::{ADMIN_TOKEN_ENV, AdminToken, ReviewOptions, ReviewServer, token_from_env};

use super::common::{announce, runtime, shutdown_signal};

/// What the page needs from the environment, read before anything starts
/// so that a missing token stops the command at once.
pub struct ReviewSetup {
    token: AdminToken,
    sample_key: Option<SampleKey>,
    key_env: String,
}

impl ReviewSetup {
    /// Reads the admin token (`$CANARYGATE_ADMIN_TOKEN`) and the sample key
    /// (`$key_env`, optional), and warns when `listen` leaves this machine.
    pub fn from_env(key_env: &str, listen: SocketAddr) -> anyhow::Result<Self> {
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
        Ok(Self {
            token,
            sample_key,
            key_env: key_env.to_owned(),
        })
    }

    /// Opens the store in `dir`, binds `listen` and prints the readiness line.
    pub async fn bind(self, dir: &Path, listen: SocketAddr) -> anyhow::Result<ReviewServer> {
        let server = ReviewServer::bind(ReviewOptions {
            data_dir: dir.to_owned(),
            listen,
            token: self.token,
            sample_key: self.sample_key,
            key_env: self.key_env,
        })
        .await?;
        let address = server.local_addr()?;
        announce(&format!(
            "canarygate review page listening on http://{address}"
        ));
        tracing::info!("review page: log in with the token in ${ADMIN_TOKEN_ENV}");
        Ok(server)
    }
}

/// `audit ui`: serves the review page for the store in `dir` on `listen`
/// until Ctrl-C or SIGTERM.
pub fn run(dir: &Path, listen: SocketAddr, key_env: &str) -> anyhow::Result<()> {
    let setup = ReviewSetup::from_env(key_env, listen)?;
    runtime()?.block_on(async move {
        let server = setup.bind(dir, listen).await?;
        server.run(shutdown_signal()).await?;
        Ok(())
    })
}
