//! Pool configuration: named pools, each with IPv4 and/or IPv6 ranges, from
//! `--pool NAME=CIDR[,CIDR...]` (fixed) or SetPool (replaceable), checked
//! together (size, alignment, overlap).

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// Name of the pool used when a request names none.
pub const DEFAULT_POOL: &str = "default";

/// Address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl Family {
    /// The family of `addr`.
    pub fn of(addr: &IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// `ipv4` or `ipv6`, as used in metric labels and tables.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a pool's ranges come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PoolSource {
    /// The `--pool` flag: fixed for the process' lifetime.
    Flag,
    /// SetPool (the node's RivetNode via svc-k8s-sync): durable, replaceable.
    SetPool,
}

/// Why a pool configuration is refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum PoolConfigError {
    /// Not `NAME=CIDR[,CIDR...]`.
    #[error("pool {spec:?}: expected NAME=CIDR[,CIDR...], e.g. default=198.18.0.0/24,2001:2::/112")]
    Syntax {
        /// The pool specification given.
        spec: String,
    },
    /// Bad pool name.
    #[error("pool name {name:?}: use 1-63 lowercase letters, digits and '-'")]
    Name {
        /// The name given.
        name: String,
    },
    /// Two pools with one name.
    #[error("pool {name:?} is defined twice")]
    DuplicateName {
        /// The name.
        name: String,
    },
    /// Not a CIDR.
    #[error("pool {pool}: {cidr:?} is not a CIDR")]
    Cidr {
        /// Pool.
        pool: String,
        /// The text.
        cidr: String,
    },
    /// Host bits set.
    #[error("pool {pool}: {cidr} has host bits set; did you mean {network}?")]
    NotNetwork {
        /// Pool.
        pool: String,
        /// The CIDR given.
        cidr: IpNet,
        /// Its network.
        network: IpNet,
    },
    /// No usable address left after network, gateway and broadcast.
    #[error(
        "pool {pool}: {cidr} is too small; it needs room for the network address, the gateway and at least one pod (IPv4 /30 or larger, IPv6 /126 or larger)"
    )]
    TooSmall {
        /// Pool.
        pool: String,
        /// The CIDR.
        cidr: IpNet,
    },
    /// Two ranges overlap.
    #[error("pool {pool}: {cidr} overlaps {other} of pool {other_pool}")]
    Overlap {
        /// Pool.
        pool: String,
        /// The CIDR.
        cidr: IpNet,
        /// The pool it overlaps.
        other_pool: String,
        /// The CIDR it overlaps.
        other: IpNet,
    },
    /// A pool without any range.
    #[error("pool {pool}: no CIDR given")]
    NoCidr {
        /// Pool.
        pool: String,
    },
}

/// One `--pool` flag: a name and its CIDRs, not yet validated together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// Pool name.
    pub name: String,
    /// Its CIDRs.
    pub cidrs: Vec<IpNet>,
}

impl FromStr for PoolSpec {
    type Err = PoolConfigError;

