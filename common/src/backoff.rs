//! Exponential backoff with jitter, shared by every retry loop (client
//! connects, controllers), so retries from many clients never synchronise.

use std::time::Duration;

/// Exponential backoff: `initial`, doubled per attempt up to `max`, each delay
/// randomised by ±`jitter` (a fraction, 0.0..=1.0).
///
/// ```
/// use rivet_common::backoff::Backoff;
/// use std::time::Duration;
///
/// let mut b = Backoff::new(Duration::from_millis(10), Duration::from_millis(80)).with_jitter(0.0);
/// let delays: Vec<_> = (0..5).map(|_| b.next_delay().as_millis()).collect();
/// assert_eq!(delays, [10, 20, 40, 80, 80]);
/// b.reset();
/// assert_eq!(b.next_delay(), Duration::from_millis(10));
/// ```
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    jitter: f64,
    next: Duration,
}

impl Backoff {
    /// A backoff starting at `initial` and capped at `max`, with 20% jitter.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            jitter: 0.2,
            next: initial,
        }
    }

    /// Sets the jitter fraction (clamped to 0.0..=1.0).
    pub fn with_jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter.clamp(0.0, 1.0);
        self
    }

    /// The delay before the next attempt; advances the backoff.
    pub fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        if self.jitter == 0.0 {
            return base;
        }
        let factor = 1.0 + self.jitter * (rand::random::<f64>() * 2.0 - 1.0);
        base.mul_f64(factor).min(self.max)
    }

    /// Starts over at the initial delay (after a success).
    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

impl Default for Backoff {
    /// 50 ms doubling up to 2 s.
    fn default() -> Self {
        Self::new(Duration::from_millis(50), Duration::from_secs(2))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jittered_delays_stay_within_bounds() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1)).with_jitter(0.5);
        for _ in 0..100 {
            let d = b.next_delay();
            assert!(
                d >= Duration::from_millis(50) && d <= Duration::from_secs(1),
                "a jittered delay must stay within half the initial and the cap, got {d:?}"
            );
        }
    }
}
