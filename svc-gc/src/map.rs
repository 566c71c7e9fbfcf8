//! Access to one BPF hash map for a sweep: read it in chunks, look single
//! entries up again, delete sets of keys, estimate its fill.
//!
//! [`EntryMap`] is the seam (tests wrap it to act between the read and the
//! delete of a pass); [`PinnedMap`] is the real thing: a map opened by its pin
//! path, read-write, used through raw `bpf(2)` batch commands
//! (`BPF_MAP_LOOKUP_BATCH`, `BPF_MAP_DELETE_BATCH`) with a per-element
//! fallback (`BPF_MAP_GET_NEXT_KEY` + `BPF_MAP_LOOKUP_ELEM`,
//! `BPF_MAP_DELETE_ELEM`) when the kernel refuses batches.

use std::fmt;
use std::io;
use std::os::fd::{AsFd as _, OwnedFd};
use std::path::{Path, PathBuf};

use aya::maps::Map;
use rand::Rng as _;
use rivet_datapath::spec::{MapDef, map_type_name};
use rivet_datapath::{PinnedMapError, open_pinned_map};

use crate::sys;

/// Entries read per `BPF_MAP_LOOKUP_BATCH` call (and per chunk a pass
/// classifies before it deletes): big enough that syscalls are a small part
/// of a dump, small enough that a chunk is read, checked and deleted within
/// a millisecond or two.
pub const CHUNK: usize = 4096;

/// Entries read per probe when estimating the fill of a map.
const PROBE_ENTRIES: usize = 128;
/// Probes per estimate.
const PROBES: usize = 16;

/// How a [`PinnedMap`] reads and deletes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BatchMode {
    /// Batch commands, falling back to per-element ones (for good, on this
    /// map) the first time the kernel refuses a batch.
    #[default]
    Auto,
    /// Per-element commands only.
    Never,
}

/// A map operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    /// A syscall on the map failed.
    #[error("{op} on map {map}: {source}")]
    Io {
        /// Map name.
        map: String,
        /// What was done.
        op: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// The map could not be opened (not pinned yet, wrong shape).
    #[error("opening map {map}: {source}")]
    Open {
        /// Map name.
        map: String,
        /// Why.
        source: Box<PinnedMapError>,
    },
    /// The pinned map is not a hash map (the datapath ABI says it is).
    #[error("opening map {map}: it is not a hash map ({})", map_type_name(*map_type))]
    NotAHashMap {
        /// Map name.
        map: String,
        /// Its `BPF_MAP_TYPE_*`.
        map_type: u32,
    },
    /// The map's key or value size is not the size of the Rust types
    /// used to read it.
    #[error(
        "opening map {map}: key/value sizes {key_size}/{value_size} bytes, expected {expected_key_size}/{expected_value_size}"
    )]
    Sizes {
        /// Map name.
        map: String,
        /// The map's key size.
        key_size: u32,
        /// The map's value size.
        value_size: u32,
        /// The key type's size.
        expected_key_size: usize,
        /// The value type's size.
        expected_value_size: usize,
    },
    /// A per-element scan kept restarting (its cursor key vanished again
    /// and again) and was stopped.
    #[error("scan of map {map} stopped after {scanned} entries: the iteration kept restarting")]
    ScanRestarts {
        /// Map name.
        map: String,
        /// Entries visited.
        scanned: u64,
    },
}

/// What a delete of a set of keys did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeleteOutcome {
    /// Indexes (into the keys given) of keys that were already gone.
    pub missing: Vec<usize>,
}

/// One hash map as a sweep uses it.
pub trait EntryMap: Send {
    /// Key type (`#[repr(C)]`, the map's key size).
    type Key: aya::Pod + PartialEq + Send;
    /// Value type (`#[repr(C)]`, the map's value size).
    type Value: aya::Pod + PartialEq + Send;

    /// Pin name, e.g. `ct4`.
    fn name(&self) -> &str;
    /// The map's max_entries.
    fn max_entries(&self) -> u32;
    /// Whether the last scan (or the current one) used batch commands.
    fn batched(&self) -> bool;
    /// Starts a new scan from the beginning of the map.
    fn begin_scan(&mut self);
    /// The next chunk of the scan into `keys` / `values` (cleared first);
    /// returns `false` once the map is exhausted (the chunk filled by that
    /// call may still hold entries). Entries deleted between chunks never
    /// disturb the scan.
    fn next_chunk(&mut self, keys: &mut Vec<Self::Key>, values: &mut Vec<Self::Value>) -> Result<bool, MapError>;
    /// The current value of one key.
    fn lookup(&mut self, key: &Self::Key) -> Result<Option<Self::Value>, MapError>;
    /// Deletes `keys`; keys already gone are reported, not errors.
    fn delete(&mut self, keys: &[Self::Key]) -> Result<DeleteOutcome, MapError>;
    /// Roughly how many entries the map holds, cheaply (a sample).
    fn estimate_len(&mut self) -> Result<u64, MapError>;
    /// Whether this handle still is the map its pin names (a pin replaced
    /// by a new map makes the handle stale: reopen it).
    fn is_current(&self) -> bool {
        true
    }
}

