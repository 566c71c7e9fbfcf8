//! svc-health's telemetry: each named event writes its log line and updates
//! its metrics in one place, so logs and metrics never disagree.
//!
//! - `rivet_health_peer_reachable{peer,probe}`: 1 while every target of that
//!   probe kind of the peer answered in the last round, else 0 (series of a
//!   peer that left are removed);
//! - `rivet_health_probe_latency_seconds{probe}`: round trips of successful
//!   probes;
//! - `rivet_health_probe_failures_total{probe,kind}`: failed probes by kind;
//! - `rivet_health_peer_changes_total{state}`: peers that became `reachable`
//!   or `unreachable` or `left` (each also one log line);
//! - `rivet_health_rounds_total`, `rivet_health_peers`,
//!   `rivet_health_peers_reachable`.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::probe::{ProbeKind, ProbeOutcome, Target};
use crate::table::{HealthTable, TargetStatus, Transition};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerProbeLabels {
    peer: String,
    probe: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProbeLabels {
    probe: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabels {
    probe: &'static str,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

/// The metrics of svc-health (`rivet_health_*`).
#[derive(Clone, Debug)]
pub struct HealthMetrics {
    peer_reachable: Family<PeerProbeLabels, Gauge>,
    latency: Family<ProbeLabels, Histogram>,
    failures: Family<FailureLabels, Counter>,
    changes: Family<StateLabels, Counter>,
    rounds: Counter,
    peers: Gauge,
    peers_reachable: Gauge,
    round_seconds: Gauge<f64, AtomicU64>,
}

impl Default for HealthMetrics {
    fn default() -> Self {
        Self {
            peer_reachable: Family::default(),
            // 50 µs .. ~1.6 s.
            latency: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.000_05, 2.0, 16))),
            failures: Family::default(),
            changes: Family::default(),
            rounds: Counter::default(),
            peers: Gauge::default(),
            peers_reachable: Gauge::default(),
            round_seconds: Gauge::default(),
        }
    }
}

impl HealthMetrics {
    /// Registers every metric under `registry` (prefix it with `rivet`).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("health");
        r.register(
            "peer_reachable",
            "1 while every target of this probe kind of the peer answered in the last round",
            self.peer_reachable.clone(),
        );
        r.register(
            "probe_latency_seconds",
            "Round trip of successful probes, per probe kind",
            self.latency.clone(),
        );
        r.register(
            "probe_failures",
            "Failed probes, per probe kind and failure kind",
            self.failures.clone(),
        );
        r.register(
            "peer_changes",
            "Peers that became reachable, unreachable, or left the cluster",
            self.changes.clone(),
        );
        r.register("rounds", "Completed probe rounds", self.rounds.clone());
        r.register("peers", "Peer nodes probed in the last round", self.peers.clone());
        r.register(
            "peers_reachable",
            "Peer nodes whose every probe answered in the last round",
            self.peers_reachable.clone(),
        );
        r.register(
            "round_duration_seconds",
            "Duration of the last probe round (listing the peers and every probe)",
            self.round_seconds.clone(),
        );
    }

    /// The event of a completed round: the probes' metrics, one log line
    /// (and counter) per changed peer, the gauges of `table`.
    pub fn round_completed(
        &self,
        table: &HealthTable,
        outcomes: &[(String, Target, ProbeOutcome)],
        transitions: &[Transition],
        took: std::time::Duration,
    ) {
        self.rounds.inc();
        self.round_seconds.set(took.as_secs_f64());
        for (peer, target, outcome) in outcomes {
            let probe = target.kind.as_str();
            match outcome {
                Ok(latency) => self
                    .latency
                    .get_or_create(&ProbeLabels { probe })
                    .observe(latency.as_secs_f64()),
                Err(failure) => {
                    self.failures
                        .get_or_create(&FailureLabels {
                            probe,
                            kind: failure.kind.as_str(),
                        })
                        .inc();
                    tracing::debug!(peer, probe, address = %target.address, kind = failure.kind.as_str(), "probe failed: {failure}");
                }
            }
        }
        for transition in transitions {
            match transition {
                Transition::Reachable { peer } => {
                    self.changes.get_or_create(&StateLabels { state: "reachable" }).inc();
                    tracing::info!(peer, "peer node reachable: every probe answered");
                }
                Transition::Unreachable { peer, failures } => {
                    self.changes.get_or_create(&StateLabels { state: "unreachable" }).inc();
                    let failed: Vec<String> = failures
                        .iter()
                        .map(|(t, f)| format!("{} {}: {} ({})", t.kind, t.address, f.message, f.kind.as_str()))
                        .collect();
                    tracing::warn!(peer, failed = %failed.join("; "), "peer node unreachable");
                }
                Transition::Left { peer } => {
                    self.changes.get_or_create(&StateLabels { state: "left" }).inc();
                    for kind in ProbeKind::ALL {
                        self.peer_reachable.remove(&PeerProbeLabels {
                            peer: peer.clone(),
                            probe: kind.as_str(),
                        });
                    }
                    tracing::info!(peer, "peer node left the cluster: no longer probed");
                }
            }
        }
        for (peer, row) in &table.peers {
            for kind in ProbeKind::ALL {
                let mut of_kind = row.targets.iter().filter(|(t, _)| t.kind == kind).peekable();
                let labels = PeerProbeLabels {
                    peer: peer.clone(),
                    probe: kind.as_str(),
                };
                if of_kind.peek().is_none() {
                    self.peer_reachable.remove(&labels);
                    continue;
                }
                let up = of_kind.all(|(_, s)| s.status == TargetStatus::Reachable && s.round == table.round);
                self.peer_reachable.get_or_create(&labels).set(i64::from(up));
            }
        }
        let (peers, reachable) = table.summary();
        self.peers.set(i64::try_from(peers).unwrap_or(i64::MAX));
        self.peers_reachable.set(i64::try_from(reachable).unwrap_or(i64::MAX));
    }
}
