//! Attaching the two programs to an endpoint's host-side veth as tc
//! filters, detaching them, adopting the filters of an earlier loader, and
//! listing what is attached.

use std::collections::BTreeMap;
use std::fmt;
use std::os::fd::AsFd as _;
use std::path::PathBuf;

use aya::Ebpf;
use aya::programs::{ProgramFd, SchedClassifier};

use super::Datapath;
use super::error::{DatapathError, ObjectError, tc_err};
use crate::netdev;
use crate::tc;

/// The program on tc ingress of the host-side veth (packets leaving the pod).
pub const PROG_FROM_CONTAINER: &str = "from_container";
/// The program on tc egress of the host-side veth (packets entering the pod).
pub const PROG_TO_CONTAINER: &str = "to_container";

/// One of the two attachment points of an endpoint's host-side veth.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Hook {
    /// tc ingress of the host-side veth: `from_container` (packets leaving the pod).
    Ingress,
    /// tc egress of the host-side veth: `to_container` (packets entering the pod).
    Egress,
}

impl Hook {
    /// Both hooks.
    pub const ALL: [Self; 2] = [Self::Ingress, Self::Egress];

    /// The program attached here.
    pub const fn program(self) -> &'static str {
        match self {
            Self::Ingress => PROG_FROM_CONTAINER,
            Self::Egress => PROG_TO_CONTAINER,
        }
    }

    /// `ingress` / `egress`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Ingress => "ingress",
            Self::Egress => "egress",
        }
    }

    pub(super) fn direction(self) -> tc::Direction {
        match self {
            Self::Ingress => tc::Direction::Ingress,
            Self::Egress => tc::Direction::Egress,
        }
    }

    pub(super) fn from_suffix(s: &str) -> Option<Self> {
        match s {
            "ingress" => Some(Self::Ingress),
            "egress" => Some(Self::Egress),
            _ => None,
        }
    }
}

impl fmt::Display for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tc {}", self.as_str())
    }
}

/// What [`Datapath::attach`] did on one hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkChange {
    /// The filter already runs this loader's program.
    Unchanged,
    /// A new filter was attached.
    Created,
    /// The filter now runs this loader's program instead of `previous_prog_id`.
    Updated {
        /// The program id the filter ran before.
        previous_prog_id: u32,
    },
}

impl LinkChange {
    /// Whether anything changed.
    pub fn changed(self) -> bool {
        self != Self::Unchanged
    }

    pub(super) fn is_new(self) -> bool {
        self == Self::Created
    }
}

/// The result of [`Datapath::attach`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachOutcome {
    /// The interface.
    pub ifindex: u32,
    /// Its name in the loader's namespace.
    pub ifname: String,
    /// `from_container` on tc ingress.
    pub ingress: LinkChange,
    /// `to_container` on tc egress.
    pub egress: LinkChange,
}

impl AttachOutcome {
    /// Whether anything changed.
    pub fn changed(&self) -> bool {
        self.ingress.changed() || self.egress.changed()
    }
}

/// The result of [`Datapath::detach`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DetachOutcome {
    /// The ingress filter was deleted.
    pub ingress: bool,
    /// The egress filter was deleted.
    pub egress: bool,
}

impl DetachOutcome {
    /// Whether anything changed.
    pub fn changed(&self) -> bool {
        self.ingress || self.egress
    }
}

/// What [`Datapath::adopt_existing`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdoptReport {
    /// Filters now running this loader's programs (they ran another instance).
    pub updated: usize,
    /// Filters that already ran this loader's programs.
    pub unchanged: usize,
    /// TCX link pins of an earlier loader replaced by filters (ifindex, hook).
    pub migrated: Vec<(u32, Hook)>,
    /// TCX link pins of an earlier loader removed because their interface
    /// is gone (ifindex, hook).
    pub removed: Vec<(u32, Hook)>,
    /// Entries of the legacy links directory left alone, with the reason.
    pub ignored: Vec<(PathBuf, String)>,
}

/// The state of one hook of one interface, see [`Datapath::attachments`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachState {
    /// This loader's program is attached.
    Attached {
        /// Kernel program id (this loader's).
        prog_id: u32,
    },
    /// No filter of ours on this hook.
    Detached,
    /// Our filter runs another program (another loader instance's):
    /// [`Datapath::adopt_existing`] or [`Datapath::attach`] fixes it.
    Stale {
        /// Kernel program id.
        prog_id: u32,
    },
    /// The interface no longer exists (in this namespace).
    InterfaceGone,
}

/// One interface and the state of its two hooks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    /// The interface index.
    pub ifindex: u32,
    /// Its name in the loader's namespace, if it exists there.
    pub ifname: Option<String>,
    /// `from_container` on tc ingress.
    pub ingress: AttachState,
    /// `to_container` on tc egress.
    pub egress: AttachState,
}

impl AttachState {
    /// Whether a filter of ours is on the hook (this instance's program or
    /// another's).
    pub fn is_ours(self) -> bool {
        matches!(self, Self::Attached { .. } | Self::Stale { .. })
    }
}

