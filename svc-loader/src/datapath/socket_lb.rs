//! Socket-level load balancing: the cgroup `sock_addr` programs of
//! `bpf/datapath.c` ("socket load balancing") attached to one cgroup v2
//! directory, the node operator's `--socket-lb-cgroup`.
//!
//! Every program is attached by a BPF link pinned at
//! `<pin_dir>/socket-lb/<program>`: the pin keeps the attachment while the
//! loader is down. A new loader [adopts](Datapath::enable_socket_lb) each
//! pinned link by giving it its own program instance (`BPF_LINK_UPDATE`,
//! atomic: no socket sees a missing program); a link on another cgroup
//! (the flag changed) is replaced by a new one on the asked cgroup, the new
//! one attached before the old pin goes. [`Datapath::disable_socket_lb`]
//! removes the pins, which detaches the programs.
//!
//! Not here: what the programs do (the C section's comment) and the maps
//! they share with the tc programs (the same object, so the same pinned
//! `lb_*` maps).

use std::fs::File;
use std::io;
use std::os::fd::{AsFd as _, OwnedFd};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use aya::programs::CgroupSockAddr;
use rivet_bpf_sys as sys;

use super::Datapath;
use super::error::{DatapathError, ObjectError, io_err};

/// Subdirectory of the pin directory holding the socket LB's link pins.
pub const SOCKET_LB_LINKS_DIR: &str = "socket-lb";

/// `CGROUP2_SUPER_MAGIC` (linux/magic.h).
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// One cgroup program of the socket load balancer and its hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SocketLbProgram {
    /// The program's name in the object (also its link's pin name).
    pub name: &'static str,
    /// `BPF_CGROUP_*` attach type.
    pub attach_type: u32,
}

/// The programs, in the order they are attached (the reverse hooks first:
/// a translated socket always finds its way back).
pub const SOCKET_LB_PROGRAMS: [SocketLbProgram; 8] = [
    SocketLbProgram {
        name: "sock_recvmsg4",
        attach_type: 19, // BPF_CGROUP_UDP4_RECVMSG
    },
    SocketLbProgram {
        name: "sock_recvmsg6",
        attach_type: 20, // BPF_CGROUP_UDP6_RECVMSG
    },
    SocketLbProgram {
        name: "sock_getpeername4",
        attach_type: 29, // BPF_CGROUP_INET4_GETPEERNAME
    },
    SocketLbProgram {
        name: "sock_getpeername6",
        attach_type: 30, // BPF_CGROUP_INET6_GETPEERNAME
    },
    SocketLbProgram {
        name: "sock_connect4",
        attach_type: 10, // BPF_CGROUP_INET4_CONNECT
    },
    SocketLbProgram {
        name: "sock_connect6",
        attach_type: 11, // BPF_CGROUP_INET6_CONNECT
    },
    SocketLbProgram {
        name: "sock_sendmsg4",
        attach_type: 14, // BPF_CGROUP_UDP4_SENDMSG
    },
    SocketLbProgram {
        name: "sock_sendmsg6",
        attach_type: 15, // BPF_CGROUP_UDP6_SENDMSG
    },
];

/// What [`Datapath::enable_socket_lb`] did with each program's link.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SocketLbReport {
    /// The cgroup the programs are attached to.
    pub cgroup: PathBuf,
    /// Its cgroup id (the directory's inode number).
    pub cgroup_id: u64,
    /// Programs attached by a new link (no pin before).
    pub attached: Vec<&'static str>,
    /// Pinned links of an earlier loader on this cgroup, now running this
    /// loader's program.
    pub adopted: Vec<&'static str>,
    /// Pinned links on another cgroup (or on one that is gone), replaced by
    /// a link on this one.
    pub moved: Vec<&'static str>,
}

/// One pinned link of the socket load balancer, see [`Datapath::socket_lb_links`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SocketLbLink {
    /// The program (pin name).
    pub program: &'static str,
    /// What the kernel says about the link.
    pub info: sys::LinkInfo,
}

impl Datapath {
    /// The directory of the socket LB's link pins.
    pub fn socket_lb_links_dir(&self) -> PathBuf {
        self.opts.pin_dir.join(SOCKET_LB_LINKS_DIR)
    }

