//! `canarygate topic calibrate`: the topic check's threshold, measured on labelled pairs.
//!
//! Reads question/answer pairs (JSON lines: `corpus`, `pair` = `honest` | `swapped`,
//! `question`, `answer`), scores each with the model, and prints per corpus (and over all of
//! them) the ROC curve's area, the threshold keeping false alarms on honest pairs within the
//! bound, and the share of swapped pairs caught there. Each answer is scored in three forms:
//! as plain text; wrapped in a JSON object as a JSON-mode or tool answer would be, embedding
//! its string values; and that JSON verbatim, for contrast.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use anyhow::Context as _;
use canarygate_policies::topic::answer_text;
use canarygate_topic::calibration::Calibration;
use canarygate_topic::{Embedder, cosine};
use clap::{Args, Subcommand};
use serde::{Deserialize, Serialize};

/// Subcommands of `canarygate topic`.
#[derive(Debug, Subcommand)]
pub enum TopicCommand {
    /// Calibrate `min_similarity` on honest and swapped question/answer pairs.
    Calibrate(CalibrateArgs),
}

/// Arguments of `canarygate topic calibrate`.
#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// A sentence-transformers model directory (scripts/embedding-model.sh fetches one).
    #[arg(long)]
    model_dir: PathBuf,
    /// JSON lines of pairs: {"corpus", "pair": "honest" | "swapped", "question", "answer"}.
    #[arg(long)]
    pairs: PathBuf,
    /// The most honest pairs that may fall below the threshold, as a fraction.
    #[arg(long, default_value_t = 0.01)]
    max_false_alarms: f64,
    /// Print the results (ROC curves included) as JSON.
    #[arg(long)]
    json: bool,
}

/// Runs a `topic` subcommand.
pub fn run(command: TopicCommand) -> anyhow::Result<()> {
    match command {
        TopicCommand::Calibrate(args) => calibrate(args),
    }
}

#[derive(Deserialize)]
struct Pair {
    corpus: String,
    pair: Label,
    question: String,
    answer: String,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Label {
    Honest,
    Swapped,
}

/// How an answer reaches the embedder.
#[derive(Clone, Copy, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Form {
    /// The answer's text as it is.
    Text,
    /// The answer wrapped in a JSON object; its string values joined, keys left out.
    Json,
    /// The same JSON object's serialised text, keys and punctuation included.
    JsonRaw,
}

const FORMS: [Form; 3] = [Form::Text, Form::Json, Form::JsonRaw];

impl Form {
    fn name(self) -> &'static str {
        match self {
            Form::Text => "text",
            Form::Json => "json",
            Form::JsonRaw => "json-raw",
        }
    }

    fn render(self, answer: &str) -> String {
        match self {
            // What the proxy embeds of an answer (canaries removed, JSON by its
            // string values), so the calibration measures the proxy's own texts.
            Form::Text => answer_text([answer]).unwrap_or_default(),
            Form::Json => {
                answer_text([as_json_answer(answer).to_string().as_str()]).unwrap_or_default()
            }
            Form::JsonRaw => as_json_answer(answer).to_string(),
        }
    }
}

/// An answer as a JSON-mode reply might carry it: a summary sentence, the rest as a list of
/// paragraphs, and fields that are not the answer's text (a number, a language tag).
fn as_json_answer(answer: &str) -> serde_json::Value {
    let mut paragraphs = answer.split("\n\n");
    let first = paragraphs.next().unwrap_or_default();
    let (summary, rest) = match first.find(". ") {
        Some(end) => (&first[..=end], first[end + 2..].trim()),
        None => (first, ""),
    };
    let details: Vec<&str> = std::iter::once(rest)
        .chain(paragraphs)
        .filter(|p| !p.is_empty())
        .collect();
    serde_json::json!({
        "summary": summary,
        "details": details,
        "confidence": 0.9,
        "language": "en",
    })
}

#[derive(Serialize)]
struct Row {
    corpus: String,
    form: Form,
    #[serde(flatten)]
    calibration: Calibration,
}

#[derive(Serialize)]
struct Report {
    model: String,
    max_false_alarms: f64,
    results: Vec<Row>,
}

