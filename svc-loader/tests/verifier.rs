//! The embedded datapath passes the kernel verifier on this kernel.

use aya::Ebpf;
use aya::programs::{CgroupSockAddr, SchedClassifier};

fn object() -> Ebpf {
    aya::EbpfLoader::new()
        .map_max_entries("ct4", 1024)
        .map_max_entries("ct6", 1024)
        .load(svc_loader::DATAPATH_OBJECT)
        .expect("the datapath object loads (needs CAP_BPF)")
}

/// Instructions the verifier may walk for one program before a change
/// counts as a regression: half the kernel's limit of 1M, so a program
/// that grew this far is noticed while it still loads.
const VERIFIED_INSTRUCTIONS_MAX: u32 = 500_000;

#[test]
fn the_tc_programs_pass_the_verifier_well_under_its_limit() {
    let mut bpf = object();
    for name in [
        "from_container",
        "to_container",
        "from_overlay",
        "to_overlay",
        "from_netdev",
        "to_netdev",
    ] {
        let program: &mut SchedClassifier = bpf
            .program_mut(name)
            .unwrap_or_else(|| panic!("{name} is in the object"))
            .try_into()
            .expect("a classifier");
        if let Err(e) = program.load() {
            panic!("{name} must pass the verifier: {e:#?}");
        }
        let verified = program
            .info()
            .expect("a loaded program's info")
            .verified_instruction_count()
            .expect("the kernel reports verified instructions (5.16+)");
        println!("{name}: {verified} instructions verified");
        assert!(
            verified < VERIFIED_INSTRUCTIONS_MAX,
            "{name}: {verified} instructions verified, over {VERIFIED_INSTRUCTIONS_MAX}"
        );
    }
}

#[test]
fn the_socket_lb_programs_pass_the_verifier() {
    let mut bpf = object();
    for program in svc_loader::datapath::SOCKET_LB_PROGRAMS {
        let prog: &mut CgroupSockAddr = bpf
            .program_mut(program.name)
            .unwrap_or_else(|| panic!("{} is in the object", program.name))
            .try_into()
            .expect("a cgroup sock_addr program");
        if let Err(e) = prog.load() {
            panic!("{} must pass the verifier: {e:#?}", program.name);
        }
    }
}
