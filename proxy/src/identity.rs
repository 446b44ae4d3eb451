//! Client authentication and session identity.
//!
//! A session id is a keyed hash (HMAC-SHA256 with the per-install secret, or
//! the deployment's registry key when instances share a registry) of
//! the client's credential and the optional `x-canarygate-session` label. The
//! credential itself is never stored or logged: only its keyed hash.

use axum::http::{HeaderMap, HeaderValue, header};
use canarygate_policies::config::{AuthConfig, AuthMode};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::{ApiError, ErrorCode};

/// Request header a client may set to split one credential into sessions.
pub const SESSION_HEADER: &str = "x-canarygate-session";

/// Longest session label accepted.
pub const MAX_SESSION_LABEL: usize = 128;

/// Who sent a request.
pub struct Caller {
    /// The bearer credential presented. Never logged: `Debug` is not derived.
    credential: String,
    /// Keyed hash of credential + session label: the session id (32 hex chars).
    pub session_id: String,
    /// Keyed hash of the credential alone (64 hex chars), for audit records.
    pub credential_hash: String,
    /// Name of the managed client key, when auth is managed.
    pub client_name: Option<String>,
}

impl Caller {
    /// The caller's key, to forward upstream in passthrough mode (the
    /// provider's client puts it in the header its API expects).
    pub fn passthrough_key(&self) -> Result<HeaderValue, ApiError> {
        key_value(&self.credential)
    }

    /// `body` (a provider's answer) without the credentials of this request:
    /// the caller's and `provider_key` (the provider's own, under managed
    /// auth) each become [`WITHHELD_CREDENTIAL`]; `None` when neither is in
    /// it. A provider that quotes the key it was sent (in a 401's message)
    /// must not have it stored in a sample, nor, under managed auth, shown
    /// to a client that holds only its own key.
    pub fn without_credentials(
        &self,
        body: &[u8],
        provider_key: Option<&HeaderValue>,
    ) -> Option<Vec<u8>> {
        let secrets = [
            Some(self.credential.as_bytes()),
            provider_key.map(HeaderValue::as_bytes),
        ];
        let mut withheld: Option<Vec<u8>> = None;
        for secret in secrets.into_iter().flatten() {
            let text = withheld.as_deref().unwrap_or(body);
            if let Some(without) = without_secret(text, secret) {
                withheld = Some(without);
            }
        }
        withheld
    }

    /// The caller's credential, held to be taken out of the texts of an
    /// audit sample ([`CallerSecret::withhold`]).
    pub fn secret(&self) -> CallerSecret {
        CallerSecret(self.credential.clone())
    }
}

/// A caller's credential, kept in memory to be taken out of texts that are
/// stored. Never logged: `Debug` prints nothing of it.
pub struct CallerSecret(String);

impl std::fmt::Debug for CallerSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallerSecret(..)")
    }
}

impl CallerSecret {
    /// `credential`, held as a caller's (tests).
    #[cfg(test)]
    pub(crate) fn of(credential: &str) -> Self {
        Self(credential.to_owned())
    }

    /// Whether `text` holds the credential (one too short to tell from
    /// ordinary text, under [`MIN_SECRET_BYTES`], never).
    pub fn is_in(&self, text: &str) -> bool {
        self.0.len() >= MIN_SECRET_BYTES && text.contains(self.0.as_str())
    }

    /// Whether `text` ends with the credential's first `min` bytes or more
    /// (not all of it): what a cut through it leaves.
    pub fn is_cut_at_end_of(&self, text: &str, min: usize) -> bool {
        let secret = self.0.as_bytes();
        secret.len() >= MIN_SECRET_BYTES
            && (min..secret.len()).any(|len| text.as_bytes().ends_with(&secret[..len]))
    }

    /// `text` with every copy of the credential (a client that pasted its
    /// own key into a prompt) made [`WITHHELD_CREDENTIAL`]; `None` when it
    /// holds none.
    pub fn withhold(&self, text: &str) -> Option<String> {
        let without = without_secret(text.as_bytes(), self.0.as_bytes())?;
        // Header text is ASCII, so the text stays UTF-8 with it replaced.
        Some(
            String::from_utf8(without)
                .unwrap_or_else(|error| String::from_utf8_lossy(error.as_bytes()).into_owned()),
        )
    }
}

/// Shortest credential told from ordinary text: an empty or test key is
/// never looked for.
const MIN_SECRET_BYTES: usize = 8;

/// `text` with every copy of `secret` made [`WITHHELD_CREDENTIAL`]; `None`
/// when it holds none, or when `secret` is too short to tell from ordinary
/// text (under [`MIN_SECRET_BYTES`]).
fn without_secret(text: &[u8], secret: &[u8]) -> Option<Vec<u8>> {
    if secret.len() < MIN_SECRET_BYTES {
        return None;
    }
    let first = memchr::memmem::find(text, secret)?;
    let mut out = Vec::with_capacity(text.len());
    out.extend_from_slice(&text[..first]);
    let mut rest = &text[first..];
    while let Some(at) = memchr::memmem::find(rest, secret) {
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(WITHHELD_CREDENTIAL.as_bytes());
        rest = &rest[at + secret.len()..];
    }
    out.extend_from_slice(rest);
    Some(out)
}

