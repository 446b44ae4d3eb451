//! Per-install secrets, keyed hashes, and sample encryption.
//!
//! `DIR/secret.key` holds 32 random bytes (mode 0600), created on first use.
//! Named secrets (session hashing, canary hashing, credential hashing) are
//! derived from it with HMAC-SHA256, so one file serves them all. The file is
//! kept out of the redb store so the store holds no secret material at all.

use std::fs;
use std::io::Write;
use std::path::Path;

use chacha20poly1305::aead::{Aead, Payload};
use chacha20poly1305::{ChaCha20Poly1305, KeyInit, Nonce};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::AuditError;

/// File name of the per-install secret inside the data directory.
pub const SECRET_FILE: &str = "secret.key";

/// The install's secrets, derived from `DIR/secret.key`.
#[derive(Clone)]
pub struct Secrets {
    master: [u8; 32],
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secrets(..)")
    }
}

impl Secrets {
    /// Loads `dir/secret.key`, creating it (0600, fsynced) when missing.
    pub fn load_or_create(dir: &Path) -> Result<Self, AuditError> {
        let path = dir.join(SECRET_FILE);
        match fs::read(&path) {
            Ok(bytes) => Self::from_file_bytes(&bytes, &path),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                let mut master = [0; 32];
                getrandom::fill(&mut master).map_err(|error| {
                    AuditError::Io(format!("no randomness for {}: {error}", path.display()))
                })?;
                // Write a temporary file, then link it into place: a crash leaves
                // either no key or a whole one, and two racing creators agree.
                let temporary = dir.join(format!(".{SECRET_FILE}.{}", std::process::id()));
                let io = |error: std::io::Error| {
                    AuditError::Io(format!("cannot create {}: {error}", path.display()))
                };
                {
                    // A leftover of a crashed creator with our pid.
                    let _ = fs::remove_file(&temporary);
                    let mut file = crate::files::create_private_file(&temporary).map_err(io)?;
                    file.write_all(&master).map_err(io)?;
                    file.sync_all().map_err(io)?;
                }
                let linked = fs::hard_link(&temporary, &path);
                let _ = fs::remove_file(&temporary);
                match linked {
                    Ok(()) => {
                        if let Ok(directory) = fs::File::open(dir) {
                            let _ = directory.sync_all();
                        }
                        Ok(Self { master })
                    }
                    Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
                        let bytes = fs::read(&path).map_err(io)?;
                        Self::from_file_bytes(&bytes, &path)
                    }
                    Err(error) => Err(io(error)),
                }
            }
            Err(error) => Err(AuditError::Io(format!(
                "cannot read {}: {error}",
                path.display()
            ))),
        }
    }

    fn from_file_bytes(bytes: &[u8], path: &Path) -> Result<Self, AuditError> {
        let master = bytes.try_into().map_err(|_| {
            AuditError::Io(format!(
                "{} holds {} bytes, expected 32: restore it or remove it \
                 (hashes made with the old one will no longer match)",
                path.display(),
                bytes.len()
            ))
        })?;
        Ok(Self { master })
    }

    /// Secrets derived from `master` instead of the install's file: a key
    /// shared by the instances of one deployment.
    pub fn from_master(master: [u8; 32]) -> Self {
        Self { master }
    }

    /// The 32-byte secret called `name` (e.g. `session`, `canary`, `credential`).
    pub fn secret(&self, name: &str) -> [u8; 32] {
        hmac_sha256(&self.master, format!("canarygate-secret:{name}").as_bytes())
    }

    /// Keyed hash (hex) of a client credential or API key, for audit records.
    pub fn hash_credential(&self, credential: &str) -> String {
        hex::encode(hmac_sha256(
            &self.secret("credential"),
            credential.as_bytes(),
        ))
    }
}

/// A 32-byte key written as 64 hex characters or standard base64
/// (surrounding whitespace ignored).
pub fn parse_key(text: &str) -> Option<[u8; 32]> {
    let text = text.trim();
    let bytes = if text.len() == 64 {
        hex::decode(text).ok()
    } else {
        decode_base64(text)
    };
    bytes.and_then(|bytes| bytes.try_into().ok())
}

/// HMAC-SHA256 of `message` under `key`.
pub fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts any key length");
    mac.update(message);
    mac.finalize().into_bytes().into()
}

/// Key for encrypting samples at rest (ChaCha20-Poly1305).
#[derive(Clone)]
pub struct SampleKey {
    cipher: ChaCha20Poly1305,
}

impl std::fmt::Debug for SampleKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SampleKey(..)")
    }
}

const CLEAR: u8 = 0;
const SEALED: u8 = 1;

impl SampleKey {
    /// Reads a 32-byte key given as 64 hex characters or standard base64.
    pub fn parse(text: &str) -> Result<Self, AuditError> {
        let key = parse_key(text).ok_or_else(|| {
            AuditError::Key(
                "the sample key must be 32 bytes, as 64 hex characters or base64".into(),
            )
        })?;
        Ok(Self {
            cipher: ChaCha20Poly1305::new(&key.into()),
        })
    }

