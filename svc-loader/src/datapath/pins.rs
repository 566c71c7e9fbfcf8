//! The loader's side of the map pins: the spec every pinned map must have
//! (from the embedded object and the options' sizes) and checking existing
//! pins before reuse. Names, specs and opening a pin from another process
//! are the datapath ABI's ([`rivet_datapath::spec`], [`rivet_datapath::pin`]).

use std::collections::BTreeMap;
use std::io;
use std::os::fd::AsFd as _;
use std::path::Path;

use rivet_bpf_sys as sys;
use rivet_datapath::spec::{self, BPF_F_NO_PREALLOC, BPF_MAP_TYPE_RINGBUF, MAP_NAMES, MapSpec};

use super::error::{DatapathError, ObjectError, io_err};
use super::options::DatapathOptions;
use crate::DATAPATH_OBJECT;

/// `BPF_FS_MAGIC` (linux/magic.h).
pub(super) const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

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
    let object = aya_obj::Object::parse(DATAPATH_OBJECT).map_err(ObjectError::from)?;
    let mut specs = BTreeMap::new();
    for (name, map) in &object.maps {
        if !matches!(
            map.section_kind(),
            aya_obj::EbpfSectionKind::Maps | aya_obj::EbpfSectionKind::BtfMaps
        ) {
            continue; // .rodata/.data/.bss: per load, never pinned
        }
        let ringbuf = map.map_type() == BPF_MAP_TYPE_RINGBUF;
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
    if let Some(name) = MAP_NAMES.into_iter().find(|name| !specs.contains_key(*name)) {
        return Err(ObjectError::MissingMap(name).into());
    }
    if let Some(def) = [spec::IPCACHE, spec::POLICY, spec::EP_PREFIXES]
        .into_iter()
        .find(|def| specs[def.name].flags & BPF_F_NO_PREALLOC == 0)
    {
        return Err(ObjectError::PreallocatedLpmTrie(def.name).into());
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
