//! The host-side veth name of an attachment: deterministic, so DEL, CHECK
//! and GC find it from the container id and interface name alone, even when
//! ADD died half-way.

use sha2::{Digest, Sha256};

use crate::env::IFNAME_MAX;

/// `<prefix><hex>`: the prefix, then as many lowercase hex digits of
/// SHA-256(`<container id>/<ifname>`) as fit in 15 bytes (12 after the
/// default `lxc`, 5 after a 10-byte prefix). `/` cannot occur in a
/// container id, so the hashed text is unambiguous.
///
/// ```
/// use rivet_cni::naming::host_ifname;
/// let name = host_ifname("lxc", "abc123", "eth0");
/// assert_eq!(name.len(), 15);
/// assert!(name.starts_with("lxc"));
/// assert_eq!(name, host_ifname("lxc", "abc123", "eth0"));
/// assert_ne!(name, host_ifname("lxc", "abc123", "eth1"));
/// ```
pub fn host_ifname(prefix: &str, container_id: &str, ifname: &str) -> String {
    let digest = Sha256::digest(format!("{container_id}/{ifname}").as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let room = IFNAME_MAX.saturating_sub(prefix.len());
    format!("{prefix}{}", &hex[..room])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_and_differ() {
        // A known value, so a change of scheme (which would orphan existing
        // veths at upgrade) does not go unnoticed.
        assert_eq!(host_ifname("lxc", "c1", "eth0"), "lxcd72e032fedd9");
        assert_eq!(host_ifname("tenbytes10", "c1", "eth0"), "tenbytes10d72e0");
        for prefix in ["l", "lxc", "rvh", "tenbytes10"] {
            let name = host_ifname(prefix, "5f1e2d3c4b5a", "eth0");
            assert_eq!(name.len(), 15, "{name}");
            assert!(name.starts_with(prefix));
            assert!(
                name[prefix.len()..]
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
            );
            assert!(crate::env::check_ifname(&name).is_ok());
        }
        let mut seen = std::collections::HashSet::new();
        for i in 0..1000 {
            assert!(seen.insert(host_ifname("lxc", &format!("container-{i}"), "eth0")));
        }
        // The interface name is part of the hash (two interfaces of one pod).
        assert_ne!(host_ifname("lxc", "c1", "eth0"), host_ifname("lxc", "c1", "net1"));
        // Not a simple concatenation: ("c1", "0/eth") and ("c1/0", "eth") cannot collide
        // because '/' is not allowed in container ids.
        assert!(crate::env::check_container_id("c1/0").is_err());
    }
}
