//! Who may see the page: one admin token, a session cookie that never holds
//! it, and a CSRF token for every form.
//!
//! - The token comes from the environment and must be at least
//!   [`MIN_TOKEN_LEN`] characters ([`AdminToken::new`]).
//! - Logging in (the form posts the token) starts a session: the cookie
//!   [`COOKIE`], HttpOnly and SameSite=Strict, holds a random session id,
//!   the time it was issued, and `HMAC-SHA256(server key, "session\n" || id
//!   || issued)`. The server accepts it for [`SESSION_SECONDS`] after it was
//!   issued, whatever the browser keeps, and not after its logout (the ids
//!   logged out are kept until their sessions would have ended). The server
//!   key is 32 random bytes drawn at start, so a restart ends every session,
//!   and a stolen cookie reveals nothing about the token.
//! - A request may instead send `Authorization: Bearer TOKEN`.
//! - Every POST carries a hidden `csrf` field, `HMAC-SHA256(server key,
//!   "csrf\n")`: a page of another site cannot read it, so it cannot forge a
//!   form (SameSite=Strict already keeps the cookie off such requests; this
//!   holds when a browser does not honour it).
//!
//! All comparisons are constant-time ([`subtle`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use axum::http::header::{AUTHORIZATION, COOKIE as COOKIE_HEADER};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Shortest admin token accepted.
pub const MIN_TOKEN_LEN: usize = 16;

/// Name of the session cookie.
pub const COOKIE: &str = "canarygate_review";

/// How long a login lasts, in seconds: the cookie's `Max-Age`, and how long
/// after it was issued the server accepts it.
pub const SESSION_SECONDS: u64 = 12 * 3600;

/// Bytes of a session id.
const SESSION_ID: usize = 16;

/// A session cookie's bytes: id, issue time (seconds, big-endian), MAC.
const SESSION_BYTES: usize = SESSION_ID + 8 + 32;

/// The admin token, and the keys derived from it.
pub struct AdminToken {
    key: [u8; 32],
    /// `HMAC(key, "session\n" || token)`: what a login is checked against.
    token_mac: [u8; 32],
    /// Session ids logged out, with when their sessions would have ended.
    logged_out: Mutex<HashMap<[u8; SESSION_ID], u64>>,
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
        let token_mac = mac(&key, b"session\n", token.as_bytes());
        Ok(Self {
            key,
            token_mac,
            logged_out: Mutex::new(HashMap::new()),
        })
    }

    /// Whether `token` (from the login form or a bearer header) is the
    /// admin token.
    pub fn token_matches(&self, token: &str) -> bool {
        let offered = mac(&self.key, b"session\n", token.trim().as_bytes());
        bool::from(offered.ct_eq(&self.token_mac))
    }

    /// Whether the request carries a live session cookie or the token as
    /// a bearer.
    pub fn authenticated(&self, headers: &HeaderMap) -> bool {
        let bearer = headers
            .get_all(AUTHORIZATION)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .filter_map(|value| value.strip_prefix("Bearer "))
            .any(|token| self.token_matches(token));
        bearer || self.session(headers).is_some()
    }

    /// The id of the live session the request's cookie holds.
    fn session(&self, headers: &HeaderMap) -> Option<[u8; SESSION_ID]> {
        let now = now_s();
        cookie_values(headers).find_map(|value| {
            let (id, issued) = self.open(value)?;
            let live = issued <= now && now < issued.saturating_add(SESSION_SECONDS);
            let logged_out = self
                .logged_out
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .contains_key(&id);
            (live && !logged_out).then_some(id)
        })
    }

    /// The id and issue time a cookie value holds, when its MAC is right.
    fn open(&self, value: &str) -> Option<([u8; SESSION_ID], u64)> {
        let mut bytes = [0; SESSION_BYTES];
        hex::decode_to_slice(value, &mut bytes).ok()?;
        let (signed, offered) = bytes.split_at(SESSION_ID + 8);
        let expected = mac(&self.key, b"session\n", signed);
        if !bool::from(offered.ct_eq(&expected)) {
            return None;
        }
        let id = signed[..SESSION_ID].try_into().ok()?;
        let issued = u64::from_be_bytes(signed[SESSION_ID..].try_into().ok()?);
        Some((id, issued))
    }

    /// A new session's cookie value, issued at `issued` (unix seconds).
    fn session_value(&self, issued: u64) -> String {
        let mut signed = [0; SESSION_ID + 8];
        // Without randomness the id is the MAC of the time: still unforgeable.
        if getrandom::fill(&mut signed[..SESSION_ID]).is_err() {
            let fallback = mac(&self.key, b"id\n", &issued.to_be_bytes());
            signed[..SESSION_ID].copy_from_slice(&fallback[..SESSION_ID]);
        }
        signed[SESSION_ID..].copy_from_slice(&issued.to_be_bytes());
        let tag = mac(&self.key, b"session\n", &signed);
        hex::encode([&signed[..], &tag[..]].concat())
    }

    /// Ends the session the request's cookie holds: refused from now on.
    /// Ids whose sessions have ended anyway are forgotten.
    pub fn log_out(&self, headers: &HeaderMap) {
        let now = now_s();
        let ended: Vec<([u8; SESSION_ID], u64)> = cookie_values(headers)
            .filter_map(|value| self.open(value))
            .collect();
        let mut logged_out = self
            .logged_out
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        logged_out.retain(|_, until| *until > now);
        for (id, issued) in ended {
            logged_out.insert(id, issued.saturating_add(SESSION_SECONDS));
        }
    }

    /// The CSRF token every form of an authenticated page carries (hex).
    pub fn csrf(&self) -> String {
        hex::encode(mac(&self.key, b"csrf\n", &[]))
    }

    /// Whether `offered` is the CSRF token.
    pub fn csrf_matches(&self, offered: &str) -> bool {
        let expected = mac(&self.key, b"csrf\n", &[]);
        let mut given = [0; 32];
        hex::decode_to_slice(offered.trim(), &mut given).is_ok()
            && bool::from(given.ct_eq(&expected))
    }

    /// The `Set-Cookie` value of a login: a new session.
    pub fn login_cookie(&self) -> String {
        format!(
            "{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict; Max-Age={SESSION_SECONDS}",
            self.session_value(now_s())
        )
    }
}

