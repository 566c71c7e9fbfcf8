//! [`DatapathError`]: everything the datapath can fail with, each message
//! saying what was being done and to what.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use aya::EbpfError;
use aya::maps::MapError;
use aya::programs::ProgramError;

use super::attach::Hook;
use rivet_datapath::spec::MapSpec;

/// Renders an error with all its sources (`a: b: c`); aya keeps the useful
/// part (the errno, the verifier log) in the sources.
pub(super) struct Chain<'a>(&'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(err) = source {
            write!(f, ": {err}")?;
            source = err.source();
        }
        Ok(())
    }
}

pub(super) fn chain<'a>(err: &'a (dyn std::error::Error + 'static)) -> Chain<'a> {
    Chain(err)
}

/// Options that cannot work (see [`DatapathOptions`](super::DatapathOptions)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    /// The pin directory is relative.
    #[error("pin directory {} must be an absolute path on a bpffs", pin_dir.display())]
    RelativePinDir {
        /// The pin directory.
        pin_dir: PathBuf,
    },
    /// A map would have no room at all.
    #[error("the size of map {map} must not be 0")]
    ZeroSize {
        /// The map.
        map: &'static str,
    },
    /// The event ring buffer is bigger than the loader allows.
    #[error("events ring buffer of {bytes} bytes is too big (at most 1 GiB)")]
    EventsTooBig {
        /// The size asked for.
        bytes: u32,
    },
}

