//! The topic check as the serving path runs it: a sentence-embedding model
//! behind [`TopicModel`], the policy's `[topic]`, and the two ways a score
//! is taken.
//!
//! With `action = "record"` (the default) the score is taken after the
//! request's record is written and the client has its answer
//! (the trail hands the texts to a task of their own)
//! and appended as a topic record. With `flag` or `block` the verified path
//! waits for it, within `timeout_ms`, before it decides, and the score is a
//! `topic` check of the verdict.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use canarygate_audit::TopicScore;
use canarygate_topic::{Embedder, ScorerOptions, TopicError, TopicScorer};

use crate::metrics::Metrics;
use canarygate_policies::topic::{MAX_TEXT_CHARS, TopicAction, TopicConfig, answer_text};
use canarygate_policies::verify::Part;
use canarygate_policies::verify::{Check, CheckResult, Evidence, Status, TopicEvidence};

/// A future a [`TopicModel`] returns.
pub type ScoreFuture = Pin<Box<dyn Future<Output = Result<f32, String>> + Send>>;

/// A model that scores how well an answer fits a question (cosine
/// similarity of their embeddings); `canarygate-topic`'s scorer in `serve`.
pub trait TopicModel: Send + Sync + 'static {
    /// The similarity of `question` and `answer`, or why there is none
    /// (the model is busy, it failed).
    fn score(&self, question: String, answer: String) -> ScoreFuture;
    /// The model's name, recorded with each score.
    fn name(&self) -> &str;
}

/// The batching scorer of `canarygate-topic`, as the serving path's model.
impl TopicModel for canarygate_topic::TopicScorer {
    fn score(&self, question: String, answer: String) -> ScoreFuture {
        let scorer = self.clone();
        Box::pin(async move {
            scorer
                .score(question, answer)
                .await
                .map_err(|error| match error {
                    TopicError::Busy => "busy".to_owned(),
                    other => other.to_string(),
                })
        })
    }

    fn name(&self) -> &str {
        self.model()
    }
}

/// Loads the model `[topic] model_dir` names and starts its scorer (a
/// worker thread); `None` when the check is off.
pub fn load(
    config: &TopicConfig,
    metrics: &Arc<Metrics>,
) -> Result<Option<TopicCheck>, TopicError> {
    let Some(dir) = &config.model_dir else {
        return Ok(None);
    };
    let embedder = Embedder::load(dir.get_ref())?;
    let scorer = TopicScorer::start(embedder, ScorerOptions::default());
    Ok(Some(TopicCheck::new(
        Arc::new(scorer),
        config.clone(),
        Arc::clone(metrics),
    )))
}

/// Longest a score taken off the critical path may take before it is
/// recorded as not scored.
const RECORD_DEADLINE: Duration = Duration::from_secs(30);

/// Most bytes of request and answer text that answers waiting for their
/// score (`record`) may hold for a sample the score could keep; past it a
/// score is still taken, but its sample cannot be.
const MAX_HELD_BYTES: usize = 64 * 1024 * 1024;

/// The topic check of a running server.
pub struct TopicCheck {
    model: Arc<dyn TopicModel>,
    config: TopicConfig,
    metrics: Arc<Metrics>,
    /// Bytes held by answers waiting for their score.
    held: Arc<AtomicUsize>,
}

/// Bytes counted against `MAX_HELD_BYTES` until dropped.
pub struct HeldBytes {
    held: Arc<AtomicUsize>,
    bytes: usize,
}

