//! The cluster pool's allocator: pure logic, no I/O. It knows which blocks
//! of the cluster CIDRs every holder (a RivetNode, by name) holds and hands
//! out the lowest free block of a family. The duty feeds it from the API
//! objects (a term rebuilds it from a fresh list), so it is never the
//! source of truth, only an index over it.
//!
//! ```
//! use rivet_operator::cluster_pool::allocator::{Allocator, Family, PoolConfig};
//!
//! let config = PoolConfig::new(&["198.18.0.0/23".parse()?], 24, &[], 120)?;
//! let mut pool = Allocator::new(&config);
//! pool.set_held("node-a", vec!["198.18.0.0/24".parse()?]);
//! assert_eq!(pool.allocate("node-b", Family::V4)?.to_string(), "198.18.1.0/24");
//! assert!(pool.allocate("node-c", Family::V4).is_err(), "two blocks, both held");
//! pool.release("node-a");
//! assert_eq!(pool.allocate("node-c", Family::V4)?.to_string(), "198.18.0.0/24");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// At most 2^16 blocks per cluster CIDR, like the seed's cidrset (a per-node
/// mask more than 16 bits longer than the cluster CIDR is refused): every
/// block has a counter, and the lowest free one is found by a scan.
pub const MAX_BLOCK_BITS: u8 = 16;

/// An address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl Family {
    /// The family of `net`.
    pub fn of(net: &IpNet) -> Self {
        match net {
            IpNet::V4(_) => Self::V4,
            IpNet::V6(_) => Self::V6,
        }
    }

    /// `ipv4` or `ipv6` (a metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V4 => "ipv4",
            Self::V6 => "ipv6",
        }
    }

    fn bits(self) -> u8 {
        match self {
            Self::V4 => 32,
            Self::V6 => 128,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a pool configuration is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolConfigError {
    /// A CIDR of the other family in a family's list.
    #[error("cluster CIDR {cidr} is not {family}: give it to --cluster-pool-{other}-cidr")]
    WrongFamily {
        /// The CIDR.
        cidr: IpNet,
        /// The family of the list.
        family: Family,
        /// The CIDR's family.
        other: Family,
    },
    /// Host bits set (`198.18.0.1/16`).
    #[error("cluster CIDR {cidr} has host bits set: did you mean {network}?")]
    HostBits {
        /// The CIDR.
        cidr: IpNet,
        /// The network it is in.
        network: IpNet,
    },
    /// The per-node mask is longer than the family's addresses.
    #[error("--cluster-pool-{family}-mask-size {mask} is longer than an {family} address ({bits} bits)")]
    MaskTooLong {
        /// The family.
        family: Family,
        /// The mask size.
        mask: u8,
        /// The address length.
        bits: u8,
    },
    /// The per-node mask is shorter than a cluster CIDR's prefix.
    #[error(
        "--cluster-pool-{family}-mask-size {mask} is shorter than cluster CIDR {cidr}: a node block must fit in it"
    )]
    MaskShorterThanCidr {
        /// The family.
        family: Family,
        /// The mask size.
        mask: u8,
        /// The CIDR.
        cidr: IpNet,
    },
    /// Too many blocks to index.
    #[error(
        "cluster CIDR {cidr} holds 2^{bits} blocks of /{mask}, more than the 2^{MAX_BLOCK_BITS} the allocator indexes: use a longer CIDR prefix or a shorter mask (at most {max_mask})",
        max_mask = cidr.prefix_len() + MAX_BLOCK_BITS
    )]
    TooManyBlocks {
        /// The CIDR.
        cidr: IpNet,
        /// The mask size.
        mask: u8,
        /// `mask - prefix`.
        bits: u8,
    },
    /// Two cluster CIDRs overlap.
    #[error("cluster CIDRs {a} and {b} overlap: a block would be handed out twice")]
    Overlap {
        /// One CIDR.
        a: IpNet,
        /// The other.
        b: IpNet,
    },
}

