//! LoadBalancerService against the real loader in a node namespace: what
//! the calls write is read back from the pinned maps, validation errors
//! carry their reasons, and a loader killed with SIGKILL rebuilds its index
//! from the pins so that a replay changes nothing.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use aya::maps::{HashMap, MapData};
use rivet_common::grpc::error_reason;
use rivet_datapath::maps::{
    LB_BACKEND_ACTIVE, LB_BACKEND_TERMINATING, LbBackend, LbFrontend, LbFrontendKey, LbMaglevTable, LbRevNat,
    LbService, LbServiceBackend, LbSvcBackendKey, SVC_F_AFFINITY, SVC_F_CLUSTER_IP, SVC_SCOPE_INTERNAL,
};
use rivet_datapath::{open_pinned_map, spec};
use rivet_proto::loader::v1 as pb;
use rivet_testkit::loader::LoaderNode;
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_svc-loader");

/// Every entry the loader writes, read from the pins.
#[derive(Debug, PartialEq, Eq)]
struct Maps {
    frontends: BTreeMap<LbFrontendKey, LbFrontend>,
    backends: BTreeMap<u32, LbBackend>,
    tables: BTreeMap<u32, Box<LbMaglevTable>>,
    rev_nat: BTreeMap<u32, LbRevNat>,
    services: BTreeMap<u32, LbService>,
    service_backends: BTreeMap<LbSvcBackendKey, LbServiceBackend>,
}

fn dump<K: aya::Pod + Ord, V: aya::Pod>(pins: &Path, def: &'static spec::MapDef) -> BTreeMap<K, V> {
    let map: HashMap<MapData, K, V> = open_pinned_map(pins, def)
        .expect("the pinned map opens")
        .try_into()
        .expect("a hash map of the ABI's types");
    map.iter().map(|e| e.expect("the map reads")).collect()
}

fn read_maps(node: &LoaderNode) -> Maps {
    let pins = &node.pins.0;
    Maps {
        frontends: dump(pins, &spec::LB_FRONTENDS),
        backends: dump(pins, &spec::LB_BACKENDS),
        tables: dump::<u32, LbMaglevTable>(pins, &spec::LB_MAGLEV)
            .into_iter()
            .map(|(k, v)| (k, Box::new(v)))
            .collect(),
        rev_nat: dump(pins, &spec::LB_REV_NAT),
        services: dump(pins, &spec::LB_SERVICES),
        service_backends: dump(pins, &spec::LB_SVC_BACKENDS),
    }
}

fn bytes(addr: SocketAddr) -> Vec<u8> {
    rivet_proto::net::address_bytes(addr.ip())
}

fn backend(addr: &str, state: pb::BackendState) -> pb::LbBackend {
    let addr: SocketAddr = addr.parse().unwrap();
    pb::LbBackend {
        address: bytes(addr),
        port: u32::from(addr.port()),
        state: state as i32,
        node_local: false,
    }
}

fn service(id: u32, vip: &str, backends: Vec<pb::LbBackend>) -> pb::LbService {
    let vip: SocketAddr = vip.parse().unwrap();
    pb::LbService {
        service_id: id,
        family: if vip.is_ipv4() {
            pb::Family::Ipv4
        } else {
            pb::Family::Ipv6
        } as i32,
        protocol: pb::Protocol::Tcp as i32,
        frontends: vec![pb::LbFrontend {
            kind: pb::FrontendKind::ClusterIp as i32,
            address: bytes(vip),
            port: u32::from(vip.port()),
        }],
        backends,
        affinity_timeout_seconds: 0,
        external_traffic_policy: pb::TrafficPolicy::Cluster as i32,
    }
}

fn the_set() -> Vec<pb::LbService> {
    use pb::BackendState::{Active, Terminating};
    let mut v4 = service(
        1,
        "198.19.128.10:80",
        vec![
            backend("198.18.0.2:8080", Active),
            backend("198.18.0.3:8080", Active),
            backend("198.18.0.4:8080", Terminating),
        ],
    );
    v4.affinity_timeout_seconds = 30;
    v4.frontends.push(pb::LbFrontend {
        kind: pb::FrontendKind::NodePort as i32,
        address: Vec::new(),
        port: 30080,
    });
    v4.external_traffic_policy = pb::TrafficPolicy::Local as i32;
    v4.backends[0].node_local = true;
    let v6 = service(2, "[2001:2:0:ff::a]:443", vec![backend("[2001:2::2]:8443", Active)]);
    vec![v4, v6]
}

/// Every service `node`'s loader lists (no entry counts).
async fn list(node: &LoaderNode) -> pb::ListServicesResponse {
    node.lb_client()
        .await
        .list_services(pb::ListServicesRequest::default())
        .await
        .expect("ListServices answers")
        .into_inner()
}

async fn replace(node: &LoaderNode, services: Vec<pb::LbService>) -> pb::ReplaceServicesResponse {
    node.lb_client()
        .await
        .replace_services(tokio_stream::iter([pb::ReplaceServicesRequest { services }]))
        .await
        .expect("ReplaceServices succeeds")
        .into_inner()
}

