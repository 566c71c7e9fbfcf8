//! The allocation rules, in memory and free of I/O: which address an owner
//! gets, idempotency, release, restore, and the checks applied to state loaded
//! from disk. [`crate::store::IpamStore`] makes every change durable.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::pool::{Family, PoolConfigError, PoolSet, PoolSource, PoolSpec};

/// Who holds an address: one interface of one container.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Owner {
    /// Container (sandbox) id.
    pub container_id: String,
    /// Interface name inside the container.
    pub interface: String,
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.container_id, self.interface)
    }
}

/// One held address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// Pool it was allocated from.
    pub pool: String,
    /// The address.
    pub address: IpAddr,
    /// Its holder.
    pub owner: Owner,
}

impl Allocation {
    /// The address family.
    pub fn family(&self) -> Family {
        Family::of(&self.address)
    }
}

/// Why an operation was refused. Each variant names what it refers to.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum AllocError {
    /// There is no pool at all yet (cluster-pool IPAM before SetPool).
    #[error("no pool yet: waiting for the node's pod CIDRs (SetPool, from svc-k8s-sync)")]
    NoPoolYet,
    /// SetPool: the ranges are invalid or overlap another pool.
    #[error(transparent)]
    PoolConfig(#[from] PoolConfigError),
    /// SetPool: the pool comes from the `--pool` flag.
    #[error("pool {pool} is set by svc-ipam's --pool flag and cannot be changed by SetPool")]
    PoolFixedByFlag {
        /// Pool.
        pool: String,
    },
    /// SetPool: allocated addresses would not be usable in the new ranges.
    #[error(
        "pool {pool} keeps its ranges: {count} allocated address(es) would not be usable in {new_cidrs} (e.g. {} of {}); release them first",
        example.address, example.owner
    )]
    PoolChangeStrandsAllocations {
        /// Pool.
        pool: String,
        /// The ranges asked for, comma-separated.
        new_cidrs: String,
        /// How many allocations would be stranded.
        count: usize,
        /// One of them.
        example: Box<Allocation>,
    },
    /// No pool of that name.
    #[error("pool {pool:?} does not exist")]
    UnknownPool {
        /// The pool named.
        pool: String,
    },
    /// The pool has no range of that family.
    #[error("pool {pool} has no {family} range")]
    NoRangeForFamily {
        /// Pool.
        pool: String,
        /// Family asked for.
        family: Family,
    },
    /// Every address of the family is taken.
    #[error("pool {pool} is exhausted: all {size} {family} addresses are allocated")]
    Exhausted {
        /// Pool.
        pool: String,
        /// Family.
        family: Family,
        /// Usable addresses in the pool's ranges of that family.
        size: u128,
    },
    /// The address is outside the pool or reserved.
    #[error(
        "{address} is not a usable address of pool {pool} (outside its ranges, or its network, gateway or broadcast address)"
    )]
    NotUsable {
        /// Pool.
        pool: String,
        /// The address.
        address: IpAddr,
    },
    /// Someone else holds the address.
    #[error("{address} is held by {holder}")]
    HeldByOther {
        /// The address.
        address: IpAddr,
        /// Its holder.
        holder: Owner,
    },
    /// The owner already holds another address of that pool and family.
    #[error("{owner} already holds {held} in pool {pool}; release it first")]
    OwnerHoldsOther {
        /// The owner.
        owner: Owner,
        /// Pool.
        pool: String,
        /// The address it holds.
        held: IpAddr,
    },
    /// The address belongs to another pool than the one named.
    #[error("{address} is allocated from pool {actual}, not {pool}")]
    WrongPool {
        /// The address.
        address: IpAddr,
        /// Pool named in the request.
        pool: String,
        /// Pool it belongs to.
        actual: String,
    },
}

/// A problem found in loaded state, resolved without handing out an address twice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inconsistency {
    /// Two records for one address: the first is kept.
    DuplicateAddress {
        /// The address.
        address: IpAddr,
        /// The holder kept.
        kept: Owner,
        /// The holder dropped.
        dropped: Owner,
    },
    /// The address is outside every range of its pool (the pool was removed
    /// or shrunk). Kept reserved until its owner releases it.
    Orphaned {
        /// The allocation.
        allocation: Allocation,
    },
    /// The address is the network, gateway or broadcast address of its range.
    /// Kept reserved until released.
    ReservedAddress {
        /// The allocation.
        allocation: Allocation,
    },
    /// One owner holds several addresses of one pool and family; all are kept.
    OwnerHoldsSeveral {
        /// The owner.
        owner: Owner,
        /// Pool.
        pool: String,
        /// Family.
        family: Family,
    },
    /// A pool set by SetPool before the restart could not be restored (a
    /// `--pool` flag now defines that name, or its ranges overlap a flag's);
    /// its allocations are orphaned, kept reserved until released.
    SetPoolDropped {
        /// Pool.
        pool: String,
        /// Why.
        reason: String,
    },
}

