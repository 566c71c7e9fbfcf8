//! The other nodes and their pods from the Kubernetes API
//! (`--identity-store kubernetes`, Cilium's CRD mode): what the etcd store's
//! `nodes/v1` and `ip/v1` prefixes are to the etcd store.
//!
//! - Every `RivetNode` is a node record ([`NodeStore`] for the node
//!   registry): its spec's addresses, pod CIDRs and encapsulation. The
//!   registry writes none: svc-k8s-sync applies the spec's addresses (and
//!   encapsulation) and rivet-operator the pod CIDRs (cluster-pool IPAM),
//!   each with its own field manager; this node's own RivetNode gives the
//!   registry its own addresses and pod CIDRs
//!   ([`NodeStore::publishes_own_record`] is `false`).
//! - Every `RivetEndpoint` of another node with an identity is an IP cache
//!   entry per address (the IP cache's store entries,
//!   [`ClusterObjects::list_ips`] / [`ClusterObjects::watch_ips`]), its
//!   `host_ip` the first IPv4 address of its node's RivetNode (the tunnel
//!   endpoint in vxlan mode). This node's own RivetEndpoints are left out:
//!   its endpoints are local claims already.
//!
//! Why here and not in svc-k8s-sync: svc-identity holds the IP cache and the
//! node registry and already talks to the API server for identities, so the
//! watch costs one more pair of list + watch and no new gRPC API; svc-loader
//! keeps no API access. The cost is two read-only verbs in
//! `deploy/rbac/svc-identity.yaml` (`list`, `watch` on rivetnodes and
//! rivetendpoints).
//!
//! Two kube-runtime watchers (controllers `rivet-nodes-watch` and
//! `rivet-endpoints-watch`, restarted with backoff after an error, their
//! reflector stores kept across restarts) wake `cluster-objects`, which
//! recomputes both views from the stores (bursts of events coalesce into one
//! pass) and publishes them as generation-numbered snapshots; a follower
//! lists a snapshot and watches the differences from it
//! (`store_watch::list_then_watch`, as with etcd). Nodes are listed only
//! once the RivetNodes were (the registry's first listing gates the routing
//! push, as with etcd); IP entries are listed at once (local first: the
//! push of this node's own entries to svc-loader never waits for the API
//! server), the other nodes' pods arriving as watch events once listed.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use futures::stream::{self, BoxStream, StreamExt};
use rivet_common::cluster::{NodeRecord, RecordSource};
use rivet_common::controller::{Action, Controller, Controllers, Trigger};
use rivet_k8s::kube::api::Api;
use rivet_k8s::kube::runtime::reflector::Store;
use rivet_k8s::kube::runtime::reflector::store::Writer;
use rivet_k8s::kube::runtime::watcher::{self, Event};
use rivet_k8s::kube::{Client, Resource, ResourceExt};
use rivet_k8s::{RivetEndpoint, RivetEndpointState, RivetNode};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use crate::backend::{BackendError, IpEntry, IpEvent, NodeKeyEvent, NodeStore, Revision};

/// Who this node is.
#[derive(Debug, Clone)]
pub struct ClusterObjectsOptions {
    /// This node (its RivetEndpoints are not IP cache entries here).
    pub node_name: String,
    /// The cluster the records are of (`--cluster-name`).
    pub cluster: String,
}

/// The other nodes and their pods from the API; see the module docs.
pub struct ClusterObjects {
    opts: ClusterObjectsOptions,
    nodes: Mirror<Vec<u8>>,
    ips: Mirror<IpEntry>,
}

impl Debug for ClusterObjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterObjects")
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

/// The watched kinds' reflector stores and whether each completed a list.
struct Watched {
    nodes: Store<RivetNode>,
    endpoints: Store<RivetEndpoint>,
    nodes_listed: watch::Receiver<bool>,
    endpoints_listed: watch::Receiver<bool>,
}

