//! What the whole-answer and the stream halves of the verified path share:
//! one attempt's state, its decision, and the block response.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use axum::response::Response;
use canarygate_audit::TopicScore;
use canarygate_policies::canary::Canary;
use canarygate_policies::inject::{Injection, MAX_CHOICES};
use canarygate_policies::registry::Registration;
use canarygate_policies::topic::{self, TopicAction};
use canarygate_policies::verify::{Check, Decision, Part, Status, Verdict, Verifier};
use canarygate_policies::verify_config::FailureAction;

use crate::body::Served;
use crate::context::RequestContext;
use crate::error::ApiError;
use crate::registry::CanaryBook;
use crate::topic::{AnswerTexts, TopicCheck, check_result};
use crate::trail::Trail;
use crate::wire::edit::Delivery;
use crate::wire::{ChoiceView, Spans, TextSource, WireFormat};

/// What became of one upstream attempt.
pub enum Decided {
    /// Answer the client with this.
    Served(Served),
    /// Discard the answer and try upstream again.
    Retry,
    /// Discard the answer and serve from the local engine.
    Fallback,
}

/// One upstream attempt's verification state.
pub struct Attempt {
    /// What the canaries' placement asks of the answer.
    pub injection: Injection,
    /// The verifier of this attempt's answer.
    pub verifier: Verifier,
    /// When the request was sent.
    pub sent_at: Instant,
    /// Attempts before this one.
    pub attempt: u32,
    /// How the verified answer reaches the client.
    pub delivery: Delivery,
    /// Registrations of the answer's canary-shaped spans fetched from the
    /// shared registry so far (`None`: live nowhere).
    pub fetched: HashMap<Canary, Option<Registration>>,
    /// A lookup in the shared registry failed during this attempt (counted
    /// once).
    pub lookups_degraded: bool,
    /// The answer's texts as the provider sent them: for the topic check,
    /// and a failed verdict's evidence.
    pub answer: AnswerTexts,
    /// The topic check, when the answer waits for its score (`[topic]
    /// action = "flag"` or `"block"`), and what the client asked.
    pub topic: Option<(Arc<TopicCheck>, Option<String>)>,
}

impl Attempt {
    /// The fewest of the provider's output tokens its answer's echoes took,
    /// when `verdict` says every choice wrote one (none otherwise): what its
    /// count holds beside the text the client gets
    /// ([`Delivery::fits_the_limit`](crate::wire::edit::Delivery::fits_the_limit)).
    pub fn echo_tokens_counted(&self, verdict: &Verdict) -> u64 {
        let echoed = verdict
            .result(Check::Echo)
            .is_some_and(|echo| echo.status == Status::Pass);
        if echoed {
            self.injection.echo_tokens_least * u64::from(self.injection.choices)
        } else {
            0
        }
    }

    /// Feeds every text field of `choices` (read from `value`, a whole
    /// answer or one stream event) to the verifier, in order, and records
    /// the choices' finish reasons in `reasons`. `before_text` runs before
    /// each non-empty text of the answer's own parts (not
    /// [`Part::Other`]) is pushed and says whether to stop there (the
    /// stream's time to first token, measured by the caller when the event
    /// arrived: the registry's round trip is canarygate's time). Returns the span of its part each field
    /// carried, in the order of the fields, and whether the verifier said to
    /// stop; after a stop, texts are no longer pushed. The canary-shaped
    /// spans the texts could decide are resolved first, in one round trip
    /// to the shared registry when this instance does not know them.
    pub async fn feed(
        &mut self,
        book: &CanaryBook,
        choices: &[ChoiceView],
        value: &(impl TextSource + Sync),
        reasons: &mut Vec<Option<String>>,
        mut before_text: impl FnMut(&mut Verifier) -> bool,
    ) -> (Spans, bool) {
        self.resolve(book, choices, value).await;
        let registry = book.lookup(&self.fetched);
        let verifier = &mut self.verifier;
        let mut spans = Spans::new();
        let mut stop = false;
        for choice in choices {
            for field in &choice.texts {
                let text = value.text_of(field);
                self.answer.push(field.choice, field.kind, text);
                let start = verifier.received(field.choice, field.kind);
                spans.push(start..start + text.len());
                if stop || text.is_empty() {
                    continue;
                }
                // Any other string (a prompt field the provider repeats, as
                // the Responses API's `instructions` in `response.created`,
                // sent before the prefill) is not the first generated text.
                if !matches!(field.kind, Part::Other(_)) && before_text(verifier) {
                    stop = true;
                    continue;
                }
                stop = verifier.push_part_positions(field.choice, field.kind, text, &registry);
            }
            set_reason(reasons, choice.index, choice.finish_reason.as_deref());
        }
        (spans, stop)
    }

