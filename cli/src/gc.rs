//! `rivet gc status|run`: svc-gc's conntrack garbage collection.

use clap::Subcommand;
use rivet_proto::gc::v1 as pb;
use rivet_proto::gc::v1::gc_service_client::GcServiceClient;
use serde::Serialize;

use crate::table::Table;
use crate::{CliError, Context, age, duration, fields, now_unix_nanos, truncate};

const DAEMON: &str = "svc-gc";

/// Widest ERROR cell of a map.
const ERROR_WIDTH: usize = 60;

/// `rivet gc ...`
#[derive(Debug, Subcommand)]
pub enum GcCommand {
    /// Last pass, next pass, current interval, totals per map and the timeouts applied.
    Status,
    /// Run a full pass now (after the one running, if any) and show what it did.
    Run,
}

/// Entries deleted, by reason.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct DeletedView {
    /// Lifetime over.
    pub expired: u64,
    /// Address of no endpoint on the node.
    pub orphaned_endpoint: u64,
    /// NAT entry whose connection is gone.
    pub nat_without_connection: u64,
    /// Session affinity entry of a service that is gone.
    pub service_gone: u64,
}

impl From<Option<&pb::DeletedCounts>> for DeletedView {
    fn from(d: Option<&pb::DeletedCounts>) -> Self {
        let d = d.cloned().unwrap_or_default();
        Self {
            expired: d.expired,
            orphaned_endpoint: d.orphaned_endpoint,
            nat_without_connection: d.nat_without_connection,
            service_gone: d.service_gone,
        }
    }
}

/// One map in one pass.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct MapPassView {
    /// Pin name.
    pub map: String,
    /// Entries read.
    pub scanned: u64,
    /// Deleted, by reason.
    pub deleted: DeletedView,
    /// Deletable but refreshed before the delete, so kept.
    pub spared_refreshed: u64,
    /// Left after the pass.
    pub remaining: u64,
    /// The map's size.
    pub max_entries: u32,
    /// Batch commands were used.
    pub batched: bool,
    /// Time spent, nanoseconds.
    pub duration_nanos: u64,
    /// Set when the map was not processed completely.
    pub error: String,
}

/// One pass.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PassView {
    /// From 1 per svc-gc process.
    pub pass_number: u64,
    /// `initial`, `interval`, `run-now`, `map-pressure`.
    pub trigger: String,
    /// Start, Unix nanoseconds.
    pub started_unix_nanos: i64,
    /// Nanoseconds.
    pub duration_nanos: u64,
    /// Per map.
    pub maps: Vec<MapPassView>,
    /// Entries read over all maps.
    pub scanned: u64,
    /// Deleted over all maps.
    pub deleted: DeletedView,
    /// deleted / scanned.
    pub delete_ratio: f64,
    /// `done`, or why orphans were not deleted.
    pub orphan_check: String,
}

/// Totals of one map since svc-gc started.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct TotalsView {
    /// Pin name.
    pub map: String,
    /// Entries read.
    pub scanned: u64,
    /// Deleted, by reason.
    pub deleted: DeletedView,
    /// Spared because refreshed.
    pub spared_refreshed: u64,
}

/// Idle timeouts, seconds.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct TimeoutsView {
    /// TCP being opened.
    pub tcp_syn_s: f64,
    /// TCP established.
    pub tcp_established_s: f64,
    /// TCP closing.
    pub tcp_closing_s: f64,
    /// UDP and other protocols.
    pub udp_s: f64,
    /// ICMP.
    pub icmp_s: f64,
}

/// `rivet gc status`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StatusView {
    /// The last completed pass.
    pub last_pass: Option<PassView>,
    /// A pass is running now.
    pub pass_running: bool,
    /// Next scheduled pass, Unix nanoseconds.
    pub next_pass_unix_nanos: i64,
    /// Current interval, nanoseconds.
    pub interval_nanos: u64,
    /// Its floor.
    pub min_interval_nanos: u64,
    /// Its ceiling.
    pub max_interval_nanos: u64,
    /// Passes completed.
    pub passes: u64,
    /// Per map since start.
    pub totals: Vec<TotalsView>,
    /// Timeouts applied.
    pub timeouts: TimeoutsView,
    /// svc-gc's boot id.
    pub boot_id: String,
}

/// A protobuf enum value's name in kebab case without its prefix
/// (`PASS_TRIGGER_RUN_NOW` → `run-now`).
fn enum_name(name: Option<&str>, prefix: &str, raw: i32) -> String {
    match name {
        Some(n) => n.trim_start_matches(prefix).to_ascii_lowercase().replace('_', "-"),
        None => raw.to_string(),
    }
}

