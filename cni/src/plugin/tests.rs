//! The verbs against in-memory fakes of netlink, svc-ipam, svc-endpoint and
//! a delegated IPAM plugin: results, error codes, and that a failure at any
//! ADD step leaves nothing behind.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use futures::FutureExt as _;
use futures::future::BoxFuture;
use serde_json::json;

use super::*;
use crate::api::{EndpointResult, IpamResult, PodState, RouteEntry};
use rivet_common::grpc::status_with_reason;

// ------------------------------------------------------------------ fakes --

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Step {
    CreateVeth,
    ConfigurePod,
    HostRoutes,
    DeleteLink,
}

/// A container interface: the link, its addresses, the namespace's routes.
type PodEntry = (Link, Vec<IpNet>, Vec<RouteEntry>);

/// How a case breaks the world.
type Inject = Box<dyn Fn(&World)>;

#[derive(Debug, Default)]
struct NetState {
    /// Node namespace links by name.
    node: BTreeMap<String, Link>,
    /// Container interfaces: (netns, ifname) → (link, addresses, routes).
    pods: BTreeMap<(String, String), PodEntry>,
    /// Host routes: address → host ifindex.
    host_routes: BTreeMap<IpAddr, u32>,
    next_index: u32,
    fail: Option<Step>,
    calls: Vec<&'static str>,
}

#[derive(Default)]
struct FakeNetlink(Mutex<NetState>);

fn injected(step: Step) -> NetlinkError {
    NetlinkError::os(format!("injected failure at {step:?}"), libc::EPERM)
}

impl FakeNetlink {
    fn state(&self) -> std::sync::MutexGuard<'_, NetState> {
        self.0.lock().unwrap()
    }

    fn fail_at(&self, step: Option<Step>) {
        self.state().fail = step;
    }

    fn add_node_link(&self, name: &str, kind: &str) -> Link {
        let mut st = self.state();
        st.next_index += 1;
        let link = Link {
            index: 100 + st.next_index,
            name: name.into(),
            mac: Some([2, 0, 0, 0, 0, st.next_index as u8]),
            mtu: 1500,
            up: true,
            kind: Some(kind.into()),
        };
        st.node.insert(name.into(), link.clone());
        link
    }
}

impl Netlink for FakeNetlink {
    fn check_netns<'a>(&'a self, path: &'a Path) -> BoxFuture<'a, Result<(), NetlinkError>> {
        async move {
            if path.starts_with("/not-a-netns") {
                return Err(NetlinkError::other(
                    format!("checking {}", path.display()),
                    "not a network namespace",
                ));
            }
            Ok(())
        }
        .boxed()
    }

    fn host_link<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Link>, NetlinkError>> {
        async move { Ok(self.state().node.get(name).cloned()) }.boxed()
    }

    fn create_veth<'a>(&'a self, request: &'a VethRequest) -> BoxFuture<'a, Result<Veth, NetlinkError>> {
        async move {
            let mut st = self.state();
            st.calls.push("create_veth");
            if st.fail == Some(Step::CreateVeth) {
                return Err(injected(Step::CreateVeth));
            }
            if st.node.contains_key(&request.host_name) {
                return Err(NetlinkError::os("creating veth", libc::EEXIST));
            }
            st.next_index += 1;
            let n = st.next_index;
            let host = Link {
                index: 100 + n,
                name: request.host_name.clone(),
                mac: Some([2, 0, 0, 0, 1, n as u8]),
                mtu: request.mtu,
                up: true,
                kind: Some("veth".into()),
            };
            let peer = Link {
                index: 2,
                name: request.peer_name.clone(),
                mac: Some([2, 0, 0, 0, 2, n as u8]),
                mtu: request.mtu,
                up: true,
                kind: Some("veth".into()),
            };
            st.node.insert(host.name.clone(), host.clone());
            st.pods.insert(
                (request.netns.display().to_string(), request.peer_name.clone()),
                (peer.clone(), Vec::new(), Vec::new()),
            );
            Ok(Veth { host, peer })
        }
        .boxed()
    }

    fn configure_pod<'a>(&'a self, netns: &'a Path, config: &'a PodConfig) -> BoxFuture<'a, Result<(), NetlinkError>> {
        async move {
            let mut st = self.state();
            st.calls.push("configure_pod");
            if st.fail == Some(Step::ConfigurePod) {
                return Err(injected(Step::ConfigurePod));
            }
            let key = st
                .pods
                .keys()
                .find(|(ns, _)| ns == &netns.display().to_string())
                .cloned()
                .expect("configure_pod after create_veth");
            let entry = st.pods.get_mut(&key).unwrap();
            entry.1 = config.addresses.iter().map(|a| a.address).collect();
            entry.2 = config
                .routes
                .iter()
                .map(|r| RouteEntry {
                    dst: r.dst,
                    gw: Some(r.gw),
                    oif: Some(config.ifindex),
                })
                .collect();
            Ok(())
        }
        .boxed()
    }

    fn add_host_routes<'a>(
        &'a self,
        host_ifindex: u32,
        addresses: &'a [IpAddr],
    ) -> BoxFuture<'a, Result<(), NetlinkError>> {
        async move {
            let mut st = self.state();
            st.calls.push("add_host_routes");
            if st.fail == Some(Step::HostRoutes) {
                return Err(injected(Step::HostRoutes));
            }
            for a in addresses {
                st.host_routes.insert(*a, host_ifindex);
            }
            Ok(())
        }
        .boxed()
    }

    fn delete_host_link<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool, NetlinkError>> {
        async move {
            let mut st = self.state();
            st.calls.push("delete_host_link");
            if st.fail == Some(Step::DeleteLink) {
                return Err(injected(Step::DeleteLink));
            }
            let Some(link) = st.node.remove(name) else {
                return Ok(false);
            };
            // The peer and the routes via the link go with it.
            st.host_routes.retain(|_, index| *index != link.index);
            let host_mac_suffix = link.mac.unwrap()[5];
            st.pods
                .retain(|_, (peer, _, _)| peer.mac.unwrap()[5] != host_mac_suffix);
            Ok(true)
        }
        .boxed()
    }

    fn inspect_pod<'a>(
        &'a self,
        netns: &'a Path,
        ifname: &'a str,
    ) -> BoxFuture<'a, Result<Option<PodState>, NetlinkError>> {
        async move {
            let st = self.state();
            Ok(st
                .pods
                .get(&(netns.display().to_string(), ifname.to_string()))
                .map(|(link, addresses, routes)| PodState {
                    link: link.clone(),
                    addresses: addresses.clone(),
                    routes: routes.clone(),
                }))
        }
        .boxed()
    }
}

