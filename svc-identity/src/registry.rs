//! The node registry (multi-node): this node's [`NodeRecord`] in the store,
//! the other nodes' records from it.
//!
//! - Publishing (`node-registry-publish`, a reconcile controller): this
//!   node's record (source `node`, its boot id, underlay addresses, pod
//!   CIDRs, encapsulation, and the addresses of its local endpoints with the
//!   reserved `health` identity) under `nodes/v1/<cluster>/<node>`, bound to
//!   the node lease (the lease of its value keys and IP entries). Compared
//!   with what the store holds before writing; written again when the
//!   lease was replaced (`node-registry-lease-renewals`), when the key
//!   vanished or changed under it, and when the health endpoint changes
//!   (`node-registry-health`, fed by the IP cache). A clean stop revokes the
//!   lease, so the key goes at once; a crash leaves it to the lease TTL.
//! - Following (`node-registry-watch`): list + watch of `nodes/v1/<cluster>/`
//!   (re-listed after a lost watch or a compaction, like the IP cache's
//!   store loop). Every other node's record (written by the node itself or
//!   by rivet-operator's mirror) is a peer; an unusable record (not JSON of
//!   a node record, another node's name or cluster) is skipped and counted,
//!   and a node whose key was overwritten by one is gone.
//! - Peers change: each peer's underlay addresses are claimed in the IP
//!   cache as `remote-node` (source NODE), withdrawn when the peer goes (its
//!   pods' `ip/v1` entries go with its lease); the peer set is offered to
//!   the push to svc-loader ([`peer_nodes`](NodeRegistry::peer_nodes), for
//!   `NodeRoutingService.ReplaceNodes`); each join, leave, update and
//!   restart is one [`events::node_changed`] event.
//!
//! With the Kubernetes store the records are the RivetNodes
//! ([`crate::kubernetes_cluster`]): the registry writes none (svc-k8s-sync
//! and rivet-operator own the RivetNode's fields), and this node's own
//! RivetNode gives its addresses and pod CIDRs where no flag does (the
//! cluster pool's allocation: a DaemonSet cannot pass `--pod-cidr` per
//! node). Its peers and their routing are the same as with etcd.
//!
//! With etcd and no `--pod-cidr` ([`RegistryOptions::publish_own_record`]
//! `false`: a DaemonSet with cluster-pool IPAM) the same holds for this
//! node's key: rivet-operator's mirror of its RivetNode writes it, and the
//! registry reads its pod CIDRs from there instead of overwriting it.
//!
//! Without a node store (the embedded store: one node) the registry lists
//! this node only.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ipnet::IpNet;
use rivet_common::backoff::Backoff;
use rivet_common::cluster::{EncapsulationMode, NodeRecord, NodeRecordAddress, NodeRecordEncapsulation, RecordSource};
use rivet_common::controller::{Action, Controller, Controllers, Progress, Trigger};
use rivet_proto::identity::v1 as pb;
use rivet_proto::loader::v1 as loader_pb;
use rivet_proto::net;
use tokio::sync::{broadcast, watch};

use crate::backend::{BackendError, IdentityBackend, NodeKeyEvent, NodeStore};
use crate::events::{self, IdentityMetrics, NodeChange};
use crate::ipcache::{IpCache, IpcacheSource};
use crate::{reconcile, store_watch};

/// The VXLAN port of the cluster's convention (Cilium's).
pub const DEFAULT_TUNNEL_PORT: u16 = 8472;

