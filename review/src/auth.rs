//! Who may see the page: one admin token, a session cookie that never holds
//! it, and a CSRF token for every form.
//!
//! - The token comes from the environment and must be at least
//!   [`MIN_TOKEN_LEN`] characters ([`AdminToken::new`]).
//! - Logging in (the form posts the token) sets the cookie [`COOKIE`] to
//!   `HMAC-SHA256(server key, "session\n" || token)`, HttpOnly and
//!   SameSite=Strict. The server key is 32 random bytes drawn at start, so a
//!   restart ends every session, and a stolen cookie reveals nothing about
//!   the token.
//! - A request may instead send `Authorization: Bearer TOKEN`.
//! - Every POST carries a hidden `csrf` field, `HMAC-SHA256(server key,
//!   "csrf\n" || session)`: a page of another site cannot read it, so it
//!   cannot forge a form (SameSite=Strict already keeps the cookie off such
//!   requests; this holds when a browser does not honour it).
//!
//! All comparisons are constant-time ([`subtle`]).

use axum::http::HeaderMap;
use axum::http::header::{AUTHORIZATION, COOKIE as COOKIE_HEADER};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Shortest admin token accepted.
pub const MIN_TOKEN_LEN: usize = 16;

/// Name of the session cookie.
pub const COOKIE: &str = "canarygate_review";

/// How long a login lasts, in seconds (the cookie's `Max-Age`).
pub const SESSION_SECONDS: u64 = 12 * 3600;

/// The admin token, and the keys derived from it.
pub struct AdminToken {
    key: [u8; 32],
    session: [u8; 32],
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

/// Why a token was refused at start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadToken {
    /// Shorter than [`MIN_TOKEN_LEN`].
    #[error("the admin token is {0} characters; it must be at least {MIN_TOKEN_LEN}")]
    TooShort(usize),
    /// The system could not give random bytes for the server key.
    #[error("cannot draw a random server key: {0}")]
    NoRandom(String),
}

impl AdminToken {
    /// Accepts `token` (trimmed of surrounding whitespace, as an
    /// environment variable set from a file may end in a newline).
    pub fn new(token: &str) -> Result<Self, BadToken> {
        let mut key = [0; 32];
        getrandom::fill(&mut key).map_err(|error| BadToken::NoRandom(error.to_string()))?;
        Self::with_key(token, key)
    }

    fn with_key(token: &str, key: [u8; 32]) -> Result<Self, BadToken> {
        let token = token.trim();
        let length = token.chars().count();
        if length < MIN_TOKEN_LEN {
            return Err(BadToken::TooShort(length));
        }
        let session = mac(&key, b"session\n", token.as_bytes());
        Ok(Self { key, session })
    }

    /// The cookie value a correct login gets (hex).
    pub fn session_value(&self) -> String {
        hex::encode(self.session)
    }

    /// Whether `token` (from the login form or a bearer header) is the
    /// admin token.
    pub fn token_matches(&self, token: &str) -> bool {
        let offered = mac(&self.key, b"session\n", token.trim().as_bytes());
        bool::from(offered.ct_eq(&self.session))
    }

    /// Whether the request carries a valid session cookie or bearer token.
    pub fn authenticated(&self, headers: &HeaderMap) -> bool {
        let bearer = headers
            .get_all(AUTHORIZATION)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .filter_map(|value| value.strip_prefix("Bearer "))
            .any(|token| self.token_matches(token));
        bearer || cookie_values(headers).any(|value| self.session_matches(value))
    }

    fn session_matches(&self, value: &str) -> bool {
        let mut offered = [0; 32];
        hex::decode_to_slice(value, &mut offered).is_ok()
            && bool::from(offered.ct_eq(&self.session))
    }

    /// The CSRF token every form of an authenticated page carries (hex).
    pub fn csrf(&self) -> String {
        hex::encode(mac(&self.key, b"csrf\n", &self.session))
    }

    /// Whether `offered` is the CSRF token.
    pub fn csrf_matches(&self, offered: &str) -> bool {
        let expected = mac(&self.key, b"csrf\n", &self.session);
        let mut given = [0; 32];
        hex::decode_to_slice(offered.trim(), &mut given).is_ok()
            && bool::from(given.ct_eq(&expected))
    }

    /// The `Set-Cookie` value of a login.
    pub fn login_cookie(&self) -> String {
        format!(
            "{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict; Max-Age={SESSION_SECONDS}",
            self.session_value()
        )
    }
}

/// The `Set-Cookie` value that ends a session.
pub fn logout_cookie() -> String {
    format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0")
}

/// Values of the [`COOKIE`] cookie in the request's `Cookie` headers.
fn cookie_values(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(COOKIE_HEADER)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .filter(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value)
}

fn mac(key: &[u8; 32], domain: &[u8], message: &[u8]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(domain);
    mac.update(message);
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    const TOKEN: &str = "correct horse battery staple";

    fn token() -> AdminToken {
        AdminToken::with_key(TOKEN, [7; 32]).unwrap()
    }

    #[test]
    fn short_tokens_are_refused() {
        assert_eq!(AdminToken::new("short").unwrap_err(), BadToken::TooShort(5));
        assert_eq!(
            AdminToken::new("   fifteen chars  \n").unwrap_err(),
            BadToken::TooShort(13)
        );
        assert!(AdminToken::new("sixteen chars ok").is_ok());
    }

    #[test]
    fn the_cookie_holds_a_keyed_hash_not_the_token() {
        let admin = token();
        let cookie = admin.login_cookie();
        assert!(!cookie.contains(TOKEN));
        assert!(!cookie.contains(&hex::encode(TOKEN)));
        assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"));
        // Another server key gives another session value for the same token.
        let other = AdminToken::with_key(TOKEN, [8; 32]).unwrap();
        assert_ne!(admin.session_value(), other.session_value());
    }

    #[test]
    fn cookie_and_bearer_authenticate() {
        let admin = token();
        let mut headers = HeaderMap::new();
        assert!(!admin.authenticated(&headers));
        headers.insert(
            COOKIE_HEADER,
            HeaderValue::from_str(&format!("other=1; {COOKIE}={}", admin.session_value())).unwrap(),
        );
        assert!(admin.authenticated(&headers));

        let mut wrong = HeaderMap::new();
        wrong.insert(
            COOKIE_HEADER,
            HeaderValue::from_str(&format!("{COOKIE}={}", "00".repeat(32))).unwrap(),
        );
        assert!(!admin.authenticated(&wrong));
        wrong.insert(
            COOKIE_HEADER,
            HeaderValue::from_str(&format!("{COOKIE}={TOKEN}").replace(' ', "")).unwrap(),
        );
        assert!(
            !admin.authenticated(&wrong),
            "the raw token is not a session"
        );

        let mut bearer = HeaderMap::new();
        bearer.insert(
            AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {TOKEN}")).unwrap(),
        );
        assert!(admin.authenticated(&bearer));
        bearer.insert(
            AUTHORIZATION,
            HeaderValue::from_static("Bearer correct horse battery stapl"),
        );
        assert!(!admin.authenticated(&bearer));
    }

    #[test]
    fn csrf_is_tied_to_the_server_key() {
        let admin = token();
        assert!(admin.csrf_matches(&admin.csrf()));
        assert!(!admin.csrf_matches(""));
        assert!(!admin.csrf_matches("not hex"));
        assert!(!admin.csrf_matches(&admin.session_value()));
        let other = AdminToken::with_key(TOKEN, [8; 32]).unwrap();
        assert!(!admin.csrf_matches(&other.csrf()));
    }
}
