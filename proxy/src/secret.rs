//! The per-install secret that keys session and credential hashes.
//!
//! Stored as 64 hex characters in `DATA_DIR/secret.key` (mode 0600), created on
//! first start from the OS CSPRNG. Losing it only means session ids change.

use std::io::Write;
use std::path::Path;

/// Length of the secret in bytes.
pub const SECRET_LEN: usize = 32;

/// Reads `path`, or creates it with fresh random bytes when it does not exist.
pub fn load_or_create(path: &Path) -> std::io::Result<[u8; SECRET_LEN]> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse(text.trim()).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{} must hold {} hex characters; delete it to make a new one",
                    path.display(),
                    SECRET_LEN * 2
                ),
            )
        }),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            let mut secret = [0u8; SECRET_LEN];
            getrandom::fill(&mut secret)
                .map_err(|error| std::io::Error::other(error.to_string()))?;
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            let mut options = std::fs::OpenOptions::new();
            options.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
            let mut file = options.open(path)?;
            file.write_all(hex::encode(secret).as_bytes())?;
            file.sync_all()?;
            Ok(secret)
        }
        Err(error) => Err(error),
    }
}

/// A sub-key of `secret` for one `purpose`, so each use has its own key.
pub fn derive(secret: &[u8; SECRET_LEN], purpose: &str) -> [u8; 32] {
    use hmac::{Hmac, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(purpose.as_bytes());
    mac.finalize().into_bytes().into()
}

fn parse(text: &str) -> Option<[u8; SECRET_LEN]> {
    let bytes = hex::decode(text).ok()?;
    bytes.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_once_then_reloaded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/secret.key");
        let first = load_or_create(&path).unwrap();
        assert_eq!(load_or_create(&path).unwrap(), first);
        std::fs::write(&path, "not hex").unwrap();
        assert!(load_or_create(&path).is_err());
    }
}