impl ClusterObjects {
    /// Starts watching RivetNodes and RivetEndpoints with `client` under
    /// `controllers` (module docs).
    pub fn start(client: Client, opts: ClusterObjectsOptions, controllers: &Controllers) -> Arc<Self> {
        let this = Arc::new(Self {
            opts,
            nodes: Mirror::new(),
            ips: Mirror::new(),
        });
        let changed = Trigger::new();
        let (nodes, nodes_listed) =
            watch_kind::<RivetNode>(controllers, "rivet-nodes-watch", Api::all(client.clone()), &changed);
        let (endpoints, endpoints_listed) =
            watch_kind::<RivetEndpoint>(controllers, "rivet-endpoints-watch", Api::all(client), &changed);
        let watched = Arc::new(Watched {
            nodes,
            endpoints,
            nodes_listed,
            endpoints_listed,
        });
        let view = this.clone();
        controllers.reconcile(Controller::new("cluster-objects").trigger(&changed), move || {
            let (view, watched) = (view.clone(), watched.clone());
            async move {
                view.recompute(&watched);
                Ok::<_, std::convert::Infallible>(Action::await_change())
            }
        });
        this
    }

    /// Both views from the stores, published when they changed.
    fn recompute(&self, watched: &Watched) {
        if !*watched.nodes_listed.borrow() {
            return;
        }
        let nodes: BTreeMap<String, NodeRecord> = watched
            .nodes
            .state()
            .iter()
            .map(|n| (n.name_any(), node_record(n, &self.opts.cluster)))
            .collect();
        let encoded = nodes
            .iter()
            .filter_map(|(name, record)| Some((name.clone(), serde_json::to_vec(record).ok()?)))
            .collect();
        self.nodes.publish(encoded, true);
        let endpoints_listed = *watched.endpoints_listed.borrow();
        if endpoints_listed {
            let ips = ip_entries(&watched.endpoints.state(), &nodes, &self.opts.node_name);
            self.ips.publish(ips, true);
        }
    }

    /// Every other node's pod address with its identity, and the snapshot's
    /// generation: empty (generation 0) until RivetEndpoints were listed.
    pub async fn list_ips(&self) -> Result<(Vec<IpEntry>, Revision), BackendError> {
        let (generation, items) = self.ips.list_now();
        Ok((items.values().cloned().collect(), generation))
    }

    /// The changes of the entries after the listing of generation `after`.
    pub async fn watch_ips(
        &self,
        after: Revision,
    ) -> Result<BoxStream<'static, Result<IpEvent, BackendError>>, BackendError> {
        self.ips.watch(after, "RivetEndpoints", |ip, entry| match entry {
            Some(entry) => IpEvent::Upsert(entry.clone()),
            None => IpEvent::Delete { ip: ip.to_string() },
        })
    }
}

#[tonic::async_trait]
impl NodeStore for ClusterObjects {
    fn publishes_own_record(&self) -> bool {
        false
    }

    /// Never called (`publishes_own_record` is false): svc-k8s-sync and
    /// rivet-operator write the RivetNode.
    async fn put_node(&self, _value: Vec<u8>) -> Result<(), BackendError> {
        Ok(())
    }

    /// Every RivetNode as a record, once RivetNodes were listed.
    async fn list_nodes(&self) -> Result<(Vec<(String, Vec<u8>)>, Revision), BackendError> {
        let (generation, items) = self.nodes.list_listed().await;
        Ok((items.iter().map(|(k, v)| (k.clone(), v.clone())).collect(), generation))
    }

    async fn watch_nodes(
        &self,
        after: Revision,
    ) -> Result<BoxStream<'static, Result<NodeKeyEvent, BackendError>>, BackendError> {
        self.nodes.watch(after, "RivetNodes", |node, value| match value {
            Some(value) => NodeKeyEvent::Put {
                node: node.to_string(),
                value: value.clone(),
            },
            None => NodeKeyEvent::Delete { node: node.to_string() },
        })
    }
}