    /// Loads the socket LB programs and attaches them to the cgroup v2
    /// directory `cgroup`, adopting the links an earlier loader pinned; see
    /// the module docs. Idempotent.
    pub fn enable_socket_lb(&mut self, cgroup: &Path) -> Result<SocketLbReport, DatapathError> {
        let (dir_fd, cgroup_id) = open_cgroup(cgroup)?;
        let links_dir = self.socket_lb_links_dir();
        std::fs::create_dir_all(&links_dir).map_err(io_err("creating the socket LB link directory", &links_dir))?;
        let mut report = SocketLbReport {
            cgroup: cgroup.to_owned(),
            cgroup_id,
            ..SocketLbReport::default()
        };
        for program in SOCKET_LB_PROGRAMS {
            let prog_fd = self.load_socket_lb_program(program.name)?;
            let pin = links_dir.join(program.name);
            match open_link(&pin)? {
                Some((link, info))
                    if info.link_type == sys::BPF_LINK_TYPE_CGROUP
                        && info.cgroup_id == cgroup_id
                        && info.attach_type == program.attach_type =>
                {
                    sys::link_update(link.as_fd(), prog_fd.as_fd()).map_err(|error| DatapathError::Pin {
                        what: format!("giving the pinned link its new program {}", program.name),
                        pin: pin.clone(),
                        error,
                    })?;
                    report.adopted.push(program.name);
                }
                existing => {
                    let link = sys::link_create_cgroup(prog_fd.as_fd(), dir_fd.as_fd(), program.attach_type).map_err(
                        |error| DatapathError::Pin {
                            what: format!("attaching {} to the cgroup", program.name),
                            pin: cgroup.to_owned(),
                            error,
                        },
                    )?;
                    // Pinned beside the old one first, then moved over it:
                    // the old link goes only once the new one holds.
                    let staged = links_dir.join(format!("{}-new", program.name));
                    remove_if_exists(&staged)?;
                    sys::obj_pin(link.as_fd(), &staged).map_err(|error| DatapathError::Pin {
                        what: format!("pinning the link of {}", program.name),
                        pin: staged.clone(),
                        error,
                    })?;
                    std::fs::rename(&staged, &pin).map_err(io_err("moving the new link pin to", &pin))?;
                    if existing.is_some() {
                        report.moved.push(program.name);
                    } else {
                        report.attached.push(program.name);
                    }
                }
            }
        }
        Ok(report)
    }

    /// Detaches the socket load balancer (flag removed): removes its link
    /// pins and their directory. Returns how many links went. Idempotent.
    pub fn disable_socket_lb(&self) -> Result<usize, DatapathError> {
        let dir = self.socket_lb_links_dir();
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(err) => return Err(io_err("listing the socket LB link pins in", &dir)(err)),
        };
        let mut removed = 0;
        for entry in entries {
            let path = entry
                .map_err(io_err("listing the socket LB link pins in", &dir))?
                .path();
            std::fs::remove_file(&path).map_err(io_err("removing the socket LB link pin", &path))?;
            removed += 1;
        }
        std::fs::remove_dir(&dir).map_err(io_err("removing the socket LB link directory", &dir))?;
        Ok(removed)
    }

    /// The socket LB's pinned links (empty when it is off).
    pub fn socket_lb_links(&self) -> Result<Vec<SocketLbLink>, DatapathError> {
        let dir = self.socket_lb_links_dir();
        let mut links = Vec::new();
        for program in SOCKET_LB_PROGRAMS {
            if let Some((_, info)) = open_link(&dir.join(program.name))? {
                links.push(SocketLbLink {
                    program: program.name,
                    info,
                });
            }
        }
        Ok(links)
    }

    fn load_socket_lb_program(&mut self, name: &'static str) -> Result<OwnedFd, DatapathError> {
        let program_err = |what, error| DatapathError::Program {
            what,
            program: name,
            error: Box::new(error),
        };
        let prog: &mut CgroupSockAddr = self
            .ebpf
            .program_mut(name)
            .ok_or(ObjectError::MissingProgram(name))?
            .try_into()
            .map_err(|e| program_err("using", e))?;
        if prog.fd().is_err() {
            prog.load().map_err(|e| program_err("loading (verifying)", e))?;
        }
        let fd = prog.fd().map_err(|e| program_err("using", e))?;
        fd.as_fd().try_clone_to_owned().map_err(|error| DatapathError::Pin {
            what: format!("duplicating the fd of program {name} for"),
            pin: self.socket_lb_links_dir(),
            error,
        })
    }
}

/// Opens `cgroup`, which must be a directory of a cgroup v2 hierarchy:
/// its fd and its cgroup id.
fn open_cgroup(cgroup: &Path) -> Result<(File, u64), DatapathError> {
    let not_cgroup = |reason: String| DatapathError::NotCgroup2 {
        path: cgroup.to_owned(),
        reason,
    };
    if !cgroup.is_absolute() {
        return Err(not_cgroup("the path is relative".to_owned()));
    }
    let fs_type = sys::fs_type(cgroup).map_err(|e| not_cgroup(e.to_string()))?;
    if fs_type != CGROUP2_SUPER_MAGIC {
        return Err(not_cgroup(format!("its file system type is {fs_type:#x}, not cgroup2")));
    }
    let dir = File::open(cgroup).map_err(|e| not_cgroup(e.to_string()))?;
    let meta = dir.metadata().map_err(|e| not_cgroup(e.to_string()))?;
    if !meta.is_dir() {
        return Err(not_cgroup("not a directory".to_owned()));
    }
    Ok((dir, meta.ino()))
}

/// The link pinned at `pin` and its info; `None` if there is no pin.
fn open_link(pin: &Path) -> Result<Option<(OwnedFd, sys::LinkInfo)>, DatapathError> {
    let link = match sys::obj_get(pin) {
        Ok(fd) => fd,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => {
            return Err(DatapathError::Pin {
                what: "opening the socket LB link pinned at".to_owned(),
                pin: pin.to_owned(),
                error,
            });
        }
    };
    let info = sys::link_info(link.as_fd()).map_err(|error| DatapathError::Pin {
        what: "reading the socket LB link pinned at".to_owned(),
        pin: pin.to_owned(),
        error,
    })?;
    Ok(Some((link, info)))
}

fn remove_if_exists(path: &Path) -> Result<(), DatapathError> {
    match std::fs::remove_file(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(io_err("removing the stale link pin", path)(err)),
        _ => Ok(()),
    }
}