/// What a credential quoted in a provider's answer becomes
/// ([`Caller::without_credentials`]).
pub const WITHHELD_CREDENTIAL: &str = "[credential withheld by canarygate]";

/// An API key as a sensitive header value (never printed by `Debug`).
pub fn key_value(key: &str) -> Result<HeaderValue, ApiError> {
    let mut value = HeaderValue::try_from(key).map_err(|_| {
        ApiError::new(
            ErrorCode::InvalidApiKey,
            "The API key is not valid header text.",
        )
    })?;
    value.set_sensitive(true);
    Ok(value)
}

/// Checks credentials per the policy's `[auth]` and derives session ids.
pub struct Authenticator {
    mode: AuthMode,
    /// Managed keys: (name, SHA-256 of the key).
    client_keys: Vec<(String, [u8; 32])>,
    secret: [u8; 32],
}

impl Authenticator {
    /// Builds the authenticator; `config` has been validated by the policy loader.
    pub fn new(config: &AuthConfig, secret: [u8; 32]) -> Self {
        let client_keys = config
            .client_keys
            .iter()
            .filter_map(|key| {
                let hash: [u8; 32] = hex::decode(key.sha256.get_ref()).ok()?.try_into().ok()?;
                Some((key.name.clone(), hash))
            })
            .collect();
        Self {
            mode: config.mode,
            client_keys,
            secret,
        }
    }

    /// Authenticates a request from its headers.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        let credential = bearer_token(headers)?;
        let client_name = match self.mode {
            AuthMode::Passthrough => None,
            AuthMode::Managed => Some(self.managed_key_name(credential)?),
        };
        let label = match headers.get(SESSION_HEADER) {
            None => "",
            Some(value) => value
                .to_str()
                .ok()
                .filter(|label| label.len() <= MAX_SESSION_LABEL)
                .ok_or_else(|| {
                    ApiError::new(
                        ErrorCode::InvalidSessionHeader,
                        format!(
                            "{SESSION_HEADER} must be ASCII text (visible characters, spaces and tabs) of at most {MAX_SESSION_LABEL} bytes"
                        ),
                    )
                })?,
        };
        Ok(Caller {
            session_id: self.keyed_hash(&[b"session", credential.as_bytes(), label.as_bytes()])
                [..32]
                .to_owned(),
            credential_hash: self.keyed_hash(&[b"credential", credential.as_bytes()]),
            credential: credential.to_owned(),
            client_name,
        })
    }

    /// Name of the managed key matching `credential`. Every configured key is
    /// compared in constant time, so timing reveals neither which nor how much matched.
    fn managed_key_name(&self, credential: &str) -> Result<String, ApiError> {
        let presented: [u8; 32] = Sha256::digest(credential.as_bytes()).into();
        let mut found = None;
        for (name, hash) in &self.client_keys {
            if bool::from(presented.ct_eq(hash)) {
                found = Some(name.clone());
            }
        }
        found.ok_or_else(|| {
            ApiError::new(
                ErrorCode::InvalidApiKey,
                "Incorrect API key provided: it is not one of this canarygate's client keys.",
            )
        })
    }

    /// Hex HMAC-SHA256 of the NUL-joined `parts`.
    fn keyed_hash(&self, parts: &[&[u8]]) -> String {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.secret).expect("HMAC takes any key length");
        for (index, part) in parts.iter().enumerate() {
            if index > 0 {
                mac.update(b"\0");
            }
            mac.update(part);
        }
        hex::encode(mac.finalize().into_bytes())
    }
}

/// Header carrying the key in Anthropic's API (its SDKs send it).
const API_KEY_HEADER: &str = "x-api-key";

/// The client's key: the token of `Authorization: Bearer <token>` (OpenAI's
/// clients; Anthropic's with an auth token), else `x-api-key` (Anthropic's).
fn bearer_token(headers: &HeaderMap) -> Result<&str, ApiError> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        let key = headers.get(API_KEY_HEADER).ok_or_else(|| {
            ApiError::new(
                ErrorCode::MissingApiKey,
                "You didn't provide an API key: send it as `Authorization: Bearer <key>` \
                 (or `x-api-key: <key>`).",
            )
        })?;
        return key
            .to_str()
            .ok()
            .map(str::trim)
            .filter(|key| !key.is_empty())
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::InvalidApiKey,
                    "The x-api-key header must hold the key as visible ASCII.",
                )
            });
    };
    value
        .to_str()
        .ok()
        .and_then(|text| {
            let (scheme, token) = text.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
        .filter(|token| !token.is_empty())
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::InvalidApiKey,
                "The Authorization header must be `Bearer <key>`.",
            )
        })
}

