//! A whole answer read without its JSON tree, and delivered by splicing.
//!
//! Most whole answers are a few choices whose message holds text and
//! nothing canarygate rewrites but that text and, when the client's token
//! limit cut a choice, its finish reason. A format that recognises such an
//! answer ([`WireFormat::read_answer_light`](super::WireFormat::read_answer_light))
//! reads it in place: it finds each text field's JSON string literal in the
//! provider's bytes ([`LightField::of`]), whose text is read from there
//! (unescaped only when it holds an escape). The client then gets the
//! provider's own bytes with each edited literal replaced
//! ([`LightAnswer::deliver`]): no tree is built, no answer re-encoded.
//! Anything else is read from its tree, which gives what this reading gives.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use canarygate_policies::verify::Verifier;
use serde_json::value::RawValue;

use super::edit::{Delivery, apply};
use super::format::{AnswerView, LightAnswer, LightField, LightText, TextField, TextSource};
use super::json_str::range_in;

impl LightField {
    /// The field whose literal `raw` is (borrowed from `answer`); `None`
    /// when it is not a string, or not a slice of `answer`.
    pub fn of(answer: &str, raw: &RawValue) -> Option<Self> {
        let literal = raw.get();
        if !literal.starts_with('"') {
            return None;
        }
        let range = range_in(answer, literal)?;
        let text = if literal.contains('\\') {
            LightText::Unescaped(serde_json::from_str(literal).ok()?)
        } else {
            LightText::InData(range.start + 1..range.end - 1)
        };
        Some(Self {
            literal: range,
            text,
        })
    }

    /// The literal's bytes in the answer, quotes included.
    pub fn literal(&self) -> Range<usize> {
        self.literal.clone()
    }

    /// Its text, in `answer` (the bytes it was read from).
    pub fn text<'a>(&'a self, answer: &'a str) -> &'a str {
        match &self.text {
            LightText::InData(range) => answer.get(range.clone()).unwrap_or(""),
            LightText::Unescaped(text) => text,
        }
    }
}

impl LightAnswer {
    /// An answer read as `view`, with `fields` (each text field of the view,
    /// in its order, with its literal) and, per choice, its finish reason's
    /// literal; a cut choice finishes with `cut_reason`.
    pub fn new(
        view: AnswerView,
        fields: Vec<(TextField, LightField)>,
        finish_reasons: Vec<Option<Range<usize>>>,
        cut_reason: &'static str,
    ) -> Self {
        debug_assert!(
            view.choices
                .iter()
                .flat_map(|choice| &choice.texts)
                .eq(fields.iter().map(|(field, _)| field)),
            "one literal per text field of the view, in its order"
        );
        debug_assert_eq!(view.choices.len(), finish_reasons.len());
        Self {
            view,
            fields,
            finish_reasons,
            cut_reason,
        }
    }

    /// Its strings, read from `answer` (the bytes it was read from).
    pub fn texts<'a>(&'a self, answer: &'a str) -> LightAnswerTexts<'a> {
        LightAnswerTexts {
            light: self,
            answer,
            next: AtomicUsize::new(0),
        }
    }

    /// `answer` for the client: each text field becomes what `verifier`'s
    /// release and `delivery` leave of it (`spans[i]`, the span of its part
    /// that field `i` carried), a choice cut at the client's limit finishes
    /// with the cut reason, and every other byte is the provider's. The
    /// edits of the tree's reading, without the tree.
    pub fn deliver(
        &self,
        answer: &str,
        spans: &[Range<usize>],
        verifier: &Verifier,
        delivery: &mut Delivery,
    ) -> Vec<u8> {
        let mut splices: Vec<(Range<usize>, String)> = Vec::new();
        for ((field, light), span) in self.fields.iter().zip(spans) {
            let text = light.text(answer);
            let edit = delivery.admit(
                field.choice,
                field.kind,
                text,
                span.clone(),
                verifier.release_of(field.choice, field.kind),
            );
            if !edit.unchanged() {
                let literal = serde_json::Value::String(apply(text, &edit.kept)).to_string();
                splices.push((light.literal.clone(), literal));
            }
        }
        for (choice, literal) in self.view.choices.iter().zip(&self.finish_reasons) {
            if let Some(literal) = literal
                && delivery.was_cut(choice.index)
                && choice.finish_reason.as_deref() != Some(self.cut_reason)
            {
                splices.push((literal.clone(), format!("\"{}\"", self.cut_reason)));
            }
        }
        splices.sort_by_key(|(range, _)| range.start);
        let mut out = Vec::with_capacity(answer.len());
        let mut at = 0;
        for (range, literal) in splices {
            out.extend_from_slice(&answer.as_bytes()[at..range.start]);
            out.extend_from_slice(literal.as_bytes());
            at = range.end;
        }
        out.extend_from_slice(&answer.as_bytes()[at..]);
        out
    }
}

/// A [`LightAnswer`]'s strings with the bytes they are read from.
pub struct LightAnswerTexts<'a> {
    light: &'a LightAnswer,
    answer: &'a str,
    /// The field after the one asked for last: fields are asked for in the
    /// view's order, so each is found at once (a provider's answer may hold
    /// any number of choices).
    next: AtomicUsize,
}

impl TextSource for LightAnswerTexts<'_> {
    fn text_of(&self, field: &TextField) -> &str {
        let fields = &self.light.fields;
        let next = self.next.load(Ordering::Relaxed);
        let at = fields
            .get(next)
            .filter(|(known, _)| known.at == field.at)
            .map(|_| next)
            .or_else(|| fields.iter().position(|(known, _)| known.at == field.at));
        let Some(at) = at else { return "" };
        self.next.store(at + 1, Ordering::Relaxed);
        fields[at].1.text(self.answer)
    }
}
