//! Duty `kvstore-mirror` (issue 15 §5, the seed's node and service sync
//! into the kvstore), with `--etcd-endpoints` only: nodes without
//! Kubernetes access and other clusters read nodes and shared services
//! from etcd.
//!
//! - Nodes: every RivetNode is mirrored into `nodes/v1/<cluster>/<node>`
//!   ([`NodeRecord`](rivet_common::cluster::NodeRecord)).
//! - Services: every Service annotated `service.rivet.io/global: "true"`,
//!   with the ready endpoints of its EndpointSlices, into
//!   `services/v1/<cluster>/<ns>/<name>`
//!   ([`ServiceRecord`](rivet_common::cluster::ServiceRecord)).
//!
//! Each term starts its own watchers (kube-runtime reflectors, see
//! `watch_cache`) and two level-triggered reconcile controllers,
//! `kvstore-mirror-nodes` and `kvstore-mirror-services`: once the watchers'
//! first lists are complete, and again on every change and every
//! `--kvstore-mirror-resync`, a pass lists the prefix and writes only what
//! differs ([`sync::plan`]): missing or changed records are put, keys no
//! object accounts for are deleted (the leftover sweep, so a term's first
//! pass removes what an earlier operator left behind). Keys with a lease
//! are never touched: they are a node's own record on its own lease
//! (multi-node). Every write follows [`Term::ensure`] and compares the
//! key's mod revision with the listed one.
//!
//! The mirror is a copy (keys without a lease): when the operator stops,
//! the records stay as they were and are corrected by the next leader's
//! first pass.

pub mod records;
pub mod sync;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::Client as EtcdClient;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use kube::runtime::watcher;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use rivet_common::controller::{Action, Controller, Controllers, Trigger};
use rivet_k8s::RivetNode;

use crate::kvstore::Layout;
use crate::term::{Duty, Term};
use crate::watch_cache::{self, Cache};
use records::{SERVICE_NAME_LABEL, Skipped};
use sync::{Applied, SyncError, Write};

/// A pass after a conflicting write comes this soon (the key changed
/// between the listing and the write; the next listing sees it).
const CONFLICT_RETRY: Duration = Duration::from_millis(100);

/// The mirror's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct MirrorArgs {
    /// How often the kvstore mirror re-checks every node and shared-service
    /// record even without a change (keys edited or deleted by hand are
    /// put back; `5m`, `30s`, ...). Changes are mirrored at once.
    #[arg(long, env = "RIVET_KVSTORE_MIRROR_RESYNC", default_value = "5m",
          value_parser = svc_identity::heartbeat::parse_interval)]
    pub kvstore_mirror_resync: Duration,
}

/// What a pass mirrors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Nodes,
    Services,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Nodes => "node",
            Self::Services => "service",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WriteLabels {
    kind: &'static str,
    action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    kind: &'static str,
    error: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource: &'static str,
}

/// The mirror's metrics (`rivet_operator_kvstore_mirror_*`).
#[derive(Debug, Clone, Default)]
struct MirrorMetrics {
    writes: Family<WriteLabels, Counter>,
    conflicts: Family<KindLabels, Counter>,
    failures: Family<ErrorLabels, Counter>,
    skipped: Family<KindLabels, Counter>,
    watch_errors: Family<ResourceLabels, Counter>,
}

/// The duty; cheap to clone.
#[derive(Clone)]
pub struct KvstoreMirror(Arc<Inner>);

struct Inner {
    kube: kube::Client,
    etcd: EtcdClient,
    layout: Layout,
    resync: Duration,
    metrics: MirrorMetrics,
}

impl std::fmt::Debug for KvstoreMirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvstoreMirror")
            .field("layout", &self.0.layout)
            .field("resync", &self.0.resync)
            .finish_non_exhaustive()
    }
}

/// One term's watch caches.
struct Caches {
    nodes: Cache<RivetNode>,
    services: Cache<Service>,
    slices: Cache<EndpointSlice>,
}

impl KvstoreMirror {
    /// The duty mirroring from `kube` into `etcd` under `layout`, passing
    /// over everything every `resync`.
    pub fn new(kube: kube::Client, etcd: EtcdClient, layout: Layout, resync: Duration) -> Self {
        Self(Arc::new(Inner {
            kube,
            etcd,
            layout,
            resync,
            metrics: MirrorMetrics::default(),
        }))
    }