fn pass_view(p: &pb::PassStats) -> PassView {
    PassView {
        pass_number: p.pass_number,
        trigger: enum_name(
            pb::PassTrigger::try_from(p.trigger).ok().map(|t| t.as_str_name()),
            "PASS_TRIGGER_",
            p.trigger,
        ),
        started_unix_nanos: p.started_unix_nanos,
        duration_nanos: p.duration_nanos,
        maps: p
            .maps
            .iter()
            .map(|m| MapPassView {
                map: m.map.clone(),
                scanned: m.scanned,
                deleted: m.deleted.as_ref().into(),
                spared_refreshed: m.spared_refreshed,
                remaining: m.remaining,
                max_entries: m.max_entries,
                batched: m.batched,
                duration_nanos: m.duration_nanos,
                error: m.error.clone(),
            })
            .collect(),
        scanned: p.scanned,
        deleted: p.deleted.as_ref().into(),
        delete_ratio: p.delete_ratio,
        orphan_check: enum_name(
            pb::OrphanCheck::try_from(p.orphan_check).ok().map(|o| o.as_str_name()),
            "ORPHAN_CHECK_",
            p.orphan_check,
        ),
    }
}

fn status_view(s: &pb::StatusResponse) -> StatusView {
    let t = s.timeouts.unwrap_or_default();
    let secs = |n: u64| n as f64 / 1e9;
    StatusView {
        last_pass: s.last_pass.as_ref().map(pass_view),
        pass_running: s.pass_running,
        next_pass_unix_nanos: s.next_pass_unix_nanos,
        interval_nanos: s.interval_nanos,
        min_interval_nanos: s.min_interval_nanos,
        max_interval_nanos: s.max_interval_nanos,
        passes: s.passes,
        totals: s
            .totals
            .iter()
            .map(|t| TotalsView {
                map: t.map.clone(),
                scanned: t.scanned,
                deleted: t.deleted.as_ref().into(),
                spared_refreshed: t.spared_refreshed,
            })
            .collect(),
        timeouts: TimeoutsView {
            tcp_syn_s: secs(t.tcp_syn_nanos),
            tcp_established_s: secs(t.tcp_established_nanos),
            tcp_closing_s: secs(t.tcp_closing_nanos),
            udp_s: secs(t.udp_nanos),
            icmp_s: secs(t.icmp_nanos),
        },
        boot_id: s.boot_id.clone(),
    }
}

fn deleted_text(d: &DeletedView) -> String {
    format!(
        "{} (expired {}, orphaned {}, nat {}, service gone {})",
        d.expired + d.orphaned_endpoint + d.nat_without_connection + d.service_gone,
        d.expired,
        d.orphaned_endpoint,
        d.nat_without_connection,
        d.service_gone
    )
}

/// A pass as aligned fields and a per-map table.
pub fn pass_text(p: &PassView, now_unix_nanos: i64) -> String {
    let mut out = fields([
        ("PASS", format!("{} ({})", p.pass_number, p.trigger)),
        (
            "STARTED",
            format!(
                "{} ago, took {}",
                age(now_unix_nanos, p.started_unix_nanos),
                duration(p.duration_nanos)
            ),
        ),
        ("SCANNED", p.scanned.to_string()),
        ("DELETED", deleted_text(&p.deleted)),
        ("RATIO", format!("{:.1}%", p.delete_ratio * 100.0)),
        ("ORPHAN CHECK", p.orphan_check.clone()),
    ]);
    let mut t = Table::new([
        "MAP",
        "SCANNED",
        "EXPIRED",
        "ORPHANED",
        "NAT",
        "SPARED",
        "REMAINING",
        "MAX",
        "BATCHED",
        "TOOK",
        "ERROR",
    ]);
    for m in &p.maps {
        t.row([
            m.map.clone(),
            m.scanned.to_string(),
            m.deleted.expired.to_string(),
            m.deleted.orphaned_endpoint.to_string(),
            m.deleted.nat_without_connection.to_string(),
            m.spared_refreshed.to_string(),
            m.remaining.to_string(),
            m.max_entries.to_string(),
            if m.batched { "yes" } else { "no" }.to_string(),
            duration(m.duration_nanos),
            if m.error.is_empty() {
                "-".to_string()
            } else {
                truncate(&m.error, ERROR_WIDTH)
            },
        ]);
    }
    out.push('\n');
    out.push_str(&t.render());
    out
}