/// A RivetNode as a node record of `cluster` (source `node`: svc-k8s-sync
/// writes its addresses): addresses and pod CIDRs that do not parse are
/// left out (logged), so a typo in one field does not hide the node.
pub fn node_record(node: &RivetNode, cluster: &str) -> NodeRecord {
    let (record, skipped) = rivet_k8s::records::node_record(node, cluster, RecordSource::Node);
    for field in skipped {
        tracing::warn!(field = %field.field, reason = %field.reason, "skipping a RivetNode field that does not parse");
    }
    record
}

/// The IP cache entries of the RivetEndpoints of nodes other than `me`:
/// one per address of an endpoint with an identity that is not being
/// removed, `host_ip` the first IPv4 address of its node's record. When two
/// endpoints name one address (a pod moved, the old object not deleted yet)
/// the ready one wins, then the first by namespace and name.
pub fn ip_entries(
    endpoints: &[Arc<RivetEndpoint>],
    nodes: &BTreeMap<String, NodeRecord>,
    me: &str,
) -> BTreeMap<String, IpEntry> {
    let mut entries: BTreeMap<String, (bool, IpEntry)> = BTreeMap::new();
    let mut sorted: Vec<&Arc<RivetEndpoint>> = endpoints.iter().collect();
    sorted.sort_by_key(|e| (e.namespace(), e.name_any()));
    for endpoint in sorted {
        let Some(status) = &endpoint.status else { continue };
        let Some(identity) = status.identity.filter(|i| *i != 0) else {
            continue;
        };
        if status.node == me
            || matches!(
                status.state,
                RivetEndpointState::Disconnecting | RivetEndpointState::Disconnected
            )
        {
            continue;
        }
        let host_ip = nodes.get(&status.node).and_then(|n| {
            n.addresses
                .iter()
                .map(|a| a.ip)
                .filter(IpAddr::is_ipv4)
                .min()
                .map(|ip| ip.to_string())
        });
        let ready = status.state == RivetEndpointState::Ready;
        for ip in [&status.ipv4, &status.ipv6].into_iter().flatten() {
            let Ok(address) = ip.parse::<IpAddr>() else {
                tracing::warn!(endpoint = %endpoint.name_any(), %ip, "skipping a RivetEndpoint address that is no IP address");
                continue;
            };
            let entry = IpEntry {
                ip: address.to_string(),
                identity,
                host_ip: host_ip.clone(),
                namespace: endpoint.namespace(),
                pod: Some(endpoint.name_any()),
                node: status.node.clone(),
                named_ports: Vec::new(),
            };
            match entries.get(&entry.ip) {
                Some((true, _)) => {}
                Some((false, _)) if !ready => {}
                _ => {
                    entries.insert(entry.ip.clone(), (ready, entry));
                }
            }
        }
    }
    entries.into_iter().map(|(ip, (_, entry))| (ip, entry)).collect()
}

/// Watches `api` into a reflector store as controller `name` (restarted
/// with backoff after an error, the store kept); `changed` fires after each
/// event. Returns the store and whether a list completed.
fn watch_kind<K>(
    controllers: &Controllers,
    name: &'static str,
    api: Api<K>,
    changed: &Trigger,
) -> (Store<K>, watch::Receiver<bool>)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let writer = Arc::new(Mutex::new(Writer::<K>::default()));
    let store = writer.lock().unwrap_or_else(|e| e.into_inner()).as_reader();
    let (listed, listed_rx) = watch::channel(false);
    let listed = Arc::new(listed);
    let kind = K::kind(&()).to_string();
    let changed = changed.clone();
    controllers.supervise(Controller::new(name), move |progress| {
        let (api, writer, listed, changed, kind) = (
            api.clone(),
            writer.clone(),
            listed.clone(),
            changed.clone(),
            kind.clone(),
        );
        async move {
            let mut events = watcher::watcher(api, watcher::Config::default()).boxed();
            while let Some(event) = events.next().await {
                let event = event.map_err(|e| watch_error(&kind, e))?;
                writer
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .apply_watcher_event(&event);
                match event {
                    Event::InitApply(_) | Event::Init => continue,
                    Event::InitDone => {
                        listed.send_replace(true);
                        tracing::info!(kind = %kind, objects = store_len(&writer), "listed from the API server");
                    }
                    Event::Apply(_) | Event::Delete(_) => {}
                }
                progress.ok();
                changed.trigger();
            }
            Ok::<(), BackendError>(())
        }
    });
    (store, listed_rx)
}