    /// Parses `NAME=CIDR[,CIDR...]`.
    ///
    /// ```
    /// let spec: svc_ipam::pool::PoolSpec = "default=198.18.0.0/24,2001:2::/112".parse().unwrap();
    /// assert_eq!(spec.name, "default");
    /// assert_eq!(spec.cidrs.len(), 2);
    /// ```
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, cidrs) = s
            .split_once('=')
            .ok_or_else(|| PoolConfigError::Syntax { spec: s.into() })?;
        let name = name.trim();
        check_name(name)?;
        let cidrs = cidrs
            .split(',')
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(|c| {
                c.parse::<IpNet>().map_err(|_| PoolConfigError::Cidr {
                    pool: name.into(),
                    cidr: c.into(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if cidrs.is_empty() {
            return Err(PoolConfigError::Syntax { spec: s.into() });
        }
        Ok(Self {
            name: name.into(),
            cidrs,
        })
    }
}

impl PoolSpec {
    /// A pool named `name` (1-63 lowercase letters, digits and '-') with
    /// at least one CIDR; the CIDRs are checked by [`PoolSet`].
    pub fn new(name: &str, cidrs: Vec<IpNet>) -> Result<Self, PoolConfigError> {
        check_name(name)?;
        if cidrs.is_empty() {
            return Err(PoolConfigError::NoCidr { pool: name.into() });
        }
        Ok(Self {
            name: name.into(),
            cidrs,
        })
    }
}

fn check_name(name: &str) -> Result<(), PoolConfigError> {
    let valid = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if valid {
        Ok(())
    } else {
        Err(PoolConfigError::Name { name: name.into() })
    }
}

/// A validated range of a pool, with its reserved addresses worked out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRange {
    /// Pool the range belongs to.
    pub pool: String,
    /// The CIDR.
    pub cidr: IpNet,
    /// First host address, held by the node side; never handed out.
    pub gateway: IpAddr,
    /// First address that may be handed out (gateway + 1), as a number.
    pub first: u128,
    /// Last address that may be handed out (before the IPv4 broadcast).
    pub last: u128,
}

impl PoolRange {
    fn new(pool: &str, cidr: IpNet) -> Result<Self, PoolConfigError> {
        if cidr.trunc() != cidr {
            return Err(PoolConfigError::NotNetwork {
                pool: pool.into(),
                cidr,
                network: cidr.trunc(),
            });
        }
        let network = to_u128(&cidr.network());
        let end = to_u128(&cidr.broadcast());
        // IPv4 loses the broadcast address; IPv6 has none.
        let last = match cidr {
            IpNet::V4(_) => end.saturating_sub(1),
            IpNet::V6(_) => end,
        };
        let first = network + 2;
        if cidr.prefix_len() >= cidr.max_prefix_len() || first > last {
            return Err(PoolConfigError::TooSmall {
                pool: pool.into(),
                cidr,
            });
        }
        Ok(Self {
            pool: pool.into(),
            cidr,
            gateway: from_u128(Family::of(&cidr.network()), network + 1),
            first,
            last,
        })
    }

    /// The range's family.
    pub fn family(&self) -> Family {
        Family::of(&self.cidr.network())
    }

    /// How many addresses can be handed out.
    pub fn size(&self) -> u128 {
        self.last - self.first + 1
    }

    /// Whether `addr` lies in this range's CIDR (usable or not).
    pub fn contains(&self, addr: &IpAddr) -> bool {
        self.cidr.contains(addr)
    }

    /// Whether `addr` may be handed out (in the CIDR and not reserved).
    pub fn is_usable(&self, addr: &IpAddr) -> bool {
        let n = to_u128(addr);
        self.contains(addr) && n >= self.first && n <= self.last
    }

    /// The address at `offset` from the first usable one.
    pub fn address_at(&self, offset: u128) -> IpAddr {
        from_u128(self.family(), self.first + offset)
    }

    /// Offset of a usable `addr` from the first usable address.
    pub fn offset_of(&self, addr: &IpAddr) -> u128 {
        to_u128(addr) - self.first
    }
}

/// Every pool's ranges, validated together (no overlap anywhere). May be
/// empty: a node in cluster-pool IPAM waits for its pod CIDRs (SetPool).
#[derive(Debug, Clone, Default)]
pub struct PoolSet {
    ranges: Vec<PoolRange>,
    names: Vec<String>,
    /// Per name (same order): where the pool comes from.
    sources: Vec<PoolSource>,
}

impl PoolSet {
    /// Validates `specs` (the `--pool` flags) and returns the pools;
    /// refuses duplicate, too small, misaligned and overlapping ranges.
    ///
    /// ```
    /// use svc_ipam::pool::PoolSet;
    /// let err = PoolSet::new(&["a=198.18.0.0/24".parse().unwrap(), "b=198.18.0.128/25".parse().unwrap()])
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("overlaps"));
    /// ```
    pub fn new(specs: &[PoolSpec]) -> Result<Self, PoolConfigError> {
        Self::build(specs.iter().map(|s| (s, PoolSource::Flag)))
    }

    fn build<'a>(specs: impl IntoIterator<Item = (&'a PoolSpec, PoolSource)>) -> Result<Self, PoolConfigError> {
        let mut sources = Vec::new();
        let mut ranges: Vec<PoolRange> = Vec::new();
        let mut names: Vec<String> = Vec::new();
        for (spec, source) in specs {
            if names.contains(&spec.name) {
                return Err(PoolConfigError::DuplicateName {
                    name: spec.name.clone(),
                });
            }
            names.push(spec.name.clone());
            sources.push(source);
            for cidr in &spec.cidrs {
                let range = PoolRange::new(&spec.name, *cidr)?;
                if let Some(other) = ranges
                    .iter()
                    .find(|r| r.cidr.contains(&range.cidr.network()) || range.cidr.contains(&r.cidr.network()))
                {
                    return Err(PoolConfigError::Overlap {
                        pool: spec.name.clone(),
                        cidr: *cidr,
                        other_pool: other.pool.clone(),
                        other: other.cidr,
                    });
                }
                ranges.push(range);
            }
        }
        Ok(Self { ranges, names, sources })
    }

    /// These pools with `spec` replacing (or adding) its pool, as SetPool
    /// sets it; validated together like the flags.
    pub fn with_pool(&self, spec: &PoolSpec) -> Result<Self, PoolConfigError> {
        let mut specs: Vec<(PoolSpec, PoolSource)> = self
            .names
            .iter()
            .zip(&self.sources)
            .map(|(name, source)| match name == &spec.name {
                true => (spec.clone(), PoolSource::SetPool),
                false => (
                    PoolSpec {
                        name: name.clone(),
                        cidrs: self.cidrs(name),
                    },
                    *source,
                ),
            })
            .collect();
        if !self.has_pool(&spec.name) {
            specs.push((spec.clone(), PoolSource::SetPool));
        }
        Self::build(specs.iter().map(|(s, source)| (s, *source)))
    }

    /// Where pool `name` comes from; `None` when there is no such pool.
    pub fn source(&self, name: &str) -> Option<PoolSource> {
        let i = self.names.iter().position(|n| n == name)?;
        Some(self.sources[i])
    }

    /// The CIDRs of pool `name`, in configuration order.
    pub fn cidrs(&self, name: &str) -> Vec<IpNet> {
        self.ranges.iter().filter(|r| r.pool == name).map(|r| r.cidr).collect()
    }

    /// Whether there is no pool at all.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// All ranges in configuration order.
    pub fn ranges(&self) -> &[PoolRange] {
        &self.ranges
    }

    /// Pool names in configuration order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Whether a pool of this name exists.
    pub fn has_pool(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// Indices of `pool`'s ranges of `family`.
    pub fn range_indices<'a>(&'a self, pool: &'a str, family: Family) -> impl Iterator<Item = usize> + 'a {
        self.ranges
            .iter()
            .enumerate()
            .filter(move |(_, r)| r.pool == pool && r.family() == family)
            .map(|(i, _)| i)
    }

    /// The range of `pool` whose CIDR contains `addr`.
    pub fn range_of(&self, pool: &str, addr: &IpAddr) -> Option<usize> {
        self.ranges.iter().position(|r| r.pool == pool && r.contains(addr))
    }

    /// The range of any pool whose CIDR contains `addr`.
    pub fn any_range_of(&self, addr: &IpAddr) -> Option<usize> {
        self.ranges.iter().position(|r| r.contains(addr))
    }
}

