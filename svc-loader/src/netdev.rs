//! Network interfaces of the *calling thread's* network namespace: the list,
//! index ↔ name, MAC address, and whether an interface is a veth.
//!
//! Everything here goes through `ioctl`s on a socket the function creates
//! (the list through `if_nameindex`: one rtnetlink link dump),
//! and a socket belongs to the network namespace of the thread that created
//! it. That is what a loader running inside a node namespace needs:
//! `/sys/class/net` shows the namespace of whoever mounted sysfs, not the
//! current one, so it is never read here.
//!
//! The ioctls address an interface by name, so each function resolves the
//! index to a name, asks, and then checks that the name still has the same
//! index (an interface renamed or replaced in between is retried, then
//! reported as gone).

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

/// `ETHTOOL_GDRVINFO` (linux/ethtool.h).
const ETHTOOL_GDRVINFO: u32 = 0x0000_0003;

/// `ARPHRD_ETHER` (linux/if_arp.h).
const ARPHRD_ETHER: u16 = 1;

/// How often an index → name → ioctl sequence is retried when the name
/// changed meanwhile.
const RACE_RETRIES: usize = 3;

/// `struct ethtool_drvinfo` (linux/ethtool.h).
#[repr(C)]
struct EthtoolDrvinfo {
    cmd: u32,
    driver: [u8; 32],
    version: [u8; 32],
    fw_version: [u8; 32],
    bus_info: [u8; 32],
    erom_version: [u8; 32],
    reserved2: [u8; 12],
    n_priv_flags: u32,
    n_stats: u32,
    testinfo_len: u32,
    eedump_len: u32,
    regdump_len: u32,
}

/// The name of interface `ifindex`; `None` if there is none in this namespace.
pub fn ifindex_to_name(ifindex: u32) -> io::Result<Option<String>> {
    if ifindex == 0 {
        return Ok(None);
    }
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: the buffer has IF_NAMESIZE bytes, as if_indextoname requires.
    let ptr = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if ptr.is_null() {
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::ENXIO) | Some(libc::ENODEV) => Ok(None),
            _ => Err(io::Error::new(
                err.kind(),
                format!("looking up the name of ifindex {ifindex}: {err}"),
            )),
        };
    }
    // SAFETY: on success the buffer holds a NUL-terminated name.
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Ok(Some(name.to_string_lossy().into_owned()))
}

/// The index of interface `name`; `None` if there is none in this namespace
/// (or the name cannot be an interface name).
pub fn name_to_ifindex(name: &str) -> io::Result<Option<u32>> {
    if name.is_empty() || name.len() >= libc::IF_NAMESIZE {
        return Ok(None);
    }
    let Ok(c_name) = CString::new(name) else {
        return Ok(None);
    };
    // SAFETY: a valid NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(c_name.as_ptr()) };
    if index == 0 {
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::ENODEV) | Some(libc::ENXIO) => Ok(None),
            _ => Err(io::Error::new(
                err.kind(),
                format!("looking up interface {name}: {err}"),
            )),
        };
    }
    Ok(Some(index))
}

/// Every interface of this namespace, index → name, from one rtnetlink
/// link dump (`if_nameindex`: one socket, one `RTM_GETLINK` request): what
/// a liveness check of many interfaces should cost.
pub fn interfaces() -> io::Result<BTreeMap<u32, String>> {
    // SAFETY: if_nameindex returns an array ended by a zero entry, or NULL.
    let list = unsafe { libc::if_nameindex() };
    if list.is_null() {
        return Err(io::Error::last_os_error());
    }
    let mut interfaces = BTreeMap::new();
    let mut entry = list;
    // SAFETY: walks the array up to its terminating entry (each name is
    // NUL-terminated), then frees it once.
    unsafe {
        while (*entry).if_index != 0 {
            let name = CStr::from_ptr((*entry).if_name).to_string_lossy().into_owned();
            interfaces.insert((*entry).if_index, name);
            entry = entry.add(1);
        }
        libc::if_freenameindex(list);
    }
    Ok(interfaces)
}

/// Whether interface `ifindex` exists in this namespace.
pub fn interface_exists(ifindex: u32) -> io::Result<bool> {
    Ok(ifindex_to_name(ifindex)?.is_some())
}

/// The kernel driver of interface `ifindex` (`ETHTOOL_GDRVINFO`: "veth",
/// "bridge", …); `None` if the device does not report one (loopback).
/// An interface that does not exist is an [`io::ErrorKind::NotFound`] error.
pub fn driver(ifindex: u32) -> io::Result<Option<String>> {
    with_name(ifindex, |sock, name| {
        let mut info = EthtoolDrvinfo {
            cmd: ETHTOOL_GDRVINFO,
            driver: [0; 32],
            version: [0; 32],
            fw_version: [0; 32],
            bus_info: [0; 32],
            erom_version: [0; 32],
            reserved2: [0; 12],
            n_priv_flags: 0,
            n_stats: 0,
            testinfo_len: 0,
            eedump_len: 0,
            regdump_len: 0,
        };
        let mut req = ifreq(name);
        req.ifr_ifru.ifru_data = (&raw mut info).cast();
        // SAFETY: SIOCETHTOOL with ETHTOOL_GDRVINFO fills `info`, which
        // outlives the call; `req` names the interface.
        let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCETHTOOL, &raw mut req) };
        if rc < 0 {
            let err = io::Error::last_os_error();
            return match err.raw_os_error() {
                Some(libc::EOPNOTSUPP) => Ok(None),
                _ => Err(err),
            };
        }
        let end = info.driver.iter().position(|b| *b == 0).unwrap_or(info.driver.len());
        Ok(Some(String::from_utf8_lossy(&info.driver[..end]).into_owned()))
    })
}

