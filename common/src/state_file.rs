//! Crash-safe state files: written to a temp file, fsynced, renamed over the
//! old one and the directory fsynced, so a reader sees the old or the new
//! content, never a mix. Every file carries its kind and schema version; a
//! torn or foreign file is reported, never treated as empty.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Why a state file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    /// The file is not valid (torn write, manual edit, disk corruption).
    #[error("state file {path} is corrupt: {source}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The file holds another kind of state.
    #[error("state file {path} holds {found:?} state, expected {expected:?}")]
    WrongKind {
        /// The file.
        path: PathBuf,
        /// Kind in the file.
        found: String,
        /// Kind expected.
        expected: &'static str,
    },
    /// The file was written by an incompatible version.
    #[error("state file {path} has schema version {found}; this binary reads version {supported}")]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// Version in the file.
        found: u32,
        /// Version this binary reads.
        supported: u32,
    },
    /// Serialising the value failed.
    #[error("encoding state for {path}: {source}")]
    Encode {
        /// The file.
        path: PathBuf,
        /// The error.
        source: serde_json::Error,
    },
    /// An I/O step failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// To what.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
}

#[derive(Serialize)]
struct EnvelopeOut<'a, T> {
    kind: &'a str,
    schema_version: u32,
    data: &'a T,
}

#[derive(Deserialize)]
struct EnvelopeHeader {
    kind: String,
    schema_version: u32,
}

#[derive(Deserialize)]
struct EnvelopeIn<T> {
    data: T,
}

/// A typed state file at a fixed path.
///
/// ```
/// use rivet_common::state_file::StateFile;
/// let dir = tempfile::tempdir().unwrap();
/// let file: StateFile<Vec<u32>> = StateFile::new(dir.path().join("ids.json"), "ids", 1);
/// assert_eq!(file.load().unwrap(), None);
/// file.store(&vec![1, 2, 3]).unwrap();
/// assert_eq!(file.load().unwrap(), Some(vec![1, 2, 3]));
/// ```
#[derive(Debug, Clone)]
pub struct StateFile<T> {
    path: PathBuf,
    kind: &'static str,
    schema_version: u32,
    _value: PhantomData<fn() -> T>,
}

impl<T: Serialize + DeserializeOwned> StateFile<T> {
    /// A state file of `kind` at `path` with this binary's `schema_version`.
    pub fn new(path: impl Into<PathBuf>, kind: &'static str, schema_version: u32) -> Self {
        Self {
            path: path.into(),
            kind,
            schema_version,
            _value: PhantomData,
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the state; `None` when the file does not exist.
    pub fn load(&self) -> Result<Option<T>, StateFileError> {
        let bytes = match fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(self.io("reading", source)),
        };
        let corrupt = |source| StateFileError::Corrupt {
            path: self.path.clone(),
            source,
        };
        let header: EnvelopeHeader = serde_json::from_slice(&bytes).map_err(corrupt)?;
        if header.kind != self.kind {
            return Err(StateFileError::WrongKind {
                path: self.path.clone(),
                found: header.kind,
                expected: self.kind,
            });
        }
        if header.schema_version != self.schema_version {
            return Err(StateFileError::UnsupportedVersion {
                path: self.path.clone(),
                found: header.schema_version,
                supported: self.schema_version,
            });
        }
        let envelope: EnvelopeIn<T> = serde_json::from_slice(&bytes).map_err(corrupt)?;
        Ok(Some(envelope.data))
    }

    /// Replaces the state durably: when this returns Ok the new content
    /// survives a crash or power loss.
    pub fn store(&self, value: &T) -> Result<(), StateFileError> {
        let bytes = serde_json::to_vec(&EnvelopeOut {
            kind: self.kind,
            schema_version: self.schema_version,
            data: value,
        })
        .map_err(|source| StateFileError::Encode {
            path: self.path.clone(),
            source,
        })?;
        write_atomic(&self.path, &bytes).map_err(|(action, source)| self.io(action, source))
    }

    fn io(&self, action: &'static str, source: io::Error) -> StateFileError {
        StateFileError::Io {
            action,
            path: self.path.clone(),
            source,
        }
    }
}

/// Writes `bytes` to `path` atomically and durably (tmp + fsync + rename +
/// fsync of the directory). Creates the parent directory if needed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), (&'static str, io::Error)> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(|e| ("creating directory for", e))?;
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| ("creating temp file for", e))?;
    file.write_all(bytes).map_err(|e| ("writing temp file for", e))?;
    file.sync_all().map_err(|e| ("syncing temp file for", e))?;
    drop(file);
    fs::rename(&tmp, path).map_err(|e| ("renaming temp file over", e))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| ("syncing directory of", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct S {
        n: u32,
    }

    #[test]
    fn round_trip_and_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let f = StateFile::<S>::new(dir.path().join("sub/s.json"), "s", 3);
        f.store(&S { n: 1 }).unwrap();
        f.store(&S { n: 2 }).unwrap();
        assert_eq!(f.load().unwrap(), Some(S { n: 2 }));
        let leftovers: Vec<_> = fs::read_dir(dir.path().join("sub")).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp file is left behind");
    }

    #[test]
    fn torn_file_is_reported_not_treated_as_empty() {
        let dir = tempfile::tempdir().unwrap();
        let f = StateFile::<S>::new(dir.path().join("s.json"), "s", 1);
        f.store(&S { n: 7 }).unwrap();
        let full = fs::read(f.path()).unwrap();
        fs::write(f.path(), &full[..full.len() / 2]).unwrap();
        assert!(
            matches!(f.load(), Err(StateFileError::Corrupt { .. })),
            "a truncated file must be reported as corrupt"
        );
        fs::write(f.path(), b"").unwrap();
        assert!(
            matches!(f.load(), Err(StateFileError::Corrupt { .. })),
            "an empty file is corrupt too"
        );
    }

    #[test]
    fn unknown_version_and_kind_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.json");
        StateFile::<S>::new(&path, "s", 2).store(&S { n: 1 }).unwrap();
        let err = StateFile::<S>::new(&path, "s", 1).load().unwrap_err();
        assert!(
            matches!(
                err,
                StateFileError::UnsupportedVersion {
                    found: 2,
                    supported: 1,
                    ..
                }
            ),
            "{err}"
        );
        let err = StateFile::<S>::new(&path, "other", 2).load().unwrap_err();
        assert!(matches!(err, StateFileError::WrongKind { .. }), "{err}");
    }
}
