//! `<state-dir>/services/`: one state file per object (crash-safe: written
//! to a temp file, fsynced and renamed), holding its origin, the object as
//! stored (a Service with its allocated clusterIPs and nodePorts) and a
//! Service's ids. Restored at start; what no longer reads is left out and
//! kept on disk.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rivet_common::state_file::{StateFile, StateFileError};
use serde::{Deserialize, Serialize};

use super::Origin;
use super::document::{Family, ObjectKey, ObjectKind};

/// A Service's id of one port and family.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdRecord {
    /// The port's name.
    pub port: String,
    /// The family.
    pub family: Family,
    /// The service id.
    pub id: u32,
}

/// One stored object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ObjectRecord {
    /// Who applied it.
    pub origin: Origin,
    /// The object as JSON (with the allocations).
    pub object: serde_json::Value,
    /// A Service's ids.
    #[serde(default)]
    pub service_ids: Vec<IdRecord>,
}

impl ObjectRecord {
    /// The ids as a map.
    pub fn ids(&self) -> BTreeMap<(String, Family), u32> {
        self.service_ids
            .iter()
            .map(|r| ((r.port.clone(), r.family), r.id))
            .collect()
    }

    /// Ids from a map.
    pub fn id_records(ids: &BTreeMap<(String, Family), u32>) -> Vec<IdRecord> {
        ids.iter()
            .map(|((port, family), id)| IdRecord {
                port: port.clone(),
                family: *family,
                id: *id,
            })
            .collect()
    }
}

/// The directory of stored objects.
#[derive(Debug, Clone)]
pub struct ObjectStore {
    dir: PathBuf,
}

const KIND: &str = "rivet.endpoint.service-object";
const SCHEMA: u32 = 1;

impl ObjectStore {
    /// The store in `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `service_<ns>_<name>.json` or `endpointslice_<ns>_<name>.json`
    /// (namespaces and names hold no `_`).
    fn file(&self, key: &ObjectKey) -> StateFile<ObjectRecord> {
        let kind = match key.kind {
            ObjectKind::Service => "service",
            ObjectKind::EndpointSlice => "endpointslice",
        };
        StateFile::new(
            self.dir.join(format!("{kind}_{}_{}.json", key.namespace, key.name)),
            KIND,
            SCHEMA,
        )
    }

    /// Writes one object durably.
    pub fn store(&self, key: &ObjectKey, record: &ObjectRecord) -> Result<(), StateFileError> {
        self.file(key).store(record)
    }

    /// Removes one object (absent is fine).
    pub fn remove(&self, key: &ObjectKey) -> Result<(), std::io::Error> {
        match std::fs::remove_file(self.file(key).path()) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Every stored object, in file name order: Ok records and the files
    /// that did not read (path, why).
    pub fn load_all(&self) -> (Vec<ObjectRecord>, Vec<(PathBuf, String)>) {
        let mut records = Vec::new();
        let mut failed = Vec::new();
        let mut paths: Vec<PathBuf> = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "json"))
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                failed.push((self.dir.clone(), e.to_string()));
                Vec::new()
            }
        };
        paths.sort();
        for path in paths {
            match StateFile::<ObjectRecord>::new(path.clone(), KIND, SCHEMA).load() {
                Ok(Some(record)) => records.push(record),
                Ok(None) => {}
                Err(e) => failed.push((path, e.to_string())),
            }
        }
        (records, failed)
    }
}
