//! The real model, all-MiniLM-L6-v2 (fetched by `scripts/embedding-model.sh`), loaded once:
//! its embeddings against an independent numpy implementation, truncation, and the scorer.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use canarygate_topic::{Embedder, ScorerOptions, TopicError, TopicScorer, cosine};

mod model_dir;

fn embedder() -> &'static Embedder {
    static EMBEDDER: OnceLock<Embedder> = OnceLock::new();
    EMBEDDER.get_or_init(|| Embedder::load(&model_dir::model_dir()).expect("the model loads"))
}

/// The Python with numpy, safetensors and tokenizers, installed by `scripts/test.sh`.
fn python() -> PathBuf {
    if let Ok(path) = std::env::var("CANARYGATE_PYTHON") {
        return PathBuf::from(path);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        venv.exists(),
        "{} is missing: run scripts/test.sh (it creates the venv) or set CANARYGATE_PYTHON",
        venv.display()
    );
    venv
}

/// A text well past 256 tokens, mixing scripts so that truncation lands among multi-byte chars.
fn long_text() -> String {
    let paragraph = "Der Übersetzer prüft jede Zeile zweimal, bevor er sie abschickt — 翻訳者は各行を \
                     二回確認します. The translator checks every line twice before sending it. ";
    paragraph.repeat(12)
}

#[test]
fn embeddings_match_an_independent_numpy_implementation() {
    let long = long_text();
    let texts: Vec<&str> = vec![
        "How do I reverse a list in Python?",
        "Use the reversed() built-in, or slice it with a step of -1.",
        "Zürich, Kraków and Åre: café crème à volonté! ¿Qué tal? Ελληνικά, русский, 中文, 🚀🔥",
        "dpkg",
        "  Whitespace\taround\n\nand inside   the text.  ",
        &long,
    ];
    let ours = embedder().embed(&texts).expect("embeds");

    let mut child = Command::new(python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/reference_minilm.py"
        ))
        .arg(model_dir::model_dir())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python starts");
    serde_json::to_writer(child.stdin.take().unwrap(), &texts).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "the numpy reference failed");
    let reference: Vec<serde_json::Value> = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(reference.len(), texts.len());
    // The long text really is past the limit, so truncation is what is compared.
    assert_eq!(reference[5]["tokens"], 256);

    let theirs: Vec<Vec<f32>> = reference
        .iter()
        .map(|r| serde_json::from_value(r["embedding"].clone()).unwrap())
        .collect();
    for (index, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(a.len(), 384);
        assert_eq!(b.len(), 384);
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "text {index}: max |difference| {worst}");
    }
    for i in 0..texts.len() {
        for j in i + 1..texts.len() {
            let (ours, theirs) = (cosine(&ours[i], &ours[j]), cosine(&theirs[i], &theirs[j]));
            assert!(
                (ours - theirs).abs() < 1e-4,
                "cosine({i}, {j}): {ours} vs {theirs}"
            );
        }
    }
}

#[test]
fn related_text_scores_higher_than_unrelated() {
    let vectors = embedder()
        .embed(&[
            "How do I reverse a list in Python?",
            "Call list.reverse() to reverse it in place, or use reversed(items).",
            "The Debian installer partitions the disk and sets up the boot loader.",
        ])
        .unwrap();
    let related = cosine(&vectors[0], &vectors[1]);
    let unrelated = cosine(&vectors[0], &vectors[2]);
    assert!(
        related > unrelated + 0.2,
        "related {related}, unrelated {unrelated}"
    );
}

#[test]
fn text_past_the_limit_is_cut_by_tokens() {
    let long = long_text();
    // What follows the first 256 tokens does not count; multi-byte chars at the cut are fine.
    let a = format!("{long} and then it ends about cooking pasta");
    let b = format!("{long} 🚀 völlig anders: the rest is about kernel modules");
    let vectors = embedder().embed(&[&a, &b, &long]).unwrap();
    assert!(cosine(&vectors[0], &vectors[1]) > 0.99999);
    assert!(cosine(&vectors[0], &vectors[2]) > 0.99999);
}

#[test]
fn the_scorer_batches_without_changing_scores() {
    let pairs: Vec<(String, String)> = [
        (
            "How do I reverse a list in Python?",
            "Use reversed() or slicing with [::-1].",
        ),
        (
            "What is a Debian package?",
            "A .deb archive holding files and control data.",
        ),
        (
            "How do I reverse a list in Python?",
            "The Debian installer sets up the disk.",
        ),
        ("Zürich café?", "Ein Café in Zürich, ja: 🚀 near the lake."),
    ]
    .iter()
    .map(|(q, a)| (q.to_string(), a.to_string()))
    .cycle()
    .take(24)
    .collect();
    let expected: Vec<f32> = pairs
        .iter()
        .map(|(q, a)| {
            let v = embedder().embed(&[q, a]).unwrap();
            cosine(&v[0], &v[1])
        })
        .collect();
    let scorer = TopicScorer::start(
        Embedder::load(&model_dir::model_dir()).unwrap(),
        ScorerOptions::default(),
    );
    assert_eq!(scorer.model(), "all-MiniLM-L6-v2");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let scores = runtime.block_on(async {
        // All at once: the worker sees a queue and batches it.
        let tasks: Vec<_> = pairs
            .iter()
            .cloned()
            .map(|(q, a)| {
                let scorer = scorer.clone();
                tokio::spawn(async move { scorer.score(q, a).await })
            })
            .collect();
        let mut scores = Vec::new();
        for task in tasks {
            scores.push(task.await.unwrap().expect("scores"));
        }
        scores
    });
    for (index, (got, want)) in scores.iter().zip(&expected).enumerate() {
        assert!((got - want).abs() < 1e-5, "pair {index}: {got} vs {want}");
    }
    // Empty texts are typed errors, and they do not fail their batch-mates.
    runtime.block_on(async {
        let empty = scorer.score("question".into(), " \n".into());
        let fine = scorer.score(pairs[0].0.clone(), pairs[0].1.clone());
        let (empty, fine) = tokio::join!(empty, fine);
        assert!(matches!(empty, Err(TopicError::EmptyText(what)) if what == "answer"));
        assert!((fine.unwrap() - expected[0]).abs() < 1e-5);
        let empty = scorer.score(String::new(), "answer".into()).await;
        assert!(matches!(empty, Err(TopicError::EmptyText(what)) if what == "question"));
    });
}

#[test]
fn a_full_queue_answers_busy_at_once() {
    let scorer = TopicScorer::start(
        Embedder::load(&model_dir::model_dir()).unwrap(),
        ScorerOptions {
            max_batch: 1,
            queue: 1,
        },
    );
    let long = long_text();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let results = runtime.block_on(async {
        // Twenty long pairs submitted together: the worker takes one (tens of milliseconds
        // of work), one waits in the queue, and the rest find it full.
        let tasks: Vec<_> = (0..20)
            .map(|_| {
                let (scorer, long) = (scorer.clone(), long.clone());
                tokio::spawn(async move { scorer.score(long.clone(), long).await })
            })
            .collect();
        let mut results = Vec::new();
        for task in tasks {
            results.push(task.await.unwrap());
        }
        results
    });
    let busy = results
        .iter()
        .filter(|r| matches!(r, Err(TopicError::Busy)))
        .count();
    let scored = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(busy + scored, 20, "{results:?}");
    assert!(busy >= 10, "only {busy} of 20 were refused");
    assert!(scored >= 1);
}
