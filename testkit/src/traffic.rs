//! Traffic that proves a promise of no loss: [`Pinger`], a flood ping from
//! one network namespace to an address, counted in back-to-back runs so a
//! test can stop it without counting in-flight requests as lost.
//!
//! Not a benchmark (rivet-bench measures throughput): a pinger only counts
//! what was sent and what came back.

use std::net::IpAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Echo requests per `ping` run of a [`Pinger`]. `-i 0.0002` is below
/// iputils' 1 ms resolution and becomes 0: each request leaves as soon as
/// the previous reply is back (150 000-200 000 per second on a local veth),
/// so a request is in flight nearly all the time and any window in which
/// the datapath drops pod traffic for more than a few microseconds loses
/// one. 20 000 take 0.1-0.2 s locally, longer across nodes.
pub const PING_BATCH: u32 = 20_000;

/// The interval of a flood ([`Pinger::start`]): `-i 0.0002`, which iputils
/// rounds to 0.
pub const FLOOD: Duration = Duration::from_micros(200);

/// What the pings of a [`Pinger`] saw.
#[derive(Debug, Default, Clone, Copy)]
pub struct PingTotals {
    /// Echo requests sent.
    pub transmitted: u64,
    /// Echo replies received.
    pub received: u64,
    /// From the start to the stop.
    pub elapsed: Duration,
}

impl PingTotals {
    /// Requests without a reply.
    pub fn lost(&self) -> u64 {
        self.transmitted - self.received
    }
}

/// Completed runs, their totals, and whether the pinger ended (failed or
/// stopped).
#[derive(Default)]
struct Progress {
    runs: u64,
    totals: PingTotals,
    ended: bool,
}

/// A flood ping (`ping -i 0.0002`, [`PING_BATCH`] requests per run) from a
/// network namespace to an address (IPv4 or IPv6), in a background thread,
/// as back-to-back `ping -c` runs. Stops on drop.
pub struct Pinger {
    stop: Arc<AtomicBool>,
    progress: Arc<(Mutex<Progress>, Condvar)>,
    thread: Option<JoinHandle<Result<PingTotals, String>>>,
}

impl Pinger {
    /// Starts pinging `dst` from namespace `netns` (a name under
    /// /run/netns), [`PING_BATCH`] requests per run.
    pub fn start(netns: &str, dst: IpAddr) -> Self {
        Self::with_batch(netns, dst, PING_BATCH)
    }

    /// The same with `batch` requests per run.
    pub fn with_batch(netns: &str, dst: IpAddr, batch: u32) -> Self {
        Self::with_interval(netns, dst, batch, FLOOD)
    }

    /// `batch` requests per run, one every `interval` (iputils' resolution
    /// is 1 ms; [`FLOOD`] sends each as the previous reply arrives): a
    /// steady stream that leaves the CPU to others, for long runs.
    pub fn with_interval(netns: &str, dst: IpAddr, batch: u32, interval: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new((Mutex::new(Progress::default()), Condvar::new()));
        let thread = {
            let (stop, progress) = (stop.clone(), progress.clone());
            let (netns, dst) = (netns.to_owned(), dst.to_string());
            std::thread::spawn(move || {
                let result = ping_runs(&netns, &dst, batch, interval, &stop, &progress.0, &progress.1);
                progress.0.lock().unwrap().ended = true;
                progress.1.notify_all();
                result
            })
        };
        Self {
            stop,
            progress,
            thread: Some(thread),
        }
    }

    /// Waits until `n` more ping runs completed (so traffic covered what
    /// happened before this call), or the ping failed ([`stop`](Self::stop)
    /// says why); panics after `timeout`.
    pub fn wait_runs(&self, n: u64, timeout: Duration) {
        let (progress, changed) = &*self.progress;
        let mut now = progress.lock().unwrap();
        let target = now.runs + n;
        let deadline = Instant::now() + timeout;
        while now.runs < target && !now.ended {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "the flood ping completed {} of {target} runs within {timeout:?}",
                now.runs
            );
            now = changed.wait_timeout(now, left).unwrap().0;
        }
    }

    /// What the runs completed so far saw (a run in flight is not counted).
    pub fn totals(&self) -> PingTotals {
        self.progress.0.lock().unwrap().totals
    }

    /// Stops after the run in flight; what every run saw. Panics if a run
    /// failed or nothing was sent.
    pub fn stop(mut self) -> PingTotals {
        self.stop.store(true, Ordering::SeqCst);
        let totals = self
            .thread
            .take()
            .expect("stopped once")
            .join()
            .expect("the ping thread does not panic")
            .unwrap_or_else(|e| panic!("the flood ping failed: {e}"));
        assert!(totals.transmitted > 0, "the flood ping sent nothing");
        totals
    }
}

impl Drop for Pinger {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// `ping -c batch` runs until `stop`, each counted in `progress`.
fn ping_runs(
    netns: &str,
    dst: &str,
    batch: u32,
    interval: Duration,
    stop: &AtomicBool,
    progress: &Mutex<Progress>,
    changed: &Condvar,
) -> Result<PingTotals, String> {
    let started = Instant::now();
    let mut totals = PingTotals::default();
    let family = if dst.contains(':') { "-6" } else { "-4" };
    while !stop.load(Ordering::SeqCst) {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                netns,
                "ping",
                family,
                "-n",
                "-q",
                "-i",
                &format!("{:.4}", interval.as_secs_f64()),
                "-W",
                "1",
                "-c",
            ])
            .args([batch.to_string().as_str(), dst])
            .env("LC_ALL", "C")
            .output()
            .map_err(|e| format!("running ping in {netns}: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let (sent, received) = parse_ping(&text).ok_or_else(|| {
            format!(
                "unexpected output of ping {dst} in {netns}: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
        totals.transmitted += sent;
        totals.received += received;
        totals.elapsed = started.elapsed();
        let mut now = progress.lock().unwrap();
        now.runs += 1;
        now.totals = totals;
        drop(now);
        changed.notify_all();
    }
    totals.elapsed = started.elapsed();
    Ok(totals)
}

/// `N packets transmitted, M received` of ping's summary.
pub fn parse_ping(text: &str) -> Option<(u64, u64)> {
    let line = text.lines().find(|l| l.contains("packets transmitted"))?;
    let mut numbers = line
        .split(',')
        .map(|part| part.split_whitespace().next()?.parse::<u64>().ok());
    Some((numbers.next()??, numbers.next()??))
}

#[cfg(test)]
mod tests {
    use super::parse_ping;

    #[test]
    fn parses_the_summary_of_iputils_ping() {
        let text = "--- 198.18.2.3 ping statistics ---\n\
                    20000 packets transmitted, 19998 received, 0.01% packet loss, time 143ms\n";
        assert_eq!(parse_ping(text), Some((20_000, 19_998)));
        assert_eq!(parse_ping("ping: connect: Network is unreachable\n"), None);
    }
}
