//! Previous ABIs of the datapath's maps, kept so that a loader can migrate
//! the pinned maps an older loader left (an upgrade keeps every connection).

use super::{CtEntry, LbService, LbServiceBackend};
use crate::spec::{self, MapDef};

/// `struct ct_entry` of the first ABI (svc-loader before the cached policy
/// verdict, 56 bytes): [`CtEntry`] without `policy_revision`,
/// `policy_verdict` and their padding. Pinned `ct4`/`ct6` maps with this
/// value size are migrated by svc-loader.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtEntryV1 {
    /// As [`CtEntry::expires`].
    pub expires: u64,
    /// As [`CtEntry::packets_fwd`].
    pub packets_fwd: u64,
    /// As [`CtEntry::bytes_fwd`].
    pub bytes_fwd: u64,
    /// As [`CtEntry::packets_rev`].
    pub packets_rev: u64,
    /// As [`CtEntry::bytes_rev`].
    pub bytes_rev: u64,
    /// As [`CtEntry::src_identity`].
    pub src_identity: u32,
    /// As [`CtEntry::endpoint_id`].
    pub endpoint_id: u32,
    /// As [`CtEntry::tcp_state`].
    pub tcp_state: u8,
    /// As [`CtEntry::tcp_flags_fwd`].
    pub tcp_flags_fwd: u8,
    /// As [`CtEntry::tcp_flags_rev`].
    pub tcp_flags_rev: u8,
    /// As [`CtEntry::flags`].
    pub flags: u8,
    /// As [`CtEntry::lifetime`].
    pub lifetime: u32,
}

/// The value size of `ct4`/`ct6` in the first ABI.
pub const CT_ENTRY_V1_SIZE: u32 = size_of::<CtEntryV1>() as u32;

/// Policy revision 0 is never the datapath's (the loader never sets it), so an
/// entry cached at it takes the policy verdict again at its next packet.
pub const UNCACHED_POLICY_REVISION: u32 = 0;

impl From<CtEntryV1> for CtEntry {
    /// The same connection with no cached verdict: its next packet takes
    /// the policy lookup (its revision, [`UNCACHED_POLICY_REVISION`], never
    /// matches the datapath's).
    fn from(old: CtEntryV1) -> Self {
        Self {
            expires: old.expires,
            packets_fwd: old.packets_fwd,
            bytes_fwd: old.bytes_fwd,
            packets_rev: old.packets_rev,
            bytes_rev: old.bytes_rev,
            src_identity: old.src_identity,
            endpoint_id: old.endpoint_id,
            tcp_state: old.tcp_state,
            tcp_flags_fwd: old.tcp_flags_fwd,
            tcp_flags_rev: old.tcp_flags_rev,
            flags: old.flags,
            lifetime: old.lifetime,
            policy_revision: UNCACHED_POLICY_REVISION,
            policy_verdict: 0,
            pad: [0; 3],
        }
    }
}

/// Backend slots of an [`LbServiceV1`] record.
pub const LB_SERVICE_V1_MAX_BACKENDS: usize = 1024;

/// `struct lb_service` before the backends moved to `lb_svc_backends`
/// (8,216 bytes, 1,024 backend slots inline, ~8 KiB per service whatever
/// its backends): [`LbService`]'s fields, then the slots. svc-loader
/// converts a pinned `lb_services` of this value size on upgrade.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LbServiceV1 {
    /// The record, as [`LbService`] (whose `backend_count` counts `backends`).
    pub record: LbService,
    /// The backends, `record.backend_count` of them first.
    pub backends: [LbServiceBackend; LB_SERVICE_V1_MAX_BACKENDS],
}

/// The value size of `lb_services` in the first services ABI.
pub const LB_SERVICE_V1_SIZE: u32 = size_of::<LbServiceV1>() as u32;

/// `lb_services` in the first services ABI (pinned by loaders before
/// `lb_svc_backends`): the current definition with [`LbServiceV1`] values.
pub const LB_SERVICES_V1: MapDef = MapDef {
    value_size: LB_SERVICE_V1_SIZE,
    ..spec::LB_SERVICES
};

impl LbServiceV1 {
    /// The backends in use.
    pub fn backends(&self) -> &[LbServiceBackend] {
        &self.backends[..usize::from(self.record.backend_count).min(LB_SERVICE_V1_MAX_BACKENDS)]
    }
}

// SAFETY: #[repr(C)], integers only, no implicit padding (checked below).
unsafe impl aya::Pod for CtEntryV1 {}
// SAFETY: #[repr(C)] of two Pod types whose sizes are multiples of 4 (no
// padding; the size is checked below).
unsafe impl aya::Pod for LbServiceV1 {}

#[cfg(test)]
mod tests {
    use std::mem::offset_of;

    use super::*;

    /// The first ABI's size, and every field where the current `ct_entry`
    /// has it: the current layout only appended fields.
    #[test]
    fn ct_entry_v1_is_the_current_layout_cut_at_56_bytes() {
        assert_eq!(CT_ENTRY_V1_SIZE, 56);
        assert_eq!(offset_of!(CtEntry, policy_revision), 56);
        macro_rules! same {
            ($($f:ident),*) => {$(
                assert_eq!(offset_of!(CtEntryV1, $f), offset_of!(CtEntry, $f), stringify!($f));
            )*};
        }
        same!(
            expires,
            packets_fwd,
            bytes_fwd,
            packets_rev,
            bytes_rev,
            src_identity,
            endpoint_id,
            tcp_state,
            tcp_flags_fwd,
            tcp_flags_rev,
            flags,
            lifetime
        );
        assert_eq!(
            offset_of!(CtEntryV1, lifetime) + 4,
            size_of::<CtEntryV1>(),
            "no implicit padding"
        );
    }

    /// The first services ABI's record: the current one, then 1,024 slots.
    #[test]
    fn lb_service_v1_is_the_current_record_and_its_slots() {
        assert_eq!(LB_SERVICE_V1_SIZE, 24 + 8 * 1024);
        assert_eq!(offset_of!(LbServiceV1, backends), size_of::<LbService>());
    }

    #[test]
    fn a_converted_entry_keeps_its_fields_and_has_no_cached_verdict() {
        let old = CtEntryV1 {
            expires: 1,
            packets_fwd: 2,
            bytes_fwd: 3,
            packets_rev: 4,
            bytes_rev: 5,
            src_identity: 6,
            endpoint_id: 7,
            tcp_state: 8,
            tcp_flags_fwd: 9,
            tcp_flags_rev: 10,
            flags: 11,
            lifetime: 12,
        };
        let new = CtEntry::from(old);
        assert_eq!(
            (
                new.expires,
                new.packets_fwd,
                new.bytes_fwd,
                new.packets_rev,
                new.bytes_rev
            ),
            (1, 2, 3, 4, 5)
        );
        assert_eq!((new.src_identity, new.endpoint_id, new.lifetime), (6, 7, 12));
        assert_eq!(
            (new.tcp_state, new.tcp_flags_fwd, new.tcp_flags_rev, new.flags),
            (8, 9, 10, 11)
        );
        assert_eq!((new.policy_revision, new.policy_verdict), (UNCACHED_POLICY_REVISION, 0));
    }
}
