//! Choosing a similarity threshold from scored pairs: pure arithmetic, no model.
//!
//! Two sets of scores: honest pairs (an answer with the question it was written for) and
//! swapped pairs (the same answers under other questions). A pair is flagged when its score
//! is strictly below the threshold. A false alarm is a flagged honest pair; a catch is a
//! flagged swapped pair. The ROC curve runs over every threshold; its area is the chance
//! that a random swapped pair scores below a random honest one (ties count half).

use serde::Serialize;

/// A calibration: the ROC curve's area and the threshold chosen on it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Calibration {
    /// Area under the ROC curve, in [0, 1]: 0.5 is chance, 1 separates perfectly.
    pub auc: f64,
    /// The highest threshold whose false-alarm rate is within the bound asked for.
    pub threshold: f32,
    /// Honest pairs flagged at `threshold`, as a fraction of the honest pairs.
    pub false_alarm_rate: f64,
    /// Swapped pairs flagged at `threshold`, as a fraction of the swapped pairs.
    pub catch_rate: f64,
    /// How many honest pairs were scored.
    pub honest: usize,
    /// How many swapped pairs were scored.
    pub swapped: usize,
    /// The ROC curve: one point per distinct score, thresholds ascending, from nothing
    /// flagged to everything flagged.
    pub roc: Vec<RocPoint>,
}

/// One point of the ROC curve.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RocPoint {
    /// Pairs scoring strictly below this are flagged.
    pub threshold: f32,
    /// Honest pairs flagged, as a fraction.
    pub false_alarm_rate: f64,
    /// Swapped pairs flagged, as a fraction.
    pub catch_rate: f64,
}

