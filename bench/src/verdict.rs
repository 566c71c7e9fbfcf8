//! `verdict`: nanoseconds per packet of the datapath's two programs, run by
//! the kernel on the real maps with `BPF_PROG_TEST_RUN`, against a floor: a
//! tc program that only returns `TC_ACT_OK` (`bench/bpf/floor.c`), run the
//! same way. ratio = from_container's IPv4 conntrack hit / floor (the
//! per-packet cost of an established pod→pod flow, in floors).
//!
//! The datapath is loaded in-process (svc-loader's library) with pins of its
//! own, in a network namespace holding two endpoint veths: `a` (egress
//! enforced) and `b` (ingress enforced, with `--policy-entries` more entries
//! than the one that matters), plus a remote peer in the ipcache.
//!
//! Cases, IPv4 and IPv6 each:
//! - `from_container` a→b, a local destination: a's egress policy, b's
//!   ingress policy, the rewrite and the redirect to b (`TC_ACT_REDIRECT`);
//! - `to_container` remote→b: b's ingress policy (`TC_ACT_OK`);
//! - **CT hit**: a TCP segment of a flow whose entries exist, `--repeat`
//!   runs per call. The kernel reruns the program on one socket buffer, so
//!   the frame starts with TTL / hop limit 255 and `--repeat` stays below
//!   it: every run takes the redirect path, not the stack's time-exceeded;
//! - **CT miss**: a SYN of a new flow (policy lookups, conntrack entries
//!   created), one run per call, each call a new source port.
//!
//! The floor is measured in both modes (`--repeat` runs per call and one),
//! each case divided by the floor of its mode: one run per call carries the
//! kernel's timer reads, which the floor then carries too. Every call's
//! return value is checked (a case that took another path fails the
//! benchmark). The cases are interleaved call by call, `--samples` times,
//! so that the machine's load weighs on all of them alike; each figure is
//! the median over the calls of the kernel's mean time per run.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsFd as _;

use aya::programs::SchedClassifier;
use rivet_bpf_sys as sys;
use rivet_common::testing::netns::{NetNs, veth_pair};
use rivet_proto::loader::v1 as pb;
use rivet_testkit::frames::{self, ETH_P_IP, ETH_P_IPV6, TCP_ACK, TCP_SYN, proto};
use rivet_testkit::loader::{PinDir, entry, policy};
use svc_loader::datapath::{Datapath, DatapathOptions, Hook};
use svc_loader::loader::EndpointDatapath;
use svc_loader::maps::IpcacheValue;

use crate::report::{BenchResult, load_average, percentile};

/// Options of the verdict benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct VerdictArgs {
    /// Calls per case (each case's figure is their median).
    #[arg(long, default_value_t = 2000)]
    samples: u32,
    /// Runs per call for the conntrack-hit cases and their floor (below 254:
    /// each run lowers the frame's TTL by one).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..254))]
    repeat: u32,
    /// Extra ingress policy entries on b (realistic policy size).
    #[arg(long, default_value_t = 100)]
    policy_entries: u32,
}

/// The floor program, compiled by build.rs from `bpf/floor.c`.
static FLOOR_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/floor.o"));

const TC_ACT_OK: u32 = 0;
const TC_ACT_REDIRECT: u32 = 7;
/// Host-side veth prefix; the loader acts only on these.
const PREFIX: &str = "rvvb";
const A: u32 = 1001;
const B: u32 = 1002;
const REMOTE: u32 = 1003;
const PORT: u16 = 5201;
const A4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
const B4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 3);
const REMOTE4: Ipv4Addr = Ipv4Addr::new(198, 18, 4, 2);
const A6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 2);
const B6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 3);
const REMOTE6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 4, 0, 0, 0, 0, 2);
const POD_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
const NODE_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0xfe];
/// The established flows' source port; new flows count up from `MISS_PORTS`.
const HIT_PORT: u16 = 40000;
const MISS_PORTS: u16 = 1024;

/// Runs the benchmark.
pub async fn run(args: &VerdictArgs) -> anyhow::Result<BenchResult> {
    let args = args.clone();
    // Blocking work on one thread inside the namespace; the namespace and
    // the pins go away when it is done, also on error.
    let ns = NetNs::new("rvverdict")?;
    for i in 0..2 {
        veth_pair(&ns, &format!("{PREFIX}{i}"), &ns, &format!("rvvp{i}"))?;
    }
    let pins = PinDir::of_node(&format!("bench-verdict-{}", std::process::id()));
    let pin_dir = pins.0.clone();
    let cases = ns.in_ns(move || measure(&args, pin_dir))??;
    drop(ns);
    drop(pins);
    Ok(report(&cases, load_average()?))
}

/// One measured case: its name, its median ns per packet and its floor's.
struct Measured {
    name: String,
    ns: f64,
    floor_ns: f64,
}