impl Drop for HeldBytes {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl TopicCheck {
    /// The check with `model` under `config`, counted in `metrics`.
    pub fn new(model: Arc<dyn TopicModel>, config: TopicConfig, metrics: Arc<Metrics>) -> Self {
        Self {
            model,
            config,
            metrics,
            held: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Counts `bytes` held while an answer waits for its score; `None`
    /// when that would pass `MAX_HELD_BYTES` (then hold nothing).
    pub fn hold(&self, bytes: usize) -> Option<HeldBytes> {
        let before = self.held.fetch_add(bytes, Ordering::Relaxed);
        let held = HeldBytes {
            held: Arc::clone(&self.held),
            bytes,
        };
        (before.saturating_add(bytes) <= MAX_HELD_BYTES).then_some(held)
    }

    /// What a low score does.
    pub fn action(&self) -> TopicAction {
        self.config.action
    }

    /// The model's name.
    pub fn model_name(&self) -> &str {
        self.model.name()
    }

    /// The policy's threshold.
    pub fn min_similarity(&self) -> f32 {
        self.config.min_similarity()
    }

    /// Scores `answer` against `question`: within the policy's
    /// `timeout_ms` when the answer waits for it (`flag`, `block`), within
    /// a generous deadline otherwise. Never fails: a score that could not
    /// be taken says why.
    pub async fn score(&self, question: Option<String>, answer: Option<String>) -> TopicScore {
        let deadline = match self.config.action {
            TopicAction::Record => RECORD_DEADLINE,
            TopicAction::Flag | TopicAction::Block => {
                Duration::from_millis(*self.config.timeout_ms.get_ref())
            }
        };
        let started = std::time::Instant::now();
        let outcome = match (question, answer) {
            (None, _) => Err("no_question".to_owned()),
            (_, None) => Err("no_answer".to_owned()),
            (Some(question), Some(answer)) => {
                match tokio::time::timeout(deadline, self.model.score(question, answer)).await {
                    Ok(scored) => scored,
                    Err(_) => Err("timeout".to_owned()),
                }
            }
        };
        let (similarity, skipped) = match outcome {
            // Four decimals: the model's own precision is not better.
            Ok(similarity) if similarity.is_finite() => {
                (Some((similarity * 10_000.0).round() / 10_000.0), None)
            }
            Ok(_) => (None, Some("not_a_number".to_owned())),
            Err(why) => (None, Some(why)),
        };
        let score = TopicScore {
            similarity,
            skipped,
            min_similarity: self.min_similarity(),
            model: self.model.name().to_owned(),
        };
        let result = match (&score.similarity, &score.skipped) {
            (Some(_), _) if score.low() => "low",
            (Some(_), _) => "fits",
            // A fixed set of labels: an error's text stays in the record.
            (None, Some(why)) => match why.as_str() {
                known @ ("timeout" | "busy" | "no_question" | "no_answer" | "not_a_number") => {
                    known
                }
                _ => "error",
            },
            (None, None) => "error",
        };
        self.metrics
            .count_topic(result, started.elapsed().as_secs_f64());
        score
    }
}

/// `score` as a check of the verdict: failed when low, skipped when it
/// could not be taken.
pub fn check_result(score: &TopicScore) -> CheckResult {
    let (status, reason) = match (score.similarity, &score.skipped) {
        (Some(similarity), _) if score.low() => (
            Status::Fail,
            Some(format!(
                "the answer's similarity to the question, {similarity:.4}, is below {:.2}",
                score.min_similarity
            )),
        ),
        (Some(_), _) => (Status::Pass, None),
        (None, why) => (
            Status::Skip,
            Some(format!(
                "not scored: {}",
                why.as_deref().unwrap_or("unknown")
            )),
        ),
    };
    CheckResult {
        check: Check::Topic,
        status,
        reason,
        evidence: Evidence::Topic(TopicEvidence {
            similarity: score.similarity,
            min_similarity: score.min_similarity,
            model: score.model.clone(),
        }),
    }
}

/// Most bytes of an answer's texts kept ([`AnswerTexts`]).
const MAX_KEPT_BYTES: usize = 256 * 1024;

/// The texts of an answer as the provider sent them, by choice and part,
/// bounded: what the topic check reads ([`AnswerTexts::topic_text`]) and
/// what a failed verdict keeps as evidence ([`AnswerTexts::evidence`]).
#[derive(Debug, Default)]
pub struct AnswerTexts {
    parts: Vec<((u32, Part), String)>,
    kept: usize,
    /// Texts stopped being kept at the bound.
    cut: bool,
}

impl AnswerTexts {
    /// Adds `text` of `part` of choice `choice`.
    pub fn push(&mut self, choice: u32, part: Part, text: &str) {
        if text.is_empty() {
            return;
        }
        let room = MAX_KEPT_BYTES.saturating_sub(self.kept);
        let mut take = text.len().min(room);
        while !text.is_char_boundary(take) {
            take -= 1;
        }
        self.cut |= take < text.len();
        if take == 0 {
            return;
        }
        self.kept += take;
        let key = (choice, part);
        match self.parts.iter_mut().find(|(at, _)| *at == key) {
            Some((_, kept)) => kept.push_str(&text[..take]),
            None => self.parts.push((key, text[..take].to_owned())),
        }
    }

    /// What the topic check compares with the question: the first
    /// choice's content, refusal and call arguments ([`answer_text`]).
    pub fn topic_text(&self) -> Option<String> {
        let mut texts: Vec<&((u32, Part), String)> = self
            .parts
            .iter()
            .filter(|((choice, part), _)| {
                *choice == 0
                    && matches!(
                        part,
                        Part::Content
                            | Part::Refusal
                            | Part::Transcript
                            | Part::ToolArguments(_)
                            | Part::FunctionArguments
                    )
            })
            .collect();
        texts.sort_by_key(|(at, _)| *at);
        answer_text(
            texts
                .into_iter()
                .map(|(_, text)| &text[..floor_boundary(text, MAX_TEXT_CHARS * 4)]),
        )
    }

    /// Every text, labelled by choice and part, in order; `None` when the
    /// answer had none. The caller redacts canaries.
    pub fn evidence(&self) -> Option<String> {
        if self.parts.is_empty() {
            return None;
        }
        let mut parts: Vec<&((u32, Part), String)> = self.parts.iter().collect();
        parts.sort_by_key(|(at, _)| *at);
        let mut out = String::new();
        for ((choice, part), text) in parts {
            if !out.is_empty() {
                out.push_str("\n\n");
            }
            out.push_str(&format!("[choice {choice}, {}]\n{text}", part_label(*part)));
        }
        if self.cut {
            out.push_str("\n[cut at 256 KiB]");
        }
        Some(out)
    }
}

/// How a part is labelled in a sample.
fn part_label(part: Part) -> String {
    match part {
        Part::Content => "content".into(),
        Part::Reasoning | Part::ReasoningAlias | Part::ReasoningDetail(_) => "reasoning".into(),
        Part::Refusal => "refusal".into(),
        Part::Transcript => "spoken transcript".into(),
        Part::ToolArguments(n) => format!("tool call {n} arguments"),
        Part::FunctionArguments => "function call arguments".into(),
        Part::Other(n) => format!("other text {n}"),
    }
}

/// The largest char boundary of `text` at or below `at`.
fn floor_boundary(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model that always answers the same similarity.
    struct Fixed(f32);

    impl TopicModel for Fixed {
        fn score(&self, _question: String, _answer: String) -> ScoreFuture {
            let similarity = self.0;
            Box::pin(async move { Ok(similarity) })
        }

        fn name(&self) -> &str {
            "fixed"
        }
    }

    fn check(similarity: f32) -> TopicCheck {
        TopicCheck::new(
            Arc::new(Fixed(similarity)),
            TopicConfig::default(),
            Arc::new(Metrics::new()),
        )
    }

    #[test]
    fn waiting_texts_are_bounded_in_bytes() {
        let check = check(0.5);
        let first = check.hold(MAX_HELD_BYTES).expect("fits");
        assert!(check.hold(1).is_none(), "past the bound");
        drop(first);
        assert!(check.hold(1).is_some(), "released when dropped");
    }

    #[tokio::test]
    async fn scores_are_rounded_and_a_missing_text_is_named() {
        let check = check(0.123_456);
        let score = check.score(Some("q".into()), Some("a".into())).await;
        assert_eq!(score.similarity, Some(0.1235));
        assert!(score.low(), "below the default threshold");
        assert_eq!(check_result(&score).status, Status::Fail);
        let score = check.score(Some("q".into()), None).await;
        assert_eq!(score.skipped.as_deref(), Some("no_answer"));
        assert_eq!(check_result(&score).status, Status::Skip);
        let score = self::check(0.9)
            .score(Some("q".into()), Some("a".into()))
            .await;
        assert_eq!(check_result(&score).status, Status::Pass);
    }

    #[test]
    fn answer_texts_keep_parts_apart_and_read_json_by_values() {
        let mut texts = AnswerTexts::default();
        texts.push(0, Part::Reasoning, "thinking about owls");
        texts.push(0, Part::Content, "{\"answer\": ");
        texts.push(0, Part::Content, "\"Owls eat mice\"}");
        texts.push(1, Part::Content, "another choice");
        assert_eq!(texts.topic_text().as_deref(), Some("Owls eat mice"));
        let evidence = texts.evidence().unwrap();
        assert!(
            evidence.contains("[choice 0, reasoning]\nthinking about owls"),
            "{evidence}"
        );
        assert!(
            evidence.contains("[choice 1, content]\nanother choice"),
            "{evidence}"
        );
    }
}