/// Whether interface `ifindex` is a veth (its driver is "veth").
/// An interface that does not exist is an [`io::ErrorKind::NotFound`] error.
pub fn is_veth(ifindex: u32) -> io::Result<bool> {
    Ok(driver(ifindex)?.as_deref() == Some("veth"))
}

/// The MAC address of Ethernet interface `ifindex` (`SIOCGIFHWADDR`).
/// An interface that does not exist is an [`io::ErrorKind::NotFound`] error;
/// one that is not Ethernet (loopback, tunnels) [`io::ErrorKind::InvalidInput`].
pub fn host_mac(ifindex: u32) -> io::Result<[u8; 6]> {
    with_name(ifindex, |sock, name| {
        let mut req = ifreq(name);
        // SAFETY: SIOCGIFHWADDR fills the ifreq it is given.
        let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFHWADDR, &raw mut req) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: SIOCGIFHWADDR succeeded, so the union holds ifru_hwaddr.
        let addr = unsafe { req.ifr_ifru.ifru_hwaddr };
        if addr.sa_family != ARPHRD_ETHER {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "interface {name} (ifindex {ifindex}) is not an Ethernet device (ARP hardware type {})",
                    addr.sa_family
                ),
            ));
        }
        Ok(std::array::from_fn(|i| addr.sa_data[i] as u8))
    })
}

fn not_found(ifindex: u32) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("no interface with ifindex {ifindex} in this network namespace"),
    )
}

/// Runs an ioctl-based query `f(socket, name)` for interface `ifindex` and
/// checks that the name still denotes the same index afterwards.
fn with_name<T>(ifindex: u32, f: impl Fn(&OwnedFd, &str) -> io::Result<T>) -> io::Result<T> {
    let sock = ioctl_socket()?;
    for _ in 0..RACE_RETRIES {
        let Some(name) = ifindex_to_name(ifindex)? else {
            return Err(not_found(ifindex));
        };
        let result = f(&sock, &name);
        if name_to_ifindex(&name)? == Some(ifindex) {
            return result.map_err(|err| match err.raw_os_error() {
                Some(libc::ENODEV) => not_found(ifindex),
                Some(_) => io::Error::new(
                    err.kind(),
                    format!("querying interface {name} (ifindex {ifindex}): {err}"),
                ),
                None => err,
            });
        }
    }
    Err(not_found(ifindex))
}

fn ioctl_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        let err = io::Error::last_os_error();
        return Err(io::Error::new(
            err.kind(),
            format!("opening a socket for interface ioctls: {err}"),
        ));
    }
    // SAFETY: a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ifreq(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes().take(libc::IF_NAMESIZE - 1)) {
        *dst = src as libc::c_char;
    }
    req
}

#[cfg(test)]
mod tests {
    use rivet_common::testing::netns::{NetNs, veth_pair};

    use super::*;

    #[test]
    fn netdev_queries_follow_the_thread_namespace() {
        let ns = NetNs::new("rvtnd").expect("a test network namespace (needs root)");
        veth_pair(&ns, "rvnda", &ns, "rvndb").unwrap();
        ns.ip(&["link", "add", "rvndbr", "type", "bridge"]).unwrap();
        let veth = ns.ifindex("rvnda").unwrap();
        let bridge = ns.ifindex("rvndbr").unwrap();
        let mac = ns.mac("rvnda").unwrap();

        let (names, drivers, macs, lo, missing) = ns
            .in_ns(move || {
                (
                    (ifindex_to_name(veth).unwrap(), name_to_ifindex("rvnda").unwrap()),
                    (
                        is_veth(veth).unwrap(),
                        is_veth(bridge).unwrap(),
                        driver(bridge).unwrap(),
                    ),
                    host_mac(veth).unwrap(),
                    (is_veth(1).unwrap(), host_mac(1).unwrap_err().kind()),
                    (
                        ifindex_to_name(999_999).unwrap(),
                        is_veth(999_999).unwrap_err(),
                        host_mac(999_999).unwrap_err(),
                        interface_exists(999_999).unwrap(),
                    ),
                )
            })
            .unwrap();
        assert_eq!(names, (Some("rvnda".to_owned()), Some(veth)));
        let all = ns.in_ns(interfaces).unwrap().unwrap();
        assert_eq!(
            (all.get(&1), all.get(&veth), all.get(&bridge)),
            (
                Some(&"lo".to_owned()),
                Some(&"rvnda".to_owned()),
                Some(&"rvndbr".to_owned())
            ),
            "one link dump names every interface of the namespace: {all:?}"
        );
        assert_eq!(all.len(), 4, "lo, the veth pair and the bridge: {all:?}");
        assert_eq!(drivers, (true, false, Some("bridge".to_owned())));
        assert_eq!(macs, mac);
        assert_eq!(lo, (false, io::ErrorKind::InvalidInput));
        let (name, veth_err, mac_err, exists) = missing;
        assert_eq!(name, None);
        assert!(!exists);
        assert_eq!(veth_err.kind(), io::ErrorKind::NotFound);
        assert!(veth_err.to_string().contains("ifindex 999999"), "{veth_err}");
        assert_eq!(mac_err.kind(), io::ErrorKind::NotFound);

        // This thread is still in the test process's namespace, where the
        // veth does not exist.
        assert_eq!(name_to_ifindex("rvnda").unwrap(), None);
        assert_eq!(name_to_ifindex("").unwrap(), None);
        assert_eq!(name_to_ifindex("a-name-far-too-long").unwrap(), None);
        assert_eq!(ifindex_to_name(0).unwrap(), None);
    }
}
