//! The datapath against the real kernel: pins, attachments, adoption.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, Ordering};

use aya::maps::IterableMap as _;
use rivet_common::testing::netns::{NetNs, veth_pair};

use std::io;

use aya::programs::SchedClassifier;
use rivet_datapath::maps::{
    Ct4Key, CtEntry, CtTimeouts, EndpointInfo, EndpointKey, IpcacheKey, IpcacheValue, PolicyKey, PolicyValue,
    VERDICT_ALLOW,
};

use rivet_datapath::maps::legacy::CT_ENTRY_V1_SIZE;
use rivet_datapath::pin::{DEFAULT_BPFFS, open_pinned_map};
use rivet_datapath::spec::{
    self, MAP_CT4, MAP_CT6, MAP_LB_BACKENDS, MAP_LB_FRONTENDS, MAP_LB_MAGLEV, MAP_LB_REV_NAT, MAP_LB_SERVICES,
    MAP_NAMES,
};

use super::options::page_size;
use super::pins::BPF_FS_MAGIC;
use super::*;
use crate::{netdev, tc};

static PIN_DIRS: AtomicU32 = AtomicU32::new(0);

/// A unique pin directory under /sys/fs/bpf/rivet-test, removed (with
/// every pin in it, which also frees pinned links) on drop.
pub(crate) struct PinDir(PathBuf);

