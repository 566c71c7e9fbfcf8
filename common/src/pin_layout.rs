//! Where a node's datapath maps are pinned: `<bpffs>/rivet/<node>/<map>`.
//!
//! The one owner of the pin layout, free of aya so that the CLI (which
//! removes a node's pins on `rivet node down`) and every other process can
//! name the directory without linking the BPF loader. `rivet_datapath::pin`
//! re-exports it beside opening the pinned maps.
//!
//! ```
//! use rivet_common::pin_layout::{DEFAULT_BPFFS, pin_dir};
//!
//! let dir = pin_dir(DEFAULT_BPFFS, "node-1").unwrap();
//! assert_eq!(dir, std::path::Path::new("/sys/fs/bpf/rivet/node-1"));
//! assert!(pin_dir(DEFAULT_BPFFS, "../etc").is_err());
//! ```

use std::path::{Path, PathBuf};

/// Default bpffs mount point.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf";

/// Directory under the bpffs holding one pin directory per node.
pub const PIN_ROOT: &str = "rivet";

/// A node name that cannot be a pin directory's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("node name {node:?} cannot name a pin directory (it must be one path component, not . or ..)")]
pub struct PinDirError {
    /// The node name.
    pub node: String,
}

/// `<bpffs>/rivet/<node>`: the pin directory of a node's datapath. The node
/// name must be one path component (no `/` or NUL, not `.` or `..`).
pub fn pin_dir(bpffs: impl AsRef<Path>, node: &str) -> Result<PathBuf, PinDirError> {
    if node.is_empty() || node == "." || node == ".." || node.contains('/') || node.contains('\0') {
        return Err(PinDirError { node: node.to_owned() });
    }
    Ok(bpffs.as_ref().join(PIN_ROOT).join(node))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_dirs_are_one_component_under_the_bpffs() {
        assert_eq!(
            pin_dir(DEFAULT_BPFFS, "node-1").unwrap(),
            Path::new("/sys/fs/bpf/rivet/node-1")
        );
        for bad in ["", ".", "..", "a/b", "a\0b"] {
            let err = pin_dir(DEFAULT_BPFFS, bad).unwrap_err();
            assert!(err.to_string().contains("cannot name a pin directory"), "{err}");
        }
    }
}