fn calibrate(args: CalibrateArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.pairs)
        .with_context(|| format!("reading {}", args.pairs.display()))?;
    let mut pairs = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let pair: Pair = serde_json::from_str(line)
            .with_context(|| format!("{}:{}", args.pairs.display(), index + 1))?;
        pairs.push(pair);
    }
    anyhow::ensure!(!pairs.is_empty(), "{}: no pairs", args.pairs.display());
    let embedder = Embedder::load(&args.model_dir)?;

    // Every distinct text embedded once, sixteen to a batch.
    let mut texts: Vec<String> = pairs.iter().map(|p| p.question.clone()).collect();
    for form in FORMS {
        texts.extend(pairs.iter().map(|p| form.render(&p.answer)));
    }
    texts.sort();
    texts.dedup();
    let mut vectors: HashMap<&str, Vec<f32>> = HashMap::with_capacity(texts.len());
    for (done, chunk) in texts.chunks(16).enumerate() {
        let batch: Vec<&str> = chunk.iter().map(String::as_str).collect();
        let embedded = embedder.embed(&batch)?;
        vectors.extend(batch.into_iter().zip(embedded));
        eprint!(
            "\rembedded {} of {} texts",
            (done * 16 + chunk.len()),
            texts.len()
        );
    }
    eprintln!();

    // Scores per (corpus, form), then pooled over every corpus as "all".
    let mut scores: BTreeMap<(String, usize), (Vec<f32>, Vec<f32>)> = BTreeMap::new();
    for pair in &pairs {
        for (form_index, form) in FORMS.iter().enumerate() {
            let answer = form.render(&pair.answer);
            let score = cosine(&vectors[pair.question.as_str()], &vectors[answer.as_str()]);
            for corpus in [pair.corpus.clone(), "all".to_string()] {
                let entry = scores.entry((corpus, form_index)).or_default();
                match pair.pair {
                    Label::Honest => entry.0.push(score),
                    Label::Swapped => entry.1.push(score),
                }
            }
        }
    }
    let mut results = Vec::new();
    let corpora: Vec<String> = {
        let mut names: Vec<String> = scores.keys().map(|(c, _)| c.clone()).collect();
        names.dedup();
        names.retain(|name| name != "all");
        names.push("all".to_string());
        names
    };
    for corpus in &corpora {
        for (form_index, form) in FORMS.iter().enumerate() {
            let (honest, swapped) = &scores[&(corpus.clone(), form_index)];
            let calibration = Calibration::from_scores(honest, swapped, args.max_false_alarms)
                .with_context(|| format!("{corpus} ({})", form.name()))?;
            results.push(Row {
                corpus: corpus.clone(),
                form: *form,
                calibration,
            });
        }
    }
    let report = Report {
        model: embedder.name().to_string(),
        max_false_alarms: args.max_false_alarms,
        results,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

fn print_table(report: &Report) {
    println!(
        "topic calibration: model {}, threshold for at most {:.2} % false alarms on honest pairs",
        report.model,
        report.max_false_alarms * 100.0
    );
    println!(
        "{:<12} {:<9} {:>6} {:>7} {:>7} {:>9} {:>12} {:>10}",
        "corpus", "form", "honest", "swapped", "AUC", "threshold", "false alarms", "catch rate"
    );
    for row in &report.results {
        let c = &row.calibration;
        println!(
            "{:<12} {:<9} {:>6} {:>7} {:>7.4} {:>9.4} {:>11.2}% {:>9.1}%",
            row.corpus,
            row.form.name(),
            c.honest,
            c.swapped,
            c.auc,
            c.threshold,
            c.false_alarm_rate * 100.0,
            c.catch_rate * 100.0
        );
    }
    println!(
        "forms: text = the answer as is; json = the answer in a JSON object, its string values \
         embedded; json-raw = that object's JSON text (contrast only)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_form_keeps_the_answer_text_and_drops_keys_and_numbers() {
        let answer = "Use reversed(). It returns an iterator.\n\nOr slice with [::-1].";
        let json = as_json_answer(answer);
        assert_eq!(json["summary"], "Use reversed().");
        assert_eq!(
            Form::Json.render(answer),
            "Use reversed().\nIt returns an iterator.\nOr slice with [::-1].\nen"
        );
        let raw = Form::JsonRaw.render(answer);
        assert!(raw.contains("\"confidence\":0.9"), "{raw}");
        // Nested objects and arrays, in document order.
        let nested = serde_json::json!({"a": ["x", {"b": "y", "n": 1, "t": true}], "c": "z"});
        assert_eq!(
            answer_text([nested.to_string().as_str()]).unwrap(),
            "x\ny\nz"
        );
    }
}
