//! The topic check's model: is an answer about what was asked?
//!
//! Three types meet here:
//!
//! - [`Embedder`] is a sentence-transformers directory loaded into candle (a BERT encoder,
//!   attention-masked mean pooling, optional L2 normalisation): texts in, one vector each.
//!   It is synchronous and owns the model's weights.
//! - [`TopicScorer`] puts one `Embedder` on its own worker thread behind a bounded queue. An
//!   async caller hands it a question and an answer and awaits their [`cosine`] similarity;
//!   the worker embeds everything queued (up to `max_batch` pairs) together, questions in one
//!   forward pass and answers in another, so
//!   batching happens exactly when the scorer is busy and costs nothing when it is idle. A
//!   full queue answers [`TopicError::Busy`] at once: the caller never blocks.
//! - [`calibration`] is pure arithmetic over scores of honest and swapped pairs: the ROC
//!   curve, its area, and the threshold that keeps false alarms on honest pairs under a bound.
//!
//! Nothing here knows about requests, policies or the audit log: the proxy decides what text
//! is the question and what the answer, and what a low score means.

pub mod calibration;
mod embedder;
mod error;
mod scorer;

pub use embedder::Embedder;
pub use error::TopicError;
pub use scorer::{ScorerOptions, TopicScorer};

/// The cosine similarity of two vectors: in [-1, 1], or 0 when either is all zeros or
/// their lengths differ (no direction to compare).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return 0.0;
    }
    let (mut dot, mut norm_a, mut norm_b) = (0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        dot += x * y;
        norm_a += x * x;
        norm_b += y * y;
    }
    if norm_a == 0.0 || norm_b == 0.0 {
        return 0.0;
    }
    (dot / (norm_a.sqrt() * norm_b.sqrt())).clamp(-1.0, 1.0) as f32
}

#[cfg(test)]
mod tests {
    use super::cosine;

    #[test]
    fn cosine_of_known_vectors() {
        assert!((cosine(&[1.0, 0.0], &[1.0, 0.0]) - 1.0).abs() < 1e-6);
        assert!(cosine(&[1.0, 0.0], &[0.0, 2.0]).abs() < 1e-6);
        assert!((cosine(&[1.0, 1.0], &[-3.0, -3.0]) + 1.0).abs() < 1e-6);
        // Scale does not matter.
        assert!((cosine(&[1.0, 2.0, 3.0], &[2.0, 4.0, 6.0]) - 1.0).abs() < 1e-6);
        assert!((cosine(&[1.0, 0.0], &[1.0, 1.0]) - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
    }

    #[test]
    fn cosine_without_a_direction_is_zero() {
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 0.0]), 0.0);
        assert_eq!(cosine(&[1.0], &[1.0, 0.0]), 0.0);
        assert_eq!(cosine(&[], &[]), 0.0);
    }
}
