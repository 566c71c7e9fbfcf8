//! Scale by simulation (issue 16 §7): a load generator that publishes many
//! simulated nodes and their pods in a real etcd, in the key layout real
//! nodes use, and one real node ([`EtcdNode`]: svc-loader in a node
//! namespace, svc-identity on that etcd) whose pinned ipcache is read
//! directly ([`IpcacheReader`]) to see when it holds them.
//!
//! Each simulated node is what a real node's svc-identity writes, written
//! by svc-identity's own library: an [`EtcdBackend`] with its own lease
//! (so a simulated node's keys expire like a crashed node's), an
//! [`IdentityAllocator`] over it (identities allocated the real way: the
//! creating transaction, value keys on the node's lease), its
//! [`NodeRecord`] under `nodes/v1/<cluster>/<node>` on the lease, and an
//! [`IpEntry`] per pod under `ip/v1/<cluster>/<ip>` with `host_ip` = the
//! node's underlay IPv4 (`EtcdBackend::upsert_ip`, as the ipcache's
//! publication does).
//!
//! Addresses, all in 198.18.0.0/15 and clear of the simulated cluster of
//! `rivet cluster up` (`198.18.<i>.0/24` pods, `198.19.254.0/24` underlay):
//! simulated node `i` (0-based) has underlay address `198.19.255.<i+1>` and
//! pods `198.19.<i>.<j+1>`, so up to [`MAX_NODES`] nodes of up to
//! [`MAX_PODS_PER_NODE`] pods (IPv4 only: one ipcache entry per pod).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aya::maps::lpm_trie::LpmTrie;
use aya::maps::{MapData, MapError};
use futures::{StreamExt, TryStreamExt};
use rivet_common::cluster::{EncapsulationMode, NodeRecord, NodeRecordAddress, NodeRecordEncapsulation, RecordSource};
use rivet_common::controller::Controllers;
use rivet_common::grpc::BootId;
use rivet_common::labels::{LabelError, Labels};
use rivet_common::testing::{DaemonCommand, DaemonProcess};
use rivet_datapath::maps::{IpcacheKey, IpcacheKeyData, IpcacheValue};
use rivet_datapath::spec::IPCACHE;
use svc_identity::allocator::{AllocError, AllocatorOptions, IdentityAllocator};
use svc_identity::backend::{BackendError, IdentityBackend, IpEntry};
use svc_identity::etcd_backend::{EtcdBackend, EtcdOptions};

use crate::loader::LoaderNode;

/// Simulated nodes at most (underlay 198.19.255.1-254, one /24 of pods each).
pub const MAX_NODES: u32 = 254;
/// Pods per simulated node at most (one /24).
pub const MAX_PODS_PER_NODE: u32 = 254;
/// The namespace of the simulated pods (an identity label).
pub const NAMESPACE: &str = "scale";
/// The lease TTL of the simulated nodes.
pub const LEASE_TTL: Duration = Duration::from_secs(30);
/// Concurrent etcd writes of the generator.
const CONCURRENCY: usize = 64;
/// The first id of [`SimulatedCluster::add_identities`]: past
/// svc-identity's default `--max-identity`.
pub const BULK_FIRST_ID: u32 = rivet_common::identity::DEFAULT_MAX_CLUSTER_IDENTITY + 1;
/// Identities per transaction of [`SimulatedCluster::add_identities`]: two
/// puts each, within etcd's default `--max-txn-ops` of 128.
pub const IDENTITY_BATCH: usize = 50;