/// The cluster CIDRs and per-node mask of one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyConfig {
    /// The family.
    pub family: Family,
    /// Its cluster CIDRs, allocated from in this order.
    pub cidrs: Vec<IpNet>,
    /// The prefix length of each node's block.
    pub mask: u8,
}

/// The validated pool configuration: a family without cluster CIDRs is not
/// allocated.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolConfig {
    families: Vec<FamilyConfig>,
}

impl PoolConfig {
    /// Validates the cluster CIDRs and mask sizes of both families.
    ///
    /// # Errors
    /// A CIDR of the wrong family or with host bits, a mask longer than the
    /// address or shorter than a CIDR, more than 2^[`MAX_BLOCK_BITS`] blocks
    /// in a CIDR, or two overlapping CIDRs.
    pub fn new(ipv4: &[IpNet], ipv4_mask: u8, ipv6: &[IpNet], ipv6_mask: u8) -> Result<Self, PoolConfigError> {
        let mut families = Vec::new();
        for (family, cidrs, mask) in [(Family::V4, ipv4, ipv4_mask), (Family::V6, ipv6, ipv6_mask)] {
            if cidrs.is_empty() {
                continue;
            }
            if mask > family.bits() {
                return Err(PoolConfigError::MaskTooLong {
                    family,
                    mask,
                    bits: family.bits(),
                });
            }
            for (i, cidr) in cidrs.iter().enumerate() {
                let other = Family::of(cidr);
                if other != family {
                    return Err(PoolConfigError::WrongFamily {
                        cidr: *cidr,
                        family,
                        other,
                    });
                }
                if cidr.trunc() != *cidr {
                    return Err(PoolConfigError::HostBits {
                        cidr: *cidr,
                        network: cidr.trunc(),
                    });
                }
                if mask < cidr.prefix_len() {
                    return Err(PoolConfigError::MaskShorterThanCidr {
                        family,
                        mask,
                        cidr: *cidr,
                    });
                }
                let bits = mask - cidr.prefix_len();
                if bits > MAX_BLOCK_BITS {
                    return Err(PoolConfigError::TooManyBlocks {
                        cidr: *cidr,
                        mask,
                        bits,
                    });
                }
                if let Some(b) = cidrs[..i].iter().find(|b| overlap(b, cidr)) {
                    return Err(PoolConfigError::Overlap { a: *b, b: *cidr });
                }
            }
            families.push(FamilyConfig {
                family,
                cidrs: cidrs.to_vec(),
                mask,
            });
        }
        Ok(Self { families })
    }

    /// The configured families (none: the pool allocates nothing).
    pub fn families(&self) -> &[FamilyConfig] {
        &self.families
    }

    /// Whether `family` is allocated.
    pub fn allocates(&self, family: Family) -> bool {
        self.families.iter().any(|f| f.family == family)
    }
}

/// No free block of a family is left.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the {family} cluster pool is exhausted: all {blocks} blocks of /{mask} in {cidrs} are held")]
pub struct Exhausted {
    /// The family.
    pub family: Family,
    /// How many blocks it has.
    pub blocks: u64,
    /// The per-node mask.
    pub mask: u8,
    /// The cluster CIDRs, comma-separated.
    pub cidrs: String,
}

/// The blocks of one family: a holder count per block of each cluster CIDR.
#[derive(Debug, Clone)]
struct FamilyPool {
    config: FamilyConfig,
    /// Per cluster CIDR, per block: how many holders' CIDRs overlap it.
    counts: Vec<Vec<u32>>,
    /// Blocks with a non-zero count.
    used: u64,
}

impl FamilyPool {
    fn new(config: &FamilyConfig) -> Self {
        let counts = config
            .cidrs
            .iter()
            .map(|c| vec![0; 1usize << (config.mask - c.prefix_len())])
            .collect();
        Self {
            config: config.clone(),
            counts,
            used: 0,
        }
    }

    fn total(&self) -> u64 {
        self.counts.iter().map(|c| c.len() as u64).sum()
    }