#[derive(Debug)]
struct IpamState {
    v4: Option<(IpNet, IpAddr)>,
    v6: Option<(IpNet, IpAddr)>,
    /// address → (owner container, owner interface).
    allocations: BTreeMap<IpAddr, (String, String)>,
    unreachable: bool,
    fail_allocate: Option<Status>,
    calls: Vec<&'static str>,
}

struct FakeIpam(Mutex<IpamState>);

impl FakeIpam {
    fn dual_stack() -> Self {
        Self(Mutex::new(IpamState {
            v4: Some(("198.18.0.0/22".parse().unwrap(), "198.18.0.1".parse().unwrap())),
            v6: Some(("2001:2::/64".parse().unwrap(), "2001:2::1".parse().unwrap())),
            allocations: BTreeMap::new(),
            unreachable: false,
            fail_allocate: None,
            calls: Vec::new(),
        }))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, IpamState> {
        self.0.lock().unwrap()
    }
}

fn allocation(address: IpAddr, owner: &(String, String), net: &IpNet, gw: IpAddr) -> ipampb::Allocation {
    ipampb::Allocation {
        pool: "default".into(),
        family: if address.is_ipv4() { 1 } else { 2 },
        address: rivet_proto::net::address_bytes(address),
        prefix_length: u32::from(net.prefix_len()),
        gateway: rivet_proto::net::address_bytes(gw),
        owner: Some(ipampb::Owner {
            container_id: owner.0.clone(),
            interface: owner.1.clone(),
        }),
    }
}

impl IpamApi for FakeIpam {
    fn ready<'a>(&'a self, pool: &'a str, _: Duration) -> BoxFuture<'a, IpamResult<()>> {
        async move {
            let st = self.state();
            if st.unreachable {
                return Err(Status::unavailable("connection refused").into());
            }
            if pool != "default" {
                return Err(status_with_reason(
                    Code::NotFound,
                    format!("no pool {pool}"),
                    ipampb::ErrorReason::PoolNotFound,
                )
                .into());
            }
            Ok(())
        }
        .boxed()
    }

    fn allocate(&self, request: ipampb::AllocateRequest, _: Duration) -> BoxFuture<'_, IpamResult<ipampb::Allocation>> {
        async move {
            let mut st = self.state();
            st.calls.push("allocate");
            if let Some(status) = st.fail_allocate.clone() {
                return Err(status.into());
            }
            let v4 = request.family == 1;
            let Some((net, gw)) = (if v4 { st.v4 } else { st.v6 }) else {
                // Worded unlike svc-ipam: the plugin decides on the reason.
                return Err(status_with_reason(
                    Code::InvalidArgument,
                    "single-stack pool",
                    ipampb::ErrorReason::FamilyNotConfigured,
                )
                .into());
            };
            let o = request.owner.unwrap();
            let owner = (o.container_id, o.interface);
            if let Some((a, _)) = st.allocations.iter().find(|(a, w)| **w == owner && a.is_ipv4() == v4) {
                return Ok(allocation(*a, &owner, &net, gw));
            }
            let address = if request.requested_address.is_empty() {
                net.hosts()
                    .find(|a| *a != gw && *a != net.network() && !st.allocations.contains_key(a))
                    .unwrap()
            } else {
                rivet_proto::net::address_from_bytes(&request.requested_address).unwrap()
            };
            st.allocations.insert(address, owner.clone());
            Ok(allocation(address, &owner, &net, gw))
        }
        .boxed()
    }

    fn release(&self, owner: ipampb::Owner, _: Duration) -> BoxFuture<'_, IpamResult<Vec<ipampb::Allocation>>> {
        async move {
            let mut st = self.state();
            st.calls.push("release");
            if st.unreachable {
                return Err(Status::unavailable("connection refused").into());
            }
            let key = (owner.container_id, owner.interface);
            let released: Vec<IpAddr> = st
                .allocations
                .iter()
                .filter(|(_, w)| **w == key)
                .map(|(a, _)| *a)
                .collect();
            for a in &released {
                st.allocations.remove(a);
            }
            let Some((net, gw)) = st.v4.or(st.v6) else {
                return Ok(Vec::new());
            };
            Ok(released.iter().map(|a| allocation(*a, &key, &net, gw)).collect())
        }
        .boxed()
    }

    fn release_address(
        &self,
        _: String,
        address: Vec<u8>,
        _: Duration,
    ) -> BoxFuture<'_, IpamResult<Vec<ipampb::Allocation>>> {
        async move {
            let mut st = self.state();
            st.calls.push("release_address");
            let a = rivet_proto::net::address_from_bytes(&address).unwrap();
            let (net, gw) = st.v4.unwrap();
            Ok(st
                .allocations
                .remove(&a)
                .map(|o| allocation(a, &o, &net, gw))
                .into_iter()
                .collect())
        }
        .boxed()
    }

    fn allocations(&self, _: String, _: Duration) -> BoxFuture<'_, IpamResult<Vec<ipampb::Allocation>>> {
        async move {
            let st = self.state();
            let (net, gw) = st.v4.unwrap();
            Ok(st
                .allocations
                .iter()
                .map(|(a, o)| allocation(*a, o, &net, gw))
                .collect())
        }
        .boxed()
    }
}

#[derive(Debug, Default)]
struct EndpointState {
    endpoints: Vec<eppb::Endpoint>,
    next_id: u32,
    unreachable: bool,
    fail_create: Option<Status>,
    /// Create succeeds at the server but the reply is an error (the client gave up).
    fail_after_create: Option<Status>,
    fail_delete: Option<Status>,
    restore_complete: bool,
    create_delay: Option<Duration>,
    requests: Vec<eppb::CreateEndpointRequest>,
}

#[derive(Default)]
struct FakeEndpoints(Mutex<EndpointState>);

impl FakeEndpoints {
    fn new() -> Self {
        let fake = Self::default();
        fake.state().restore_complete = true;
        fake
    }

    fn state(&self) -> std::sync::MutexGuard<'_, EndpointState> {
        self.0.lock().unwrap()
    }
}

