//! canarygate-review: the audit log in a browser.
//!
//! A small web UI over [`canarygate_audit::Archive`], for the people who
//! spot-check answers: the record list with filters, one record with its
//! checks, evidence and decrypted sample side by side, the ok / bad review
//! form, and charts. Plain server-rendered HTML and inline SVG with one
//! stylesheet; no script, no CDN, no external font: it works offline.
//!
//! How the parts meet:
//!
//! - [`ReviewServer::bind`] opens the store with
//!   [`Archive::open_writable`] and binds the address. redb's multi-writer
//!   mode locks with open-file-description locks (`F_OFD_SETLK` on Linux), which
//!   exclude each other even inside one process, so this handle works beside
//!   a running `serve` and beside `serve`'s own [`canarygate_audit::AuditLog`]
//!   in the same process (`canarygate serve --review-listen`): both append,
//!   and the chain verifies (this crate's tests, and the e2e test
//!   `serve_runs_the_review_page_beside_the_proxy`).
//! - `server` routes requests: `auth` ([`AdminToken`]) gates every page
//!   but the login form and the stylesheet; `filter` parses the list's
//!   query strictly (a bad value is a 400 page naming it); `data` reads a
//!   snapshot in `spawn_blocking`; `pages` and `charts` render with
//!   `html::Page`, the one way text reaches a page (always escaped).
//! - Reviews are written only through [`Archive::review`], as the CLI's
//!   `audit spot-check` does, so each is a chained record and `audit
//!   verify` still passes.
//!
//! Routes: `GET /` (list; `?verdict=&check=&route=&session=&endpoint=&request=&since=&until=&reviewed=&order=&page=`),
//! `GET /records/{id}`, `POST /records/{id}/review`, `GET /charts` (the
//! same filters), `GET|POST /login`, `POST /logout`, `GET /style.css`.

mod auth;
mod charts;
mod data;
mod filter;
mod html;
mod pages;
mod server;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use canarygate_audit::{Archive, AuditError, SampleKey};

pub use auth::{AdminToken, BadToken, MIN_TOKEN_LEN};
pub use html::escape;

/// The environment variable `canarygate audit ui` reads the admin token from.
pub const ADMIN_TOKEN_ENV: &str = "CANARYGATE_ADMIN_TOKEN";

/// What the review page serves.
pub struct ReviewOptions {
    /// The data directory holding `canarygate.redb`.
    pub data_dir: PathBuf,
    /// Where to listen.
    pub listen: SocketAddr,
    /// The admin token ([`AdminToken::new`]).
    pub token: AdminToken,
    /// Decrypts samples; without it an encrypted sample is shown as unreadable.
    pub sample_key: Option<SampleKey>,
    /// The variable the key comes from, named in messages.
    pub key_env: String,
}

/// Why the review page could not start.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// The admin token is missing or unusable.
    #[error("admin token: {0}")]
    Token(String),
    /// The store could not be opened.
    #[error(transparent)]
    Audit(#[from] AuditError),
    /// The address could not be bound.
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
}

/// A bound review page, ready to [`run`](ReviewServer::run).
pub struct ReviewServer {
    listener: tokio::net::TcpListener,
    state: Arc<server::AppState>,
}

impl ReviewServer {
    /// Opens the store in `options.data_dir` (it must exist: the page does
    /// not create an empty log) and binds `options.listen`.
    pub async fn bind(options: ReviewOptions) -> Result<Self, ReviewError> {
        // A missing store is an error (a wrong --data), never created.
        let dir = options.data_dir.clone();
        let archive = tokio::task::spawn_blocking(move || Archive::open_writable(&dir))
            .await
            .map_err(|_| {
                AuditError::Corrupt("the store file is damaged and cannot be opened".into())
            })??;
        let listener = tokio::net::TcpListener::bind(options.listen)
            .await
            .map_err(|error| ReviewError::Listen(options.listen, error))?;
        Ok(Self {
            listener,
            state: Arc::new(server::AppState {
                archive,
                token: options.token,
                sample_key: options.sample_key,
                key_env: options.key_env,
            }),
        })
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` resolves.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> std::io::Result<()> {
        let router = server::router(self.state);
        server::serve(self.listener, router, shutdown).await
    }
}

/// The admin token from [`ADMIN_TOKEN_ENV`]: an error when it is unset,
/// not UTF-8 or shorter than [`MIN_TOKEN_LEN`].
pub fn token_from_env() -> Result<AdminToken, ReviewError> {
    let text = std::env::var(ADMIN_TOKEN_ENV).map_err(|_| {
        ReviewError::Token(format!(
            "set ${ADMIN_TOKEN_ENV} to a secret of at least {MIN_TOKEN_LEN} characters \
             (e.g. `openssl rand -hex 24`)"
        ))
    })?;
    AdminToken::new(&text)
        .map_err(|error| ReviewError::Token(format!("${ADMIN_TOKEN_ENV}: {error}")))
}

#[cfg(test)]
mod tests;