/// Why the load generator or the observed node failed.
#[derive(Debug, thiserror::Error)]
pub enum ScaleError {
    /// The counts are out of the address plan.
    #[error(
        "a simulated cluster of {nodes} nodes x {pods} pods does not fit the address plan (at most {MAX_NODES} x {MAX_PODS_PER_NODE}, and at least 1 app)"
    )]
    TooLarge {
        /// Nodes asked for.
        nodes: u32,
        /// Pods per node asked for.
        pods: u32,
    },
    /// A simulated node's store failed.
    #[error("simulated node {node}: {action}: {source}")]
    Store {
        /// The node.
        node: String,
        /// What it was doing.
        action: String,
        /// The store's error.
        source: Box<BackendError>,
    },
    /// A simulated node's identity allocation failed.
    #[error("simulated node {node}: allocating the identity of {labels}: {source}")]
    Allocate {
        /// The node.
        node: String,
        /// The labels.
        labels: String,
        /// The allocator's error.
        source: Box<AllocError>,
    },
    /// Writing a node record failed.
    #[error("simulated node {node}: publishing its node record: {source}")]
    NodeRecord {
        /// The node.
        node: String,
        /// etcd's error.
        source: Box<etcd_client::Error>,
    },
    /// Writing a batch of identities failed.
    #[error("simulated node {node}: putting identities {first}..={last}: {source}")]
    Identities {
        /// The node holding them.
        node: String,
        /// The batch's first id.
        first: u32,
        /// Its last id.
        last: u32,
        /// etcd's error.
        source: Box<etcd_client::Error>,
    },
    /// A label set could not be built.
    #[error("the labels of app {app}: {source}")]
    Labels {
        /// The app's number.
        app: u32,
        /// Why.
        source: LabelError,
    },
    /// The observed node's pinned ipcache could not be opened or read.
    #[error("reading the pinned ipcache in {pins}: {detail}")]
    Ipcache {
        /// The pin directory.
        pins: String,
        /// What failed.
        detail: String,
    },
    /// Starting the observed node's daemons failed.
    #[error("starting the observed node: {0}")]
    Start(#[from] std::io::Error),
}

/// What to simulate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScaleSpec {
    /// Simulated nodes.
    pub nodes: u32,
    /// Pods per simulated node.
    pub pods_per_node: u32,
    /// Distinct pod label sets (apps) in the cluster: pod `k` of the
    /// cluster (node-major) runs app `k % apps`, so every app runs on many
    /// nodes (a shared identity with a value key per node).
    pub apps: u32,
    /// Cluster name (`ip/v1/<cluster>/`, `nodes/v1/<cluster>/`).
    pub cluster: String,
    /// Encapsulation written in the node records.
    pub encapsulation: EncapsulationMode,
}

impl ScaleSpec {
    /// `nodes` x `pods_per_node` in cluster `default`, VXLAN, 100 apps.
    pub fn new(nodes: u32, pods_per_node: u32) -> Self {
        Self {
            nodes,
            pods_per_node,
            apps: 100,
            cluster: svc_identity::etcd_backend::DEFAULT_CLUSTER.to_string(),
            encapsulation: EncapsulationMode::Vxlan,
        }
    }

    fn check(&self) -> Result<(), ScaleError> {
        let fits = (1..=MAX_NODES).contains(&self.nodes) && self.pods_per_node <= MAX_PODS_PER_NODE && self.apps > 0;
        fits.then_some(()).ok_or(ScaleError::TooLarge {
            nodes: self.nodes,
            pods: self.pods_per_node,
        })
    }

    /// The name of simulated node `i`.
    pub fn node_name(&self, i: u32) -> String {
        format!("sim-{}-{i:03}", std::process::id())
    }

    /// The underlay IPv4 of simulated node `i`.
    pub fn node_address(i: u32) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, 255, (i + 1) as u8)
    }

    /// The address of pod `j` of simulated node `i` (`j` may pass
    /// `pods_per_node`: the benchmark's extra pods).
    pub fn pod_address(i: u32, j: u32) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, i as u8, (j + 1) as u8)
    }

    /// The identity labels of app `app`.
    pub fn app_labels(app: u32) -> Result<Labels, ScaleError> {
        Labels::parse([
            format!("k8s:app=scale-{app}"),
            format!("k8s:io.kubernetes.pod.namespace={NAMESPACE}"),
        ])
        .map_err(|source| ScaleError::Labels { app, source })
    }
}

/// One simulated node: its store (own lease) and allocator.
#[derive(Debug)]
pub struct SimulatedNode {
    /// Its name.
    pub name: String,
    /// Its underlay IPv4.
    pub address: Ipv4Addr,
    backend: Arc<EtcdBackend>,
    /// Holds the references of its apps (its value keys).
    allocator: Arc<IdentityAllocator>,
    /// Identity by app, of the apps this node runs.
    identities: HashMap<u32, u32>,
    /// Its lease keeper, identity watch and value-key passes (controller
    /// names are unique per node, as in a daemon).
    controllers: Controllers,
}