fn store_len<K: Resource<DynamicType = ()> + Clone>(writer: &Mutex<Writer<K>>) -> usize {
    writer
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_reader()
        .state()
        .len()
}

/// A watcher's error, typed like the identity store's: a refusal (RBAC)
/// names the verb and resource.
fn watch_error(kind: &str, error: watcher::Error) -> BackendError {
    let resource = match kind {
        "RivetNode" => "rivetnodes.rivet.io",
        _ => "rivetendpoints.rivet.io",
    };
    let (verb, source) = match error {
        watcher::Error::InitialListFailed(e) => ("list", e),
        watcher::Error::WatchStartFailed(e) | watcher::Error::WatchFailed(e) => ("watch", e),
        watcher::Error::WatchError(status) => ("watch", rivet_k8s::kube::Error::Api(status)),
        other => {
            return BackendError::Unavailable {
                action: format!("watching {kind}s"),
                detail: other.to_string(),
            };
        }
    };
    let action = format!("watching {kind}s");
    match source {
        rivet_k8s::kube::Error::Api(status) if (400..500).contains(&status.code) && status.code != 429 => {
            BackendError::Refused {
                action,
                verb,
                resource,
                code: status.code,
                message: status.message.clone(),
            }
        }
        other => BackendError::Unavailable {
            action,
            detail: other.to_string(),
        },
    }
}

/// A generation-numbered snapshot of a keyed view.
type Snapshot<V> = (Revision, Arc<BTreeMap<String, V>>);

/// A view published as snapshots: followers list one and watch the
/// differences from it.
struct Mirror<V> {
    /// The current snapshot; its `bool`: the source was listed.
    current: watch::Sender<(Snapshot<V>, bool)>,
    /// Snapshots handed to listings, by generation (the last few), so a
    /// watch from a listing diffs from exactly what it listed.
    listed: Mutex<BTreeMap<Revision, Arc<BTreeMap<String, V>>>>,
}

/// Listed snapshots kept for watches to start from.
const LISTINGS_KEPT: usize = 8;

