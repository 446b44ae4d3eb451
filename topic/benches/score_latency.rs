//! Latency of `TopicScorer::score` on the real model (all-MiniLM-L6-v2), on this machine.
//!
//! Prints, in one run: the time of one forward pass by input length (what dominates), then
//! p50/p99 per call and pairs per second at 1, 4, 16 and 64 concurrent callers, for
//! `max_batch = 16` against `max_batch = 1` (no batching: the baseline), with their ratios.
//!
//! `cargo bench -p canarygate-topic --bench score_latency` (model from
//! `CANARYGATE_TOPIC_MODEL` or `scripts/embedding-model.sh`'s default directory).

use std::time::{Duration, Instant};

use canarygate_topic::{Embedder, ScorerOptions, TopicScorer};

#[path = "../tests/model_dir/mod.rs"]
mod model_dir;

/// A question of about 40 tokens.
const QUESTION: &str = "Our nightly export job writes a CSV of every invoice to object storage, \
    but since last week some files are truncated. How can I tell whether the upload or the \
    query is at fault, and how do I make the job retry safely?";

/// An answer of about 200 tokens.
const ANSWER: &str = "Start by separating the two halves of the job. Run the query alone and \
    count its rows, then compare that count with the number of lines in the file you uploaded: \
    if they match, the upload is fine and the truncation happens later; if the file is shorter, \
    look at the writer. A common cause is a process that is killed by its memory limit while \
    it streams rows, which leaves a partial file behind without any error in the job's own log. \
    Check the container's exit status and the kernel log for out-of-memory kills around the \
    time of the export. To make retries safe, write to a temporary name first, verify the row \
    count and a checksum, and only then rename the object to its final key, so that readers \
    never see a partial file. Make the job idempotent by deriving the key from the export date \
    rather than the time it ran, and let the scheduler retry with a backoff of a few minutes. \
    Finally, alert on a row count that drops by more than a tenth from the previous day.";

fn main() {
    let dir = model_dir::model_dir();
    // Counting only: without the file's own fixed padding and truncation (128 tokens).
    let mut tokenizer =
        tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).expect("tokenizer.json loads");
    tokenizer.with_padding(None);
    tokenizer.with_truncation(None).expect("no truncation");
    let tokens = |text: &str| tokenizer.encode(text, true).map_or(0, |e| e.len());
    println!(
        "model {} | question {} tokens, answer {} tokens (with [CLS]/[SEP])",
        dir.display(),
        tokens(QUESTION),
        tokens(ANSWER)
    );

    let embedder = Embedder::load(&dir).expect("the model loads");
    println!("\none forward pass by input length (median of 9):");
    println!(
        "{:>8} {:>8} {:>10} {:>12}",
        "texts", "tokens", "ms", "ms/text"
    );
    let words: Vec<&str> = ANSWER.split_whitespace().collect();
    for (count, word_count) in [(1, 8), (1, 30), (1, 70), (1, 150), (2, 150), (16, 150)] {
        let text = words[..word_count.min(words.len())].join(" ");
        let texts = vec![text.as_str(); count];
        let mut times: Vec<Duration> = (0..9)
            .map(|_| {
                let start = Instant::now();
                embedder.embed(&texts).expect("embeds");
                start.elapsed()
            })
            .collect();
        times.sort();
        let ms = times[4].as_secs_f64() * 1e3;
        println!(
            "{count:>8} {:>8} {ms:>10.1} {:>12.1}",
            tokens(&text).min(embedder.max_seq_length()),
            ms / count as f64
        );
    }
    drop(embedder);

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let mut rows = Vec::new();
    for max_batch in [16, 1] {
        let embedder = Embedder::load(&dir).expect("the model loads");
        let scorer = TopicScorer::start(
            embedder,
            ScorerOptions {
                max_batch,
                ..ScorerOptions::default()
            },
        );
        // Warm up: first passes allocate.
        runtime.block_on(async {
            for _ in 0..3 {
                scorer
                    .score(QUESTION.into(), ANSWER.into())
                    .await
                    .expect("scores");
            }
        });
        for callers in [1usize, 4, 16, 64] {
            let per_caller = (32 / callers).max(2);
            let (latencies, wall) = runtime.block_on(run(&scorer, callers, per_caller));
            rows.push((max_batch, callers, summarise(latencies, wall)));
        }
    }

    println!("\nscore() latency (ms) and throughput, by concurrent callers:");
    println!(
        "{:>9} {:>8} {:>6} {:>9} {:>9} {:>9}",
        "max_batch", "callers", "calls", "p50", "p99", "pairs/s"
    );
    for (max_batch, callers, s) in &rows {
        println!(
            "{max_batch:>9} {callers:>8} {:>6} {:>9.1} {:>9.1} {:>9.1}",
            s.calls, s.p50, s.p99, s.per_second
        );
    }
    println!(
        "\nratios, max_batch 16 / max_batch 1 (p99 below 1 and throughput above 1 favour batching):"
    );
    println!("{:>8} {:>10} {:>12}", "callers", "p99", "throughput");
    for callers in [1usize, 4, 16, 64] {
        let find = |batch: usize| {
            rows.iter()
                .find(|(b, c, _)| *b == batch && *c == callers)
                .map(|(_, _, s)| s)
                .expect("measured")
        };
        let (batched, single) = (find(16), find(1));
        println!(
            "{callers:>8} {:>10.2} {:>12.2}",
            batched.p99 / single.p99,
            batched.per_second / single.per_second
        );
    }
}

struct Summary {
    calls: usize,
    p50: f64,
    p99: f64,
    per_second: f64,
}

/// `callers` tasks, each scoring `per_caller` pairs one after another.
async fn run(scorer: &TopicScorer, callers: usize, per_caller: usize) -> (Vec<Duration>, Duration) {
    let start = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|_| {
            let scorer = scorer.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(per_caller);
                for _ in 0..per_caller {
                    let begun = Instant::now();
                    scorer
                        .score(QUESTION.into(), ANSWER.into())
                        .await
                        .expect("scores");
                    latencies.push(begun.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.expect("caller task"));
    }
    (all, start.elapsed())
}

fn summarise(mut latencies: Vec<Duration>, wall: Duration) -> Summary {
    latencies.sort();
    let at = |q: f64| {
        let index = ((latencies.len() as f64 * q).ceil() as usize).clamp(1, latencies.len()) - 1;
        latencies[index].as_secs_f64() * 1e3
    };
    Summary {
        calls: latencies.len(),
        p50: at(0.50),
        p99: at(0.99),
        per_second: latencies.len() as f64 / wall.as_secs_f64(),
    }
}