/// Who this node is in the cluster.
#[derive(Debug, Clone)]
pub struct RegistryOptions {
    /// This node's name (the store's node).
    pub node_name: String,
    /// The cluster (`--cluster-name`).
    pub cluster: String,
    /// How pod traffic crosses nodes; `None`: a single node (published as
    /// `direct`, nothing pushed to svc-loader).
    pub routing: Option<EncapsulationMode>,
    /// This node's underlay addresses (`--node-address`); empty: those of
    /// its record in a store that does not publish it (a RivetNode).
    pub node_addresses: Vec<IpAddr>,
    /// This node's pod CIDRs (`--pod-cidr`); empty: those of its record in
    /// a store that does not publish it (the RivetNode's allocation).
    pub pod_cidrs: Vec<IpNet>,
    /// Whether this node writes its own record where the store lets it
    /// (etcd). `false`: another writer keeps it (rivet-operator's mirror of
    /// the node's RivetNode) and the registry reads it, as with the
    /// Kubernetes store.
    pub publish_own_record: bool,
    /// The VXLAN UDP port (`--tunnel-port`).
    pub tunnel_port: u16,
    /// This process's boot id.
    pub boot_id: String,
    /// Retry delays of listing/watching the store.
    pub relist_backoff: Backoff,
    /// Where node changes are counted.
    pub metrics: IdentityMetrics,
}

impl RegistryOptions {
    /// A single node `node_name` of cluster `cluster`, no addresses.
    pub fn new(node_name: impl Into<String>, cluster: impl Into<String>, boot_id: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            cluster: cluster.into(),
            routing: None,
            node_addresses: Vec::new(),
            pod_cidrs: Vec::new(),
            publish_own_record: true,
            tunnel_port: DEFAULT_TUNNEL_PORT,
            boot_id: boot_id.into(),
            relist_backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
            metrics: IdentityMetrics::default(),
        }
    }
}

/// The peer nodes as svc-loader's `ReplaceNodes` takes them, by name.
pub type PeerNodes = Arc<Vec<loader_pb::PeerNode>>;

#[derive(Debug, Default)]
struct State {
    /// Other nodes' usable records, by name.
    peers: BTreeMap<String, NodeRecord>,
    /// This node's key as the store holds it (`None`: absent or not known).
    own_in_store: Option<Vec<u8>>,
    /// The first listing completed.
    listed: bool,
    /// The record must be written even if the store holds it (a replaced
    /// lease).
    republish: bool,
    /// This node's record as another writer keeps it in the store (the
    /// RivetNode), when the registry does not publish its own.
    own_listed: Option<NodeRecord>,
}

/// The node registry; see the module docs.
pub struct NodeRegistry {
    opts: RegistryOptions,
    store: Option<Arc<dyn NodeStore>>,
    backend: Arc<dyn IdentityBackend>,
    ipcache: Arc<IpCache>,
    state: Mutex<State>,
    publish: Trigger,
    peers: watch::Sender<Option<PeerNodes>>,
}

impl std::fmt::Debug for NodeRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeRegistry")
            .field("opts", &self.opts)
            .field("store", &self.store.is_some())
            .finish_non_exhaustive()
    }
}

impl NodeRegistry {
    /// A registry of this node over `store` (`None`: this node only),
    /// claiming peers' addresses in `ipcache`; `backend` reports replaced
    /// leases. Call [`run`](Self::run).
    pub fn new(
        opts: RegistryOptions,
        store: Option<Arc<dyn NodeStore>>,
        backend: Arc<dyn IdentityBackend>,
        ipcache: Arc<IpCache>,
    ) -> Arc<Self> {
        events::nodes_known(&opts.metrics, 1);
        Arc::new(Self {
            opts,
            store,
            backend,
            ipcache,
            state: Mutex::new(State::default()),
            publish: Trigger::new(),
            peers: watch::channel(None).0,
        })
    }