    /// Registers under `registry` (prefix `rivet`):
    /// `rivet_operator_kvstore_mirror_writes_total{kind,action}` (`node` or
    /// `service` × `created`, `updated`, `deleted`),
    /// `..._conflicts_total{kind}` (a key changed between listing and
    /// write), `..._failures_total{kind,error}` (`not_leading`,
    /// `etcd_error`, `timeout`), `..._skipped_fields_total{kind}` (fields
    /// that do not parse, left out of a record) and
    /// `..._watch_errors_total{resource}`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("operator_kvstore_mirror");
        let m = &self.0.metrics;
        r.register(
            "writes",
            "Records the kvstore mirror wrote, by kind and action",
            m.writes.clone(),
        );
        r.register(
            "conflicts",
            "Writes of the kvstore mirror skipped because the key changed since it was listed, by kind",
            m.conflicts.clone(),
        );
        r.register(
            "failures",
            "Passes of the kvstore mirror that failed, by kind and error",
            m.failures.clone(),
        );
        r.register(
            "skipped_fields",
            "Fields left out of a written record because they do not parse, by kind",
            m.skipped.clone(),
        );
        r.register(
            "watch_errors",
            "Errors of the kvstore mirror's watches (retried), by resource",
            m.watch_errors.clone(),
        );
    }

    fn on_watch_error(&self, resource: &'static str) -> watch_cache::OnError {
        let errors = self.0.metrics.watch_errors.clone();
        Arc::new(move |e: &watcher::Error| {
            errors.get_or_create(&ResourceLabels { resource }).inc();
            tracing::warn!(resource, error = %e, "kvstore mirror: watch failed; retrying");
        })
    }

    /// The records the caches ask for, by key, with the fields each leaves
    /// out; `None` until the caches it reads completed their first list.
    fn desired(&self, kind: Kind, caches: &Caches) -> Option<BTreeMap<String, (String, Vec<Skipped>)>> {
        let layout = &self.0.layout;
        let cluster = layout.cluster();
        match kind {
            Kind::Nodes => {
                if !caches.nodes.synced() {
                    return None;
                }
                let desired = caches
                    .nodes
                    .store
                    .state()
                    .iter()
                    .filter_map(|node| {
                        let name = node.metadata.name.as_deref()?;
                        let (record, skipped) = records::node_record(node, cluster);
                        Some((layout.node_key(name), (to_json(&record), skipped)))
                    })
                    .collect();
                Some(desired)
            }
            Kind::Services => {
                if !caches.services.synced() || !caches.slices.synced() {
                    return None;
                }
                let mut slices: BTreeMap<(String, String), Vec<Arc<EndpointSlice>>> = BTreeMap::new();
                for slice in caches.slices.store.state() {
                    let service = slice.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_NAME_LABEL));
                    if let (Some(ns), Some(service)) = (&slice.metadata.namespace, service) {
                        slices
                            .entry((ns.clone(), service.clone()))
                            .or_default()
                            .push(slice.clone());
                    }
                }
                let desired = caches
                    .services
                    .store
                    .state()
                    .iter()
                    .filter(|s| records::is_global(s))
                    .filter_map(|service| {
                        let ns = service.metadata.namespace.clone()?;
                        let name = service.metadata.name.clone()?;
                        let own = slices
                            .get(&(ns.clone(), name.clone()))
                            .map(Vec::as_slice)
                            .unwrap_or(&[]);
                        let (record, skipped) = records::service_record(service, own.iter().map(|s| &**s), cluster);
                        Some((layout.service_key(&ns, &name), (to_json(&record), skipped)))
                    })
                    .collect();
                Some(desired)
            }
        }
    }

    /// One pass of `kind`: list, plan, write what differs.
    async fn pass(&self, term: &Term, kind: Kind, caches: &Caches) -> Result<Action, SyncError> {
        let Some(desired) = self.desired(kind, caches) else {
            return Ok(Action::await_change());
        };
        let prefix = match kind {
            Kind::Nodes => self.0.layout.node_prefix(),
            Kind::Services => self.0.layout.service_prefix(),
        };
        let result = self.write(term, kind, &prefix, &desired).await;
        if let Err(e) = &result {
            failed(&self.0.metrics, kind, e);
        }
        let conflicts = result?;
        Ok(Action::requeue(if conflicts > 0 {
            CONFLICT_RETRY
        } else {
            self.0.resync
        }))
    }

    /// Writes the differences; the number of conflicts.
    async fn write(
        &self,
        term: &Term,
        kind: Kind,
        prefix: &str,
        desired: &BTreeMap<String, (String, Vec<Skipped>)>,
    ) -> Result<usize, SyncError> {
        let etcd = &self.0.etcd;
        let listed = sync::list(etcd, prefix).await?;
        let values = desired.iter().map(|(k, (v, _))| (k.clone(), v.clone())).collect();
        let mut conflicts = 0;
        for write in sync::plan(&listed, &values) {
            match sync::apply(etcd, term, &write).await? {
                Applied::Written => {
                    let skipped = desired.get(write.key()).map_or(&[][..], |(_, s)| s.as_slice());
                    written(&self.0.metrics, kind, &write, skipped);
                }
                Applied::Conflict => {
                    conflicts += 1;
                    conflict(&self.0.metrics, kind, &write);
                }
            }
        }
        Ok(conflicts)
    }
}

