//! `rivet health`: the connectivity matrix svc-health measures between this
//! node and every peer node (ICMP and HTTP to the peer's underlay addresses,
//! HTTP to its health endpoint through the pod datapath), and the one-line
//! summary `rivet status` shows.

use clap::Args;
use rivet_proto::health::v1 as pb;
use rivet_proto::health::v1::health_service_client::HealthServiceClient;
use rivet_proto::net::format_address;
use serde::Serialize;

use crate::table::Table;
use crate::{CliError, Context, age, duration, now_unix_nanos, truncate};

/// The daemon asked.
pub const DAEMON: &str = "svc-health";

/// Widest LAST FAILURE cell.
const FAILURE_WIDTH: usize = 60;

/// `rivet health`
#[derive(Debug, Args)]
pub struct HealthArgs {
    /// Wait (up to --timeout) until a probe round numbered above this one has completed (`round` in the
    /// output): `--after-round N` shows results measured after round N.
    #[arg(long, default_value_t = 0)]
    pub after_round: u64,
}

/// One probe of a peer.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ProbeView {
    /// `icmp_node`, `http_node`, `http_health_endpoint`.
    pub probe: String,
    /// The address probed.
    pub address: String,
    /// `reachable`, `unreachable`, `unknown`.
    pub status: String,
    /// Round trip of the last success, nanoseconds.
    pub latency_nanos: Option<u64>,
    /// Unix nanoseconds of the last success.
    pub last_success_unix_nanos: Option<u64>,
    /// Unix nanoseconds of the last failure.
    pub last_failure_unix_nanos: Option<u64>,
    /// `timeout`, `refused`, `no_route`, `bad_response`, `socket`.
    pub last_failure_kind: Option<String>,
    /// The last failure, for people.
    pub last_failure: Option<String>,
    /// Failures since the last success.
    pub consecutive_failures: u32,
    /// The round that probed it last.
    pub round: u64,
}

/// One peer node.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PeerView {
    /// The node's name.
    pub name: String,
    /// Every probe answered in the last round.
    pub reachable: bool,
    /// Since when (Unix nanoseconds).
    pub since_unix_nanos: Option<u64>,
    /// Its probes.
    pub probes: Vec<ProbeView>,
}

/// What `rivet health` shows.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct HealthView {
    /// This node.
    pub node: String,
    /// Where this node serves /hello.
    pub node_addresses: Vec<String>,
    /// This node's health endpoint addresses.
    pub health_addresses: Vec<String>,
    /// Peers.
    pub peers: usize,
    /// Reachable peers.
    pub peers_reachable: usize,
    /// The last completed round (0: none yet).
    pub round: u64,
    /// When it finished (Unix nanoseconds).
    pub round_finished_unix_nanos: Option<u64>,
    /// The probe interval, nanoseconds.
    pub probe_interval_nanos: u64,
    /// The probe timeout, nanoseconds.
    pub probe_timeout_nanos: u64,
    /// Why the peers could not be listed in the last round.
    pub peers_error: Option<String>,
    /// Per peer.
    pub peer_health: Vec<PeerView>,
    /// svc-health's boot id.
    pub boot_id: String,
}

fn nonzero(v: u64) -> Option<u64> {
    (v != 0).then_some(v)
}

fn nonempty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

fn kind_name(k: i32) -> String {
    match pb::ProbeKind::try_from(k) {
        Ok(pb::ProbeKind::IcmpNode) => "icmp_node",
        Ok(pb::ProbeKind::HttpNode) => "http_node",
        Ok(pb::ProbeKind::HttpHealthEndpoint) => "http_health_endpoint",
        _ => "unknown",
    }
    .into()
}

fn status_name(s: i32) -> String {
    match pb::ProbeStatus::try_from(s) {
        Ok(pb::ProbeStatus::Reachable) => "reachable",
        Ok(pb::ProbeStatus::Unreachable) => "unreachable",
        _ => "unknown",
    }
    .into()
}

fn failure_name(k: i32) -> Option<String> {
    let name = match pb::FailureKind::try_from(k).ok()? {
        pb::FailureKind::Unspecified => return None,
        pb::FailureKind::Timeout => "timeout",
        pb::FailureKind::Refused => "refused",
        pb::FailureKind::NoRoute => "no_route",
        pb::FailureKind::BadResponse => "bad_response",
        pb::FailureKind::Socket => "socket",
    };
    Some(name.into())
}

