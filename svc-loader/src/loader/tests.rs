//! [`EndpointDatapath`] over the real datapath in a test network namespace:
//! a policy diff that fails midway, concurrent applies and removes; and its
//! [`KeyedLocks`].

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use rivet_common::testing::netns::{NetNs, veth_pair};

use super::*;
use crate::datapath::DatapathOptions;
use crate::datapath::tests::PinDir;
use crate::policy_lpm::PolicyRule;
use crate::policy_lpm::tests::rule;
use crate::validate::PolicySpec;
use rivet_datapath::maps::{DIR_EGRESS, DIR_INGRESS, VERDICT_ALLOW, VERDICT_DENY};

const PREFIX: &str = "rvl";
const TCP: u8 = 6;
const UDP: u8 = 17;
/// Nothing a test waits for takes this long unless it is stuck.
const STUCK: Duration = Duration::from_secs(20);

static FIXTURES: AtomicU32 = AtomicU32::new(0);

/// A namespace with `interfaces` host-side veths `rvl<n>-<i>` (peers in
/// the same namespace) and a pin directory; both go on drop.
struct Fixture {
    ns: NetNs,
    pins: PinDir,
    ifindexes: Vec<u32>,
    policy_max: u32,
    ep_prefixes_max: u32,
}

impl Fixture {
    fn new(interfaces: usize, policy_max: u32) -> Self {
        let n = FIXTURES.fetch_add(1, Ordering::Relaxed);
        let ns = NetNs::new("rvtld").unwrap();
        let mut ifindexes = Vec::new();
        for i in 0..interfaces {
            let name = format!("{PREFIX}{n}-{i}");
            veth_pair(&ns, &name, &ns, &format!("rvp{n}-{i}")).unwrap();
            ifindexes.push(ns.ifindex(&name).unwrap());
        }
        let pins = PinDir::new("loader");
        Self {
            ns,
            pins,
            ifindexes,
            policy_max,
            ep_prefixes_max: rivet_datapath::spec::EP_PREFIXES.default_max_entries,
        }
    }

    fn options(&self) -> DatapathOptions {
        DatapathOptions {
            policy_max: self.policy_max,
            ep_prefixes_max: self.ep_prefixes_max,
            ..self.pins.opts()
        }
    }

    /// Runs `f` with a fresh loader on a thread inside the namespace
    /// (threads it spawns stay there too).
    fn run<T: Send + 'static>(&self, f: impl FnOnce(Arc<EndpointDatapath>, Vec<u32>) -> T + Send + 'static) -> T {
        let (opts, ifindexes) = (self.options(), self.ifindexes.clone());
        self.ns
            .in_ns(move || {
                let datapath = Datapath::open(opts).expect("the datapath loads");
                let dp = Arc::new(EndpointDatapath::new(datapath, PREFIX).expect("the loader adopts the maps"));
                f(dp, ifindexes)
            })
            .unwrap()
    }
}

fn allow(direction: u8, peer: u32, protocol: u8, port: u16) -> PolicyRule {
    rule(direction, peer, protocol, port, 0, VERDICT_ALLOW)
}

fn deny(direction: u8, peer: u32, protocol: u8, port: u16) -> PolicyRule {
    rule(direction, peer, protocol, port, 0, VERDICT_DENY)
}

fn policy(revision: u64, rules: Vec<PolicyRule>) -> PolicySpec {
    PolicySpec {
        revision,
        enforce_ingress: true,
        enforce_egress: true,
        allow_from_host: true,
        rules,
        prefixes: Vec::new(),
    }
}

/// Endpoint `id` on `ifindex` with addresses of slot `slot`.
fn spec(id: u32, ifindex: u32, slot: u8, policy: Option<PolicySpec>) -> EndpointSpec {
    EndpointSpec {
        endpoint_id: id,
        ifindex,
        ipv4: Some(Ipv4Addr::new(198, 18, 7, slot + 2)),
        ipv6: Some(Ipv6Addr::new(0x2001, 2, 0, 7, 0, 0, 0, u16::from(slot) + 2)),
        mac: [2, 0, 0, 0, 7, slot],
        identity: 1000 + id,
        policy,
    }
}