/// A pod as the observed node must learn it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpectedEntry {
    /// The pod's address.
    pub ip: Ipv4Addr,
    /// Its identity.
    pub identity: u32,
    /// Its node's underlay address (the tunnel endpoint).
    pub node: Ipv4Addr,
}

/// Simulated nodes publishing their pods in etcd; see the module docs.
/// Dropping it stops the lease keepalives (the keys expire after
/// [`LEASE_TTL`], like a crashed node's); [`withdraw`](Self::withdraw)
/// revokes the leases at once.
#[derive(Debug)]
pub struct SimulatedCluster {
    spec: ScaleSpec,
    nodes: Vec<SimulatedNode>,
    expected: Vec<ExpectedEntry>,
    /// Bytes of the IP entries' keys and values in etcd.
    entry_bytes: usize,
}

impl SimulatedCluster {
    /// Connects `spec.nodes` simulated nodes to `etcd_endpoint` (a lease
    /// each), allocates the identities of their apps through each node's
    /// allocator, publishes their node records and then every pod's IP
    /// cache entry, `CONCURRENCY` writes at a time. Returns when all is in
    /// etcd.
    pub async fn publish(etcd_endpoint: &str, spec: ScaleSpec) -> Result<Self, ScaleError> {
        spec.check()?;
        let connected: Vec<SimulatedNode> =
            futures::stream::iter((0..spec.nodes).map(|i| connect_node(etcd_endpoint, &spec, i)))
                .buffered(8)
                .try_collect()
                .await?;
        let mut nodes = Vec::with_capacity(connected.len());
        for (i, mut node) in (0..).zip(connected) {
            let apps: std::collections::BTreeSet<u32> = (0..spec.pods_per_node)
                .map(|j| (i * spec.pods_per_node + j) % spec.apps)
                .collect();
            for app in apps {
                let labels = ScaleSpec::app_labels(app)?;
                let allocated = node
                    .allocator
                    .allocate(&labels, Some(&format!("app-{app}")))
                    .await
                    .map_err(|source| ScaleError::Allocate {
                        node: node.name.clone(),
                        labels: labels.to_string(),
                        source: Box::new(source),
                    })?;
                node.identities.insert(app, allocated.id);
            }
            publish_node_record(&node, &spec, i).await?;
            nodes.push(node);
        }
        let mut expected = Vec::with_capacity((spec.nodes * spec.pods_per_node) as usize);
        for (i, node) in (0..).zip(&nodes) {
            for j in 0..spec.pods_per_node {
                let app = (i * spec.pods_per_node + j) % spec.apps;
                expected.push(ExpectedEntry {
                    ip: ScaleSpec::pod_address(i, j),
                    identity: node.identities[&app],
                    node: node.address,
                });
            }
        }
        let mut cluster = Self {
            spec,
            nodes,
            expected,
            entry_bytes: 0,
        };
        let sizes: Vec<usize> = futures::stream::iter(cluster.expected.iter().map(|e| cluster.publish_entry(e)))
            .buffer_unordered(CONCURRENCY)
            .try_collect()
            .await?;
        cluster.entry_bytes = sizes.iter().sum();
        Ok(cluster)
    }

    /// What was asked for.
    pub fn spec(&self) -> &ScaleSpec {
        &self.spec
    }

    /// The simulated nodes.
    pub fn nodes(&self) -> &[SimulatedNode] {
        &self.nodes
    }

    /// Every pod entry the observed node must hold.
    pub fn expected(&self) -> &[ExpectedEntry] {
        &self.expected
    }

    /// Bytes of the published IP entries, keys and values (what a watcher
    /// of `ip/v1` receives for them, before framing).
    pub fn entry_bytes(&self) -> usize {
        self.entry_bytes
    }

    /// One more pod, `extra` (0-based) beyond the spec's pods, on simulated
    /// node `node`, with the identity of that node's first app: the entry
    /// it publishes (the put has completed when this returns).
    pub async fn add_pod(&self, node: u32, extra: u32) -> Result<ExpectedEntry, ScaleError> {
        let j = self.spec.pods_per_node + extra;
        let sim = &self.nodes[node as usize];
        if j >= MAX_PODS_PER_NODE {
            return Err(ScaleError::TooLarge {
                nodes: self.spec.nodes,
                pods: j + 1,
            });
        }
        let identity = *sim
            .identities
            .values()
            .min()
            .expect("a simulated node runs at least one app");
        let entry = ExpectedEntry {
            ip: ScaleSpec::pod_address(node, j),
            identity,
            node: sim.address,
        };
        self.publish_entry(&entry).await?;
        Ok(entry)
    }

