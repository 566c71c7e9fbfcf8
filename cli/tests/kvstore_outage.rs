//! Two nodes made by `rivet node up --create-netns --etcd-endpoints ...`
//! sharing one real etcd, which is stopped under traffic for a few seconds
//! (the mechanism is what is tested, not the length of the outage): pods
//! keep their traffic, pods of known label sets start, a pod of a new label
//! set retries within the CNI deadline (it fails with the kvstore reason
//! when etcd stays away, and starts when etcd comes back in time), deletes
//! (also `--force`) are done locally, `rivet status` says the node is
//! degraded;
//! when etcd is back everything converges (the other node's IP cache, the
//! keys in etcd, svc-ipam, svc-endpoint) and nothing is left; a node that
//! stops cleanly takes its keys with it at once. And svc-identity killed
//! (-9) during the outage restarts from its local snapshot and serves
//! (svc-loader's push, known label sets) until etcd is back.
//!
//! Needs root, a bpffs at /sys/fs/bpf, the rivet users (`cargo xtask
//! install`) and the workspace binaries beside `rivet` (`cargo build
//! --bins`). Addresses come from 198.18.0.0/15 and 2001:2::/48 only.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use etcd_client::GetOptions;
use rivet_common::testing::etcd::EtcdServer;
use support::{TestNode, eventually};

mod support;

/// The lease TTL of both nodes: far longer than anything the test waits
/// for, so keys that go did not expire, something deleted them.
const LEASE_TTL_SECONDS: u64 = 30;

/// Each node's CNI deadline (a pod whose label set needs the kvstore waits
/// at most this long).
const CNI_TIMEOUT_SECONDS: &str = "10";

