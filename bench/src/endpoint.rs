//! `endpoint`: svc-endpoint on one simulated node with every daemon real
//! (svc-loader in the node namespace, svc-identity with its embedded store,
//! svc-ipam, svc-endpoint), release build:
//!
//! 1. first-regeneration latency: the wall time of a synchronous
//!    CreateEndpoint, one endpoint after the other (p50/p99 over `--first`);
//! 2. a policy change: UpsertPolicy(wait) of a NetworkPolicy selecting every
//!    endpoint (`--policy-endpoints` of them) until it returns, then checked
//!    in svc-loader: every endpoint holds the new revision, enforced;
//! 3. restore: svc-endpoint is killed with SIGKILL at `--restore-endpoints`
//!    endpoints and restarted; the time from the restart until GetStatus
//!    reports restore COMPLETE with all of them restored (goal ≤ 3 s);
//! 4. the VmRSS of the four daemons at that size, and their sum.
//!
//! Peer, measured in the same run and interleaved with (1): svc-loader's
//! ApplyEndpoint alone for fresh endpoints of the same shape on the same
//! kind of interfaces, on a second node with an identical loader (same flags,
//! as many veths) and no svc-endpoint (which removes datapath entries it
//! does not own, so the peer cannot share its loader). That is the datapath
//! step of a regeneration, its floor.
//! ratio = first-regeneration p50 / raw ApplyEndpoint p50 (lower is better).
//!
//! Endpoints have no pod namespace: each is a veth pair with both ends in
//! the node namespace (`rvhe<i>`, the host side the loader acts on, and
//! `rvqe<i>` with the endpoint's MAC), all created with one `ip -batch`, and
//! one IPv4 address from svc-ipam. One address takes two entries of the
//! loader's endpoints map, so both loaders get `--endpoints-max` 2048 (the
//! test loader's 1024 holds 512 such endpoints). Everything lives in the two node
//! namespaces, their temp dirs and pin dirs, removed when the nodes drop
//! (also on error): deleting a namespace deletes its veths in one batch,
//! far faster than one by one.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::mac::format_mac;
use rivet_common::testing::netns::NetNs;
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::endpoint_service_client::EndpointServiceClient;
use rivet_proto::endpoint::v1::policy_service_client::PolicyServiceClient;
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::ipam::v1::ipam_client::IpamClient;
use rivet_proto::loader::v1 as ldpb;
use rivet_proto::loader::v1::loader_service_client::LoaderServiceClient;
use rivet_testkit::loader::HOST_PREFIX;
use rivet_testkit::node::{EndpointNode, NodeOptions};

use crate::procfs::{memory, pid, rss_mib};
use crate::report::{BenchResult, ms, percentile, sibling_binary};

/// The node's IPv4 pool (`rivet_testkit::node::POOL4`, a /22) bounds the
/// node size.
pub(crate) const MAX_ENDPOINTS: u32 = 1000;
/// svc-loader's endpoints map: one entry per endpoint plus one per address
/// (the test loader's default 1024 holds only 512 of these endpoints).
pub(crate) const LOADER_ENDPOINTS_MAX: u32 = 2 * MAX_ENDPOINTS + 48;
/// Distinct `app` labels, so endpoints share a handful of identities like
/// replicas do.
pub(crate) const APPS: u32 = 10;
/// Selects every endpoint (they all carry `tier=bench`), ingress from any
/// pod of the namespace (all `APPS` identities) on two ports.
pub(crate) const POLICY: &str = r#"apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: bench-all
  namespace: default
spec:
  podSelector:
    matchLabels:
      tier: bench
  policyTypes: [Ingress]
  ingress:
    - from:
        - podSelector: {}
      ports:
        - protocol: TCP
          port: 80
        - protocol: TCP
          port: 443
"#;

/// Options of the endpoint benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct EndpointArgs {
    /// Endpoints created one by one for the first-regeneration latency
    /// (and raw ApplyEndpoint calls on the peer node).
    #[arg(long, default_value_t = 200)]
    first: u32,
    /// Endpoints on the node when the policy selecting all of them is applied.
    #[arg(long, default_value_t = 500)]
    policy_endpoints: u32,
    /// Endpoints on the node when svc-endpoint is killed and restored (at most 1000).
    #[arg(long, default_value_t = 1000)]
    restore_endpoints: u32,
    /// Concurrent CreateEndpoint calls while growing the node between the
    /// measurements.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Restore goal, milliseconds (reported, not enforced).
    #[arg(long, default_value_t = 3000)]
    restore_goal_ms: u64,
}

