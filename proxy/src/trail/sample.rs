//! A request's sample and its topic score taken later: the texts a sample
//! is made of (redacted only when it is kept), and the task that scores an
//! answer after its record is durable and appends the score.

use std::sync::Arc;

use canarygate_audit::{AuditLog, Recorded, Sample, should_sample};
use canarygate_policies::canary::replace_canaries;
use canarygate_policies::topic::sample_chance;

use crate::topic::{HeldBytes, TopicCheck};

/// Placeholder for a canary in sampled text.
const REDACTED: &str = "[canary]";

/// Most response bytes kept for a spot-check sample.
const MAX_SAMPLE_BYTES: usize = 256 * 1024;

/// The room [`KeptBytes`] start with. They come in pieces (a stream's
/// events, a few hundred bytes each) and grow fourfold from here: a 17 KB
/// stream is kept in three allocations, where Vec's doubling from the first
/// event's size took seven.
const KEPT_START_BYTES: usize = 2 * 1024;

/// The first [`MAX_SAMPLE_BYTES`] of what the client was sent, kept until
/// the record decides whether a sample is drawn.
#[derive(Debug, Default)]
pub(crate) struct KeptBytes(Vec<u8>);

impl KeptBytes {
    /// Keeps what of `bytes` fits.
    pub fn push(&mut self, bytes: &[u8]) {
        let room = MAX_SAMPLE_BYTES.saturating_sub(self.0.len());
        let kept = &bytes[..bytes.len().min(room)];
        let needed = self.0.len() + kept.len();
        let capacity = self.0.capacity();
        if needed > capacity {
            // A fourfold step, not Vec's twofold: the pieces are small.
            let grown = (capacity * 4).clamp(KEPT_START_BYTES, MAX_SAMPLE_BYTES);
            self.0.reserve_exact(grown.max(needed) - self.0.len());
        }
        self.0.extend_from_slice(kept);
    }

    /// The bytes kept, leaving none.
    pub fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.0)
    }
}

/// The texts a sample is made of, before redaction.
pub(crate) struct SampleTexts {
    pub request: Vec<u8>,
    pub response: Vec<u8>,
    /// What the provider sent, kept when the verdict failed.
    pub provider: Option<String>,
}

impl SampleTexts {
    /// Bytes held.
    pub fn len(&self) -> usize {
        self.request.len() + self.response.len() + self.provider.as_ref().map_or(0, String::len)
    }

    /// The sample, canaries redacted.
    pub fn sample(&self) -> Sample {
        Sample {
            request_text: redact(&String::from_utf8_lossy(&self.request)),
            response_text: redact(&String::from_utf8_lossy(&self.response)),
            provider_text: self.provider.as_ref().map(|sent| redact(sent)),
        }
    }
}

/// A topic score taken after the request's record was written.
pub(crate) struct ScoreLater {
    pub log: AuditLog,
    pub check: Arc<TopicCheck>,
    pub request_id: String,
    pub question: Option<String>,
    pub answer: Option<String>,
    /// The sample's texts, when the request record kept none (their bytes
    /// counted while they wait).
    pub texts: Option<(SampleTexts, HeldBytes)>,
    pub rate: f64,
}

impl ScoreLater {
    /// Scores, and appends the score after the request's record.
    pub async fn run(self, recorded: Recorded) {
        let score = self.check.score(self.question, self.answer).await;
        // The plain share was drawn with the request record: what is left
        // is the chance the score adds.
        let chance = sample_chance(self.rate, false, score.similarity, score.min_similarity);
        let added = if self.rate < 1.0 {
            (chance - self.rate) / (1.0 - self.rate)
        } else {
            0.0
        };
        let sample = self
            .texts
            .filter(|_| should_sample(added))
            .map(|(texts, _held)| texts.sample());
        let scored_id = match recorded.id().await {
            Ok(id) => id,
            Err(error) => {
                tracing::error!(request_id = %self.request_id, "no topic score: the request's record failed: {error}");
                return;
            }
        };
        if let Err(error) = self
            .log
            .append_topic(scored_id, &self.request_id, score, sample.as_ref())
            .await
        {
            tracing::error!(request_id = %self.request_id, "audit append of a topic score failed: {error}");
        }
    }
}

/// `text` with every canary-shaped span replaced by [`REDACTED`].
fn redact(text: &str) -> String {
    replace_canaries(text, REDACTED)
}

#[cfg(test)]
#[test]
fn redaction_removes_canaries_and_keeps_the_rest() {
    let text = "before CG482937105662831 mid cg 482 937 105 662 831 after";
    assert_eq!(redact(text), "before [canary] mid [canary] after");
    assert_eq!(redact("no canary here"), "no canary here");
}

#[cfg(test)]
#[test]
fn kept_bytes_are_the_first_of_what_was_sent_in_few_allocations() {
    let piece: Vec<u8> = (0..300u32).map(|n| (n % 251) as u8).collect();
    let mut kept = KeptBytes::default();
    let mut sent = Vec::new();
    let mut capacities = Vec::new();
    // A 17 KB stream.
    for _ in 0..58 {
        kept.push(&piece);
        sent.extend_from_slice(&piece);
        if capacities.last() != Some(&kept.0.capacity()) {
            capacities.push(kept.0.capacity());
        }
    }
    assert_eq!(kept.0, sent);
    assert_eq!(capacities, [2 * 1024, 8 * 1024, 32 * 1024]);
    // A long one is cut at the limit, and never holds more than it.
    for _ in 0..1_000 {
        kept.push(&piece);
        sent.extend_from_slice(&piece);
    }
    assert!(kept.0.capacity() <= MAX_SAMPLE_BYTES);
    assert_eq!(kept.take(), sent[..MAX_SAMPLE_BYTES]);
    // A whole answer is kept in one allocation of its size (or the start).
    let mut whole = KeptBytes::default();
    whole.push(&[7; 5_000]);
    assert_eq!((whole.0.len(), whole.0.capacity()), (5_000, 5_000));
}
