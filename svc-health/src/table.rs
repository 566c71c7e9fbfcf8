//! The health table: what every probe of every peer said last, kept across
//! rounds (latency of the last success, last failure, consecutive failures),
//! and the state changes a round makes ([`Transition`]). Pure: a round's
//! outcomes go in, the table and the transitions come out.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use crate::probe::{Peer, ProbeFailure, ProbeOutcome, Target};

/// The state of one target after the rounds so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetStatus {
    /// Not probed yet.
    Unknown,
    /// The last probe succeeded.
    Reachable,
    /// The last probe failed.
    Unreachable,
}

/// One target's history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetState {
    /// After the last probe.
    pub status: TargetStatus,
    /// Round trip of the last success.
    pub latency: Option<Duration>,
    /// When the last success was seen.
    pub last_success: Option<SystemTime>,
    /// When and why the last failure happened.
    pub last_failure: Option<(SystemTime, ProbeFailure)>,
    /// Failures since the last success.
    pub consecutive_failures: u32,
    /// The round that probed it last (0: none).
    pub round: u64,
}

impl TargetState {
    fn unknown() -> Self {
        Self {
            status: TargetStatus::Unknown,
            latency: None,
            last_success: None,
            last_failure: None,
            consecutive_failures: 0,
            round: 0,
        }
    }

    fn record(&mut self, round: u64, at: SystemTime, outcome: &ProbeOutcome) {
        self.round = round;
        match outcome {
            Ok(latency) => {
                self.status = TargetStatus::Reachable;
                self.latency = Some(*latency);
                self.last_success = Some(at);
                self.consecutive_failures = 0;
            }
            Err(failure) => {
                self.status = TargetStatus::Unreachable;
                self.last_failure = Some((at, failure.clone()));
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
            }
        }
    }
}

/// One peer's row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerState {
    /// Its targets, sorted.
    pub targets: BTreeMap<Target, TargetState>,
    /// Every target reachable in the last round (`None`: not probed yet).
    pub reachable: Option<bool>,
    /// When `reachable` last changed.
    pub since: Option<SystemTime>,
}

impl PeerState {
    /// The targets that failed in the last round.
    pub fn failing(&self) -> impl Iterator<Item = (&Target, &TargetState)> {
        self.targets
            .iter()
            .filter(|(_, s)| s.status == TargetStatus::Unreachable)
    }
}

/// What a round found: the peers (when they could be listed) and one
/// outcome per probed target.
#[derive(Clone, Debug)]
pub struct RoundReport {
    /// When the round started.
    pub started: SystemTime,
    /// When its last probe ended.
    pub finished: SystemTime,
    /// The peers listed for the round, or why they could not be (the
    /// table's peers are then probed again as they were).
    pub peers: Result<Vec<Peer>, String>,
    /// `(peer name, target, outcome)` for every probe run.
    pub outcomes: Vec<(String, Target, ProbeOutcome)>,
}

/// A change a round made to a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transition {
    /// Every probe of the peer succeeded, and before it had not (or it was
    /// new).
    Reachable {
        /// The peer.
        peer: String,
    },
    /// A probe of the peer failed, and before all had succeeded (or it was
    /// new).
    Unreachable {
        /// The peer.
        peer: String,
        /// The failed targets and why, for the log line.
        failures: Vec<(Target, ProbeFailure)>,
    },
    /// The peer is no longer listed (it left, or its lease expired).
    Left {
        /// The peer.
        peer: String,
    },
}

/// The health of every peer.
#[derive(Clone, Debug, Default)]
pub struct HealthTable {
    /// By peer name.
    pub peers: BTreeMap<String, PeerState>,
    /// The last completed round (0: none).
    pub round: u64,
    /// When the last round started and finished.
    pub round_times: Option<(SystemTime, SystemTime)>,
    /// Why the last round could not list the peers.
    pub peers_error: Option<String>,
    /// The peers of the last successful listing (probed again when a
    /// listing fails).
    pub listed: Vec<Peer>,
}

impl HealthTable {
    /// The peers the next round probes: the last listing's.
    pub fn listed_peers(&self) -> &[Peer] {
        &self.listed
    }