impl EndpointApi for FakeEndpoints {
    fn ready(&self, _: Duration) -> BoxFuture<'_, EndpointResult<()>> {
        async move {
            if self.state().unreachable {
                return Err(Status::unavailable("connection refused").into());
            }
            Ok(())
        }
        .boxed()
    }

    fn create(
        &self,
        request: eppb::CreateEndpointRequest,
        timeout: Duration,
    ) -> BoxFuture<'_, EndpointResult<eppb::Endpoint>> {
        async move {
            let delay = self.state().create_delay;
            if let Some(delay) = delay {
                if delay > timeout {
                    tokio::time::sleep(timeout).await;
                    return Err(Status::deadline_exceeded("regeneration did not finish").into());
                }
                tokio::time::sleep(delay).await;
            }
            let mut st = self.state();
            st.requests.push(request.clone());
            if let Some(status) = st.fail_create.clone() {
                return Err(status.into());
            }
            st.next_id += 1;
            let endpoint = eppb::Endpoint {
                id: st.next_id,
                container_id: request.container_id,
                interface: request.interface,
                netns_path: request.netns_path,
                host_interface: request.host_interface,
                host_ifindex: request.host_ifindex,
                addresses: request.addresses,
                mac: request.mac,
                state: eppb::EndpointState::Ready.into(),
                identity: 1000,
                ..Default::default()
            };
            st.endpoints.push(endpoint.clone());
            if let Some(status) = st.fail_after_create.clone() {
                return Err(status.into());
            }
            Ok(endpoint)
        }
        .boxed()
    }

    fn delete(&self, container_id: String, interface: String, _: Duration) -> BoxFuture<'_, EndpointResult<Vec<u32>>> {
        async move {
            let mut st = self.state();
            if let Some(status) = st.fail_delete.clone() {
                return Err(status.into());
            }
            let ids: Vec<u32> = st
                .endpoints
                .iter()
                .filter(|e| e.container_id == container_id && e.interface == interface)
                .map(|e| e.id)
                .collect();
            st.endpoints.retain(|e| !ids.contains(&e.id));
            Ok(ids)
        }
        .boxed()
    }

    fn delete_id(&self, id: u32, _: Duration) -> BoxFuture<'_, EndpointResult<Vec<u32>>> {
        async move {
            let mut st = self.state();
            let before = st.endpoints.len();
            st.endpoints.retain(|e| e.id != id);
            Ok(if st.endpoints.len() < before { vec![id] } else { vec![] })
        }
        .boxed()
    }

    fn get(
        &self,
        container_id: String,
        interface: String,
        _: Duration,
    ) -> BoxFuture<'_, EndpointResult<Option<eppb::Endpoint>>> {
        async move {
            Ok(self
                .state()
                .endpoints
                .iter()
                .find(|e| e.container_id == container_id && e.interface == interface)
                .cloned())
        }
        .boxed()
    }

    fn list(&self, _: Duration) -> BoxFuture<'_, EndpointResult<(Vec<eppb::Endpoint>, bool)>> {
        async move {
            let st = self.state();
            Ok((st.endpoints.clone(), st.restore_complete))
        }
        .boxed()
    }
}

#[derive(Default)]
struct FakeDelegate {
    /// stdout of ADD.
    add_output: Mutex<Option<Result<Vec<u8>, CniError>>>,
    /// stdout of VERSION (default: up to 1.0.0, as Debian's host-local).
    version_output: Mutex<Option<Vec<u8>>>,
    /// DEL fails, naming the attachment's `CNI_CONTAINERID` when given.
    fail_del: Mutex<bool>,
    /// Every call, in order.
    calls: Mutex<Vec<DelegateCall>>,
}

/// One call of the fake delegated plugin.
#[derive(Debug, Clone)]
struct DelegateCall {
    command: Command,
    /// The extra environment.
    env: Vec<(&'static str, String)>,
    stdin: String,
}

impl FakeDelegate {
    /// The verbs it was called with, in order.
    fn verbs(&self) -> Vec<Command> {
        self.calls.lock().unwrap().iter().map(|call| call.command).collect()
    }
}

impl DelegateExec for FakeDelegate {
    fn exec<'a>(
        &'a self,
        _: &'a str,
        command: Command,
        env: &'a [(&'static str, String)],
        stdin: &'a [u8],
        _: Duration,
    ) -> BoxFuture<'a, Result<Vec<u8>, CniError>> {
        async move {
            self.calls.lock().unwrap().push(DelegateCall {
                command,
                env: env.to_vec(),
                stdin: String::from_utf8_lossy(stdin).into_owned(),
            });
            match command {
                Command::Add => self.add_output.lock().unwrap().clone().expect("ADD output configured"),
                Command::Version => Ok(self
                    .version_output
                    .lock()
                    .unwrap()
                    .clone()
                    .unwrap_or_else(|| br#"{"cniVersion":"1.0.0","supportedVersions":["0.4.0","1.0.0"]}"#.to_vec())),
                Command::Del if *self.fail_del.lock().unwrap() => {
                    let container = env
                        .iter()
                        .find(|(k, _)| *k == "CNI_CONTAINERID")
                        .map(|(_, v)| v.as_str());
                    Err(CniError::new(11, format!("DEL of {}: busy", container.unwrap_or("-"))))
                }
                _ => Ok(Vec::new()),
            }
        }
        .boxed()
    }
}

struct World {
    netlink: FakeNetlink,
    ipam: FakeIpam,
    endpoints: FakeEndpoints,
    delegate: FakeDelegate,
}

impl World {
    fn new() -> Self {
        Self {
            netlink: FakeNetlink::default(),
            ipam: FakeIpam::dual_stack(),
            endpoints: FakeEndpoints::new(),
            delegate: FakeDelegate::default(),
        }
    }

    fn deps(&self) -> Deps<'_> {
        Deps {
            netlink: &self.netlink,
            ipam: &self.ipam,
            endpoints: &self.endpoints,
            delegate: &self.delegate,
        }
    }

    async fn run(&self, inv: &Invocation) -> Result<Option<Value>, CniError> {
        run(self.deps(), inv).await
    }

    /// The container ids of svc-endpoint's endpoints, in its order.
    fn endpoint_containers(&self) -> Vec<String> {
        self.endpoints
            .state()
            .endpoints
            .iter()
            .map(|e| e.container_id.clone())
            .collect()
    }

    /// Nothing of any attachment is left.
    fn assert_clean(&self) {
        let net = self.netlink.state();
        assert!(net.node.is_empty(), "links left: {:?}", net.node.keys());
        assert!(net.pods.is_empty(), "container interfaces left: {:?}", net.pods.keys());
        assert!(net.host_routes.is_empty(), "host routes left: {:?}", net.host_routes);
        drop(net);
        assert!(
            self.ipam.state().allocations.is_empty(),
            "{:?}",
            self.ipam.state().allocations
        );
        assert!(
            self.endpoints.state().endpoints.is_empty(),
            "{:?}",
            self.endpoints.state().endpoints
        );
    }
}