/// Client deadline: long enough for a policy realised on every endpoint.
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// How long restore may take before the benchmark gives up.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(120);

/// One endpoint's host interface: a veth with both ends in the node namespace.
#[derive(Debug, Clone)]
struct Veth {
    host: String,
    ifindex: u32,
    /// The other end's MAC: the endpoint's ("pod") MAC.
    mac: [u8; 6],
}

/// Runs the benchmark.
pub async fn run(args: &EndpointArgs) -> anyhow::Result<BenchResult> {
    anyhow::ensure!(
        args.first > 0
            && args.first <= args.policy_endpoints
            && args.policy_endpoints <= args.restore_endpoints
            && args.restore_endpoints <= MAX_ENDPOINTS,
        "need 0 < --first <= --policy-endpoints <= --restore-endpoints <= {MAX_ENDPOINTS} \
         (the node's /22 pool)"
    );
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be positive");
    let loader_bin = sibling_binary("svc-loader")?;
    for daemon in ["svc-identity", "svc-ipam", "svc-endpoint"] {
        sibling_binary(daemon)?;
    }
    let bin_dir = loader_bin
        .parent()
        .ok_or_else(|| anyhow::anyhow!("{} has no parent dir", loader_bin.display()))?
        .to_path_buf();

    let setup = Instant::now();
    // Guards: dropped on every return path, each node removes its daemons,
    // namespaces (with the veths), pins and temp dir (with svc-ipam's,
    // svc-identity's and svc-endpoint's state).
    let node_options = NodeOptions {
        bin_dir: Some(bin_dir),
        loader_endpoints_max: Some(LOADER_ENDPOINTS_MAX),
        ..NodeOptions::default()
    };
    let peer = EndpointNode::start(NodeOptions {
        without_endpoint_daemon: true,
        ..node_options.clone()
    })
    .await?;
    let mut node = EndpointNode::start(node_options).await?;
    // As many interfaces on both nodes; the peer uses the first `--first`.
    let peer_veths = add_veths(&peer.node.node.ns, 'r', args.restore_endpoints)?;

    let options = ClientOptions {
        request_timeout: CALL_TIMEOUT,
        ..ClientOptions::default()
    };
    let mut endpoints = EndpointServiceClient::new(node.connect("svc-endpoint", &options).await?);
    let mut policies = PolicyServiceClient::new(node.connect("svc-endpoint", &options).await?);
    let ipam = IpamClient::new(node.connect("svc-ipam", &options).await?);
    let mut loader = LoaderServiceClient::new(node.connect("svc-loader", &options).await?);
    let mut raw = LoaderServiceClient::new(connect_unix(peer.node.loader.socket(), &options).await?);

    // Interfaces and addresses for every endpoint, up front (not measured).
    let requests = endpoint_requests(&node, &ipam, args.restore_endpoints, args.concurrency).await?;
    println!(
        "setup: two nodes, {} + {} veths, as many addresses from svc-ipam in {:.1} s",
        requests.len(),
        peer_veths.len(),
        setup.elapsed().as_secs_f64()
    );

    // 1. First regenerations, one at a time, interleaved with the peer.
    let first = args.first as usize;
    let (mut rivet_ms, mut raw_ms) = (Vec::with_capacity(first), Vec::with_capacity(first));
    for (i, (request, veth)) in requests[..first].iter().zip(&peer_veths).enumerate() {
        let apply = raw_apply_request(i as u32, veth);
        // Alternate which goes first.
        if i % 2 == 1 {
            raw_ms.push(timed_ms(raw.apply_endpoint(apply.clone())).await?);
        }
        let started = Instant::now();
        let created = endpoints.create_endpoint(request.clone()).await?.into_inner();
        rivet_ms.push(ms(started.elapsed()));
        let ep = created.endpoint.unwrap_or_default();
        anyhow::ensure!(
            created.created && ep.state == pb::EndpointState::Ready as i32,
            "endpoint {i} was not created ready: {ep:?}"
        );
        if i % 2 == 0 {
            raw_ms.push(timed_ms(raw.apply_endpoint(apply)).await?);
        }
    }
    let (regen_p50, regen_p99) = (percentile(&mut rivet_ms, 0.50), percentile(&mut rivet_ms, 0.99));
    let (raw_p50, raw_p99) = (percentile(&mut raw_ms, 0.50), percentile(&mut raw_ms, 0.99));
    println!(
        "first regeneration (sync CreateEndpoint, {first} one by one): p50 {regen_p50:.2} ms, p99 {regen_p99:.2} ms"
    );
    println!("raw svc-loader ApplyEndpoint ({first} fresh endpoints): p50 {raw_p50:.2} ms, p99 {raw_p99:.2} ms");

    // 2. Grow to the policy size; one policy selecting all of them.
    let policy_n = args.policy_endpoints as usize;
    let grow1 = create_all(&endpoints, &requests[first..policy_n], args.concurrency).await?;
    let policy_started = Instant::now();
    let upserted = policies
        .upsert_policy(pb::UpsertPolicyRequest {
            document: POLICY.into(),
            origin: pb::PolicyOrigin::Api.into(),
            wait: true,
        })
        .await?
        .into_inner();
    let policy_ms = ms(policy_started.elapsed());
    anyhow::ensure!(
        upserted.changed
            && upserted.affected_endpoints as usize == policy_n
            && upserted.realised_endpoints as usize == policy_n,
        "the policy must select and be realised on all {policy_n} endpoints: {upserted:?}"
    );
    let entries = check_datapath(&mut loader, policy_n, upserted.revision).await?;
    println!(
        "policy change selecting {policy_n} endpoints (UpsertPolicy wait=true): {policy_ms:.0} ms \
         ({:.2} ms per endpoint); svc-loader holds revision {} with {entries} entries on each",
        policy_ms / policy_n as f64,
        upserted.revision
    );

    // 3. Grow to the restore size; memory; kill -9 and restore.
    let restore_n = args.restore_endpoints as usize;
    let grow2 = create_all(&endpoints, &requests[policy_n..restore_n], args.concurrency).await?;
    let grown = restore_n - first;
    let create_per_s = if grown == 0 {
        f64::NAN
    } else {
        grown as f64 / (grow1 + grow2).as_secs_f64()
    };
    println!(
        "growing to {restore_n} endpoints: {grown} CreateEndpoint with {} concurrent callers, {create_per_s:.0}/s",
        args.concurrency
    );
    check_datapath(&mut loader, restore_n, upserted.revision).await?;
    let daemons = [
        ("svc_loader", pid(node.node.loader.pid())?, "svc-loader"),
        ("svc_identity", pid(node.identity.pid())?, "svc-identity"),
        ("svc_ipam", pid(node.ipam.pid())?, "svc-ipam"),
        ("svc_endpoint", pid(node.endpoint_daemon().pid())?, "svc-endpoint"),
    ];
    let mut rss: Vec<(&str, f64)> = Vec::new();
    for (metric, pid, name) in daemons {
        let m = memory(pid, name)?;
        println!(
            "{name}: VmRSS {:.1} MiB (anonymous {:.1}, file {:.1}), {} threads",
            m.rss, m.anon, m.file, m.threads
        );
        rss.push((metric, m.rss));
    }
    let rss_sum: f64 = rss.iter().map(|(_, v)| v).sum();
    println!(
        "VmRSS at {restore_n} endpoints: {} = {rss_sum:.1} MiB",
        rss.iter()
            .map(|(n, v)| format!("{} {v:.1} MiB", n.replace('_', "-")))
            .collect::<Vec<_>>()
            .join(", ")
    );

    drop(endpoints);
    drop(policies);
    let daemon = node.endpoint_daemon();
    daemon.kill9();
    let restarted = Instant::now();
    daemon.restart().await?;
    let answering_ms = ms(restarted.elapsed());
    let status = wait_restored(&node.sockets(), &options, restarted).await?;
    let restore_ms = ms(restarted.elapsed());
    let restore = status.restore.unwrap_or_default();
    anyhow::ensure!(
        restore.found as usize == restore_n && restore.restored as usize == restore_n,
        "restore must bring back all {restore_n} endpoints: {restore:?}"
    );
    let logged_ms = restore_took_ms(&node.endpoint_daemon().log());
    let rss_after = rss_mib(pid(node.endpoint_daemon().pid())?, "svc-endpoint")?;
    check_datapath(&mut loader, restore_n, upserted.revision).await?;
    let goal_met = restore_ms <= args.restore_goal_ms as f64;
    println!(
        "restore of {restore_n} endpoints after kill -9: {restore_ms:.0} ms from restart to COMPLETE \
         (answering after {answering_ms:.0} ms; svc-endpoint logged took_ms={}); goal <= {} ms: {}",
        logged_ms.map_or("?".to_string(), |v| v.to_string()),
        args.restore_goal_ms,
        if goal_met { "met" } else { "NOT met" }
    );
    println!("svc-endpoint VmRSS after restore: {rss_after:.1} MiB");

    let ratio = regen_p50 / raw_p50;
    println!(
        "ratio = first-regeneration p50 / raw ApplyEndpoint p50 = {ratio:.2} (lower is better; 1 would mean \
         identity, policy, ipcache, state dir and the extra process hop cost nothing beyond the datapath step)"
    );

    let mut metrics = vec![
        ("first_regeneration_p50_ms".into(), regen_p50),
        ("first_regeneration_p99_ms".into(), regen_p99),
        ("raw_apply_endpoint_p50_ms".into(), raw_p50),
        ("raw_apply_endpoint_p99_ms".into(), raw_p99),
        ("first_endpoints".into(), first as f64),
        ("policy_change_ms".into(), policy_ms),
        ("policy_endpoints".into(), policy_n as f64),
        ("create_concurrent_per_s".into(), create_per_s),
        ("restore_ms".into(), restore_ms),
        ("restore_logged_ms".into(), logged_ms.map_or(f64::NAN, |v| v as f64)),
        ("restore_endpoints".into(), restore_n as f64),
        ("restore_goal_ms".into(), args.restore_goal_ms as f64),
        ("restore_goal_met".into(), f64::from(u8::from(goal_met))),
    ];
    for (name, value) in &rss {
        metrics.push((format!("rss_{name}_mib"), *value));
    }
    metrics.push(("rss_sum_mib".into(), rss_sum));
    metrics.push(("rss_svc_endpoint_after_restore_mib".into(), rss_after));
    drop(node);
    drop(peer);
    Ok(BenchResult {
        name: "endpoint".into(),
        metrics,
        ratio,
    })
}

