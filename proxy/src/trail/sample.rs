//! A request's sample and its topic score taken later: the texts a sample
//! is made of (redacted only when it is kept), and the task that scores an
//! answer after its record is durable and appends the score.

use std::sync::Arc;

use canarygate_audit::{AuditLog, Recorded, Sample, should_sample};
use canarygate_policies::canary::replace_canaries;
use canarygate_policies::topic::sample_chance;
use serde_json::Value;

use crate::identity::CallerSecret;
use crate::topic::{HeldBytes, TopicCheck};

/// Placeholder for a canary in sampled text.
const REDACTED: &str = "[canary]";

/// What a sample keeps of an answer that spelled the caller's credential
/// across its events, or was cut through it.
const SPELLED_CREDENTIAL: &str = "[answer withheld by canarygate: it spelled the caller's \
     credential across its events, or was cut through it]";

/// The members whose strings are an answer's text in its events (Chat's
/// `content`, the Responses API's `delta`, Messages' `text`, `thinking` and
/// `partial_json`, arguments, reasoning, refusals, transcripts).
const TEXT_MEMBERS: [&str; 10] = [
    "content",
    "delta",
    "text",
    "thinking",
    "partial_json",
    "arguments",
    "reasoning_content",
    "reasoning",
    "refusal",
    "transcript",
];

/// Fewest bytes of the credential, cut at a sample's end, that withhold it.
const CUT_CREDENTIAL_BYTES: usize = 4;

/// Most response bytes kept for a spot-check sample.
const MAX_SAMPLE_BYTES: usize = 256 * 1024;

/// The first piece [`KeptBytes`] keep: room for a few events, so an open
/// stream that has sent little holds little.
const KEPT_START_BYTES: usize = 2 * 1024;

/// Each later piece. Pieces are filled, never grown or copied, and joined
/// only for a sample: a 17 KB stream is kept in three allocations (2 KiB
/// and two of 8 KiB), each byte copied once.
const KEPT_PIECE_BYTES: usize = 8 * 1024;

/// The first [`MAX_SAMPLE_BYTES`] of what the client was sent, kept until
/// the record decides whether a sample is drawn.
#[derive(Debug, Default)]
pub(crate) struct KeptBytes {
    pieces: Vec<Vec<u8>>,
    len: usize,
}

impl KeptBytes {
    /// Keeps what of `bytes` fits.
    pub fn push(&mut self, bytes: &[u8]) {
        let room = MAX_SAMPLE_BYTES.saturating_sub(self.len);
        let mut rest = &bytes[..bytes.len().min(room)];
        self.len += rest.len();
        if let Some(last) = self.pieces.last_mut() {
            let fits = rest.len().min(last.capacity() - last.len());
            last.extend_from_slice(&rest[..fits]);
            rest = &rest[fits..];
        }
        if !rest.is_empty() {
            let size = if self.pieces.is_empty() {
                KEPT_START_BYTES
            } else {
                KEPT_PIECE_BYTES
            };
            let mut piece = Vec::with_capacity(rest.len().max(size));
            piece.extend_from_slice(rest);
            self.pieces.push(piece);
        }
    }

    /// Bytes kept.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The bytes kept, in one piece.
    pub fn joined(&self) -> Vec<u8> {
        self.pieces.concat()
    }
}

/// The texts a sample is made of, before redaction.
pub(crate) struct SampleTexts {
    pub request: Vec<u8>,
    pub response: KeptBytes,
    /// What the provider sent, kept when the verdict failed.
    pub provider: Option<String>,
    /// The caller's credential, taken out of every text.
    pub secret: Option<CallerSecret>,
}

impl SampleTexts {
    /// Bytes held.
    pub fn len(&self) -> usize {
        self.request.len() + self.response.len() + self.provider.as_ref().map_or(0, String::len)
    }

    /// The sample, canaries redacted and the caller's credential withheld
    /// (a client that pasted its own key into a prompt): every copy of it,
    /// and an answer that spells it across its events (a model repeating
    /// the key writes it a few characters an event) or was cut through it
    /// at the sample's end goes whole.
    pub fn sample(&self) -> Sample {
        let redact = |text: &str| {
            let text = redact(text);
            self.secret
                .as_ref()
                .and_then(|secret| secret.withhold(&text))
                .unwrap_or(text)
        };
        let answer = |text: &str, cut: bool| {
            let text = redact(text);
            match &self.secret {
                Some(secret)
                    if secret.is_in(&events_text(&text))
                        || cut && secret.is_cut_at_end_of(&text, CUT_CREDENTIAL_BYTES) =>
                {
                    SPELLED_CREDENTIAL.to_owned()
                }
                _ => text,
            }
        };
        let response = self.response.joined();
        let cut = response.len() >= MAX_SAMPLE_BYTES;
        Sample {
            request_text: redact(&String::from_utf8_lossy(&self.request)),
            response_text: answer(&String::from_utf8_lossy(&response), cut),
            provider_text: self.provider.as_deref().map(|text| answer(text, false)),
        }
    }
}