const NETNS: &str = "/run/netns/pod-a";

fn invocation(command: &str, container: &str, conf: Value) -> Invocation {
    let vars: HashMap<&str, String> = [
        ("CNI_COMMAND", command.to_string()),
        ("CNI_CONTAINERID", container.to_string()),
        ("CNI_NETNS", NETNS.to_string()),
        ("CNI_IFNAME", "eth0".to_string()),
        ("CNI_PATH", "/opt/cni/bin".to_string()),
        (
            "CNI_ARGS",
            format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME={container};K8S_POD_UID=uid-{container}"),
        ),
    ]
    .into();
    let env = crate::env::parse(|k| vars.get(k).cloned()).unwrap();
    let stdin = conf.to_string().into_bytes();
    let conf = NetConf::parse(&stdin).unwrap();
    Invocation { env, conf, stdin }
}

fn conf(version: &str) -> Value {
    json!({
        "cniVersion": version, "name": "rivet", "type": "rivet-cni",
        "args": {"cni": {"labels": ["app=web"], "containerPorts": [{"name": "http", "containerPort": 8080}]}},
        "dns": {"nameservers": ["198.18.0.53"]},
    })
}

fn with_prev(mut conf: Value, prev: Value) -> Value {
    conf["prevResult"] = prev;
    conf
}

// ------------------------------------------------------------------ tests --

#[tokio::test]
async fn add_wires_the_pod_and_creates_the_endpoint() {
    let w = World::new();
    let out = w.run(&invocation("ADD", "c1", conf("1.0.0"))).await.unwrap().unwrap();
    let host = host_ifname("lxc", "c1", "eth0");
    assert_eq!(out["cniVersion"], "1.0.0");
    assert_eq!(out["interfaces"][0]["name"], host.as_str());
    assert!(out["interfaces"][0].get("sandbox").is_none());
    assert_eq!(
        out["interfaces"][1],
        json!({"name": "eth0", "mac": "02:00:00:00:02:01", "sandbox": NETNS})
    );
    assert_eq!(
        out["ips"],
        json!([
            {"address": "198.18.0.2/22", "gateway": "198.18.0.1", "interface": 1},
            {"address": "2001:2::2/64", "gateway": "2001:2::1", "interface": 1},
        ])
    );
    assert_eq!(
        out["routes"],
        json!([{"dst": "0.0.0.0/0", "gw": "198.18.0.1"}, {"dst": "::/0", "gw": "2001:2::1"}])
    );
    assert_eq!(out["dns"], json!({"nameservers": ["198.18.0.53"]}));

    let net = w.netlink.state();
    let link = &net.node[&host];
    assert_eq!(net.host_routes.len(), 2);
    assert!(net.host_routes.values().all(|i| *i == link.index));
    let (_, addrs, routes) = &net.pods[&(NETNS.to_string(), "eth0".to_string())];
    assert_eq!(addrs.len(), 2);
    assert_eq!(routes.len(), 2);
    drop(net);

    let st = w.endpoints.state();
    let request = &st.requests[0];
    assert_eq!(request.container_id, "c1");
    assert_eq!(request.interface, "eth0");
    assert_eq!(request.netns_path, NETNS);
    assert_eq!(request.host_interface, host);
    assert_eq!(request.mac, [2, 0, 0, 0, 2, 1]);
    assert_eq!(
        (
            request.pod_namespace.as_str(),
            request.pod_name.as_str(),
            request.pod_uid.as_str()
        ),
        ("shop", "c1", "uid-c1")
    );
    assert_eq!(request.labels, ["k8s:app=web"]);
    assert_eq!(
        request.named_ports,
        [eppb::NamedPort {
            name: "http".into(),
            protocol: "TCP".into(),
            port: 8080
        }],
        "the pod's named ports reach svc-endpoint"
    );
    assert!(!request.r#async, "CreateEndpoint is synchronous");
    assert!(request.addresses.iter().all(|a| a.ipam_pool == "default"));
}

#[tokio::test]
async fn add_result_per_version() {
    for version in ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        let w = World::new();
        let out = w.run(&invocation("ADD", "c1", conf(version))).await.unwrap().unwrap();
        assert_eq!(out["cniVersion"], version);
        let has_version = out["ips"][0].get("version").is_some();
        assert_eq!(has_version, version < "1.0.0", "{version}: {out}");
        if has_version {
            assert_eq!(out["ips"][1]["version"], "6");
        }
        assert_eq!(
            out["interfaces"][1].get("mtu").is_some(),
            version == "1.1.0",
            "{version}"
        );
    }
}

#[tokio::test]
async fn add_skips_a_family_the_pool_lacks() {
    let w = World::new();
    w.ipam.state().v6 = None;
    let out = w.run(&invocation("ADD", "c1", conf("1.1.0"))).await.unwrap().unwrap();
    assert_eq!(out["ips"].as_array().unwrap().len(), 1);
    assert_eq!(out["routes"].as_array().unwrap().len(), 1);
    // A requested address of the missing family is an error, not silently dropped.
    let w = World::new();
    w.ipam.state().v6 = None;
    let mut c = conf("1.1.0");
    c["runtimeConfig"] = json!({"ips": ["2001:2::99"]});
    let err = w.run(&invocation("ADD", "c1", c)).await.unwrap_err();
    assert_eq!(err.code, codes::INVALID_NETCONF, "{err}");
    w.assert_clean();
    // Neither family: nothing to do.
    let w = World::new();
    {
        let mut st = w.ipam.state();
        st.v4 = None;
        st.v6 = None;
    }
    assert_eq!(
        w.run(&invocation("ADD", "c1", conf("1.1.0"))).await.unwrap_err().code,
        codes::IPAM
    );
}