impl Attachment {
    /// Whether a filter of ours is on either hook.
    pub fn has_ours(&self) -> bool {
        self.ingress.is_ours() || self.egress.is_ours()
    }
}

/// Kernel ids of this loader's program instances.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgramIds {
    /// `from_container`.
    pub from_container: u32,
    /// `to_container`.
    pub to_container: u32,
}

impl ProgramIds {
    /// The program id attached at `hook`.
    pub fn for_hook(&self, hook: Hook) -> u32 {
        match hook {
            Hook::Ingress => self.from_container,
            Hook::Egress => self.to_container,
        }
    }
}

impl Datapath {
    /// Attaches `from_container` to tc ingress and `to_container` to tc
    /// egress of interface `ifindex` (in the calling thread's namespace),
    /// adding its clsact qdisc if needed. The filters outlive this process.
    ///
    /// Idempotent: a filter that already runs this instance's program is
    /// left alone; one that runs another instance's (a previous loader's) gets
    /// this one's, atomically. If the second hook fails, a filter this call
    /// created on the first is removed again.
    pub fn attach(&self, ifindex: u32) -> Result<AttachOutcome, DatapathError> {
        let ifname = self
            .ifname(ifindex)?
            .ok_or(DatapathError::InterfaceNotFound { ifindex })?;
        // Both filters first: an endpoint that is already attached (every
        // restore, every regeneration) costs these two requests only.
        let current = [
            self.our_filter(ifindex, Hook::Ingress)?,
            self.our_filter(ifindex, Hook::Egress)?,
        ];
        if current.iter().any(Option::is_none) {
            tc::ensure_clsact(ifindex)
                .map_err(|error| tc_err(format!("adding the clsact qdisc to {ifname}"), ifindex, error))?;
        }
        let [ingress_now, egress_now] = current;
        let ingress = self.attach_hook(ifindex, &ifname, Hook::Ingress, ingress_now)?;
        let egress = match self.attach_hook(ifindex, &ifname, Hook::Egress, egress_now) {
            Ok(change) => change,
            Err(err) => {
                if ingress.is_new() {
                    // Best effort: the error that matters is `err`.
                    let _ = self.detach_hook(ifindex, Hook::Ingress);
                }
                return Err(err);
            }
        };
        Ok(AttachOutcome {
            ifindex,
            ifname,
            ingress,
            egress,
        })
    }

    /// Deletes both filters from `ifindex` (nothing if the interface is
    /// gone: its filters went with it). Idempotent.
    pub fn detach(&self, ifindex: u32) -> Result<DetachOutcome, DatapathError> {
        Ok(DetachOutcome {
            ingress: self.detach_hook(ifindex, Hook::Ingress)?,
            egress: self.detach_hook(ifindex, Hook::Egress)?,
        })
    }

    /// Makes every filter of ours (on any interface of the namespace) run
    /// this instance's programs, replacing the program in place. Runs on
    /// [`open`](Self::open), after moving TCX link pins of an earlier loader
    /// to filters.
    pub fn adopt_existing(&self) -> Result<AdoptReport, DatapathError> {
        let mut report = self.migrate_legacy_links()?;
        for attachment in self.attachments()? {
            for (hook, state) in Hook::ALL.into_iter().zip([attachment.ingress, attachment.egress]) {
                match state {
                    AttachState::Attached { .. } => report.unchanged += 1,
                    AttachState::Stale { .. } => match self.set_filter(attachment.ifindex, hook, true) {
                        Ok(()) => report.updated += 1,
                        // Deleted meanwhile: nothing to adopt.
                        Err(DatapathError::InterfaceNotFound { .. }) => {}
                        Err(err) => return Err(err),
                    },
                    AttachState::Detached | AttachState::InterfaceGone => {}
                }
            }
        }
        Ok(report)
    }

    /// Every interface of the namespace with a filter of ours, with the
    /// state of both hooks, by ifindex (one deleted during the walk is
    /// left out: its filters went with it).
    pub fn attachments(&self) -> Result<Vec<Attachment>, DatapathError> {
        let mut list = Vec::new();
        for ifindex in interfaces()?.into_keys() {
            let attachment = self.attachment(ifindex)?;
            if attachment.has_ours() {
                list.push(attachment);
            }
        }
        Ok(list)
    }

    /// The attach state of one interface (`InterfaceGone` on both hooks if
    /// it does not exist).
    pub fn attachment(&self, ifindex: u32) -> Result<Attachment, DatapathError> {
        let ifname = self.ifname(ifindex)?;
        let mut states = [AttachState::InterfaceGone; 2];
        if ifname.is_some() {
            for (hook, state) in Hook::ALL.into_iter().zip(&mut states) {
                *state = match self.our_filter(ifindex, hook) {
                    Ok(None) => AttachState::Detached,
                    Ok(Some(f)) if f.prog_id == self.program_ids.for_hook(hook) => {
                        AttachState::Attached { prog_id: f.prog_id }
                    }
                    Ok(Some(f)) => AttachState::Stale { prog_id: f.prog_id },
                    Err(DatapathError::InterfaceNotFound { .. }) => AttachState::InterfaceGone,
                    Err(err) => return Err(err),
                };
            }
        }
        Ok(Attachment {
            ifindex,
            ifname: ifname.filter(|_| states != [AttachState::InterfaceGone; 2]),
            ingress: states[0],
            egress: states[1],
        })
    }

