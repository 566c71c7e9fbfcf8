//! The raw `bpf(2)` commands Rivet needs and aya 0.14 does not expose, on
//! plain fds: `BPF_OBJ_GET` and object info for map pins, the map
//! commands of svc-gc's passes —
//! `BPF_MAP_LOOKUP_BATCH` / `BPF_MAP_DELETE_BATCH` / `BPF_MAP_UPDATE_BATCH`
//! plus the per-element commands of their fallback path — and
//! `BPF_PROG_TEST_RUN` for running a classifier on a frame in tests, and
//! `BPF_MAP_CREATE` / `BPF_OBJ_PIN` for maps made outside an object (tests
//! that build the pins of an earlier loader), and the link commands of
//! svc-loader's cgroup attachments (`BPF_LINK_CREATE` on a cgroup,
//! `BPF_LINK_UPDATE`, link info with its cgroup id).
//!
//! Every function takes keys and values as `aya::Pod` slices; their sizes must
//! be the map's key and value sizes (the callers check that once at open).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;

const BPF_MAP_CREATE: u32 = 0;
const BPF_MAP_LOOKUP_ELEM: u32 = 1;
const BPF_MAP_UPDATE_ELEM: u32 = 2;
const BPF_MAP_DELETE_ELEM: u32 = 3;
const BPF_MAP_GET_NEXT_KEY: u32 = 4;
const BPF_OBJ_PIN: u32 = 6;
const BPF_OBJ_GET: u32 = 7;
const BPF_PROG_TEST_RUN: u32 = 10;
const BPF_OBJ_GET_INFO_BY_FD: u32 = 15;
const BPF_MAP_LOOKUP_BATCH: u32 = 24;
const BPF_MAP_UPDATE_BATCH: u32 = 26;
const BPF_MAP_DELETE_BATCH: u32 = 27;
const BPF_LINK_CREATE: u32 = 28;
const BPF_LINK_UPDATE: u32 = 29;

/// `ENOTSUPP` (kernel-internal, 524): what old kernels answer for batch
/// commands a map type lacks.
pub const ENOTSUPP: i32 = 524;

/// Whether `err` means "this kernel or map type has no batch command": the
/// caller falls back to per-element commands.
pub fn batch_unsupported(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP | libc::ENOSYS)
    )
}

fn bpf<T>(cmd: u32, attr: &mut T) -> io::Result<i64> {
    // SAFETY: `attr` is a #[repr(C)] prefix of `union bpf_attr` for `cmd`,
    // valid for the size passed; the kernel reads (and for some commands
    // writes) only that many bytes, and every pointer inside points to
    // memory of the size the kernel derives from the map.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size_of::<T>()) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

#[repr(C)]
#[derive(Default)]
struct ElemAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

#[repr(C)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
}

#[repr(C)]
struct ObjGetAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// The head of `struct bpf_map_info` (the kernel copies as much as asked).
#[repr(C)]
#[derive(Default)]
struct RawMapInfo {
    map_type: u32,
    id: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    name: [u8; 16],
}

/// What the kernel says about a map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapInfo {
    /// `BPF_MAP_TYPE_*`.
    pub map_type: u32,
    /// Kernel map id (unique while the map exists).
    pub id: u32,
    /// Key size in bytes.
    pub key_size: u32,
    /// Value size in bytes.
    pub value_size: u32,
    /// max_entries.
    pub max_entries: u32,
    /// `BPF_F_*` creation flags.
    pub map_flags: u32,
}

/// The `BPF_PROG_TEST_RUN` part of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    pad: u32,
}

/// Offset of `ifindex` in `struct __sk_buff` (after len, pkt_type, mark,
/// queue_mapping, protocol, vlan_present, vlan_tci, vlan_proto, priority,
/// ingress_ifindex: ten `__u32`s).
const SKB_IFINDEX_OFFSET: usize = 40;

/// Runs a `sched_cls` program once on `frame` (an Ethernet frame) with
/// `BPF_PROG_TEST_RUN`, as if it arrived on interface `ifindex` of the
/// calling thread's network namespace (1 is `lo`; the kernel takes the
/// `__sk_buff` context's `ifindex` and fails with ENODEV for an unknown
/// one). Returns the program's return value (`TC_ACT_*`). Redirects are
/// reported, not performed; map writes are real.
pub fn test_run_classifier(prog: BorrowedFd<'_>, frame: &[u8], ifindex: u32) -> io::Result<u32> {
    test_run_classifier_repeat(prog, frame, ifindex, 1).map(|run| run.retval)
}

