//! The datapath's map pins: names, the spec every pinned map must have,
//! checking existing pins before reuse, and opening a pinned map from
//! another process.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::os::fd::AsFd as _;
use std::path::Path;

use aya::maps::{Map, MapData};
use rivet_bpf_sys as sys;

use super::error::{DatapathError, chain, io_err};
use super::options::DatapathOptions;
use crate::DATAPATH_OBJECT;

/// Map names (as in `bpf/datapath.c` and under the pin directory).
pub const MAP_ENDPOINTS: &str = "endpoints";
/// The ipcache LPM trie.
pub const MAP_IPCACHE: &str = "ipcache";
/// The policy LPM trie.
pub const MAP_POLICY: &str = "policy";
/// The per-endpoint prefixes LPM trie (ipBlock peers matched by address).
pub const MAP_EP_PREFIXES: &str = "ep_prefixes";
/// IPv4 conntrack.
pub const MAP_CT4: &str = "ct4";
/// IPv6 conntrack.
pub const MAP_CT6: &str = "ct6";
/// Per-CPU counters by reason and direction.
pub const MAP_METRICS: &str = "metrics";
/// The event ring buffer.
pub const MAP_EVENTS: &str = "events";
/// The single-entry config array.
pub const MAP_CONFIG: &str = "config";
/// First fragments' ports for the later fragments (LRU hash, the datapath's alone).
pub const MAP_FRAGMENTS: &str = "fragments";
/// Every map the loader uses by name.
pub const MAP_NAMES: [&str; 10] = [
    MAP_ENDPOINTS,
    MAP_IPCACHE,
    MAP_POLICY,
    MAP_EP_PREFIXES,
    MAP_CT4,
    MAP_CT6,
    MAP_METRICS,
    MAP_EVENTS,
    MAP_CONFIG,
    MAP_FRAGMENTS,
];

/// `BPF_F_NO_PREALLOC`.
pub(super) const BPF_F_NO_PREALLOC: u32 = 1;
/// `BPF_FS_MAGIC` (linux/magic.h).
pub(super) const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// What a map is, as the kernel reports it (or as the loader wants it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSpec {
    /// `BPF_MAP_TYPE_*`.
    pub map_type: u32,
    /// Key size in bytes.
    pub key_size: u32,
    /// Value size in bytes.
    pub value_size: u32,
    /// max_entries (bytes for a ring buffer).
    pub max_entries: u32,
    /// `BPF_F_*` map flags.
    pub flags: u32,
}

impl From<sys::MapInfo> for MapSpec {
    fn from(info: sys::MapInfo) -> Self {
        Self {
            map_type: info.map_type,
            key_size: info.key_size,
            value_size: info.value_size,
            max_entries: info.max_entries,
            flags: info.map_flags,
        }
    }
}

impl fmt::Display for MapSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (key {} B, value {} B, max_entries {}, flags {:#x})",
            map_type_name(self.map_type),
            self.key_size,
            self.value_size,
            self.max_entries,
            self.flags
        )
    }
}

/// The kernel's name of a map type (`lru_hash`, `lpm_trie`, ...).
pub fn map_type_name(map_type: u32) -> String {
    let name = match map_type {
        1 => "hash",
        2 => "array",
        6 => "percpu_array",
        9 => "lru_hash",
        11 => "lpm_trie",
        27 => "ringbuf",
        _ => return format!("map type {map_type}"),
    };
    name.to_owned()
}

/// Fails unless `dir` (or its nearest existing ancestor) is on a bpffs.
pub(super) fn check_bpffs(dir: &Path) -> Result<(), DatapathError> {
    let mut probe = dir;
    while !probe.exists() {
        probe = probe.parent().unwrap_or(Path::new("/"));
    }
    let fs_type = sys::fs_type(probe).map_err(io_err("checking the file system of", probe))?;
    if fs_type != BPF_FS_MAGIC {
        return Err(DatapathError::NotBpffs {
            path: probe.to_owned(),
            fs_type,
        });
    }
    Ok(())
}

/// What every pinnable map of the object must be, with the options' sizes.
pub(super) fn expected_specs(opts: &DatapathOptions) -> Result<BTreeMap<String, MapSpec>, DatapathError> {
    let object = aya_obj::Object::parse(DATAPATH_OBJECT).map_err(|e| DatapathError::Object(e.to_string()))?;
    let mut specs = BTreeMap::new();
    for (name, map) in &object.maps {
        if !matches!(
            map.section_kind(),
            aya_obj::EbpfSectionKind::Maps | aya_obj::EbpfSectionKind::BtfMaps
        ) {
            continue; // .rodata/.data/.bss: per load, never pinned
        }
        let ringbuf = map.map_type() == 27;
        let max_entries = if ringbuf {
            opts.effective_events_bytes()
        } else {
            opts.max_entries()
                .iter()
                .find(|(n, _)| n == name)
                .map_or(map.max_entries(), |(_, max)| *max)
        };
        specs.insert(
            name.clone(),
            MapSpec {
                map_type: map.map_type(),
                key_size: if ringbuf { 0 } else { map.key_size() },
                value_size: if ringbuf { 0 } else { map.value_size() },
                max_entries,
                flags: map.map_flags(),
            },
        );
    }
    for name in MAP_NAMES {
        if !specs.contains_key(name) {
            return Err(DatapathError::Object(format!("it has no map {name}")));
        }
    }
    if [MAP_IPCACHE, MAP_POLICY, MAP_EP_PREFIXES]
        .iter()
        .any(|name| specs[*name].flags & BPF_F_NO_PREALLOC == 0)
    {
        return Err(DatapathError::Object(
            "its LPM tries must be created with BPF_F_NO_PREALLOC".to_owned(),
        ));
    }
    Ok(specs)
}

