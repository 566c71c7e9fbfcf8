//! Removing this node's datapath from the namespace and the bpffs: every
//! filter of ours on any interface and the pin directory. Only the loader's
//! shutdown on a node without endpoints calls it ([`crate::uninstall`]):
//! a restart keeps everything (DESIGN.md §1).

use std::io;

use super::error::{io_err, tc_err};
use super::{Datapath, DatapathError, attach::interfaces};
use crate::tc;

impl Datapath {
    /// Deletes every tc filter named `rivet-<node>-…` (this node's: endpoint,
    /// NodePort and overlay programs) on both hooks of every interface of
    /// the namespace. Returns `(ifindex, filter name)` of each one removed.
    /// Other filters, another node's included, are left alone.
    pub fn remove_all_filters(&self) -> Result<Vec<(u32, String)>, DatapathError> {
        let ours = self.program_filter_name("");
        let mut removed = Vec::new();
        for ifindex in interfaces()?.into_keys() {
            for direction in [tc::Direction::Ingress, tc::Direction::Egress] {
                let filters = match tc::bpf_filters(ifindex, direction) {
                    Ok(filters) => filters,
                    // Gone since the dump: its filters went with it.
                    Err(error) if error.raw_os_error() == Some(libc::ENODEV) => continue,
                    Err(error) => return Err(tc_err("listing filters to remove".into(), ifindex, error)),
                };
                for filter in filters {
                    if filter.name.starts_with(&ours) && filter.is_ours(&filter.name) {
                        tc::detach_bpf(ifindex, direction)
                            .map_err(|error| tc_err(format!("removing filter {}", filter.name), ifindex, error))?;
                        removed.push((ifindex, filter.name));
                    }
                }
            }
        }
        Ok(removed)
    }

    /// Removes everything pinned in the pin directory (maps, link pins),
    /// then the directory itself where the loader may (a loader that
    /// switched to `--user` may not write the root-owned `<bpffs>/rivet`;
    /// the empty directory is then `rivet node cleanup`'s). Maps stay alive
    /// while a program or a handle still holds them; with no filter left,
    /// they go when the loader exits. `Ok(false)` if there was none.
    pub fn remove_pins(&self) -> Result<bool, DatapathError> {
        let dir = self.pin_dir();
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(error) => return Err(io_err("listing the pin directory", dir)(error)),
        };
        for entry in entries {
            let path = entry.map_err(io_err("listing the pin directory", dir))?.path();
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            removed.map_err(io_err("removing the pin", &path))?;
        }
        match std::fs::remove_dir(dir) {
            Err(error) if !matches!(error.kind(), io::ErrorKind::PermissionDenied | io::ErrorKind::NotFound) => {
                Err(io_err("removing the pin directory", dir)(error))
            }
            _ => Ok(true),
        }
    }
}
