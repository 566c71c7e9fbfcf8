//! The C allocator's settings for a daemon process: few arenas and fixed
//! trim and mmap thresholds, so that memory a burst of calls freed goes back
//! to the kernel.
//!
//! glibc gives each thread that contends for the heap an arena of its own
//! (up to 8 per core) and raises its trim and mmap thresholds (up to 32 and
//! 64 MiB) every time a large block is freed. A daemon's tokio blocking pool
//! grows a thread per concurrent call (svc-loader ran 26 after 16 concurrent
//! CreateEndpoint callers), so after a burst each arena kept what it had
//! peaked at: at 1000 endpoints svc-loader held 21.6 MiB of anonymous memory
//! and the four node daemons 82.8 MiB of resident memory together; with
//! these settings 5.9 and 65.6 MiB (`cargo xtask bench endpoint`). The
//! daemons are mostly idle and serialise their work per endpoint, so two
//! arenas cost no measurable contention.
//!
//! Not for the CLI or the CNI plugin: short-lived processes gain nothing.

/// Arenas a daemon's allocator may use.
pub const ARENAS: i32 = 2;
/// Freed memory above the heap's top beyond this goes back to the kernel,
/// and blocks this large are mmapped on their own (returned when freed);
/// fixed, so glibc does not raise them after large frees (bytes).
pub const TRIM_AND_MMAP_THRESHOLD: i32 = 128 * 1024;

/// A setting glibc refused.
#[derive(Debug, thiserror::Error)]
#[error("the C allocator refused mallopt({name}, {value})")]
pub struct MalloptError {
    /// The parameter's name.
    pub name: &'static str,
    /// The value refused.
    pub value: i32,
}

/// Applies [`ARENAS`] and [`TRIM_AND_MMAP_THRESHOLD`]. Call it first in a
/// daemon's `main`, before any thread starts (arenas already handed out
/// stay). A platform whose C library is not glibc keeps its allocator as it
/// is.
pub fn tune_for_daemon() -> Result<(), MalloptError> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    for (name, param, value) in [
        ("M_ARENA_MAX", libc::M_ARENA_MAX, ARENAS),
        ("M_TRIM_THRESHOLD", libc::M_TRIM_THRESHOLD, TRIM_AND_MMAP_THRESHOLD),
        ("M_MMAP_THRESHOLD", libc::M_MMAP_THRESHOLD, TRIM_AND_MMAP_THRESHOLD),
    ] {
        // SAFETY: mallopt only sets allocator parameters; it returns 0 for a
        // parameter or value it refuses.
        if unsafe { libc::mallopt(param, value) } != 1 {
            return Err(MalloptError { name, value });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_takes_every_setting() {
        tune_for_daemon().expect("glibc accepts the daemon settings");
    }
}
