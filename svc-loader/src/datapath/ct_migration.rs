//! Migrating the conntrack maps an earlier loader pinned with the first
//! `ct_entry` layout ([`CtEntryV1`], 56 bytes) to the current one, so that an
//! upgrade of svc-loader loses no connection.
//!
//! A pinned `ct4`/`ct6` whose spec is the current one but for a value size
//! of [`CT_ENTRY_V1_SIZE`] is migrated; any other mismatch is refused as
//! before. Steps (each map on its own):
//!
//! 1. the object's map is created (or reused, see below) and pinned at
//!    `<pin_dir>/<map>-migrating` instead of `<pin_dir>/<map>`;
//! 2. every old entry is copied, converted ([`CtEntry::from`]: no cached
//!    verdict, so its next packet takes the policy lookup);
//! 3. the new programs replace the old ones on every filter;
//! 4. the entries the old programs created or updated meanwhile are copied
//!    again;
//! 5. `rename(2)` moves the new pin over the old one (atomic: the pin always
//!    names one of the two maps), so svc-gc and later loaders see the new map.
//!
//! A copy never overwrites an entry the new programs have touched (its
//! policy revision is no longer [`UNCACHED_POLICY_REVISION`]): that is
//! newer than anything in the old map. This makes every step safe to redo:
//! a loader that dies half way finds both pins at its next start, reuses
//! the `-migrating` map (which the new programs may already use) and
//! finishes; one that died after the rename finds nothing to migrate.

use std::io;
use std::os::fd::{AsFd as _, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rivet_bpf_sys as sys;
use rivet_datapath::maps::legacy::{CT_ENTRY_V1_SIZE, CtEntryV1, UNCACHED_POLICY_REVISION};
use rivet_datapath::maps::{Ct4Key, Ct6Key, CtEntry};
use rivet_datapath::spec::{MAP_CT4, MAP_CT6, MapSpec};

use super::error::DatapathError;

/// Suffix of the pin of a conntrack map being migrated (bpffs refuses names
/// with a dot).
pub const MIGRATING_PIN_SUFFIX: &str = "-migrating";

/// What migrating one conntrack map did, see [`Datapath::ct_migrations`](super::Datapath::ct_migrations).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CtMigrated {
    /// `ct4` or `ct6`.
    pub map: &'static str,
    /// Entries written into the new map (both copies).
    pub copied: u64,
    /// Old entries not written because the new programs had already
    /// touched their connection in the new map.
    pub kept_newer: u64,
    /// The new map was left by an interrupted migration.
    pub resumed: bool,
}

/// One conntrack map being migrated, from [`prepare`] to [`Self::finish`].
#[derive(Debug)]
pub(super) struct CtMigration {
    report: CtMigrated,
    old: OwnedFd,
    pin: PathBuf,
    migrating_pin: PathBuf,
}

/// The pin the object's map `name` is created at: the `-migrating` one
/// while it is migrated.
pub(super) fn migrating_pin(pin_dir: &Path, name: &str) -> PathBuf {
    pin_dir.join(format!("{name}{MIGRATING_PIN_SUFFIX}"))
}

fn pin_err(what: String, pin: &Path) -> impl FnOnce(io::Error) -> DatapathError + '_ {
    move |error| DatapathError::Pin {
        what,
        pin: pin.to_owned(),
        error,
    }
}

/// Whether map `name` (pinned in `pin_dir`) must be migrated to `expected`:
/// its pin holds the first `ct_entry` layout with the rest of `expected`'s
/// spec. `None` for every other map and state (the caller checks the pin
/// as usual and refuses mismatches).
pub(super) fn prepare(name: &str, pin_dir: &Path, expected: &MapSpec) -> Result<Option<CtMigration>, DatapathError> {
    let map = match name {
        MAP_CT4 => MAP_CT4,
        MAP_CT6 => MAP_CT6,
        _ => return Ok(None),
    };
    let pin = pin_dir.join(map);
    let migrating_pin = migrating_pin(pin_dir, map);
    // Not an openable map (a directory, another object): the usual check
    // says what it is.
    let Ok(old) = sys::obj_get(&pin) else {
        return Ok(None);
    };
    let Ok(info) = sys::map_info(old.as_fd()) else {
        return Ok(None);
    };
    let previous = MapSpec {
        value_size: CT_ENTRY_V1_SIZE,
        ..*expected
    };
    if MapSpec::from(info) != previous {
        return Ok(None);
    }
    Ok(Some(CtMigration {
        report: CtMigrated {
            map,
            resumed: migrating_pin.exists(),
            ..CtMigrated::default()
        },
        old,
        pin,
        migrating_pin,
    }))
}

impl CtMigration {
    /// The map's name.
    pub(super) fn map(&self) -> &'static str {
        self.report.map
    }

    /// Where the new map is pinned until [`finish`](Self::finish).
    pub(super) fn migrating_pin(&self) -> &Path {
        &self.migrating_pin
    }

    /// Copies the old map's entries into the new one (pinned at the
    /// `-migrating` pin by now), keeping entries the new programs touched.
    pub(super) fn copy(&mut self) -> Result<(), DatapathError> {
        let new = sys::obj_get(&self.migrating_pin).map_err(pin_err(
            format!("opening the new map {} at", self.report.map),
            &self.migrating_pin,
        ))?;
        let (copied, kept) = match self.report.map {
            MAP_CT4 => copy_entries::<Ct4Key>(self.old.as_fd(), new.as_fd()),
            _ => copy_entries::<Ct6Key>(self.old.as_fd(), new.as_fd()),
        }
        .map_err(pin_err(
            format!("copying the entries of {} into its new map at", self.report.map),
            &self.migrating_pin,
        ))?;
        self.report.copied += copied;
        self.report.kept_newer = kept;
        Ok(())
    }

    /// The last copy (after the new programs are attached), then the new
    /// map's pin replaces the old one.
    pub(super) fn finish(mut self) -> Result<CtMigrated, DatapathError> {
        self.copy()?;
        std::fs::rename(&self.migrating_pin, &self.pin).map_err(pin_err(
            format!("moving the migrated {} map over its old pin at", self.report.map),
            &self.pin,
        ))?;
        Ok(self.report)
    }
}

/// Copies every entry of `old` (first layout) into `new`, converted, except
/// where `new` holds an entry the new datapath has touched. Returns
/// (written, kept). An entry deleted during the walk is skipped (the kernel
/// restarts a walk whose cursor was deleted from the first key).
fn copy_entries<K: aya::Pod>(old: BorrowedFd<'_>, new: BorrowedFd<'_>) -> io::Result<(u64, u64)> {
    let (mut written, mut kept) = (0, 0);
    let mut cursor: Option<K> = None;
    while let Some(key) = sys::next_key::<K>(old, cursor.as_ref())? {
        cursor = Some(key);
        let Some(value) = sys::lookup::<K, CtEntryV1>(old, &key)? else {
            continue;
        };
        match sys::lookup::<K, CtEntry>(new, &key)? {
            Some(current) if current.policy_revision != UNCACHED_POLICY_REVISION => kept += 1,
            Some(current) if current == CtEntry::from(value) => {}
            _ => {
                sys::update(new, &key, &CtEntry::from(value), 0)?;
                written += 1;
            }
        }
    }
    Ok((written, kept))
}
