//! Serving a router over TLS (rustls), for the simulated provider behind a
//! private CA in tests.

use std::path::Path;
use std::sync::Arc;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// Why a TLS server config could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or parsed.
    #[error("{path}: {message}")]
    Pem {
        /// The file.
        path: String,
        /// What was wrong with it.
        message: String,
    },
    /// rustls refused the certificate, the key or the pair.
    #[error("certificate and key do not form a valid pair: {0}")]
    Config(#[from] rustls::Error),
}

/// Builds a rustls server config from PEM certificate chain and key files.
pub fn server_config(cert_path: &Path, key_path: &Path) -> Result<ServerConfig, TlsError> {
    let pem = |path: &Path, error: &dyn std::fmt::Display| TlsError::Pem {
        path: path.display().to_string(),
        message: error.to_string(),
    };
    let certificates = CertificateDer::pem_file_iter(cert_path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|error| pem(cert_path, &error))?;
    let key = PrivateKeyDer::from_pem_file(key_path).map_err(|error| pem(key_path, &error))?;
    let mut config =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certificates, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// Accepts TLS connections on `listener` and serves `router` on each, forever.
pub async fn serve_tls(listener: TcpListener, router: Router, config: ServerConfig) {
    let acceptor = TlsAcceptor::from(Arc::new(config));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!("accept failed: {error}");
                continue;
            }
        };
        // No Nagle: streamed tokens leave at once.
        let _ = stream.set_nodelay(true);
        let acceptor = acceptor.clone();
        let service = TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let stream = match acceptor.accept(stream).await {
                Ok(stream) => stream,
                Err(error) => {
                    tracing::debug!(%peer, "TLS handshake failed: {error}");
                    return;
                }
            };
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            if let Err(error) = builder
                .serve_connection_with_upgrades(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, "connection ended: {error}");
            }
        });
    }
}
