//! `rivet.health.v1.HealthService` over the [`Prober`].

use std::time::{Duration, SystemTime};

use rivet_common::grpc::{BootId, status_with_reason};
use rivet_proto::health::v1 as pb;
use rivet_proto::net::address_bytes;
use tonic::{Code, Request, Response, Status};

use crate::probe::{FailureKind, ProbeKind};
use crate::prober::{HealthSnapshot, Prober, WaitError};
use crate::table::{TargetState, TargetStatus};

/// How long `GetHealth` waits for a round when the call carries no deadline.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(60);

/// The gRPC service.
#[derive(Clone, Debug)]
pub struct HealthService {
    prober: Prober,
    boot_id: BootId,
}

impl HealthService {
    /// Serves `prober`'s results.
    pub fn new(prober: Prober, boot_id: BootId) -> Self {
        Self { prober, boot_id }
    }

    /// The tonic server.
    pub fn into_server(self) -> pb::health_service_server::HealthServiceServer<Self> {
        pb::health_service_server::HealthServiceServer::new(self)
    }
}

fn unix_nanos(t: Option<SystemTime>) -> u64 {
    t.and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn kind_proto(k: ProbeKind) -> pb::ProbeKind {
    match k {
        ProbeKind::IcmpNode => pb::ProbeKind::IcmpNode,
        ProbeKind::HttpNode => pb::ProbeKind::HttpNode,
        ProbeKind::HttpHealthEndpoint => pb::ProbeKind::HttpHealthEndpoint,
    }
}

fn failure_proto(k: FailureKind) -> pb::FailureKind {
    match k {
        FailureKind::Timeout => pb::FailureKind::Timeout,
        FailureKind::Refused => pb::FailureKind::Refused,
        FailureKind::NoRoute => pb::FailureKind::NoRoute,
        FailureKind::BadResponse => pb::FailureKind::BadResponse,
        FailureKind::Socket => pb::FailureKind::Socket,
    }
}

fn probe_proto(target: &crate::probe::Target, s: &TargetState) -> pb::ProbeResult {
    let status = match s.status {
        TargetStatus::Unknown => pb::ProbeStatus::Unknown,
        TargetStatus::Reachable => pb::ProbeStatus::Reachable,
        TargetStatus::Unreachable => pb::ProbeStatus::Unreachable,
    };
    let (failed_at, failure) = match &s.last_failure {
        Some((at, f)) => (Some(*at), Some(f)),
        None => (None, None),
    };
    pb::ProbeResult {
        kind: kind_proto(target.kind).into(),
        address: address_bytes(target.address),
        status: status.into(),
        latency_nanos: s.latency.map_or(0, nanos),
        last_success_unix_nanos: unix_nanos(s.last_success),
        last_failure_unix_nanos: unix_nanos(failed_at),
        last_failure_kind: failure
            .map_or(pb::FailureKind::Unspecified, |f| failure_proto(f.kind))
            .into(),
        last_failure: failure.map(|f| f.message.clone()).unwrap_or_default(),
        consecutive_failures: s.consecutive_failures,
        round: s.round,
    }
}

/// The results as the API shows them.
pub fn health_proto(s: &HealthSnapshot, boot_id: &str) -> pb::GetHealthResponse {
    let table = &s.table;
    let (peers, reachable) = table.summary();
    pb::GetHealthResponse {
        peers: table
            .peers
            .iter()
            .map(|(name, row)| pb::PeerHealth {
                name: name.clone(),
                reachable: row.reachable == Some(true),
                probes: row.targets.iter().map(|(t, st)| probe_proto(t, st)).collect(),
                since_unix_nanos: unix_nanos(row.since),
            })
            .collect(),
        local: Some(pb::LocalHealth {
            node_name: s.local.name.clone(),
            node_addresses: s.local.node_addresses.iter().copied().map(address_bytes).collect(),
            health_addresses: s.local_health.iter().copied().map(address_bytes).collect(),
            peers: u32::try_from(peers).unwrap_or(u32::MAX),
            peers_reachable: u32::try_from(reachable).unwrap_or(u32::MAX),
        }),
        round: table.round,
        round_started_unix_nanos: unix_nanos(table.round_times.map(|t| t.0)),
        round_finished_unix_nanos: unix_nanos(table.round_times.map(|t| t.1)),
        probe_interval_nanos: nanos(s.options.interval),
        probe_timeout_nanos: nanos(s.options.timeout),
        peers_error: table.peers_error.clone().unwrap_or_default(),
        boot_id: boot_id.to_owned(),
    }
}

#[tonic::async_trait]
impl pb::health_service_server::HealthService for HealthService {
    #[tracing::instrument(name = "get_health", skip_all)]
    async fn get_health(
        &self,
        request: Request<pb::GetHealthRequest>,
    ) -> Result<Response<pb::GetHealthResponse>, Status> {
        let deadline = rivet_common::grpc::request_deadline(&request, DEFAULT_DEADLINE);
        let after = request.get_ref().after_round;
        if after > 0 {
            self.prober.wait_for_round(after, deadline).await.map_err(|e| {
                let (code, reason) = match e {
                    WaitError::Pending { .. } => (Code::DeadlineExceeded, pb::ErrorReason::RoundPending),
                    WaitError::Stopped => (Code::Unavailable, pb::ErrorReason::ProberStopped),
                };
                status_with_reason(code, e.to_string(), reason)
            })?;
        }
        Ok(Response::new(health_proto(
            &self.prober.snapshot(),
            self.boot_id.as_str(),
        )))
    }
}