impl Inconsistency {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Inconsistency::DuplicateAddress { .. } => "duplicate_address",
            Inconsistency::Orphaned { .. } => "orphaned",
            Inconsistency::ReservedAddress { .. } => "reserved_address",
            Inconsistency::OwnerHoldsSeveral { .. } => "owner_holds_several",
            Inconsistency::SetPoolDropped { .. } => "set_pool_dropped",
        }
    }
}

impl fmt::Display for Inconsistency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Inconsistency::DuplicateAddress { address, kept, dropped } => {
                write!(f, "{address} recorded twice; kept {kept}, dropped {dropped}")
            }
            Inconsistency::Orphaned { allocation: a } => write!(
                f,
                "{} of {} lies outside every range of pool {}; kept reserved until released",
                a.address, a.owner, a.pool
            ),
            Inconsistency::ReservedAddress { allocation: a } => write!(
                f,
                "{} of {} is a reserved address of pool {}; kept until released",
                a.address, a.owner, a.pool
            ),
            Inconsistency::OwnerHoldsSeveral { owner, pool, family } => {
                write!(f, "{owner} holds several {family} addresses of pool {pool}; all kept")
            }
            Inconsistency::SetPoolDropped { pool, reason } => {
                write!(f, "pool {pool} set by SetPool is not restored: {reason}")
            }
        }
    }
}

/// The persisted form of the allocator.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorState {
    /// Every allocation.
    pub allocations: Vec<Allocation>,
    /// Where each range (by CIDR) continues searching, so released addresses
    /// are not reused at once.
    pub cursors: BTreeMap<String, u128>,
    /// The pools set by SetPool (flag pools come from the command line), so
    /// a restarted svc-ipam serves them before anyone sets them again.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub set_pools: BTreeMap<String, Vec<IpNet>>,
}

/// Usage of one range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeUsage {
    /// Index into [`PoolSet::ranges`].
    pub range: usize,
    /// Usable addresses.
    pub size: u128,
    /// Allocated addresses inside the range.
    pub allocated: u128,
}

/// All allocations of a node, indexed by address and by owner.
#[derive(Debug, Clone)]
pub struct Allocator {
    pools: PoolSet,
    by_address: BTreeMap<IpAddr, Allocation>,
    by_owner: HashMap<Owner, BTreeSet<IpAddr>>,
    /// Per range: next offset to try.
    cursors: Vec<u128>,
    /// Per range: allocated addresses inside it.
    counts: Vec<u128>,
}

impl Allocator {
    /// An empty allocator over `pools`.
    pub fn new(pools: PoolSet) -> Self {
        let n = pools.ranges().len();
        Self {
            pools,
            by_address: BTreeMap::new(),
            by_owner: HashMap::new(),
            cursors: vec![0; n],
            counts: vec![0; n],
        }
    }

    /// Rebuilds an allocator from persisted state over the `--pool` flags'
    /// `pools` plus the pools SetPool set, reporting (and resolving) every
    /// inconsistency. No address ends up with two holders.
    pub fn from_state(mut pools: PoolSet, state: AllocatorState) -> (Self, Vec<Inconsistency>) {
        let mut found = Vec::new();
        for (name, cidrs) in &state.set_pools {
            let restored = match pools.source(name) {
                Some(PoolSource::Flag) => Err("svc-ipam's --pool flag defines it now".to_string()),
                _ => PoolSpec::new(name, cidrs.clone())
                    .and_then(|spec| pools.with_pool(&spec))
                    .map_err(|e| e.to_string()),
            };
            match restored {
                Ok(with) => pools = with,
                Err(reason) => found.push(Inconsistency::SetPoolDropped {
                    pool: name.clone(),
                    reason,
                }),
            }
        }
        let (me, more) = Self::load(pools, state);
        found.extend(more);
        (me, found)
    }