enum Cursor {
    Idle,
    Batch {
        token: Option<u64>,
        done: bool,
    },
    PerEntry {
        next: Option<Vec<u8>>,
        started: bool,
        done: bool,
        visited: u64,
    },
}

/// A pinned hash map opened read-write by path, with the key and value sizes
/// of `K` and `V` checked against the kernel's map.
pub struct PinnedMap<K, V> {
    name: String,
    pin: PathBuf,
    fd: OwnedFd,
    id: u32,
    max_entries: u32,
    mode: BatchMode,
    lookup_batch_ok: bool,
    delete_batch_ok: bool,
    used_batch: bool,
    cursor: Cursor,
    _types: std::marker::PhantomData<fn() -> (K, V)>,
}

impl<K, V> fmt::Debug for PinnedMap<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedMap")
            .field("name", &self.name)
            .field("pin", &self.pin)
            .field("id", &self.id)
            .field("max_entries", &self.max_entries)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl<K: aya::Pod + PartialEq + Send, V: aya::Pod + PartialEq + Send> PinnedMap<K, V> {
    /// Opens `<pin_dir>/<def.name>`, a map of the datapath: its type, key
    /// and value sizes and flags are checked against the datapath ABI's
    /// definition (as svc-loader creates it) and against `K` and `V`.
    pub fn open(pin_dir: &Path, def: &'static MapDef, mode: BatchMode) -> Result<Self, MapError> {
        let name = def.name;
        let map = open_pinned_map(pin_dir, def).map_err(|source| MapError::Open {
            map: name.to_owned(),
            source: Box::new(source),
        })?;
        let data = match map {
            Map::HashMap(data) | Map::LruHashMap(data) => data,
            _ => {
                return Err(MapError::NotAHashMap {
                    map: name.to_owned(),
                    map_type: def.map_type,
                });
            }
        };
        let fd = data.fd().as_fd().try_clone_to_owned().map_err(|source| MapError::Io {
            map: name.to_owned(),
            op: "duplicating the fd",
            source,
        })?;
        Self::from_fd(name, pin_dir.join(name), fd, mode)
    }

    /// Uses an open map fd (`pin` is where it is pinned, for staleness
    /// checks); checks the key and value sizes against `K` and `V`.
    pub fn from_fd(name: &str, pin: PathBuf, fd: OwnedFd, mode: BatchMode) -> Result<Self, MapError> {
        let info = sys::map_info(fd.as_fd()).map_err(|source| MapError::Io {
            map: name.to_owned(),
            op: "reading the info",
            source,
        })?;
        if info.key_size as usize != size_of::<K>() || info.value_size as usize != size_of::<V>() {
            return Err(MapError::Sizes {
                map: name.to_owned(),
                key_size: info.key_size,
                value_size: info.value_size,
                expected_key_size: size_of::<K>(),
                expected_value_size: size_of::<V>(),
            });
        }
        Ok(Self {
            name: name.to_owned(),
            pin,
            fd,
            id: info.id,
            max_entries: info.max_entries,
            mode,
            lookup_batch_ok: mode == BatchMode::Auto,
            delete_batch_ok: mode == BatchMode::Auto,
            used_batch: false,
            cursor: Cursor::Idle,
            _types: std::marker::PhantomData,
        })
    }

    /// The kernel's id of the map.
    pub fn id(&self) -> u32 {
        self.id
    }

    fn io(&self, op: &'static str) -> impl FnOnce(io::Error) -> MapError + '_ {
        move |source| MapError::Io {
            map: self.name.clone(),
            op,
            source,
        }
    }

    /// Writes entries with `BPF_MAP_UPDATE_BATCH` (per element where the
    /// kernel refuses batches); for tests and benchmarks.
    pub fn insert_all(&mut self, keys: &[K], values: &[V]) -> Result<(), MapError> {
        let fd = self.fd.as_fd();
        let mut at = 0;
        while at < keys.len().min(values.len()) {
            let end = (at + 65_536).min(keys.len());
            let (n, err) = sys::update_batch(fd, &keys[at..end], &values[at..end], 0);
            at += n;
            match err {
                None => {}
                Some(e) if sys::batch_unsupported(&e) && n == 0 => {
                    for i in at..end {
                        sys::update(fd, &keys[i], &values[i], 0).map_err(self.io("updating an element"))?;
                    }
                    at = end;
                }
                Some(e) => return Err(self.io("updating a batch")(e)),
            }
        }
        Ok(())
    }

    /// Writes one entry (`BPF_ANY`).
    pub fn insert(&mut self, key: &K, value: &V) -> Result<(), MapError> {
        sys::update(self.fd.as_fd(), key, value, 0).map_err(self.io("updating an element"))
    }

    /// Every entry, read with batches (or per element); for tests and
    /// benchmarks.
    pub fn dump(&mut self) -> Result<Vec<(K, V)>, MapError> {
        let mut out = Vec::new();
        let mut keys = Vec::with_capacity(CHUNK);
        let mut values = Vec::with_capacity(CHUNK);
        self.begin_scan();
        loop {
            let more = self.next_chunk(&mut keys, &mut values)?;
            out.extend(keys.iter().copied().zip(values.iter().copied()));
            if !more {
                return Ok(out);
            }
        }
    }

    fn next_chunk_batch(
        &mut self,
        token: Option<u64>,
        keys: &mut Vec<K>,
        values: &mut Vec<V>,
    ) -> Result<Option<(Option<u64>, bool)>, MapError> {
        keys.reserve(CHUNK);
        values.reserve(CHUNK);
        match sys::lookup_batch(self.fd.as_fd(), token, keys, values, CHUNK) {
            Ok(read) => Ok(Some((Some(read.next), read.done))),
            // Refused on the first call: this kernel (or map type) has no
            // batch lookup. Anything later is a real error.
            Err(e) if token.is_none() && sys::batch_unsupported(&e) => {
                tracing::warn!(map = %self.name, error = %e, "batch lookup refused; using per-element commands");
                self.lookup_batch_ok = false;
                Ok(None)
            }
            Err(e) => Err(self.io("BPF_MAP_LOOKUP_BATCH")(e)),
        }
    }

    fn next_chunk_per_entry(
        &mut self,
        mut next: Option<Vec<u8>>,
        started: bool,
        mut visited: u64,
        keys: &mut Vec<K>,
        values: &mut Vec<V>,
    ) -> Result<bool, MapError> {
        let fd = self.fd.as_fd();
        // The cursor is the next key not yet returned: the pass deletes only
        // returned keys, so the cursor survives unless the datapath drops it
        // (then the kernel restarts from the first key; bounded below).
        let mut current: Option<K> = match (&next, started) {
            (Some(bytes), _) => Some(from_bytes(bytes)),
            (None, false) => sys::next_key::<K>(fd, None).map_err(self.io("BPF_MAP_GET_NEXT_KEY"))?,
            (None, true) => None,
        };
        let limit = 2 * u64::from(self.max_entries) + CHUNK as u64;
        while let Some(key) = current {
            if keys.len() == CHUNK {
                break;
            }
            visited += 1;
            if visited > limit {
                return Err(MapError::ScanRestarts {
                    map: self.name.clone(),
                    scanned: visited,
                });
            }
            if let Some(value) = sys::lookup::<K, V>(fd, &key).map_err(self.io("BPF_MAP_LOOKUP_ELEM"))? {
                keys.push(key);
                values.push(value);
            }
            current = sys::next_key(fd, Some(&key)).map_err(self.io("BPF_MAP_GET_NEXT_KEY"))?;
        }
        next = current.map(|k| to_bytes(&k));
        let more = next.is_some();
        self.cursor = Cursor::PerEntry {
            done: !more,
            next,
            started: true,
            visited,
        };
        Ok(more)
    }

    fn delete_per_entry(&self, keys: &[K], from: usize, outcome: &mut DeleteOutcome) -> Result<(), MapError> {
        let fd = self.fd.as_fd();
        for (i, key) in keys.iter().enumerate().skip(from) {
            if !sys::delete(fd, key).map_err(self.io("BPF_MAP_DELETE_ELEM"))? {
                outcome.missing.push(i);
            }
        }
        Ok(())
    }
}

fn to_bytes<K: aya::Pod>(key: &K) -> Vec<u8> {
    // SAFETY: `K: Pod` is plain bytes without padding requirements on read.
    unsafe { std::slice::from_raw_parts(std::ptr::from_ref(key).cast::<u8>(), size_of::<K>()) }.to_vec()
}

fn from_bytes<K: aya::Pod>(bytes: &[u8]) -> K {
    assert_eq!(bytes.len(), size_of::<K>());
    // SAFETY: length checked; any bit pattern is a valid `K` (`Pod`).
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<K>()) }
}