impl PinDir {
    pub(crate) fn new(tag: &str) -> Self {
        let bpffs = Path::new(DEFAULT_BPFFS);
        let fs = sys::fs_type(bpffs).unwrap_or(0);
        assert_eq!(
            fs, BPF_FS_MAGIC,
            "no BPF filesystem at {DEFAULT_BPFFS}: these tests need bpffs (`mount -t bpf bpf /sys/fs/bpf`) \
             and root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN)"
        );
        let n = PIN_DIRS.fetch_add(1, Ordering::Relaxed);
        let dir = bpffs
            .join("rivet-test")
            .join(format!("{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir); // a leftover of a crashed run with the same pid
        Self(dir)
    }

    pub(crate) fn opts(&self) -> DatapathOptions {
        test_opts(&self.0)
    }
}

/// Small maps and short lifetimes: tests open many datapaths.
pub(crate) fn test_opts(pin_dir: &Path) -> DatapathOptions {
    DatapathOptions {
        endpoints_max: 1024,
        ipcache_max: 1024,
        policy_max: 4096,
        ct4_max: 4096,
        ct6_max: 2048,
        lb_flows_max: 2048,
        events_bytes: 64 * 1024,
        ct_timeouts: CtTimeouts {
            tcp_syn: 5,
            tcp_established: 30,
            tcp_closing: 2,
            udp: 7,
            icmp: 3,
            other: 4,
        },
        ..DatapathOptions::new(pin_dir)
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Err(err) = std::fs::remove_dir_all(&self.0)
            && err.kind() != io::ErrorKind::NotFound
        {
            eprintln!("could not remove test pin directory {}: {err}", self.0.display());
        }
    }
}

/// Program ids of the bpf filters on a hook of `ifname`, as the kernel
/// lists them (call inside the namespace).
fn filter_ids(ifname: &str, hook: Hook) -> Vec<u32> {
    let ifindex = netdev::name_to_ifindex(ifname).unwrap().unwrap();
    tc::bpf_filters(ifindex, hook.direction())
        .unwrap()
        .iter()
        .map(|f| f.prog_id)
        .collect()
}

fn both(ids: ProgramIds) -> (Vec<u32>, Vec<u32>) {
    (vec![ids.from_container], vec![ids.to_container])
}

fn attached(ifname: &str) -> (Vec<u32>, Vec<u32>) {
    (filter_ids(ifname, Hook::Ingress), filter_ids(ifname, Hook::Egress))
}

#[test]
fn datapath_is_send() {
    fn is_send<T: Send>() {}
    is_send::<Datapath>();
    is_send::<DatapathError>();
}

#[test]
fn options_defaults_and_validation() {
    let opts = DatapathOptions::for_node(DEFAULT_BPFFS, "node-1").unwrap();
    assert_eq!(opts.pin_dir, Path::new("/sys/fs/bpf/rivet/node-1"));
    assert_eq!(opts.legacy_links_dir(), Path::new("/sys/fs/bpf/rivet/node-1/links"));
    assert_eq!((opts.ct4_max, opts.ct6_max), (786_432, 786_432));
    assert_eq!(
        (opts.endpoints_max, opts.ipcache_max, opts.policy_max),
        (65_536, 524_288, 1_048_576)
    );
    assert_eq!(opts.effective_events_bytes(), 1 << 20);
    for bad in ["", ".", "..", "a/b"] {
        let err = DatapathOptions::for_node(DEFAULT_BPFFS, bad).unwrap_err();
        assert!(matches!(err, DatapathError::PinDir(_)), "{bad:?}: {err}");
    }
    let odd = DatapathOptions {
        events_bytes: 5000,
        ..opts.clone()
    };
    assert_eq!(odd.effective_events_bytes(), 2 * page_size());

    let err = Datapath::open(DatapathOptions {
        ct4_max: 0,
        ..opts.clone()
    })
    .unwrap_err();
    assert!(
        matches!(
            err,
            DatapathError::InvalidOptions(OptionsError::ZeroSize { map: "ct4" })
        ),
        "{err}"
    );
    assert!(err.to_string().contains("ct4"), "{err}");
    let err = Datapath::open(DatapathOptions::new("relative/dir")).unwrap_err();
    assert!(
        matches!(err, DatapathError::InvalidOptions(OptionsError::RelativePinDir { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("absolute"), "{err}");
    let err = Datapath::open(DatapathOptions {
        events_bytes: 2 << 30,
        ..opts.clone()
    })
    .unwrap_err();
    assert!(
        matches!(err, DatapathError::InvalidOptions(OptionsError::EventsTooBig { .. })),
        "{err}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let err = Datapath::open(DatapathOptions::new(tmp.path().join("pins"))).unwrap_err();
    assert!(matches!(err, DatapathError::NotBpffs { .. }), "{err}");
    assert!(err.to_string().contains("mount -t bpf"), "{err}");
}

/// `lb_services_max` sizes the per-service maps (the services a node can
/// hold); the backends' map keeps its own size.
#[test]
fn the_per_service_maps_take_lb_services_max() {
    let dir = PinDir::new("lbsize");
    drop(
        Datapath::open(DatapathOptions {
            lb_services_max: 100,
            ..dir.opts()
        })
        .unwrap(),
    );
    let max_entries = |map: &str| {
        sys::map_info(sys::obj_get(&dir.0.join(map)).unwrap().as_fd())
            .unwrap()
            .max_entries
    };
    for map in [MAP_LB_SERVICES, MAP_LB_REV_NAT, MAP_LB_MAGLEV, MAP_LB_FRONTENDS] {
        assert_eq!(max_entries(map), 100, "{map}");
    }
    assert_eq!(max_entries(MAP_LB_BACKENDS), spec::LB_BACKENDS.default_max_entries);
    assert_eq!(
        max_entries(spec::MAP_LB_SVC_BACKENDS),
        100 * spec::LB_SVC_BACKENDS_PER_SERVICE
    );
}

#[test]
fn open_twice_reuses_the_pinned_maps() {
    let dir = PinDir::new("reuse");
    let first = Datapath::open(dir.opts()).unwrap();
    for name in MAP_NAMES {
        assert!(dir.0.join(name).exists(), "map {name} is pinned");
    }
    let key = EndpointKey::ifindex(42);
    let mut info = EndpointInfo {
        endpoint_id: 7,
        identity: 300,
        ifindex: 42,
        mac: [2, 0, 0, 0, 0, 1],
        policy_revision: 3,
        ..EndpointInfo::default()
    };
    info.set_ipv4(Some("198.18.0.2".parse().unwrap()));
    first.maps().endpoints.lock().insert(key, info, 0).unwrap();
    let prefix = IpcacheKey::new("198.18.0.0".parse().unwrap(), 24).unwrap();
    first
        .maps()
        .ipcache
        .lock()
        .insert(&prefix.to_lpm(), IpcacheValue::new(300, None), 0)
        .unwrap();
    let rule = PolicyKey::new(7, 300, rivet_datapath::maps::DIR_INGRESS, 6, 80, 16);
    first
        .maps()
        .policy
        .lock()
        .insert(&rule.to_lpm(), PolicyValue::new(VERDICT_ALLOW), 0)
        .unwrap();

    let second = Datapath::open(dir.opts()).unwrap();
    assert_eq!(second.maps().endpoints.lock().get(&key, 0).unwrap(), info);
    // A longest-prefix lookup of an address inside the prefix.
    let ip: IpAddr = "198.18.0.77".parse().unwrap();
    let found = second
        .maps()
        .ipcache
        .lock()
        .get(&IpcacheKey::lookup(ip).to_lpm(), 0)
        .unwrap();
    assert_eq!(found.identity, 300);
    let hit = PolicyKey::lookup(7, 300, rivet_datapath::maps::DIR_INGRESS, 6, 80);
    assert_eq!(
        second.maps().policy.lock().get(&hit.to_lpm(), 0).unwrap().verdict,
        VERDICT_ALLOW
    );
    // The very same kernel maps, different program instances.
    let id = |dp: &Datapath| dp.maps().endpoints.lock().map().info().unwrap().id();
    assert_eq!(id(&first), id(&second));
    assert_ne!(first.program_ids(), second.program_ids());
    // The config map got the options' lifetimes.
    let config = second.maps().config.lock().get(&0, 0).unwrap();
    assert_eq!(config.ct, dir.opts().ct_timeouts);
    assert!(second.metrics_totals().unwrap().is_empty());

    drop(first);
    drop(second);
    // Pins outlive the loader; another process can open one.
    let ct4 = open_pinned_map(&dir.0, &spec::CT4).unwrap();
    aya::maps::HashMap::<_, Ct4Key, CtEntry>::try_from(ct4).unwrap();
    let endpoints = open_pinned_map(&dir.0, &spec::ENDPOINTS).unwrap();
    let endpoints = aya::maps::HashMap::<_, EndpointKey, EndpointInfo>::try_from(endpoints).unwrap();
    assert_eq!(endpoints.get(&key, 0).unwrap(), info);
    // Every map the loader pinned is what the ABI crate defines.
    for def in &spec::ALL {
        open_pinned_map(&dir.0, def).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn mismatching_pins_are_refused_and_left_alone() {
    let dir = PinDir::new("mismatch");
    std::fs::create_dir_all(&dir.0).unwrap();
    let ct4 = dir.0.join(MAP_CT4);
    let wrong = aya::maps::HashMap::<MapData, u32, u32>::create(16, 0).unwrap();
    wrong.pin(&ct4).unwrap();

    let err = Datapath::open(dir.opts()).unwrap_err();
    let text = err.to_string();
    match &err {
        DatapathError::PinMismatch {
            map,
            pin,
            found,
            expected,
            ..
        } => {
            assert_eq!(map, MAP_CT4);
            assert_eq!(pin, &ct4);
            assert_eq!((found.key_size, found.value_size, found.max_entries), (4, 4, 16));
            assert_eq!((expected.key_size, expected.value_size), (16, 64));
        }
        other => panic!("expected PinMismatch, got {other}"),
    }
    assert!(
        text.contains("map `ct4`") && text.contains(&ct4.display().to_string()),
        "{text}"
    );
    assert!(
        text.contains("remove") && text.contains("stop every node daemon"),
        "{text}"
    );
    // Never deleted or replaced.
    assert_eq!(sys::map_info(sys::obj_get(&ct4).unwrap().as_fd()).unwrap().key_size, 4);

    // Without it, the map is created; then a different size is refused.
    std::fs::remove_file(&ct4).unwrap();
    drop(Datapath::open(dir.opts()).unwrap());
    let bigger = DatapathOptions {
        ct4_max: 8192,
        ..dir.opts()
    };
    let err = Datapath::open(bigger).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(&err, DatapathError::PinMismatch { map, .. } if map == MAP_CT4),
        "{text}"
    );
    assert!(
        text.contains("max_entries 4096") && text.contains("max_entries 8192"),
        "{text}"
    );
    assert!(text.contains("current size (4096)"), "{text}");

    // Something that is not a map where a map belongs.
    let ct6 = dir.0.join(MAP_CT6);
    std::fs::remove_file(&ct6).unwrap();
    std::fs::create_dir(&ct6).unwrap();
    let err = Datapath::open(dir.opts()).unwrap_err();
    assert!(
        matches!(&err, DatapathError::PinNotAMap { map, .. } if map == MAP_CT6),
        "{err}"
    );
    assert!(err.to_string().contains("a directory"), "{err}");
}

#[test]
fn attachments_survive_the_loader_and_are_adopted() {
    let ns = NetNs::new("rvtdp").unwrap();
    veth_pair(&ns, "rvdp0", &ns, "rvdp0p").unwrap();
    let ifindex = ns.ifindex("rvdp0").unwrap();
    let dir = PinDir::new("attach");
    let opts = dir.opts();
    ns.in_ns(move || {
        let dp = Datapath::open(opts.clone()).unwrap();
        assert_eq!(dp.adoption(), &AdoptReport::default());
        let out = dp.attach(ifindex).unwrap();
        assert_eq!((out.ingress, out.egress), (LinkChange::Created, LinkChange::Created));
        assert_eq!(out.ifname, "rvdp0");
        // Idempotent.
        let again = dp.attach(ifindex).unwrap();
        assert!(!again.changed(), "{again:?}");
        let first = dp.program_ids();
        assert_eq!(attached("rvdp0"), both(first));
        let list = dp.attachments().unwrap();
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].ifname.as_deref(), Some("rvdp0"));
        assert!(matches!(list[0].ingress, AttachState::Attached { prog_id, .. } if prog_id == first.from_container));
        assert!(matches!(list[0].egress, AttachState::Attached { prog_id, .. } if prog_id == first.to_container));

        // The loader goes away: the programs stay attached.
        drop(dp);
        assert_eq!(attached("rvdp0"), both(first), "attachments survive the loader");

        // A new loader adopts them: same filters, its own programs.
        let dp = Datapath::open(opts.clone()).unwrap();
        let report = dp.adoption().clone();
        assert_eq!((report.updated, report.unchanged, report.migrated.len()), (2, 0, 0));
        let second = dp.program_ids();
        assert_ne!(second, first);
        assert_eq!(attached("rvdp0"), both(second), "one program per hook, the new one");
        assert!(!dp.attach(ifindex).unwrap().changed());

        // Another instance adopts them in turn: for this one they are stale.
        let third = Datapath::open(opts.clone()).unwrap();
        let state = dp.attachment(ifindex).unwrap();
        assert!(
            matches!(state.ingress, AttachState::Stale { prog_id, .. } if prog_id == third.program_ids().from_container),
            "{state:?}"
        );
        let out = dp.attach(ifindex).unwrap();
        assert_eq!(
            out.ingress,
            LinkChange::Updated {
                previous_prog_id: third.program_ids().from_container
            }
        );
        assert_eq!(attached("rvdp0"), both(second));
        drop(third);

        // Detach removes both; twice is fine.
        let out = dp.detach(ifindex).unwrap();
        assert!(out.ingress && out.egress, "{out:?}");
        assert_eq!(attached("rvdp0"), (vec![], vec![]));
        assert!(dp.attachments().unwrap().is_empty());
        assert!(!dp.detach(ifindex).unwrap().changed());
    })
    .unwrap();
}

#[test]
fn attaching_to_a_missing_interface_is_a_clear_error() {
    let ns = NetNs::new("rvtdm").unwrap();
    veth_pair(&ns, "rvdm0", &ns, "rvdm0p").unwrap();
    let ifindex = ns.ifindex("rvdm0").unwrap();
    ns.ip(&["link", "del", "rvdm0"]).unwrap();
    let dir = PinDir::new("missing");
    let opts = dir.opts();
    ns.in_ns(move || {
        let dp = Datapath::open(opts).unwrap();
        let err = dp.attach(ifindex).unwrap_err();
        assert!(
            matches!(err, DatapathError::InterfaceNotFound { ifindex: i } if i == ifindex),
            "{err}"
        );
        assert!(err.to_string().contains(&format!("ifindex {ifindex}")), "{err}");
        assert!(!dp.detach(ifindex).unwrap().changed());
    })
    .unwrap();
    // The loader's namespace matters: the interface of another namespace is not found.
    let ns2 = NetNs::new("rvtdm").unwrap();
    veth_pair(&ns2, "rvdm1", &ns2, "rvdm1p").unwrap();
    let elsewhere = ns2.ifindex("rvdm1").unwrap();
    let opts = dir.opts();
    ns.in_ns(move || {
        let dp = Datapath::open(opts).unwrap();
        if netdev::ifindex_to_name(elsewhere).unwrap().is_none() {
            assert!(matches!(
                dp.attach(elsewhere),
                Err(DatapathError::InterfaceNotFound { .. })
            ));
        }
    })
    .unwrap();
}

#[test]
fn deleted_interfaces_take_their_filters_and_foreign_filters_are_left_alone() {
    let ns = NetNs::new("rvtdd").unwrap();
    veth_pair(&ns, "rvdd0", &ns, "rvdd0p").unwrap();
    veth_pair(&ns, "rvdd1", &ns, "rvdd1p").unwrap();
    let gone = ns.ifindex("rvdd0").unwrap();
    let other = ns.ifindex("rvdd1").unwrap();
    let dir = PinDir::new("defunct");
    let opts = dir.opts();
    let dp = ns
        .in_ns(move || {
            let dp = Datapath::open(opts).unwrap();
            assert!(dp.attach(gone).unwrap().changed());
            dp
        })
        .unwrap();
    ns.ip(&["link", "del", "rvdd0"]).unwrap();
    // Someone else's filter at our priority and handle, under another name.
    ns.ip(&["link", "set", "rvdd1", "up"]).unwrap();
    let dp = ns
        .in_ns(move || {
            let state = dp.attachment(gone).unwrap();
            assert_eq!(
                (state.ingress, state.egress, state.ifname.as_deref()),
                (AttachState::InterfaceGone, AttachState::InterfaceGone, None),
                "the interface and its filters are gone"
            );
            assert!(dp.attachments().unwrap().is_empty(), "nothing of ours is left");
            let mut dp = dp;
            assert!(
                !dp.detach(gone).unwrap().changed(),
                "detaching a gone interface is a no-op"
            );

            tc::ensure_clsact(other).unwrap();
            let prog = classifier(&mut dp.ebpf, Hook::Egress).unwrap();
            let fd = prog.fd().unwrap().as_fd().try_clone_to_owned().unwrap();
            tc::attach_bpf(other, tc::Direction::Ingress, fd.as_fd(), "someone_else", false).unwrap();
            let err = dp.attach(other).unwrap_err();
            assert!(
                err.to_string().contains("another filter holds priority 1 handle 1"),
                "a foreign filter is not overwritten: {err}"
            );
            assert_eq!(
                attached("rvdd1"),
                (vec![dp.program_ids().to_container], vec![]),
                "the failed attach left the foreign filter and nothing else"
            );
            assert!(dp.attachments().unwrap().is_empty(), "a foreign filter is not ours");
            assert!(
                !dp.detach(other).unwrap().changed(),
                "a foreign filter is never deleted"
            );
            assert_eq!(attached("rvdd1").0.len(), 1);
            dp
        })
        .unwrap();
    let report = dp.adopt_existing().unwrap();
    assert_eq!((report.updated, report.unchanged), (0, 0), "{report:?}");
}

#[test]
fn a_loader_of_another_node_in_the_same_namespace_leaves_our_filters_alone() {
    let ns = NetNs::new("rvtdo").unwrap();
    veth_pair(&ns, "rvdo0", &ns, "rvdo0p").unwrap();
    let ifindex = ns.ifindex("rvdo0").unwrap();
    let (mine, theirs) = (PinDir::new("mine"), PinDir::new("theirs"));
    let (mine, theirs) = (mine.opts(), theirs.opts());
    ns.in_ns(move || {
        let dp = Datapath::open(mine).unwrap();
        dp.attach(ifindex).unwrap();
        let other = Datapath::open(theirs).unwrap();
        assert_eq!(
            (other.adoption().updated, other.adoption().unchanged),
            (0, 0),
            "another node's loader adopts nothing of ours"
        );
        assert!(other.attachments().unwrap().is_empty(), "our filters are not theirs");
        assert!(!other.detach(ifindex).unwrap().changed(), "and it cannot detach them");
        assert_eq!(attached("rvdo0"), both(dp.program_ids()));
    })
    .unwrap();
}

#[test]
fn tcx_link_pins_of_an_earlier_loader_become_filters() {
    use aya::programs::links::FdLink;
    use aya::programs::tc::TcAttachOptions;
    use aya::programs::{LinkOrder, TcAttachType};

    let ns = NetNs::new("rvtdl").unwrap();
    veth_pair(&ns, "rvdl0", &ns, "rvdl0p").unwrap();
    let ifindex = ns.ifindex("rvdl0").unwrap();
    let dir = PinDir::new("legacy");
    let opts = dir.opts();
    ns.in_ns(move || {
        // What the loader before tc did: TCX links pinned under links/.
        let mut old = Datapath::open(opts.clone()).unwrap();
        let links = opts.legacy_links_dir();
        std::fs::create_dir_all(&links).unwrap();
        for (hook, ty) in [
            (Hook::Ingress, TcAttachType::Ingress),
            (Hook::Egress, TcAttachType::Egress),
        ] {
            let prog = classifier(&mut old.ebpf, hook).unwrap();
            let id = prog
                .attach_with_options("rvdl0", ty, TcAttachOptions::TcxOrder(LinkOrder::default()))
                .unwrap();
            let link = FdLink::try_from(prog.take_link(id).unwrap()).unwrap();
            drop(link.pin(links.join(format!("{ifindex}-{}", hook.as_str()))).unwrap());
        }
        std::fs::create_dir(links.join("junk")).unwrap();
        drop(old);

        let dp = Datapath::open(opts.clone()).unwrap();
        let report = dp.adoption().clone();
        assert_eq!(
            report.migrated,
            vec![(ifindex, Hook::Ingress), (ifindex, Hook::Egress)],
            "{report:?}"
        );
        assert_eq!(report.ignored.len(), 1, "a stranger is reported: {report:?}");
        assert_eq!(
            attached("rvdl0"),
            both(dp.program_ids()),
            "the filters run the new programs"
        );
        // The kernel releases an unpinned link from a work queue: a moment later.
        let tcx = || {
            let count = |ty| SchedClassifier::query_tcx("rvdl0", ty).unwrap().1.len();
            (count(TcAttachType::Ingress), count(TcAttachType::Egress))
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while tcx() != (0, 0) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(tcx(), (0, 0), "the TCX links are gone with their pins");
        assert!(!links.join(format!("{ifindex}-ingress")).exists());
        assert!(links.join("junk").exists(), "a stranger is left alone");
    })
    .unwrap();
}

/// Set for the child process of [`attachments_survive_kill_9`]:
/// `<netns path>|<pin dir>|<ifindex>`.
const CHILD_ENV: &str = "RIVET_DATAPATH_TEST_CHILD";

/// The child role of [`attachments_survive_kill_9`] (the same test,
/// re-executed with [`CHILD_ENV`] set): attaches, prints the program ids
/// and SIGKILLs itself, so no destructor of aya or ours runs.
fn attach_then_die_by_sigkill(spec: &str) -> ! {
    use std::io::Write as _;
    use std::os::fd::AsRawFd as _;

    let parts: Vec<&str> = spec.split('|').collect();
    let (ns_path, pin_dir, ifindex) = (parts[0], Path::new(parts[1]), parts[2].parse::<u32>().unwrap());
    let ns = std::fs::File::open(ns_path).unwrap();
    // SAFETY: setns on this thread, with a valid namespace fd.
    assert_eq!(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
    let dp = Datapath::open(test_opts(pin_dir)).unwrap();
    assert!(dp.attach(ifindex).unwrap().changed());
    let ids = dp.program_ids();
    println!("PROGRAM_IDS {} {}", ids.from_container, ids.to_container);
    std::io::stdout().flush().unwrap();
    // SAFETY: kill(2) on ourselves.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!("SIGKILL");
}

#[test]
fn attachments_survive_kill_9() {
    use std::os::unix::process::ExitStatusExt as _;

    if let Ok(spec) = std::env::var(CHILD_ENV) {
        attach_then_die_by_sigkill(&spec);
    }
    let ns = NetNs::new("rvtdk").unwrap();
    veth_pair(&ns, "rvdk0", &ns, "rvdk0p").unwrap();
    let ifindex = ns.ifindex("rvdk0").unwrap();
    let dir = PinDir::new("kill9");
    let spec = format!("{}|{}|{ifindex}", ns.path().display(), dir.0.display());
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "datapath::tests::attachments_survive_kill_9"])
        .args(["--nocapture", "--test-threads", "1"])
        .env(CHILD_ENV, spec)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGKILL),
        "the child should have killed itself\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids: Vec<u32> = stdout
        .lines()
        .find_map(|line| line.split("PROGRAM_IDS ").nth(1)) // after the harness's "test … "
        .unwrap_or_else(|| panic!("no program ids in {stdout}"))
        .split_whitespace()
        .map(|id| id.parse().unwrap())
        .collect();
    let opts = dir.opts();
    ns.in_ns(move || {
        assert_eq!(
            attached("rvdk0"),
            (vec![ids[0]], vec![ids[1]]),
            "still attached after kill -9"
        );
        let dp = Datapath::open(opts).unwrap();
        assert_eq!(dp.adoption().updated, 2, "the new loader adopts both filters");
        assert_eq!(attached("rvdk0"), both(dp.program_ids()));
    })
    .unwrap();
}

/// Only a conntrack pin of exactly the first layout's spec is migrated: a
/// 56-byte one of another size is refused as any mismatch, and left alone.
#[test]
fn a_first_layout_conntrack_pin_of_another_shape_is_refused_not_migrated() {
    let dir = PinDir::new("ctv1-shape");
    std::fs::create_dir_all(&dir.0).unwrap();
    let ct4 = dir.0.join(MAP_CT4);
    let old = sys::map_create(spec::CT4.map_type, spec::CT4.key_size, CT_ENTRY_V1_SIZE, 1234, 0).unwrap();
    sys::obj_pin(old.as_fd(), &ct4).unwrap();

    let err = Datapath::open(dir.opts()).unwrap_err();
    assert!(
        matches!(&err, DatapathError::PinMismatch { map, found, .. }
            if map == MAP_CT4 && found.value_size == CT_ENTRY_V1_SIZE && found.max_entries == 1234),
        "{err}"
    );
    assert!(!dir.0.join(format!("{MAP_CT4}{MIGRATING_PIN_SUFFIX}")).exists());
    let pinned = sys::map_info(sys::obj_get(&ct4).unwrap().as_fd()).unwrap();
    assert_eq!(
        pinned.id,
        sys::map_info(old.as_fd()).unwrap().id,
        "the pin is left alone"
    );
}

/// A pin directory of a loader from before the `routing` map (multi-node)
/// is adopted as it is, and the new map created beside the others: a
/// running single-node node upgrades in place.
#[test]
fn a_pin_dir_without_the_routing_map_is_adopted_and_the_map_created() {
    use rivet_datapath::maps::{ROUTING_VXLAN, RoutingConfig};
    use rivet_datapath::spec::MAP_ROUTING;

    let dir = PinDir::new("routing");
    drop(Datapath::open(dir.opts()).unwrap());
    std::fs::remove_file(dir.0.join(MAP_ROUTING)).unwrap();

    let dp = Datapath::open(dir.opts()).expect("an older pin directory is adopted");
    let status = dp.map_status();
    let reused = |name: &str| status.iter().find(|m| m.name == name).map(|m| m.reused);
    assert_eq!(reused(MAP_ROUTING), Some(false), "created now");
    assert_eq!(reused(spec::MAP_CONFIG), Some(true));
    assert_eq!(reused(MAP_CT4), Some(true));
    assert_eq!(dp.maps().routing.lock().get(&0, 0).unwrap(), RoutingConfig::default());
    let vxlan = RoutingConfig {
        mode: ROUTING_VXLAN,
        tunnel_ifindex: 7,
        tunnel_mtu: 1450,
        underlay_ifindex: 2,
    };
    dp.write_routing(vxlan).unwrap();
    assert_eq!(dp.maps().routing.lock().get(&0, 0).unwrap(), vxlan);
    assert!(dir.0.join(MAP_ROUTING).exists(), "pinned");
}