/// What the policy map holds, by endpoint (read from the kernel).
fn policy_map(dp: &EndpointDatapath) -> BTreeMap<u32, BTreeMap<PolicyEntry, u8>> {
    let datapath = dp.datapath();
    let map = datapath.maps().policy.lock();
    let mut out: BTreeMap<u32, BTreeMap<PolicyEntry, u8>> = BTreeMap::new();
    for key in map.keys() {
        let key = key.expect("the policy map reads");
        let entry = PolicyEntry::from_lpm_key(&key).expect("a well-formed policy key");
        let verdict = map.get(&key, 0).expect("a listed key reads").verdict;
        out.entry(entry.endpoint_id).or_default().insert(entry, verdict);
    }
    out
}

/// The endpoints map: ifindex entries and address entries.
fn endpoints_map(dp: &EndpointDatapath) -> (BTreeMap<u32, EndpointInfo>, BTreeMap<IpAddr, u32>) {
    let datapath = dp.datapath();
    let map = datapath.maps().endpoints.lock();
    let (mut by_ifindex, mut by_address) = (BTreeMap::new(), BTreeMap::new());
    for item in map.iter() {
        let (key, info) = item.expect("the endpoints map reads");
        if let Some(ifindex) = key.as_ifindex() {
            by_ifindex.insert(ifindex, info);
        } else if let Some(address) = key.as_ip() {
            by_address.insert(address, info.endpoint_id);
        }
    }
    (by_ifindex, by_address)
}

/// The loader's own account of an endpoint's policy (GetEndpointPolicy).
fn loader_view(dp: &EndpointDatapath, id: u32) -> BTreeMap<PolicyEntry, u8> {
    let view = dp.policy(id).expect("the endpoint is known");
    view.entries.iter().map(|v| (v.entry, v.verdict)).collect()
}

fn is_capacity_error(e: &LoaderError) -> bool {
    matches!(e, LoaderError::Map { source: aya::maps::MapError::SyscallError(s), .. }
        if matches!(s.io_error.raw_os_error(), Some(libc::E2BIG | libc::ENOSPC | libc::ENOMEM)))
}