async fn timed_ms<T, E>(call: impl Future<Output = Result<T, E>>) -> anyhow::Result<f64>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let started = Instant::now();
    call.await?;
    Ok(ms(started.elapsed()))
}

/// `count` veth pairs in `ns`, both ends there and up: `rvh<tag><i>` (the
/// loader's prefix) and `rvq<tag><i>` carrying the endpoint's MAC. One
/// `ip -batch`; they go when the namespace is deleted.
fn add_veths(ns: &NetNs, tag: char, count: u32) -> anyhow::Result<Vec<Veth>> {
    let mut batch = String::new();
    let mut veths = Vec::with_capacity(count as usize);
    for i in 0..count {
        let host = format!("{HOST_PREFIX}{tag}{i}");
        let peer = format!("rvq{tag}{i}");
        // Locally administered, unicast; 0x72 0x76 = "rv".
        let mac = [0x02, 0x72, 0x76, tag as u8, (i >> 8) as u8, i as u8];
        batch.push_str(&format!(
            "link add {host} mtu 1500 type veth peer name {peer} address {}\nlink set {host} up\nlink set {peer} up\n",
            format_mac(&mac)
        ));
        veths.push(Veth { host, ifindex: 0, mac });
    }
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), batch)?;
    let path = file
        .path()
        .to_str()
        .ok_or_else(|| anyhow::anyhow!("temp path is not UTF-8"))?;
    ns.ip(&["-batch", path])?;
    let listed: serde_json::Value = serde_json::from_str(&ns.ip(&["-j", "link", "show", "type", "veth"])?)?;
    let indexes: HashMap<&str, u32> = listed
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| Some((l["ifname"].as_str()?, u32::try_from(l["ifindex"].as_u64()?).ok()?)))
        .collect();
    for veth in &mut veths {
        veth.ifindex = *indexes
            .get(veth.host.as_str())
            .ok_or_else(|| anyhow::anyhow!("{} was not created in {}", veth.host, ns.name()))?;
    }
    Ok(veths)
}

