//! Classic tc attachments over rtnetlink: the `clsact` qdisc and one
//! direct-action `cls_bpf` filter per hook, addressed by interface index in
//! the calling thread's network namespace.
//!
//! Why not TCX links: measured on this project's kernel (6.18, 2 cores),
//! creating a TCX link costs 10-15 ms per hook (the kernel waits for an RCU
//! grace period when it swaps a device's program array) and a device holding
//! TCX links takes twice as long to delete (~48 ms vs ~24 ms); a clsact qdisc
//! plus two `cls_bpf` filters takes 0.2-0.4 ms. A pod's ADD and DEL pay this
//! once per pod, so it decides how fast pods start. A filter is also a kernel
//! object that needs no pin to outlive the loader: it holds its program, and
//! goes away with its device.
//!
//! Our filter on a hook is the one at [`FILTER_PRIORITY`] / [`FILTER_HANDLE`]
//! with the name the loader gave it; filters of anyone else are left alone.

use std::io;
use std::os::fd::{AsRawFd as _, BorrowedFd};

use netlink_packet_core::{NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_packet_route::tc::{TcAttribute, TcBpfFlags, TcFilterBpfOption, TcHandle, TcMessage, TcOption};

use crate::rtnl::request;

/// Priority of Rivet's filter on each hook (the first filter to run).
pub const FILTER_PRIORITY: u16 = 1;

/// Handle of Rivet's filter on each hook.
pub const FILTER_HANDLE: u32 = 1;

/// `ETH_P_ALL`: the filter sees every protocol.
const ETH_P_ALL: u16 = 0x0003;

/// One of the two clsact hooks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Packets the device receives.
    Ingress,
    /// Packets the device sends.
    Egress,
}

impl Direction {
    fn parent(self) -> TcHandle {
        TcHandle {
            major: u16::MAX,
            minor: match self {
                Self::Ingress => TcHandle::MIN_INGRESS,
                Self::Egress => TcHandle::MIN_EGRESS,
            },
        }
    }
}

/// A `cls_bpf` filter as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BpfFilter {
    /// Filter priority.
    pub priority: u16,
    /// Filter handle.
    pub handle: u32,
    /// Kernel id of the program it runs.
    pub prog_id: u32,
    /// The name given when it was attached.
    pub name: String,
}

impl BpfFilter {
    /// Whether this is Rivet's filter named `name`.
    pub fn is_ours(&self, name: &str) -> bool {
        self.priority == FILTER_PRIORITY && self.handle == FILTER_HANDLE && self.name == name
    }
}

/// Adds the `clsact` qdisc to `ifindex`; one that exists already is fine.
pub fn ensure_clsact(ifindex: u32) -> io::Result<()> {
    let mut msg = TcMessage::with_index(index(ifindex)?);
    msg.header.parent = TcHandle::CLSACT;
    msg.header.handle = TcHandle {
        major: 0xffff,
        minor: 0,
    };
    msg.attributes.push(TcAttribute::Kind("clsact".into()));
    match request(RouteNetlinkMessage::NewQueueDiscipline(msg), NLM_F_CREATE | NLM_F_EXCL) {
        Err(err) if err.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        other => other.map(drop),
    }
}

/// The `cls_bpf` filters on one hook of `ifindex` (none without a clsact
/// qdisc). `ENODEV` if the interface does not exist.
pub fn bpf_filters(ifindex: u32, direction: Direction) -> io::Result<Vec<BpfFilter>> {
    let mut msg = TcMessage::with_index(index(ifindex)?);
    msg.header.parent = direction.parent();
    let replies = match request(RouteNetlinkMessage::GetTrafficFilter(msg), NLM_F_DUMP) {
        Ok(replies) => replies,
        // No clsact qdisc: no filters.
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) && crate::netdev::interface_exists(ifindex)? => {
            return Ok(Vec::new());
        }
        Err(err) => return Err(err),
    };
    let mut filters = Vec::new();
    for reply in replies {
        let RouteNetlinkMessage::NewTrafficFilter(msg) = reply else {
            continue;
        };
        let mut kind_bpf = false;
        let (mut prog_id, mut name) = (None, String::new());
        for attribute in &msg.attributes {
            match attribute {
                TcAttribute::Kind(kind) => kind_bpf = kind == "bpf",
                TcAttribute::Options(options) => {
                    for option in options {
                        match option {
                            TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => prog_id = Some(*id),
                            TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => name = n.clone(),
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        // A dump also lists the filter "chain heads" (no options): skip them.
        if let (true, Some(prog_id)) = (kind_bpf, prog_id) {
            filters.push(BpfFilter {
                priority: (msg.header.info >> 16) as u16,
                handle: u32::from(msg.header.handle),
                prog_id,
                name,
            });
        }
    }
    Ok(filters)
}

/// Attaches `prog` as Rivet's direct-action filter named `name` on one hook
/// of `ifindex` (clsact must exist). With `replace`, an existing filter at
/// Rivet's priority and handle gets the new program atomically; without it,
/// such a filter makes this fail with `EEXIST`.
pub fn attach_bpf(
    ifindex: u32,
    direction: Direction,
    prog: BorrowedFd<'_>,
    name: &str,
    replace: bool,
) -> io::Result<()> {
    let msg = filter_message(
        ifindex,
        direction,
        vec![
            TcAttribute::Kind("bpf".into()),
            TcAttribute::Options(vec![
                TcOption::Bpf(TcFilterBpfOption::ProgFd(prog.as_raw_fd() as u32)),
                TcOption::Bpf(TcFilterBpfOption::ProgName(name.to_owned())),
                TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
            ]),
        ],
    )?;
    // cls_bpf replaces the program of an existing handle when NLM_F_EXCL is absent.
    let flags = if replace {
        NLM_F_CREATE
    } else {
        NLM_F_CREATE | NLM_F_EXCL
    };
    request(RouteNetlinkMessage::NewTrafficFilter(msg), flags).map(drop)
}

/// Deletes Rivet's filter from one hook of `ifindex`; `Ok(false)` if there
/// was none (or no interface).
pub fn detach_bpf(ifindex: u32, direction: Direction) -> io::Result<bool> {
    let msg = filter_message(ifindex, direction, vec![TcAttribute::Kind("bpf".into())])?;
    match request(RouteNetlinkMessage::DelTrafficFilter(msg), 0) {
        Ok(_) => Ok(true),
        Err(err) if matches!(err.raw_os_error(), Some(libc::ENOENT | libc::EINVAL | libc::ENODEV)) => Ok(false),
        Err(err) => Err(err),
    }
}

fn filter_message(ifindex: u32, direction: Direction, attributes: Vec<TcAttribute>) -> io::Result<TcMessage> {
    let mut msg = TcMessage::with_index(index(ifindex)?);
    msg.header.parent = direction.parent();
    msg.header.handle = TcHandle::from(FILTER_HANDLE);
    msg.header.info = (u32::from(FILTER_PRIORITY) << 16) | u32::from(ETH_P_ALL.to_be());
    msg.attributes = attributes;
    Ok(msg)
}

fn index(ifindex: u32) -> io::Result<i32> {
    i32::try_from(ifindex).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "ifindex out of range"))
}
