//! `rivet monitor -o json` read by a test: [`DropMonitor`] collects the
//! drops a node's datapath reports ([`DropEvent`]), so a test can tell a drop
//! by the datapath (and its reason) from a timeout or a missing server.

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long [`NodeDrops::wait_for`] waits for a drop to show.
pub const DROP_SHOWN_WITHIN: Duration = Duration::from_secs(10);

/// A drop `rivet monitor -o json` printed.
#[derive(Debug, Clone)]
pub struct DropEvent {
    /// `policy-denied`, `invalid-source-address`, …
    pub reason: String,
    /// `tcp`, `udp`, `icmp`, …
    pub protocol: String,
    /// The dropped packet's source address.
    pub source: IpAddr,
    /// Its destination address and port.
    pub destination: SocketAddr,
}

impl DropEvent {
    /// A line of `rivet monitor -o json`, if it is a drop with addresses
    /// and ports.
    pub fn parse(line: &str) -> Option<Self> {
        let event: serde_json::Value = serde_json::from_str(line).ok()?;
        if event["type"] != "drop" {
            return None;
        }
        // "198.18.0.2:80", "2001:2::2:80": the port is after the last colon.
        let split = |field: &str| -> Option<(IpAddr, u16)> {
            let (ip, port) = event[field].as_str()?.rsplit_once(':')?;
            Some((ip.parse().ok()?, port.parse().ok()?))
        };
        let (source, _) = split("source")?;
        let (destination, port) = split("destination")?;
        Some(Self {
            reason: event["reason"].as_str()?.to_string(),
            protocol: event["protocol"].as_str()?.to_string(),
            source,
            destination: SocketAddr::new(destination, port),
        })
    }

    /// Whether policy dropped it (`policy-denied` or `policy-default-deny`).
    pub fn is_policy_drop(&self) -> bool {
        matches!(self.reason.as_str(), "policy-denied" | "policy-default-deny")
    }
}

/// One `rivet monitor -o json` and the threads reading its drops (into a
/// list shared with other monitors) and its stderr; killed on drop.
pub struct DropMonitor {
    child: Child,
    readers: Vec<JoinHandle<()>>,
}

impl DropMonitor {
    /// Starts `monitor`, a `rivet monitor -o json` command of some node,
    /// and returns once it is subscribed; its drops go to `drops`.
    pub fn start(mut monitor: Command, drops: &Arc<Mutex<Vec<DropEvent>>>) -> Self {
        let mut child = monitor
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning rivet monitor");
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (subscribed_tx, subscribed) = std::sync::mpsc::channel();
        // Ends with the process (its stderr closes).
        let stderr_reader = std::thread::spawn(move || {
            let mut text = String::new();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line == "rivet monitor: listening" {
                    let _ = subscribed_tx.send(Ok(()));
                }
                text.push_str(&line);
                text.push('\n');
            }
            let _ = subscribed_tx.send(Err(text));
        });
        let drops_reader = {
            let drops = Arc::clone(drops);
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if let Some(event) = DropEvent::parse(&line) {
                        drops.lock().unwrap().push(event);
                    }
                }
            })
        };
        let mut process = Self {
            child,
            readers: vec![drops_reader, stderr_reader],
        };
        match subscribed.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(())) => process,
            Ok(Err(stderr)) => {
                let status = process.child.wait();
                panic!("rivet monitor ended before subscribing ({status:?}): {stderr}")
            }
            Err(_) => panic!("rivet monitor did not subscribe within 30 s"),
        }
    }
}

impl Drop for DropMonitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
    }
}

/// The drops of one node's `rivet monitor -o json`, collected while it
/// runs (it ends with the node's svc-loader: start another after a restart).
pub struct NodeDrops {
    drops: Arc<Mutex<Vec<DropEvent>>>,
    _monitor: DropMonitor,
}

impl NodeDrops {
    /// Starts `monitor` (`rivet [--node N] monitor -o json`); returns once
    /// it is subscribed.
    pub fn start(monitor: Command) -> Self {
        let drops = Arc::new(Mutex::new(Vec::new()));
        let monitor = DropMonitor::start(monitor, &drops);
        Self {
            drops,
            _monitor: monitor,
        }
    }

    /// Every drop seen so far.
    pub fn all(&self) -> Vec<DropEvent> {
        self.drops.lock().unwrap().clone()
    }

    /// Drops from `source` to `destination` seen so far.
    pub fn of(&self, source: IpAddr, destination: SocketAddr) -> Vec<DropEvent> {
        self.drops
            .lock()
            .unwrap()
            .iter()
            .filter(|d| d.source == source && d.destination == destination)
            .cloned()
            .collect()
    }

    /// Drops of packets from or to any of `addrs` seen so far.
    pub fn involving(&self, addrs: &[IpAddr]) -> Vec<DropEvent> {
        self.drops
            .lock()
            .unwrap()
            .iter()
            .filter(|d| addrs.contains(&d.source) || addrs.contains(&d.destination.ip()))
            .cloned()
            .collect()
    }

    /// Waits until a drop from `source` to `destination` with `reason`
    /// shows up; panics naming `what` after [`DROP_SHOWN_WITHIN`].
    pub fn wait_for(&self, what: &str, reason: &str, source: IpAddr, destination: SocketAddr) {
        let started = Instant::now();
        while !self.of(source, destination).iter().any(|d| d.reason == reason) {
            assert!(
                started.elapsed() < DROP_SHOWN_WITHIN,
                "{what}: no {reason} drop of {source} -> {destination} in rivet monitor within \
                 {DROP_SHOWN_WITHIN:?}; drops of it: {:?}",
                self.of(source, destination)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