#[test]
fn a_policy_diff_that_fails_midway_leaves_no_entry_the_loader_does_not_know() {
    // 8 policy entries fit: a diff that needs more fails midway, for real.
    let fx = Fixture::new(1, 8);
    fx.run(|dp, ifs| {
        const A: u32 = 2001;
        const B: u32 = 2002;
        const C: u32 = 2003;
        let id = 1;
        let two_allows = vec![allow(DIR_INGRESS, A, TCP, 80), allow(DIR_INGRESS, A, TCP, 81)];
        dp.apply(&spec(id, ifs[0], 0, Some(policy(1, two_allows.clone()))))
            .unwrap();

        // 1. Allows added until the map is full: 6 of 10 new entries land.
        let mut grown = two_allows.clone();
        grown.extend((0..10).map(|i| allow(DIR_INGRESS, B, TCP, 1000 + i)));
        let err = dp.apply(&spec(id, ifs[0], 0, Some(policy(2, grown)))).unwrap_err();
        assert!(is_capacity_error(&err), "the map is full: {err}");
        assert_eq!(
            loader_view(&dp, id),
            policy_map(&dp)[&id],
            "after the failure the loader's index is what the map holds"
        );

        // The next policy lacks every one of them: none survives.
        let narrow = policy(3, vec![allow(DIR_INGRESS, C, UDP, 53)]);
        let applied = dp.apply(&spec(id, ifs[0], 0, Some(narrow.clone()))).unwrap();
        let fresh = policy_lpm::compile(id, &narrow.rules).unwrap();
        assert_eq!(
            policy_map(&dp)[&id],
            fresh,
            "the map holds exactly what a fresh apply writes: no stale ALLOW of the failed diff"
        );
        assert_eq!(applied.policy_entries, fresh.len());
        assert_eq!(loader_view(&dp, id), fresh);

        // 2. A diff that removed entries and then failed: the loader must not
        // believe the removed ones are still there.
        let with_deny = policy(4, {
            let mut r = two_allows.clone();
            r.push(deny(DIR_INGRESS, C, 0, 0));
            r
        });
        dp.apply(&spec(id, ifs[0], 0, Some(with_deny.clone()))).unwrap();
        let mut replaced = vec![deny(DIR_INGRESS, C, 0, 0)];
        replaced.extend((0..8).map(|i| allow(DIR_EGRESS, B, TCP, 2000 + i)));
        let err = dp.apply(&spec(id, ifs[0], 0, Some(policy(5, replaced)))).unwrap_err();
        assert!(is_capacity_error(&err), "{err}");
        assert_eq!(loader_view(&dp, id), policy_map(&dp)[&id]);
        // Back to the previous policy: its two allows were removed by the
        // failed diff and must be written again.
        dp.apply(&spec(id, ifs[0], 0, Some(with_deny.clone()))).unwrap();
        assert_eq!(
            policy_map(&dp)[&id],
            policy_lpm::compile(id, &with_deny.rules).unwrap(),
            "the allows the failed diff removed are back, the ones it added are gone"
        );

        // 3. After a failure the next diff starts from the map's truth, also
        // when the map changed behind the loader's back in between.
        let err = dp
            .apply(&spec(
                id,
                ifs[0],
                0,
                Some(policy(
                    6,
                    (0..12).map(|i| allow(DIR_INGRESS, A, UDP, 3000 + i)).collect(),
                )),
            ))
            .unwrap_err();
        assert!(is_capacity_error(&err), "{err}");
        let stray = PolicyEntry {
            endpoint_id: id,
            direction: DIR_INGRESS,
            by_address: false,
            identity: A,
            protocol: UDP,
            port: 3000,
            port_bits: 16,
        };
        assert!(policy_map(&dp)[&id].contains_key(&stray), "the failed diff wrote it");
        dp.datapath().maps().policy.lock().remove(&stray.lpm_key()).unwrap();
        let extra = PolicyEntry { port: 4444, ..stray };
        dp.datapath()
            .maps()
            .policy
            .lock()
            .insert(
                &extra.lpm_key(),
                rivet_datapath::maps::PolicyValue::new(VERDICT_ALLOW),
                0,
            )
            .unwrap();
        dp.apply(&spec(id, ifs[0], 0, Some(narrow.clone()))).unwrap();
        assert_eq!(
            policy_map(&dp)[&id],
            fresh,
            "a dirty endpoint is re-read from the map before its next diff"
        );

        // Removal leaves nothing of it in the map.
        assert!(dp.remove(Some(id), None).unwrap());
        assert!(!policy_map(&dp).contains_key(&id), "{:?}", policy_map(&dp));
    });
}

/// What `ep_prefixes` holds for an endpoint (read from the kernel).
fn prefix_map(dp: &EndpointDatapath, id: u32) -> BTreeMap<EpPrefixKey, u32> {
    read_prefixes(dp.datapath(), Some(id))
        .expect("ep_prefixes reads")
        .remove(&id)
        .unwrap_or_default()
}

/// The loader's own account of an endpoint's prefixes (GetEndpointPolicy).
fn loader_prefixes(dp: &EndpointDatapath, id: u32) -> BTreeMap<EpPrefixKey, u32> {
    let view = dp.policy(id).expect("the endpoint is known");
    view.prefixes
        .iter()
        .map(|p| {
            (
                EpPrefixKey::new(id, p.direction, p.addr, p.len).unwrap(),
                p.cidr_identity,
            )
        })
        .collect()
}

/// A policy allowing egress by address to `n` /32 prefixes of 203.0.113.0/24.
fn address_policy(revision: u64, n: u8) -> PolicySpec {
    let cidr = |i: u8| rivet_common::identity::CIDR_IDENTITY_MIN + u32::from(i);
    PolicySpec {
        rules: (0..n)
            .map(|i| PolicyRule {
                by_address: true,
                ..allow(DIR_EGRESS, cidr(i), 0, 0)
            })
            .collect(),
        prefixes: (0..n)
            .map(|i| PolicyPrefix {
                direction: DIR_EGRESS,
                addr: IpAddr::V4(Ipv4Addr::new(203, 0, 113, i)),
                len: 32,
                cidr_identity: cidr(i),
            })
            .collect(),
        ..policy(revision, Vec::new())
    }
}

