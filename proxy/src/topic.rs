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
use std::time::Duration;

use canarygate_audit::TopicScore;

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

/// Longest a score taken off the critical path may take before it is
/// recorded as not scored.
const RECORD_DEADLINE: Duration = Duration::from_secs(30);

/// The topic check of a running server.
pub struct TopicCheck {
    model: Arc<dyn TopicModel>,
    config: TopicConfig,
    metrics: Arc<Metrics>,
}

impl TopicCheck {
    /// The check with `model` under `config`, counted in `metrics`.
    pub fn new(model: Arc<dyn TopicModel>, config: TopicConfig, metrics: Arc<Metrics>) -> Self {
        Self {
            model,
            config,
            metrics,
        }
    }

    /// What a low score does.
    pub fn action(&self) -> TopicAction {
        self.config.action
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
        Part::Reasoning | Part::ReasoningAlias => "reasoning".into(),
        Part::Refusal => "refusal".into(),
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