fn report(cases: &[Measured], load: f64) -> BenchResult {
    let mut metrics = Vec::new();
    for case in cases {
        println!(
            "{:<32} {:>7.1} ns/packet  floor {:>5.1} ns  ratio {:>6.2}  (+{:.1} ns)",
            case.name,
            case.ns,
            case.floor_ns,
            case.ns / case.floor_ns,
            case.ns - case.floor_ns
        );
        metrics.push((format!("{}_ns", case.name), case.ns));
    }
    let floor = |name: &str| cases.iter().find(|c| c.name == name).map_or(f64::NAN, |c| c.floor_ns);
    metrics.push(("floor_ns".into(), floor("from_container_v4_ct_hit")));
    metrics.push(("floor_single_run_ns".into(), floor("from_container_v4_ct_miss")));
    metrics.push(("load_average_1m".into(), load));
    println!("load average (1 min): {load:.2}");
    let headline = cases
        .iter()
        .find(|c| c.name == "from_container_v4_ct_hit")
        .map_or(f64::NAN, |c| c.ns / c.floor_ns);
    BenchResult {
        name: "verdict".into(),
        metrics,
        ratio: headline,
    }
}

/// Which program a case runs.
#[derive(Clone, Copy)]
enum Program {
    Floor,
    Datapath(Hook),
}

/// A case: TCP segments `src` → `dst` with `flags` run through a program
/// from an interface, with the return value they must give.
struct Case {
    name: String,
    program: Program,
    ifindex: u32,
    src: IpAddr,
    dst: IpAddr,
    flags: u8,
    /// `Some(port)`: every call runs this flow `repeat` times (a hit);
    /// `None`: every call is one run of a new flow (a miss).
    hit_port: Option<u16>,
    expect: u32,
    /// The kernel's mean ns per run, one per call.
    samples: Vec<f64>,
}

fn measure(args: &VerdictArgs, pin_dir: std::path::PathBuf) -> anyhow::Result<Vec<Measured>> {
    let loader = open_loader(args, pin_dir)?;
    let ifindex = |name: String| -> anyhow::Result<u32> {
        svc_loader::netdev::name_to_ifindex(&name)?.ok_or_else(|| anyhow::anyhow!("no interface {name}"))
    };
    let (a_if, b_if) = (ifindex(format!("{PREFIX}0"))?, ifindex(format!("{PREFIX}1"))?);
    apply_endpoints(&loader, args, a_if, b_if)?;

    let mut floor_object = aya::Ebpf::load(FLOOR_OBJECT)?;
    let floor: &mut SchedClassifier = floor_object
        .program_mut("pass")
        .ok_or_else(|| anyhow::anyhow!("the floor object has no program `pass`"))?
        .try_into()?;
    floor.load()?;
    let floor_fd = floor.fd()?.as_fd();

    let mut cases = Vec::new();
    for family in [4u8, 6] {
        let (a, b, remote): (IpAddr, IpAddr, IpAddr) = if family == 4 {
            (A4.into(), B4.into(), REMOTE4.into())
        } else {
            (A6.into(), B6.into(), REMOTE6.into())
        };
        for (program, hook, ifindex, src, dst, expect) in [
            ("from_container", Hook::Ingress, a_if, a, b, TC_ACT_REDIRECT),
            ("to_container", Hook::Egress, b_if, remote, b, TC_ACT_OK),
        ] {
            for (kind, flags, hit_port) in [("ct_hit", TCP_ACK, Some(HIT_PORT)), ("ct_miss", TCP_SYN, None)] {
                cases.push(Case {
                    name: format!("{program}_v{family}_{kind}"),
                    program: Program::Datapath(hook),
                    ifindex,
                    src,
                    dst,
                    flags,
                    hit_port,
                    expect,
                    samples: Vec::new(),
                });
            }
        }
    }
    for (mode, hit_port) in [("repeat", Some(HIT_PORT)), ("single", None)] {
        cases.push(Case {
            name: format!("floor_{mode}"),
            program: Program::Floor,
            ifindex: a_if,
            src: A4.into(),
            dst: B4.into(),
            flags: TCP_ACK,
            hit_port,
            expect: TC_ACT_OK,
            samples: Vec::new(),
        });
    }

    // The established flows: one SYN each creates their entries.
    for case in &cases {
        if let (Program::Datapath(hook), Some(port)) = (case.program, case.hit_port) {
            let syn = tcp_frame(case.src, case.dst, port, TCP_SYN);
            let retval = loader.datapath().test_run(hook, &syn, case.ifindex)?;
            anyhow::ensure!(
                retval == case.expect,
                "{}: the opening SYN returned {retval}, not {}",
                case.name,
                case.expect
            );
        }
    }

    for sample in 0..args.samples {
        let miss_port = MISS_PORTS + (sample % u32::from(u16::MAX - MISS_PORTS)) as u16;
        for case in &mut cases {
            let (port, repeat) = match case.hit_port {
                Some(port) => (port, args.repeat),
                None => (miss_port, 1),
            };
            let frame = tcp_frame(case.src, case.dst, port, case.flags);
            let run = match case.program {
                Program::Floor => sys::test_run_classifier_repeat(floor_fd, &frame, case.ifindex, repeat)?,
                Program::Datapath(hook) => loader.datapath().test_run_repeat(hook, &frame, case.ifindex, repeat)?,
            };
            anyhow::ensure!(
                run.retval == case.expect,
                "{}: returned {}, not {} (call {sample})",
                case.name,
                run.retval,
                case.expect
            );
            case.samples.push(f64::from(run.duration_ns));
        }
    }

    let mut floors = [f64::NAN; 2];
    for case in &mut cases {
        if matches!(case.program, Program::Floor) {
            floors[usize::from(case.hit_port.is_none())] = percentile(&mut case.samples, 0.5);
        }
    }
    Ok(cases
        .iter_mut()
        .filter(|c| matches!(c.program, Program::Datapath(_)))
        .map(|c| Measured {
            name: c.name.clone(),
            ns: percentile(&mut c.samples, 0.5),
            floor_ns: floors[usize::from(c.hit_port.is_none())],
        })
        .collect())
}