/// What a `BPF_PROG_TEST_RUN` of a classifier reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TestRun {
    /// The last run's return value (`TC_ACT_*`).
    pub retval: u32,
    /// Mean nanoseconds per run, measured by the kernel around its loop.
    pub duration_ns: u32,
}

/// [`test_run_classifier`] `repeat` times in the kernel, on one socket
/// buffer: a program that rewrites the frame sees its own rewrite on the
/// next run.
pub fn test_run_classifier_repeat(
    prog: BorrowedFd<'_>,
    frame: &[u8],
    ifindex: u32,
    repeat: u32,
) -> io::Result<TestRun> {
    // A `struct __sk_buff` prefix up to and including `ifindex`: the kernel
    // zero-fills the rest and refuses non-zero fields it does not take.
    let mut ctx = [0u8; SKB_IFINDEX_OFFSET + 4];
    ctx[SKB_IFINDEX_OFFSET..].copy_from_slice(&ifindex.to_ne_bytes());
    let mut attr = TestRunAttr {
        prog_fd: fd_u32(prog),
        data_size_in: u32::try_from(frame.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?,
        data_in: frame.as_ptr() as u64,
        repeat,
        ctx_size_in: ctx.len() as u32,
        ctx_in: ctx.as_ptr() as u64,
        ..TestRunAttr::default()
    };
    bpf(BPF_PROG_TEST_RUN, &mut attr)?;
    Ok(TestRun {
        retval: attr.retval,
        duration_ns: attr.duration,
    })
}

fn fd_u32(fd: BorrowedFd<'_>) -> u32 {
    fd.as_raw_fd() as u32
}

/// Opens a pinned object read-write (`BPF_OBJ_GET`, file_flags 0).
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in a pin path"))?;
    let mut attr = ObjGetAttr {
        pathname: c_path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: BPF_OBJ_GET returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `BPF_MAP_CREATE` of an unnamed map with no BTF.
pub fn map_create(
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
) -> io::Result<OwnedFd> {
    let mut attr = MapCreateAttr {
        map_type,
        key_size,
        value_size,
        max_entries,
        map_flags,
    };
    let fd = bpf(BPF_MAP_CREATE, &mut attr)?;
    // SAFETY: BPF_MAP_CREATE returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `BPF_OBJ_PIN`: pins the object `fd` at `path` (which must not exist).
pub fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in a pin path"))?;
    let mut attr = ObjGetAttr {
        pathname: c_path.as_ptr() as u64,
        bpf_fd: fd_u32(fd),
        file_flags: 0,
    };
    bpf(BPF_OBJ_PIN, &mut attr).map(drop)
}

/// `BPF_OBJ_GET_INFO_BY_FD` for a map.
pub fn map_info(fd: BorrowedFd<'_>) -> io::Result<MapInfo> {
    let mut info = RawMapInfo::default();
    let mut attr = InfoAttr {
        bpf_fd: fd_u32(fd),
        info_len: size_of::<RawMapInfo>() as u32,
        info: std::ptr::from_mut(&mut info) as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(MapInfo {
        map_type: info.map_type,
        id: info.id,
        key_size: info.key_size,
        value_size: info.value_size,
        max_entries: info.max_entries,
        map_flags: info.map_flags,
    })
}

#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
}

#[repr(C)]
struct LinkUpdateAttr {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

/// The head of `struct bpf_link_info` with its cgroup member (the union
/// starts at offset 16: it holds `__u64`s).
#[repr(C)]
#[derive(Default)]
struct RawLinkInfo {
    link_type: u32,
    id: u32,
    prog_id: u32,
    pad: u32,
    cgroup_id: u64,
    attach_type: u32,
    pad2: u32,
}

/// `BPF_LINK_TYPE_CGROUP`.
pub const BPF_LINK_TYPE_CGROUP: u32 = 3;

/// What the kernel says about a link; `cgroup_id` and `attach_type` only
/// for [`BPF_LINK_TYPE_CGROUP`] links (`cgroup_id` 0 once the cgroup is gone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkInfo {
    /// `BPF_LINK_TYPE_*`.
    pub link_type: u32,
    /// The link's id.
    pub id: u32,
    /// The id of the program it runs.
    pub prog_id: u32,
    /// The cgroup's id (its cgroup2 directory's inode number).
    pub cgroup_id: u64,
    /// `BPF_CGROUP_*` attach type.
    pub attach_type: u32,
}

/// `BPF_LINK_CREATE` of program `prog` on the cgroup directory `cgroup`
/// (an fd of the directory) at `attach_type`: the new link's fd. The
/// attachment lasts while the link has an fd or a pin.
pub fn link_create_cgroup(prog: BorrowedFd<'_>, cgroup: BorrowedFd<'_>, attach_type: u32) -> io::Result<OwnedFd> {
    let mut attr = LinkCreateAttr {
        prog_fd: fd_u32(prog),
        target_fd: fd_u32(cgroup),
        attach_type,
        flags: 0,
    };
    let fd = bpf(BPF_LINK_CREATE, &mut attr)?;
    // SAFETY: BPF_LINK_CREATE returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `BPF_LINK_UPDATE`: `link` runs `prog` from now on (atomically).
pub fn link_update(link: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = LinkUpdateAttr {
        link_fd: fd_u32(link),
        new_prog_fd: fd_u32(prog),
        flags: 0,
        old_prog_fd: 0,
    };
    bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
}

/// `BPF_OBJ_GET_INFO_BY_FD` for a link.
pub fn link_info(fd: BorrowedFd<'_>) -> io::Result<LinkInfo> {
    let mut info = RawLinkInfo::default();
    let mut attr = InfoAttr {
        bpf_fd: fd_u32(fd),
        info_len: size_of::<RawLinkInfo>() as u32,
        info: std::ptr::from_mut(&mut info) as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(LinkInfo {
        link_type: info.link_type,
        id: info.id,
        prog_id: info.prog_id,
        cgroup_id: if info.link_type == BPF_LINK_TYPE_CGROUP {
            info.cgroup_id
        } else {
            0
        },
        attach_type: if info.link_type == BPF_LINK_TYPE_CGROUP {
            info.attach_type
        } else {
            0
        },
    })
}

/// What kind of BPF object an fd is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjKind {
    /// A map.
    Map,
    /// A program.
    Program,
    /// A link.
    Link,
    /// /proc not readable: callers go on and let the info calls decide.
    Unknown,
}

impl std::fmt::Display for ObjKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Map => "a BPF map",
            Self::Program => "a BPF program",
            Self::Link => "a BPF link",
            Self::Unknown => "an unknown BPF object",
        })
    }
}