    /// Records a completed round; returns what changed, in peer order.
    pub fn apply(&mut self, report: RoundReport, targets_of: impl Fn(&Peer) -> Vec<Target>) -> Vec<Transition> {
        self.round += 1;
        let round = self.round;
        self.round_times = Some((report.started, report.finished));
        match report.peers {
            Ok(peers) => {
                self.listed = peers;
                self.peers_error = None;
            }
            Err(error) => self.peers_error = Some(error),
        }
        let mut transitions = Vec::new();

        // Peers no longer listed leave the table.
        let listed: std::collections::BTreeSet<&str> = self.listed.iter().map(|p| p.name.as_str()).collect();
        let gone: Vec<String> = self
            .peers
            .keys()
            .filter(|name| !listed.contains(name.as_str()))
            .cloned()
            .collect();
        for peer in gone {
            self.peers.remove(&peer);
            transitions.push(Transition::Left { peer });
        }

        // Targets follow the listing: new ones start unknown, old ones go.
        for peer in &self.listed {
            let row = self.peers.entry(peer.name.clone()).or_insert_with(|| PeerState {
                targets: BTreeMap::new(),
                reachable: None,
                since: None,
            });
            let wanted = targets_of(peer);
            row.targets.retain(|t, _| wanted.contains(t));
            for target in wanted {
                row.targets.entry(target).or_insert_with(TargetState::unknown);
            }
        }

        for (peer, target, outcome) in &report.outcomes {
            if let Some(state) = self.peers.get_mut(peer).and_then(|row| row.targets.get_mut(target)) {
                state.record(round, report.finished, outcome);
            }
        }

        for (name, row) in &mut self.peers {
            // Reachable: every target answered in this round. A peer with no
            // target at all (no address) cannot be reached.
            let probed_now = |s: &TargetState| s.round == round;
            let reachable = !row.targets.is_empty()
                && row
                    .targets
                    .values()
                    .all(|s| probed_now(s) && s.status == TargetStatus::Reachable);
            if row.reachable == Some(reachable) {
                continue;
            }
            row.reachable = Some(reachable);
            row.since = Some(report.finished);
            transitions.push(if reachable {
                Transition::Reachable { peer: name.clone() }
            } else {
                Transition::Unreachable {
                    peer: name.clone(),
                    failures: row
                        .failing()
                        .filter_map(|(t, s)| s.last_failure.as_ref().map(|(_, f)| (*t, f.clone())))
                        .collect(),
                }
            });
        }
        transitions
    }