    /// Publishes `e` as its node's svc-identity does; returns the bytes of
    /// its key and value.
    async fn publish_entry(&self, e: &ExpectedEntry) -> Result<usize, ScaleError> {
        let node = self
            .nodes
            .iter()
            .find(|n| n.address == e.node)
            .expect("entries name simulated nodes");
        let [_, _, i, j] = e.ip.octets();
        let entry = IpEntry {
            ip: e.ip.to_string(),
            identity: e.identity,
            host_ip: Some(e.node.to_string()),
            namespace: Some(NAMESPACE.to_string()),
            pod: Some(format!("pod-{i}-{}", u32::from(j) - 1)),
            node: node.name.clone(),
            named_ports: Vec::new(),
        };
        node.backend
            .upsert_ip(&entry)
            .await
            .map_err(|source| ScaleError::Store {
                node: node.name.clone(),
                action: format!("publishing IP cache entry {}", e.ip),
                source: Box::new(source),
            })?;
        let value = serde_json::to_vec(&entry).expect("an IP entry serialises");
        Ok(node.backend.layout().ip_key(&entry.ip).len() + value.len())
    }

    /// `count` more identities in the store, as many label sets no pod of
    /// the spec runs (apps `spec.apps..`, namespace [`NAMESPACE`]), each
    /// held by one simulated node in turn: its master key
    /// `identities/v1/id/<id>` and a value key on that node's lease — the
    /// keys an allocation writes (svc-identity's layout), put
    /// [`IDENTITY_BATCH`] identities to a transaction instead of one each
    /// (an allocation's transaction per identity would take minutes for
    /// 100,000). The ids are [`BULK_FIRST_ID`] upwards, above the
    /// allocators' default range so they never collide with an app's: a
    /// node that is to hold them needs `--max-identity` of at least the
    /// last one returned. Returns the ids in order.
    pub async fn add_identities(&self, count: u32) -> Result<Vec<u32>, ScaleError> {
        let ids: Vec<u32> = (BULK_FIRST_ID..).take(count as usize).collect();
        let batches: Vec<&[u32]> = ids.chunks(IDENTITY_BATCH).collect();
        futures::stream::iter(batches.into_iter().enumerate().map(|(b, batch)| {
            let node = &self.nodes[b % self.nodes.len()];
            let apps = batch.iter().map(|id| self.spec.apps + (id - BULK_FIRST_ID));
            async move {
                let lease = etcd_client::PutOptions::new().with_lease(node.backend.lease_id());
                let layout = node.backend.layout();
                let mut ops = Vec::with_capacity(2 * batch.len());
                for (&id, app) in batch.iter().zip(apps) {
                    let labels = ScaleSpec::app_labels(app)?.to_string();
                    ops.push(etcd_client::TxnOp::put(layout.id_key(id), labels.clone(), None));
                    ops.push(etcd_client::TxnOp::put(
                        layout.value_key(&labels, &node.name),
                        id.to_string(),
                        Some(lease.clone()),
                    ));
                }
                node.backend
                    .etcd_client()
                    .kv_client()
                    .txn(etcd_client::Txn::new().and_then(ops))
                    .await
                    .map_err(|source| ScaleError::Identities {
                        node: node.name.clone(),
                        first: batch[0],
                        last: batch[batch.len() - 1],
                        source: Box::new(source),
                    })?;
                Ok::<_, ScaleError>(())
            }
        }))
        .buffer_unordered(8)
        .try_collect::<()>()
        .await?;
        Ok(ids)
    }

    /// Revokes every simulated node's lease (a clean stop of each): their
    /// node records, value keys and IP entries vanish from etcd at once.
    pub async fn withdraw(self) {
        futures::stream::iter(self.nodes.iter().map(|n| async {
            n.controllers.shutdown().await;
            n.backend.shutdown().await;
        }))
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<()>>()
        .await;
    }
}