/// svc-ipam's reasons, not its wording, decide the CNI code: a full pool
/// clears as pods go (11), a pool the netconf names wrongly is a bad
/// configuration (7), and the old message text with no reason means nothing.
#[tokio::test]
async fn ipam_reasons_map_to_cni_codes_without_reading_the_message() {
    let cases = [
        (
            status_with_reason(Code::ResourceExhausted, "no luck", ipampb::ErrorReason::PoolExhausted),
            codes::TRY_AGAIN_LATER,
        ),
        (
            status_with_reason(Code::Unavailable, "disk", ipampb::ErrorReason::StateNotDurable),
            codes::TRY_AGAIN_LATER,
        ),
        (
            status_with_reason(Code::NotFound, "?", ipampb::ErrorReason::PoolNotFound),
            codes::INVALID_NETCONF,
        ),
        (
            status_with_reason(Code::AlreadyExists, "?", ipampb::ErrorReason::AddressHeld),
            codes::IPAM,
        ),
        // Exhaustion without its reason (an older svc-ipam): not retried.
        (Status::resource_exhausted("pool default is exhausted"), codes::IPAM),
        // svc-ipam's wording for a missing family, without the reason, is
        // a refusal like any other, not a family to skip.
        (Status::invalid_argument("pool default has no IPv6 range"), codes::IPAM),
        // Not reached at all: transient.
        (Status::unavailable("connection refused"), codes::TRY_AGAIN_LATER),
    ];
    for (status, code) in cases {
        let w = World::new();
        w.ipam.state().fail_allocate = Some(status.clone());
        let err = w.run(&invocation("ADD", "c1", conf("1.1.0"))).await.unwrap_err();
        assert_eq!(err.code, code, "{status:?} -> {err}");
        w.assert_clean();
    }
}

#[tokio::test]
async fn add_requests_specific_addresses() {
    let w = World::new();
    let mut c = conf("1.0.0");
    c["runtimeConfig"] = json!({"ips": ["198.18.3.200/22"]});
    let out = w.run(&invocation("ADD", "c1", c)).await.unwrap().unwrap();
    assert_eq!(out["ips"][0]["address"], "198.18.3.200/22");
}

#[tokio::test]
async fn a_failure_at_each_add_step_leaves_nothing() {
    let cases: Vec<(&str, Inject, u32)> = vec![
        (
            "allocate",
            Box::new(|w: &World| w.ipam.state().fail_allocate = Some(Status::resource_exhausted("pool full"))),
            codes::IPAM,
        ),
        (
            "create veth",
            Box::new(|w: &World| w.netlink.fail_at(Some(Step::CreateVeth))),
            codes::NETLINK,
        ),
        (
            "configure pod",
            Box::new(|w: &World| w.netlink.fail_at(Some(Step::ConfigurePod))),
            codes::NETLINK,
        ),
        (
            "host routes",
            Box::new(|w: &World| w.netlink.fail_at(Some(Step::HostRoutes))),
            codes::NETLINK,
        ),
        (
            "create endpoint",
            Box::new(|w: &World| w.endpoints.state().fail_create = Some(Status::invalid_argument("pod_name: bad"))),
            codes::ENDPOINT,
        ),
        (
            "endpoint created but the reply lost",
            Box::new(|w: &World| w.endpoints.state().fail_after_create = Some(Status::unavailable("connection reset"))),
            codes::TRY_AGAIN_LATER,
        ),
    ];
    for (name, inject, code) in cases {
        let w = World::new();
        inject(&w);
        let err = w.run(&invocation("ADD", "c1", conf("1.1.0"))).await.unwrap_err();
        assert_eq!(err.code, code, "{name}: {err}");
        w.assert_clean();
        // And a later ADD of the same attachment works.
        w.netlink.fail_at(None);
        {
            let mut st = w.endpoints.state();
            st.fail_create = None;
            st.fail_after_create = None;
        }
        w.ipam.state().fail_allocate = None;
        w.run(&invocation("ADD", "c1", conf("1.1.0")))
            .await
            .unwrap_or_else(|e| panic!("{name}: ADD after the failure: {e}"));
    }
}

#[tokio::test]
async fn a_failed_undo_is_reported_in_the_details() {
    let w = World::new();
    {
        let mut st = w.endpoints.state();
        st.fail_create = Some(Status::internal("datapath: boom"));
        st.fail_delete = Some(Status::unavailable("gone"));
    }
    let err = w.run(&invocation("ADD", "c1", conf("1.1.0"))).await.unwrap_err();
    assert_eq!(err.code, codes::ENDPOINT);
    assert!(err.details.contains("undoing the ADD failed too"), "{err}");
    // The veth went; the addresses stay until the endpoint is surely gone.
    assert!(w.netlink.state().node.is_empty());
    assert_eq!(w.ipam.state().allocations.len(), 2);
}

#[tokio::test]
async fn add_times_out_and_undoes() {
    let w = World::new();
    w.endpoints.state().create_delay = Some(Duration::from_secs(5));
    let mut c = conf("1.1.0");
    c["timeoutSeconds"] = json!(1);
    let started = Instant::now();
    let err = w.run(&invocation("ADD", "c1", c)).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    assert_eq!(err.code, codes::TRY_AGAIN_LATER, "{err}");
    w.assert_clean();
}

#[tokio::test]
async fn add_readiness() {
    let w = World::new();
    w.endpoints.state().unreachable = true;
    let err = w.run(&invocation("ADD", "c1", conf("1.1.0"))).await.unwrap_err();
    assert_eq!(err.code, codes::NOT_AVAILABLE, "{err}");
    assert!(err.msg.contains("svc-endpoint"), "{err}");
    assert!(w.ipam.state().calls.is_empty(), "nothing allocated");

    let w = World::new();
    w.ipam.state().unreachable = true;
    let err = w.run(&invocation("ADD", "c1", conf("1.1.0"))).await.unwrap_err();
    assert_eq!(err.code, codes::NOT_AVAILABLE);
    assert!(err.msg.contains("svc-ipam"), "{err}");

    let w = World::new();
    let mut c = conf("1.1.0");
    c["ipamPool"] = json!("nope");
    let err = w.run(&invocation("ADD", "c1", c)).await.unwrap_err();
    assert_eq!(err.code, codes::INVALID_NETCONF);
    assert!(err.msg.contains("ipamPool"), "{err}");
    w.assert_clean();
}

#[tokio::test]
async fn add_refuses_a_netns_that_is_not_one() {
    let w = World::new();
    let mut inv = invocation("ADD", "c1", conf("1.1.0"));
    inv.env.netns = Some("/not-a-netns/x".into());
    let err = w.run(&inv).await.unwrap_err();
    assert_eq!(err.code, codes::INVALID_ENVIRONMENT);
    assert!(err.msg.contains("CNI_NETNS"), "{err}");
    w.assert_clean();
}