    // ------------------------------------------------------------ internals

    pub(super) fn ifname(&self, ifindex: u32) -> Result<Option<String>, DatapathError> {
        netdev::ifindex_to_name(ifindex).map_err(|error| DatapathError::Netdev { ifindex, error })
    }

    /// Makes `hook` run this instance's program, given the filter on it now.
    pub(super) fn attach_hook(
        &self,
        ifindex: u32,
        ifname: &str,
        hook: Hook,
        current: Option<tc::BpfFilter>,
    ) -> Result<LinkChange, DatapathError> {
        match current {
            Some(f) if f.prog_id == self.program_ids.for_hook(hook) => Ok(LinkChange::Unchanged),
            Some(f) => {
                self.set_filter(ifindex, hook, true)?;
                Ok(LinkChange::Updated {
                    previous_prog_id: f.prog_id,
                })
            }
            None => {
                self.set_filter(ifindex, hook, false).map_err(|err| match err {
                    DatapathError::Tc { ifindex, error, .. } if error.raw_os_error() == Some(libc::EEXIST) => tc_err(
                        format!(
                            "attaching {} to {hook} of {ifname}: another filter holds priority {} handle {}",
                            hook.program(),
                            tc::FILTER_PRIORITY,
                            tc::FILTER_HANDLE
                        ),
                        ifindex,
                        error,
                    ),
                    other => other,
                })?;
                Ok(LinkChange::Created)
            }
        }
    }

    /// Attaches this instance's program as our filter on `hook`
    /// (`replace`: in place of the existing one).
    pub(super) fn set_filter(&self, ifindex: u32, hook: Hook, replace: bool) -> Result<(), DatapathError> {
        let name = self.filter_name(hook);
        let fd = self.program_fd(hook);
        tc::attach_bpf(ifindex, hook.direction(), fd.as_fd(), &name, replace).map_err(|error| {
            if error.raw_os_error() == Some(libc::ENODEV) {
                return DatapathError::InterfaceNotFound { ifindex };
            }
            tc_err(format!("attaching {} to {hook}", hook.program()), ifindex, error)
        })
    }

    pub(super) fn detach_hook(&self, ifindex: u32, hook: Hook) -> Result<bool, DatapathError> {
        match self.our_filter(ifindex, hook) {
            Ok(Some(_)) => {}
            Ok(None) | Err(DatapathError::InterfaceNotFound { .. }) => return Ok(false),
            Err(err) => return Err(err),
        }
        tc::detach_bpf(ifindex, hook.direction()).map_err(|error| {
            tc_err(
                format!("deleting the filter of {} on {hook}", hook.program()),
                ifindex,
                error,
            )
        })
    }

    /// The fd of the program attached at `hook`.
    pub(super) fn program_fd(&self, hook: Hook) -> &ProgramFd {
        match hook {
            Hook::Ingress => &self.program_fds[0],
            Hook::Egress => &self.program_fds[1],
        }
    }

    /// The name of this node's filter on `hook`: `rivet-<node>-<program>`,
    /// so a loader adopts and deletes only its own node's filters (the pin
    /// directory's last component is the node).
    fn filter_name(&self, hook: Hook) -> String {
        self.program_filter_name(hook.program())
    }

    /// Our filter on `hook` of `ifindex`, if any.
    pub(super) fn our_filter(&self, ifindex: u32, hook: Hook) -> Result<Option<tc::BpfFilter>, DatapathError> {
        match tc::bpf_filters(ifindex, hook.direction()) {
            Ok(filters) => Ok(filters.into_iter().find(|f| f.is_ours(&self.filter_name(hook)))),
            Err(error) if error.raw_os_error() == Some(libc::ENODEV) => {
                Err(DatapathError::InterfaceNotFound { ifindex })
            }
            Err(error) => Err(tc_err(format!("listing the filters on {hook}"), ifindex, error)),
        }
    }
}

/// The interfaces of the calling thread's network namespace (one link dump).
pub(crate) fn interfaces() -> Result<BTreeMap<u32, String>, DatapathError> {
    netdev::interfaces().map_err(|error| DatapathError::Interfaces { error })
}

#[cfg(test)]
pub(super) fn classifier(ebpf: &mut Ebpf, hook: Hook) -> Result<&mut SchedClassifier, DatapathError> {
    classifier_named(ebpf, hook.program())
}

/// The object's `sched_cls` program `program`.
pub(super) fn classifier_named<'a>(
    ebpf: &'a mut Ebpf,
    program: &'static str,
) -> Result<&'a mut SchedClassifier, DatapathError> {
    ebpf.program_mut(program)
        .ok_or(ObjectError::MissingProgram(program))?
        .try_into()
        .map_err(|error| DatapathError::Program {
            what: "using",
            program,
            error: Box::new(error),
        })
}