    /// The allocator over `pools` with `state`'s allocations and cursors.
    fn load(pools: PoolSet, state: AllocatorState) -> (Self, Vec<Inconsistency>) {
        let mut me = Self::new(pools);
        let mut found = Vec::new();
        for (i, range) in me.pools.ranges().iter().enumerate() {
            if let Some(c) = state.cursors.get(&range.cidr.to_string()) {
                me.cursors[i] = c % range.size();
            }
        }
        for a in state.allocations {
            if let Some(existing) = me.by_address.get(&a.address) {
                found.push(Inconsistency::DuplicateAddress {
                    address: a.address,
                    kept: existing.owner.clone(),
                    dropped: a.owner,
                });
                continue;
            }
            match me.pools.range_of(&a.pool, &a.address) {
                None => found.push(Inconsistency::Orphaned { allocation: a.clone() }),
                Some(r) if !me.pools.ranges()[r].is_usable(&a.address) => {
                    found.push(Inconsistency::ReservedAddress { allocation: a.clone() })
                }
                Some(_) => {}
            }
            if me.held(&a.owner, &a.pool, a.family()).is_some() {
                found.push(Inconsistency::OwnerHoldsSeveral {
                    owner: a.owner.clone(),
                    pool: a.pool.clone(),
                    family: a.family(),
                });
            }
            me.insert(a);
        }
        (me, found)
    }

    /// The persisted form.
    pub fn state(&self) -> AllocatorState {
        AllocatorState {
            allocations: self.by_address.values().cloned().collect(),
            cursors: self
                .pools
                .ranges()
                .iter()
                .zip(&self.cursors)
                .map(|(r, c)| (r.cidr.to_string(), *c))
                .collect(),
            set_pools: self
                .pools
                .names()
                .iter()
                .filter(|name| self.pools.source(name) == Some(PoolSource::SetPool))
                .map(|name| (name.clone(), self.pools.cidrs(name)))
                .collect(),
        }
    }

    /// Replaces the ranges of pool `name` (creating it) with `cidrs`, as
    /// SetPool asks. Returns whether anything changed: the same ranges in
    /// any order change nothing. Refused, changing nothing, for a `--pool`
    /// pool, invalid or overlapping ranges, and when an address allocated in
    /// the pool would not be usable in the new ranges (outside them, or
    /// their network, gateway or broadcast address). Allocations already
    /// orphaned (outside the old ranges) stay reserved and do not count.
    pub fn set_pool(&mut self, spec: &PoolSpec) -> Result<bool, AllocError> {
        let name = spec.name.as_str();
        if self.pools.source(name) == Some(PoolSource::Flag) {
            return Err(AllocError::PoolFixedByFlag { pool: name.into() });
        }
        let sorted = |mut v: Vec<IpNet>| {
            v.sort();
            v.dedup();
            v
        };
        let pools = self.pools.with_pool(spec)?;
        if self.pools.has_pool(name) && sorted(self.pools.cidrs(name)) == sorted(spec.cidrs.clone()) {
            return Ok(false);
        }
        let mut stranded = self.by_address.values().filter(|a| {
            a.pool == name
                && self.pools.range_of(name, &a.address).is_some()
                && !pools
                    .range_of(name, &a.address)
                    .is_some_and(|r| pools.ranges()[r].is_usable(&a.address))
        });
        if let Some(example) = stranded.next() {
            return Err(AllocError::PoolChangeStrandsAllocations {
                pool: name.into(),
                new_cidrs: spec.cidrs.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
                count: 1 + stranded.count(),
                example: Box::new(example.clone()),
            });
        }
        self.replace_pools(pools);
        Ok(true)
    }

    /// Swaps the pool configuration, keeping every allocation (those
    /// outside every range of their pool stay reserved as orphans) and the
    /// cursors of ranges that stay.
    pub fn replace_pools(&mut self, pools: PoolSet) {
        let state = self.state();
        *self = Self::load(pools, state).0;
    }

    /// The pool configuration.
    pub fn pools(&self) -> &PoolSet {
        &self.pools
    }

    /// The address `owner` holds in `pool` for `family`, if any.
    pub fn held(&self, owner: &Owner, pool: &str, family: Family) -> Option<&Allocation> {
        self.by_owner.get(owner)?.iter().find_map(|addr| {
            let a = &self.by_address[addr];
            (a.pool == pool && a.family() == family).then_some(a)
        })
    }