#[tokio::test]
async fn a_second_add_without_del_fails_and_touches_nothing() {
    let w = World::new();
    w.run(&invocation("ADD", "c1", conf("1.1.0"))).await.unwrap();
    let err = w.run(&invocation("ADD", "c1", conf("1.1.0"))).await.unwrap_err();
    assert_eq!(err.code, codes::ALREADY_EXISTS, "{err}");
    assert_eq!(w.endpoints.state().endpoints.len(), 1);
    assert_eq!(w.ipam.state().allocations.len(), 2);
    assert!(w.netlink.state().node.contains_key(&host_ifname("lxc", "c1", "eth0")));
}

#[tokio::test]
async fn del_removes_everything_and_is_idempotent() {
    let w = World::new();
    w.run(&invocation("ADD", "c1", conf("1.1.0"))).await.unwrap();
    w.run(&invocation("ADD", "c2", conf("1.1.0"))).await.unwrap();
    let prev = w.run(&invocation("ADD", "c3", conf("1.1.0"))).await.unwrap().unwrap();
    w.run(&invocation("DEL", "c1", conf("1.1.0"))).await.unwrap();
    w.run(&invocation("DEL", "c1", conf("1.1.0"))).await.unwrap();
    // With its own result as prevResult (what a runtime passes): still a full DEL.
    w.run(&invocation("DEL", "c3", with_prev(conf("1.1.0"), prev)))
        .await
        .unwrap();
    let mut no_netns = invocation("DEL", "c2", conf("1.1.0"));
    no_netns.env.netns = None;
    w.run(&no_netns).await.unwrap();
    w.assert_clean();
    // Never added at all.
    w.run(&invocation("DEL", "c9", conf("1.1.0"))).await.unwrap();
}

#[tokio::test]
async fn del_keeps_addresses_while_the_endpoint_may_exist() {
    let w = World::new();
    w.run(&invocation("ADD", "c1", conf("1.1.0"))).await.unwrap();
    w.endpoints.state().fail_delete = Some(Status::unavailable("svc-endpoint restarting"));
    let err = w.run(&invocation("DEL", "c1", conf("1.1.0"))).await.unwrap_err();
    assert_eq!(err.code, codes::TRY_AGAIN_LATER, "{err}");
    assert!(w.netlink.state().node.is_empty(), "the veth is deleted anyway");
    assert_eq!(w.ipam.state().allocations.len(), 2, "addresses kept");
    w.endpoints.state().fail_delete = None;
    w.run(&invocation("DEL", "c1", conf("1.1.0"))).await.unwrap();
    w.assert_clean();
}

fn ptp_result(host: &str) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "interfaces": [
            {"name": host, "mac": "aa:bb:cc:00:00:01"},
            {"name": "eth0", "mac": "AA:BB:CC:00:00:02", "sandbox": NETNS}
        ],
        "ips": [{"interface": 1, "address": "198.18.8.5/24", "gateway": "198.18.8.1"}],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dns": {}
    })
}

#[tokio::test]
async fn chained_add_creates_only_the_endpoint() {
    let w = World::new();
    let veth = w.netlink.add_node_link("veth1234abcd", "veth");
    let prev = ptp_result("veth1234abcd");
    let out = w
        .run(&invocation("ADD", "c1", with_prev(conf("1.0.0"), prev.clone())))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(out, prev, "prevResult is printed unchanged");
    assert!(w.ipam.state().calls.is_empty(), "no svc-ipam");
    assert!(w.netlink.state().calls.is_empty(), "no interfaces created");
    {
        let st = w.endpoints.state();
        let request = &st.requests[0];
        assert_eq!(request.host_interface, "veth1234abcd");
        assert_eq!(request.host_ifindex, veth.index);
        assert_eq!(request.mac, [0xaa, 0xbb, 0xcc, 0, 0, 2]);
        assert_eq!(
            request.addresses,
            [eppb::EndpointAddress {
                address: vec![198, 18, 8, 5],
                ipam_pool: String::new()
            }]
        );
    }

    // CHECK in chained mode looks at the endpoint and the previous plugin's veth.
    w.netlink.state().pods.insert(
        (NETNS.into(), "eth0".into()),
        (
            Link {
                index: 2,
                name: "eth0".into(),
                mac: Some([0xaa, 0xbb, 0xcc, 0, 0, 2]),
                mtu: 1500,
                up: true,
                kind: Some("veth".into()),
            },
            vec!["198.18.8.5/24".parse().unwrap()],
            vec![],
        ),
    );
    w.run(&invocation("CHECK", "c1", with_prev(conf("1.0.0"), prev.clone())))
        .await
        .unwrap();

    // DEL in chained mode deletes only the endpoint.
    w.run(&invocation("DEL", "c1", with_prev(conf("1.0.0"), prev)))
        .await
        .unwrap();
    assert!(w.endpoints.state().endpoints.is_empty());
    assert!(
        w.netlink.state().node.contains_key("veth1234abcd"),
        "ptp's veth is ptp's"
    );
    assert!(w.ipam.state().calls.is_empty(), "no svc-ipam release");
}

#[tokio::test]
async fn chained_add_errors() {
    let w = World::new();
    // No veth of that name in the node.
    let err = w
        .run(&invocation("ADD", "c1", with_prev(conf("1.0.0"), ptp_result("veth0"))))
        .await
        .unwrap_err();
    assert_eq!(err.code, codes::INVALID_NETCONF, "{err}");
    // No container interface of CNI_IFNAME.
    let mut prev = ptp_result("veth0");
    prev["interfaces"][1]["name"] = json!("net1");
    let err = w
        .run(&invocation("ADD", "c1", with_prev(conf("1.0.0"), prev)))
        .await
        .unwrap_err();
    assert_eq!(err.code, codes::INVALID_NETCONF);
    assert!(err.msg.contains("eth0"), "{err}");
    // A failing CreateEndpoint is undone.
    w.netlink.add_node_link("veth0", "veth");
    w.endpoints.state().fail_after_create = Some(Status::internal("boom"));
    let err = w
        .run(&invocation("ADD", "c1", with_prev(conf("1.0.0"), ptp_result("veth0"))))
        .await
        .unwrap_err();
    assert_eq!(err.code, codes::ENDPOINT);
    assert!(w.endpoints.state().endpoints.is_empty());
}