/// A record as JSON (cannot fail: records have no maps with non-string
/// keys and no floats).
fn to_json(record: &impl serde::Serialize) -> String {
    serde_json::to_string(record).expect("records serialise to JSON")
}

/// A record written: its log line and its counters.
fn written(m: &MirrorMetrics, kind: Kind, write: &Write, skipped: &[Skipped]) {
    let action = write.action();
    m.writes
        .get_or_create(&WriteLabels {
            kind: kind.as_str(),
            action,
        })
        .inc();
    tracing::info!(
        kind = kind.as_str(),
        key = write.key(),
        action,
        "kvstore mirror: record {action}"
    );
    if !skipped.is_empty() {
        m.skipped
            .get_or_create(&KindLabels { kind: kind.as_str() })
            .inc_by(skipped.len() as u64);
        for s in skipped {
            tracing::warn!(
                kind = kind.as_str(),
                key = write.key(),
                field = %s.field,
                reason = %s.reason,
                "kvstore mirror: a field does not parse and was left out of the record"
            );
        }
    }
}

/// A write skipped because the key changed since it was listed.
fn conflict(m: &MirrorMetrics, kind: Kind, write: &Write) {
    m.conflicts.get_or_create(&KindLabels { kind: kind.as_str() }).inc();
    tracing::info!(
        kind = kind.as_str(),
        key = write.key(),
        "kvstore mirror: the key changed since it was listed; the next pass decides"
    );
}

/// A pass failed (retried with backoff).
fn failed(m: &MirrorMetrics, kind: Kind, error: &SyncError) {
    m.failures
        .get_or_create(&ErrorLabels {
            kind: kind.as_str(),
            error: error.kind(),
        })
        .inc();
    tracing::warn!(kind = kind.as_str(), error = %error, "kvstore mirror pass failed");
}

impl Duty for KvstoreMirror {
    fn name(&self) -> &'static str {
        "kvstore-mirror"
    }

    fn start(&self, term: &Term, controllers: &Controllers) {
        let (nodes_changed, services_changed) = (Trigger::new(), Trigger::new());
        let kube = &self.0.kube;
        let caches = Arc::new(Caches {
            nodes: watch_cache::watch(
                controllers,
                "kvstore-mirror-watch-rivetnodes",
                Api::all(kube.clone()),
                self.on_watch_error("rivetnodes"),
                nodes_changed.clone(),
            ),
            services: watch_cache::watch(
                controllers,
                "kvstore-mirror-watch-services",
                Api::all(kube.clone()),
                self.on_watch_error("services"),
                services_changed.clone(),
            ),
            slices: watch_cache::watch(
                controllers,
                "kvstore-mirror-watch-endpointslices",
                Api::all(kube.clone()),
                self.on_watch_error("endpointslices"),
                services_changed.clone(),
            ),
        });
        for (kind, name, trigger) in [
            (Kind::Nodes, "kvstore-mirror-nodes", &nodes_changed),
            (Kind::Services, "kvstore-mirror-services", &services_changed),
        ] {
            let (duty, term, caches) = (self.clone(), term.clone(), caches.clone());
            controllers.reconcile(Controller::new(name).trigger(trigger), move || {
                let (duty, term, caches) = (duty.clone(), term.clone(), caches.clone());
                async move { duty.pass(&term, kind, &caches).await }
            });
        }
    }
}