#[test]
fn a_prefix_diff_that_fails_midway_leaves_the_record_equal_to_the_map() {
    // 4 prefixes fit: a policy that needs more fails midway, for real.
    let mut fx = Fixture::new(1, 4096);
    fx.ep_prefixes_max = 4;
    fx.run(|dp, ifs| {
        let id = 1;
        let flags = |dp: &EndpointDatapath| endpoints_map(dp).0[&ifs[0]].flags;
        dp.apply(&spec(id, ifs[0], 0, Some(address_policy(1, 2)))).unwrap();
        assert_eq!(prefix_map(&dp, id).len(), 2);
        assert_eq!(loader_prefixes(&dp, id), prefix_map(&dp, id));
        assert_ne!(flags(&dp) & EP_F_EGRESS_PREFIXES, 0, "egress prefix lookups are on");
        assert_eq!(flags(&dp) & EP_F_INGRESS_PREFIXES, 0, "ingress has no prefixes");

        let err = dp.apply(&spec(id, ifs[0], 0, Some(address_policy(2, 6)))).unwrap_err();
        assert!(is_capacity_error(&err), "the map is full: {err}");
        assert_eq!(
            loader_prefixes(&dp, id),
            prefix_map(&dp, id),
            "after the failure the loader's record is what the map holds"
        );
        assert_eq!(prefix_map(&dp, id).len(), 4, "the map filled up");

        // The next policy has one prefix: exactly it remains, also after the
        // map changed behind the loader's back.
        let stray = EpPrefixKey::new(id, DIR_EGRESS, "203.0.113.3".parse().unwrap(), 32).unwrap();
        dp.datapath().maps().ep_prefixes.lock().remove(&stray.to_lpm()).unwrap();
        dp.apply(&spec(id, ifs[0], 0, Some(address_policy(3, 1)))).unwrap();
        let one = prefix_entries(id, &address_policy(3, 1).prefixes);
        assert_eq!(prefix_map(&dp, id), one, "no prefix of the failed diff survives");
        assert_eq!(loader_prefixes(&dp, id), one);

        // A policy without prefixes takes them and the flag away; so does removal.
        dp.apply(&spec(id, ifs[0], 0, Some(policy(4, vec![allow(DIR_EGRESS, 0, 0, 0)]))))
            .unwrap();
        assert!(prefix_map(&dp, id).is_empty());
        assert_eq!(flags(&dp) & EP_F_EGRESS_PREFIXES, 0, "no prefixes, no lookups");
        dp.apply(&spec(id, ifs[0], 0, Some(address_policy(5, 3)))).unwrap();
        assert!(dp.remove(Some(id), None).unwrap());
        assert!(prefix_map(&dp, id).is_empty(), "removal leaves no prefix");
        assert!(dp.list().unwrap().orphan_policies.is_empty());
    });
}

/// Blocks attaches of chosen interfaces until the test lets each one go.
#[derive(Default)]
struct TestGate {
    blocked: Mutex<BTreeSet<u32>>,
    entered: Mutex<Option<mpsc::Sender<u32>>>,
    release: Mutex<BTreeMap<u32, mpsc::Receiver<()>>>,
}

impl TestGate {
    /// Blocks the next attach of `ifindex`; returns the sender that lets it go.
    fn block(&self, ifindex: u32) -> mpsc::Sender<()> {
        let (tx, rx) = mpsc::channel();
        self.blocked.lock().unwrap().insert(ifindex);
        self.release.lock().unwrap().insert(ifindex, rx);
        tx
    }

    fn pass(&self, ifindex: u32) {
        if !self.blocked.lock().unwrap().remove(&ifindex) {
            return;
        }
        if let Some(tx) = self.entered.lock().unwrap().as_ref() {
            let _ = tx.send(ifindex);
        }
        let rx = self.release.lock().unwrap().remove(&ifindex).expect("set with blocked");
        rx.recv_timeout(STUCK).expect("the test lets the attach go");
    }
}

/// The datapath's policy revision (the config map's).
fn policy_revision(dp: &EndpointDatapath) -> u32 {
    dp.datapath().maps().config.lock().get(&0, 0).unwrap().policy_revision
}