    /// Allocates an address of `family` from `pool` for `owner`: the address
    /// the owner already holds there, else `requested` when free, else the
    /// next free one. Returns the allocation and whether it is new.
    pub fn allocate(
        &mut self,
        owner: &Owner,
        pool: &str,
        family: Family,
        requested: Option<IpAddr>,
    ) -> Result<(Allocation, bool), AllocError> {
        self.check_pool(pool)?;
        let ranges: Vec<usize> = self.pools.range_indices(pool, family).collect();
        if ranges.is_empty() {
            return Err(AllocError::NoRangeForFamily {
                pool: pool.into(),
                family,
            });
        }
        if let Some(held) = self.held(owner, pool, family) {
            return match requested {
                Some(r) if r != held.address => Err(AllocError::OwnerHoldsOther {
                    owner: owner.clone(),
                    pool: pool.into(),
                    held: held.address,
                }),
                _ => Ok((held.clone(), false)),
            };
        }
        let address = match requested {
            Some(addr) => {
                self.check_claimable(owner, pool, &addr)?;
                addr
            }
            None => self.next_free(pool, family, &ranges)?,
        };
        let allocation = Allocation {
            pool: pool.into(),
            address,
            owner: owner.clone(),
        };
        self.insert(allocation.clone());
        Ok((allocation, true))
    }

    /// Re-reserves `address` for `owner` (after the owner restarted).
    /// Succeeds when it is free or already the owner's.
    pub fn restore(&mut self, owner: &Owner, pool: &str, address: IpAddr) -> Result<(Allocation, bool), AllocError> {
        self.check_pool(pool)?;
        if let Some(a) = self.by_address.get(&address) {
            if a.owner != *owner {
                return Err(AllocError::HeldByOther {
                    address,
                    holder: a.owner.clone(),
                });
            }
            if a.pool != pool {
                return Err(AllocError::WrongPool {
                    address,
                    pool: pool.into(),
                    actual: a.pool.clone(),
                });
            }
            return Ok((a.clone(), false));
        }
        self.allocate(owner, pool, Family::of(&address), Some(address))
    }

    /// Releases everything `owner` holds; returns what was released.
    pub fn release_owner(&mut self, owner: &Owner) -> Vec<Allocation> {
        let Some(addrs) = self.by_owner.remove(owner) else {
            return Vec::new();
        };
        addrs.into_iter().filter_map(|a| self.remove(&a)).collect()
    }

    /// Releases `address` whoever holds it. With `pool` set, the address
    /// must belong to that pool.
    pub fn release_address(&mut self, pool: Option<&str>, address: &IpAddr) -> Result<Option<Allocation>, AllocError> {
        let Some(a) = self.by_address.get(address) else {
            return Ok(None);
        };
        if let Some(pool) = pool
            && a.pool != pool
        {
            return Err(AllocError::WrongPool {
                address: *address,
                pool: pool.into(),
                actual: a.pool.clone(),
            });
        }
        let owner = a.owner.clone();
        if let Some(set) = self.by_owner.get_mut(&owner) {
            set.remove(address);
            if set.is_empty() {
                self.by_owner.remove(&owner);
            }
        }
        Ok(self.remove(address))
    }

    /// Every allocation, ordered by address.
    pub fn allocations(&self) -> impl Iterator<Item = &Allocation> {
        self.by_address.values()
    }

    /// Allocations outside every range of their pool.
    pub fn orphaned(&self) -> impl Iterator<Item = &Allocation> {
        self.by_address
            .values()
            .filter(|a| self.pools.range_of(&a.pool, &a.address).is_none())
    }

    /// Usage of every range.
    pub fn usage(&self) -> Vec<RangeUsage> {
        self.pools
            .ranges()
            .iter()
            .enumerate()
            .map(|(i, r)| RangeUsage {
                range: i,
                size: r.size(),
                allocated: self.counts[i],
            })
            .collect()
    }

    fn check_pool(&self, pool: &str) -> Result<(), AllocError> {
        if self.pools.is_empty() {
            return Err(AllocError::NoPoolYet);
        }
        if !self.pools.has_pool(pool) {
            return Err(AllocError::UnknownPool { pool: pool.into() });
        }
        Ok(())
    }

