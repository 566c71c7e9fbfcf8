//! The index and the write order over in-memory maps ([`LbSnapshot`] as
//! the kernel); the pinned maps are exercised by `tests/lb.rs`.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use rivet_datapath::maps::legacy::LbServiceV1;
use rivet_datapath::maps::{
    LB_BACKEND_ACTIVE, LB_BACKEND_TERMINATING, LB_MAGLEV_SIZE, LbFrontendKey, SVC_F_AFFINITY, SVC_F_CLUSTER_IP,
    SVC_F_LOCAL, SVC_F_NODE_PORT, SVC_SCOPE_EXTERNAL, SVC_SCOPE_INTERNAL,
};
use rivet_proto::loader::v1 as pb;

use super::*;

/// The maps in memory, with every write logged (map, put?).
#[derive(Clone, Default)]
struct FakeMaps {
    state: Arc<Mutex<LbSnapshot>>,
    /// Records of the first layout an older loader left.
    legacy: Arc<Mutex<BTreeMap<u32, Box<LbServiceV1>>>>,
    log: Arc<Mutex<Vec<(&'static str, bool)>>>,
    /// Walks of the flow and affinity maps (`dynamic_entries` calls).
    walks: Arc<std::sync::atomic::AtomicUsize>,
}

impl ServiceMaps for FakeMaps {
    fn write(&self, write: LbWrite<'_>) -> Result<(), LbMapError> {
        let put = !matches!(
            write,
            LbWrite::Service(_, None)
                | LbWrite::ServiceBackend(_, None)
                | LbWrite::Backend(_, None)
                | LbWrite::Table(_, None)
                | LbWrite::RevNat(_, None)
                | LbWrite::Frontend(_, None)
        );
        self.log.lock().unwrap().push((write.map(), put));
        self.state.lock().unwrap().apply(write);
        Ok(())
    }

    fn snapshot(&self) -> Result<LbSnapshot, LbMapError> {
        Ok(self.state.lock().unwrap().clone())
    }

    fn legacy_services(&self) -> Result<BTreeMap<u32, Box<LbServiceV1>>, LbMapError> {
        Ok(self.legacy.lock().unwrap().clone())
    }

    fn remove_legacy_services(&self) -> Result<(), LbMapError> {
        self.legacy.lock().unwrap().clear();
        Ok(())
    }

    fn dynamic_entries(&self) -> Result<(u64, u64), LbMapError> {
        self.walks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok((6, 2))
    }
}

impl FakeMaps {
    fn snapshot_now(&self) -> LbSnapshot {
        self.state.lock().unwrap().clone()
    }