/// The synchronous CreateEndpoint requests of `count` endpoints `bench-<i>`
/// of `node`: a veth pair each in the node namespace ([`add_veths`], tag
/// `e`), one IPv4 address each from svc-ipam, labels `app=bench-<i % 10>`
/// and `tier=bench` (ignored in Kubernetes mode, where the Pod's labels
/// count).
pub(crate) async fn endpoint_requests(
    node: &EndpointNode,
    ipam: &IpamClient<DaemonChannel>,
    count: u32,
    concurrency: usize,
) -> anyhow::Result<Vec<pb::CreateEndpointRequest>> {
    let node_ns = &node.node.node.ns;
    let veths = add_veths(node_ns, 'e', count)?;
    let netns_path = node_ns.path().display().to_string();
    let addresses = allocate(ipam, count, concurrency).await?;
    Ok(veths
        .iter()
        .zip(&addresses)
        .enumerate()
        .map(|(i, (veth, (pool, address)))| create_request(i as u32, veth, pool, address, &netns_path))
        .collect())
}

/// One IPv4 address per endpoint `bench-<i>` (interface eth0) from the
/// default pool: `(pool, address)` in endpoint order.
async fn allocate(
    ipam: &IpamClient<DaemonChannel>,
    count: u32,
    concurrency: usize,
) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    futures::stream::iter(0..count)
        .map(|i| {
            let mut ipam = ipam.clone();
            async move {
                let allocation = ipam
                    .allocate(ipampb::AllocateRequest {
                        owner: Some(ipampb::Owner {
                            container_id: container_id(i),
                            interface: "eth0".into(),
                        }),
                        pool: "default".into(),
                        family: ipampb::Family::Ipv4.into(),
                        requested_address: Vec::new(),
                    })
                    .await?
                    .into_inner()
                    .allocation
                    .ok_or_else(|| anyhow::anyhow!("svc-ipam returned no allocation for {}", container_id(i)))?;
                anyhow::Ok((allocation.pool, allocation.address))
            }
        })
        .buffered(concurrency)
        .try_collect()
        .await
}