    /// Adds `delta` (+1 or -1) to every block `net` overlaps.
    fn count(&mut self, net: &IpNet, delta: i32) {
        let host_bits = u32::from(self.config.family.bits() - self.config.mask);
        let (start, end) = bounds(net);
        for (cidr, counts) in self.config.cidrs.iter().zip(&mut self.counts) {
            let (c_start, c_end) = bounds(cidr);
            if start > c_end || end < c_start {
                continue;
            }
            let first = ((start.max(c_start) - c_start) >> host_bits) as usize;
            let last = ((end.min(c_end) - c_start) >> host_bits) as usize;
            for count in &mut counts[first..=last] {
                let before = *count;
                *count = count.saturating_add_signed(delta);
                match (before, *count) {
                    (0, 1..) => self.used += 1,
                    (1.., 0) => self.used -= 1,
                    _ => {}
                }
            }
        }
    }

    /// The lowest free block, in configuration order of the cluster CIDRs.
    fn lowest_free(&self) -> Option<IpNet> {
        let host_bits = u32::from(self.config.family.bits() - self.config.mask);
        self.config.cidrs.iter().zip(&self.counts).find_map(|(cidr, counts)| {
            let index = counts.iter().position(|&c| c == 0)?;
            let (start, _) = bounds(cidr);
            Some(net_at(
                self.config.family,
                start + ((index as u128) << host_bits),
                self.config.mask,
            ))
        })
    }
}

/// Which holder holds which CIDRs, and the blocks they cover.
#[derive(Debug, Clone)]
pub struct Allocator {
    families: Vec<FamilyPool>,
    holders: HashMap<String, Vec<IpNet>>,
}

impl Allocator {
    /// An allocator with nothing held.
    pub fn new(config: &PoolConfig) -> Self {
        Self {
            families: config.families.iter().map(FamilyPool::new).collect(),
            holders: HashMap::new(),
        }
    }

    /// Records that `holder` holds exactly `cidrs` (replacing what it held),
    /// in or out of the cluster CIDRs.
    pub fn set_held(&mut self, holder: &str, cidrs: Vec<IpNet>) {
        let old = self.holders.remove(holder).unwrap_or_default();
        if old == cidrs {
            self.holders.insert(holder.to_string(), cidrs);
            return;
        }
        self.count_all(&old, -1);
        self.count_all(&cidrs, 1);
        if !cidrs.is_empty() {
            self.holders.insert(holder.to_string(), cidrs);
        }
    }

    /// `holder` is gone; returns what it held (now free unless someone
    /// else overlaps it).
    pub fn release(&mut self, holder: &str) -> Vec<IpNet> {
        let old = self.holders.remove(holder).unwrap_or_default();
        self.count_all(&old, -1);
        old
    }

    /// What `holder` holds.
    pub fn held(&self, holder: &str) -> &[IpNet] {
        self.holders.get(holder).map_or(&[], Vec::as_slice)
    }

    /// The configured families `holder` holds no CIDR of (any CIDR of the
    /// family counts, also one outside the cluster CIDRs).
    pub fn missing(&self, holder: &str) -> Vec<Family> {
        let held = self.held(holder);
        self.families
            .iter()
            .map(|f| f.config.family)
            .filter(|&family| !held.iter().any(|n| Family::of(n) == family))
            .collect()
    }

    /// Hands `holder` the lowest free block of `family` and records it.
    ///
    /// # Errors
    /// [`Exhausted`] when every block is held (or the family is not
    /// configured: then it has no blocks).
    pub fn allocate(&mut self, holder: &str, family: Family) -> Result<IpNet, Exhausted> {
        let exhausted = || {
            let pool = self.families.iter().find(|f| f.config.family == family);
            Exhausted {
                family,
                blocks: pool.map_or(0, FamilyPool::total),
                mask: pool.map_or(0, |p| p.config.mask),
                cidrs: pool.map_or(String::new(), |p| {
                    p.config
                        .cidrs
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                }),
            }
        };
        let free = self.families.iter().find(|f| f.config.family == family);
        let Some(block) = free.and_then(FamilyPool::lowest_free) else {
            return Err(exhausted());
        };
        let mut held = self.held(holder).to_vec();
        held.push(block);
        self.set_held(holder, held);
        Ok(block)
    }