impl From<&pb::GetHealthResponse> for HealthView {
    fn from(r: &pb::GetHealthResponse) -> Self {
        let local = r.local.clone().unwrap_or_default();
        Self {
            node: local.node_name,
            node_addresses: local.node_addresses.iter().map(|a| format_address(a)).collect(),
            health_addresses: local.health_addresses.iter().map(|a| format_address(a)).collect(),
            peers: local.peers as usize,
            peers_reachable: local.peers_reachable as usize,
            round: r.round,
            round_finished_unix_nanos: nonzero(r.round_finished_unix_nanos),
            probe_interval_nanos: r.probe_interval_nanos,
            probe_timeout_nanos: r.probe_timeout_nanos,
            peers_error: nonempty(&r.peers_error),
            peer_health: r
                .peers
                .iter()
                .map(|p| PeerView {
                    name: p.name.clone(),
                    reachable: p.reachable,
                    since_unix_nanos: nonzero(p.since_unix_nanos),
                    probes: p
                        .probes
                        .iter()
                        .map(|x| ProbeView {
                            probe: kind_name(x.kind),
                            address: format_address(&x.address),
                            status: status_name(x.status),
                            latency_nanos: nonzero(x.latency_nanos),
                            last_success_unix_nanos: nonzero(x.last_success_unix_nanos),
                            last_failure_unix_nanos: nonzero(x.last_failure_unix_nanos),
                            last_failure_kind: failure_name(x.last_failure_kind),
                            last_failure: nonempty(&x.last_failure),
                            consecutive_failures: x.consecutive_failures,
                            round: x.round,
                        })
                        .collect(),
                })
                .collect(),
            boot_id: r.boot_id.clone(),
        }
    }
}

impl HealthView {
    /// The line `rivet status` shows: `health: 2/2 nodes reachable`, or
    /// which are not (`health: 1/2 nodes reachable; unreachable: n3`).
    pub fn summary_line(&self) -> String {
        if self.round == 0 {
            return "health: no probe round completed yet".into();
        }
        let mut line = format!("health: {}/{} nodes reachable", self.peers_reachable, self.peers);
        let unreachable: Vec<&str> = self
            .peer_health
            .iter()
            .filter(|p| !p.reachable)
            .map(|p| p.name.as_str())
            .collect();
        if !unreachable.is_empty() {
            line.push_str(&format!("; unreachable: {}", unreachable.join(", ")));
        }
        if let Some(error) = &self.peers_error {
            line.push_str(&format!("; peers not listed: {}", truncate(error, FAILURE_WIDTH)));
        }
        line
    }

    /// The matrix as a table, with times relative to `now` (Unix nanoseconds).
    pub fn render(&self, now: i64) -> String {
        let ago = |t: Option<u64>| age(now, t.map_or(0, |t| i64::try_from(t).unwrap_or(i64::MAX)));
        let mut out = format!(
            "node {} ({}), round {} finished {} ago, interval {}, timeout {}\n{}\n",
            if self.node.is_empty() { "-" } else { &self.node },
            if self.node_addresses.is_empty() {
                "/hello on every address".to_string()
            } else {
                self.node_addresses.join(", ")
            },
            self.round,
            ago(self.round_finished_unix_nanos),
            duration(self.probe_interval_nanos),
            duration(self.probe_timeout_nanos),
            self.summary_line(),
        );
        if self.peer_health.is_empty() {
            out.push_str("no peer nodes\n");
            return out;
        }
        let mut t = Table::new([
            "PEER",
            "PROBE",
            "ADDRESS",
            "STATUS",
            "LATENCY",
            "FAILURES",
            "LAST FAILURE",
        ]);
        for peer in &self.peer_health {
            for (i, p) in peer.probes.iter().enumerate() {
                t.row([
                    if i == 0 {
                        format!("{} ({})", peer.name, if peer.reachable { "up" } else { "DOWN" })
                    } else {
                        String::new()
                    },
                    p.probe.clone(),
                    p.address.clone(),
                    p.status.clone(),
                    p.latency_nanos.map_or("-".into(), duration),
                    p.consecutive_failures.to_string(),
                    match (&p.last_failure, &p.last_failure_kind) {
                        (Some(f), kind) => format!(
                            "{} ago, {}: {}",
                            ago(p.last_failure_unix_nanos),
                            kind.as_deref().unwrap_or("-"),
                            truncate(f, FAILURE_WIDTH)
                        ),
                        (None, _) => "-".into(),
                    },
                ]);
            }
        }
        out.push_str(&t.render());
        out
    }
}