/// From the fd's anon inode name (`bpf-map`, `bpf-prog`, `bpf_link`):
/// `BPF_OBJ_GET_INFO_BY_FD` happily answers for any kind.
pub fn obj_kind(fd: BorrowedFd<'_>) -> ObjKind {
    match std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())) {
        Ok(target) => match target.to_string_lossy().as_ref() {
            "anon_inode:bpf-map" => ObjKind::Map,
            "anon_inode:bpf-prog" => ObjKind::Program,
            "anon_inode:bpf_link" => ObjKind::Link,
            _ => ObjKind::Unknown,
        },
        Err(_) => ObjKind::Unknown,
    }
}

/// `statfs(2)` `f_type` of `path` (is it a bpffs?).
pub fn fs_type(path: &Path) -> io::Result<i64> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in a path"))?;
    // SAFETY: statfs fills the zeroed struct it is given.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid path and a valid out pointer.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut buf) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(buf.f_type as i64)
}

/// `BPF_MAP_LOOKUP_ELEM`: `Ok(None)` when the key is absent.
pub fn lookup<K: aya::Pod, V: aya::Pod>(fd: BorrowedFd<'_>, key: &K) -> io::Result<Option<V>> {
    let mut value = std::mem::MaybeUninit::<V>::zeroed();
    let mut attr = ElemAttr {
        map_fd: fd_u32(fd),
        key: std::ptr::from_ref(key) as u64,
        value: value.as_mut_ptr() as u64,
        ..ElemAttr::default()
    };
    match bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) {
        // SAFETY: zeroed, then filled by the kernel; `V: Pod` accepts any bits.
        Ok(_) => Ok(Some(unsafe { value.assume_init() })),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `BPF_MAP_UPDATE_ELEM` with `flags` (`BPF_ANY` = 0).
pub fn update<K: aya::Pod, V: aya::Pod>(fd: BorrowedFd<'_>, key: &K, value: &V, flags: u64) -> io::Result<()> {
    let mut attr = ElemAttr {
        map_fd: fd_u32(fd),
        key: std::ptr::from_ref(key) as u64,
        value: std::ptr::from_ref(value) as u64,
        flags,
        ..ElemAttr::default()
    };
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(drop)
}

/// `BPF_MAP_DELETE_ELEM`: `Ok(false)` when the key was already gone.
pub fn delete<K: aya::Pod>(fd: BorrowedFd<'_>, key: &K) -> io::Result<bool> {
    let mut attr = ElemAttr {
        map_fd: fd_u32(fd),
        key: std::ptr::from_ref(key) as u64,
        ..ElemAttr::default()
    };
    match bpf(BPF_MAP_DELETE_ELEM, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `BPF_MAP_GET_NEXT_KEY`: the key after `key` (the first key for `None`, and
/// also for a key that is no longer in the map), `Ok(None)` at the end.
pub fn next_key<K: aya::Pod>(fd: BorrowedFd<'_>, key: Option<&K>) -> io::Result<Option<K>> {
    let mut next = std::mem::MaybeUninit::<K>::zeroed();
    let mut attr = ElemAttr {
        map_fd: fd_u32(fd),
        key: key.map_or(0, |k| std::ptr::from_ref(k) as u64),
        value: next.as_mut_ptr() as u64,
        ..ElemAttr::default()
    };
    match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
        // SAFETY: zeroed, then filled by the kernel; `K: Pod`.
        Ok(_) => Ok(Some(unsafe { next.assume_init() })),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// One `BPF_MAP_LOOKUP_BATCH` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchRead {
    /// Entries written to the front of the buffers.
    pub count: usize,
    /// The token to continue from (for hash maps: the next bucket index).
    pub next: u64,
    /// The map has no more entries after these.
    pub done: bool,
}

/// `BPF_MAP_LOOKUP_BATCH` into the spare capacity of `keys` and `values`
/// (both cleared first; at most `max` entries, bounded by their capacity),
/// starting at token `from` (`None`: the beginning).
///
/// Errors as the kernel returns them; [`batch_unsupported`] tells the ones
/// that mean "use per-element commands".
pub fn lookup_batch<K: aya::Pod, V: aya::Pod>(
    fd: BorrowedFd<'_>,
    from: Option<u64>,
    keys: &mut Vec<K>,
    values: &mut Vec<V>,
    max: usize,
) -> io::Result<BatchRead> {
    keys.clear();
    values.clear();
    let count = max.min(keys.capacity()).min(values.capacity()).min(u32::MAX as usize);
    // The token is a u32 bucket index for hash maps; the kernel copies what
    // it needs from the front of these 8 zeroed bytes.
    let in_token: u64 = from.unwrap_or(0);
    let mut out_token: u64 = 0;
    let mut attr = BatchAttr {
        in_batch: from.map_or(0, |_| std::ptr::from_ref(&in_token) as u64),
        out_batch: std::ptr::from_mut(&mut out_token) as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count: count as u32,
        map_fd: fd_u32(fd),
        ..BatchAttr::default()
    };
    let done = match bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) {
        Ok(_) => false,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
        Err(e) => return Err(e),
    };
    let n = (attr.count as usize).min(count);
    // SAFETY: the kernel wrote `n` (<= capacity) keys and values, and any bit
    // pattern is a valid `K` / `V` (`Pod`).
    unsafe {
        keys.set_len(n);
        values.set_len(n);
    }
    Ok(BatchRead {
        count: n,
        next: out_token,
        done,
    })
}

/// `BPF_MAP_DELETE_BATCH` of `keys`: returns how many were deleted before the
/// kernel stopped, and the error that stopped it (`ENOENT` for a key that was
/// already gone, at index `deleted`).
pub fn delete_batch<K: aya::Pod>(fd: BorrowedFd<'_>, keys: &[K]) -> (usize, Option<io::Error>) {
    if keys.is_empty() {
        return (0, None);
    }
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        count: keys.len().min(u32::MAX as usize) as u32,
        map_fd: fd_u32(fd),
        ..BatchAttr::default()
    };
    let result = bpf(BPF_MAP_DELETE_BATCH, &mut attr);
    let done = (attr.count as usize).min(keys.len());
    match result {
        Ok(_) => (done, None),
        Err(e) => (done, Some(e)),
    }
}

/// `BPF_MAP_UPDATE_BATCH` of `keys[i] → values[i]` with `elem_flags`; returns
/// how many were written before an error, and the error.
pub fn update_batch<K: aya::Pod, V: aya::Pod>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
    elem_flags: u64,
) -> (usize, Option<io::Error>) {
    let n = keys.len().min(values.len());
    if n == 0 {
        return (0, None);
    }
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: n.min(u32::MAX as usize) as u32,
        map_fd: fd_u32(fd),
        elem_flags,
        ..BatchAttr::default()
    };
    let result = bpf(BPF_MAP_UPDATE_BATCH, &mut attr);
    let done = (attr.count as usize).min(n);
    match result {
        Ok(_) => (done, None),
        Err(e) => (done, Some(e)),
    }
}