impl<V: Clone + PartialEq + Send + Sync + 'static> Mirror<V> {
    fn new() -> Self {
        Self {
            current: watch::Sender::new(((0, Arc::default()), false)),
            listed: Mutex::default(),
        }
    }

    /// Publishes `items` as the next generation unless they are what is
    /// published already.
    fn publish(&self, items: BTreeMap<String, V>, listed: bool) {
        self.current.send_if_modified(|((generation, current), was_listed)| {
            if **current == items && *was_listed == listed {
                return false;
            }
            *generation += 1;
            *current = Arc::new(items);
            *was_listed = listed;
            true
        });
    }

    fn remember(&self, (generation, items): &Snapshot<V>) {
        let mut listed = self.listed.lock().unwrap_or_else(|e| e.into_inner());
        listed.insert(*generation, items.clone());
        while listed.len() > LISTINGS_KEPT {
            listed.pop_first();
        }
    }

    /// The current snapshot, listed or not.
    fn list_now(&self) -> Snapshot<V> {
        let snapshot = self.current.borrow().0.clone();
        self.remember(&snapshot);
        snapshot
    }

    /// The first snapshot of a listed source.
    async fn list_listed(&self) -> Snapshot<V> {
        let mut rx = self.current.subscribe();
        let snapshot = match rx.wait_for(|(_, listed)| *listed).await {
            Ok(current) => current.0.clone(),
            // The sender lives as long as self.
            Err(_) => unreachable!("the mirror's sender is alive"),
        };
        self.remember(&snapshot);
        snapshot
    }

    /// The changes from the listing of generation `after` on, as `event`
    /// makes them (`None`: the key went). A generation no listing handed
    /// out is `Compacted`: re-list.
    fn watch<E: Send + 'static>(
        &self,
        after: Revision,
        what: &'static str,
        event: fn(&str, Option<&V>) -> E,
    ) -> Result<BoxStream<'static, Result<E, BackendError>>, BackendError> {
        let base = self
            .listed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&after)
            .cloned()
            .ok_or(BackendError::Compacted {
                what,
                revision: after,
                compacted: 0,
            })?;
        let mut rx = self.current.subscribe();
        // A change between the listing and now is sent at once.
        rx.mark_changed();
        let stream = stream::unfold((rx, base), move |(mut rx, base)| async move {
            rx.changed().await.ok()?;
            let next = rx.borrow_and_update().0.1.clone();
            let events: Vec<Result<E, BackendError>> = diff(&base, &next, event).into_iter().map(Ok).collect();
            Some((stream::iter(events), (rx, next)))
        })
        .flatten();
        Ok(stream.boxed())
    }
}