/// svc-health's results (after round `after_round`, when not 0).
pub async fn fetch(ctx: &Context, after_round: u64) -> Result<pb::GetHealthResponse, CliError> {
    let channel = ctx.connect_with_deadline(DAEMON).await?;
    let response = HealthServiceClient::new(channel)
        .get_health(ctx.request(pb::GetHealthRequest { after_round }))
        .await
        .map_err(|s| CliError::rpc(DAEMON, s))?;
    Ok(response.into_inner())
}

/// `rivet health`.
pub async fn run(ctx: &Context, args: HealthArgs) -> Result<(), CliError> {
    let view = HealthView::from(&fetch(ctx, args.after_round).await?);
    ctx.print(&view, || view.render(now_unix_nanos()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rivet_proto::net::address_bytes;

    const S: u64 = 1_000_000_000;

    fn probe(kind: pb::ProbeKind, address: &str, ok: bool) -> pb::ProbeResult {
        pb::ProbeResult {
            kind: kind.into(),
            address: address_bytes(address.parse().unwrap()),
            status: if ok {
                pb::ProbeStatus::Reachable
            } else {
                pb::ProbeStatus::Unreachable
            }
            .into(),
            latency_nanos: 180_000,
            last_success_unix_nanos: 90 * S,
            last_failure_unix_nanos: if ok { 0 } else { 99 * S },
            last_failure_kind: if ok {
                pb::FailureKind::Unspecified
            } else {
                pb::FailureKind::Timeout
            }
            .into(),
            last_failure: if ok {
                String::new()
            } else {
                "no echo reply from 198.19.254.3 within 500ms".into()
            },
            consecutive_failures: u32::from(!ok) * 2,
            round: 7,
        }
    }

    fn response() -> pb::GetHealthResponse {
        pb::GetHealthResponse {
            peers: vec![
                pb::PeerHealth {
                    name: "c-n2".into(),
                    reachable: true,
                    probes: vec![
                        probe(pb::ProbeKind::IcmpNode, "198.19.254.2", true),
                        probe(pb::ProbeKind::HttpNode, "198.19.254.2", true),
                    ],
                    since_unix_nanos: 10 * S,
                },
                pb::PeerHealth {
                    name: "c-n3".into(),
                    reachable: false,
                    probes: vec![
                        probe(pb::ProbeKind::IcmpNode, "198.19.254.3", false),
                        probe(pb::ProbeKind::HttpNode, "198.19.254.3", true),
                    ],
                    since_unix_nanos: 99 * S,
                },
            ],
            local: Some(pb::LocalHealth {
                node_name: "c-n1".into(),
                node_addresses: vec![address_bytes("198.19.254.1".parse().unwrap())],
                health_addresses: vec![],
                peers: 2,
                peers_reachable: 1,
            }),
            round: 7,
            round_started_unix_nanos: 99 * S,
            round_finished_unix_nanos: 99 * S + 500_000_000,
            probe_interval_nanos: S,
            probe_timeout_nanos: S / 2,
            peers_error: String::new(),
            boot_id: "b".into(),
        }
    }

    #[test]
    fn the_summary_names_the_unreachable_nodes() {
        let view = HealthView::from(&response());
        assert_eq!(view.summary_line(), "health: 1/2 nodes reachable; unreachable: c-n3");
        let mut all_up = response();
        all_up.peers.pop();
        all_up.local.as_mut().unwrap().peers = 1;
        assert_eq!(HealthView::from(&all_up).summary_line(), "health: 1/1 nodes reachable");
        let none = pb::GetHealthResponse::default();
        assert_eq!(
            HealthView::from(&none).summary_line(),
            "health: no probe round completed yet"
        );
    }

    #[test]
    fn the_matrix_shows_latency_and_the_last_failure() {
        let text = HealthView::from(&response()).render(i64::try_from(100 * S).unwrap());
        assert!(
            text.starts_with("node c-n1 (198.19.254.1), round 7 finished 500ms ago"),
            "{text}"
        );
        assert!(text.contains("c-n2 (up)"), "{text}");
        assert!(text.contains("c-n3 (DOWN)"), "{text}");
        assert!(text.contains("180µs"), "{text}");
        assert!(
            text.contains("1s ago, timeout: no echo reply from 198.19.254.3 within 500ms"),
            "{text}"
        );
        let json = serde_json::to_value(HealthView::from(&response())).unwrap();
        assert_eq!(json["peer_health"][1]["probes"][0]["last_failure_kind"], "timeout");
        assert_eq!(json["peer_health"][0]["probes"][0]["address"], "198.19.254.2");
    }
}
