//! `<state-dir>/endpoints/`: one directory per endpoint holding its state
//! file, written crash-safely with the seed's scheme (DESIGN.md §1):
//!
//! - `<id>/endpoint.json`: the last completed regeneration;
//! - `<id>_next/`: a regeneration being written; renamed to `<id>` on success
//!   (the old `<id>` is moved to `<id>_stale` for the swap, then removed);
//! - `<id>_next_fail/`: the state a failed regeneration tried to write, kept
//!   for debugging until the next success.
//!
//! Restore reads all of them and prefers the newest complete record of each
//! id; `_next_fail` only when nothing else exists.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use rivet_common::labels::Labels;
use rivet_common::state_file::{StateFile, StateFileError};
use serde::{Deserialize, Serialize};

use crate::endpoint::EndpointSpec;

const FILE_NAME: &str = "endpoint.json";
const KIND: &str = "rivet.endpoint";
const SCHEMA_VERSION: u32 = 1;

/// What the state dir holds for one endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointRecord {
    /// What the endpoint was created with.
    pub spec: EndpointSpec,
    /// The identity realised by the regeneration that wrote the record.
    pub identity: u32,
    /// Its labels.
    pub identity_labels: Labels,
    /// The policy revision realised.
    pub policy_revision: u64,
    /// When the record was written (restore prefers the newest).
    pub written: SystemTime,
}

/// Which directory a restored record came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RecordSource {
    /// `<id>`.
    Current,
    /// `<id>_next`: a regeneration completed its write but not the rename.
    Next,
    /// `<id>_stale`: the previous state during a swap.
    Stale,
    /// `<id>_next_fail`: a failed regeneration's state.
    NextFail,
}

impl RecordSource {
    fn suffix(self) -> &'static str {
        match self {
            Self::Current => "",
            Self::Next => "_next",
            Self::Stale => "_stale",
            Self::NextFail => "_next_fail",
        }
    }

    const ALL: [RecordSource; 4] = [Self::Current, Self::Next, Self::Stale, Self::NextFail];
}

/// Why the state dir could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateDirError {
    /// A filesystem operation failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// On what.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A state file could not be written or read.
    #[error(transparent)]
    File(#[from] StateFileError),
}

/// The result of reading the state dir at start.
#[derive(Debug, Default)]
pub struct Scan {
    /// The newest usable record of each id.
    pub records: BTreeMap<u16, (EndpointRecord, RecordSource)>,
    /// Ids whose directories could not be read (kept on disk, reported).
    pub unreadable: BTreeMap<u16, String>,
}

/// The endpoints' state directory.
///
/// ```
/// use svc_endpoint::state_dir::EndpointStateDir;
/// let dir = tempfile::tempdir()?;
/// let state = EndpointStateDir::new(dir.path().join("endpoints"));
/// assert!(state.scan()?.records.is_empty());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct EndpointStateDir {
    root: PathBuf,
}