pub(crate) fn container_id(i: u32) -> String {
    format!("bench-{i}")
}

/// The synchronous CreateEndpoint of endpoint `i`.
fn create_request(i: u32, veth: &Veth, pool: &str, address: &[u8], netns_path: &str) -> pb::CreateEndpointRequest {
    pb::CreateEndpointRequest {
        container_id: container_id(i),
        interface: "eth0".into(),
        // No pod namespace of its own; nothing reads it back.
        netns_path: netns_path.into(),
        host_interface: veth.host.clone(),
        host_ifindex: veth.ifindex,
        addresses: vec![pb::EndpointAddress {
            address: address.to_vec(),
            ipam_pool: pool.into(),
        }],
        mac: veth.mac.to_vec(),
        pod_namespace: "default".into(),
        pod_name: container_id(i),
        labels: vec![format!("k8s:app=bench-{}", i % APPS), "k8s:tier=bench".into()],
        ..Default::default()
    }
}

/// What svc-endpoint sends for a first regeneration without policy: one
/// IPv4 address, the MAC, an identity, a policy enforcing nothing.
fn raw_apply_request(i: u32, veth: &Veth) -> ldpb::ApplyEndpointRequest {
    ldpb::ApplyEndpointRequest {
        endpoint_id: i + 1,
        host_ifindex: veth.ifindex,
        // 198.18.8.2 upwards: inside 198.18.0.0/15, outside the other node's pool.
        addresses: vec![vec![198, 18, 8 + (i / 250) as u8, (i % 250) as u8 + 2]],
        mac: veth.mac.to_vec(),
        identity: 256 + i % APPS,
        policy: Some(ldpb::EndpointPolicy {
            revision: 1,
            enforce_ingress: false,
            enforce_egress: false,
            allow_from_host: true,
            entries: Vec::new(),
            prefixes: Vec::new(),
        }),
    }
}