impl<K: aya::Pod + PartialEq + Send, V: aya::Pod + PartialEq + Send> EntryMap for PinnedMap<K, V> {
    type Key = K;
    type Value = V;

    fn name(&self) -> &str {
        &self.name
    }

    fn max_entries(&self) -> u32 {
        self.max_entries
    }

    fn batched(&self) -> bool {
        self.used_batch
    }

    fn begin_scan(&mut self) {
        self.used_batch = self.lookup_batch_ok;
        self.cursor = if self.lookup_batch_ok {
            Cursor::Batch {
                token: None,
                done: false,
            }
        } else {
            Cursor::PerEntry {
                next: None,
                started: false,
                done: false,
                visited: 0,
            }
        };
    }

    fn next_chunk(&mut self, keys: &mut Vec<K>, values: &mut Vec<V>) -> Result<bool, MapError> {
        keys.clear();
        values.clear();
        match std::mem::replace(&mut self.cursor, Cursor::Idle) {
            Cursor::Idle => Ok(false),
            Cursor::Batch { done: true, .. } | Cursor::PerEntry { done: true, .. } => Ok(false),
            Cursor::Batch { token, done: false } => match self.next_chunk_batch(token, keys, values)? {
                Some((next, done)) => {
                    self.cursor = Cursor::Batch { token: next, done };
                    Ok(!done)
                }
                None => {
                    self.used_batch = false;
                    self.next_chunk_per_entry(None, false, 0, keys, values)
                }
            },
            Cursor::PerEntry {
                next,
                started,
                visited,
                done: false,
            } => self.next_chunk_per_entry(next, started, visited, keys, values),
        }
    }