#[tokio::test]
async fn check_verifies_interface_routes_veth_and_endpoint() {
    let w = World::new();
    let prev = w.run(&invocation("ADD", "c1", conf("1.1.0"))).await.unwrap().unwrap();
    let check = || invocation("CHECK", "c1", with_prev(conf("1.1.0"), prev.clone()));
    w.run(&check()).await.unwrap();

    let expect = |err: CniError, needle: &str| {
        assert_eq!(err.code, codes::CHECK_FAILED, "{err}");
        assert!(err.msg.contains(needle), "{err} should mention {needle}");
    };
    // Not ready.
    w.endpoints.state().endpoints[0].state = eppb::EndpointState::Regenerating.into();
    expect(w.run(&check()).await.unwrap_err(), "REGENERATING");
    w.endpoints.state().endpoints[0].state = eppb::EndpointState::Ready.into();
    // A route gone.
    let key = (NETNS.to_string(), "eth0".to_string());
    let routes = std::mem::take(&mut w.netlink.state().pods.get_mut(&key).unwrap().2);
    expect(w.run(&check()).await.unwrap_err(), "default route");
    w.netlink.state().pods.get_mut(&key).unwrap().2 = routes;
    // An address gone.
    let addrs = std::mem::take(&mut w.netlink.state().pods.get_mut(&key).unwrap().1);
    expect(w.run(&check()).await.unwrap_err(), "lacks address");
    w.netlink.state().pods.get_mut(&key).unwrap().1 = addrs;
    // The endpoint gone.
    let endpoints = std::mem::take(&mut w.endpoints.state().endpoints);
    expect(w.run(&check()).await.unwrap_err(), "no endpoint");
    w.endpoints.state().endpoints = endpoints;
    w.run(&check()).await.unwrap();
    // The host veth gone (the container side goes with it).
    let host = host_ifname("lxc", "c1", "eth0");
    w.netlink.state().node.remove(&host);
    w.run(&check()).await.map(drop).expect_err("the host side is missing");
    w.netlink.state().pods.clear();
    expect(w.run(&check()).await.unwrap_err(), "missing");
}

#[tokio::test]
async fn check_needs_a_version_and_a_prev_result() {
    let w = World::new();
    let prev = w.run(&invocation("ADD", "c1", conf("0.3.1"))).await.unwrap().unwrap();
    let err = w
        .run(&invocation("CHECK", "c1", with_prev(conf("0.3.1"), prev)))
        .await
        .unwrap_err();
    assert_eq!(err.code, codes::INCOMPATIBLE_VERSION);
    let err = w.run(&invocation("CHECK", "c1", conf("0.4.0"))).await.unwrap_err();
    assert_eq!(err.code, codes::INVALID_NETCONF);
    assert!(err.msg.contains("prevResult"));
}

#[tokio::test]
async fn status() {
    let w = World::new();
    assert_eq!(w.run(&invocation("STATUS", "c1", conf("1.1.0"))).await.unwrap(), None);
    assert_eq!(
        w.run(&invocation("STATUS", "c1", conf("1.0.0")))
            .await
            .unwrap_err()
            .code,
        codes::INCOMPATIBLE_VERSION
    );
    w.ipam.state().unreachable = true;
    assert_eq!(
        w.run(&invocation("STATUS", "c1", conf("1.1.0")))
            .await
            .unwrap_err()
            .code,
        codes::NOT_AVAILABLE
    );
    // With a delegated IPAM plugin svc-ipam is not needed.
    let mut c = conf("1.1.0");
    c["ipam"] = json!({"type": "host-local"});
    assert_eq!(w.run(&invocation("STATUS", "c1", c)).await.unwrap(), None);
    w.endpoints.state().unreachable = true;
    let err = w.run(&invocation("STATUS", "c1", conf("1.1.0"))).await.unwrap_err();
    assert_eq!(err.code, codes::NOT_AVAILABLE);
}

#[tokio::test]
async fn gc_removes_what_is_not_valid() {
    let w = World::new();
    for c in ["c1", "c2", "c3"] {
        w.run(&invocation("ADD", c, conf("1.1.0"))).await.unwrap();
    }
    // A leak: an ADD that died after allocating and creating the veth.
    w.ipam
        .state()
        .allocations
        .insert("198.18.0.99".parse().unwrap(), ("c4".into(), "eth0".into()));
    w.netlink.add_node_link(&host_ifname("lxc", "c4", "eth0"), "veth");
    // An endpoint of another network (another pool) is not this network's to collect.
    w.endpoints.state().endpoints.push(eppb::Endpoint {
        id: 77,
        container_id: "other".into(),
        interface: "net1".into(),
        addresses: vec![eppb::EndpointAddress {
            address: vec![198, 19, 0, 5],
            ipam_pool: "blue".into(),
        }],
        ..Default::default()
    });

    // Without the list nothing goes.
    w.run(&invocation("GC", "", conf("1.1.0"))).await.unwrap();
    assert_eq!(w.endpoints.state().endpoints.len(), 4);

    let mut c = conf("1.1.0");
    c["cni.dev/valid-attachments"] = json!([{"containerID": "c2", "ifname": "eth0"}]);
    w.run(&invocation("GC", "", c)).await.unwrap();
    assert_eq!(w.endpoint_containers(), ["c2", "other"]);
    let owners: Vec<String> = w.ipam.state().allocations.values().map(|o| o.0.clone()).collect();
    assert_eq!(owners, ["c2", "c2"]);
    let links: Vec<String> = w.netlink.state().node.keys().cloned().collect();
    assert_eq!(links, [host_ifname("lxc", "c2", "eth0")]);

    // GC needs 1.1.0 and a complete endpoint list.
    assert_eq!(
        w.run(&invocation("GC", "", conf("1.0.0"))).await.unwrap_err().code,
        codes::INCOMPATIBLE_VERSION
    );
    w.endpoints.state().restore_complete = false;
    let mut c = conf("1.1.0");
    c["cni.dev/valid-attachments"] = json!([]);
    assert_eq!(
        w.run(&invocation("GC", "", c)).await.unwrap_err().code,
        codes::TRY_AGAIN_LATER
    );
    assert_eq!(w.endpoints.state().endpoints.len(), 2);
}

fn delegated_conf() -> Value {
    let mut c = conf("1.0.0");
    c["ipam"] = json!({"type": "host-local", "subnet": "198.18.8.0/24"});
    c
}

