//! Pinned maps against the real kernel (root, bpffs at /sys/fs/bpf): a map
//! created from its definition opens; a map of another shape under its pin
//! is refused with what was found and what was expected.

use std::path::PathBuf;

use aya::maps::{HashMap, MapData};
use rivet_datapath::maps::{Ct4Key, CtEntry};
use rivet_datapath::pin::{DEFAULT_BPFFS, create_pinned_map};
use rivet_datapath::spec::{self, BPF_MAP_TYPE_HASH};
use rivet_datapath::{PinnedMapError, open_pinned_map};

/// A unique pin directory, removed with its pins on drop.
struct PinDir(PathBuf);

impl PinDir {
    fn new(tag: &str) -> Self {
        let dir = PathBuf::from(DEFAULT_BPFFS)
            .join("rivet-test")
            .join(format!("abi-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir); // a leftover of a crashed run with the same pid
        Self(dir)
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("removing test pins {}: {e}", self.0.display());
        }
    }
}

#[test]
fn a_map_created_from_its_definition_opens_with_its_types() {
    let dir = PinDir::new("open");
    create_pinned_map(&dir.0, &spec::CT4, 128).unwrap();
    let map = open_pinned_map(&dir.0, &spec::CT4).unwrap();
    let ct4 = HashMap::<MapData, Ct4Key, CtEntry>::try_from(map).unwrap();
    assert_eq!(ct4.keys().count(), 0);

    // Another map's definition does not fit under this one's pin: missing.
    let err = open_pinned_map(&dir.0, &spec::CT6).unwrap_err();
    assert!(matches!(err, PinnedMapError::Open { map: "ct6", .. }), "{err}");
    assert!(
        err.to_string().contains(&dir.0.join("ct6").display().to_string()),
        "{err}"
    );
}

#[test]
fn a_map_of_another_shape_under_the_pin_is_refused() {
    let dir = PinDir::new("mismatch");
    std::fs::create_dir_all(&dir.0).unwrap();
    let wrong = HashMap::<MapData, u32, u32>::create(16, 0).unwrap();
    wrong.pin(dir.0.join("ct4")).unwrap();
    let err = open_pinned_map(&dir.0, &spec::CT4).unwrap_err();
    match &err {
        PinnedMapError::Mismatch {
            map, found, expected, ..
        } => {
            assert_eq!(*map, "ct4");
            assert_eq!(
                (found.map_type, found.key_size, found.value_size),
                (BPF_MAP_TYPE_HASH, 4, 4)
            );
            assert_eq!(*expected, spec::CT4.spec(16), "the expected size is the pinned one");
        }
        other => panic!("expected Mismatch, got {other}"),
    }
    let text = err.to_string();
    let wanted = format!("lru_hash (key 16 B, value {} B", spec::CT4.value_size);
    assert!(text.contains("map `ct4`") && text.contains(&wanted), "{text}");
}
