//! Where the datapath's maps are pinned and how another process opens them.
//!
//! Layout: `<bpffs>/rivet/<node>/<map>` ([`pin_dir`], owned by
//! `rivet_common::pin_layout`, aya-free, re-exported here): svc-loader creates
//! and pins the maps there; svc-gc and inspection open them by path with
//! [`open_pinned_map`], which checks the map against its [`MapDef`] first.

use std::io;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};

use aya::maps::{Map, MapData, MapError};

use crate::spec::{MapDef, MapSpec};

pub use rivet_common::pin_layout::{DEFAULT_BPFFS, PIN_ROOT, PinDirError, pin_dir};

/// Opening a pinned map of the datapath failed.
#[derive(Debug, thiserror::Error)]
pub enum PinnedMapError {
    /// The pin could not be opened (missing, no permission, not a BPF object).
    #[error("opening the pinned map {map} at {}: {source}", pin.display())]
    Open {
        /// The map name.
        map: &'static str,
        /// The pin path.
        pin: PathBuf,
        /// The kernel's answer.
        source: io::Error,
    },
    /// The kernel's description of the map could not be read.
    #[error("reading the pinned map {map} at {}: {source}", pin.display())]
    Info {
        /// The map name.
        map: &'static str,
        /// The pin path.
        pin: PathBuf,
        /// The kernel's answer.
        source: io::Error,
    },
    /// The pinned map is not what the datapath defines.
    #[error(
        "map `{map}` pinned at {} is {found}, but the datapath needs {expected}; \
         to fix: use the rivet binaries of the svc-loader that created the map",
        pin.display()
    )]
    Mismatch {
        /// The map name.
        map: &'static str,
        /// The pin path.
        pin: PathBuf,
        /// What is pinned.
        found: MapSpec,
        /// What the datapath defines (with the pinned map's size).
        expected: MapSpec,
    },
    /// The pin directory could not be created.
    #[error("creating the pin directory {}: {source}", dir.display())]
    CreateDir {
        /// The directory.
        dir: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// aya could not create, pin or use the map.
    #[error("using the pinned map {map} at {}: {source}", pin.display())]
    Use {
        /// The map name.
        map: &'static str,
        /// The pin path.
        pin: PathBuf,
        /// aya's error.
        source: MapError,
    },
}

/// Opens `<pin_dir>/<def.name>`, a map of a running datapath, for another
/// process (svc-gc, inspection), after checking its type, key and value
/// sizes and flags against `def` (not its size, which is the loader's option).
pub fn open_pinned_map(pin_dir: &Path, def: &'static MapDef) -> Result<Map, PinnedMapError> {
    let map = def.name;
    let pin = pin_dir.join(map);
    let fd = rivet_bpf_sys::obj_get(&pin).map_err(|source| PinnedMapError::Open {
        map,
        pin: pin.clone(),
        source,
    })?;
    let found = rivet_bpf_sys::map_info(fd.as_fd())
        .map(MapSpec::from)
        .map_err(|source| PinnedMapError::Info {
            map,
            pin: pin.clone(),
            source,
        })?;
    if !def.matches(&found) {
        return Err(PinnedMapError::Mismatch {
            map,
            pin,
            found,
            expected: def.spec(found.max_entries),
        });
    }
    let use_err = |source| PinnedMapError::Use {
        map,
        pin: pin.clone(),
        source,
    };
    let data = MapData::from_fd(fd).map_err(use_err)?;
    Map::from_map_data(data).map_err(use_err)
}

/// Creates `def`'s map with `max_entries` and pins it at
/// `<pin_dir>/<def.name>` (creating `pin_dir`), for tests and tools that
/// need the datapath's maps without the loader (svc-gc's tests). In a
/// node, svc-loader alone creates the maps, by loading the object.
#[cfg(feature = "testing")]
pub fn create_pinned_map(pin_dir: &Path, def: &'static MapDef, max_entries: u32) -> Result<Map, PinnedMapError> {
    let map = def.name;
    let pin = pin_dir.join(map);
    std::fs::create_dir_all(pin_dir).map_err(|source| PinnedMapError::CreateDir {
        dir: pin_dir.to_owned(),
        source,
    })?;
    let use_err = |source| PinnedMapError::Use {
        map,
        pin: pin.clone(),
        source,
    };
    let obj = aya_obj::Map::new_from_params(def.map_type, def.key_size, def.value_size, max_entries, def.flags);
    let data = MapData::create(obj, map, None).map_err(use_err)?;
    data.pin(&pin).map_err(|error| {
        use_err(MapError::PinError {
            name: Some(map.to_owned()),
            error,
        })
    })?;
    Map::from_map_data(data).map_err(use_err)
}