/// Synchronous creates, `concurrency` at a time; the wall time of all.
pub(crate) async fn create_all(
    endpoints: &EndpointServiceClient<DaemonChannel>,
    requests: &[pb::CreateEndpointRequest],
    concurrency: usize,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    futures::stream::iter(requests.iter().cloned())
        .map(|request| {
            let mut client = endpoints.clone();
            async move {
                let name = request.container_id.clone();
                let created = client.create_endpoint(request).await?.into_inner();
                let state = created.endpoint.map(|e| e.state).unwrap_or_default();
                anyhow::ensure!(
                    created.created && state == pb::EndpointState::Ready as i32,
                    "endpoint {name} was not created ready (state {state})"
                );
                anyhow::Ok(())
            }
        })
        .buffer_unordered(concurrency)
        .try_collect::<()>()
        .await?;
    Ok(started.elapsed())
}

/// Checks that svc-loader holds exactly `count` endpoints, each with policy
/// `revision` (or newer) enforced on ingress; returns the entries of one.
pub(crate) async fn check_datapath(
    loader: &mut LoaderServiceClient<DaemonChannel>,
    count: usize,
    revision: u64,
) -> anyhow::Result<u32> {
    let listed = loader.list_endpoints(ldpb::ListEndpointsRequest {}).await?.into_inner();
    anyhow::ensure!(
        listed.endpoints.len() == count,
        "svc-loader holds {} endpoints, expected {count}",
        listed.endpoints.len()
    );
    let stale: Vec<_> = listed
        .endpoints
        .iter()
        .filter(|e| e.policy_revision < revision || !e.enforce_ingress || e.policy_entries == 0)
        .map(|e| (e.endpoint_id, e.policy_revision, e.enforce_ingress, e.policy_entries))
        .collect();
    anyhow::ensure!(
        stale.is_empty(),
        "{} endpoints do not hold policy revision {revision} (id, revision, enforced, entries): {:?}",
        stale.len(),
        &stale[..stale.len().min(10)]
    );
    let sample = listed.endpoints.first().map_or(0, |e| e.endpoint_id);
    let policy = loader
        .get_endpoint_policy(ldpb::GetEndpointPolicyRequest { endpoint_id: sample })
        .await?
        .into_inner();
    anyhow::ensure!(
        policy.revision >= revision && !policy.entries.is_empty(),
        "endpoint {sample}'s policy in svc-loader is not revision {revision}: {policy:?}"
    );
    Ok(policy.entries.len() as u32)
}

/// Polls svc-endpoint's GetStatus until restore is COMPLETE.
async fn wait_restored(
    sockets: &Path,
    options: &ClientOptions,
    since: Instant,
) -> anyhow::Result<pb::GetStatusResponse> {
    let mut client = EndpointServiceClient::new(connect_unix(&sockets.join("svc-endpoint.sock"), options).await?);
    loop {
        let status = client.get_status(pb::GetStatusRequest {}).await?.into_inner();
        if status
            .restore
            .as_ref()
            .is_some_and(|r| r.phase == pb::RestorePhase::Complete as i32)
        {
            return Ok(status);
        }
        anyhow::ensure!(
            since.elapsed() < RESTORE_TIMEOUT,
            "restore not complete after {RESTORE_TIMEOUT:?}: {:?}",
            status.restore
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `took_ms` of the last "endpoint restore complete" line of the log.
fn restore_took_ms(log: &str) -> Option<u64> {
    let line = log.lines().rev().find(|l| l.contains("endpoint restore complete"))?;
    let rest = &line[line.find("took_ms")? + "took_ms".len()..];
    let digits: String = rest
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn took_ms_is_read_from_text_and_json_logs() {
        let text = "2026-11-22T01:02:03Z  INFO svc_endpoint::events: endpoint restore complete found=3 took_ms=1234\n";
        assert_eq!(restore_took_ms(text), Some(1234));
        let json = r#"{"fields":{"message":"endpoint restore complete","took_ms":87}}"#;
        assert_eq!(restore_took_ms(json), Some(87));
        assert_eq!(restore_took_ms("nothing here"), None);
    }
}