#[test]
fn every_change_to_a_map_a_verdict_reads_bumps_the_policy_revision_and_nothing_else_does() {
    let fixture = Fixture::new(1, 1024);
    fixture.run(|dp, ifindexes| {
        let opened = policy_revision(&dp);
        assert_ne!(opened, 0, "a datapath opens at a revision of its own");
        let mut seen = opened;
        let mut bumped = |dp: &EndpointDatapath, what: &str, expect: bool| {
            let now = policy_revision(dp);
            assert_eq!(now != seen, expect, "{what}: revision {seen} -> {now}");
            if expect {
                assert_eq!(now, seen.wrapping_add(1).max(1), "{what}: one bump");
            }
            seen = now;
        };
        let web = |revision| policy(revision, vec![allow(DIR_INGRESS, 2000, TCP, 80)]);
        dp.apply(&spec(1, ifindexes[0], 0, Some(web(1)))).unwrap();
        bumped(&dp, "a new endpoint", true);
        dp.apply(&spec(1, ifindexes[0], 0, Some(web(2)))).unwrap();
        bumped(
            &dp,
            "the same policy again (only svc-endpoint's revision differs)",
            false,
        );
        dp.apply(&spec(1, ifindexes[0], 0, None)).unwrap();
        bumped(&dp, "no policy: the current one kept", false);
        dp.apply(&spec(
            1,
            ifindexes[0],
            0,
            Some(policy(3, vec![allow(DIR_INGRESS, 2000, TCP, 443)])),
        ))
        .unwrap();
        bumped(&dp, "another port", true);
        let mut unenforced = policy(4, vec![allow(DIR_INGRESS, 2000, TCP, 443)]);
        unenforced.enforce_egress = false;
        dp.apply(&spec(1, ifindexes[0], 0, Some(unenforced))).unwrap();
        bumped(&dp, "egress no longer enforced (flags only)", true);
        let mut relabelled = spec(1, ifindexes[0], 0, None);
        relabelled.identity = 5000;
        dp.apply(&relabelled).unwrap();
        bumped(&dp, "a new identity", true);

        let world = IpcacheValue::new(3000, None);
        let prefix: IpAddr = Ipv4Addr::new(198, 18, 9, 0).into();
        dp.upsert_ipcache(&[(prefix, 24, world)]).unwrap();
        bumped(&dp, "a new ipcache prefix", true);
        dp.upsert_ipcache(&[(prefix, 24, world)]).unwrap();
        bumped(&dp, "the same ipcache entry again", false);
        dp.upsert_ipcache(&[(prefix, 24, IpcacheValue::new(3001, None))])
            .unwrap();
        bumped(&dp, "another identity for the prefix", true);
        assert_eq!(dp.delete_ipcache(&[(prefix, 24)]).unwrap(), 1);
        bumped(&dp, "an ipcache prefix deleted", true);
        assert_eq!(dp.delete_ipcache(&[(prefix, 24)]).unwrap(), 0);
        bumped(&dp, "deleting it again", false);

        assert!(dp.remove(Some(1), None).unwrap());
        bumped(&dp, "the endpoint removed", true);
        assert!(!dp.remove(Some(1), None).unwrap());
        bumped(&dp, "removed again", false);
    });
    // A restarted loader bumps once: it cannot know whether its predecessor
    // died between a change and its bump.
    let before = fixture.run(|dp, _| policy_revision(&dp));
    let after = fixture.run(|dp, _| policy_revision(&dp));
    assert_eq!(after, before.wrapping_add(1).max(1));
}

fn gated(dp: &Arc<EndpointDatapath>) -> (Arc<TestGate>, mpsc::Receiver<u32>) {
    let gate = Arc::new(TestGate::default());
    let (tx, rx) = mpsc::channel();
    *gate.entered.lock().unwrap() = Some(tx);
    let g = gate.clone();
    dp.set_attach_gate(Arc::new(move |ifindex| g.pass(ifindex)));
    (gate, rx)
}

fn spawn_apply(dp: &Arc<EndpointDatapath>, spec: EndpointSpec) -> mpsc::Receiver<Result<Applied, LoaderError>> {
    let (tx, rx) = mpsc::channel();
    let dp = dp.clone();
    std::thread::spawn(move || {
        let _ = tx.send(dp.apply(&spec));
    });
    rx
}