/// Lowercase hex SHA-256 of a client key, as listed in `auth.client_keys`.
pub fn client_key_hash(key: &str) -> String {
    hex::encode(Sha256::digest(key.trim().as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use canarygate_policies::config::Policy;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    #[test]
    fn passthrough_sessions_depend_on_key_and_label() {
        let auth = Authenticator::new(&AuthConfig::default(), [7; 32]);
        let a = auth
            .authenticate(&headers(&[("authorization", "Bearer k1")]))
            .unwrap();
        let b = auth
            .authenticate(&headers(&[("authorization", "Bearer k2")]))
            .unwrap();
        let a2 = auth
            .authenticate(&headers(&[
                ("authorization", "Bearer k1"),
                (SESSION_HEADER, "job-2"),
            ]))
            .unwrap();
        assert_ne!(a.session_id, b.session_id);
        assert_ne!(a.session_id, a2.session_id);
        assert_eq!(a.credential_hash, a2.credential_hash);
        assert!(!a.credential_hash.contains("k1"));
        // A different install secret gives unrelated ids.
        let other = Authenticator::new(&AuthConfig::default(), [8; 32]);
        let a_other = other
            .authenticate(&headers(&[("authorization", "Bearer k1")]))
            .unwrap();
        assert_ne!(a.session_id, a_other.session_id);
        // A label is ASCII text, spaces and tabs included, of at most 128
        // bytes.
        let label = |value: &[u8]| {
            let mut map = headers(&[("authorization", "Bearer k1")]);
            map.insert(SESSION_HEADER, HeaderValue::from_bytes(value).unwrap());
            auth.authenticate(&map).map(|caller| caller.session_id)
        };
        assert_ne!(label(b"job 1").unwrap(), label(b"job\t1").unwrap());
        assert!(label(&[b'j'; 128]).is_ok());
        for refused in [&[b'j'; 129][..], "caf\u{e9}".as_bytes()] {
            let error = label(refused).unwrap_err();
            assert_eq!(error.code, ErrorCode::InvalidSessionHeader);
        }
    }

    #[test]
    fn a_providers_answer_quoting_a_credential_loses_it() {
        let auth = Authenticator::new(&AuthConfig::default(), [7; 32]);
        let caller = auth
            .authenticate(&headers(&[(
                "authorization",
                "Bearer sk-caller-0123456789",
            )]))
            .unwrap();
        let body = br#"{"error":{"message":"Incorrect API key provided: sk-caller-0123456789 (and sk-caller-0123456789)."}}"#;
        let withheld = caller.without_credentials(body, None).unwrap();
        let text = String::from_utf8(withheld).unwrap();
        assert!(!text.contains("sk-caller"), "{text}");
        assert_eq!(text.matches(WITHHELD_CREDENTIAL).count(), 2, "{text}");
        // The provider's own key, under managed auth.
        let provider = HeaderValue::from_static("sk-provider-abcdefgh");
        let body = b"bad key sk-provider-abcdefgh";
        let withheld = caller.without_credentials(body, Some(&provider)).unwrap();
        assert_eq!(
            withheld,
            format!("bad key {WITHHELD_CREDENTIAL}").as_bytes()
        );
        assert_eq!(
            caller.without_credentials(b"nothing here", Some(&provider)),
            None
        );
    }

    #[test]
    fn missing_and_malformed_credentials() {
        let auth = Authenticator::new(&AuthConfig::default(), [7; 32]);
        let missing = auth.authenticate(&HeaderMap::new()).err().unwrap();
        assert_eq!(missing.code, ErrorCode::MissingApiKey);
        let basic = auth
            .authenticate(&headers(&[("authorization", "Basic abc")]))
            .err()
            .unwrap();
        assert_eq!(basic.code, ErrorCode::InvalidApiKey);
        // Anthropic's header names the same session as a bearer token.
        let bearer = auth
            .authenticate(&headers(&[("authorization", "Bearer k1")]))
            .unwrap();
        let api_key = auth.authenticate(&headers(&[("x-api-key", "k1")])).unwrap();
        assert_eq!(bearer.session_id, api_key.session_id);
        let empty = auth
            .authenticate(&headers(&[("x-api-key", " ")]))
            .err()
            .unwrap();
        assert_eq!(empty.code, ErrorCode::InvalidApiKey);
    }

    #[test]
    fn managed_keys_match_by_hash() {
        let text = format!(
            "[auth]\nmode = \"managed\"\nclient_keys = [{{ name = \"cron\", sha256 = \"{}\" }}]\n\
             [[providers]]\nname = \"p\"\nbase_url = \"http://x\"\ncontext_window = 10\napi_key_env = \"K\"\n\
             [[routes]]\nmodel = \"*\"\nprovider = \"p\"\n",
            client_key_hash("proxy-key-1")
        );
        let policy = Policy::from_toml_str(&text, "t.toml").unwrap();
        let auth = Authenticator::new(&policy.auth, [1; 32]);
        let caller = auth
            .authenticate(&headers(&[("authorization", "Bearer proxy-key-1")]))
            .unwrap();
        assert_eq!(caller.client_name.as_deref(), Some("cron"));
        let wrong = auth
            .authenticate(&headers(&[("authorization", "Bearer proxy-key-2")]))
            .err()
            .unwrap();
        assert_eq!(wrong.code, ErrorCode::InvalidApiKey);
    }
}
