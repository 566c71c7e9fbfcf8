//! `rivet.gc.v1.GcService` over the [`Collector`].

use std::time::Duration;

use rivet_common::grpc::{BootId, status_with_reason};
use rivet_proto::gc::v1 as pb;
use tonic::{Code, Request, Response, Status};

use crate::classify::Timeouts;
use crate::collector::{Collector, CollectorStatus, RunNowError};
use crate::pass::PassError;
use crate::pass::{DeletedCounts, MapReport, OrphanCheck, PassReport, Trigger};

/// How long RunNow waits when the call carries no deadline.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(60);

/// The gRPC service.
#[derive(Clone, Debug)]
pub struct GcService {
    collector: Collector,
    boot_id: BootId,
}

impl GcService {
    /// Serves `collector`'s passes and status.
    pub fn new(collector: Collector, boot_id: BootId) -> Self {
        Self { collector, boot_id }
    }

    /// The tonic server.
    pub fn into_server(self) -> pb::gc_service_server::GcServiceServer<Self> {
        pb::gc_service_server::GcServiceServer::new(self)
    }
}

/// The call's deadline (grpc-timeout) or the default.
fn deadline<T>(request: &Request<T>) -> Duration {
    rivet_common::grpc::request_deadline(request, DEFAULT_DEADLINE)
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn deleted_proto(d: &DeletedCounts) -> pb::DeletedCounts {
    pb::DeletedCounts {
        expired: d.expired,
        orphaned_endpoint: d.orphaned_endpoint,
        nat_without_connection: d.nat_without_connection,
        service_gone: d.service_gone,
    }
}

fn map_proto(m: &MapReport) -> pb::MapPassStats {
    pb::MapPassStats {
        map: m.map.clone(),
        scanned: m.scanned,
        deleted: Some(deleted_proto(&m.deleted)),
        spared_refreshed: m.spared_refreshed,
        remaining: m.remaining,
        max_entries: m.max_entries,
        batched: m.batched,
        duration_nanos: nanos(m.duration),
        error: m.error.clone().unwrap_or_default(),
    }
}

fn trigger_proto(t: Trigger) -> pb::PassTrigger {
    match t {
        Trigger::Initial => pb::PassTrigger::Initial,
        Trigger::Interval => pb::PassTrigger::Interval,
        Trigger::RunNow => pb::PassTrigger::RunNow,
        Trigger::MapPressure => pb::PassTrigger::MapPressure,
    }
}

fn orphan_proto(o: OrphanCheck) -> pb::OrphanCheck {
    match o {
        OrphanCheck::Done => pb::OrphanCheck::Done,
        OrphanCheck::SkippedListFailed => pb::OrphanCheck::SkippedListFailed,
        OrphanCheck::SkippedListEmpty => pb::OrphanCheck::SkippedListEmpty,
        OrphanCheck::SkippedRestoring => pb::OrphanCheck::SkippedRestoring,
    }
}

/// A pass as the API shows it.
pub fn pass_proto(p: &PassReport) -> pb::PassStats {
    pb::PassStats {
        pass_number: p.number,
        trigger: trigger_proto(p.trigger).into(),
        started_unix_nanos: p.started_unix_nanos,
        duration_nanos: nanos(p.duration),
        maps: p.maps.iter().map(map_proto).collect(),
        scanned: p.scanned,
        deleted: Some(deleted_proto(&p.deleted)),
        delete_ratio: p.delete_ratio,
        orphan_check: orphan_proto(p.orphan_check).into(),
    }
}

fn timeouts_proto(t: &Timeouts) -> pb::Timeouts {
    pb::Timeouts {
        tcp_syn_nanos: nanos(t.tcp_syn),
        tcp_established_nanos: nanos(t.tcp_established),
        tcp_closing_nanos: nanos(t.tcp_closing),
        udp_nanos: nanos(t.udp),
        icmp_nanos: nanos(t.icmp),
    }
}

/// The status as the API shows it.
pub fn status_proto(s: &CollectorStatus, boot_id: &str) -> pb::StatusResponse {
    pb::StatusResponse {
        last_pass: s.last_pass.as_ref().map(pass_proto),
        pass_running: s.pass_running,
        next_pass_unix_nanos: s.next_pass_unix_nanos,
        interval_nanos: nanos(s.interval),
        min_interval_nanos: nanos(s.bounds.min),
        max_interval_nanos: nanos(s.bounds.max),
        passes: s.passes,
        totals: s
            .totals
            .iter()
            .map(|(map, t)| pb::MapTotals {
                map: map.clone(),
                scanned: t.scanned,
                deleted: Some(deleted_proto(&t.deleted)),
                spared_refreshed: t.spared_refreshed,
            })
            .collect(),
        timeouts: Some(timeouts_proto(&s.timeouts)),
        boot_id: boot_id.to_owned(),
    }
}

#[tonic::async_trait]
impl pb::gc_service_server::GcService for GcService {
    #[tracing::instrument(name = "run_now", skip_all)]
    async fn run_now(&self, request: Request<pb::RunNowRequest>) -> Result<Response<pb::RunNowResponse>, Status> {
        let deadline = deadline(&request);
        match self.collector.run_now(deadline).await {
            Ok(pass) => Ok(Response::new(pb::RunNowResponse {
                pass: Some(pass_proto(&pass)),
                boot_id: self.boot_id.to_string(),
            })),
            Err(e) => {
                let (code, reason) = match &e {
                    RunNowError::Pass(PassError::Unavailable { .. }) => {
                        (Code::Unavailable, pb::ErrorReason::MapsUnavailable)
                    }
                    // A bug: nothing for a client to act on.
                    RunNowError::Pass(PassError::Panicked { .. }) => return Err(Status::internal(e.to_string())),
                    RunNowError::DeadlineExceeded(_) => (Code::DeadlineExceeded, pb::ErrorReason::PassContinues),
                    RunNowError::Stopped => (Code::Unavailable, pb::ErrorReason::CollectorStopped),
                };
                Err(status_with_reason(code, e.to_string(), reason))
            }
        }
    }

    async fn status(&self, _request: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        Ok(Response::new(status_proto(
            &self.collector.status(),
            self.boot_id.as_str(),
        )))
    }
}