/// The `Set-Cookie` value that ends a session.
pub fn logout_cookie() -> String {
    format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0")
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
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

    fn cookie(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            COOKIE_HEADER,
            HeaderValue::from_str(&format!("other=1; {COOKIE}={value}")).unwrap(),
        );
        headers
    }

    /// The value of a `Set-Cookie` of [`COOKIE`].
    fn value_of(set_cookie: &str) -> &str {
        set_cookie
            .strip_prefix(&format!("{COOKIE}="))
            .and_then(|rest| rest.split(';').next())
            .unwrap()
    }

    #[test]
    fn the_cookie_holds_a_keyed_hash_not_the_token() {
        let admin = token();
        let login = admin.login_cookie();
        assert!(!login.contains(TOKEN));
        assert!(!login.contains(&hex::encode(TOKEN)));
        assert!(login.contains("HttpOnly") && login.contains("SameSite=Strict"));
        // Each login is a session of its own; another server key accepts none.
        assert_ne!(value_of(&login), value_of(&admin.login_cookie()));
        let other = AdminToken::with_key(TOKEN, [8; 32]).unwrap();
        assert!(!other.authenticated(&cookie(value_of(&login))));
    }

    #[test]
    fn cookie_and_bearer_authenticate() {
        let admin = token();
        assert!(!admin.authenticated(&HeaderMap::new()));
        let login = admin.login_cookie();
        assert!(admin.authenticated(&cookie(value_of(&login))));
        assert!(!admin.authenticated(&cookie(&"00".repeat(SESSION_BYTES))));
        assert!(
            !admin.authenticated(&cookie(&TOKEN.replace(' ', ""))),
            "the raw token is not a session"
        );
        // One byte of the id or the time changed: the MAC no longer fits.
        let mut forged = value_of(&login).to_owned();
        forged.replace_range(0..2, if &forged[0..2] == "00" { "01" } else { "00" });
        assert!(!admin.authenticated(&cookie(&forged)));

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
    fn a_session_ends_after_its_hours_and_at_its_logout() {
        let admin = token();
        let now = now_s();
        let old = admin.session_value(now - SESSION_SECONDS - 1);
        assert!(!admin.authenticated(&cookie(&old)), "past its 12 hours");
        let recent = admin.session_value(now - SESSION_SECONDS + 60);
        assert!(admin.authenticated(&cookie(&recent)));
        let future = admin.session_value(now + 3600);
        assert!(
            !admin.authenticated(&cookie(&future)),
            "issued later than now"
        );

        let other = admin.session_value(now);
        admin.log_out(&cookie(&recent));
        assert!(!admin.authenticated(&cookie(&recent)), "logged out");
        assert!(
            admin.authenticated(&cookie(&other)),
            "another session goes on"
        );
    }

    #[test]
    fn csrf_is_tied_to_the_server_key() {
        let admin = token();
        assert!(admin.csrf_matches(&admin.csrf()));
        assert!(!admin.csrf_matches(""));
        assert!(!admin.csrf_matches("not hex"));
        assert!(!admin.csrf_matches(&admin.session_value(now_s())));
        let other = AdminToken::with_key(TOKEN, [8; 32]).unwrap();
        assert!(!admin.csrf_matches(&other.csrf()));
    }
}