/// The datapath with its own pins, conntrack room for every new flow.
fn open_loader(args: &VerdictArgs, pin_dir: std::path::PathBuf) -> anyhow::Result<EndpointDatapath> {
    let mut opts = DatapathOptions::new(pin_dir);
    // Three entries per sample and family (from_container: a's egress and
    // b's ingress; to_container: b's ingress), with room to spare: an LRU
    // map near its size evicts on insert, which no node's map does.
    let ct_max = (32 * args.samples).clamp(65536, 1 << 20);
    opts.ct4_max = ct_max;
    opts.ct6_max = ct_max;
    opts.endpoints_max = 64;
    opts.ipcache_max = 4096;
    opts.policy_max = 65536;
    opts.events_bytes = 1 << 16;
    Ok(EndpointDatapath::new(Datapath::open(opts)?, PREFIX)?)
}

/// a: egress enforced, allowing b on the port. b: ingress enforced,
/// allowing a and the remote peer on the port, plus `policy_entries`
/// entries for other identities and ports. The remote peer in the ipcache.
fn apply_endpoints(loader: &EndpointDatapath, args: &VerdictArgs, a_if: u32, b_if: u32) -> anyhow::Result<()> {
    use pb::{Direction::*, Protocol, Verdict::*};
    let a_policy = policy(
        1,
        false,
        true,
        vec![entry(Egress, B, Protocol::Tcp, PORT.into(), 0, Allow)],
    );
    let mut b_entries = vec![
        entry(Ingress, A, Protocol::Tcp, PORT.into(), 0, Allow),
        entry(Ingress, REMOTE, Protocol::Tcp, PORT.into(), 0, Allow),
    ];
    for i in 0..args.policy_entries {
        b_entries.push(entry(Ingress, 2000 + i, Protocol::Tcp, 10000 + i, 0, Allow));
    }
    let b_policy = policy(1, true, false, b_entries);
    for (id, ifindex, identity, v4, v6, policy) in [(1, a_if, A, A4, A6, a_policy), (2, b_if, B, B4, B6, b_policy)] {
        let request = pb::ApplyEndpointRequest {
            endpoint_id: id,
            host_ifindex: ifindex,
            addresses: vec![v4.octets().to_vec(), v6.octets().to_vec()],
            mac: vec![2, 0, 0, 0, 0, id as u8],
            identity,
            policy: Some(policy),
        };
        loader.apply(&svc_loader::validate::endpoint(&request)?)?;
    }
    loader.upsert_ipcache(&[
        (REMOTE4.into(), 32, IpcacheValue::new(REMOTE, None)),
        (REMOTE6.into(), 128, IpcacheValue::new(REMOTE, None)),
    ])?;
    Ok(())
}

/// An Ethernet frame of a TCP segment `src:sport` → `dst:PORT`, TTL / hop
/// limit 255.
fn tcp_frame(src: IpAddr, dst: IpAddr, sport: u16, flags: u8) -> Vec<u8> {
    let segment = frames::tcp(src, dst, sport, PORT, flags);
    let (ethertype, packet) = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => (ETH_P_IP, frames::ipv4(s, d, proto::TCP, 255, 1, None, &segment)),
        (IpAddr::V6(s), IpAddr::V6(d)) => (ETH_P_IPV6, frames::ipv6(s, d, 255, &[], proto::TCP, &segment)),
        _ => unreachable!("one family per frame"),
    };
    frames::ethernet(NODE_MAC, POD_MAC, ethertype, &packet)
}
