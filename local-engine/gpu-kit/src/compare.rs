//! How a device run is held against the CPU reference: the tolerances, the error measure, and
//! what counts as agreement along a greedy generation.
//!
//! Rows are compared while the run's tokens equal the reference's: a row's logits depend on
//! every token before it, so after the first different token the two runs no longer see the
//! same context. The row where tokens first differ is still compared (its context is shared).

use serde::{Deserialize, Serialize};

/// How closely a run must follow the reference.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tolerance {
    /// Largest allowed [`relative_error`] of any compared logits row.
    pub max_relative_error: f32,
    /// Leading greedy steps whose tokens must equal the reference's.
    pub identical_steps: usize,
}

/// f32 on a device: the bound. CPU and GPU differ only in summation order.
pub const F32: Tolerance = Tolerance {
    max_relative_error: 1e-3,
    identical_steps: 32,
};

/// bf16 weights, activations and KV against the f32 reference. bf16 keeps 8 significant bits
/// (a rounding error of up to 2^-9 = 0.2 % per value), and every layer rounds again: on the
/// kit's model the CPU's bf16 kernels are 0.5-0.6 % off. 3 % leaves room for cuBLAS's other
/// summation order, and is far below what a broken part does to the same logits (an attention
/// output of zero: 56 %, an MLP output of zero: 28 %; see `reference.rs`).
pub const BF16: Tolerance = Tolerance {
    max_relative_error: 3e-2,
    identical_steps: 32,
};

/// `max |x - reference| / max |reference|` over one logits row; infinite when the rows differ in
/// length or `x` holds a NaN or an infinity (a poisoned or stale read), 0 for two zero rows.
pub fn relative_error(x: &[f32], reference: &[f32]) -> f32 {
    if x.len() != reference.len() || x.iter().any(|v| !v.is_finite()) {
        return f32::INFINITY;
    }
    let diff = x
        .iter()
        .zip(reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let scale = reference.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
    if diff == 0.0 {
        0.0
    } else if scale == 0.0 {
        f32::INFINITY
    } else {
        diff / scale
    }
}

/// Index of the largest logit (the first of equal ones, as the engine's greedy sampler).
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Lead of the top logit over the runner-up, as a fraction of the row's largest magnitude.
///
/// Two runs whose rows each stay within a relative error `e` of the reference pick the same
/// greedy token wherever this margin exceeds `2 * e`: that is how the kit chooses prompts for
/// which "identical greedy tokens" is a fair demand of bf16.
pub fn relative_margin(row: &[f32]) -> f32 {
    let scale = row.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
    if row.len() < 2 || scale == 0.0 {
        return 0.0;
    }
    let top = argmax(row);
    let runner_up = row
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != top)
        .map(|(_, &v)| v)
        .fold(f32::NEG_INFINITY, f32::max);
    (row[top] - runner_up) / scale
}

/// How one generation compares with the reference's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Agreement {
    /// Tokens the run generated.
    pub steps: usize,
    /// Leading steps whose tokens equal the reference's.
    pub identical_tokens: usize,
    /// Logits rows compared (see the module docs).
    pub compared_rows: usize,
    /// Largest [`relative_error`] over the compared rows.
    pub max_relative_error: f32,
    /// Step of that largest error.
    pub worst_step: usize,
}

/// Compares a run's tokens and logits rows with the reference's.
pub fn agreement(
    reference_tokens: &[u32],
    reference_logits: &[Vec<f32>],
    tokens: &[u32],
    logits: &[Vec<f32>],
) -> Agreement {
    let identical_tokens = reference_tokens
        .iter()
        .zip(tokens)
        .take_while(|(a, b)| a == b)
        .count();
    // Rows up to and including the first differing token share their context.
    let comparable = (identical_tokens + 1)
        .min(reference_logits.len())
        .min(logits.len());
    let (mut max_relative_error, mut worst_step) = (0.0f32, 0);
    for (step, (row, reference)) in logits
        .iter()
        .zip(reference_logits)
        .take(comparable)
        .enumerate()
    {
        let error = relative_error(row, reference);
        if error > max_relative_error || error.is_nan() {
            max_relative_error = error;
            worst_step = step;
        }
    }
    Agreement {
        steps: tokens.len(),
        identical_tokens,
        compared_rows: comparable,
        max_relative_error,
        worst_step,
    }
}