    /// Starts the controllers (module docs) under `controllers`; nothing
    /// without a node store.
    pub fn run(self: &Arc<Self>, controllers: &Controllers) {
        let Some(store) = self.store.clone() else {
            self.state().listed = true;
            self.peers.send_replace(Some(Arc::new(Vec::new())));
            return;
        };
        let this = self.clone();
        let publishes = self.publishes();
        let watch = Controller::new("node-registry-watch").backoff(self.opts.relist_backoff.clone());
        controllers.supervise(watch, move |progress| this.clone().follow(store.clone(), progress));
        if !publishes {
            return;
        }
        let this = self.clone();
        let publish = Controller::new("node-registry-publish")
            .trigger(&self.publish)
            .backoff(Backoff::new(Duration::from_millis(200), Duration::from_secs(10)));
        controllers.reconcile(publish, move || this.clone().publish_pass());
        let this = self.clone();
        reconcile::on_lease_renewed(controllers, "node-registry-lease-renewals", &self.backend, move || {
            tracing::info!("node lease replaced; publishing this node's record again");
            this.state().republish = true;
            this.publish.trigger();
        });
        let this = self.clone();
        controllers.supervise(Controller::new("node-registry-health"), move |progress| {
            this.clone().follow_health(progress)
        });
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the registry writes this node's record (else it reads it
    /// from the store like a peer's).
    fn publishes(&self) -> bool {
        self.opts.publish_own_record && self.store.as_ref().is_none_or(|s| s.publishes_own_record())
    }

    /// This node's record as it is to be published now (with a store that
    /// does not publish it: the flags' addresses and pod CIDRs, else the
    /// listed record's).
    pub fn own_record(&self) -> NodeRecord {
        let listed = self.state().own_listed.clone();
        let mut addresses: Vec<NodeRecordAddress> = match (&listed, self.opts.node_addresses.is_empty()) {
            (Some(record), true) => record.addresses.clone(),
            _ => self
                .opts
                .node_addresses
                .iter()
                .map(|ip| NodeRecordAddress {
                    type_: "InternalIP".into(),
                    ip: *ip,
                })
                .collect(),
        };
        addresses.sort();
        addresses.dedup();
        let mut pod_cidrs = self.own_pod_cidrs(listed.as_ref());
        pod_cidrs.sort();
        pod_cidrs.dedup();
        let mode = self.opts.routing.unwrap_or_default();
        NodeRecord {
            name: self.opts.node_name.clone(),
            cluster: self.opts.cluster.clone(),
            addresses,
            pod_cidrs,
            encapsulation: NodeRecordEncapsulation {
                mode,
                port: (mode == EncapsulationMode::Vxlan).then_some(self.opts.tunnel_port),
            },
            boot_id: self.opts.boot_id.clone(),
            health_addresses: self.ipcache.local_health_addresses(),
            source: RecordSource::Node,
        }
    }

    /// This node's pod CIDRs: `--pod-cidr`, else those of its listed
    /// record (`listed`).
    fn own_pod_cidrs(&self, listed: Option<&NodeRecord>) -> Vec<IpNet> {
        match listed {
            Some(record) if self.opts.pod_cidrs.is_empty() => record.pod_cidrs.clone(),
            _ => self.opts.pod_cidrs.clone(),
        }
    }

    /// The other nodes' records, by name.
    pub fn peers(&self) -> Vec<NodeRecord> {
        self.state().peers.values().cloned().collect()
    }

    /// Whether the store's node records were listed (always, without one).
    pub fn is_listed(&self) -> bool {
        self.state().listed
    }

    /// The peer set for svc-loader, current and on every change (`None`
    /// until the store's records were listed).
    pub fn peer_nodes(&self) -> watch::Receiver<Option<PeerNodes>> {
        self.peers.subscribe()
    }

    /// The routing mode of this node (`None`: a single node).
    pub fn routing(&self) -> Option<EncapsulationMode> {
        self.opts.routing
    }

    /// One publishing pass: writes this node's record unless the store
    /// holds it already (and the lease was not replaced).
    async fn publish_pass(self: Arc<Self>) -> Result<Action, BackendError> {
        let Some(store) = &self.store else {
            return Ok(Action::done());
        };
        let record = self.own_record();
        let value = serde_json::to_vec(&record).map_err(|e| BackendError::Corrupt {
            key: self.opts.node_name.clone(),
            detail: format!("encoding this node's record: {e}"),
        })?;
        {
            let st = self.state();
            if !st.republish && st.own_in_store.as_deref() == Some(value.as_slice()) {
                return Ok(Action::await_change());
            }
        }
        store.put_node(value.clone()).await?;
        tracing::info!(
            node = %record.name,
            boot_id = %record.boot_id,
            addresses = ?record.addresses.iter().map(|a| a.ip).collect::<Vec<_>>(),
            health_addresses = ?record.health_addresses,
            "this node's record published"
        );
        let mut st = self.state();
        st.republish = false;
        st.own_in_store = Some(value);
        Ok(Action::await_change())
    }

    /// Wakes the publishing pass when a local endpoint changes (its health
    /// addresses may have); the pass compares before it writes.
    async fn follow_health(self: Arc<Self>, progress: Progress) -> Result<(), String> {
        let (_, _, mut deltas) = self.ipcache.subscribe();
        progress.ok();
        loop {
            match deltas.recv().await {
                Ok(delta) => {
                    if delta
                        .entry
                        .as_ref()
                        .is_none_or(|e| e.source == IpcacheSource::LocalEndpoint)
                    {
                        self.publish.trigger();
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => self.publish.trigger(),
                Err(broadcast::error::RecvError::Closed) => return Err("the IP cache is gone".into()),
            }
        }
    }

    /// Keeps the peers equal to the store's records: list, watch, re-list.
    async fn follow(self: Arc<Self>, store: Arc<dyn NodeStore>, progress: Progress) -> Result<(), BackendError> {
        store_watch::list_then_watch(
            &progress,
            store.list_nodes(),
            |revision| store.watch_nodes(revision),
            |keys, _| self.apply_listing(keys),
            |event| self.apply_event(event),
        )
        .await
    }

    /// A usable record of another node from a key's value, or why not
    /// (counted).
    fn decode(&self, node: &str, value: &[u8]) -> Option<NodeRecord> {
        let record: NodeRecord = match serde_json::from_slice(value) {
            Ok(r) => r,
            Err(e) => {
                events::node_record_invalid(&self.opts.metrics, node, "undecodable", &e);
                return None;
            }
        };
        if record.name != node {
            let detail = format!("the record names node {:?}", record.name);
            events::node_record_invalid(&self.opts.metrics, node, "name_mismatch", &detail);
            return None;
        }
        if record.cluster != self.opts.cluster {
            let detail = format!("the record names cluster {:?}", record.cluster);
            events::node_record_invalid(&self.opts.metrics, node, "other_cluster", &detail);
            return None;
        }
        Some(record)
    }

    fn apply_listing(&self, keys: Vec<(String, Vec<u8>)>) {
        let mut own = None;
        let mut peers = BTreeMap::new();
        for (node, value) in keys {
            if node == self.opts.node_name {
                own = Some(value);
            } else if let Some(record) = self.decode(&node, &value) {
                peers.insert(node, record);
            }
        }
        let mut st = self.state();
        st.listed = true;
        let own_changed = self.set_own(&mut st, own);
        let before = std::mem::replace(&mut st.peers, peers);
        tracing::info!(peers = st.peers.len(), "node records listed from the store");
        self.peers_changed(st, &before, own_changed);
        self.publish.trigger();
    }

    /// Records this node's key as the store holds it; with a store that
    /// does not publish it, its decoded record too. `true` when this node's
    /// pod CIDRs changed (the peers' overlap checks change with them).
    fn set_own(&self, st: &mut State, value: Option<Vec<u8>>) -> bool {
        if self.publishes() {
            st.own_in_store = value;
            return false;
        }
        let record = value.and_then(|v| self.decode(&self.opts.node_name, &v));
        let before = self.own_pod_cidrs(st.own_listed.as_ref());
        if record != st.own_listed {
            if let Some(r) = &record {
                tracing::info!(
                    node = %r.name,
                    addresses = ?r.addresses.iter().map(|a| a.ip).collect::<Vec<_>>(),
                    pod_cidrs = ?r.pod_cidrs,
                    "this node's record listed from the store"
                );
            }
            st.own_listed = record;
        }
        self.own_pod_cidrs(st.own_listed.as_ref()) != before
    }

    fn apply_event(&self, event: NodeKeyEvent) {
        let mut st = self.state();
        let before = st.peers.clone();
        match event {
            NodeKeyEvent::Put { node, value } if node == self.opts.node_name => {
                let own_changed = self.set_own(&mut st, Some(value));
                // Not ours any more (another writer): the pass puts it back.
                self.publish.trigger();
                if own_changed {
                    self.peers_changed(st, &before, true);
                }
                return;
            }
            NodeKeyEvent::Delete { node } if node == self.opts.node_name => {
                let own_changed = self.set_own(&mut st, None);
                self.publish.trigger();
                if own_changed {
                    self.peers_changed(st, &before, true);
                }
                return;
            }
            NodeKeyEvent::Put { node, value } => match self.decode(&node, &value) {
                Some(record) => {
                    st.peers.insert(node, record);
                }
                None => {
                    st.peers.remove(&node);
                }
            },
            NodeKeyEvent::Delete { node } => {
                st.peers.remove(&node);
            }
        }
        self.peers_changed(st, &before, false);
    }

    /// After the peers changed from `before` (or, `own_changed`, this
    /// node's pod CIDRs did): the events, the remote-node claims and the
    /// set for svc-loader.
    fn peers_changed(&self, st: MutexGuard<'_, State>, before: &BTreeMap<String, NodeRecord>, own_changed: bool) {
        let first_listing = self.peers.borrow().is_none();
        if st.peers == *before && !first_listing && !own_changed {
            return;
        }
        let known = st.peers.len() + 1;
        let m = &self.opts.metrics;
        for (name, old) in before {
            if !st.peers.contains_key(name) {
                events::node_changed(m, NodeChange::Left, name, &old.boot_id, known);
            }
        }
        for (name, record) in &st.peers {
            match before.get(name) {
                None => events::node_changed(m, NodeChange::Joined, name, &record.boot_id, known),
                Some(old) if old.boot_id != record.boot_id => {
                    events::node_changed(m, NodeChange::Restarted, name, &record.boot_id, known)
                }
                Some(old) if old != record => {
                    events::node_changed(m, NodeChange::Updated, name, &record.boot_id, known)
                }
                Some(_) => {}
            }
        }
        let addresses: BTreeMap<IpAddr, String> = st
            .peers
            .values()
            .flat_map(|r| r.addresses.iter().map(|a| (a.ip, r.name.clone())))
            .collect();
        let mode = self.opts.routing.unwrap_or_default();
        let own_cidrs = self.own_pod_cidrs(st.own_listed.as_ref());
        let (peers, skipped) = routable_peers(st.peers.values(), mode, &own_cidrs);
        drop(st);
        for (node, reason) in &skipped {
            events::node_unroutable(m, node, reason);
        }
        self.ipcache.replace_node_claims(&addresses);
        self.peers.send_if_modified(|current| {
            if current.as_deref() == Some(&peers) {
                return false;
            }
            *current = Some(Arc::new(peers));
            true
        });
    }

    /// Every node known, this node first, then by name (`ListNodes`).
    pub fn list(&self) -> pb::ListNodesResponse {
        let mut own = node_proto(&self.own_record());
        own.local = true;
        // A single node has no routing mode, whatever its record says.
        if self.opts.routing.is_none() {
            own.routing_mode = pb::RoutingMode::Unspecified as i32;
            own.tunnel_port = 0;
        }
        let (peers, listed) = {
            let st = self.state();
            (st.peers.values().map(node_proto).collect::<Vec<_>>(), st.listed)
        };
        pb::ListNodesResponse {
            nodes: std::iter::once(own).chain(peers).collect(),
            cluster: self.opts.cluster.clone(),
            listed,
            boot_id: self.opts.boot_id.clone(),
        }
    }
}

/// A record as `ListNodes` shows it: addresses IPv4 first.
pub fn node_proto(record: &NodeRecord) -> pb::Node {
    let (routing_mode, tunnel_port) = match record.encapsulation.mode {
        EncapsulationMode::Direct => (pb::RoutingMode::Native, 0),
        EncapsulationMode::Vxlan => (
            pb::RoutingMode::Vxlan,
            record.encapsulation.port.unwrap_or(DEFAULT_TUNNEL_PORT),
        ),
    };
    let mut addresses: Vec<IpAddr> = record.addresses.iter().map(|a| a.ip).collect();
    addresses.sort_by_key(|ip| (ip.is_ipv6(), *ip));
    addresses.dedup();
    pb::Node {
        name: record.name.clone(),
        addresses: addresses.into_iter().map(net::address_bytes).collect(),
        pod_cidrs: record.pod_cidrs.iter().map(|p| net::prefix_to_proto(*p)).collect(),
        boot_id: record.boot_id.clone(),
        routing_mode: routing_mode as i32,
        tunnel_port: u32::from(tunnel_port),
        health_addresses: record
            .health_addresses
            .iter()
            .map(|ip| net::address_bytes(*ip))
            .collect(),
        source: match record.source {
            RecordSource::Node => pb::NodeSource::Node,
            RecordSource::Operator => pb::NodeSource::Operator,
        } as i32,
        local: false,
    }
}

/// Most pod CIDRs svc-loader takes per peer.
const MAX_PEER_POD_CIDRS: usize = 8;

/// The peers as svc-loader's `ReplaceNodes` takes them (it refuses the
/// whole set for one bad node, so each is checked here by its rules,
/// `loader.proto` `PeerNode`): the first unicast underlay address of each
/// family, an IPv4 one in vxlan mode, at most 8 canonical pod CIDRs that
/// are no default route, IPv6 ones only with an IPv6 address in native
/// mode, and none overlapping `own` (this node's pod CIDRs) or an earlier
/// peer's (by name). The others are returned with why they cannot be
/// routed (they stay nodes: their addresses are still remote-node).
pub fn routable_peers<'r>(
    records: impl IntoIterator<Item = &'r NodeRecord>,
    mode: EncapsulationMode,
    own: &[IpNet],
) -> (Vec<loader_pb::PeerNode>, Vec<(String, String)>) {
    let mut taken: Vec<(IpNet, String)> = own.iter().map(|c| (*c, "this node".to_string())).collect();
    let (mut peers, mut skipped) = (Vec::new(), Vec::new());
    for record in records {
        match routable_peer(record, mode, &taken) {
            Ok(peer) => {
                taken.extend(record.pod_cidrs.iter().map(|c| (*c, record.name.clone())));
                peers.push(peer);
            }
            Err(reason) => skipped.push((record.name.clone(), reason)),
        }
    }
    (peers, skipped)
}

fn routable_peer(
    record: &NodeRecord,
    mode: EncapsulationMode,
    taken: &[(IpNet, String)],
) -> Result<loader_pb::PeerNode, String> {
    rivet_common::k8s_name::check_dns_subdomain(&record.name).map_err(|e| format!("its name: {e}"))?;
    let unicast = |ip: &IpAddr| {
        !(ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() || *ip == IpAddr::from([255, 255, 255, 255]))
    };
    let first = |v6: bool| {
        record
            .addresses
            .iter()
            .map(|a| a.ip)
            .filter(|ip| ip.is_ipv6() == v6 && unicast(ip))
            .min()
    };
    let (v4, v6) = (first(false), first(true));
    if v4.is_none() && v6.is_none() {
        return Err("no unicast underlay address".into());
    }
    if mode == EncapsulationMode::Vxlan && v4.is_none() {
        return Err("no IPv4 underlay address (vxlan tunnel endpoints are IPv4)".into());
    }
    if record.pod_cidrs.len() > MAX_PEER_POD_CIDRS {
        return Err(format!(
            "{} pod CIDRs (at most {MAX_PEER_POD_CIDRS})",
            record.pod_cidrs.len()
        ));
    }
    for cidr in &record.pod_cidrs {
        if cidr.prefix_len() == 0 || cidr.trunc() != *cidr {
            return Err(format!("pod CIDR {cidr} is a default route or has host bits set"));
        }
        if mode == EncapsulationMode::Direct && cidr.addr().is_ipv6() && v6.is_none() {
            return Err(format!(
                "IPv6 pod CIDR {cidr} without an IPv6 underlay address (native routing)"
            ));
        }
        if let Some((other, owner)) = taken.iter().find(|(t, _)| t.contains(cidr) || cidr.contains(t)) {
            return Err(format!("pod CIDR {cidr} overlaps {other} of {owner}"));
        }
    }
    Ok(loader_pb::PeerNode {
        name: record.name.clone(),
        underlay_ipv4: v4.map(net::address_bytes).unwrap_or_default(),
        underlay_ipv6: v6.map(net::address_bytes).unwrap_or_default(),
        pod_cidrs: record.pod_cidrs.iter().map(|p| net::prefix_to_proto(*p)).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, addresses: &[&str], cidrs: &[&str]) -> NodeRecord {
        NodeRecord {
            name: name.into(),
            cluster: "c".into(),
            addresses: addresses
                .iter()
                .map(|a| NodeRecordAddress {
                    type_: "InternalIP".into(),
                    ip: a.parse().unwrap(),
                })
                .collect(),
            pod_cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            encapsulation: NodeRecordEncapsulation::default(),
            boot_id: String::new(),
            health_addresses: vec![],
            source: RecordSource::Node,
        }
    }

    /// svc-loader refuses the whole set for one bad peer: the registry
    /// leaves out what it would refuse, and says why.
    #[test]
    fn peers_svc_loader_would_refuse_are_left_out_with_the_reason() {
        let own: Vec<IpNet> = vec!["198.18.1.0/24".parse().unwrap()];
        let records = [
            record(
                "n2",
                &["198.19.254.2", "2001:2:0:fe::2"],
                &["198.18.2.0/24", "2001:2:0:2::/64"],
            ),
            record("n3", &["2001:2:0:fe::3"], &["198.18.3.0/24"]),
            record("n4", &["198.19.254.4"], &["198.18.2.128/25"]),
            record("n5", &["127.0.0.1"], &[]),
            record("n6", &["198.19.254.6"], &["198.18.0.0/16"]),
            record("n7", &["198.19.254.7"], &["2001:2:0:7::/64"]),
            record("Bad_Name", &["198.19.254.8"], &[]),
        ];
        let (peers, skipped) = routable_peers(&records, EncapsulationMode::Vxlan, &own);
        let names: Vec<&str> = peers.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["n2", "n7"], "{skipped:?}");
        assert_eq!(peers[0].underlay_ipv4, vec![198, 19, 254, 2]);
        assert_eq!(peers[0].pod_cidrs.len(), 2);
        let why: BTreeMap<&str, &str> = skipped.iter().map(|(n, r)| (n.as_str(), r.as_str())).collect();
        assert!(why["n3"].contains("no IPv4 underlay address"), "{why:?}");
        assert!(why["n4"].contains("overlaps 198.18.2.0/24 of n2"), "{why:?}");
        assert!(why["n5"].contains("no unicast underlay address"), "{why:?}");
        assert!(why["n6"].contains("overlaps 198.18.1.0/24 of this node"), "{why:?}");
        assert!(why["Bad_Name"].contains("its name"), "{why:?}");
        // Native routing: IPv4 over IPv6 is fine, IPv6 over IPv4 is not.
        let (peers, skipped) = routable_peers(&records[1..2], EncapsulationMode::Direct, &own);
        assert_eq!((peers.len(), skipped.len()), (1, 0));
        let (peers, skipped) = routable_peers(&records[5..6], EncapsulationMode::Direct, &own);
        assert_eq!(peers.len(), 0);
        assert!(skipped[0].1.contains("without an IPv6 underlay address"), "{skipped:?}");
    }
}