fn shown(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A node of its own namespace and temp dir on the shared etcd, with
/// `pools` (`default=<v4>,<v6>`), [`LEASE_TTL_SECONDS`] and
/// [`CNI_TIMEOUT_SECONDS`].
fn node_on(etcd: &str, pools: &str) -> TestNode {
    node_with(etcd, pools, &[])
}

/// [`node_on`] with more `rivet node up` flags.
fn node_with(etcd: &str, pools: &str, extra: &[&str]) -> TestNode {
    let ttl = format!("svc-identity=--lease-ttl-seconds={LEASE_TTL_SECONDS}");
    let mut args = vec![
        "--pool",
        pools,
        "--etcd-endpoints",
        etcd,
        "--daemon-arg",
        &ttl,
        "--cni-timeout-seconds",
        CNI_TIMEOUT_SECONDS,
    ];
    args.extend(extra);
    TestNode::up_with(&args)
}

fn run(node: &TestNode, args: &[&str]) -> Output {
    node.rivet(args).output().expect("running rivet")
}

fn add_pod(node: &TestNode, pod: &str, app: &str) -> Output {
    let label = format!("app={app}");
    run(node, &["pod", "add", pod, "--label", &label])
}

/// The node's effective IP cache: prefix → publishing node.
fn ipcache(node: &TestNode) -> BTreeMap<String, String> {
    node.json(&["ipcache", "list"])
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["prefix"].as_str().unwrap().to_string(),
                e["node"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The network namespace of pod `default/<pod>` (the node's name is its
/// namespace's).
fn pod_netns(node: &TestNode, pod: &str) -> String {
    format!("rivet-pod-{}-default-{pod}", node.netns)
}

/// Pings that run until stopped: `ping` in a pod's namespace, ended with
/// SIGINT (it then prints its summary).
struct Pinger(Option<Child>);

impl Pinger {
    fn start(netns: &str, to: &str) -> Self {
        let child = Command::new("ip")
            .args(["netns", "exec", netns, "ping", "-i", "0.2", "-W", "1", to])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting ping");
        Self(Some(child))
    }

    /// Stops it; returns (sent, received) and its output.
    fn stop(mut self) -> (u32, u32, String) {
        let child = self.0.take().expect("running");
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT to ping");
        let out = child.wait_with_output().expect("ping ends");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = text
            .lines()
            .find(|l| l.contains("packets transmitted"))
            .unwrap_or_else(|| panic!("ping printed no summary: {text}"));
        let number = |word: &str| -> u32 {
            let before = line.split(word).next().unwrap_or_default();
            before
                .rsplit(|c: char| !c.is_ascii_digit())
                .find(|s| !s.is_empty())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no count before {word:?} in {line}"))
        };
        (number(" packets transmitted"), number(" received"), text)
    }
}

impl Drop for Pinger {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Every key under `prefix` in etcd.
async fn keys(endpoint: &str, prefix: &str) -> BTreeSet<String> {
    leases(endpoint, prefix).await.into_keys().collect()
}

/// Waits until `node` reconciled with etcd (rivet status healthy, nothing
/// left to publish); returns how long that took.
fn wait_reconciled(node: &TestNode) -> Duration {
    eventually(
        &format!(
            "node {} reconciles with etcd (rivet status healthy, nothing left to publish)",
            node.netns
        ),
        Duration::from_secs(30),
        || {
            status(node).0 == Some(0)
                && node
                    .json(&["status"])
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|d| d["identity_status"]["store_pending_writes"] == 0)
        },
    )
}

/// Once every node stopped: only master keys (for the operator's GC) are
/// left in etcd.
async fn assert_only_master_keys_left(endpoint: &str) {
    let left = keys(endpoint, "rivet/state/").await;
    assert!(
        left.iter().all(|k| k.contains("/identities/v1/id/")),
        "only master keys (for the operator's GC) are left: {left:?}"
    );
}

/// `rivet status` of `node`: its exit status and output.
fn status(node: &TestNode) -> (Option<i32>, String) {
    let out = run(node, &["status"]);
    (out.status.code(), shown(&out))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_ride_out_an_etcd_outage_and_converge_when_it_returns() {
    let mut etcd = EtcdServer::start_async().await.expect("etcd starts");
    let endpoint = etcd.endpoint();
    let mut a = node_on(&endpoint, "default=198.18.0.0/22,2001:2::/64");
    let mut b = node_on(&endpoint, "default=198.18.4.0/22,2001:2:0:1::/64");
    for (pod, app) in [
        ("web", "web"),
        ("client", "client"),
        ("deleted", "deleted"),
        ("forced", "forced"),
    ] {
        let out = add_pod(&a, pod, app);
        assert!(out.status.success(), "pod {pod} on {}: {}", a.netns, shown(&out));
    }
    let out = add_pod(&b, "remote", "web");
    assert!(out.status.success(), "{}", shown(&out));
    let ip = |node: &TestNode, pod: &str| format!("{}/32", node.ipv4(pod));
    let (web, deleted, forced, remote) = (ip(&a, "web"), ip(&a, "deleted"), ip(&a, "forced"), ip(&b, "remote"));
    let gone_addresses: Vec<String> = ["deleted", "forced"].iter().flat_map(|p| a.addresses(p)).collect();
    eventually("each node knows the other's pods", Duration::from_secs(15), || {
        let (on_a, on_b) = (ipcache(&a), ipcache(&b));
        on_a.get(&remote) == Some(&b.netns) && [&web, &deleted, &forced].iter().all(|p| on_b.get(*p) == Some(&a.netns))
    });
    assert_eq!(status(&a).0, Some(0), "healthy before the outage: {}", status(&a).1);
    let web_v4 = a.ipv4("web");
    let pinger = Pinger::start(&pod_netns(&a, "client"), &web_v4);
    assert!(a.ping("client", &web_v4), "traffic flows before the outage");

    // The outage.
    etcd.stop();
    let outage = Instant::now();
    eventually(
        "rivet status says the node is degraded",
        Duration::from_secs(15),
        || status(&a).0 == Some(3),
    );
    let (_, text) = status(&a);
    assert!(
        text.contains("node health: DEGRADED") && text.contains("kvstore (etcd) unreachable"),
        "{text}"
    );

    // A pod whose label set has an identity starts, and is reachable.
    let out = add_pod(&a, "web-2", "web");
    assert!(
        out.status.success(),
        "a known label set starts during the outage: {}",
        shown(&out)
    );
    let web2 = ip(&a, "web-2");
    assert!(a.ping("client", &a.ipv4("web-2")), "the new pod is reachable at once");
    // A pod of a label set no node has needs the kvstore: it fails with the
    // reason once the CNI deadline runs out, and leaves nothing.
    let out = add_pod(&a, "brand-new", "brand-new");
    assert!(
        !out.status.success(),
        "a new label set cannot start without the kvstore"
    );
    assert!(shown(&out).contains("kvstore is unreachable"), "{}", shown(&out));
    assert!(
        !a.ok(&["pod", "list"]).contains("brand-new"),
        "the failed pod left nothing"
    );
    // Another one keeps retrying within its deadline...
    let late = a
        .rivet(&["pod", "add", "late", "--label", "app=late"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting rivet pod add");
    eventually(
        "svc-endpoint retries the late pod's identity",
        Duration::from_secs(8),
        || {
            a.json(&["endpoint", "list"])["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| {
                    e["pod_name"] == "late"
                        && e["last_error"]
                            .as_str()
                            .is_some_and(|m| m.contains("kvstore is unreachable"))
                })
        },
    );
    // Deletes are local work.
    a.ok(&["pod", "del", "deleted"]);
    a.ok(&["pod", "del", "forced", "--force"]);
    let outage_work = outage.elapsed();

    let _etcd = etcd.restart_async().await.expect("etcd restarts");
    eprintln!("etcd was down {:?} (local work took {outage_work:?})", outage.elapsed());
    // ...and starts once etcd is back.
    let out = late.wait_with_output().expect("rivet pod add ends");
    assert!(
        out.status.success(),
        "a new label set starts once etcd is back within the deadline: {}",
        shown(&out)
    );
    let took = wait_reconciled(&a);
    eprintln!("node a reconciled {took:?} after etcd's restart");
    let (sent, received, summary) = pinger.stop();
    assert!(
        sent >= 5 && received == sent,
        "no ping lost across the outage: {summary}"
    );

    // The other node converges through its watch.
    eventually("node b sees node a's changes", Duration::from_secs(15), || {
        let on_b = ipcache(&b);
        on_b.get(&web2) == Some(&a.netns) && !on_b.contains_key(&deleted) && !on_b.contains_key(&forced)
    });
    // Nothing of the deleted pods is left anywhere.
    let ips = keys(&endpoint, "rivet/state/ip/").await;
    let expected: BTreeSet<String> = ["web", "client", "web-2", "late"]
        .iter()
        .flat_map(|p| a.addresses(p))
        .chain(b.addresses("remote"))
        .map(|address| format!("rivet/state/ip/v1/default/{address}"))
        .collect();
    assert_eq!(ips, expected, "etcd holds the IP entries of the pods that exist");
    let values = keys(&endpoint, "rivet/state/identities/v1/value/").await;
    let of_a: Vec<&String> = values
        .iter()
        .filter(|k| k.ends_with(&format!("/{}", a.netns)))
        .collect();
    for app in ["app=web", "app=client", "app=late"] {
        assert!(of_a.iter().any(|k| k.contains(app)), "node a holds {app}: {of_a:?}");
    }
    for app in ["app=deleted", "app=forced", "app=brand-new"] {
        assert!(
            !values.iter().any(|k| k.contains(app)),
            "no value key of {app} is left: {values:?}"
        );
    }
    let endpoints = a.json(&["endpoint", "list"]).to_string();
    let allocations = a.json(&["ipam", "list", "--allocations"]).to_string();
    for address in &gone_addresses {
        assert!(
            !endpoints.contains(&format!("\"{address}\"")),
            "no endpoint has {address}: {endpoints}"
        );
        assert!(
            !allocations.contains(&format!("\"{address}/")),
            "svc-ipam released {address}: {allocations}"
        );
    }
    let out = add_pod(&a, "brand-new", "brand-new");
    assert!(
        out.status.success(),
        "a new label set starts once etcd is back: {}",
        shown(&out)
    );

    // A clean stop takes the node's keys with it at once (not after the TTL).
    let stopping = Instant::now();
    b.down_and_check_nothing_left();
    let b_keys = |all: &BTreeSet<String>| -> Vec<String> {
        all.iter()
            .filter(|k| k.ends_with(&format!("/{}", b.netns)) || k.contains("/ip/v1/default/198.18.4."))
            .cloned()
            .collect()
    };
    assert_eq!(
        b_keys(&keys(&endpoint, "rivet/state/").await),
        Vec::<String>::new(),
        "node b's keys are gone"
    );
    eventually("node a's view loses node b's pod", Duration::from_secs(5), || {
        !ipcache(&a).contains_key(&remote)
    });
    let gone = stopping.elapsed();
    assert!(
        gone < Duration::from_secs(LEASE_TTL_SECONDS / 2),
        "gone {gone:?} after the stop, well before the {LEASE_TTL_SECONDS} s TTL"
    );
    a.down_and_check_nothing_left();
    assert_only_master_keys_left(&endpoint).await;
}

/// Every key under `prefix` in etcd with its lease.
async fn leases(endpoint: &str, prefix: &str) -> BTreeMap<String, i64> {
    let mut c = etcd_client::Client::connect([endpoint], None)
        .await
        .expect("connecting to the test etcd");
    let r = c
        .get(prefix, Some(GetOptions::new().with_prefix().with_keys_only()))
        .await
        .expect("listing etcd");
    r.kvs()
        .iter()
        .map(|kv| (kv.key_str().unwrap().to_string(), kv.lease()))
        .collect()
}

/// svc-identity's local snapshot on `node` (JSON), if written.
fn identity_snapshot(node: &TestNode) -> Option<serde_json::Value> {
    let path = node.state_dir().join("svc-identity/identity/etcd-snapshot.json");
    let text = std::fs::read_to_string(path).ok()?;
    Some(serde_json::from_str(&text).expect("the snapshot is JSON"))
}

/// The `ip`s of the snapshot's IP cache entries of `part` (`remote`, `local`).
fn snapshot_ips(snapshot: &serde_json::Value, part: &str) -> BTreeSet<String> {
    snapshot["data"]["ipcache"][part]
        .as_array()
        .map(|a| a.iter().map(|e| e["ip"].as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// svc-loader's ipcache on `node`: prefix → identity.
async fn loader_ipcache(node: &TestNode) -> BTreeMap<String, u32> {
    use rivet_proto::loader::v1 as loader_pb;
    let channel = rivet_common::grpc::connect_unix(
        &node.path("sockets").join("svc-loader.sock"),
        &rivet_common::grpc::ClientOptions::default(),
    )
    .await
    .expect("connecting to svc-loader");
    let r = loader_pb::loader_service_client::LoaderServiceClient::new(channel)
        .list_ipcache(loader_pb::ListIpcacheRequest {
            page_size: 10000,
            start_after: None,
        })
        .await
        .expect("svc-loader lists its ipcache")
        .into_inner();
    assert!(r.complete);
    r.entries
        .into_iter()
        .map(|e| {
            let p = e.prefix.expect("a prefix");
            let prefix = rivet_proto::net::prefix_from_proto(&p).expect("the loader holds valid prefixes");
            (prefix.to_string(), e.identity)
        })
        .collect()
}

/// The value of the sample `series` (as printed) in svc-identity's
/// `/metrics` at `address`, 0 when absent.
async fn identity_metric(address: std::net::SocketAddr, series: &str) -> f64 {
    let text = rivet_common::testing::http_get(address, "/metrics")
        .await
        .expect("GET /metrics of svc-identity");
    rivet_common::testing::metric_sample(&text, series).unwrap_or(0.0)
}

/// `rivet status -o json` of `node`, whatever its exit status (3 while
/// degraded).
fn status_json(node: &TestNode) -> serde_json::Value {
    let out = run(node, &["status", "-o", "json"]);
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("rivet status -o json: {e}: {}", shown(&out)))
}

/// svc-identity killed (-9) while etcd is down is restarted by the
/// supervisor and serves from its local snapshot: pods keep their traffic,
/// svc-loader gets its full ipcache push (the other node's pod included)
/// and the new pod of a known label set; `rivet status` says degraded. When
/// etcd is back it converges: the other node sees the new pod, this node's
/// keys are those of its pods, all on its new lease, and nothing is left
/// after the nodes stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn svc_identity_killed_during_an_etcd_outage_restarts_from_its_snapshot_and_converges() {
    let mut etcd = EtcdServer::start_async().await.expect("etcd starts");
    let endpoint = etcd.endpoint();
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], rivet_common::testing::free_local_port()));
    let metrics_arg = format!("svc-identity=--metrics-address={metrics}");
    // Passes every 2 s: one fails while etcd is away.
    let resync_arg = "svc-identity=--resync-seconds=2";
    let mut a = node_with(
        &endpoint,
        "default=198.18.8.0/22,2001:2:0:8::/64",
        &["--daemon-arg", &metrics_arg, "--daemon-arg", resync_arg],
    );
    let mut b = node_on(&endpoint, "default=198.18.12.0/22,2001:2:0:9::/64");
    for (pod, app) in [("web", "web"), ("client", "client")] {
        let out = add_pod(&a, pod, app);
        assert!(out.status.success(), "pod {pod}: {}", shown(&out));
    }
    let out = add_pod(&b, "remote", "web");
    assert!(out.status.success(), "{}", shown(&out));
    let ip = |node: &TestNode, pod: &str| format!("{}/32", node.ipv4(pod));
    let (web, client, remote) = (ip(&a, "web"), ip(&a, "client"), ip(&b, "remote"));
    eventually("node a knows node b's pod", Duration::from_secs(15), || {
        ipcache(&a).get(&remote) == Some(&b.netns)
    });
    // The signal that a restart has what it needs: the snapshot holds it.
    let bare = |p: &str| p.trim_end_matches("/32").to_string();
    eventually(
        "node a's snapshot holds both nodes' pods",
        Duration::from_secs(15),
        || {
            identity_snapshot(&a).is_some_and(|s| {
                snapshot_ips(&s, "remote").contains(&bare(&remote))
                    && [&web, &client]
                        .iter()
                        .all(|p| snapshot_ips(&s, "local").contains(&bare(p)))
            })
        },
    );
    let web_v4 = a.ipv4("web");
    let pinger = Pinger::start(&pod_netns(&a, "client"), &web_v4);
    assert!(a.ping("client", &web_v4), "traffic flows before the outage");

    etcd.stop();
    eventually("rivet status says node a is degraded", Duration::from_secs(15), || {
        status(&a).0 == Some(3)
    });
    let killed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64;
    a.kill9_and_wait_for_restart("svc-identity");

    // Served from the snapshot, degraded, the push to svc-loader done.
    let (code, text) = status(&a);
    assert_eq!(code, Some(3), "{text}");
    assert!(text.contains("DEGRADED") && text.contains("local snapshot"), "{text}");
    eventually(
        "svc-loader got the restarted svc-identity's full push",
        Duration::from_secs(15),
        || {
            status_json(&a).as_array().unwrap().iter().any(|d| {
                let s = &d["identity_status"];
                s["loader_connected"] == true
                    && s["loader_last_full_sync_unix_nanos"]
                        .as_i64()
                        .is_some_and(|t| t > killed)
            })
        },
    );
    let view = ipcache(&a);
    assert_eq!(
        view.get(&remote),
        Some(&b.netns),
        "the other node's pod is served: {view:?}"
    );
    let loader = loader_ipcache(&a).await;
    assert!(
        loader.contains_key(&remote) && loader.contains_key(&web) && loader.contains_key(&client),
        "the full push held the snapshot's view: {loader:?}"
    );
    assert!(a.ok(&["identity", "list"]).contains("app=web"), "identities are served");
    // A pod of a known label set starts and is reachable; its address
    // reaches svc-loader.
    let out = add_pod(&a, "web-2", "web");
    assert!(out.status.success(), "a known label set starts: {}", shown(&out));
    let web2 = ip(&a, "web-2");
    assert!(a.ping("client", &a.ipv4("web-2")), "the new pod is reachable at once");
    let pushed = loader_ipcache(&a).await;
    assert!(pushed.contains_key(&web2), "{pushed:?}");
    let unreachable = "rivet_identity_reconcile_passes_total{keys=\"value_keys\",outcome=\"store_unreachable\"}";
    let started = Instant::now();
    while identity_metric(metrics, unreachable).await < 1.0 {
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "no failed pass was counted"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        identity_metric(metrics, "rivet_identity_snapshot_loads_total{outcome=\"loaded\"}").await,
        1.0
    );
    assert!(identity_metric(metrics, "rivet_identity_local_allocations_total").await >= 1.0);
    assert!(
        identity_metric(metrics, "rivet_identity_store_pending_writes{keys=\"ip_entries\"}").await >= 1.0,
        "web-2's entries wait for etcd"
    );

    // etcd is back: node a converges.
    let _etcd = etcd.restart_async().await.expect("etcd restarts");
    wait_reconciled(&a);
    // Healthy with nothing pending says web-2's keys are written; the keys
    // that were already in etcd move to the new lease with the value-key
    // pass. Two more successful passes: the second started after the first
    // had seen the new lease.
    let succeeded = "rivet_identity_reconcile_passes_total{keys=\"value_keys\",outcome=\"succeeded\"}";
    let before = identity_metric(metrics, succeeded).await;
    let started = Instant::now();
    while identity_metric(metrics, succeeded).await < before + 2.0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "svc-identity runs a value-key pass every 2 s once etcd is back"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (sent, received, summary) = pinger.stop();
    assert!(
        sent >= 5 && received == sent,
        "no ping lost across the outage and the restart: {summary}"
    );
    eventually("node b sees node a's new pod", Duration::from_secs(15), || {
        let on_b = ipcache(&b);
        [&web, &client, &web2].iter().all(|p| on_b.get(*p) == Some(&a.netns))
    });
    let lease = a
        .json(&["status"])
        .as_array()
        .unwrap()
        .iter()
        .find_map(|d| d["identity_status"]["lease_id"].as_i64())
        .expect("svc-identity's lease");
    let of_a: BTreeMap<String, i64> = leases(&endpoint, "rivet/state/")
        .await
        .into_iter()
        .filter(|(k, _)| {
            k.ends_with(&format!("/{}", a.netns))
                || k.contains("/ip/v1/default/198.18.8.")
                || k.contains("/ip/v1/default/2001:2:0:8:")
        })
        .collect();
    let expected: BTreeSet<String> = ["web", "client", "web-2"]
        .iter()
        .flat_map(|p| a.addresses(p))
        .map(|address| format!("rivet/state/ip/v1/default/{address}"))
        .collect();
    let ips: BTreeSet<String> = of_a.keys().filter(|k| k.contains("/ip/")).cloned().collect();
    assert_eq!(ips, expected, "etcd holds node a's pods");
    for app in ["app=web", "app=client"] {
        assert!(of_a.keys().any(|k| k.contains(app)), "node a holds {app}: {of_a:?}");
    }
    assert!(
        of_a.values().all(|l| *l == lease),
        "every key of node a is on its new lease {lease:x}, none on the killed process's: {of_a:?}"
    );
    assert!(
        identity_metric(
            metrics,
            "rivet_identity_reconcile_keys_total{key=\"ip\",action=\"created\"}"
        )
        .await
            >= 1.0
    );
    assert_eq!(
        identity_metric(metrics, "rivet_identity_store_pending_writes{keys=\"ip_entries\"}").await,
        0.0
    );

    b.down_and_check_nothing_left();
    a.down_and_check_nothing_left();
    assert_only_master_keys_left(&endpoint).await;
}
