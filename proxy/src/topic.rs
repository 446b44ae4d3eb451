//! The topic check as the serving path runs it: a sentence-embedding model
//! behind [`TopicModel`], the policy's `[topic]`, and the two ways a score
//! is taken.
//!
//! With `action = "record"` (the default) the score is taken after the
//! request's record is written and the client has its answer
//! ([`crate::trail::Trail::commit`] hands the texts to a task of their own)
//! and appended as a topic record. With `flag` or `block` the verified path
//! waits for it, within `timeout_ms`, before it decides, and the score is a
//! `topic` check of the verdict.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use canarygate_audit::TopicScore;
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
}

impl TopicCheck {
    /// The check with `model` under `config`.
    pub fn new(model: Arc<dyn TopicModel>, config: TopicConfig) -> Self {
        Self { model, config }
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
        TopicScore {
            similarity,
            skipped,
            min_similarity: self.min_similarity(),
            model: self.model.name().to_owned(),
        }
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

/// The texts of an answer's first choice that the topic check reads: its
/// content and its tool-call and function-call arguments, as the provider
/// sent them, each bounded.
#[derive(Debug, Default)]
pub struct AnswerTexts {
    /// Content, then refusal, then each argument string, by part.
    parts: Vec<(Part, String)>,
}

impl AnswerTexts {
    /// Adds `text` of `part` of choice `choice` (only choice 0 is kept).
    pub fn push(&mut self, choice: u32, part: Part, text: &str) {
        if choice != 0
            || !matches!(
                part,
                Part::Content | Part::Refusal | Part::ToolArguments(_) | Part::FunctionArguments
            )
        {
            return;
        }
        let index = match self.parts.iter().position(|(kind, _)| *kind == part) {
            Some(index) => index,
            None => {
                self.parts.push((part, String::new()));
                self.parts.len() - 1
            }
        };
        let kept = &mut self.parts[index].1;
        // Whole JSON documents are parsed; past the bound a text is cut and
        // read as plain text, which is what the model would read of it.
        let room = (MAX_TEXT_CHARS * 4).saturating_sub(kept.len());
        let mut cut = text.len().min(room);
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        kept.push_str(&text[..cut]);
    }

    /// The text to embed ([`answer_text`]), `None` when there is none.
    pub fn text(&self) -> Option<String> {
        let mut parts: Vec<&(Part, String)> = self.parts.iter().collect();
        parts.sort_by_key(|(part, _)| *part);
        answer_text(parts.into_iter().map(|(_, text)| text.as_str()))
    }
}