/// What the embedded object lacks (a build bug: the tests catch it).
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    /// The object does not parse.
    #[error("it does not parse: {0}")]
    Parse(#[from] aya_obj::ParseError),
    /// A map of the datapath ABI is missing.
    #[error("it has no map {0}")]
    MissingMap(&'static str),
    /// A program is missing.
    #[error("it has no program {0}")]
    MissingProgram(&'static str),
    /// An LPM trie is preallocated (the kernel refuses to create it).
    #[error("its LPM trie {0} must be created with BPF_F_NO_PREALLOC")]
    PreallocatedLpmTrie(&'static str),
}

/// Everything [`Datapath`](super::Datapath) can fail with; each message says what was being
/// done and to what (map, pin path, program, interface).
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// The options cannot work.
    #[error("invalid datapath options: {0}")]
    InvalidOptions(#[from] OptionsError),
    /// The node name cannot name a pin directory.
    #[error(transparent)]
    PinDir(#[from] rivet_datapath::PinDirError),
    /// The pin directory is not on a BPF filesystem.
    #[error(
        "{} is not on a BPF filesystem (found filesystem type {fs_type:#x}); \
         mount one with `mount -t bpf bpf /sys/fs/bpf`",
        path.display()
    )]
    NotBpffs {
        /// The directory checked (the nearest existing ancestor of the pin directory).
        path: PathBuf,
        /// Its `statfs` type.
        fs_type: i64,
    },
    /// A file system operation failed.
    #[error("{what} {}: {error}", path.display())]
    Io {
        /// What was being done.
        what: String,
        /// On what.
        path: PathBuf,
        /// The error.
        error: io::Error,
    },
    /// The embedded object lacks something the loader needs (a build bug).
    #[error("the embedded datapath object is unusable: {0}")]
    Object(#[from] ObjectError),
    /// A pinned map differs from what the datapath needs.
    #[error("map `{map}` pinned at {} is {found}, but the datapath needs {expected}; to fix: {fix}", pin.display())]
    PinMismatch {
        /// The map name.
        map: String,
        /// Its pin.
        pin: PathBuf,
        /// What the pinned map is.
        found: MapSpec,
        /// What this object with these options needs.
        expected: MapSpec,
        /// What the operator can do.
        fix: String,
    },
    /// Something other than a map is pinned where a map belongs.
    #[error("{} should be the pinned map `{map}` but is {found}; to fix: {fix}", pin.display())]
    PinNotAMap {
        /// The map name.
        map: String,
        /// The pin path.
        pin: PathBuf,
        /// What is there instead.
        found: String,
        /// What the operator can do.
        fix: String,
    },
    /// A pinned object could not be opened or inspected.
    #[error("{what} {}: {error}", pin.display())]
    Pin {
        /// What was being done.
        what: String,
        /// The pin path.
        pin: PathBuf,
        /// The error.
        error: io::Error,
    },
    /// Creating or reusing the maps failed.
    #[error(
        "loading the datapath object with its maps pinned under {}: {}; \
         loading needs CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON, and write access to the pin directory",
        pin_dir.display(),
        chain(&**.error)
    )]
    Load {
        /// The pin directory.
        pin_dir: PathBuf,
        /// aya's error.
        error: Box<EbpfError>,
    },
    /// A program could not be loaded (verifier) or inspected.
    #[error("{what} program {program}: {}", chain(&**.error))]
    Program {
        /// What was being done.
        what: &'static str,
        /// The program name.
        program: &'static str,
        /// aya's error.
        error: Box<ProgramError>,
    },
    /// A map operation failed.
    #[error("{what} map {map}: {}", chain(&**.error))]
    Map {
        /// What was being done.
        what: String,
        /// The map name.
        map: &'static str,
        /// aya's error.
        error: Box<MapError>,
    },
    /// No interface with that index in the loader's network namespace.
    #[error("no interface with ifindex {ifindex} in the loader's network namespace")]
    InterfaceNotFound {
        /// The index asked for.
        ifindex: u32,
    },
    /// Looking up an interface failed (not: the interface does not exist).
    #[error("looking up interface {ifindex}: {error}")]
    Netdev {
        /// The index asked for.
        ifindex: u32,
        /// The error.
        error: io::Error,
    },
    /// Using a program for an attachment failed.
    #[error("{what} {program} on {hook} of {ifname} (ifindex {ifindex}): {}", chain(&**.error))]
    Attach {
        /// What was being done.
        what: &'static str,
        /// The program.
        program: &'static str,
        /// The hook.
        hook: Hook,
        /// The interface index.
        ifindex: u32,
        /// The interface name (or `?`).
        ifname: String,
        /// aya's error.
        error: Box<ProgramError>,
    },
    /// Listing the interfaces of the loader's namespace failed.
    #[error("listing the interfaces of the loader's network namespace: {error}")]
    Interfaces {
        /// The error.
        error: io::Error,
    },
    /// `BPF_PROG_TEST_RUN` of a program failed.
    #[error("test-running program {program} on a {len}-byte frame from ifindex {ifindex}: {error}")]
    TestRun {
        /// The program.
        program: &'static str,
        /// The frame's length.
        len: usize,
        /// The interface the frame came from.
        ifindex: u32,
        /// The kernel's answer.
        error: io::Error,
    },
    /// The socket LB's cgroup (`--socket-lb-cgroup`) is not a cgroup v2 directory.
    #[error(
        "{} cannot take the socket load balancer: {reason}; give a directory of the cgroup v2 \
         hierarchy (e.g. /sys/fs/cgroup or, on a hybrid host, /sys/fs/cgroup/unified)",
        path.display()
    )]
    NotCgroup2 {
        /// The path given.
        path: PathBuf,
        /// Why not.
        reason: String,
    },
    /// A tc request (qdisc or filter) for an interface failed.
    #[error("{what} (ifindex {ifindex}): {error}")]
    Tc {
        /// What was being done, to what.
        what: String,
        /// The interface index.
        ifindex: u32,
        /// The kernel's answer.
        error: io::Error,
    },
}

pub(super) fn io_err(what: impl Into<String>, path: &Path) -> impl FnOnce(io::Error) -> DatapathError {
    let (what, path) = (what.into(), path.to_owned());
    move |error| DatapathError::Io { what, path, error }
}

pub(super) fn map_err(what: impl Into<String>, map: &'static str) -> impl FnOnce(MapError) -> DatapathError {
    let what = what.into();
    move |error| DatapathError::Map {
        what,
        map,
        error: Box::new(error),
    }
}

pub(super) fn tc_err(what: String, ifindex: u32, error: io::Error) -> DatapathError {
    DatapathError::Tc { what, ifindex, error }
}
