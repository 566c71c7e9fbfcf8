use std::sync::Mutex;

use super::*;

/// A route table in memory, counting requests.
#[derive(Default)]
struct FakeRoutes {
    routes: Mutex<BTreeSet<PeerRoute>>,
    requests: Mutex<Vec<String>>,
}

impl RouteTable for std::sync::Arc<FakeRoutes> {
    fn owned_routes(&self) -> io::Result<Vec<PeerRoute>> {
        Ok(self.routes.lock().unwrap().iter().copied().collect())
    }
    fn replace(&self, route: &PeerRoute) -> io::Result<()> {
        self.requests
            .lock()
            .unwrap()
            .push(format!("replace {}", describe(route)));
        let mut routes = self.routes.lock().unwrap();
        routes.retain(|r| r.destination != route.destination);
        routes.insert(*route);
        Ok(())
    }
    fn delete(&self, route: &PeerRoute) -> io::Result<()> {
        self.requests
            .lock()
            .unwrap()
            .push(format!("delete {}", describe(route)));
        self.routes.lock().unwrap().remove(route);
        Ok(())
    }
}

fn peer(n: u8, v6: bool) -> PeerNode {
    PeerNode {
        name: format!("n{n}"),
        underlay_ipv4: Some(Ipv4Addr::new(198, 19, 254, n)),
        underlay_ipv6: v6.then(|| Ipv6Addr::new(0x2001, 2, 0, 0xfe, 0, 0, 0, u16::from(n))),
        pod_cidrs: vec![
            format!("198.18.{n}.0/24").parse().unwrap(),
            format!("2001:2:0:{n}::/64").parse().unwrap(),
        ],
    }
}

fn routing(mode: RoutingMode) -> (NodeRouting, std::sync::Arc<FakeRoutes>) {
    let fake = std::sync::Arc::new(FakeRoutes::default());
    let setup = RoutingSetup {
        mode,
        underlay: Some(("ul0".into(), 2)),
        tunnel_ifindex: (mode == RoutingMode::Vxlan).then_some(9),
        tunnel_port: DEFAULT_TUNNEL_PORT,
        underlay_addresses: (Some(Ipv4Addr::new(198, 19, 254, 1)), None),
    };
    (NodeRouting::new(setup, Box::new(fake.clone())), fake)
}

#[test]
fn native_routes_go_via_the_peer_underlay_address_of_the_cidr_family() {
    let (r, fake) = routing(RoutingMode::Native);
    let changes = r.replace_nodes(vec![peer(2, true), peer(3, true)]).unwrap();
    assert_eq!(
        changes,
        RouteChanges {
            added: 4,
            removed: 0,
            unchanged: 0,
            deferred: 0
        }
    );
    let routes: Vec<String> = fake.routes.lock().unwrap().iter().map(describe).collect();
    assert_eq!(
        routes,
        [
            "198.18.2.0/24 via 198.19.254.2 ifindex 2",
            "198.18.3.0/24 via 198.19.254.3 ifindex 2",
            "2001:2:0:2::/64 via 2001:2:0:fe::2 ifindex 2",
            "2001:2:0:3::/64 via 2001:2:0:fe::3 ifindex 2",
        ]
    );
}

#[test]
fn a_resync_removes_exactly_the_routes_of_a_peer_that_left_and_rewrites_nothing_else() {
    let (r, fake) = routing(RoutingMode::Vxlan);
    r.replace_nodes(vec![peer(2, true), peer(3, true)]).unwrap();
    fake.requests.lock().unwrap().clear();
    let changes = r.replace_nodes(vec![peer(3, true)]).unwrap();
    assert_eq!(
        changes,
        RouteChanges {
            added: 0,
            removed: 2,
            unchanged: 2,
            deferred: 0
        }
    );
    assert_eq!(
        *fake.requests.lock().unwrap(),
        [
            "delete 198.18.2.0/24 ifindex 9 src 198.19.254.1",
            "delete 2001:2:0:2::/64 ifindex 9"
        ]
    );
    assert_eq!(r.status().unwrap().peers, vec![peer(3, true)]);
    assert_eq!(r.status().unwrap().routes, 2);
}