#[test]
fn applies_on_different_interfaces_overlap_and_one_endpoint_stays_serialised() {
    let fx = Fixture::new(2, 64);
    fx.run(|dp, ifs| {
        let (gate, entered) = gated(&dp);
        let rules = |port| policy(1, vec![allow(DIR_INGRESS, 7, TCP, port)]);

        // Endpoint 1's apply stops inside its attach (the netlink step).
        let release = gate.block(ifs[0]);
        let first = spawn_apply(&dp, spec(1, ifs[0], 0, Some(rules(80))));
        assert_eq!(
            entered.recv_timeout(STUCK).unwrap(),
            ifs[0],
            "endpoint 1 reached its attach"
        );

        // Meanwhile endpoint 2 on another interface is applied completely.
        let other = spawn_apply(&dp, spec(2, ifs[1], 1, Some(rules(443))));
        let applied = other
            .recv_timeout(STUCK)
            .expect("an apply on another interface does not wait for endpoint 1's attach")
            .unwrap();
        assert_eq!(applied.info.endpoint_id, 2);
        assert!(matches!(dp.view(2).unwrap().ingress, AttachState::Attached { .. }));

        // A second apply of endpoint 1 waits for the first to finish.
        let second = spawn_apply(&dp, spec(1, ifs[0], 0, Some(rules(8080))));
        dp.wait_for_lock_waiters(1, STUCK);
        assert!(second.try_recv().is_err(), "still waiting for the first apply");
        release.send(()).unwrap();
        first.recv_timeout(STUCK).unwrap().unwrap();
        second.recv_timeout(STUCK).unwrap().unwrap();
        assert_eq!(
            policy_map(&dp)[&1],
            policy_lpm::compile(1, &rules(8080).rules).unwrap(),
            "the later apply's policy wins"
        );
    });
}

/// A compiled policy.
type Compiled = BTreeMap<PolicyEntry, u8>;

fn random_policy(rng: &mut StdRng) -> PolicySpec {
    let mut rules = Vec::new();
    for _ in 0..rng.random_range(0..6) {
        let protocol = [0, TCP, UDP][rng.random_range(0..3)];
        let port = if protocol == 0 { 0 } else { rng.random_range(1..=2000) };
        let end_port = if port != 0 && rng.random_range(0..3) == 0 {
            port + rng.random_range(0..300)
        } else {
            0
        };
        rules.push(rule(
            [DIR_INGRESS, DIR_EGRESS][rng.random_range(0..2)],
            rng.random_range(0..4),
            protocol,
            port,
            end_port,
            if rng.random_range(0..4) == 0 {
                VERDICT_DENY
            } else {
                VERDICT_ALLOW
            },
        ));
    }
    policy(rng.random_range(0..1000), rules)
}