    /// With `[topic] action = "flag"` or `"block"`: scores the answer and
    /// adds the `topic` check to `verdict`. Returns the score.
    /// An answer that already failed another check is not held up for it:
    /// it is withheld or flagged anyway.
    pub async fn judge_topic(&mut self, verdict: &mut Verdict) -> Option<TopicScore> {
        if !verdict.passed() {
            return None;
        }
        let (check, question) = self.topic.as_ref()?;
        let score = check
            .score(question.clone(), self.answer.topic_text())
            .await;
        verdict.checks.push(check_result(&score));
        Some(score)
    }

    /// What to do with `verdict` under the policy (a low topic score alone
    /// is only flagged under `[topic] action = "flag"`).
    pub fn decide(&self, verdict: &Verdict, action: FailureAction, released_any: bool) -> Decision {
        let topic = self
            .topic
            .as_ref()
            .map_or(TopicAction::Record, |(check, _)| check.action());
        topic::decide(verdict, topic, action, self.attempt, released_any)
    }

    /// Hands to `trail` what it keeps of the answer so far: its text when
    /// the trail scores it later, and everything the provider sent when
    /// `verdict` failed (`stopped`: canarygate stopped reading it there).
    pub fn record_answer(&self, trail: &mut Trail, verdict: Option<&Verdict>, stopped: bool) {
        let failed = verdict.is_some_and(|verdict| !verdict.passed());
        let evidence = failed
            .then(|| self.answer.evidence())
            .flatten()
            .map(|mut text| {
                if stopped {
                    text.push_str("\n[canarygate stopped reading here: a check had failed]");
                }
                text
            });
        let answer = trail
            .scores_later()
            .then(|| self.answer.topic_text())
            .flatten();
        trail.provider_answer(answer, evidence);
    }

    /// Fetches who minted the canary-shaped spans that the text fields of
    /// `choices` could decide (texts of one part are joined first: a canary
    /// may span two fields of one event); an unreachable shared registry
    /// degrades the verdict, or fails it when the policy fails closed.
    async fn resolve(
        &mut self,
        book: &CanaryBook,
        choices: &[ChoiceView],
        value: &(impl TextSource + Sync),
    ) {
        if !book.is_shared() {
            // This process's memory answers every lookup itself.
            return;
        }
        let mut texts: Vec<(u32, Part, Cow<'_, str>)> = Vec::new();
        for field in choices.iter().flat_map(|choice| &choice.texts) {
            let text = value.text_of(field);
            if text.is_empty() {
                continue;
            }
            match texts
                .iter_mut()
                .find(|(choice, part, _)| *choice == field.choice && *part == field.kind)
            {
                Some((_, _, joined)) => joined.to_mut().push_str(text),
                None => texts.push((field.choice, field.kind, Cow::Borrowed(text))),
            }
        }
        let spans: Vec<Canary> = texts
            .iter()
            .flat_map(|(choice, part, text)| self.verifier.spans_to_look_up(*choice, *part, text))
            .collect();
        if spans.is_empty() {
            return;
        }
        if let Some(unresolved) = book.resolve(&spans, &mut self.fetched).await {
            if !std::mem::replace(&mut self.lookups_degraded, true) {
                book.count_unavailable(if unresolved.fail {
                    "failed"
                } else {
                    "degraded"
                });
            }
            self.verifier
                .registry_degraded(unresolved.spans, unresolved.fail);
        }
    }
}

pub fn elapsed_ms(since: Instant) -> u64 {
    since.elapsed().as_millis().try_into().unwrap_or(u64::MAX)
}

/// HTTP 502 naming the failed checks of `verdict`.
pub fn blocked<W: WireFormat>(context: &RequestContext<'_, W>, verdict: &Verdict) -> Response {
    tracing::warn!(
        request_id = %context.request_id,
        provider = %context.upstream.name,
        verdict = %verdict.header_value(),
        "answer blocked"
    );
    context.error_response(
        &ApiError::verification_failed(verdict),
        Some(&verdict.header_value()),
    )
}

/// Records `reason` as the finish reason of choice `index`, and that the
/// answer has at least `index + 1` choices.
fn set_reason(reasons: &mut Vec<Option<String>>, index: u32, reason: Option<&str>) {
    if u64::from(index) >= MAX_CHOICES {
        // No request asks for that many choices (its text fails the
        // verifier); never size a list by an index the provider sent.
        return;
    }
    let index = index as usize;
    if reasons.len() <= index {
        reasons.resize(index + 1, None);
    }
    if let Some(reason) = reason {
        reasons[index] = Some(reason.to_owned());
    }
}