    /// `(peers, reachable peers)`.
    pub fn summary(&self) -> (usize, usize) {
        let reachable = self.peers.values().filter(|p| p.reachable == Some(true)).count();
        (self.peers.len(), reachable)
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::probe::{FailureKind, ProbeKind};

    fn peer(name: &str, address: &str) -> Peer {
        Peer {
            name: name.into(),
            addresses: vec![address.parse().unwrap()],
            health_addresses: vec![],
        }
    }

    fn targets(p: &Peer) -> Vec<Target> {
        p.targets(&[])
    }

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    /// A round where every target of `peers` gets `outcome_of(peer, target)`.
    fn round(
        secs: u64,
        peers: Result<Vec<Peer>, String>,
        probed: &[Peer],
        outcome_of: impl Fn(&str, &Target) -> ProbeOutcome,
    ) -> RoundReport {
        let outcomes = probed
            .iter()
            .flat_map(|p| targets(p).into_iter().map(move |t| (p.name.clone(), t)))
            .map(|(name, t)| {
                let outcome = outcome_of(&name, &t);
                (name, t, outcome)
            })
            .collect();
        RoundReport {
            started: at(secs),
            finished: at(secs) + Duration::from_millis(10),
            peers,
            outcomes,
        }
    }

    fn ok(_: &str, _: &Target) -> ProbeOutcome {
        Ok(Duration::from_micros(150))
    }

    fn timeout() -> ProbeFailure {
        ProbeFailure::new(FailureKind::Timeout, "no answer in 500ms")
    }

    #[test]
    fn a_partition_and_its_recovery_are_one_transition_each() {
        let peers = vec![peer("n2", "198.19.254.2"), peer("n3", "198.19.254.3")];
        let mut table = HealthTable::default();

        let t = table.apply(round(1, Ok(peers.clone()), &peers, ok), targets);
        assert_eq!(
            t,
            vec![
                Transition::Reachable { peer: "n2".into() },
                Transition::Reachable { peer: "n3".into() }
            ]
        );
        assert_eq!(table.summary(), (2, 2));

        // n3's link goes down: its ICMP times out, its HTTP too.
        let down = |name: &str, _: &Target| {
            if name == "n3" {
                Err(timeout())
            } else {
                ok(name, &dummy())
            }
        };
        let t = table.apply(round(2, Ok(peers.clone()), &peers, down), targets);
        assert_eq!(t.len(), 1);
        let Transition::Unreachable { peer, failures } = &t[0] else {
            panic!("{t:?}")
        };
        assert_eq!(peer, "n3");
        assert_eq!(failures.len(), 2);
        assert_eq!(table.summary(), (2, 1));
        let n3 = &table.peers["n3"];
        assert_eq!(n3.since, Some(at(2) + Duration::from_millis(10)));
        for state in n3.targets.values() {
            assert_eq!(state.consecutive_failures, 1);
            assert_eq!(
                state.latency,
                Some(Duration::from_micros(150)),
                "the last success's latency stays"
            );
            assert_eq!(state.last_failure.as_ref().unwrap().1.kind, FailureKind::Timeout);
        }

        // Still down: no new transition, failures count up.
        let t = table.apply(round(3, Ok(peers.clone()), &peers, down), targets);
        assert!(t.is_empty());
        assert!(table.peers["n3"].targets.values().all(|s| s.consecutive_failures == 2));

        // Back.
        let t = table.apply(round(4, Ok(peers.clone()), &peers, ok), targets);
        assert_eq!(t, vec![Transition::Reachable { peer: "n3".into() }]);
        let n3 = &table.peers["n3"];
        assert!(
            n3.targets.values().all(|s| s.consecutive_failures == 0
                && s.status == TargetStatus::Reachable
                && s.last_failure.is_some())
        );
        assert_eq!(table.round, 4);
    }

    fn dummy() -> Target {
        Target {
            kind: ProbeKind::IcmpNode,
            address: IpAddr::from([0, 0, 0, 0]),
        }
    }

    #[test]
    fn one_failed_probe_kind_makes_a_peer_unreachable() {
        let peers = vec![peer("n2", "198.19.254.2")];
        let mut table = HealthTable::default();
        let http_refused = |_: &str, t: &Target| match t.kind {
            ProbeKind::HttpNode => Err(ProbeFailure::new(FailureKind::Refused, "connection refused")),
            _ => ok("", t),
        };
        let t = table.apply(round(1, Ok(peers.clone()), &peers, http_refused), targets);
        assert!(matches!(&t[..], [Transition::Unreachable { failures, .. }] if failures.len() == 1));
        let row = &table.peers["n2"];
        let icmp = row
            .targets
            .iter()
            .find(|(t, _)| t.kind == ProbeKind::IcmpNode)
            .unwrap()
            .1;
        assert_eq!(icmp.status, TargetStatus::Reachable);
    }

    #[test]
    fn peers_follow_the_listing_and_a_failed_listing_keeps_the_last() {
        let both = vec![peer("n2", "198.19.254.2"), peer("n3", "198.19.254.3")];
        let mut table = HealthTable::default();
        table.apply(round(1, Ok(both.clone()), &both, ok), targets);

        // The registry is down: the same peers are probed, the error is kept.
        let t = table.apply(round(2, Err("svc-identity: unavailable".into()), &both, ok), targets);
        assert!(t.is_empty());
        assert_eq!(table.peers_error.as_deref(), Some("svc-identity: unavailable"));
        assert_eq!(table.listed_peers().len(), 2);

        // n3 left the cluster; n2 moved to a new address.
        let now = vec![peer("n2", "198.19.254.22")];
        let t = table.apply(round(3, Ok(now.clone()), &now, ok), targets);
        assert_eq!(t, vec![Transition::Left { peer: "n3".into() }]);
        assert_eq!(table.peers_error, None);
        let n2 = &table.peers["n2"];
        assert!(
            n2.targets
                .keys()
                .all(|t| t.address == "198.19.254.22".parse::<IpAddr>().unwrap())
        );
        assert_eq!(n2.reachable, Some(true));
    }

    #[test]
    fn a_target_not_probed_in_the_round_is_not_reachable() {
        let peers = vec![peer("n2", "198.19.254.2")];
        let mut table = HealthTable::default();
        // The round listed n2 but ran no probe of it (it appeared during the round).
        let t = table.apply(round(1, Ok(peers.clone()), &[], ok), targets);
        assert!(matches!(&t[..], [Transition::Unreachable { failures, .. }] if failures.is_empty()));
        assert!(
            table.peers["n2"]
                .targets
                .values()
                .all(|s| s.status == TargetStatus::Unknown)
        );
    }
}