/// `addr` as a number (IPv4 in the low 32 bits).
pub fn to_u128(addr: &IpAddr) -> u128 {
    match addr {
        IpAddr::V4(a) => u32::from(*a) as u128,
        IpAddr::V6(a) => u128::from(*a),
    }
}

fn from_u128(family: Family, n: u128) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4((n as u32).into()),
        Family::V6 => IpAddr::V6(n.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(specs: &[&str]) -> Result<PoolSet, PoolConfigError> {
        PoolSet::new(&specs.iter().map(|s| s.parse().unwrap()).collect::<Vec<_>>())
    }

    #[test]
    fn reserved_addresses_are_excluded() {
        let s = set(&["default=198.18.0.0/29,2001:2::/125"]).unwrap();
        let v4 = &s.ranges()[0];
        assert_eq!(v4.gateway.to_string(), "198.18.0.1");
        assert_eq!(
            v4.address_at(0).to_string(),
            "198.18.0.2",
            "network and gateway are never handed out"
        );
        assert_eq!(v4.size(), 5, "a /29 has 8 addresses minus network, gateway, broadcast");
        assert!(!v4.is_usable(&"198.18.0.7".parse().unwrap()), "broadcast is reserved");
        let v6 = &s.ranges()[1];
        assert_eq!(v6.gateway.to_string(), "2001:2::1");
        assert_eq!(v6.size(), 6, "IPv6 has no broadcast: 8 minus network and gateway");
    }

    #[test]
    fn too_small_misaligned_and_bad_specs_are_refused() {
        assert!(matches!(
            set(&["a=198.18.0.0/31"]),
            Err(PoolConfigError::TooSmall { .. })
        ));
        assert!(matches!(
            set(&["a=198.18.0.0/32"]),
            Err(PoolConfigError::TooSmall { .. })
        ));
        assert!(matches!(
            set(&["a=2001:2::/127"]),
            Err(PoolConfigError::TooSmall { .. })
        ));
        assert!(set(&["a=198.18.0.0/30"]).is_ok(), "a /30 leaves one pod address");
        let err = set(&["a=198.18.0.5/24"]).unwrap_err();
        assert!(err.to_string().contains("did you mean 198.18.0.0/24"), "{err}");
        assert!(matches!("a".parse::<PoolSpec>(), Err(PoolConfigError::Syntax { .. })));
        assert!(matches!(
            "A_b=198.18.0.0/24".parse::<PoolSpec>(),
            Err(PoolConfigError::Name { .. })
        ));
        assert!(matches!(
            "a=198.18.0.0/33".parse::<PoolSpec>(),
            Err(PoolConfigError::Cidr { .. })
        ));
        assert!(
            set(&[]).unwrap().is_empty(),
            "no pool yet is a valid start (cluster-pool IPAM)"
        );
        assert!(matches!(
            PoolSpec::new("a", vec![]),
            Err(PoolConfigError::NoCidr { .. })
        ));
        assert!(matches!(
            PoolSpec::new("Bad", vec!["198.18.0.0/24".parse().unwrap()]),
            Err(PoolConfigError::Name { .. })
        ));
        assert!(matches!(
            set(&["a=198.18.0.0/24", "a=198.18.1.0/24"]),
            Err(PoolConfigError::DuplicateName { .. })
        ));
    }

    #[test]
    fn overlapping_ranges_are_refused_in_either_order() {
        for specs in [
            ["a=198.18.0.0/24", "b=198.18.0.128/25"],
            ["a=198.18.0.128/25", "b=198.18.0.0/16"],
        ] {
            let err = set(&specs).unwrap_err();
            assert!(matches!(err, PoolConfigError::Overlap { .. }), "{err}");
        }
        assert!(
            set(&["a=198.18.0.0/25", "b=198.18.0.128/25"]).is_ok(),
            "adjacent ranges do not overlap"
        );
    }

    #[test]
    fn with_pool_replaces_or_adds_and_checks_against_the_others() {
        let flags = set(&["extra=198.18.9.0/24"]).unwrap();
        let spec = |s: &str| s.parse::<PoolSpec>().unwrap();
        let added = flags.with_pool(&spec("default=198.18.0.0/24,2001:2::/112")).unwrap();
        assert_eq!(added.names(), ["extra", "default"]);
        assert_eq!(added.source("extra"), Some(PoolSource::Flag));
        assert_eq!(added.source("default"), Some(PoolSource::SetPool));
        let replaced = added.with_pool(&spec("default=198.18.4.0/24")).unwrap();
        assert_eq!(replaced.cidrs("default"), ["198.18.4.0/24".parse::<IpNet>().unwrap()]);
        assert_eq!(replaced.cidrs("extra"), flags.cidrs("extra"), "other pools are kept");
        assert!(matches!(
            added.with_pool(&spec("default=198.18.9.128/25")),
            Err(PoolConfigError::Overlap { .. })
        ));
        assert!(
            added.with_pool(&spec("default=198.18.0.128/25")).is_ok(),
            "a pool's new ranges may overlap its own old ones"
        );
        assert!(matches!(
            added.with_pool(&spec("default=198.18.0.1/24")),
            Err(PoolConfigError::NotNetwork { .. })
        ));
    }
}