    /// Reads the key from environment variable `var`; `Ok(None)` when unset.
    pub fn from_env(var: &str) -> Result<Option<Self>, AuditError> {
        match std::env::var(var) {
            Ok(text) => Self::parse(&text)
                .map(Some)
                .map_err(|error| AuditError::Key(format!("${var}: {error}"))),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(AuditError::Key(format!("${var} is not valid UTF-8")))
            }
        }
    }
}

/// Encodes a sample for storage, encrypted when `key` is given. `bound_to`
/// (the request id) is authenticated, so a sample cannot be moved to another record.
pub(crate) fn seal_sample(
    plain: &[u8],
    key: Option<&SampleKey>,
    bound_to: &str,
) -> Result<Vec<u8>, AuditError> {
    let Some(key) = key else {
        let mut out = Vec::with_capacity(1 + plain.len());
        out.push(CLEAR);
        out.extend_from_slice(plain);
        return Ok(out);
    };
    let mut nonce = [0; 12];
    getrandom::fill(&mut nonce)
        .map_err(|error| AuditError::Key(format!("no randomness for a nonce: {error}")))?;
    let sealed = key
        .cipher
        .encrypt(
            &Nonce::from(nonce),
            Payload {
                msg: plain,
                aad: bound_to.as_bytes(),
            },
        )
        .map_err(|_| AuditError::Key("sample encryption failed".into()))?;
    let mut out = Vec::with_capacity(13 + sealed.len());
    out.push(SEALED);
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&sealed);
    Ok(out)
}

/// Decodes a stored sample; encrypted ones need `key`.
pub(crate) fn open_sample(
    stored: &[u8],
    key: Option<&SampleKey>,
    bound_to: &str,
) -> Result<Vec<u8>, AuditError> {
    match stored.split_first() {
        Some((&CLEAR, plain)) => Ok(plain.to_vec()),
        Some((&SEALED, rest)) if rest.len() >= 12 + 16 => {
            let key = key.ok_or_else(|| {
                AuditError::Key("this sample is encrypted; set the key (see --key-env)".into())
            })?;
            let (nonce, sealed) = rest.split_at(12);
            let nonce: [u8; 12] = nonce.try_into().expect("split at 12");
            key.cipher
                .decrypt(
                    &Nonce::from(nonce),
                    Payload {
                        msg: sealed,
                        aad: bound_to.as_bytes(),
                    },
                )
                .map_err(|_| {
                    AuditError::Key(
                        "cannot decrypt the sample: wrong key, or the sample was altered".into(),
                    )
                })
        }
        _ => Err(AuditError::Corrupt(
            "stored sample has an unknown format".into(),
        )),
    }
}

/// Standard base64 (with or without padding); `None` on anything else.
fn decode_base64(text: &str) -> Option<Vec<u8>> {
    let text = text.trim_end_matches('=');
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut buffer, mut bits) = (0u32, 0);
    for byte in text.bytes() {
        let value = match byte {
            b'A'..=b'Z' => byte - b'A',
            b'a'..=b'z' => byte - b'a' + 26,
            b'0'..=b'9' => byte - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        buffer = (buffer << 6) | u32::from(value);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((buffer >> bits) as u8);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_from_hex_and_base64_only_when_32_bytes() {
        let hex_key = "00".repeat(32);
        assert!(SampleKey::parse(&hex_key).is_ok());
        // 32 zero bytes in base64.
        assert!(SampleKey::parse("AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=").is_ok());
        assert!(SampleKey::parse("abc").is_err());
        assert!(SampleKey::parse(&"zz".repeat(32)).is_err());
        assert!(SampleKey::parse("AAAA").is_err());
    }

    #[test]
    fn sealed_samples_need_the_right_key_and_binding() {
        let key = SampleKey::parse(&"11".repeat(32)).unwrap();
        let other = SampleKey::parse(&"22".repeat(32)).unwrap();
        let sealed = seal_sample(b"hello text", Some(&key), "req-1").unwrap();
        assert!(!sealed.windows(10).any(|w| w == b"hello text"));
        assert_eq!(
            open_sample(&sealed, Some(&key), "req-1").unwrap(),
            b"hello text"
        );
        assert!(open_sample(&sealed, Some(&other), "req-1").is_err());
        assert!(open_sample(&sealed, Some(&key), "req-2").is_err());
        assert!(open_sample(&sealed, None, "req-1").is_err());
        let clear = seal_sample(b"hello text", None, "req-1").unwrap();
        assert_eq!(open_sample(&clear, None, "req-1").unwrap(), b"hello text");
        assert!(open_sample(&[9, 1, 2], None, "x").is_err());
    }

    #[test]
    fn secret_file_is_created_once_with_owner_only_permissions() {
        let dir = tempfile::tempdir().unwrap();
        let first = Secrets::load_or_create(dir.path()).unwrap();
        let again = Secrets::load_or_create(dir.path()).unwrap();
        assert_eq!(first.secret("session"), again.secret("session"));
        assert_ne!(first.secret("session"), first.secret("canary"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(dir.path().join(SECRET_FILE))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        fs::write(dir.path().join(SECRET_FILE), b"short").unwrap();
        let error = Secrets::load_or_create(dir.path()).unwrap_err();
        assert!(error.to_string().contains("expected 32"), "{error}");
    }
}
