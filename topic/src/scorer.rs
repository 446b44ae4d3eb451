//! One worker thread, one embedder, a bounded queue: batching exactly when busy.
//!
//! An async caller puts its pair on the queue with `try_send` (a full queue is
//! [`TopicError::Busy`], never a wait) and awaits a oneshot reply. The worker blocks on the
//! queue; when a pair arrives it also takes whatever else is already waiting, up to
//! `max_batch` pairs, and embeds their questions in one forward pass and their answers in
//! another (each padded to the longest of its kind). An idle scorer thus embeds each pair
//! alone as soon as it comes; a busy one amortises the passes over the queue.

use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};

use tokio::sync::oneshot;

use crate::{Embedder, TopicError, cosine};

/// How a [`TopicScorer`] batches and how much it queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScorerOptions {
    /// The most pairs embedded together (at least 1).
    pub max_batch: usize,
    /// The most pairs waiting; beyond it `score` answers [`TopicError::Busy`] (at least 1).
    pub queue: usize,
}

impl Default for ScorerOptions {
    fn default() -> Self {
        Self {
            max_batch: 16,
            queue: 1024,
        }
    }
}

/// A question/answer pair waiting for its score.
struct Job {
    question: String,
    answer: String,
    reply: oneshot::Sender<Result<f32, TopicError>>,
}

/// Scores question/answer pairs on a worker thread; cheap to clone (an `Arc` inside).
///
/// The worker ends when the last clone is dropped, after the pairs already queued.
#[derive(Clone)]
pub struct TopicScorer {
    inner: Arc<Inner>,
}

struct Inner {
    queue: SyncSender<Job>,
    model: String,
}

impl TopicScorer {
    /// Starts the worker thread, which owns `embedder` from now on.
    pub fn start(embedder: Embedder, options: ScorerOptions) -> Self {
        let (queue, jobs) = mpsc::sync_channel(options.queue.max(1));
        let model = embedder.name().to_string();
        let max_batch = options.max_batch.max(1);
        // If the thread cannot be spawned, `jobs` is dropped with the closure and every
        // `score` answers Closed: the scorer degrades, it does not panic.
        let _ = std::thread::Builder::new()
            .name("topic-scorer".to_string())
            .spawn(move || work(&embedder, &jobs, max_batch));
        Self {
            inner: Arc::new(Inner { queue, model }),
        }
    }

    /// The cosine similarity of the question's and the answer's embeddings.
    ///
    /// [`TopicError::Busy`] when the queue is full (returned at once), [`TopicError::Closed`]
    /// when the worker is gone, [`TopicError::EmptyText`] when either text is empty or only
    /// whitespace.
    pub async fn score(&self, question: String, answer: String) -> Result<f32, TopicError> {
        let (reply, receiver) = oneshot::channel();
        let job = Job {
            question,
            answer,
            reply,
        };
        match self.inner.queue.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(TopicError::Busy),
            Err(TrySendError::Disconnected(_)) => return Err(TopicError::Closed),
        }
        receiver.await.unwrap_or(Err(TopicError::Closed))
    }

    /// The model's name (its directory's last component).
    pub fn model(&self) -> &str {
        &self.inner.model
    }
}

/// The worker's loop: wait for a pair, take what else is queued, score them together.
fn work(embedder: &Embedder, jobs: &Receiver<Job>, max_batch: usize) {
    while let Ok(first) = jobs.recv() {
        let mut batch = vec![first];
        while batch.len() < max_batch {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        score_batch(embedder, batch);
    }
}

/// Scores a batch (two forward passes), answering each caller; pairs with an empty text are
/// answered first, and if the pass fails each pair is retried alone so that one bad input
/// does not fail the others.
fn score_batch(embedder: &Embedder, batch: Vec<Job>) {
    let mut ready = Vec::with_capacity(batch.len());
    for job in batch {
        if job.question.trim().is_empty() {
            let _ = job
                .reply
                .send(Err(TopicError::EmptyText("question".into())));
        } else if job.answer.trim().is_empty() {
            let _ = job.reply.send(Err(TopicError::EmptyText("answer".into())));
        } else {
            ready.push(job);
        }
    }
    if ready.is_empty() {
        return;
    }
    match scores(embedder, &ready) {
        Ok(scores) => {
            for (job, score) in ready.into_iter().zip(scores) {
                let _ = job.reply.send(Ok(score));
            }
        }
        Err(error) if ready.len() == 1 => {
            if let Some(job) = ready.pop() {
                let _ = job.reply.send(Err(error));
            }
        }
        Err(_) => {
            for job in ready {
                let score = scores(embedder, std::slice::from_ref(&job)).and_then(|scores| {
                    scores
                        .first()
                        .copied()
                        .ok_or_else(|| TopicError::Model("no score came back".into()))
                });
                let _ = job.reply.send(score);
            }
        }
    }
}

/// The pairs' similarities: the questions in one pass, the answers in another, so that each
/// text is padded only to the longest of its kind (a short question padded to a long answer's
/// length would cost as much as the answer).
fn scores(embedder: &Embedder, jobs: &[Job]) -> Result<Vec<f32>, TopicError> {
    let questions: Vec<&str> = jobs.iter().map(|job| job.question.as_str()).collect();
    let answers: Vec<&str> = jobs.iter().map(|job| job.answer.as_str()).collect();
    let questions = embedder.embed(&questions)?;
    let answers = embedder.embed(&answers)?;
    Ok(questions
        .iter()
        .zip(&answers)
        .map(|(question, answer)| cosine(question, answer))
        .collect())
}