#[tokio::test(flavor = "multi_thread")]
async fn upsert_replace_and_delete_read_back_from_the_pinned_maps() {
    let node = LoaderNode::start(BIN.as_ref(), &[], &[])
        .await
        .expect("a test node starts");
    let mut lb = node.lb_client().await;
    let s = service(
        7,
        "198.19.128.7:80",
        vec![
            backend("198.18.0.2:80", pb::BackendState::Active),
            backend("198.18.0.3:80", pb::BackendState::Active),
        ],
    );
    let up = lb
        .upsert_service(pb::UpsertServiceRequest {
            service: Some(s.clone()),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(up.changed && !up.boot_id.is_empty());
    let maps = read_maps(&node);
    let key = LbFrontendKey::vip("198.19.128.7:80".parse().unwrap(), 6, SVC_SCOPE_INTERNAL);
    let fe = maps.frontends[&key];
    assert_eq!((fe.service_id, fe.backend_count, fe.flags), (7, 2, SVC_F_CLUSTER_IP));
    let ids: Vec<u32> = maps.backends.keys().copied().collect();
    assert_eq!(ids.len(), 2);
    assert!(maps.tables[&fe.table_id].backend_ids.iter().all(|id| ids.contains(id)));
    assert_eq!(maps.rev_nat[&7].socket_addr(), Some("198.19.128.7:80".parse().unwrap()));

    // Listed with its slots; an identical upsert changes nothing.
    let listed = lb
        .list_services(pb::ListServicesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.services.len(), 1);
    let slots: u32 = listed.services[0].backends.iter().map(|b| b.maglev_slots).sum();
    assert_eq!(slots, 1021);
    assert_eq!(listed.services[0].service.as_ref(), Some(&s));
    let again = lb
        .upsert_service(pb::UpsertServiceRequest {
            service: Some(s.clone()),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.changed);
    assert_eq!(read_maps(&node), maps);

    // Replace with the set: service 7 goes, 1 and 2 come.
    let report = replace(&node, the_set()).await;
    assert_eq!((report.upserted, report.deleted), (2, 1));
    let maps = read_maps(&node);
    assert_eq!(maps.services.keys().copied().collect::<Vec<_>>(), [1, 2]);
    assert!(!maps.frontends.contains_key(&key));
    let states: Vec<u8> = maps.backends.values().map(|b| b.state).collect();
    assert_eq!(
        states.iter().filter(|s| **s == LB_BACKEND_TERMINATING).count(),
        1,
        "{states:?}"
    );
    assert_eq!(states.iter().filter(|s| **s == LB_BACKEND_ACTIVE).count(), 3);
    let fe = maps.frontends[&LbFrontendKey::vip("198.19.128.10:80".parse().unwrap(), 6, SVC_SCOPE_INTERNAL)];
    assert_eq!(
        (fe.backend_count, fe.flags, fe.affinity_timeout),
        (2, SVC_F_CLUSTER_IP | SVC_F_AFFINITY, 30)
    );
    assert_eq!(
        maps.frontends.len(),
        4,
        "ClusterIP, NodePort internal and external, IPv6 ClusterIP"
    );

    // Delete both: nothing is left.
    for id in [1, 2] {
        let deleted = lb
            .delete_service(pb::DeleteServiceRequest { service_id: id })
            .await
            .unwrap();
        assert!(deleted.into_inner().existed);
    }
    let empty = read_maps(&node);
    assert!(
        empty.frontends.is_empty()
            && empty.backends.is_empty()
            && empty.tables.is_empty()
            && empty.rev_nat.is_empty()
            && empty.services.is_empty()
            && empty.service_backends.is_empty(),
        "{empty:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_services_and_held_frontends_are_refused_with_their_reasons() {
    let node = LoaderNode::start(BIN.as_ref(), &[], &[])
        .await
        .expect("a test node starts");
    let mut lb = node.lb_client().await;
    let mut bad = service(
        1,
        "198.19.128.1:80",
        vec![backend("198.18.0.2:80", pb::BackendState::Active)],
    );
    bad.backends[0].port = 0;
    let err = lb
        .upsert_service(pb::UpsertServiceRequest { service: Some(bad) })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("service.backends[0].port"), "{}", err.message());
    let err = lb
        .upsert_service(pb::UpsertServiceRequest { service: None })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("service"), "{}", err.message());

    let one = service(
        1,
        "198.19.128.1:80",
        vec![backend("198.18.0.2:80", pb::BackendState::Active)],
    );
    lb.upsert_service(pb::UpsertServiceRequest { service: Some(one) })
        .await
        .unwrap();
    let thief = service(
        2,
        "198.19.128.1:80",
        vec![backend("198.18.0.3:80", pb::BackendState::Active)],
    );
    let err = lb
        .upsert_service(pb::UpsertServiceRequest { service: Some(thief) })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    assert_eq!(
        error_reason::<pb::ErrorReason>(&err),
        Some(pb::ErrorReason::FrontendHeld)
    );
    assert_eq!(
        read_maps(&node).services.len(),
        1,
        "nothing of the refused service was written"
    );

    let err = lb
        .delete_service(pb::DeleteServiceRequest { service_id: 0 })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_restores_the_index_from_the_pins_and_a_replay_changes_nothing() {
    let mut node = LoaderNode::start(BIN.as_ref(), &[], &[])
        .await
        .expect("a test node starts");
    replace(&node, the_set()).await;
    let listed_before = list(&node).await;
    let before = read_maps(&node);

    node.loader.kill9();
    node.loader.restart().await.expect("the loader restarts on its pins");

    let listed_after = list(&node).await;
    assert_ne!(listed_after.boot_id, listed_before.boot_id);
    assert_eq!(listed_after.services, listed_before.services, "the index is restored");
    let report = replace(&node, the_set()).await;
    assert_eq!(
        (report.upserted, report.deleted),
        (0, 0),
        "the replay finds every service as it was"
    );
    assert_eq!(read_maps(&node), before, "the maps are byte-identical");
}

/// An upgrade from a loader whose service records held 1,024 backend
/// slots inline (`lb_services` of 8,216-byte values, no `lb_svc_backends`):
/// the new loader sets the old pin aside, converts every record, removes
/// it, and restores the same index from the same maps.
#[tokio::test(flavor = "multi_thread")]
async fn an_upgrade_converts_first_layout_service_records() {
    use rivet_datapath::maps::legacy::{LB_SERVICE_V1_MAX_BACKENDS, LB_SERVICES_V1, LbServiceV1};

    let mut node = LoaderNode::start(BIN.as_ref(), &[], &[])
        .await
        .expect("a test node starts");
    replace(&node, the_set()).await;
    let listed_before = list(&node).await;
    let before = read_maps(&node);
    node.loader.kill9();

    // The pins as the older loader left them.
    let pins = node.pins.0.clone();
    for map in [spec::MAP_LB_SERVICES, spec::MAP_LB_SVC_BACKENDS] {
        std::fs::remove_file(pins.join(map)).unwrap();
    }
    let mut old: HashMap<MapData, u32, LbServiceV1> =
        rivet_datapath::pin::create_pinned_map(&pins, &LB_SERVICES_V1, 1024)
            .expect("a first-layout lb_services")
            .try_into()
            .unwrap();
    for (id, record) in &before.services {
        let mut v1 = LbServiceV1 {
            record: *record,
            backends: [LbServiceBackend::default(); LB_SERVICE_V1_MAX_BACKENDS],
        };
        for (slot, (_, entry)) in v1.backends.iter_mut().zip(before.service_backends.range(
            LbSvcBackendKey {
                service_id: *id,
                index: 0,
            }..,
        )) {
            *slot = *entry;
        }
        old.insert(id, v1, 0).unwrap();
    }
    drop(old);

    node.loader
        .restart()
        .await
        .expect("the loader restarts on the old pins");
    assert!(
        !pins.join(svc_loader::datapath::LB_SERVICES_V1_PIN).exists(),
        "the old records are removed once converted"
    );
    let listed_after = list(&node).await;
    assert_eq!(listed_after.services, listed_before.services, "the index is restored");
    assert_eq!(read_maps(&node), before, "the maps say what they said");
    let report = replace(&node, the_set()).await;
    assert_eq!((report.upserted, report.deleted), (0, 0), "a replay changes nothing");
}

/// The kernel memory of the maps a service's state lives in besides its
/// frontends (lb_services, lb_svc_backends, lb_maglev: allocated as used)
/// is about its Maglev table (4 KiB) and a small record: before, every
/// record held 1,024 backend slots (8 KiB).
#[tokio::test(flavor = "multi_thread")]
async fn a_service_costs_about_its_maglev_table() {
    const SERVICES: u32 = 200;
    let node = LoaderNode::start(BIN.as_ref(), &[], &[])
        .await
        .expect("a test node starts");
    let memory = || -> u64 {
        ["lb_services", "lb_svc_backends", "lb_maglev"]
            .iter()
            .map(|map| node.pins.0.join(map))
            .filter(|pin| pin.exists())
            .map(|pin| rivet_testkit::scale::pinned_map_memory(&pin).expect("memlock of the map"))
            .sum()
    };
    let empty = memory();
    let set: Vec<pb::LbService> = (0..SERVICES)
        .map(|i| {
            let vip = format!("198.19.{}.{}:80", 128 + i / 250, 1 + i % 250);
            let backends = (0..3)
                .map(|b| backend(&format!("198.18.{b}.{}:8080", 1 + i % 250), pb::BackendState::Active))
                .collect();
            service(i + 1, &vip, backends)
        })
        .collect();
    replace(&node, set).await;
    let per_service = (memory() - empty) / u64::from(SERVICES);
    println!("{per_service} bytes per service of 3 backends in lb_services, lb_svc_backends and lb_maglev");
    assert!(
        (4084..5 * 1024).contains(&per_service),
        "{per_service} bytes per service"
    );
}