    /// Blocks of `family` held (in whole or part) and free.
    pub fn usage(&self, family: Family) -> (u64, u64) {
        self.families
            .iter()
            .find(|f| f.config.family == family)
            .map_or((0, 0), |p| (p.used, p.total() - p.used))
    }

    /// The other holders whose CIDRs overlap one of `holder`'s, with the
    /// overlapping pair (`holder`'s CIDR first). A scan over every holder:
    /// overlaps exist only by hand or from node-pool mode.
    pub fn overlaps(&self, holder: &str) -> Vec<(String, IpNet, IpNet)> {
        let mine = self.held(holder);
        let mut found: Vec<(String, IpNet, IpNet)> = self
            .holders
            .iter()
            .filter(|(other, _)| other.as_str() != holder)
            .flat_map(|(other, theirs)| {
                mine.iter().flat_map(move |a| {
                    theirs
                        .iter()
                        .filter(move |b| overlap(a, b))
                        .map(move |b| (other.clone(), *a, *b))
                })
            })
            .collect();
        found.sort();
        found
    }

    /// The holders of CIDRs that overlap `net`.
    pub fn holders_of(&self, net: &IpNet) -> Vec<&str> {
        let mut found: Vec<&str> = self
            .holders
            .iter()
            .filter(|(_, held)| held.iter().any(|h| overlap(h, net)))
            .map(|(name, _)| name.as_str())
            .collect();
        found.sort();
        found
    }

    fn count_all(&mut self, cidrs: &[IpNet], delta: i32) {
        for net in cidrs {
            if let Some(pool) = self.families.iter_mut().find(|f| f.config.family == Family::of(net)) {
                pool.count(net, delta);
            }
        }
    }
}

/// Whether two prefixes share an address (prefixes are nested or disjoint).
pub fn overlap(a: &IpNet, b: &IpNet) -> bool {
    Family::of(a) == Family::of(b) && (a.contains(b) || b.contains(a))
}

/// The first and last address of `net`, as integers.
fn bounds(net: &IpNet) -> (u128, u128) {
    match net {
        IpNet::V4(n) => (u128::from(u32::from(n.network())), u128::from(u32::from(n.broadcast()))),
        IpNet::V6(n) => (u128::from(n.network()), u128::from(n.broadcast())),
    }
}