    fn lookup(&mut self, key: &K) -> Result<Option<V>, MapError> {
        sys::lookup(self.fd.as_fd(), key).map_err(self.io("BPF_MAP_LOOKUP_ELEM"))
    }

    fn delete(&mut self, keys: &[K]) -> Result<DeleteOutcome, MapError> {
        let mut outcome = DeleteOutcome::default();
        let mut at = 0;
        while self.delete_batch_ok && at < keys.len() {
            let (n, err) = sys::delete_batch(self.fd.as_fd(), &keys[at..]);
            at += n;
            match err {
                None => {}
                // The kernel stops at a key that is already gone: note it, go on
                // after it.
                Some(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    outcome.missing.push(at);
                    at += 1;
                }
                Some(e) if n == 0 && sys::batch_unsupported(&e) => {
                    tracing::warn!(map = %self.name, error = %e, "batch delete refused; using per-element commands");
                    self.delete_batch_ok = false;
                }
                Some(e) => return Err(self.io("BPF_MAP_DELETE_BATCH")(e)),
            }
        }
        if at < keys.len() {
            self.used_batch = false;
            self.delete_per_entry(keys, at, &mut outcome)?;
        }
        Ok(outcome)
    }

    /// Samples the map: batch lookups from random bucket positions (a hash
    /// map's batch token is a bucket index, and it has max_entries rounded up
    /// to a power of two buckets) give entries per bucket. ±~3% at 16 × 128
    /// entries. Per-element mode has no cheap way: an error.
    fn estimate_len(&mut self) -> Result<u64, MapError> {
        let unsupported = || MapError::Io {
            map: self.name.clone(),
            op: "estimating the fill",
            source: io::Error::new(io::ErrorKind::Unsupported, "needs batch lookups"),
        };
        if !self.lookup_batch_ok {
            return Err(unsupported());
        }
        let buckets = u64::from(self.max_entries).next_power_of_two();
        let mut keys: Vec<K> = Vec::with_capacity(PROBE_ENTRIES);
        let mut values: Vec<V> = Vec::with_capacity(PROBE_ENTRIES);
        let (mut seen, mut spanned) = (0u64, 0u64);
        let mut rng = rand::rng();
        for _ in 0..PROBES {
            let start = rng.random_range(0..buckets);
            let read = match sys::lookup_batch(self.fd.as_fd(), Some(start), &mut keys, &mut values, PROBE_ENTRIES) {
                Ok(read) => read,
                // A bucket with more entries than a probe holds: skip it.
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => continue,
                Err(e) if sys::batch_unsupported(&e) => return Err(unsupported()),
                Err(e) => return Err(self.io("BPF_MAP_LOOKUP_BATCH")(e)),
            };
            let end = if read.done { buckets } else { read.next };
            if end < start || end > buckets {
                // Not a bucket index after all: this kernel's token is opaque.
                return Err(unsupported());
            }
            seen += read.count as u64;
            spanned += end - start;
            if spanned >= buckets {
                break;
            }
        }
        if spanned == 0 {
            return Ok(0);
        }
        let estimate = (seen as f64 / spanned as f64 * buckets as f64).round() as u64;
        Ok(estimate.min(u64::from(self.max_entries)))
    }

    fn is_current(&self) -> bool {
        sys::obj_get(&self.pin)
            .and_then(|fd| sys::map_info(fd.as_fd()))
            .is_ok_and(|info| info.id == self.id)
    }
}