fn mismatch_fix(pin: &Path, found: &MapSpec, expected: &MapSpec) -> String {
    let mut fix = format!(
        "stop every node daemon using it (svc-loader, svc-gc), remove {} \
         (this flushes the map: its entries are lost), and start svc-loader again",
        pin.display()
    );
    let same_but_size = MapSpec {
        max_entries: expected.max_entries,
        ..*found
    } == *expected;
    if same_but_size {
        fix.push_str(&format!(
            "; or keep the map by configuring its current size ({})",
            found.max_entries
        ));
    }
    fix
}

/// Checks an existing map pin against `expected`; a missing pin is fine
/// (aya creates and pins the map). Never modifies the pin.
pub(super) fn check_map_pin(name: &str, pin: &Path, expected: &MapSpec) -> Result<(), DatapathError> {
    let not_a_map = |found: String| DatapathError::PinNotAMap {
        map: name.to_owned(),
        pin: pin.to_owned(),
        found,
        fix: format!(
            "stop every node daemon, move {} away, and start svc-loader again",
            pin.display()
        ),
    };
    match std::fs::symlink_metadata(pin) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(error) => {
            return Err(DatapathError::Pin {
                what: format!("inspecting the pin of map {name} at"),
                pin: pin.to_owned(),
                error,
            });
        }
        Ok(meta) if meta.is_dir() => return Err(not_a_map("a directory".to_owned())),
        Ok(_) => {}
    }
    let fd = sys::obj_get(pin).map_err(|error| DatapathError::Pin {
        what: format!("opening the pinned map {name} at"),
        pin: pin.to_owned(),
        error,
    })?;
    match sys::obj_kind(fd.as_fd()) {
        sys::ObjKind::Map | sys::ObjKind::Unknown => {}
        other => return Err(not_a_map(other.to_string())),
    }
    let found = sys::map_info(fd.as_fd())
        .map(MapSpec::from)
        .map_err(|error| DatapathError::Pin {
            what: format!("reading the pinned map {name} at"),
            pin: pin.to_owned(),
            error,
        })?;
    if found != *expected {
        return Err(DatapathError::PinMismatch {
            map: name.to_owned(),
            pin: pin.to_owned(),
            found,
            expected: *expected,
            fix: mismatch_fix(pin, &found, expected),
        });
    }
    Ok(())
}

/// Opens one pinned map of a running datapath for another process (svc-gc,
/// inspection), checking its type and key and value sizes against the
/// embedded object (not its size, which is the loader's option).
pub fn open_pinned_map(pin_dir: &Path, name: &str) -> Result<Map, DatapathError> {
    let opts = DatapathOptions::new(pin_dir);
    let specs = expected_specs(&opts)?;
    let expected = specs
        .get(name)
        .ok_or_else(|| DatapathError::InvalidOptions(format!("the datapath has no map {name}")))?;
    let pin = pin_dir.join(name);
    let fd = sys::obj_get(&pin).map_err(|error| DatapathError::Pin {
        what: format!("opening the pinned map {name} at"),
        pin: pin.clone(),
        error,
    })?;
    let found = sys::map_info(fd.as_fd())
        .map(MapSpec::from)
        .map_err(|error| DatapathError::Pin {
            what: format!("reading the pinned map {name} at"),
            pin: pin.clone(),
            error,
        })?;
    let expected = MapSpec {
        max_entries: found.max_entries,
        ..*expected
    };
    if found != expected {
        return Err(DatapathError::PinMismatch {
            map: name.to_owned(),
            pin: pin.clone(),
            found,
            expected,
            fix: "use the rivet binaries of the svc-loader that created the map".to_owned(),
        });
    }
    let data = MapData::from_fd(fd).map_err(|error| DatapathError::Pin {
        what: format!("using the pinned map {name} at"),
        pin: pin.clone(),
        error: io::Error::other(chain(&error).to_string()),
    })?;
    Map::from_map_data(data).map_err(|error| DatapathError::Pin {
        what: format!("using the pinned map {name} at"),
        pin,
        error: io::Error::other(chain(&error).to_string()),
    })
}
