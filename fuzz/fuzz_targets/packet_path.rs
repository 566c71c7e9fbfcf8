//! Frames through the real datapath: svc-loader's `from_container` and
//! `to_container`, loaded in-process with `BPF_PROG_TEST_RUN` on their real
//! maps, with two endpoints, an IP cache and a small policy compiled by
//! rivet-policy, exactly as svc-endpoint asks for it.
//!
//! Every frame must get a defined verdict: `TC_ACT_OK`, `TC_ACT_SHOT` or
//! (`from_container` only) `TC_ACT_REDIRECT`, a drop always with exactly
//! one drop event of a defined reason, and never a drop event without a
//! drop. Where the frame says what must happen, it must happen:
//!
//! - an interface with no endpoint: `DROP_UNKNOWN_ENDPOINT`;
//! - an EtherType other than IPv4, IPv6 and ARP: `DROP_UNSUPPORTED_L3`;
//! - an IP header, or the ports of TCP/UDP or the ICMP header, cut short:
//!   `DROP_INVALID_PACKET`;
//! - a well-formed IPv4/IPv6 TCP, UDP, ICMP or ICMPv6 packet (not an ICMP
//!   error, neighbour discovery or MLD, not a later fragment) of a new flow
//!   (no conntrack entry either way): the source check, then the verdict of
//!   `PolicyRepository::evaluate` for the source and destination
//!   identities, protocol, port and direction (the sender's egress, then,
//!   to a local endpoint, its ingress), with the drop event naming both
//!   identities; a dropped new flow leaves no conntrack entry, a passed one
//!   leaves its own.
//!
//! Conntrack and the fragments map are emptied after every input, so an
//! input's outcome depends on that input alone; within an input, later
//! frames meet the state earlier ones left (replies, retransmissions).
//!
//! Input: the first byte's low bit chooses the form.
//! - 1, raw: bits 1-2 the interface (client, server, no endpoint), bit 3
//!   the program (`to_container` if set); the rest is an Ethernet frame.
//! - 0, structured: up to `MAX_FRAMES` records of `RECORD` bytes, each
//!   a frame built with testkit's frame helpers (see `Record` in the harness).
//!
//! Setup, once per fuzzing thread: a network namespace and a mount
//! namespace of its own (`unshare`), a fresh bpffs mounted over
//! `/sys/fs/bpf` in the latter for the pins: both go with the process
//! however it ends, so a crashed run leaves no namespace, interface or pin.
//! Needs root; without BPF, bpffs or the privileges it fails (a crash),
//! never skips.
//!
//! `RIVET_PKTFUZZ_DUMP=<dir>`: every frame a structured input builds is
//! also written there as a raw input (how the raw seeds were made:
//! `packet_path -runs=0 corpus/packet_path` over the structured seeds).

#![no_main]

// testkit's frame builders, by path: testkit itself pulls kube and
// etcd-client, most of a cold build, for nothing this target uses.
#[allow(dead_code)]
#[path = "../../testkit/src/frames.rs"]
mod frames;

#[path = "packet_path/harness.rs"]
mod harness;

use std::cell::RefCell;

use libfuzzer_sys::fuzz_target;

thread_local! {
    /// One datapath per fuzzing thread, in that thread's own namespaces.
    static HARNESS: RefCell<harness::Harness> = RefCell::new(harness::Harness::setup());
}

fuzz_target!(
    // Before the first input: loading the datapath takes seconds (the
    // verifier), which would count against that input's timeout.
    init: HARNESS.with(|_| ()),
    |data: &[u8]| {
        HARNESS.with_borrow_mut(|harness| harness.input(data));
    }
);