#[test]
fn a_changed_next_hop_is_replaced_in_place() {
    let (r, fake) = routing(RoutingMode::Native);
    r.replace_nodes(vec![peer(2, true)]).unwrap();
    fake.requests.lock().unwrap().clear();
    let mut moved = peer(2, true);
    moved.underlay_ipv4 = Some(Ipv4Addr::new(198, 19, 254, 9));
    let changes = r.replace_nodes(vec![moved]).unwrap();
    assert_eq!((changes.added, changes.removed, changes.unchanged), (1, 0, 1));
    assert_eq!(
        *fake.requests.lock().unwrap(),
        ["replace 198.18.2.0/24 via 198.19.254.9 ifindex 2"]
    );
}

#[test]
fn an_ipv4_cidr_of_a_peer_with_only_ipv6_underlay_goes_via_inet6() {
    let (r, _) = routing(RoutingMode::Native);
    let mut v6_only = peer(4, true);
    v6_only.underlay_ipv4 = None;
    let routes = r.desired_routes(&[v6_only]).unwrap();
    assert_eq!(
        routes[&"198.18.4.0/24".parse::<IpNet>().unwrap()].gateway,
        Some("2001:2:0:fe::4".parse().unwrap())
    );
}

#[test]
fn mode_none_holds_no_peers() {
    let fake = std::sync::Arc::new(FakeRoutes::default());
    let r = NodeRouting::new(
        RoutingSetup {
            mode: RoutingMode::None,
            underlay: None,
            tunnel_ifindex: None,
            tunnel_port: DEFAULT_TUNNEL_PORT,
            underlay_addresses: (None, None),
        },
        Box::new(fake.clone()),
    );
    assert!(matches!(
        r.replace_nodes(vec![peer(2, true)]),
        Err(RoutingError::Disabled)
    ));
    assert!(fake.requests.lock().unwrap().is_empty());
}

/// A route table whose every add fails with `errno` (a device that is down).
struct DownRoutes(std::sync::Arc<FakeRoutes>, i32);

impl RouteTable for DownRoutes {
    fn owned_routes(&self) -> io::Result<Vec<PeerRoute>> {
        self.0.owned_routes()
    }
    fn replace(&self, _route: &PeerRoute) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(self.1))
    }
    fn delete(&self, route: &PeerRoute) -> io::Result<()> {
        self.0.delete(route)
    }
}

#[test]
fn resync_restores_the_held_peers_routes_and_holds_nothing_before_the_first_push() {
    let (routing, fake) = routing(RoutingMode::Native);
    let stale = PeerRoute {
        destination: "198.18.7.0/24".parse().unwrap(),
        gateway: Some(IpAddr::V4(Ipv4Addr::new(198, 19, 254, 7))),
        ifindex: 2,
        source: None,
    };
    fake.routes.lock().unwrap().insert(stale);
    assert_eq!(
        routing.resync().unwrap(),
        None,
        "nothing held: a restarted loader keeps its routes"
    );
    assert_eq!(fake.routes.lock().unwrap().len(), 1);

    routing.replace_nodes(vec![peer(2, true)]).unwrap();
    fake.routes.lock().unwrap().clear();
    let changes = routing.resync().unwrap().unwrap();
    assert_eq!((changes.added, changes.removed, changes.unchanged), (2, 0, 0));
    let again = routing.resync().unwrap().unwrap();
    assert_eq!((again.added, again.unchanged), (0, 2));
}

#[test]
fn a_route_whose_device_is_down_is_deferred_and_any_other_failure_is_an_error() {
    for (errno, deferred) in [(libc::ENETDOWN, true), (libc::ENETUNREACH, true), (libc::EPERM, false)] {
        let fake = std::sync::Arc::new(FakeRoutes::default());
        let (template, _) = routing(RoutingMode::Native);
        let routing = NodeRouting::new(template.setup().clone(), Box::new(DownRoutes(fake, errno)));
        match routing.replace_nodes(vec![peer(2, true)]) {
            Ok(changes) => {
                assert!(deferred, "errno {errno} is an error");
                assert_eq!((changes.added, changes.deferred), (0, 2));
                assert_eq!(routing.status().unwrap().peers.len(), 1, "the peers are held");
            }
            Err(e) => {
                assert!(!deferred, "errno {errno} defers: {e}");
                assert_eq!(e.kind(), "add");
            }
        }
    }
}