/// The texts the events of `stream` (an answer's SSE bytes) carry, joined
/// in order: the strings of their [`TEXT_MEMBERS`]. Empty for an answer that
/// is not a stream.
fn events_text(stream: &str) -> String {
    fn gather(value: &Value, joined: &mut String) {
        match value {
            Value::Object(members) => {
                for (name, member) in members {
                    match member {
                        Value::String(text) if TEXT_MEMBERS.contains(&name.as_str()) => {
                            joined.push_str(text);
                        }
                        _ => gather(member, joined),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|item| gather(item, joined)),
            _ => {}
        }
    }
    let mut joined = String::new();
    for line in stream.lines() {
        let Some(data) = line.strip_prefix("data:") else {
            continue;
        };
        if let Ok(event) = serde_json::from_str::<Value>(data.trim_start()) {
            gather(&event, &mut joined);
        }
    }
    joined
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
    let capacities =
        |kept: &KeptBytes| -> Vec<usize> { kept.pieces.iter().map(Vec::capacity).collect() };
    // A 17 KB stream: three pieces, none of them grown.
    for _ in 0..58 {
        kept.push(&piece);
        sent.extend_from_slice(&piece);
    }
    assert_eq!((kept.len(), kept.joined()), (sent.len(), sent.clone()));
    assert_eq!(capacities(&kept), [2 * 1024, 8 * 1024, 8 * 1024]);
    // A long one is cut at the limit, and never holds much more than it.
    for _ in 0..1_000 {
        kept.push(&piece);
        sent.extend_from_slice(&piece);
    }
    assert_eq!(kept.len(), MAX_SAMPLE_BYTES);
    assert_eq!(kept.joined(), sent[..MAX_SAMPLE_BYTES]);
    assert!(capacities(&kept).iter().sum::<usize>() < MAX_SAMPLE_BYTES + KEPT_PIECE_BYTES);
    // A whole answer is kept in one allocation of its size.
    let mut whole = KeptBytes::default();
    whole.push(&[7; 5_000]);
    assert_eq!(capacities(&whole), [5_000]);
    // What does not fit the last piece starts the next one.
    let mut split = KeptBytes::default();
    split.push(&[1; 2_000]);
    split.push(&[2; 100]);
    assert_eq!(capacities(&split), [2 * 1024, 8 * 1024]);
    assert_eq!(split.joined(), [[1; 2_000].as_slice(), &[2; 100]].concat());
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "sk-sample-0123456789abcdef";

    /// A sample of `request` and the answer `response`, its bytes kept as a
    /// stream's are.
    fn texts(request: &str, response: &str) -> SampleTexts {
        let mut kept = KeptBytes::default();
        kept.push(response.as_bytes());
        SampleTexts {
            request: request.as_bytes().to_vec(),
            response: kept,
            provider: None,
            secret: Some(CallerSecret::of(KEY)),
        }
    }

    /// A Chat stream of `pieces`, one chunk each.
    fn stream(pieces: &[&str]) -> String {
        let mut out = String::new();
        for piece in pieces {
            let chunk = serde_json::json!({"choices": [{"index": 0, "delta": {"content": piece}}]});
            out.push_str(&format!("data: {chunk}\n\n"));
        }
        out + "data: [DONE]\n\n"
    }

    #[test]
    fn a_key_spelled_across_events_is_not_kept() {
        let request = format!("my key is {KEY}");
        let spelled = stream(&["You wrote: my key is sk-sam", "ple-01234", "56789abcdef"]);
        let sample = texts(&request, &spelled).sample();
        assert_eq!(
            sample.request_text,
            "my key is [credential withheld by canarygate]"
        );
        assert_eq!(sample.response_text, SPELLED_CREDENTIAL);
        // Whole in one event, it is withheld where it stands.
        let whole = stream(&[&format!("You wrote: {KEY}")]);
        let sample = texts(&request, &whole).sample();
        assert!(!sample.response_text.contains(KEY));
        assert!(
            sample
                .response_text
                .contains("[credential withheld by canarygate]")
        );
        // An answer without it is kept as it went.
        let plain = stream(&["Mercury, ", "Venus."]);
        assert_eq!(texts(&request, &plain).sample().response_text, plain);
    }

    #[test]
    fn an_answer_cut_through_the_key_is_not_kept() {
        let filler = "x".repeat(MAX_SAMPLE_BYTES - 9);
        let cut = format!("{filler}{}", &KEY[..9]);
        assert_eq!(cut.len(), MAX_SAMPLE_BYTES);
        assert_eq!(texts("", &cut).sample().response_text, SPELLED_CREDENTIAL);
        // Ending so is no cut when the sample holds the whole answer.
        let short = format!("ends with {}", &KEY[..9]);
        assert_eq!(texts("", &short).sample().response_text, short);
    }
}
