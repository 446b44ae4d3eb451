//! Next-token sampling: greedy, temperature, top-k, top-p, seeded.

use serde::Deserialize;

/// How to pick the next token from the logits.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; `0.0` means greedy (argmax).
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability sums to at least `top_p` (1.0: all;
    /// 0.0: the most likely one, as greedy).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Seed of the request's random stream; the same seed gives the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Argmax decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Rejects values outside their meaningful range.
    pub fn validate(&self) -> Result<(), InvalidSampling> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(InvalidSampling::Temperature(self.temperature));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(InvalidSampling::TopP(self.top_p));
        }
        Ok(())
    }
}

/// Sampling settings outside their meaningful range.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum InvalidSampling {
    /// Negative or not finite.
    #[error("temperature must be >= 0, got {0}")]
    Temperature(f32),
    /// Not in [0, 1].
    #[error("top_p must be from 0 to 1, got {0}")]
    TopP(f32),
}

/// Per-request sampler state. It travels with the request through preemption, so a recomputed
/// request continues the same random stream.
#[derive(Debug, Clone)]
pub(crate) struct Sampler {
    params: SamplingParams,
    /// SplitMix64 state.
    state: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self {
            state: params.seed,
            params,
        }
    }

    /// Uniform in [0, 1) (SplitMix64, 53 bits).
    fn next_f64(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Picks the next token id from `logits` (length = vocabulary).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let argmax = || {
            logits
                .iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
                    if x > best.1 { (i, x) } else { best }
                })
                .0 as u32
        };
        let p = &self.params;
        if p.temperature == 0.0 || p.top_k == 1 || p.top_p == 0.0 {
            return argmax();
        }
        // Candidates sorted by logit, descending (ties: lower id first).
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        if p.top_k > 0 {
            order.truncate(p.top_k);
        }
        let max = logits[order[0] as usize];
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| (((logits[i as usize] - max) / p.temperature) as f64).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        if p.top_p < 1.0 {
            let mut cumulative = 0.0;
            let keep = probs
                .iter()
                .position(|&x| {
                    cumulative += x;
                    cumulative >= p.top_p as f64
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            order.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut r = self.next_f64() * total;
        for (i, &x) in probs.iter().enumerate() {
            if r < x {
                return order[i];
            }
            r -= x;
        }
        order[probs.len() - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn top_k_and_top_p_restrict_candidates() {
        let logits = [0.0, 5.0, 4.9, -2.0, 4.8];
        let mut k2 = Sampler::new(SamplingParams {
            top_k: 2,
            seed: 7,
            ..SamplingParams::default()
        });
        let mut seen = [0usize; 5];
        for _ in 0..400 {
            seen[k2.sample(&logits) as usize] += 1;
        }
        assert_eq!(seen[0] + seen[3] + seen[4], 0, "{seen:?}");
        assert!(seen[1] > 0 && seen[2] > 0, "{seen:?}");

        // With a tiny top_p only the most likely token survives.
        let mut p = Sampler::new(SamplingParams {
            top_p: 0.01,
            seed: 1,
            ..SamplingParams::default()
        });
        assert!((0..50).all(|_| p.sample(&logits) == 1));
    }

    #[test]
    fn same_seed_same_stream() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplingParams {
            seed: 42,
            ..SamplingParams::default()
        };
        let run = |params: &SamplingParams| {
            let mut s = Sampler::new(params.clone());
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(&params), run(&params));
        assert_ne!(
            run(&params),
            run(&SamplingParams {
                seed: 43,
                ..params.clone()
            })
        );
    }

    #[test]
    fn invalid_params_are_rejected() {
        assert!(
            SamplingParams {
                temperature: -1.0,
                ..SamplingParams::default()
            }
            .validate()
            .is_err()
        );
        for top_p in [-0.1, 1.5, f32::NAN] {
            let params = SamplingParams {
                top_p,
                ..SamplingParams::default()
            };
            assert!(params.validate().is_err(), "{top_p}");
        }
        assert!(SamplingParams::default().validate().is_ok());
    }

    #[test]
    fn top_p_zero_keeps_the_most_likely_token() {
        // OpenAI and Anthropic accept 0: the smallest set is one token.
        let params = SamplingParams {
            top_p: 0.0,
            seed: 3,
            ..SamplingParams::default()
        };
        assert!(params.validate().is_ok());
        let mut sampler = Sampler::new(params);
        for _ in 0..20 {
            assert_eq!(sampler.sample(&[0.1, 3.0, 2.99, -1.0]), 1);
        }
    }
}
