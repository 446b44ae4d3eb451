//! `[endpoints]`: what canarygate does with API endpoints whose answers it
//! cannot verify.
//!
//! Chat Completions, the Responses API, Anthropic Messages and legacy
//! completions are verified. Embeddings carry no answer text, so nothing in
//! them can be checked: they are forwarded and recorded with the verdict
//! `unverifiable`, or refused when `unverifiable = "block"`. Any other
//! `/v1/...` path is 404 unless `passthrough` lists it (or a prefix of it):
//! then it is forwarded as it is and recorded the same way.

use std::ops::Range;

use serde::Deserialize;
use toml::Spanned;

/// Paths canarygate serves itself: never a passthrough prefix.
const VERIFIED_PATHS: [&str; 5] = [
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/completions",
    "/v1/embeddings",
];

/// `[endpoints] unverifiable`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Unverifiable {
    /// Forwarded and recorded with the verdict `unverifiable`.
    #[default]
    Forward,
    /// Refused with 403 `canarygate_unverifiable_endpoint`.
    Block,
}

/// `[endpoints]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EndpointsConfig {
    /// Embeddings and passthrough paths: forwarded, or refused.
    pub unverifiable: Unverifiable,
    /// Path prefixes under `/v1/` forwarded as they are (e.g.
    /// `"/v1/files"`, `"/v1/models/"`); every other unknown path is 404.
    pub passthrough: Vec<Spanned<String>>,
}

impl EndpointsConfig {
    /// Whether `path` is listed for plain passthrough: a listed prefix
    /// that ends at a `/` of the path, or is the whole path.
    pub fn passes_through(&self, path: &str) -> bool {
        self.passthrough.iter().any(|prefix| {
            let prefix = prefix.get_ref().trim_end_matches('/');
            path.strip_prefix(prefix)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        })
    }

    /// Checks every passthrough prefix.
    pub(crate) fn validate(&self) -> Result<(), (Option<Range<usize>>, String)> {
        for prefix in &self.passthrough {
            let path = prefix.get_ref();
            let fail = |why: &str| {
                Err((
                    Some(prefix.span()),
                    format!("endpoints.passthrough `{path}` {why}"),
                ))
            };
            if !path.starts_with("/v1/") || path.len() <= "/v1/".len() {
                return fail("must be a path under /v1/, such as \"/v1/files\"");
            }
            if path.contains(['?', '#', '%', '\\', ' ']) || path.split('/').any(|s| s == "..") {
                return fail("must be a plain path: no query, fragment, escapes or `..`");
            }
            let trimmed = path.trim_end_matches('/');
            let covers = |verified: &&&str| {
                verified
                    .strip_prefix(trimmed)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
            };
            if let Some(verified) = VERIFIED_PATHS.iter().find(covers) {
                return fail(&format!(
                    "overlaps {verified}, which canarygate serves itself"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(prefixes: &[&str]) -> EndpointsConfig {
        EndpointsConfig {
            unverifiable: Unverifiable::Forward,
            passthrough: prefixes
                .iter()
                .map(|prefix| Spanned::new(0..1, (*prefix).to_owned()))
                .collect(),
        }
    }

    #[test]
    fn prefixes_match_whole_segments() {
        let endpoints = config(&["/v1/files", "/v1/batches/", "/v1/messages/batches"]);
        endpoints.validate().unwrap();
        assert!(endpoints.passes_through("/v1/files"));
        assert!(endpoints.passes_through("/v1/files/file-1/content"));
        assert!(endpoints.passes_through("/v1/batches/b1"));
        assert!(!endpoints.passes_through("/v1/filesystem"));
        assert!(!endpoints.passes_through("/v1/audio/speech"));
        assert!(endpoints.passes_through("/v1/messages/batches/b1/results"));
        assert!(!endpoints.passes_through("/v1/messages"));
        assert!(!config(&[]).passes_through("/v1/files"));
    }

    #[test]
    fn bad_prefixes_are_named() {
        for (prefix, why) in [
            ("/files", "under /v1/"),
            ("/v1/", "under /v1/"),
            ("/v1/files?x=1", "plain path"),
            ("/v1/a/../chat", "plain path"),
            ("/v1/chat", "overlaps /v1/chat/completions"),
            ("/v1/responses/", "overlaps /v1/responses"),
        ] {
            let error = config(&[prefix]).validate().unwrap_err().1;
            assert!(error.contains(why), "{prefix}: {error}");
        }
    }
}
