//! The clocks a pass reads: the kernel's monotonic clock (the one
//! `bpf_ktime_get_ns()` writes into conntrack entries) and wall-clock time for
//! the API.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Time as a pass sees it.
pub trait Clock: Send + Sync {
    /// The kernel's monotonic clock in nanoseconds, as `bpf_ktime_get_ns()`
    /// reads it in the datapath.
    fn monotonic_nanos(&self) -> u64;
    /// Wall-clock Unix nanoseconds (reported times only).
    fn unix_nanos(&self) -> i64;
}

/// `CLOCK_MONOTONIC`, corrected for this process's time namespace.
///
/// `bpf_ktime_get_ns()` is the kernel's monotonic clock with no time
/// namespace offset; `clock_gettime(CLOCK_MONOTONIC)` in a time namespace adds
/// the namespace's offset. The offset is read once from
/// `/proc/self/timens_offsets` (absent on kernels without time namespaces:
/// no offset) and subtracted.
#[derive(Debug)]
pub struct KernelClock {
    offset_nanos: i64,
}

impl KernelClock {
    /// The clock with this process's time namespace offset.
    pub fn new() -> Self {
        let offset_nanos = std::fs::read_to_string("/proc/self/timens_offsets")
            .ok()
            .and_then(|text| monotonic_offset(&text))
            .unwrap_or(0);
        if offset_nanos != 0 {
            tracing::info!(
                offset_nanos,
                "time namespace: correcting CLOCK_MONOTONIC to the kernel's clock"
            );
        }
        Self { offset_nanos }
    }
}

impl Default for KernelClock {
    fn default() -> Self {
        Self::new()
    }
}

/// The `monotonic` line of `/proc/<pid>/timens_offsets` in nanoseconds.
fn monotonic_offset(text: &str) -> Option<i64> {
    text.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        if words.next()? != "monotonic" {
            return None;
        }
        let secs: i64 = words.next()?.parse().ok()?;
        let nanos: i64 = words.next()?.parse().ok()?;
        Some(secs.saturating_mul(1_000_000_000).saturating_add(nanos))
    })
}

/// `CLOCK_MONOTONIC` as this process reads it.
pub fn raw_monotonic_nanos() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

fn now_unix_nanos() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

impl Clock for KernelClock {
    fn monotonic_nanos(&self) -> u64 {
        raw_monotonic_nanos().saturating_add_signed(-self.offset_nanos)
    }

    fn unix_nanos(&self) -> i64 {
        now_unix_nanos()
    }
}

/// The kernel clock moved by an adjustable offset: tests make time pass
/// without waiting.
#[derive(Debug, Default)]
pub struct ShiftedClock {
    base: KernelClock,
    shift_nanos: AtomicI64,
}

impl ShiftedClock {
    /// The kernel clock, not shifted yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward (or back) by `nanos` more.
    pub fn advance(&self, nanos: i64) {
        self.shift_nanos.fetch_add(nanos, Ordering::SeqCst);
    }
}

impl Clock for ShiftedClock {
    fn monotonic_nanos(&self) -> u64 {
        self.base
            .monotonic_nanos()
            .saturating_add_signed(self.shift_nanos.load(Ordering::SeqCst))
    }

    fn unix_nanos(&self) -> i64 {
        self.base
            .unix_nanos()
            .saturating_add(self.shift_nanos.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timens_offsets_are_parsed() {
        let text = "monotonic           5         20\nboottime            7         0\n";
        assert_eq!(monotonic_offset(text), Some(5_000_000_020));
        assert_eq!(monotonic_offset("monotonic -3 0\n"), Some(-3_000_000_000));
        assert_eq!(monotonic_offset("boottime 1 0\n"), None);
    }

    #[test]
    fn kernel_clock_matches_clock_monotonic_outside_time_namespaces() {
        let clock = KernelClock::new();
        let a = raw_monotonic_nanos();
        let b = clock.monotonic_nanos();
        // This test process is in the initial time namespace.
        assert!(b >= a && b - a < 1_000_000_000, "{a} vs {b}");
    }

    #[test]
    fn shifted_clock_moves() {
        let clock = ShiftedClock::new();
        let before = clock.monotonic_nanos();
        clock.advance(3_600_000_000_000);
        assert!(clock.monotonic_nanos() >= before + 3_600_000_000_000);
    }
}