impl Tolerance {
    /// `Ok` when `agreement` meets this tolerance, else what it missed.
    pub fn verdict(&self, agreement: &Agreement) -> Result<(), String> {
        let a = agreement;
        if a.steps < self.identical_steps {
            return Err(format!(
                "generated {} tokens, fewer than the {} to compare",
                a.steps, self.identical_steps
            ));
        }
        if a.identical_tokens < self.identical_steps {
            return Err(format!(
                "greedy token {} differs from the reference (the first {} must be identical)",
                a.identical_tokens, self.identical_steps
            ));
        }
        if a.compared_rows == 0 {
            return Err("no logits to compare".into());
        }
        // NaN fails too.
        if a.max_relative_error.is_nan() || a.max_relative_error > self.max_relative_error {
            return Err(format!(
                "logits relative error {:.2e} at step {} exceeds {:.0e}",
                a.max_relative_error, a.worst_step, self.max_relative_error
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_error_is_scaled_by_the_reference_and_catches_bad_values() {
        assert_eq!(relative_error(&[1.0, -4.0], &[1.0, -4.0]), 0.0);
        assert!((relative_error(&[1.0, -3.0], &[1.0, -4.0]) - 0.25).abs() < 1e-7);
        assert!((relative_error(&[1.2, -4.0], &[1.0, -4.0]) - 0.05).abs() < 1e-6);
        assert_eq!(relative_error(&[f32::NAN, 0.0], &[1.0, 0.0]), f32::INFINITY);
        assert_eq!(
            relative_error(&[f32::INFINITY, 0.0], &[1.0, 0.0]),
            f32::INFINITY
        );
        assert_eq!(relative_error(&[1.0], &[1.0, 0.0]), f32::INFINITY);
        assert_eq!(relative_error(&[0.5, 0.0], &[0.0, 0.0]), f32::INFINITY);
        assert_eq!(relative_error(&[0.0, 0.0], &[0.0, 0.0]), 0.0);
    }

    #[test]
    fn margin_is_the_lead_of_the_top_logit() {
        assert!((relative_margin(&[1.0, 4.0, 3.0]) - 0.25).abs() < 1e-7);
        assert_eq!(relative_margin(&[2.0, 2.0]), 0.0);
        assert_eq!(argmax(&[2.0, 2.0, 1.0]), 0);
        assert_eq!(relative_margin(&[1.0]), 0.0);
    }

    fn rows(n: usize) -> Vec<Vec<f32>> {
        (0..n).map(|i| vec![i as f32, 10.0, -3.0]).collect()
    }

    #[test]
    fn identical_runs_agree() {
        let a = agreement(&[1, 2, 3], &rows(3), &[1, 2, 3], &rows(3));
        assert_eq!(
            a,
            Agreement {
                steps: 3,
                identical_tokens: 3,
                compared_rows: 3,
                max_relative_error: 0.0,
                worst_step: 0,
            }
        );
        let tolerance = Tolerance {
            max_relative_error: 1e-3,
            identical_steps: 3,
        };
        assert_eq!(tolerance.verdict(&a), Ok(()));
    }

    #[test]
    fn comparison_stops_after_the_first_different_token() {
        let mut logits = rows(4);
        // Step 1 has a small error, step 3 (after the divergence at step 2) a huge one.
        logits[1][1] = 10.05;
        logits[3][1] = 1000.0;
        let a = agreement(&[1, 2, 3, 4], &rows(4), &[1, 2, 9, 4], &logits);
        assert_eq!(a.identical_tokens, 2);
        assert_eq!(a.compared_rows, 3);
        assert_eq!(a.worst_step, 1);
        assert!((a.max_relative_error - 0.005).abs() < 1e-5);
    }

    #[test]
    fn verdicts_name_what_was_missed() {
        let tolerance = Tolerance {
            max_relative_error: 1e-3,
            identical_steps: 3,
        };
        let short = agreement(&[1, 2, 3], &rows(3), &[1, 2], &rows(2));
        assert!(tolerance.verdict(&short).unwrap_err().contains("fewer"));
        let diverged = agreement(&[1, 2, 3], &rows(3), &[1, 5, 3], &rows(3));
        assert!(
            tolerance
                .verdict(&diverged)
                .unwrap_err()
                .contains("token 1")
        );
        let mut noisy = rows(3);
        noisy[2][0] += 0.1;
        let noisy = agreement(&[1, 2, 3], &rows(3), &[1, 2, 3], &noisy);
        let err = tolerance.verdict(&noisy).unwrap_err();
        assert!(err.contains("1.00e-2") && err.contains("step 2"), "{err}");
        // The same error passes a looser tolerance.
        let loose = Tolerance {
            max_relative_error: 2e-2,
            ..tolerance
        };
        assert_eq!(loose.verdict(&noisy), Ok(()));
        let mut poisoned = rows(3);
        poisoned[0][2] = f32::NAN;
        let poisoned = agreement(&[1, 2, 3], &rows(3), &[1, 2, 3], &poisoned);
        assert!(tolerance.verdict(&poisoned).is_err());
    }
}