impl EndpointStateDir {
    /// The state dir at `root` (created on first write).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// Its path.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn dir(&self, id: u16, source: RecordSource) -> PathBuf {
        self.root.join(format!("{id}{}", source.suffix()))
    }

    fn file(&self, id: u16, source: RecordSource) -> StateFile<EndpointRecord> {
        StateFile::new(self.dir(id, source).join(FILE_NAME), KIND, SCHEMA_VERSION)
    }

    /// Writes a completed regeneration's record: `<id>_next`, then swapped
    /// into `<id>`. Durable when it returns; a crash at any point leaves a
    /// complete record of either the old or the new state.
    pub fn write(&self, record: &EndpointRecord) -> Result<(), StateDirError> {
        let id = record.spec.id;
        let next = self.dir(id, RecordSource::Next);
        remove_dir(&next)?;
        self.file(id, RecordSource::Next).store(record)?;
        let current = self.dir(id, RecordSource::Current);
        let stale = self.dir(id, RecordSource::Stale);
        if current.exists() {
            remove_dir(&stale)?;
            rename(&current, &stale)?;
        }
        rename(&next, &current)?;
        sync_dir(&self.root)?;
        remove_dir(&stale)?;
        remove_dir(&self.dir(id, RecordSource::NextFail))?;
        Ok(())
    }

    /// Keeps the state a failed regeneration tried to write in `<id>_next_fail`.
    pub fn write_failed(&self, record: &EndpointRecord) -> Result<(), StateDirError> {
        let id = record.spec.id;
        let fail = self.dir(id, RecordSource::NextFail);
        remove_dir(&fail)?;
        self.file(id, RecordSource::NextFail).store(record)?;
        Ok(())
    }

    /// Removes every directory of endpoint `id`. Idempotent.
    pub fn remove(&self, id: u16) -> Result<(), StateDirError> {
        for source in RecordSource::ALL {
            remove_dir(&self.dir(id, source))?;
        }
        if self.root.is_dir() {
            sync_dir(&self.root)?;
        }
        Ok(())
    }

    /// Reads every endpoint's newest complete record.
    pub fn scan(&self) -> Result<Scan, StateDirError> {
        let mut scan = Scan::default();
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(scan),
            Err(source) => {
                return Err(StateDirError::Io {
                    action: "listing",
                    path: self.root.clone(),
                    source,
                });
            }
        };
        let mut ids = BTreeMap::<u16, ()>::new();
        for entry in entries {
            let entry = entry.map_err(|source| StateDirError::Io {
                action: "listing",
                path: self.root.clone(),
                source,
            })?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            match parse_dir_name(name) {
                Some((id, _)) => {
                    ids.insert(id, ());
                }
                None if name.ends_with(".tmp") => {}
                None => {
                    tracing::warn!(entry = name, dir = %self.root.display(), "unexpected entry in the endpoint state dir; left alone")
                }
            }
        }
        for id in ids.into_keys() {
            let mut best: Option<(EndpointRecord, RecordSource)> = None;
            let mut errors = Vec::new();
            for source in RecordSource::ALL {
                match self.file(id, source).load() {
                    Ok(Some(record)) if record.spec.id == id => {
                        let better = match &best {
                            None => true,
                            // `_next_fail` only when nothing else exists.
                            Some((_, RecordSource::NextFail)) => true,
                            Some((current, _)) => source != RecordSource::NextFail && record.written > current.written,
                        };
                        if better {
                            best = Some((record, source));
                        }
                    }
                    Ok(Some(record)) => errors.push(format!(
                        "{}: holds endpoint {} instead of {id}",
                        self.dir(id, source).display(),
                        record.spec.id
                    )),
                    Ok(None) => {}
                    Err(e) => errors.push(e.to_string()),
                }
            }
            match best {
                Some(found) => {
                    for e in &errors {
                        tracing::warn!(endpoint = id, error = %e, "ignoring an unreadable endpoint state file");
                    }
                    scan.records.insert(id, found);
                }
                None if errors.is_empty() => {
                    scan.unreadable.insert(id, "directory without a state file".into());
                }
                None => {
                    scan.unreadable.insert(id, errors.join("; "));
                }
            }
        }
        Ok(scan)
    }
}

/// `"12"` → (12, Current), `"12_next"` → (12, Next), ...
fn parse_dir_name(name: &str) -> Option<(u16, RecordSource)> {
    let (digits, source) = RecordSource::ALL
        .iter()
        .rev()
        .find_map(|s| name.strip_suffix(s.suffix()).map(|d| (d, *s)))?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let id: u16 = digits.parse().ok()?;
    (id != 0).then_some((id, source))
}