/// `rivet gc status` as text.
pub fn status_text(s: &StatusView, now_unix_nanos: i64) -> String {
    let until_next = u64::try_from(s.next_pass_unix_nanos.saturating_sub(now_unix_nanos)).unwrap_or(0);
    let t = &s.timeouts;
    let mut out = fields([
        (
            "NEXT PASS",
            if s.pass_running {
                "running now".to_string()
            } else {
                format!("in {}", duration(until_next))
            },
        ),
        (
            "INTERVAL",
            format!(
                "{} (min {}, max {})",
                duration(s.interval_nanos),
                duration(s.min_interval_nanos),
                duration(s.max_interval_nanos)
            ),
        ),
        ("PASSES", s.passes.to_string()),
        (
            "TIMEOUTS",
            format!(
                "tcp syn {}s, established {}s, closing {}s; udp {}s; icmp {}s",
                t.tcp_syn_s, t.tcp_established_s, t.tcp_closing_s, t.udp_s, t.icmp_s
            ),
        ),
    ]);
    let mut totals = Table::new(["MAP", "SCANNED", "EXPIRED", "ORPHANED", "NAT", "SPARED"]);
    for m in &s.totals {
        totals.row([
            m.map.clone(),
            m.scanned.to_string(),
            m.deleted.expired.to_string(),
            m.deleted.orphaned_endpoint.to_string(),
            m.deleted.nat_without_connection.to_string(),
            m.spared_refreshed.to_string(),
        ]);
    }
    out.push_str("\nTotals since start:\n");
    out.push_str(&totals.render());
    match &s.last_pass {
        Some(p) => {
            out.push_str("\nLast pass:\n");
            out.push_str(&pass_text(p, now_unix_nanos));
        }
        None => out.push_str("\nNo pass completed yet.\n"),
    }
    out
}

/// Runs one `rivet gc` command.
pub async fn run(ctx: &Context, command: GcCommand) -> Result<(), CliError> {
    let rpc = |s| CliError::rpc(DAEMON, s);
    match command {
        GcCommand::Status => {
            let mut client = GcServiceClient::new(ctx.connect(DAEMON).await?);
            let r = client.status(pb::StatusRequest {}).await.map_err(rpc)?.into_inner();
            let view = status_view(&r);
            ctx.print(&view, || status_text(&view, now_unix_nanos()));
        }
        GcCommand::Run => {
            let mut client = GcServiceClient::new(ctx.connect_with_deadline(DAEMON).await?);
            let r = client
                .run_now(ctx.request(pb::RunNowRequest {}))
                .await
                .map_err(rpc)?
                .into_inner();
            let view = r.pass.as_ref().map(pass_view);
            ctx.print(&view, || match &view {
                Some(p) => pass_text(p, now_unix_nanos()),
                None => "svc-gc returned no pass\n".to_string(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000_000;

    fn sample() -> pb::StatusResponse {
        pb::StatusResponse {
            last_pass: Some(pb::PassStats {
                pass_number: 3,
                trigger: pb::PassTrigger::RunNow.into(),
                started_unix_nanos: 1_000 * S,
                duration_nanos: 35_000_000,
                maps: vec![pb::MapPassStats {
                    map: "ct4".into(),
                    scanned: 1000,
                    deleted: Some(pb::DeletedCounts {
                        expired: 90,
                        orphaned_endpoint: 10,
                        nat_without_connection: 0,
                        service_gone: 0,
                    }),
                    spared_refreshed: 2,
                    remaining: 900,
                    max_entries: 786_432,
                    batched: true,
                    duration_nanos: 30_000_000,
                    error: String::new(),
                }],
                scanned: 1000,
                deleted: Some(pb::DeletedCounts {
                    expired: 90,
                    orphaned_endpoint: 10,
                    nat_without_connection: 0,
                    service_gone: 0,
                }),
                delete_ratio: 0.1,
                orphan_check: pb::OrphanCheck::SkippedRestoring.into(),
            }),
            pass_running: false,
            next_pass_unix_nanos: 1_300 * S,
            interval_nanos: 300 * S as u64,
            min_interval_nanos: 10 * S as u64,
            max_interval_nanos: 1800 * S as u64,
            passes: 3,
            totals: vec![],
            timeouts: Some(pb::Timeouts {
                tcp_syn_nanos: 60 * S as u64,
                tcp_established_nanos: 21_600 * S as u64,
                tcp_closing_nanos: 10 * S as u64,
                udp_nanos: 60 * S as u64,
                icmp_nanos: 60 * S as u64,
            }),
            boot_id: "b".into(),
        }
    }

    #[test]
    fn status_shows_the_pass_the_schedule_and_the_timeouts() {
        let view = status_view(&sample());
        let pass = view.last_pass.as_ref().unwrap();
        assert_eq!(pass.trigger, "run-now");
        assert_eq!(pass.orphan_check, "skipped-restoring");
        let text = status_text(&view, 1_060 * S);
        assert!(text.contains("NEXT PASS  in 4m0s"), "{text}");
        assert!(text.contains("INTERVAL   5m0s (min 10.0s, max 30m0s)"), "{text}");
        assert!(text.contains("established 21600s"), "{text}");
        assert!(text.contains("PASS          3 (run-now)"), "{text}");
        assert!(
            text.contains("DELETED       100 (expired 90, orphaned 10, nat 0, service gone 0)"),
            "{text}"
        );
        assert!(
            text.contains("ct4  1000     90       10        0    2       900        786432  yes      30ms  -"),
            "{text}"
        );
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["last_pass"]["maps"][0]["deleted"]["expired"], 90);
        assert_eq!(json["timeouts"]["tcp_established_s"], 21_600.0);
    }
}