    fn check_claimable(&self, owner: &Owner, pool: &str, addr: &IpAddr) -> Result<(), AllocError> {
        let usable = self
            .pools
            .range_of(pool, addr)
            .is_some_and(|r| self.pools.ranges()[r].is_usable(addr));
        if !usable {
            return Err(AllocError::NotUsable {
                pool: pool.into(),
                address: *addr,
            });
        }
        match self.by_address.get(addr) {
            Some(a) if a.owner != *owner => Err(AllocError::HeldByOther {
                address: *addr,
                holder: a.owner.clone(),
            }),
            _ => Ok(()),
        }
    }

    fn next_free(&mut self, pool: &str, family: Family, ranges: &[usize]) -> Result<IpAddr, AllocError> {
        for &i in ranges {
            let range = &self.pools.ranges()[i];
            let size = range.size();
            // Counts include reserved or orphaned addresses only if usable, so
            // a full count means no free usable address.
            if self.counts[i] >= size {
                continue;
            }
            let start = self.cursors[i];
            // Terminates: fewer than `size` usable addresses are taken.
            let mut step = 0u128;
            while step < size {
                let offset = (start + step) % size;
                let addr = range.address_at(offset);
                if !self.by_address.contains_key(&addr) {
                    self.cursors[i] = (offset + 1) % size;
                    return Ok(addr);
                }
                step += 1;
            }
        }
        Err(AllocError::Exhausted {
            pool: pool.into(),
            family,
            size: ranges.iter().map(|&i| self.pools.ranges()[i].size()).sum(),
        })
    }

    fn insert(&mut self, a: Allocation) {
        if let Some(i) = self.pools.any_range_of(&a.address)
            && self.pools.ranges()[i].is_usable(&a.address)
        {
            self.counts[i] += 1;
        }
        self.by_owner.entry(a.owner.clone()).or_default().insert(a.address);
        self.by_address.insert(a.address, a);
    }

