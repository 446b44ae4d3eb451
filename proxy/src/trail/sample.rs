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