/// The events that turn `before` into `after`: changed and new keys first
/// (by key), then the keys that went.
fn diff<V: PartialEq, E>(
    before: &BTreeMap<String, V>,
    after: &BTreeMap<String, V>,
    event: fn(&str, Option<&V>) -> E,
) -> Vec<E> {
    let mut events: Vec<E> = after
        .iter()
        .filter(|(k, v)| before.get(*k) != Some(*v))
        .map(|(k, v)| event(k, Some(v)))
        .collect();
    events.extend(
        before
            .keys()
            .filter(|k| !after.contains_key(*k))
            .map(|k| event(k, None)),
    );
    events
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipnet::IpNet;
    use rivet_common::cluster::EncapsulationMode;
    use rivet_k8s::kube::api::ObjectMeta;
    use rivet_k8s::{NodeAddress, RivetEndpointStatus, RivetNodeSpec};

    fn rivet_node(name: &str, addresses: &[&str], cidrs: &[&str]) -> RivetNode {
        RivetNode {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            spec: RivetNodeSpec {
                addresses: addresses
                    .iter()
                    .map(|ip| NodeAddress {
                        type_: "InternalIP".into(),
                        ip: ip.to_string(),
                    })
                    .collect(),
                pod_cidrs: cidrs.iter().map(ToString::to_string).collect(),
                ..RivetNodeSpec::default()
            },
            status: None,
        }
    }

    fn endpoint(
        name: &str,
        node: &str,
        identity: Option<u32>,
        ipv4: &str,
        state: RivetEndpointState,
    ) -> Arc<RivetEndpoint> {
        Arc::new(RivetEndpoint {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("shop".into()),
                ..ObjectMeta::default()
            },
            spec: rivet_k8s::RivetEndpointSpec {},
            status: Some(RivetEndpointStatus {
                node: node.into(),
                identity,
                ipv4: Some(ipv4.into()),
                ipv6: Some("2001:2:0:1::5".into()).filter(|_| name == "dual"),
                state,
                ..RivetEndpointStatus::default()
            }),
        })
    }

    #[test]
    fn a_rivet_node_becomes_a_record_without_what_does_not_parse() {
        let node = rivet_node(
            "n2",
            &["2001:2:0:fe::2", "198.19.254.2", "not-an-ip"],
            &["198.18.65.0/24", "bad"],
        );
        let record = node_record(&node, "c1");
        assert_eq!(record.name, "n2");
        assert_eq!(record.cluster, "c1");
        let ips: Vec<String> = record.addresses.iter().map(|a| a.ip.to_string()).collect();
        assert_eq!(ips, ["198.19.254.2", "2001:2:0:fe::2"]);
        assert_eq!(record.pod_cidrs, vec!["198.18.65.0/24".parse::<IpNet>().unwrap()]);
        assert_eq!(record.encapsulation.mode, EncapsulationMode::Direct);
    }

    #[test]
    fn other_nodes_endpoints_with_an_identity_are_entries_with_their_node_as_host() {
        let nodes: BTreeMap<String, NodeRecord> = [
            rivet_node("n1", &["198.19.254.1"], &[]),
            rivet_node("n2", &["2001:2:0:fe::2", "198.19.254.2"], &[]),
        ]
        .iter()
        .map(|n| (n.name_any(), node_record(n, "c")))
        .collect();
        let endpoints = [
            endpoint("mine", "n1", Some(300), "198.18.64.5", RivetEndpointState::Ready),
            endpoint("dual", "n2", Some(301), "198.18.65.5", RivetEndpointState::Ready),
            endpoint(
                "no-identity",
                "n2",
                None,
                "198.18.65.6",
                RivetEndpointState::WaitingForIdentity,
            ),
            endpoint(
                "going",
                "n2",
                Some(302),
                "198.18.65.7",
                RivetEndpointState::Disconnecting,
            ),
            endpoint(
                "unknown-node",
                "n9",
                Some(303),
                "198.18.66.8",
                RivetEndpointState::Regenerating,
            ),
            // The same address as `dual`, not ready: `dual` keeps it.
            endpoint("a-stale", "n2", Some(304), "198.18.65.5", RivetEndpointState::Restoring),
        ];
        let entries = ip_entries(&endpoints, &nodes, "n1");
        let keys: Vec<&str> = entries.keys().map(String::as_str).collect();
        assert_eq!(keys, ["198.18.65.5", "198.18.66.8", "2001:2:0:1::5"]);
        let dual = &entries["198.18.65.5"];
        assert_eq!(
            (dual.identity, dual.host_ip.as_deref(), dual.node.as_str()),
            (301, Some("198.19.254.2"), "n2")
        );
        assert_eq!(dual.namespace.as_deref(), Some("shop"));
        assert_eq!(dual.pod.as_deref(), Some("dual"));
        assert_eq!(entries["2001:2:0:1::5"].identity, 301);
        assert_eq!(entries["198.18.66.8"].host_ip, None, "no RivetNode: no tunnel endpoint");
    }

    #[tokio::test]
    async fn a_watch_sends_the_differences_from_what_its_listing_returned() {
        let mirror: Mirror<u32> = Mirror::new();
        let event = |k: &str, v: Option<&u32>| (k.to_string(), v.copied());
        mirror.publish([("a".into(), 1), ("b".into(), 2)].into(), true);
        let (generation, listed) = mirror.list_listed().await;
        assert_eq!(listed.len(), 2);
        // Changed between the listing and the watch: sent at once.
        mirror.publish([("a".into(), 1), ("b".into(), 3), ("c".into(), 4)].into(), true);
        let mut events = mirror.watch(generation, "test", event).unwrap();
        assert_eq!(events.next().await.unwrap().unwrap(), ("b".into(), Some(3)));
        assert_eq!(events.next().await.unwrap().unwrap(), ("c".into(), Some(4)));
        mirror.publish([("b".into(), 3), ("c".into(), 4)].into(), true);
        assert_eq!(events.next().await.unwrap().unwrap(), ("a".into(), None));
        // A generation no listing returned: re-list.
        assert!(matches!(
            mirror.watch(generation + 100, "test", event),
            Err(BackendError::Compacted { .. })
        ));
    }
}