/// Connects simulated node `i`: its lease, its allocator (listing the
/// identities, as a starting svc-identity does).
async fn connect_node(endpoint: &str, spec: &ScaleSpec, i: u32) -> Result<SimulatedNode, ScaleError> {
    let controllers = Controllers::new();
    let name = spec.node_name(i);
    let options = EtcdOptions {
        cluster: spec.cluster.clone(),
        lease_ttl: LEASE_TTL,
        ..EtcdOptions::new(vec![endpoint.to_string()], name.clone())
    };
    let backend = Arc::new(
        EtcdBackend::connect(options, &controllers)
            .await
            .map_err(|source| ScaleError::Store {
                node: name.clone(),
                action: "connecting to etcd".into(),
                source: Box::new(source),
            })?,
    );
    let allocator = IdentityAllocator::new(backend.clone(), AllocatorOptions::default());
    allocator.run(&controllers);
    allocator.wait_ready().await;
    Ok(SimulatedNode {
        name,
        address: ScaleSpec::node_address(i),
        backend,
        allocator,
        identities: HashMap::new(),
        controllers,
    })
}

/// Puts node `i`'s record on its lease, as its svc-identity would.
async fn publish_node_record(node: &SimulatedNode, spec: &ScaleSpec, i: u32) -> Result<(), ScaleError> {
    let v4 = ScaleSpec::pod_address(i, 0);
    let record = NodeRecord {
        name: node.name.clone(),
        cluster: spec.cluster.clone(),
        addresses: vec![NodeRecordAddress {
            type_: "InternalIP".into(),
            ip: IpAddr::V4(node.address),
        }],
        pod_cidrs: vec![
            ipnet::IpNet::new(IpAddr::V4(v4), 24)
                .expect("a /24 is a prefix")
                .trunc(),
        ],
        encapsulation: NodeRecordEncapsulation {
            mode: spec.encapsulation,
            port: None,
        },
        boot_id: BootId::random().to_string(),
        health_addresses: Vec::new(),
        source: RecordSource::Node,
    };
    let value = serde_json::to_vec(&record).expect("a node record serialises");
    let mut kv = node.backend.etcd_client().kv_client();
    let lease = etcd_client::PutOptions::new().with_lease(node.backend.lease_id());
    kv.put(node.backend.layout().node_key(&node.name), value, Some(lease))
        .await
        .map_err(|source| ScaleError::NodeRecord {
            node: node.name.clone(),
            source: Box::new(source),
        })?;
    Ok(())
}

/// The kernel's account of the memory of the map pinned at `pin`
/// (`memlock` in its fdinfo: for a map without preallocation, what its
/// entries take now).
pub fn pinned_map_memory(pin: &Path) -> std::io::Result<u64> {
    let fd = rivet_bpf_sys::obj_get(pin)
        .map_err(|e| std::io::Error::new(e.kind(), format!("opening the pin {}: {e}", pin.display())))?;
    let fdinfo = format!("/proc/self/fdinfo/{}", fd.as_raw_fd());
    let text = std::fs::read_to_string(&fdinfo)
        .map_err(|e| std::io::Error::new(e.kind(), format!("reading {fdinfo} ({}): {e}", pin.display())))?;
    text.lines()
        .find_map(|l| l.strip_prefix("memlock:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no memlock line in {fdinfo} ({})", pin.display())))
}

/// The ipcache pinned by a running svc-loader, read directly (the
/// datapath's own lookups).
pub struct IpcacheReader {
    trie: LpmTrie<MapData, IpcacheKeyData, IpcacheValue>,
    pin: PathBuf,
    pins: String,
}

impl std::fmt::Debug for IpcacheReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcacheReader").field("pins", &self.pins).finish()
    }
}

impl IpcacheReader {
    /// Opens `<pin_dir>/ipcache`.
    pub fn open(pin_dir: &Path) -> Result<Self, ScaleError> {
        let pins = pin_dir.display().to_string();
        let err = |detail: String| ScaleError::Ipcache {
            pins: pins.clone(),
            detail,
        };
        let map = rivet_datapath::open_pinned_map(pin_dir, &IPCACHE).map_err(|e| err(e.to_string()))?;
        let trie = LpmTrie::try_from(map).map_err(|e| err(format!("not an LPM trie of ipcache entries: {e}")))?;
        Ok(Self {
            trie,
            pin: pin_dir.join(IPCACHE.name),
            pins,
        })
    }