fn remove_dir(path: &Path) -> Result<(), StateDirError> {
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        // Gone, or its parent is not even a directory: nothing to remove.
        Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => Ok(()),
        Err(source) => Err(StateDirError::Io {
            action: "removing",
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn rename(from: &Path, to: &Path) -> Result<(), StateDirError> {
    fs::rename(from, to).map_err(|source| StateDirError::Io {
        action: "renaming",
        path: from.to_path_buf(),
        source,
    })
}

fn sync_dir(path: &Path) -> Result<(), StateDirError> {
    fs::File::open(path)
        .and_then(|dir| dir.sync_all())
        .map_err(|source| StateDirError::Io {
            action: "syncing",
            path: path.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointAddress;
    use std::time::Duration;

    fn record(id: u16, identity: u32, written: SystemTime) -> EndpointRecord {
        EndpointRecord {
            spec: EndpointSpec {
                id,
                container_id: format!("c{id}"),
                interface: "eth0".into(),
                netns_path: "/run/netns/x".into(),
                host_interface: format!("lxc{id}"),
                host_ifindex: 7,
                addresses: vec![EndpointAddress {
                    address: "198.18.0.5".parse().unwrap(),
                    ipam_pool: "default".into(),
                }],
                mac: [2, 0, 0, 0, 0, 5],
                pod_namespace: "default".into(),
                pod_name: "p".into(),
                pod_uid: String::new(),
                labels: "k8s:app=web".parse().unwrap(),
                named_ports: Vec::new(),
                created: SystemTime::UNIX_EPOCH,
                labels_pending: false,
                kind: Default::default(),
            },
            identity,
            identity_labels: Labels::new(),
            policy_revision: 1,
            written,
        }
    }

    #[test]
    fn a_write_replaces_the_record_and_leaves_only_the_numeric_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = EndpointStateDir::new(tmp.path().join("endpoints"));
        let t0 = SystemTime::now();
        dir.write(&record(3, 300, t0)).unwrap();
        dir.write_failed(&record(3, 301, t0 + Duration::from_secs(1))).unwrap();
        dir.write(&record(3, 302, t0 + Duration::from_secs(2))).unwrap();
        let names: Vec<String> = fs::read_dir(dir.root())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec!["3"], "a successful write must leave exactly `<id>`");
        let scan = dir.scan().unwrap();
        assert_eq!(scan.records[&3].0.identity, 302, "the newest record must be restored");
        dir.remove(3).unwrap();
        assert!(dir.scan().unwrap().records.is_empty(), "remove must leave nothing");
        dir.remove(3).expect("remove must be idempotent");
    }

    #[test]
    fn a_crash_mid_swap_restores_the_newest_complete_record() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = EndpointStateDir::new(tmp.path());
        let t0 = SystemTime::now();
        // Crash after moving `<id>` aside, before renaming `_next`.
        dir.file(4, RecordSource::Stale).store(&record(4, 400, t0)).unwrap();
        dir.file(4, RecordSource::Next)
            .store(&record(4, 401, t0 + Duration::from_secs(1)))
            .unwrap();
        // A failure record is newer but only a fallback.
        dir.write_failed(&record(4, 402, t0 + Duration::from_secs(2))).unwrap();
        // Only a failure record exists for 5.
        dir.write_failed(&record(5, 500, t0)).unwrap();
        let scan = dir.scan().unwrap();
        assert_eq!(
            (scan.records[&4].0.identity, scan.records[&4].1),
            (401, RecordSource::Next),
            "the newest complete record must win over an older one and over a failure"
        );
        assert_eq!(
            scan.records[&5].1,
            RecordSource::NextFail,
            "a failure record is used when nothing else exists"
        );
    }

    #[test]
    fn torn_and_foreign_entries_are_reported_not_restored() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = EndpointStateDir::new(tmp.path());
        fs::create_dir_all(tmp.path().join("9")).unwrap();
        fs::write(tmp.path().join("9").join(FILE_NAME), b"{\"kind\":").unwrap();
        fs::create_dir_all(tmp.path().join("lost+found")).unwrap();
        fs::create_dir_all(tmp.path().join("0")).unwrap();
        let scan = dir.scan().unwrap();
        assert!(scan.records.is_empty(), "a torn file must not be restored");
        assert!(scan.unreadable.contains_key(&9), "a torn file must be reported");
        assert_eq!(scan.unreadable.len(), 1, "non-endpoint entries must be ignored");
    }

    #[test]
    fn dir_names_parse() {
        assert_eq!(parse_dir_name("12"), Some((12, RecordSource::Current)));
        assert_eq!(parse_dir_name("12_next"), Some((12, RecordSource::Next)));
        assert_eq!(parse_dir_name("12_next_fail"), Some((12, RecordSource::NextFail)));
        assert_eq!(parse_dir_name("12_stale"), Some((12, RecordSource::Stale)));
        for bad in ["", "_next", "0", "70000", "12x", "x_next", "12_next_fail_next"] {
            assert_eq!(parse_dir_name(bad), None, "{bad:?} is not an endpoint dir");
        }
    }
}
