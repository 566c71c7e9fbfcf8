//! Moving the TCX links that loaders before the move to tc pinned under
//! `<pin_dir>/links/` to tc filters.

use std::io;

use super::Datapath;
use super::attach::{AdoptReport, Hook};
use super::error::{DatapathError, io_err, tc_err};
use crate::tc;

/// Subdirectory of the pin directory where loaders before the move to tc
/// pinned their TCX links; [`Datapath::open`] migrates and removes it.
pub const LEGACY_LINKS_DIR: &str = "links";

impl Datapath {
    /// Moves the TCX links an earlier loader pinned under `links/` to tc
    /// filters: the filter first, then the pin goes (which detaches the
    /// link), so the interface is never without its program. Pins of
    /// interfaces that are gone are removed.
    pub(super) fn migrate_legacy_links(&self) -> Result<AdoptReport, DatapathError> {
        let mut report = AdoptReport::default();
        let dir = self.opts.legacy_links_dir();
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(report),
            Err(err) => return Err(io_err("listing the legacy TCX link pins in", &dir)(err)),
        };
        for entry in entries {
            let entry = entry.map_err(io_err("listing the legacy TCX link pins in", &dir))?;
            let parsed = entry.file_name().to_str().and_then(|name| {
                let (index, hook) = name.split_once('-')?;
                Some((index.parse::<u32>().ok().filter(|i| *i != 0)?, Hook::from_suffix(hook)?))
            });
            let Some((ifindex, hook)) = parsed else {
                report
                    .ignored
                    .push((entry.path(), "not named <ifindex>-ingress|egress".to_owned()));
                continue;
            };
            let exists = self.ifname(ifindex)?.is_some();
            if exists {
                tc::ensure_clsact(ifindex)
                    .map_err(|error| tc_err("adding the clsact qdisc".to_owned(), ifindex, error))?;
                let replace = self.our_filter(ifindex, hook)?.is_some();
                self.set_filter(ifindex, hook, replace)?;
            }
            std::fs::remove_file(entry.path()).map_err(io_err("removing the legacy TCX link pin", &entry.path()))?;
            if exists {
                report.migrated.push((ifindex, hook));
            } else {
                report.removed.push((ifindex, hook));
            }
        }
        if report.ignored.is_empty() {
            // Best effort: an empty directory left behind is harmless.
            let _ = std::fs::remove_dir(&dir);
        }
        report.migrated.sort();
        report.removed.sort();
        Ok(report)
    }
}
