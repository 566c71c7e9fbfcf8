//! The adaptive interval between scheduled passes (Cilium's rule).
//!
//! After each pass, with `ratio` = deleted / scanned:
//!
//! - the ratio is first scaled to the interval in force: a pass that came
//!   after `elapsed` instead of `interval` (RunNow, map pressure, a late
//!   start) saw `elapsed` worth of expiries, so
//!   `ratio × interval / elapsed` (capped at 1) is what a full interval would
//!   have seen;
//! - over 25%: the interval shrinks to `interval × (1 − ratio)`, the ratio
//!   capped at 0.9 (at most ten times shorter at once), never below the
//!   minimum;
//! - under 5%: it grows ×1.5, never above the maximum;
//! - otherwise it stays.

use std::time::Duration;

/// Bounds of the interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntervalBounds {
    /// The floor (default 10 s).
    pub min: Duration,
    /// The ceiling.
    pub max: Duration,
}

/// A ratio above this shortens the interval.
pub const SHORTEN_ABOVE: f64 = 0.25;
/// A ratio below this lengthens the interval.
pub const LENGTHEN_BELOW: f64 = 0.05;
/// The largest ratio the shortening uses.
pub const RATIO_CAP: f64 = 0.9;
/// The lengthening factor.
pub const GROWTH: f64 = 1.5;

/// `ratio` measured over `elapsed` (0: unknown, e.g. the first pass), as if
/// measured over `interval`.
pub fn scaled_ratio(ratio: f64, interval: Duration, elapsed: Duration) -> f64 {
    let ratio = if ratio.is_finite() { ratio.clamp(0.0, 1.0) } else { 0.0 };
    if elapsed.is_zero() || interval.is_zero() {
        return ratio;
    }
    (ratio * interval.as_secs_f64() / elapsed.as_secs_f64()).min(1.0)
}

/// The interval after a pass that deleted `ratio` of what it scanned,
/// `elapsed` after the previous pass started (zero when there was none).
pub fn next_interval(interval: Duration, ratio: f64, elapsed: Duration, bounds: IntervalBounds) -> Duration {
    let ratio = scaled_ratio(ratio, interval, elapsed);
    let next = if ratio > SHORTEN_ABOVE {
        interval.mul_f64(1.0 - ratio.min(RATIO_CAP))
    } else if ratio < LENGTHEN_BELOW {
        interval.mul_f64(GROWTH)
    } else {
        interval
    };
    next.clamp(bounds.min, bounds.max.max(bounds.min))
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    const B: IntervalBounds = IntervalBounds {
        min: s(10),
        max: s(3600),
    };

    #[test]
    fn the_rule_for_chosen_ratios() {
        let i = s(300);
        let cases = [
            // (ratio, expected)
            (0.0, s(450)),      // nothing deleted: ×1.5
            (0.049, s(450)),    // under 5%: ×1.5
            (0.05, s(300)),     // 5%..25%: unchanged
            (0.10, s(300)),     // unchanged
            (0.25, s(300)),     // exactly 25%: unchanged
            (0.50, s(150)),     // ×(1 − 0.5)
            (0.80, s(60)),      // ×(1 − 0.8)
            (0.95, s(30)),      // capped at 0.9: ×0.1
            (1.0, s(30)),       // capped
            (0.60, s(120)),     // ×0.4
            (f64::NAN, s(450)), // nonsense counts as nothing deleted
        ];
        for (ratio, expected) in cases {
            let got = next_interval(i, ratio, i, B);
            let diff = got.abs_diff(expected);
            assert!(
                diff < Duration::from_millis(1),
                "ratio {ratio}: {got:?}, expected {expected:?}"
            );
        }
    }

    #[test]
    fn bounds_hold() {
        assert_eq!(next_interval(s(12), 0.9, s(12), B), s(10), "floor");
        assert_eq!(next_interval(s(3000), 0.0, s(3000), B), s(3600), "ceiling");
        assert_eq!(next_interval(s(10), 0.95, Duration::ZERO, B), s(10));
    }

    #[test]
    fn an_early_pass_counts_for_a_whole_interval() {
        // 10% deleted after a third of the interval: 30% per interval → shorten.
        let got = next_interval(s(300), 0.10, s(100), B);
        assert!(got.abs_diff(s(210)) < Duration::from_millis(1), "{got:?}");
        // 3% after half the interval: 6% → unchanged (not lengthened).
        assert_eq!(next_interval(s(300), 0.03, s(150), B), s(300));
        // A late pass (twice the interval): 40% → 20% per interval → unchanged.
        assert_eq!(next_interval(s(300), 0.40, s(600), B), s(300));
        // The first pass (no previous one): taken as is.
        assert!(next_interval(s(300), 0.5, Duration::ZERO, B).abs_diff(s(150)) < Duration::from_millis(1));
    }
}
