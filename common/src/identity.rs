//! Numeric identity ranges (DESIGN.md §4), the one place they are written:
//!
//! | range | what | who hands them out |
//! |---|---|---|
//! | 0 | no identity (in a policy entry: any peer) | — |
//! | 1..=7 | reserved ([`ReservedIdentity`]: host, world, ...) | fixed |
//! | 8..=255 | unassigned | nobody |
//! | 256..2^24 | cluster identities of label sets | svc-identity, from the kvstore, up to `--max-identity` |
//! | 2^24..=2^24+0xffff | node-local CIDR identities of ipBlock prefixes | svc-identity, never in the kvstore |
//!
//! svc-identity allocates from these ranges; the policy engine, svc-loader's
//! validation and the CLI classify numbers with [`IdentityScope::of`].

use crate::labels::ReservedIdentity;

/// The first cluster identity.
pub const CLUSTER_IDENTITY_MIN: u32 = 256;
/// The first node-local CIDR identity (Cilium's local scope bit): cluster
/// identities are below it.
pub const CIDR_IDENTITY_MIN: u32 = 1 << 24;
/// The last cluster identity any configuration may use.
pub const CLUSTER_IDENTITY_MAX: u32 = CIDR_IDENTITY_MIN - 1;
/// svc-identity's default last cluster identity (`--max-identity`).
pub const DEFAULT_MAX_CLUSTER_IDENTITY: u32 = 65535;
/// The last node-local CIDR identity (65536 prefixes per node).
pub const CIDR_IDENTITY_MAX: u32 = CIDR_IDENTITY_MIN + 0xffff;

/// Which range an identity number is in.
///
/// ```
/// use rivet_common::identity::IdentityScope;
/// use rivet_common::labels::ReservedIdentity;
///
/// assert_eq!(IdentityScope::of(2), IdentityScope::Reserved(ReservedIdentity::World));
/// assert_eq!(IdentityScope::of(300), IdentityScope::Cluster);
/// assert_eq!(IdentityScope::of(1 << 24), IdentityScope::Cidr);
/// assert_eq!(IdentityScope::of(8), IdentityScope::Unassigned);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdentityScope {
    /// 0: no identity.
    None,
    /// 1..=7.
    Reserved(ReservedIdentity),
    /// 256 <= id < 2^24.
    Cluster,
    /// 2^24 <= id <= 2^24 + 0xffff.
    Cidr,
    /// Outside every range (8..=255, above the CIDR range).
    Unassigned,
}

impl IdentityScope {
    /// The range `id` is in.
    pub fn of(id: u32) -> Self {
        match id {
            0 => Self::None,
            CLUSTER_IDENTITY_MIN..CIDR_IDENTITY_MIN => Self::Cluster,
            CIDR_IDENTITY_MIN..=CIDR_IDENTITY_MAX => Self::Cidr,
            _ => ReservedIdentity::from_id(id).map_or(Self::Unassigned, Self::Reserved),
        }
    }
}

/// Whether `id` is a cluster identity (a label set's, e.g. a pod's).
pub fn is_cluster(id: u32) -> bool {
    IdentityScope::of(id) == IdentityScope::Cluster
}

/// Whether `id` is a node-local CIDR identity (an ipBlock prefix's).
pub fn is_cidr(id: u32) -> bool {
    IdentityScope::of(id) == IdentityScope::Cidr
}

/// A configured cluster range that overlaps another range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the largest cluster identity must be in {CLUSTER_IDENTITY_MIN}..={CLUSTER_IDENTITY_MAX} \
     (CIDR identities start at {CIDR_IDENTITY_MIN}), found {max}"
)]
pub struct ClusterRangeError {
    /// The configured largest cluster identity.
    pub max: u32,
}

/// Checks a configured largest cluster identity (svc-identity's
/// `--max-identity`): above the first one and below the CIDR range.
///
/// ```
/// use rivet_common::identity::check_max_cluster_identity;
///
/// assert!(check_max_cluster_identity(65535).is_ok());
/// assert!(check_max_cluster_identity(1 << 24).is_err());
/// ```
pub fn check_max_cluster_identity(max: u32) -> Result<(), ClusterRangeError> {
    if (CLUSTER_IDENTITY_MIN + 1..=CLUSTER_IDENTITY_MAX).contains(&max) {
        Ok(())
    } else {
        Err(ClusterRangeError { max })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_number_has_one_scope() {
        assert_eq!(IdentityScope::of(0), IdentityScope::None);
        for r in ReservedIdentity::ALL {
            assert_eq!(IdentityScope::of(r.id()), IdentityScope::Reserved(r));
        }
        for id in [8, 100, 255, CIDR_IDENTITY_MAX + 1, u32::MAX] {
            assert_eq!(IdentityScope::of(id), IdentityScope::Unassigned, "{id}");
        }
        for id in [256, 65535, CLUSTER_IDENTITY_MAX] {
            assert!(is_cluster(id) && !is_cidr(id), "{id}");
        }
        for id in [CIDR_IDENTITY_MIN, CIDR_IDENTITY_MIN + 1, CIDR_IDENTITY_MAX] {
            assert!(is_cidr(id) && !is_cluster(id), "{id}");
        }
        assert!(!is_cluster(255) && !is_cidr(255));
    }

    #[test]
    fn the_cluster_range_stays_below_the_cidr_range() {
        for max in [257, DEFAULT_MAX_CLUSTER_IDENTITY, CLUSTER_IDENTITY_MAX] {
            assert_eq!(check_max_cluster_identity(max), Ok(()), "{max}");
        }
        for max in [0, 255, 256, CIDR_IDENTITY_MIN, CIDR_IDENTITY_MAX, u32::MAX] {
            assert_eq!(check_max_cluster_identity(max), Err(ClusterRangeError { max }), "{max}");
        }
    }
}