#[test]
fn concurrent_applies_and_removes_on_many_interfaces_leave_maps_and_filters_consistent() {
    const INTERFACES: usize = 8;
    const THREADS: u64 = 4;
    const OPS: usize = 40;
    let seed: u64 = rand::random();
    eprintln!("stress seed {seed:#x}");
    let fx = Fixture::new(INTERFACES, 4096);
    fx.run(move |dp, ifs| {
        // Interface i has two candidate endpoints with the same addresses:
        // 100 + i and 200 + i; threads race for them.
        // Every policy each endpoint was given.
        let applied: Arc<Mutex<BTreeMap<u32, Vec<Compiled>>>> = Arc::default();
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (dp, ifs, applied) = (dp.clone(), ifs.clone(), applied.clone());
                std::thread::spawn(move || {
                    let mut rng = StdRng::seed_from_u64(seed.wrapping_add(t));
                    for _ in 0..OPS {
                        let i = rng.random_range(0..INTERFACES);
                        let id = if rng.random_range(0..3) == 0 { 200 } else { 100 } + i as u32;
                        match rng.random_range(0..6) {
                            0..=2 => {
                                let p = random_policy(&mut rng);
                                let compiled = policy_lpm::compile(id, &p.rules).unwrap();
                                match dp.apply(&spec(id, ifs[i], i as u8, Some(p))) {
                                    Ok(_) => lock(&applied).entry(id).or_default().push(compiled),
                                    Err(LoaderError::InterfaceHeld { .. } | LoaderError::AddressHeld { .. }) => {}
                                    Err(e) => panic!("seed {seed:#x}: apply {id}: {e}"),
                                }
                            }
                            3 => match dp.apply(&spec(id, ifs[i], i as u8, None)) {
                                Ok(_) => lock(&applied).entry(id).or_default().push(BTreeMap::new()),
                                Err(LoaderError::InterfaceHeld { .. } | LoaderError::AddressHeld { .. }) => {}
                                Err(e) => panic!("seed {seed:#x}: apply {id} without policy: {e}"),
                            },
                            4 => {
                                dp.remove(Some(id), None).unwrap();
                            }
                            _ => {
                                dp.remove(None, Some(ifs[i])).unwrap();
                            }
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().expect("a worker panicked");
        }

        let (by_ifindex, by_address) = endpoints_map(&dp);
        let policies = policy_map(&dp);
        let applied = lock(&applied);
        let mut owners = BTreeSet::new();
        for (i, &ifindex) in ifs.iter().enumerate() {
            let addrs = [
                IpAddr::V4(Ipv4Addr::new(198, 18, 7, i as u8 + 2)),
                IpAddr::V6(Ipv6Addr::new(0x2001, 2, 0, 7, 0, 0, 0, i as u16 + 2)),
            ];
            let attachment = dp.datapath().attachment(ifindex).unwrap();
            match by_ifindex.get(&ifindex) {
                Some(info) => {
                    let id = info.endpoint_id;
                    owners.insert(id);
                    assert!(id == 100 + i as u32 || id == 200 + i as u32, "seed {seed:#x}: {info:?}");
                    for a in addrs {
                        assert_eq!(by_address.get(&a), Some(&id), "seed {seed:#x}: address {a} of {id}");
                    }
                    assert!(
                        matches!(attachment.ingress, AttachState::Attached { .. })
                            && matches!(attachment.egress, AttachState::Attached { .. }),
                        "seed {seed:#x}: endpoint {id} is attached: {attachment:?}"
                    );
                    let in_map = policies.get(&id).cloned().unwrap_or_default();
                    assert_eq!(
                        loader_view(&dp, id),
                        in_map,
                        "seed {seed:#x}: the index of {id} is the map"
                    );
                    let candidates = &applied[&id];
                    // Without a policy an endpoint keeps its current one.
                    assert!(
                        in_map.is_empty() || candidates.contains(&in_map),
                        "seed {seed:#x}: endpoint {id} holds a policy it was given: {in_map:?}"
                    );
                }
                None => {
                    for a in addrs {
                        assert_eq!(by_address.get(&a), None, "seed {seed:#x}: address {a} without endpoint");
                    }
                    assert_eq!(
                        (attachment.ingress, attachment.egress),
                        (AttachState::Detached, AttachState::Detached),
                        "seed {seed:#x}: interface {ifindex} without endpoint"
                    );
                }
            }
        }
        assert_eq!(by_address.len(), 2 * owners.len(), "seed {seed:#x}: {by_address:?}");
        let with_policy: BTreeSet<u32> = policies.keys().copied().collect();
        assert!(
            with_policy.is_subset(&owners),
            "seed {seed:#x}: policy of removed endpoints: {with_policy:?}"
        );
        let listing = dp.list().unwrap();
        assert!(listing.orphan_attachments.is_empty(), "{listing:?}");
        assert!(listing.orphan_policies.is_empty(), "{listing:?}");
        assert_eq!(listing.endpoints.len(), owners.len());

        // Everything goes with the interfaces' removal: nothing leaks.
        for &ifindex in &ifs {
            dp.remove(None, Some(ifindex)).unwrap();
        }
        let (by_ifindex, by_address) = endpoints_map(&dp);
        assert!(
            by_ifindex.is_empty() && by_address.is_empty(),
            "{by_ifindex:?} {by_address:?}"
        );
        assert!(policy_map(&dp).is_empty(), "{:?}", policy_map(&dp));
        assert!(dp.datapath().attachments().unwrap().is_empty());
        let index = dp.index();
        assert!(
            index.endpoints.is_empty() && index.interfaces.is_empty() && index.addresses.is_empty(),
            "{index:?}"
        );
    });
}

/// An endpoint whose host veth is deleted behind the loader's back (a pod's
/// netns removed without a DEL) is listed as gone, by the full listing (both
/// hooks `InterfaceGone`, no name, no orphan attachment) and by the cheap
/// one; its neighbour is listed as it is.
#[test]
fn an_endpoint_whose_interface_is_deleted_is_listed_as_gone() {
    let fx = Fixture::new(2, 64);
    let ns = fx.ns.name().to_owned();
    fx.run(move |dp, ifs| {
        dp.apply(&spec(
            1,
            ifs[0],
            0,
            Some(policy(1, vec![allow(DIR_INGRESS, 7, TCP, 80)])),
        ))
        .unwrap();
        dp.apply(&spec(2, ifs[1], 1, None)).unwrap();
        let name = |ifindex| netdev::ifindex_to_name(ifindex).unwrap().expect("the veth exists");
        let (gone, kept) = (name(ifs[0]), name(ifs[1]));
        let deleted = std::process::Command::new("ip")
            .args(["-n", &ns, "link", "del", &gone])
            .status()
            .unwrap();
        assert!(deleted.success(), "deleting {gone}");

        let listing = dp.list().unwrap();
        let states: Vec<_> = listing
            .endpoints
            .iter()
            .map(|v| {
                (
                    v.info.endpoint_id,
                    v.info.ifindex,
                    v.ifname.clone(),
                    v.ingress,
                    v.egress,
                )
            })
            .collect();
        assert_eq!(
            states[0],
            (1, ifs[0], None, AttachState::InterfaceGone, AttachState::InterfaceGone),
            "the endpoint of the deleted veth is listed as gone: {listing:?}"
        );
        assert!(
            matches!(&states[1], (2, i, Some(n), AttachState::Attached { .. }, AttachState::Attached { .. })
                if *i == ifs[1] && *n == kept),
            "the other endpoint is listed attached: {listing:?}"
        );
        assert_eq!(states.len(), 2, "{listing:?}");
        assert!(listing.orphan_attachments.is_empty(), "{listing:?}");
        assert!(listing.orphan_policies.is_empty(), "{listing:?}");

        assert_eq!(
            dp.endpoint_interfaces().unwrap(),
            [
                EndpointInterface {
                    endpoint_id: 1,
                    ifindex: ifs[0],
                    ifname: None,
                },
                EndpointInterface {
                    endpoint_id: 2,
                    ifindex: ifs[1],
                    ifname: Some(kept.clone()),
                },
            ],
            "the cheap listing says the same"
        );

        // Removing the gone endpoint leaves the other one only.
        dp.remove(Some(1), None).unwrap();
        assert_eq!(
            dp.endpoint_interfaces().unwrap(),
            [EndpointInterface {
                endpoint_id: 2,
                ifindex: ifs[1],
                ifname: Some(kept),
            }]
        );
        assert_eq!(dp.list().unwrap().endpoints.len(), 1);
    });
}

#[test]
fn callers_waiting_for_a_held_key_sleep_until_it_is_released() {
    let locks = Arc::new(KeyedLocks::default());
    let held = locks.lock(1);
    let other = locks.lock(2);
    let waiters: Vec<_> = [1, 1, 2]
        .into_iter()
        .map(|key| {
            let locks = locks.clone();
            std::thread::spawn(move || drop(locks.lock(key)))
        })
        .collect();
    locks.wait_for_waiters(3, STUCK);
    let before = lock(&locks.state).wakeups;
    // No key was released: a waiter that wakes now is woken by another
    // waiter (and then wakes it in turn, spinning while the key is held).
    let after = locks.wakeups_after(before, Duration::from_millis(300));
    assert_eq!(after - before, 0, "waiters woke up while their keys stayed held");
    drop(other);
    drop(held);
    for waiter in waiters {
        waiter.join().expect("a waiter gets its key once released");
    }
    assert!(lock(&locks.state).held.is_empty(), "every key was released");
}