/// Why scores could not be calibrated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CalibrationError {
    /// One of the two sets has no scores.
    #[error("no {0} scores to calibrate on")]
    Empty(&'static str),
    /// A score is NaN or infinite.
    #[error("{0} scores include a value that is not finite")]
    NotFinite(&'static str),
    /// The false-alarm bound is outside [0, 1).
    #[error("the false-alarm bound {0} is outside [0, 1)")]
    BadBound(f64),
}

impl Calibration {
    /// Calibrates on `honest` and `swapped` scores, choosing the highest threshold at which
    /// at most `max_false_alarms` (a fraction, e.g. 0.01) of the honest pairs are flagged.
    pub fn from_scores(
        honest: &[f32],
        swapped: &[f32],
        max_false_alarms: f64,
    ) -> Result<Self, CalibrationError> {
        let honest = sorted("honest", honest)?;
        let swapped = sorted("swapped", swapped)?;
        if !(0.0..1.0).contains(&max_false_alarms) {
            return Err(CalibrationError::BadBound(max_false_alarms));
        }
        let (n_honest, n_swapped) = (honest.len() as f64, swapped.len() as f64);
        let below = |scores: &[f32], threshold: f32| scores.partition_point(|&s| s < threshold);

        // Mann-Whitney: for each swapped score, the honest scores above it, ties halved.
        let mut wins = 0.0f64;
        for &s in &swapped {
            let lower = below(&honest, s);
            let not_above = honest.partition_point(|&h| h <= s);
            wins += (honest.len() - not_above) as f64 + 0.5 * (not_above - lower) as f64;
        }
        let auc = wins / (n_honest * n_swapped);

        // At most k false alarms. Flagging s < honest[k] flags at most k honest pairs (fewer
        // when honest[k] is tied with lower scores); any higher threshold flags honest[k] too.
        // The small slack keeps 0.01 * 300 from rounding down to 2.
        let allowed = ((max_false_alarms * n_honest) + 1e-9).floor() as usize;
        let threshold = honest[allowed.min(honest.len() - 1)];
        let false_alarm_rate = below(&honest, threshold) as f64 / n_honest;
        let catch_rate = below(&swapped, threshold) as f64 / n_swapped;

        let mut thresholds: Vec<f32> = honest.iter().chain(&swapped).copied().collect();
        thresholds.sort_by(f32::total_cmp);
        thresholds.dedup();
        if let Some(&top) = thresholds.last() {
            thresholds.push(top.next_up());
        }
        let roc = thresholds
            .into_iter()
            .map(|threshold| RocPoint {
                threshold,
                false_alarm_rate: below(&honest, threshold) as f64 / n_honest,
                catch_rate: below(&swapped, threshold) as f64 / n_swapped,
            })
            .collect();

        Ok(Self {
            auc,
            threshold,
            false_alarm_rate,
            catch_rate,
            honest: honest.len(),
            swapped: swapped.len(),
            roc,
        })
    }
}

fn sorted(which: &'static str, scores: &[f32]) -> Result<Vec<f32>, CalibrationError> {
    if scores.is_empty() {
        return Err(CalibrationError::Empty(which));
    }
    if scores.iter().any(|score| !score.is_finite()) {
        return Err(CalibrationError::NotFinite(which));
    }
    let mut scores = scores.to_vec();
    scores.sort_by(f32::total_cmp);
    Ok(scores)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perfectly_separated_scores() {
        let honest = [0.6, 0.7, 0.8, 0.9];
        let swapped = [0.1, 0.2, 0.3];
        let c = Calibration::from_scores(&honest, &swapped, 0.0).unwrap();
        assert_eq!(c.auc, 1.0);
        // No false alarm allowed: the threshold is the lowest honest score, flagging none.
        assert_eq!(c.threshold, 0.6);
        assert_eq!(c.false_alarm_rate, 0.0);
        assert_eq!(c.catch_rate, 1.0);
        assert_eq!((c.honest, c.swapped), (4, 3));
    }

    #[test]
    fn overlapping_scores_and_the_false_alarm_bound() {
        // Swapped 0.5 beats honest 0.4; everything else is ordered.
        let honest = [0.4, 0.6, 0.7, 0.8];
        let swapped = [0.1, 0.5];
        let c = Calibration::from_scores(&honest, &swapped, 0.0).unwrap();
        // Pairs (swapped < honest): 0.1 < all 4, 0.5 < 3 of 4 -> 7 / 8.
        assert_eq!(c.auc, 7.0 / 8.0);
        assert_eq!(c.threshold, 0.4);
        assert_eq!(c.catch_rate, 0.5);
        assert_eq!(c.false_alarm_rate, 0.0);
        // Allowing one honest pair in four (25 %) moves the threshold up to 0.6.
        let c = Calibration::from_scores(&honest, &swapped, 0.25).unwrap();
        assert_eq!(c.threshold, 0.6);
        assert_eq!(c.false_alarm_rate, 0.25);
        assert_eq!(c.catch_rate, 1.0);
        // 24 % is less than one pair in four: back to none.
        let c = Calibration::from_scores(&honest, &swapped, 0.24).unwrap();
        assert_eq!(c.threshold, 0.4);
    }

    #[test]
    fn one_percent_of_three_hundred_is_three() {
        let honest: Vec<f32> = (0..300).map(|i| i as f32 / 300.0).collect();
        let c = Calibration::from_scores(&honest, &[0.0], 0.01).unwrap();
        assert_eq!(c.threshold, 3.0 / 300.0);
        assert_eq!(c.false_alarm_rate, 0.01);
    }

    #[test]
    fn ties_count_half_and_never_exceed_the_bound() {
        // All the same score: AUC is chance, and nothing can be flagged without flagging all.
        let c = Calibration::from_scores(&[0.5, 0.5], &[0.5, 0.5], 0.5).unwrap();
        assert_eq!(c.auc, 0.5);
        assert_eq!(c.false_alarm_rate, 0.0);
        assert_eq!(c.catch_rate, 0.0);
        // A tie at the threshold: honest 0.3 twice; allowing one false alarm of three cannot
        // split the tie, so the threshold stays at 0.3 and flags none.
        let c = Calibration::from_scores(&[0.3, 0.3, 0.9], &[0.3, 0.1], 0.34).unwrap();
        assert_eq!(c.threshold, 0.3);
        assert_eq!(c.false_alarm_rate, 0.0);
        assert_eq!(c.catch_rate, 0.5);
        // 0.1 beats all three; 0.3 ties two and beats one: (3 + 1 + 1) / 6.
        assert!((c.auc - 5.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn roc_runs_from_nothing_to_everything_flagged() {
        let c = Calibration::from_scores(&[0.5, 0.9], &[0.1, 0.5], 0.0).unwrap();
        let first = c.roc.first().unwrap();
        let last = c.roc.last().unwrap();
        assert_eq!((first.false_alarm_rate, first.catch_rate), (0.0, 0.0));
        assert_eq!((last.false_alarm_rate, last.catch_rate), (1.0, 1.0));
        assert_eq!(c.roc.len(), 4); // 0.1, 0.5, 0.9 and just above 0.9
        assert!(c.roc.windows(2).all(|w| w[0].threshold < w[1].threshold
            && w[0].false_alarm_rate <= w[1].false_alarm_rate
            && w[0].catch_rate <= w[1].catch_rate));
    }

    #[test]
    fn inverted_scores_have_area_zero() {
        let c = Calibration::from_scores(&[0.1, 0.2], &[0.8, 0.9], 0.0).unwrap();
        assert_eq!(c.auc, 0.0);
        assert_eq!(c.catch_rate, 0.0);
    }

    #[test]
    fn bad_input_is_an_error() {
        assert_eq!(
            Calibration::from_scores(&[], &[0.1], 0.01),
            Err(CalibrationError::Empty("honest"))
        );
        assert_eq!(
            Calibration::from_scores(&[0.1], &[], 0.01),
            Err(CalibrationError::Empty("swapped"))
        );
        assert_eq!(
            Calibration::from_scores(&[f32::NAN], &[0.1], 0.01),
            Err(CalibrationError::NotFinite("honest"))
        );
        assert_eq!(
            Calibration::from_scores(&[0.2], &[0.1], 1.0),
            Err(CalibrationError::BadBound(1.0))
        );
        assert_eq!(
            Calibration::from_scores(&[0.2], &[0.1], -0.1),
            Err(CalibrationError::BadBound(-0.1))
        );
    }
}
