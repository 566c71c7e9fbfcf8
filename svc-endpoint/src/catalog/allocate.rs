//! What the catalog hands out: cluster IPs from `--service-cidr`, node
//! ports from 30000-32767 and service ids. Pure: the caller passes what is
//! taken (rebuilt from the stored objects, so allocations are as durable as
//! the objects that hold them).

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;

use super::document::{Family, NODE_PORTS};

/// Why the service CIDRs are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceCidrError {
    /// Two CIDRs of one family.
    #[error("--service-cidr: {first} and {second} are both {family}; give at most one per family")]
    SameFamily {
        /// The first.
        first: IpNet,
        /// The second.
        second: IpNet,
        /// Their family.
        family: &'static str,
    },
    /// Too small to hold an address besides the network's own.
    #[error("--service-cidr: {0} is too small (at most /30 for IPv4, /126 for IPv6)")]
    TooSmall(IpNet),
}

/// The service CIDRs: at most one per family.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterIpPool {
    cidrs: Vec<IpNet>,
}

impl ClusterIpPool {
    /// A pool of `cidrs` (host bits are cleared).
    ///
    /// ```
    /// use svc_endpoint::catalog::allocate::ClusterIpPool;
    /// use svc_endpoint::catalog::document::Family;
    /// let pool = ClusterIpPool::new(vec!["198.19.128.0/20".parse().unwrap()]).unwrap();
    /// let first = pool.allocate(Family::IPv4, &Default::default()).unwrap();
    /// assert_eq!(first.to_string(), "198.19.128.1");
    /// ```
    pub fn new(cidrs: Vec<IpNet>) -> Result<Self, ServiceCidrError> {
        let mut seen: Vec<IpNet> = Vec::new();
        for cidr in cidrs.into_iter().map(|c| c.trunc()) {
            if cidr.max_prefix_len() - cidr.prefix_len() < 2 {
                return Err(ServiceCidrError::TooSmall(cidr));
            }
            if let Some(first) = seen.iter().find(|s| s.addr().is_ipv4() == cidr.addr().is_ipv4()) {
                return Err(ServiceCidrError::SameFamily {
                    first: *first,
                    second: cidr,
                    family: Family::of(cidr.addr()).as_str(),
                });
            }
            seen.push(cidr);
        }
        Ok(Self { cidrs: seen })
    }

    /// The CIDRs.
    pub fn cidrs(&self) -> &[IpNet] {
        &self.cidrs
    }

    /// The families it serves, IPv4 first.
    pub fn families(&self) -> Vec<Family> {
        let mut families: Vec<Family> = self.cidrs.iter().map(|c| Family::of(c.addr())).collect();
        families.sort();
        families
    }

    /// The CIDR of `family`.
    pub fn cidr(&self, family: Family) -> Option<IpNet> {
        self.cidrs.iter().copied().find(|c| Family::of(c.addr()) == family)
    }

    /// Whether `address` is in one of the CIDRs (and not its network or
    /// IPv4 broadcast address).
    pub fn contains(&self, address: IpAddr) -> bool {
        self.cidr(Family::of(address)).is_some_and(|c| {
            c.contains(&address) && address != c.network() && !(address.is_ipv4() && address == c.broadcast())
        })
    }

    /// The lowest free address of `family` not in `taken`; `None` when the
    /// family has no CIDR or it is full.
    pub fn allocate(&self, family: Family, taken: &BTreeSet<IpAddr>) -> Option<IpAddr> {
        let cidr = self.cidr(family)?;
        // Hosts: the network address is skipped (and, for IPv4, the broadcast).
        cidr.hosts().find(|a| *a != cidr.network() && !taken.contains(a))
    }
}

/// The lowest node port not in `taken`.
pub fn allocate_node_port(taken: &BTreeSet<u16>) -> Option<u16> {
    NODE_PORTS.clone().find(|p| !taken.contains(p))
}

/// The lowest nonzero service id not in `taken`.
pub fn allocate_service_id(taken: &BTreeSet<u32>) -> Option<u32> {
    // Ids are dense from 1, so the first gap is near the start or at the end.
    let mut candidate = 1u32;
    for id in taken.iter().copied().filter(|id| *id != 0) {
        if id > candidate {
            break;
        }
        candidate = id.checked_add(1)?;
    }
    Some(candidate)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn cluster_ips_never_repeat_and_stay_in_the_cidr() {
        let pool = ClusterIpPool::new(vec![
            "198.19.128.0/30".parse().unwrap(),
            "2001:2:0:ff::/126".parse().unwrap(),
        ])
        .unwrap();
        let mut taken = BTreeSet::new();
        for _ in 0..2 {
            let a = pool.allocate(Family::IPv4, &taken).unwrap();
            assert!(pool.contains(a), "{a}");
            assert!(taken.insert(a), "{a} twice");
        }
        // .0 is the network, .3 the broadcast: a /30 holds two.
        assert_eq!(pool.allocate(Family::IPv4, &taken), None);
        assert_eq!(taken, BTreeSet::from([ip("198.19.128.1"), ip("198.19.128.2")]));
        assert_eq!(
            pool.allocate(Family::IPv6, &BTreeSet::new()),
            Some(ip("2001:2:0:ff::1"))
        );
        assert!(!pool.contains(ip("198.19.128.0")));
        assert!(!pool.contains(ip("198.19.128.3")));
        assert!(!pool.contains(ip("198.19.129.1")));
        assert_eq!(pool.families(), [Family::IPv4, Family::IPv6]);
    }

    #[test]
    fn one_cidr_per_family() {
        let err = ClusterIpPool::new(vec![
            "198.19.128.0/20".parse().unwrap(),
            "198.19.144.0/20".parse().unwrap(),
        ])
        .unwrap_err();
        assert!(matches!(err, ServiceCidrError::SameFamily { .. }), "{err}");
        assert!(ClusterIpPool::new(vec!["198.19.128.0/31".parse().unwrap()]).is_err());
        assert_eq!(ClusterIpPool::default().allocate(Family::IPv4, &BTreeSet::new()), None);
    }

    #[test]
    fn node_ports_and_ids_take_the_first_gap() {
        assert_eq!(
            allocate_node_port(&BTreeSet::from([30_000, 30_001, 30_003])),
            Some(30_002)
        );
        let all: BTreeSet<u16> = NODE_PORTS.collect();
        assert_eq!(allocate_node_port(&all), None);
        assert_eq!(allocate_service_id(&BTreeSet::new()), Some(1));
        assert_eq!(allocate_service_id(&BTreeSet::from([1, 2, 4])), Some(3));
        assert_eq!(allocate_service_id(&BTreeSet::from([2, 3])), Some(1));
        assert_eq!(allocate_service_id(&BTreeSet::from([1, 2, 3])), Some(4));
    }
}