    fn remove(&mut self, addr: &IpAddr) -> Option<Allocation> {
        let a = self.by_address.remove(addr)?;
        if let Some(i) = self.pools.any_range_of(addr)
            && self.pools.ranges()[i].is_usable(addr)
        {
            self.counts[i] -= 1;
        }
        Some(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolSpec;

    fn pools(specs: &[&str]) -> PoolSet {
        PoolSet::new(&specs.iter().map(|s| s.parse::<PoolSpec>().unwrap()).collect::<Vec<_>>()).unwrap()
    }

    fn owner(c: &str) -> Owner {
        Owner {
            container_id: c.into(),
            interface: "eth0".into(),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn same_owner_gets_same_address_and_families_are_independent() {
        let mut a = Allocator::new(pools(&["default=198.18.0.0/24,2001:2::/120"]));
        let (v4, new) = a.allocate(&owner("a"), "default", Family::V4, None).unwrap();
        assert!(new);
        assert_eq!(v4.address, ip("198.18.0.2"), "the first pod gets gateway+1");
        let (again, new) = a.allocate(&owner("a"), "default", Family::V4, None).unwrap();
        assert!(!new, "asking again allocates nothing");
        assert_eq!(again.address, v4.address, "the same owner gets the same address");
        let (v6, _) = a.allocate(&owner("a"), "default", Family::V6, None).unwrap();
        assert_eq!(v6.address, ip("2001:2::2"));
        let other = owner("a").clone();
        let other = Owner {
            interface: "net1".into(),
            ..other
        };
        let (b, _) = a.allocate(&other, "default", Family::V4, None).unwrap();
        assert_ne!(
            b.address, v4.address,
            "another interface of the same container is another owner"
        );
    }

    #[test]
    fn exhaustion_names_pool_and_size_and_released_addresses_come_back() {
        let mut a = Allocator::new(pools(&["small=198.18.0.0/29"]));
        let got: Vec<_> = (0..5)
            .map(|i| {
                a.allocate(&owner(&i.to_string()), "small", Family::V4, None)
                    .unwrap()
                    .0
                    .address
            })
            .collect();
        let unique: BTreeSet<_> = got.iter().collect();
        assert_eq!(unique.len(), 5, "no address is handed out twice");
        for addr in &got {
            assert!(
                !["198.18.0.0", "198.18.0.1", "198.18.0.7"].contains(&addr.to_string().as_str()),
                "network, gateway and broadcast are never handed out (got {addr})"
            );
        }
        let err = a.allocate(&owner("x"), "small", Family::V4, None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pool small is exhausted: all 5 ipv4 addresses are allocated"
        );
        let released = a.release_owner(&owner("2"));
        assert_eq!(released.len(), 1);
        let (next, _) = a.allocate(&owner("x"), "small", Family::V4, None).unwrap();
        assert_eq!(next.address, released[0].address, "the only free address is reused");
    }

    #[test]
    fn released_addresses_are_not_reused_at_once() {
        let mut a = Allocator::new(pools(&["default=198.18.0.0/24"]));
        let (first, _) = a.allocate(&owner("a"), "default", Family::V4, None).unwrap();
        a.release_owner(&owner("a"));
        let (second, _) = a.allocate(&owner("b"), "default", Family::V4, None).unwrap();
        assert_ne!(
            first.address, second.address,
            "the cursor moves on past a released address"
        );
    }

    #[test]
    fn requested_address_rules() {
        let mut a = Allocator::new(pools(&["default=198.18.0.0/24", "other=198.18.1.0/24"]));
        let (r, _) = a
            .allocate(&owner("a"), "default", Family::V4, Some(ip("198.18.0.50")))
            .unwrap();
        assert_eq!(r.address, ip("198.18.0.50"));
        assert!(matches!(
            a.allocate(&owner("b"), "default", Family::V4, Some(ip("198.18.0.50"))),
            Err(AllocError::HeldByOther { .. })
        ));
        for bad in ["198.18.0.0", "198.18.0.1", "198.18.0.255", "198.18.1.5"] {
            assert!(
                matches!(
                    a.allocate(&owner("b"), "default", Family::V4, Some(ip(bad))),
                    Err(AllocError::NotUsable { .. })
                ),
                "{bad} must be refused for pool default"
            );
        }
        assert!(matches!(
            a.allocate(&owner("a"), "default", Family::V4, Some(ip("198.18.0.51"))),
            Err(AllocError::OwnerHoldsOther { .. })
        ));
        assert!(matches!(
            a.allocate(&owner("a"), "nope", Family::V4, None),
            Err(AllocError::UnknownPool { .. })
        ));
        assert!(matches!(
            a.allocate(&owner("a"), "default", Family::V6, None),
            Err(AllocError::NoRangeForFamily { .. })
        ));
    }

    #[test]
    fn restore_reserves_free_or_own_and_names_the_holder_otherwise() {
        let mut a = Allocator::new(pools(&["default=198.18.0.0/24"]));
        let (r, new) = a.restore(&owner("a"), "default", ip("198.18.0.9")).unwrap();
        assert!(new);
        assert_eq!(r.owner, owner("a"));
        let (_, new) = a.restore(&owner("a"), "default", ip("198.18.0.9")).unwrap();
        assert!(!new, "restoring one's own address is a no-op");
        let err = a.restore(&owner("b"), "default", ip("198.18.0.9")).unwrap_err();
        assert_eq!(err.to_string(), "198.18.0.9 is held by a/eth0");
    }

    #[test]
    fn release_address_is_idempotent_and_checks_pool() {
        let mut a = Allocator::new(pools(&["default=198.18.0.0/24"]));
        let (r, _) = a.allocate(&owner("a"), "default", Family::V4, None).unwrap();
        assert!(matches!(
            a.release_address(Some("x"), &r.address),
            Err(AllocError::WrongPool { .. })
        ));
        assert_eq!(a.release_address(Some("default"), &r.address).unwrap(), Some(r.clone()));
        assert_eq!(a.release_address(None, &r.address).unwrap(), None);
        assert!(a.held(&owner("a"), "default", Family::V4).is_none());
        assert!(a.release_owner(&owner("a")).is_empty(), "releasing twice is a no-op");
    }

    #[test]
    fn loaded_state_inconsistencies_are_resolved_without_double_allocation() {
        let alloc = |pool: &str, addr: &str, o: &str| Allocation {
            pool: pool.into(),
            address: ip(addr),
            owner: owner(o),
        };
        let state = AllocatorState {
            allocations: vec![
                alloc("default", "198.18.0.2", "a"),
                alloc("default", "198.18.0.2", "b"), // duplicate
                alloc("default", "198.18.9.9", "c"), // outside the pool now
                alloc("default", "198.18.0.1", "d"), // the gateway
                alloc("default", "198.18.0.3", "a"), // a holds two
                alloc("removed", "198.18.0.4", "e"), // pool gone, address inside another pool
            ],
            cursors: BTreeMap::new(),
            set_pools: BTreeMap::new(),
        };
        let (mut a, found) = Allocator::from_state(pools(&["default=198.18.0.0/29"]), state);
        let kinds: Vec<_> = found.iter().map(Inconsistency::kind).collect();
        assert_eq!(
            kinds,
            [
                "duplicate_address",
                "orphaned",
                "reserved_address",
                "owner_holds_several",
                "orphaned"
            ]
        );
        // 198.18.0.2, .3, .4 are taken; /29 usable = .2-.6 → two left.
        let mut got = BTreeSet::new();
        for o in ["x", "y"] {
            got.insert(a.allocate(&owner(o), "default", Family::V4, None).unwrap().0.address);
        }
        assert_eq!(got, BTreeSet::from([ip("198.18.0.5"), ip("198.18.0.6")]));
        assert!(
            matches!(
                a.allocate(&owner("z"), "default", Family::V4, None),
                Err(AllocError::Exhausted { .. })
            ),
            "addresses held by inconsistent records are never handed out again"
        );
        assert_eq!(a.orphaned().count(), 2);
        assert_eq!(
            a.release_owner(&owner("c")).len(),
            1,
            "an orphan is released by its owner"
        );
    }

    #[test]
    fn state_round_trip_keeps_allocations_and_cursors() {
        let p = pools(&["default=198.18.0.0/24,2001:2::/64"]);
        let mut a = Allocator::new(p.clone());
        for i in 0..10 {
            a.allocate(&owner(&i.to_string()), "default", Family::V4, None).unwrap();
            a.allocate(&owner(&i.to_string()), "default", Family::V6, None).unwrap();
        }
        a.release_owner(&owner("9"));
        let (mut b, found) = Allocator::from_state(p, a.state());
        assert!(found.is_empty());
        assert_eq!(a.state(), b.state());
        assert_eq!(
            a.allocate(&owner("n"), "default", Family::V4, None).unwrap(),
            b.allocate(&owner("n"), "default", Family::V4, None).unwrap(),
            "a restarted allocator continues where it left off"
        );
    }

    fn spec(s: &str) -> PoolSpec {
        s.parse().unwrap()
    }

    #[test]
    fn without_a_pool_allocation_waits_for_one() {
        let mut a = Allocator::new(PoolSet::default());
        assert_eq!(
            a.allocate(&owner("a"), "default", Family::V4, None),
            Err(AllocError::NoPoolYet)
        );
        assert_eq!(
            a.restore(&owner("a"), "default", ip("198.18.0.9")),
            Err(AllocError::NoPoolYet)
        );
        assert!(a.set_pool(&spec("default=198.18.0.0/24")).unwrap());
        assert_eq!(
            a.allocate(&owner("a"), "default", Family::V4, None).unwrap().0.address,
            ip("198.18.0.2")
        );
    }

    #[test]
    fn set_pool_replaces_ranges_keeping_allocations_inside_them() {
        let mut a = Allocator::new(PoolSet::default());
        assert!(a.set_pool(&spec("default=198.18.0.0/29")).unwrap(), "created");
        let held: BTreeSet<IpAddr> = (0..5)
            .map(|i| {
                a.allocate(&owner(&i.to_string()), "default", Family::V4, None)
                    .unwrap()
                    .0
                    .address
            })
            .collect();
        assert!(matches!(
            a.allocate(&owner("x"), "default", Family::V4, None),
            Err(AllocError::Exhausted { .. })
        ));
        assert!(
            !a.set_pool(&spec("default=198.18.0.0/29")).unwrap(),
            "the same ranges change nothing"
        );
        // Grown to a /28 (the /29's addresses stay usable) plus IPv6.
        assert!(a.set_pool(&spec("default=2001:2::/120,198.18.0.0/28")).unwrap());
        assert!(
            !a.set_pool(&spec("default=198.18.0.0/28,2001:2::/120")).unwrap(),
            "the same ranges in another order change nothing"
        );
        for i in 0..5 {
            assert!(held.contains(&a.held(&owner(&i.to_string()), "default", Family::V4).unwrap().address));
        }
        let fresh: BTreeSet<IpAddr> = (0..8)
            .map(|i| {
                a.allocate(&owner(&format!("n{i}")), "default", Family::V4, None)
                    .unwrap()
                    .0
                    .address
            })
            .collect();
        assert!(fresh.is_disjoint(&held), "held addresses are never handed out again");
        assert_eq!(fresh.len(), 8, "a /28 has 13 usable addresses, 5 held");
        assert!(matches!(
            a.allocate(&owner("x"), "default", Family::V4, None),
            Err(AllocError::Exhausted { .. })
        ));
        assert_eq!(
            a.allocate(&owner("0"), "default", Family::V6, None).unwrap().0.address,
            ip("2001:2::2")
        );
        assert_eq!(
            a.state().set_pools["default"].len(),
            2,
            "the set pool is part of the state"
        );
    }

    #[test]
    fn set_pool_that_strands_an_allocation_changes_nothing() {
        let mut a = Allocator::new(PoolSet::default());
        a.set_pool(&spec("default=198.18.0.0/24")).unwrap();
        a.allocate(&owner("a"), "default", Family::V4, Some(ip("198.18.0.200")))
            .unwrap();
        a.allocate(&owner("b"), "default", Family::V4, Some(ip("198.18.0.129")))
            .unwrap();
        a.allocate(&owner("c"), "default", Family::V4, Some(ip("198.18.0.10")))
            .unwrap();
        let before = a.state();
        // .10 falls outside and .129 becomes the new range's gateway.
        let err = a.set_pool(&spec("default=198.18.0.128/25")).unwrap_err();
        let AllocError::PoolChangeStrandsAllocations { count, example, .. } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(*count, 2);
        assert_eq!(
            example.address,
            ip("198.18.0.10"),
            "the lowest stranded address is named"
        );
        assert_eq!(
            err.to_string(),
            "pool default keeps its ranges: 2 allocated address(es) would not be usable in 198.18.0.128/25 (e.g. 198.18.0.10 of c/eth0); release them first"
        );
        assert_eq!(a.state(), before, "a refused change changes nothing");
        a.release_owner(&owner("c"));
        a.release_owner(&owner("b"));
        assert!(
            a.set_pool(&spec("default=198.18.0.128/25")).unwrap(),
            "applies once released"
        );
        assert_eq!(
            a.held(&owner("a"), "default", Family::V4).unwrap().address,
            ip("198.18.0.200")
        );
    }

    #[test]
    fn set_pool_refuses_flag_pools_and_invalid_ranges() {
        let mut a = Allocator::new(pools(&["default=198.18.0.0/24"]));
        assert_eq!(
            a.set_pool(&spec("default=198.18.4.0/24")),
            Err(AllocError::PoolFixedByFlag { pool: "default".into() })
        );
        assert!(matches!(
            a.set_pool(&spec("other=198.18.0.128/25")),
            Err(AllocError::PoolConfig(PoolConfigError::Overlap { .. }))
        ));
        assert!(matches!(
            a.set_pool(&spec("other=198.18.4.0/31")),
            Err(AllocError::PoolConfig(PoolConfigError::TooSmall { .. }))
        ));
        assert!(
            a.set_pool(&spec("other=198.18.4.0/24")).unwrap(),
            "another name beside a flag pool"
        );
    }

    #[test]
    fn set_pools_come_back_from_state_unless_a_flag_took_them() {
        let mut a = Allocator::new(PoolSet::default());
        a.set_pool(&spec("default=198.18.0.0/24,2001:2::/120")).unwrap();
        a.set_pool(&spec("other=198.18.4.0/24")).unwrap();
        let (x, _) = a.allocate(&owner("x"), "other", Family::V4, None).unwrap();
        let (b, found) = Allocator::from_state(PoolSet::default(), a.state());
        assert!(found.is_empty(), "{found:?}");
        assert_eq!(b.state(), a.state(), "set pools and allocations are restored");
        assert_eq!(b.pools().source("default"), Some(PoolSource::SetPool));

        let (c, found) = Allocator::from_state(pools(&["other=198.18.8.0/24"]), a.state());
        assert_eq!(
            found.iter().map(Inconsistency::kind).collect::<Vec<_>>(),
            ["set_pool_dropped", "orphaned"]
        );
        assert_eq!(c.pools().cidrs("default"), b.pools().cidrs("default"));
        assert_eq!(c.orphaned().next().map(|o| o.address), Some(x.address));
    }
}