fn net_at(family: Family, start: u128, prefix: u8) -> IpNet {
    let addr = match family {
        // The block lies inside an IPv4 cluster CIDR, so it fits in 32 bits.
        Family::V4 => IpAddr::V4(Ipv4Addr::from(start as u32)),
        Family::V6 => IpAddr::V6(Ipv6Addr::from(start)),
    };
    match addr {
        IpAddr::V4(a) => IpNet::V4(Ipv4Net::new(a, prefix).expect("mask validated against the family")),
        IpAddr::V6(a) => IpNet::V6(Ipv6Net::new(a, prefix).expect("mask validated against the family")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|s| net(s)).collect()
    }

    fn dual() -> PoolConfig {
        PoolConfig::new(&nets(&["198.18.0.0/22"]), 24, &nets(&["2001:2::/104"]), 120).unwrap()
    }

    #[test]
    fn allocates_the_lowest_free_block_and_never_one_twice() {
        let mut pool = Allocator::new(&dual());
        let mut seen = std::collections::HashSet::new();
        for i in 0..4 {
            let block = pool.allocate(&format!("n{i}"), Family::V4).unwrap();
            assert_eq!(block, net(&format!("198.18.{i}.0/24")), "lowest free first");
            assert!(seen.insert(block));
        }
        let err = pool.allocate("n4", Family::V4).unwrap_err();
        assert_eq!(err.blocks, 4);
        assert!(err.to_string().contains("198.18.0.0/22"), "{err}");
        assert_eq!(pool.usage(Family::V4), (4, 0));
        // Release the second: the next allocation gets exactly that block.
        assert_eq!(pool.release("n1"), vec![net("198.18.1.0/24")]);
        assert_eq!(pool.usage(Family::V4), (3, 1));
        assert_eq!(pool.allocate("n4", Family::V4).unwrap(), net("198.18.1.0/24"));
    }

    #[test]
    fn ipv6_blocks_of_120_out_of_a_104() {
        let mut pool = Allocator::new(&dual());
        assert_eq!(pool.usage(Family::V6), (0, 1 << 16));
        assert_eq!(pool.allocate("a", Family::V6).unwrap(), net("2001:2::/120"));
        assert_eq!(pool.allocate("b", Family::V6).unwrap(), net("2001:2::100/120"));
        pool.set_held("c", nets(&["2001:2::200/120", "2001:2::300/120"]));
        assert_eq!(pool.allocate("d", Family::V6).unwrap(), net("2001:2::400/120"));
        assert_eq!(pool.usage(Family::V6), (5, (1 << 16) - 5));
    }

    #[test]
    fn rebuild_respects_every_held_cidr_in_or_out_of_the_pool() {
        let mut pool = Allocator::new(&dual());
        // A node-pool node inside the cluster CIDR (a /25 takes its whole
        // block), one holding two blocks with a /23, one outside.
        pool.set_held("small", nets(&["198.18.0.128/25"]));
        pool.set_held("wide", nets(&["198.18.2.0/23"]));
        pool.set_held("outside", nets(&["10.0.0.0/24", "2001:2::/120"]));
        assert_eq!(pool.usage(Family::V4), (3, 1));
        assert_eq!(pool.missing("small"), vec![Family::V6]);
        assert!(pool.missing("outside").is_empty());
        assert_eq!(pool.allocate("new", Family::V4).unwrap(), net("198.18.1.0/24"));
        assert!(pool.allocate("newer", Family::V4).is_err());
        assert_eq!(pool.allocate("new", Family::V6).unwrap(), net("2001:2::100/120"));
        assert_eq!(pool.held("new"), nets(&["198.18.1.0/24", "2001:2::100/120"]).as_slice());
    }

    #[test]
    fn overlapping_holders_are_found_and_a_block_frees_only_when_both_let_go() {
        let mut pool = Allocator::new(&dual());
        pool.set_held("a", nets(&["198.18.0.0/24"]));
        pool.set_held("b", nets(&["198.18.0.64/26", "2001:2::/120"]));
        pool.set_held("c", nets(&["198.18.1.0/24"]));
        assert_eq!(
            pool.overlaps("b"),
            vec![("a".to_string(), net("198.18.0.64/26"), net("198.18.0.0/24"))]
        );
        assert!(pool.overlaps("c").is_empty());
        assert_eq!(pool.holders_of(&net("198.18.0.0/23")), vec!["a", "b", "c"]);
        pool.release("a");
        assert_eq!(pool.usage(Family::V4), (2, 2), "b still covers block 0");
        assert_eq!(pool.allocate("d", Family::V4).unwrap(), net("198.18.2.0/24"));
        pool.set_held("b", nets(&["2001:2::/120"]));
        assert_eq!(pool.allocate("e", Family::V4).unwrap(), net("198.18.0.0/24"));
    }

    #[test]
    fn set_held_replaces_and_is_idempotent() {
        let mut pool = Allocator::new(&dual());
        pool.set_held("a", nets(&["198.18.0.0/24"]));
        pool.set_held("a", nets(&["198.18.0.0/24"]));
        assert_eq!(pool.usage(Family::V4), (1, 3));
        pool.set_held("a", nets(&["198.18.3.0/24"]));
        assert_eq!(pool.usage(Family::V4), (1, 3));
        assert_eq!(pool.allocate("b", Family::V4).unwrap(), net("198.18.0.0/24"));
        pool.set_held("a", vec![]);
        assert!(pool.held("a").is_empty());
        assert_eq!(pool.usage(Family::V4), (1, 3));
    }

    #[test]
    fn several_cluster_cidrs_are_used_in_order() {
        let config = PoolConfig::new(&nets(&["198.19.0.0/24", "198.18.0.0/24"]), 25, &[], 120).unwrap();
        let mut pool = Allocator::new(&config);
        let got: Vec<IpNet> = (0..4)
            .map(|i| pool.allocate(&i.to_string(), Family::V4).unwrap())
            .collect();
        assert_eq!(
            got,
            nets(&["198.19.0.0/25", "198.19.0.128/25", "198.18.0.0/25", "198.18.0.128/25"])
        );
        assert!(pool.allocate("x", Family::V6).is_err(), "IPv6 not configured");
        assert!(!config.allocates(Family::V6));
    }

    #[test]
    fn an_oracle_over_random_joins_and_leaves_never_hands_a_block_out_twice() {
        let config = PoolConfig::new(&nets(&["198.18.0.0/20"]), 26, &nets(&["2001:2::/112"]), 120).unwrap();
        let mut pool = Allocator::new(&config);
        let mut live: HashMap<String, Vec<IpNet>> = HashMap::new();
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for step in 0..5000 {
            let name = format!("n{}", next() % 400);
            if live.contains_key(&name) && next() % 2 == 0 {
                assert_eq!(pool.release(&name), live.remove(&name).unwrap());
                continue;
            }
            for family in pool.missing(&name) {
                match pool.allocate(&name, family) {
                    Ok(block) => {
                        let clash = live.values().flatten().find(|b| overlap(b, &block));
                        assert!(clash.is_none(), "step {step}: {block} handed out twice");
                        live.entry(name.clone()).or_default().push(block);
                    }
                    Err(_) => {
                        let held = live.values().flatten().filter(|b| Family::of(b) == family).count() as u64;
                        assert_eq!(held, pool.usage(family).0, "exhausted only when every block is held");
                        assert_eq!(pool.usage(family).1, 0);
                    }
                }
            }
        }
        for family in [Family::V4, Family::V6] {
            let held = live.values().flatten().filter(|b| Family::of(b) == family).count() as u64;
            assert_eq!(pool.usage(family).0, held);
        }
    }

    #[test]
    fn config_errors_say_what_is_wrong() {
        let err = |v4: &[&str], m4, v6: &[&str], m6| PoolConfig::new(&nets(v4), m4, &nets(v6), m6).unwrap_err();
        assert!(matches!(
            err(&["2001:2::/64"], 24, &[], 120),
            PoolConfigError::WrongFamily { .. }
        ));
        assert!(matches!(
            err(&["198.18.0.1/16"], 24, &[], 120),
            PoolConfigError::HostBits { .. }
        ));
        assert!(matches!(
            err(&["198.18.0.0/16"], 33, &[], 120),
            PoolConfigError::MaskTooLong { .. }
        ));
        assert!(matches!(
            err(&["198.18.0.0/24"], 16, &[], 120),
            PoolConfigError::MaskShorterThanCidr { .. }
        ));
        let too_many = err(&[], 24, &["2001:2::/64"], 120);
        assert!(matches!(too_many, PoolConfigError::TooManyBlocks { bits: 56, .. }));
        assert!(too_many.to_string().contains("at most 80"), "{too_many}");
        assert!(matches!(
            err(&["198.18.0.0/16", "198.18.4.0/22"], 24, &[], 120),
            PoolConfigError::Overlap { .. }
        ));
        // The seed's defaults over the issue's example ranges are fine.
        PoolConfig::new(&nets(&["198.18.0.0/15"]), 24, &nets(&["2001:2::/104"]), 120).unwrap();
        assert!(PoolConfig::new(&[], 24, &[], 120).unwrap().families().is_empty());
    }
}