    /// The kernel's account of the map's memory (`memlock` in its fdinfo:
    /// for an LPM trie without preallocation, what its entries take now).
    pub fn memory_bytes(&self) -> Result<u64, ScaleError> {
        let err = |detail: String| ScaleError::Ipcache {
            pins: self.pins.clone(),
            detail,
        };
        pinned_map_memory(&self.pin).map_err(|e| err(e.to_string()))
    }

    /// What the datapath finds for `ip` (longest prefix match), if anything.
    pub fn lookup(&self, ip: IpAddr) -> Result<Option<IpcacheValue>, ScaleError> {
        match self.trie.get(&IpcacheKey::lookup(ip).to_lpm(), 0) {
            Ok(value) => Ok(Some(value)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(ScaleError::Ipcache {
                pins: self.pins.clone(),
                detail: format!("looking up {ip}: {e}"),
            }),
        }
    }

    /// Whether the datapath finds `e`'s identity and tunnel endpoint for its
    /// address.
    pub fn holds(&self, e: &ExpectedEntry) -> Result<bool, ScaleError> {
        Ok(self
            .lookup(IpAddr::V4(e.ip))?
            .is_some_and(|v| v.identity == e.identity && v.tunnel_endpoint_addr() == Some(e.node)))
    }

    /// Keeps the entries of `expected` the datapath does not hold yet.
    pub fn missing(&self, expected: &mut Vec<ExpectedEntry>) -> Result<(), ScaleError> {
        let mut error = None;
        expected.retain(|e| match self.holds(e) {
            Ok(held) => !held,
            Err(e) => {
                error.get_or_insert(e);
                true
            }
        });
        error.map_or(Ok(()), Err)
    }

    /// Polls (every `every`) until the datapath holds every entry of
    /// `expected` or `timeout` passed; returns the time it took, or the
    /// entries still missing.
    pub async fn wait_for(
        &self,
        expected: &[ExpectedEntry],
        every: Duration,
        timeout: Duration,
    ) -> Result<Result<Duration, Vec<ExpectedEntry>>, ScaleError> {
        let started = Instant::now();
        let mut missing = expected.to_vec();
        loop {
            self.missing(&mut missing)?;
            if missing.is_empty() {
                return Ok(Ok(started.elapsed()));
            }
            if started.elapsed() >= timeout {
                return Ok(Err(missing));
            }
            tokio::time::sleep(every).await;
        }
    }
}

/// A real node as far as the ipcache goes: svc-loader in a node namespace
/// with room for `ipcache_max` prefixes, and svc-identity on etcd (same
/// node name, cluster, socket dir), pushing the cluster's IP cache to the
/// loader. Removed on drop.
#[derive(Debug)]
pub struct EtcdNode {
    /// svc-identity (drops first).
    pub identity: DaemonProcess,
    /// The node namespace and svc-loader.
    pub node: LoaderNode,
}

impl EtcdNode {
    /// Starts svc-loader from `bin_dir` (endpoint map sized so that the
    /// ipcache gets `ipcache_max` entries), then svc-identity on
    /// `etcd_endpoint` in `cluster`, with `identity_args` added.
    pub async fn start(
        bin_dir: &Path,
        etcd_endpoint: &str,
        cluster: &str,
        ipcache_max: u32,
        identity_args: &[&str],
    ) -> Result<Self, ScaleError> {
        // The test loader sizes the ipcache at twice its endpoint map.
        let endpoints_max = ipcache_max.div_ceil(2);
        let node = LoaderNode::start_with_env(&bin_dir.join("svc-loader"), &[], &[], endpoints_max, |_| Ok(Vec::new()))
            .await?;
        let dir = node.dir.path();
        let sockets = dir.join("sockets");
        let identity = DaemonCommand::new(bin_dir.join("svc-identity"), sockets.join("svc-identity.sock"))
            .args(["--socket-dir".as_ref(), sockets.as_os_str()])
            .args(["--state-dir".as_ref(), dir.join("state").as_os_str()])
            .args(["--node-name", &node.node_name, "--cluster-name", cluster])
            .args(["--etcd-endpoints", etcd_endpoint])
            .args(identity_args)
            .log_to(dir.join("svc-identity.log"))
            .spawn()
            .await?;
        Ok(Self { identity, node })
    }

    /// The loader's pinned ipcache.
    pub fn ipcache(&self) -> Result<IpcacheReader, ScaleError> {
        IpcacheReader::open(&self.node.pins.0)
    }
}