    fn take_log(&self) -> Vec<(&'static str, bool)> {
        std::mem::take(&mut self.log.lock().unwrap())
    }
}

const CAPACITY: LbCapacity = LbCapacity {
    services: 64,
    frontends: 64,
    backends: 64,
    tables: 64,
    service_backends: 256,
};

fn lb(maps: &FakeMaps) -> LoadBalancer {
    LoadBalancer::restore(Box::new(maps.clone()), CAPACITY).unwrap().0
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn backend(s: &str) -> Backend {
    Backend {
        addr: addr(s),
        terminating: false,
        node_local: false,
    }
}

fn service(id: u32, vip: &str, backends: &[&str]) -> Service {
    Service {
        id,
        family: if vip.starts_with('[') { 6 } else { 4 },
        protocol: 6,
        frontends: vec![Frontend::ClusterIp(addr(vip))],
        backends: backends.iter().map(|b| backend(b)).collect(),
        affinity_timeout: 0,
        local: false,
    }
}

fn backend_id(maps: &FakeMaps, a: &str) -> u32 {
    let snap = maps.snapshot_now();
    *snap
        .backends
        .iter()
        .find(|(_, b)| b.socket_addr() == Some(addr(a)))
        .unwrap_or_else(|| panic!("{a} is in lb_backends"))
        .0
}

fn vip_key(vip: &str) -> LbFrontendKey {
    LbFrontendKey::vip(addr(vip), 6, SVC_SCOPE_INTERNAL)
}

#[test]
fn an_upsert_writes_backend_list_record_backends_table_rev_nat_then_frontend() {
    let maps = FakeMaps::default();
    let lb = lb(&maps);
    let s = service(7, "198.19.128.10:80", &["198.18.0.2:8080", "198.18.0.3:8080"]);
    assert!(lb.upsert(&s).unwrap());
    let order: Vec<&str> = maps.take_log().into_iter().map(|(m, _)| m).collect();
    assert_eq!(
        order,
        [
            "lb_svc_backends",
            "lb_svc_backends",
            "lb_services",
            "lb_backends",
            "lb_backends",
            "lb_maglev",
            "lb_rev_nat",
            "lb_frontends"
        ]
    );
    let snap = maps.snapshot_now();
    let fe = snap.frontends[&vip_key("198.19.128.10:80")];
    assert_eq!((fe.service_id, fe.backend_count, fe.flags), (7, 2, SVC_F_CLUSTER_IP));
    let table = &snap.tables[&fe.table_id];
    let ids = [
        backend_id(&maps, "198.18.0.2:8080"),
        backend_id(&maps, "198.18.0.3:8080"),
    ];
    assert!(table.backend_ids.iter().all(|id| ids.contains(id)));
    assert_eq!(snap.rev_nat[&7].socket_addr(), Some(addr("198.19.128.10:80")));
    assert_eq!(snap.services[&7].backend_count, 2);
    assert_eq!(
        snap.service_backends
            .keys()
            .map(|k| (k.service_id, k.index))
            .collect::<Vec<_>>(),
        [(7, 0), (7, 1)]
    );

    // The same again: nothing written.
    assert!(!lb.upsert(&s).unwrap());
    assert_eq!(maps.take_log(), []);
}

#[test]
fn removing_a_backend_keeps_the_others_ids_and_deletes_it_last() {
    let maps = FakeMaps::default();
    let lb = lb(&maps);
    let three = ["198.18.0.2:80", "198.18.0.3:80", "198.18.0.4:80"];
    lb.upsert(&service(1, "198.19.128.1:80", &three)).unwrap();
    let before: Vec<u32> = three.iter().map(|b| backend_id(&maps, b)).collect();
    maps.take_log();
    lb.upsert(&service(1, "198.19.128.1:80", &three[..2])).unwrap();
    assert_eq!(
        maps.take_log(),
        [
            ("lb_services", true),
            ("lb_svc_backends", false),
            ("lb_maglev", true),
            ("lb_frontends", true),
            ("lb_backends", false)
        ]
    );
    assert_eq!(backend_id(&maps, three[0]), before[0]);
    assert_eq!(backend_id(&maps, three[1]), before[1]);
    let snap = maps.snapshot_now();
    assert!(!snap.backends.contains_key(&before[2]));
    let table = &snap.tables[&snap.frontends[&vip_key("198.19.128.1:80")].table_id];
    assert!(!table.backend_ids.contains(&before[2]));
}

#[test]
fn a_terminating_backend_keeps_its_entry_and_leaves_the_table() {
    let maps = FakeMaps::default();
    let lb = lb(&maps);
    let mut s = service(1, "198.19.128.1:80", &["198.18.0.2:80", "198.18.0.3:80"]);
    lb.upsert(&s).unwrap();
    let id = backend_id(&maps, "198.18.0.3:80");
    s.backends[1].terminating = true;
    assert!(lb.upsert(&s).unwrap());
    let snap = maps.snapshot_now();
    assert_eq!(snap.backends[&id].state, LB_BACKEND_TERMINATING);
    let fe = snap.frontends[&vip_key("198.19.128.1:80")];
    assert_eq!(fe.backend_count, 1);
    assert!(!snap.tables[&fe.table_id].backend_ids.contains(&id));
    let status = &lb.list()[0];
    assert_eq!(status.backends[1], (id, 0));
    assert_eq!(status.backends[0].1, LB_MAGLEV_SIZE as u32);

    // No active backend at all: the frontend says 0 (the datapath rejects).
    s.backends[0].terminating = true;
    lb.upsert(&s).unwrap();
    let snap = maps.snapshot_now();
    let fe = snap.frontends[&vip_key("198.19.128.1:80")];
    assert_eq!(fe.backend_count, 0);
    assert!(snap.tables[&fe.table_id].backend_ids.iter().all(|id| *id == 0));
}

#[test]
fn a_backend_shared_by_two_services_has_one_id_and_outlives_one_of_them() {
    let maps = FakeMaps::default();
    let lb = lb(&maps);
    let mut a = service(1, "198.19.128.1:80", &["198.18.0.2:80"]);
    let b = service(2, "198.19.128.2:80", &["198.18.0.2:80"]);
    lb.upsert(&a).unwrap();
    lb.upsert(&b).unwrap();
    assert_eq!(maps.snapshot_now().backends.len(), 1);
    let id = backend_id(&maps, "198.18.0.2:80");
    // Terminating in one service, active in the other: active.
    a.backends[0].terminating = true;
    lb.upsert(&a).unwrap();
    assert_eq!(maps.snapshot_now().backends[&id].state, LB_BACKEND_ACTIVE);
    assert!(lb.delete(2).unwrap());
    assert_eq!(maps.snapshot_now().backends[&id].state, LB_BACKEND_TERMINATING);
    assert!(lb.delete(1).unwrap());
    assert!(!lb.delete(1).unwrap());
    assert_eq!(maps.snapshot_now(), LbSnapshot::default(), "nothing left behind");
}

#[test]
fn delete_runs_in_reverse_order() {
    let maps = FakeMaps::default();
    let lb = lb(&maps);
    lb.upsert(&service(3, "198.19.128.3:53", &["198.18.0.2:53"])).unwrap();
    maps.take_log();
    lb.delete(3).unwrap();
    assert_eq!(
        maps.take_log(),
        [
            ("lb_frontends", false),
            ("lb_rev_nat", false),
            ("lb_maglev", false),
            ("lb_services", false),
            ("lb_svc_backends", false),
            ("lb_backends", false)
        ]
    );
}

#[test]
fn a_frontend_of_another_service_is_refused_but_moves_in_a_replace() {
    let maps = FakeMaps::default();
    let lb = lb(&maps);
    lb.upsert(&service(1, "198.19.128.1:80", &["198.18.0.2:80"])).unwrap();
    let err = lb
        .upsert(&service(2, "198.19.128.1:80", &["198.18.0.3:80"]))
        .unwrap_err();
    assert!(
        matches!(
            err,
            LbError::FrontendHeld {
                holder: 1,
                service_id: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("198.19.128.1:80"), "{err}");
    assert_eq!(maps.snapshot_now().services.len(), 1, "nothing of service 2 written");

    // In one replace, service 1 gives the VIP to service 2.
    let set = [
        service(1, "198.19.128.9:80", &["198.18.0.2:80"]),
        service(2, "198.19.128.1:80", &["198.18.0.3:80"]),
    ];
    let report = lb.replace(&set).unwrap();
    assert_eq!((report.upserted, report.deleted), (2, 0));
    let snap = maps.snapshot_now();
    assert_eq!(snap.frontends[&vip_key("198.19.128.1:80")].service_id, 2);
    assert_eq!(snap.frontends[&vip_key("198.19.128.9:80")].service_id, 1);
    assert_eq!(snap.frontends.len(), 2);

    // A replace without service 1 deletes it.
    let report = lb.replace(&set[1..]).unwrap();
    assert_eq!((report.upserted, report.deleted, report.unchanged), (0, 1, 1));
    assert_eq!(maps.snapshot_now().services.keys().copied().collect::<Vec<_>>(), [2]);
}

#[test]
fn node_port_local_has_an_external_frontend_with_the_node_local_backends() {
    let maps = FakeMaps::default();
    let lb = lb(&maps);
    let mut s = service(4, "198.19.128.4:80", &["198.18.0.2:80", "198.18.1.2:80"]);
    s.frontends.push(Frontend::NodePort(30080));
    s.backends[0].node_local = true;
    s.local = true;
    s.affinity_timeout = 300;
    lb.upsert(&s).unwrap();
    let snap = maps.snapshot_now();
    let internal = snap.frontends[&LbFrontendKey::node_port(4, 30080, 6, SVC_SCOPE_INTERNAL)];
    let external = snap.frontends[&LbFrontendKey::node_port(4, 30080, 6, SVC_SCOPE_EXTERNAL)];
    assert_eq!(internal.backend_count, 2);
    assert_eq!(external.backend_count, 1);
    assert_eq!(external.flags, SVC_F_NODE_PORT | SVC_F_LOCAL | SVC_F_AFFINITY);
    assert_eq!(external.affinity_timeout, 300);
    assert_ne!(internal.table_id, external.table_id);
    let local_id = backend_id(&maps, "198.18.0.2:80");
    assert!(
        snap.tables[&external.table_id]
            .backend_ids
            .iter()
            .all(|id| *id == local_id)
    );
    let clusterip = snap.frontends[&vip_key("198.19.128.4:80")];
    assert_eq!(clusterip.flags, SVC_F_CLUSTER_IP | SVC_F_AFFINITY);

    // Back to Cluster: the external frontend and its table go.
    s.local = false;
    lb.upsert(&s).unwrap();
    let snap = maps.snapshot_now();
    assert!(
        !snap
            .frontends
            .contains_key(&LbFrontendKey::node_port(4, 30080, 6, SVC_SCOPE_EXTERNAL))
    );
    assert!(!snap.tables.contains_key(&external.table_id));
    assert_eq!(snap.tables.len(), 1);
}

#[test]
fn restore_rebuilds_the_index_and_an_identical_replay_writes_nothing() {
    let maps = FakeMaps::default();
    let set = {
        let mut a = service(1, "198.19.128.1:80", &["198.18.0.2:80", "198.18.0.3:80"]);
        a.backends[1].terminating = true;
        a.backends[0].node_local = true;
        a.frontends.push(Frontend::NodePort(30001));
        a.local = true;
        a.affinity_timeout = 10;
        let b = service(2, "[2001:2:0:ff::2]:443", &["[2001:2::5]:8443"]);
        vec![a, b]
    };
    let first = lb(&maps);
    first.replace(&set).unwrap();
    let listed = first.list();
    let before = maps.snapshot_now();
    drop(first);
    maps.take_log();

    let (second, report) = LoadBalancer::restore(Box::new(maps.clone()), CAPACITY).unwrap();
    assert_eq!(
        report,
        RestoreReport {
            services: 2,
            incomplete: 0,
            orphans_removed: 0,
            converted: 0,
        }
    );
    assert_eq!(second.list(), listed);
    let report = second.replace(&set).unwrap();
    assert_eq!((report.upserted, report.unchanged), (0, 2));
    assert_eq!(maps.take_log(), [], "an identical replay writes nothing");
    assert_eq!(maps.snapshot_now(), before);
    // New ids do not collide with the restored ones.
    second
        .upsert(&service(3, "198.19.128.3:80", &["198.18.0.9:80"]))
        .unwrap();
    let snap = maps.snapshot_now();
    assert_eq!(snap.backends.len(), 4);
    assert_eq!(snap.tables.len(), 4);
}

#[test]
fn restore_removes_orphans_and_rewrites_a_half_written_service() {
    let maps = FakeMaps::default();
    let s = service(1, "198.19.128.1:80", &["198.18.0.2:80", "198.18.0.3:80"]);
    lb(&maps).upsert(&s).unwrap();
    let complete = maps.snapshot_now();
    {
        // A crash after the record named a new backend, before its entry;
        // and entries nothing references.
        let mut state = maps.state.lock().unwrap();
        let id = backend_id_in(&state, "198.18.0.3:80");
        state.backends.remove(&id);
        state.tables.insert(99, Box::default());
        state
            .backends
            .insert(77, rivet_datapath::maps::LbBackend::new(addr("198.18.0.77:1"), 0));
        state
            .frontends
            .insert(vip_key("198.19.128.77:80"), rivet_datapath::maps::LbFrontend::default());
        // A backend list entry past its record's count, one of no record.
        for (service_id, index) in [(1, 2), (9, 0)] {
            state
                .service_backends
                .insert(LbSvcBackendKey { service_id, index }, LbServiceBackend::default());
        }
    }
    let (lb, report) = LoadBalancer::restore(Box::new(maps.clone()), CAPACITY).unwrap();
    assert_eq!((report.services, report.incomplete, report.orphans_removed), (1, 1, 5));
    assert!(lb.upsert(&s).unwrap(), "the identical service is written again");
    let after = maps.snapshot_now();
    assert_eq!(after.frontends, complete.frontends);
    assert_eq!(after.backends.len(), 2);
    assert_eq!(after.tables.len(), 1);
    assert_eq!(after.service_backends, complete.service_backends);
}

/// A service costs a 24-byte record and one 8-byte entry per backend
/// besides its Maglev table, not 1,024 inline slots (8 KiB) whatever its
/// backends.
#[test]
fn a_service_record_is_sized_by_its_backends() {
    let maps = FakeMaps::default();
    lb(&maps)
        .upsert(&service(1, "198.19.128.1:80", &["198.18.0.2:80", "198.18.0.3:80"]))
        .unwrap();
    let snap = maps.snapshot_now();
    let record = size_of_val(&snap.services[&1]);
    let list: usize = snap
        .service_backends
        .iter()
        .map(|(k, v)| size_of_val(k) + size_of_val(v))
        .sum();
    assert_eq!((record, list), (24, 2 * 16));
}

/// Records of the first layout (backends inline) an older loader left are
/// converted at restore into the same service, then removed; the restored
/// index equals the one the old records describe and a replay writes
/// nothing.
#[test]
fn restore_converts_first_layout_records_and_a_replay_writes_nothing() {
    let maps = FakeMaps::default();
    let mut s = service(1, "198.19.128.1:80", &["198.18.0.2:80", "198.18.0.3:80"]);
    s.backends[1].terminating = true;
    let first = lb(&maps);
    first.upsert(&s).unwrap();
    let listed = first.list();
    drop(first);
    let current = maps.snapshot_now();
    {
        // What an older loader pinned: the record with its backends inline,
        // no lb_svc_backends.
        let mut state = maps.state.lock().unwrap();
        let record = state.services.remove(&1).unwrap();
        let mut old = Box::new(LbServiceV1 {
            record,
            backends: [LbServiceBackend::default(); rivet_datapath::maps::legacy::LB_SERVICE_V1_MAX_BACKENDS],
        });
        for (slot, entry) in old.backends.iter_mut().zip(state.service_backends.values()) {
            *slot = *entry;
        }
        state.service_backends.clear();
        maps.legacy.lock().unwrap().insert(1, old);
    }
    maps.take_log();

    let (second, report) = LoadBalancer::restore(Box::new(maps.clone()), CAPACITY).unwrap();
    assert_eq!((report.converted, report.services, report.incomplete), (1, 1, 0));
    assert!(maps.legacy.lock().unwrap().is_empty(), "the old records are removed");
    assert_eq!(maps.snapshot_now(), current);
    assert_eq!(second.list(), listed);
    maps.take_log();
    assert!(!second.upsert(&s).unwrap());
    assert_eq!(maps.take_log(), [], "a replay writes nothing");
}

fn backend_id_in(snap: &LbSnapshot, a: &str) -> u32 {
    *snap
        .backends
        .iter()
        .find(|(_, b)| b.socket_addr() == Some(addr(a)))
        .unwrap()
        .0
}

#[test]
fn a_full_map_is_refused_before_anything_is_written() {
    let maps = FakeMaps::default();
    let lb = LoadBalancer::restore(
        Box::new(maps.clone()),
        LbCapacity {
            backends: 2,
            ..CAPACITY
        },
    )
    .unwrap()
    .0;
    lb.upsert(&service(1, "198.19.128.1:80", &["198.18.0.2:80", "198.18.0.3:80"]))
        .unwrap();
    maps.take_log();
    let err = lb
        .upsert(&service(2, "198.19.128.2:80", &["198.18.0.4:80"]))
        .unwrap_err();
    assert!(err.is_map_full(), "{err}");
    assert!(err.to_string().contains("lb_backends"), "{err}");
    assert_eq!(maps.take_log(), []);

    // The services' backend lists have a room of their own.
    let lb = LoadBalancer::restore(
        Box::new(maps.clone()),
        LbCapacity {
            service_backends: 3,
            ..CAPACITY
        },
    )
    .unwrap()
    .0;
    let err = lb
        .upsert(&service(2, "198.19.128.2:80", &["198.18.0.2:80", "198.18.0.3:80"]))
        .unwrap_err();
    assert!(
        err.to_string().contains("lb_svc_backends would need 4 entries"),
        "{err}"
    );
    assert_eq!(maps.take_log(), []);
}

/// ListServices walks the flow and affinity maps only when the request
/// asks for their counts (they hold up to hundreds of thousands of entries).
#[tokio::test]
async fn list_services_counts_flow_entries_only_when_asked() {
    use pb::load_balancer_service_server::LoadBalancerService as _;
    use std::sync::atomic::Ordering;

    let maps = FakeMaps::default();
    let lb = Arc::new(lb(&maps));
    lb.upsert(&service(1, "198.19.128.1:80", &["198.18.0.2:80"])).unwrap();
    let grpc = service::LoadBalancerService::new(
        lb,
        rivet_common::grpc::BootId::random(),
        crate::events::LoaderMetrics::default(),
    );
    let list = |count_entries| grpc.list_services(tonic::Request::new(pb::ListServicesRequest { count_entries }));

    let plain = list(false).await.unwrap().into_inner();
    assert_eq!(plain.services.len(), 1);
    assert_eq!(
        maps.walks.load(Ordering::SeqCst),
        0,
        "a plain list walked the flow maps"
    );
    assert!(!plain.entries_counted);
    assert_eq!((plain.flow_entries, plain.affinity_entries), (0, 0));

    let counted = list(true).await.unwrap().into_inner();
    assert_eq!(maps.walks.load(Ordering::SeqCst), 1);
    assert!(counted.entries_counted);
    assert_eq!((counted.flow_entries, counted.affinity_entries), (6, 2));
    assert_eq!(counted.services, plain.services);
}

fn pb_service() -> pb::LbService {
    pb::LbService {
        service_id: 5,
        family: pb::Family::Ipv4 as i32,
        protocol: pb::Protocol::Tcp as i32,
        frontends: vec![
            pb::LbFrontend {
                kind: pb::FrontendKind::ClusterIp as i32,
                address: vec![198, 19, 128, 5],
                port: 80,
            },
            pb::LbFrontend {
                kind: pb::FrontendKind::NodePort as i32,
                address: vec![],
                port: 30005,
            },
        ],
        backends: vec![pb::LbBackend {
            address: vec![198, 18, 0, 2],
            port: 8080,
            state: pb::BackendState::Active as i32,
            node_local: true,
        }],
        affinity_timeout_seconds: 0,
        external_traffic_policy: pb::TrafficPolicy::Local as i32,
    }
}

/// A node sized past the maps' default 65,536 services (`--lb-services-max`)
/// takes a set that large: the stream's own bound is far above it.
#[test]
fn a_set_past_the_default_map_size_is_valid() {
    let set: Vec<pb::LbService> = (0..70_000u32)
        .map(|i| pb::LbService {
            service_id: i + 1,
            frontends: vec![pb::LbFrontend {
                kind: pb::FrontendKind::ClusterIp as i32,
                address: (u32::from(std::net::Ipv4Addr::new(198, 18, 0, 0)) + i)
                    .to_be_bytes()
                    .to_vec(),
                port: 80,
            }],
            ..pb_service()
        })
        .collect();
    assert_eq!(validate::service_set(&set).unwrap().len(), 70_000);
}

#[test]
fn a_good_service_converts_and_round_trips() {
    let s = validate::service("service", &pb_service()).unwrap();
    assert_eq!(
        s.frontends,
        [Frontend::ClusterIp(addr("198.19.128.5:80")), Frontend::NodePort(30005)]
    );
    assert!(s.local && s.backends[0].node_local);
    assert_eq!(validate::service("service", &service::service_proto(&s)).unwrap(), s);
}

#[test]
fn each_bad_field_is_named() {
    type Edit = fn(&mut pb::LbService);
    let cases: &[(&str, Edit)] = &[
        ("service.service_id", |s| s.service_id = 0),
        ("service.family", |s| s.family = 0),
        ("service.protocol", |s| s.protocol = pb::Protocol::Icmp as i32),
        ("service.frontends", |s| s.frontends.clear()),
        ("service.frontends[0].address", |s| s.frontends[0].address = vec![0; 16]),
        ("service.frontends[0].address", |s| {
            s.frontends[0].address = vec![0, 0, 0, 0]
        }),
        ("service.frontends[0].port", |s| s.frontends[0].port = 0),
        ("service.frontends[0].port", |s| s.frontends[0].port = 65536),
        ("service.frontends[0].kind", |s| s.frontends[0].kind = 0),
        ("service.frontends[1].address", |s| {
            s.frontends[1].address = vec![1, 2, 3, 4]
        }),
        ("service.frontends[1]", |s| s.frontends[1] = s.frontends[0].clone()),
        ("service.backends[0].address", |s| {
            s.backends[0].address = vec![127, 0, 0, 1]
        }),
        ("service.backends[0].port", |s| s.backends[0].port = 0),
        ("service.backends[0].state", |s| s.backends[0].state = 0),
        ("service.backends[1]", |s| s.backends.push(s.backends[0].clone())),
        ("service.backends", |s| s.backends = vec![s.backends[0].clone(); 1001]),
        ("service.affinity_timeout_seconds", |s| {
            s.affinity_timeout_seconds = 86_401
        }),
        ("service.external_traffic_policy", |s| s.external_traffic_policy = 9),
    ];
    for (field, edit) in cases {
        let mut s = pb_service();
        edit(&mut s);
        let err = validate::service("service", &s).unwrap_err();
        assert_eq!(err.field, *field, "{err}");
    }
    let mut twin = pb_service();
    twin.service_id = 6;
    let err = validate::service_set(&[pb_service(), twin]).unwrap_err();
    assert_eq!(err.field, "services[1].frontends");
    let err = validate::service_set(&[pb_service(), pb_service()]).unwrap_err();
    assert_eq!(err.field, "services[1].service_id");
}