#[tokio::test]
async fn delegated_ipam() {
    let w = World::new();
    *w.delegate.add_output.lock().unwrap() = Some(Ok(json!({
        "cniVersion": "1.0.0",
        "ips": [{"address": "198.18.8.7/24", "gateway": "198.18.8.1"}],
        "routes": [{"dst": "198.19.0.0/16"}]
    })
    .to_string()
    .into_bytes()));
    let out = w
        .run(&invocation("ADD", "c1", delegated_conf()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        out["ips"],
        json!([{"address": "198.18.8.7/24", "gateway": "198.18.8.1", "interface": 1}])
    );
    assert_eq!(
        out["routes"],
        json!([{"dst": "0.0.0.0/0", "gw": "198.18.8.1"}, {"dst": "198.19.0.0/16", "gw": "198.18.8.1"}])
    );
    assert!(w.ipam.state().calls.is_empty(), "svc-ipam is not asked");
    assert_eq!(
        w.endpoints.state().requests[0].addresses[0].ipam_pool,
        "",
        "not svc-ipam's address"
    );
    w.run(&invocation("DEL", "c1", delegated_conf())).await.unwrap();
    assert_eq!(w.delegate.verbs(), [Command::Add, Command::Del]);
    assert!(w.netlink.state().node.is_empty());

    // A failure after the delegate allocated gives the address back with DEL.
    let w = World::new();
    *w.delegate.add_output.lock().unwrap() = Some(Ok(json!({
        "ips": [{"address": "198.18.8.7/24", "gateway": "198.18.8.1"}]
    })
    .to_string()
    .into_bytes()));
    w.endpoints.state().fail_create = Some(Status::internal("boom"));
    assert_eq!(
        w.run(&invocation("ADD", "c1", delegated_conf()))
            .await
            .unwrap_err()
            .code,
        codes::ENDPOINT
    );
    assert_eq!(w.delegate.verbs(), [Command::Add, Command::Del]);
    assert!(w.netlink.state().node.is_empty());

    // Its errors pass through with their code; a result without gateway is refused.
    let w = World::new();
    *w.delegate.add_output.lock().unwrap() = Some(Err(CniError::new(11, "host-local: busy")));
    assert_eq!(
        w.run(&invocation("ADD", "c1", delegated_conf()))
            .await
            .unwrap_err()
            .code,
        11
    );
    let w = World::new();
    *w.delegate.add_output.lock().unwrap() = Some(Ok(br#"{"ips": [{"address": "198.18.8.7/24"}]}"#.to_vec()));
    let err = w.run(&invocation("ADD", "c1", delegated_conf())).await.unwrap_err();
    assert_eq!(err.code, codes::DELEGATED_IPAM);
    assert!(err.msg.contains("gateway"), "{err}");
    assert_eq!(w.delegate.verbs(), [Command::Add, Command::Del]);
}

/// GC with a delegated IPAM plugin gives the removed attachments' addresses
/// back to it: its own GC when it speaks 1.1.0, else its DEL per removed
/// attachment in the newest version it takes (Debian's host-local stops at
/// 1.0.0 and knows no GC).
#[tokio::test]
async fn gc_releases_the_delegated_plugins_addresses() {
    let w = World::new();
    *w.delegate.add_output.lock().unwrap() = Some(Ok(json!({
        "cniVersion": "1.0.0",
        "ips": [{"address": "198.18.8.7/24", "gateway": "198.18.8.1"}]
    })
    .to_string()
    .into_bytes()));
    for c in ["c1", "c2", "c3"] {
        w.run(&invocation("ADD", c, delegated_conf())).await.unwrap();
    }
    w.delegate.calls.lock().unwrap().clear();
    let mut c = delegated_conf();
    c["cniVersion"] = "1.1.0".into();
    c["cni.dev/valid-attachments"] = json!([{"containerID": "c2", "ifname": "eth0"}]);
    w.run(&invocation("GC", "", c.clone())).await.unwrap();
    assert_eq!(w.endpoint_containers(), ["c2"]);
    let log = w.delegate.calls.lock().unwrap().clone();
    assert_eq!(log[0].command, Command::Version);
    let dels: Vec<_> = log[1..]
        .iter()
        .map(|call| (call.command, call.env[0].1.clone()))
        .collect();
    assert_eq!(
        dels,
        [(Command::Del, "c1".to_string()), (Command::Del, "c3".to_string())]
    );
    for call in &log[1..] {
        assert_eq!(call.env[1], ("CNI_IFNAME", "eth0".to_string()));
        let stdin: Value = serde_json::from_str(&call.stdin).unwrap();
        assert_eq!(stdin["cniVersion"], "1.0.0", "a version the plugin takes");
        assert_eq!(stdin["ipam"]["type"], "host-local");
    }

    // A plugin that speaks 1.1.0 gets GC itself, once, with the valid list.
    let w = World::new();
    *w.delegate.add_output.lock().unwrap() = Some(Ok(
        br#"{"ips": [{"address": "198.18.8.7/24", "gateway": "198.18.8.1"}]}"#.to_vec(),
    ));
    *w.delegate.version_output.lock().unwrap() = Some(br#"{"supportedVersions": ["1.0.0", "1.1.0"]}"#.to_vec());
    w.run(&invocation("ADD", "c1", delegated_conf())).await.unwrap();
    w.delegate.calls.lock().unwrap().clear();
    w.run(&invocation("GC", "", c.clone())).await.unwrap();
    assert_eq!(w.delegate.verbs(), [Command::Version, Command::Gc]);
    let gc = w.delegate.calls.lock().unwrap()[1].clone();
    assert!(gc.stdin.contains("cni.dev/valid-attachments"), "{}", gc.stdin);

    // Every failed DEL is reported, not only the first.
    let w = World::new();
    *w.delegate.add_output.lock().unwrap() = Some(Ok(
        br#"{"ips": [{"address": "198.18.8.7/24", "gateway": "198.18.8.1"}]}"#.to_vec(),
    ));
    for c in ["c1", "c2", "c3"] {
        w.run(&invocation("ADD", c, delegated_conf())).await.unwrap();
    }
    *w.delegate.fail_del.lock().unwrap() = true;
    let err = w.run(&invocation("GC", "", c)).await.unwrap_err();
    assert_eq!(err.code, 11, "{err}");
    assert!(err.msg.contains("DEL of c1: busy"), "{err}");
    assert!(err.details.contains("DEL of c3: busy"), "{err:?}");
}
