//! The loaded datapath: the BPF object, its pinned maps, and the tc
//! attachments of its two programs.
//!
//! # Pins
//!
//! Everything lives under one pin directory, `<bpffs>/rivet/<node>/`
//! ([`DatapathOptions::pin_dir`]): `<pin_dir>/<map>` for every map of the
//! object (`endpoints`, `ipcache`, `policy`, `ep_prefixes`, `ct4`, `ct6`,
//! `metrics`, `events`, `config`, and any map the datapath adds later). A
//! map of the object with no pin yet (one added by a newer datapath) is
//! created and pinned beside the adopted ones.
//!
//! [`Datapath::open`] reuses an existing map pin only if the kernel's map has
//! exactly the type, key size, value size, max_entries and flags this object
//! and these options ask for; otherwise it fails with
//! [`DatapathError::PinMismatch`], naming the map and the fix. It never
//! deletes or recreates a map pin: a map in use keeps its state across
//! loader restarts, and replacing one is an operator's decision. The one
//! exception is an upgrade: `ct4`/`ct6` pinned by a loader of the first
//! `ct_entry` layout are migrated to the current one with every entry
//! (`ct_migration`; [`Datapath::ct_migrations`]); and `lb_services` of the
//! first layout (8 KiB records) is moved aside to [`LB_SERVICES_V1_PIN`]
//! for the load balancer to convert (`lb_services_v1`).
//!
//! # Attachments outlive the loader
//!
//! [`Datapath::attach`] adds a `clsact` qdisc to the host-side veth and one
//! direct-action `cls_bpf` filter per hook ([`crate::tc`]: priority 1,
//! handle 1, named `rivet-<node>-<program>`). A filter holds its program and the
//! program its maps, so the programs keep running when the loader exits or
//! crashes, with nothing pinned; the filter goes away with its device. A new
//! loader [`adopts`](Datapath::adopt_existing) every filter of its node by
//! replacing its program with its own instance in place (one
//! netlink request; no packet sees a missing program). [`Datapath::detach`]
//! deletes the filters. Classic tc rather than TCX links: see [`crate::tc`]
//! for the measurement. A loader that finds TCX link pins of an earlier
//! version under `<pin_dir>/links/` moves them to tc filters on start.
//!
//! Interfaces are looked up in the calling thread's network namespace
//! ([`crate::netdev`]); the loader is meant to run inside the node's.
//!
//! # Modules
//!
//! [`Datapath`] itself (here: open, maps, config, test runs) and, by
//! concern: `options` (pin directory and map sizes), `error`
//! ([`DatapathError`]), `pins` (the specs the pins must have, checking
//! them), `attach` (tc filters: attach, detach, adopt,
//! list), `legacy` (moving TCX link pins of earlier loaders to filters),
//! `ct_migration` (conntrack maps of the first `ct_entry` layout),
//! `typed_maps` (the shared typed map handles), `socket_lb` (the cgroup
//! programs of socket-level load balancing and their pinned links),
//! `teardown` (removing every filter and pin of the node: uninstall).

mod attach;
mod ct_migration;
mod error;
mod lb_services_v1;
mod legacy;
mod nodeport;
mod options;
mod overlay;
mod pins;
mod socket_lb;
mod teardown;
mod typed_maps;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};

use aya::maps::{MapData, RingBuf};
use aya::programs::{ProgramError, ProgramFd};
use aya::{Ebpf, EbpfLoader};
use rivet_bpf_sys as sys;
use rivet_datapath::maps::{DatapathConfig, METRICS_ENTRIES, MetricsValue};
use rivet_datapath::spec::{MAP_CONFIG, MAP_EVENTS, MAP_METRICS, MapSpec};

use crate::DATAPATH_OBJECT;

#[cfg(test)]
use attach::classifier;
use attach::classifier_named;
pub(crate) use attach::interfaces;
pub use attach::{
    AdoptReport, AttachOutcome, AttachState, Attachment, DetachOutcome, Hook, LinkChange, PROG_FROM_CONTAINER,
    PROG_TO_CONTAINER, ProgramIds,
};
pub use ct_migration::{CtMigrated, MIGRATING_PIN_SUFFIX};
pub use error::{DatapathError, ObjectError, OptionsError};
use error::{io_err, map_err};
pub use lb_services_v1::LB_SERVICES_V1_PIN;
pub use legacy::LEGACY_LINKS_DIR;
use nodeport::NodePortPrograms;
pub use nodeport::{NodePortServed, PROG_FROM_NETDEV, PROG_TO_NETDEV};
pub use options::DatapathOptions;
use overlay::OverlayPrograms;
pub use overlay::{OverlayAttachment, PROG_FROM_OVERLAY, PROG_TO_OVERLAY};
use pins::{check_bpffs, check_map_pin, expected_specs};
pub use socket_lb::{SOCKET_LB_LINKS_DIR, SOCKET_LB_PROGRAMS, SocketLbLink, SocketLbProgram, SocketLbReport};
use typed_maps::take_map;
pub use typed_maps::{DatapathMaps, SharedMap};

// ------------------------------------------------------------------ datapath

/// The loaded datapath of one node; see the module docs.
///
/// Dropping it closes this process's handles only: maps stay pinned, and
/// attached programs stay attached through their filters.
///
/// Shared by the loader's threads (`&self`): attaching and detaching need
/// no lock (each netlink request is its own socket), and each map has its
/// own short lock ([`SharedMap`]).
pub struct Datapath {
    opts: DatapathOptions,
    /// aya's record of the loaded programs (the maps are taken out into
    /// `maps`); tc attachments use `program_fds`; the socket LB loads its
    /// cgroup programs from it when enabled.
    ebpf: Ebpf,
    /// The programs' fds, `from_container` then `to_container`, for attaching.
    program_fds: [ProgramFd; 2],
    /// The tunnel device's programs (attached in vxlan mode only).
    overlay: OverlayPrograms,
    /// The external interfaces' programs (NodePort).
    nodeport: NodePortPrograms,
    maps: DatapathMaps,
    events: Option<RingBuf<MapData>>,
    program_ids: ProgramIds,
    adoption: AdoptReport,
    map_specs: BTreeMap<String, MapSpec>,
    reused_maps: BTreeSet<String>,
    ct_migrations: Vec<CtMigrated>,
}

/// One pinned map, see [`Datapath::map_status`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapStatus {
    /// Map (and pin) name.
    pub name: String,
    /// What the kernel holds.
    pub spec: MapSpec,
    /// Its pin.
    pub pin: PathBuf,
    /// The pin existed when this loader started (adopted, not created).
    pub reused: bool,
}

impl fmt::Debug for Datapath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Datapath")
            .field("pin_dir", &self.opts.pin_dir)
            .field("program_ids", &self.program_ids)
            .field("events_taken", &self.events.is_none())
            .finish_non_exhaustive()
    }
}

impl Datapath {
    /// Loads the datapath with its maps pinned in `opts.pin_dir` (reusing
    /// matching pins, refusing mismatching ones), loads both programs, writes
    /// the config map, and [adopts](Self::adopt_existing) attached filters.
    pub fn open(opts: DatapathOptions) -> Result<Self, DatapathError> {
        opts.validate()?;
        check_bpffs(&opts.pin_dir)?;
        std::fs::create_dir_all(&opts.pin_dir).map_err(io_err("creating the pin directory", &opts.pin_dir))?;

        let specs = expected_specs(&opts)?;
        // Service records of the first layout: converted by the load
        // balancer's restore, from beside the new map.
        lb_services_v1::set_aside(&opts.pin_dir)?;
        let mut reused_maps = BTreeSet::new();
        let mut migrations = Vec::new();
        for (name, spec) in &specs {
            let pin = opts.pin_dir.join(name);
            if let Some(migration) = ct_migration::prepare(name, &opts.pin_dir, spec)? {
                // Left by an interrupted migration, the new map is reused.
                check_map_pin(name, migration.migrating_pin(), spec)?;
                migrations.push(migration);
                continue;
            }
            check_map_pin(name, &pin, spec)?;
            if pin.exists() {
                reused_maps.insert(name.clone());
            }
        }
        let pin_of = |name: &str| {
            migrations
                .iter()
                .find(|m| m.map() == name)
                .map_or_else(|| opts.pin_dir.join(name), |m| m.migrating_pin().to_owned())
        };

        let pins: Vec<(&str, PathBuf)> = specs.keys().map(|name| (name.as_str(), pin_of(name))).collect();
        let mut loader = EbpfLoader::new();
        for (name, pin) in &pins {
            loader.map_pin_path(name, pin.as_path());
        }
        for (name, max) in opts.max_entries() {
            loader.map_max_entries(name, max);
        }
        let mut ebpf = loader.load(DATAPATH_OBJECT).map_err(|error| DatapathError::Load {
            pin_dir: opts.pin_dir.clone(),
            error: Box::new(error),
        })?;
        // Again, now that every pin exists: one created by someone else
        // between the check and the load would have been reused as is.
        for (name, pin) in &pins {
            check_map_pin(name, pin, &specs[*name])?;
        }
        // Before the new programs replace the old ones: they find every
        // connection the old ones knew.
        for migration in &mut migrations {
            migration.copy()?;
        }

        let (from_container_fd, from_container) = load_program(&mut ebpf, Hook::Ingress.program())?;
        let (to_container_fd, to_container) = load_program(&mut ebpf, Hook::Egress.program())?;
        let overlay = OverlayPrograms {
            from_overlay: load_program(&mut ebpf, PROG_FROM_OVERLAY)?,
            to_overlay: load_program(&mut ebpf, PROG_TO_OVERLAY)?,
        };
        let nodeport = NodePortPrograms {
            from_netdev: load_program(&mut ebpf, PROG_FROM_NETDEV)?,
            to_netdev: load_program(&mut ebpf, PROG_TO_NETDEV)?,
        };
        let maps = DatapathMaps::take(&mut ebpf)?;
        let events = take_map(&mut ebpf, MAP_EVENTS)?;

        let mut datapath = Self {
            opts,
            ebpf,
            program_fds: [from_container_fd, to_container_fd],
            overlay,
            nodeport,
            maps,
            events: Some(events),
            program_ids: ProgramIds {
                from_container,
                to_container,
            },
            adoption: AdoptReport::default(),
            map_specs: specs,
            reused_maps,
            ct_migrations: Vec::new(),
        };
        datapath.write_config()?;
        // A loader that died between a policy change and its bump left
        // verdicts cached at a revision that no longer says what they saw.
        datapath.bump_policy_revision()?;
        datapath.adoption = datapath.adopt_existing()?;
        // The old programs are gone from every filter: what they wrote
        // since the first copy is all there is left to copy.
        for migration in migrations {
            let report = migration.finish()?;
            datapath.ct_migrations.push(report);
        }
        Ok(datapath)
    }

    /// The conntrack maps [`open`](Self::open) migrated from the first
    /// `ct_entry` layout (empty unless this start upgraded them).
    pub fn ct_migrations(&self) -> &[CtMigrated] {
        &self.ct_migrations
    }

    /// Every pinned map with its shape and whether it was adopted.
    pub fn map_status(&self) -> Vec<MapStatus> {
        self.map_specs
            .iter()
            .map(|(name, spec)| MapStatus {
                name: name.clone(),
                spec: *spec,
                pin: self.opts.pin_dir.join(name),
                reused: self.reused_maps.contains(name),
            })
            .collect()
    }

    /// The options it was opened with.
    pub fn options(&self) -> &DatapathOptions {
        &self.opts
    }

    /// The pin directory.
    pub fn pin_dir(&self) -> &Path {
        &self.opts.pin_dir
    }

    /// Kernel ids of this instance's programs.
    pub fn program_ids(&self) -> ProgramIds {
        self.program_ids
    }

    /// What [`open`](Self::open) found and did with attachments.
    pub fn adoption(&self) -> &AdoptReport {
        &self.adoption
    }

    /// The typed maps.
    pub fn maps(&self) -> &DatapathMaps {
        &self.maps
    }

    /// The event ring buffer, for one consumer (`None` once taken). It can be
    /// wrapped in `tokio::io::unix::AsyncFd` for async reading.
    pub fn take_events(&mut self) -> Option<RingBuf<MapData>> {
        self.events.take()
    }

    /// The counters summed over CPUs, by `(reason, direction)`, non-zero only.
    pub fn metrics_totals(&self) -> Result<BTreeMap<(u8, u8), MetricsValue>, DatapathError> {
        let mut totals = BTreeMap::new();
        let metrics = self.maps.metrics.lock();
        for index in 0..METRICS_ENTRIES {
            let per_cpu = metrics
                .get(&index, 0)
                .map_err(map_err(format!("reading index {index} of"), MAP_METRICS))?;
            let sum = per_cpu.iter().fold(MetricsValue::default(), |acc, v| MetricsValue {
                packets: acc.packets + v.packets,
                bytes: acc.bytes + v.bytes,
            });
            if sum != MetricsValue::default() {
                totals.insert(((index / 4) as u8, (index % 4) as u8), sum);
            }
        }
        Ok(totals)
    }

    /// Runs `hook`'s program once on `frame` (an Ethernet frame) as if it
    /// came through interface `ifindex` of the calling thread's network
    /// namespace (`BPF_PROG_TEST_RUN`), against the real maps; returns the
    /// program's `TC_ACT_*`. For tests (the differential test of the
    /// datapath against the policy engine): a redirect is reported, not done.
    pub fn test_run(&self, hook: Hook, frame: &[u8], ifindex: u32) -> Result<u32, DatapathError> {
        self.test_run_repeat(hook, frame, ifindex, 1).map(|run| run.retval)
    }

    /// [`test_run`](Self::test_run) `repeat` times in the kernel on one
    /// socket buffer (a rewrite by one run is the next run's input), with
    /// the kernel's mean time per run: the verdict benchmark.
    pub fn test_run_repeat(
        &self,
        hook: Hook,
        frame: &[u8],
        ifindex: u32,
        repeat: u32,
    ) -> Result<sys::TestRun, DatapathError> {
        let program = hook.program();
        sys::test_run_classifier_repeat(self.program_fd(hook).as_fd(), frame, ifindex, repeat).map_err(|error| {
            DatapathError::TestRun {
                program,
                len: frame.len(),
                ifindex,
                error,
            }
        })
    }

    /// Writes the options' conntrack lifetimes and event flags to the config
    /// map, keeping its policy revision.
    pub fn write_config(&self) -> Result<(), DatapathError> {
        let mut config = self.maps.config.lock();
        let current = config
            .get(&0, 0)
            .map_err(map_err("reading the config from", MAP_CONFIG))?;
        let value = DatapathConfig {
            event_flags: self.opts.event_flags,
            policy_revision: current.policy_revision,
            ct: self.opts.ct_timeouts,
        };
        config
            .set(0, value, 0)
            .map_err(map_err("writing the config to", MAP_CONFIG))
    }

    /// Bumps the policy revision ([`DatapathConfig::policy_revision`]), so
    /// that every established connection takes its policy verdict again at
    /// its next packet; returns the new revision. Call it after the last
    /// write of every change to a map a verdict reads (endpoints, ipcache,
    /// policy, ep_prefixes): a verdict taken during the change is cached at
    /// the revision before the bump.
    pub fn bump_policy_revision(&self) -> Result<u32, DatapathError> {
        let mut config = self.maps.config.lock();
        let mut value = config
            .get(&0, 0)
            .map_err(map_err("reading the config from", MAP_CONFIG))?;
        value.policy_revision = next_policy_revision(value.policy_revision);
        config
            .set(0, value, 0)
            .map_err(map_err("writing the config to", MAP_CONFIG))?;
        Ok(value.policy_revision)
    }

    /// Switches the optional events (`CONFIG_EVENT_*`) to `event_flags`,
    /// keeping the conntrack lifetimes (the config map is the truth; the
    /// options keep what the datapath was opened with).
    pub fn set_event_flags(&self, event_flags: u32) -> Result<(), DatapathError> {
        let mut config = self.maps.config.lock();
        let mut value = config
            .get(&0, 0)
            .map_err(map_err("reading the config from", MAP_CONFIG))?;
        value.event_flags = event_flags;
        config
            .set(0, value, 0)
            .map_err(map_err("writing the config to", MAP_CONFIG))
    }
}

/// The policy revision after `current`. A config map that never held one
/// (0: new, or replaced while the conntrack maps were kept) starts at a
/// value taken from the clock, so that entries cached at the revisions of
/// an earlier config map do not match it; 0 is never used.
fn next_policy_revision(current: u32) -> u32 {
    let next = if current == 0 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.subsec_nanos() ^ d.as_secs() as u32)
    } else {
        current.wrapping_add(1)
    };
    next.max(1)
}

/// Loads (verifies) `program`: its fd, for attaching, and its kernel id.
fn load_program(ebpf: &mut Ebpf, program: &'static str) -> Result<(ProgramFd, u32), DatapathError> {
    let prog = classifier_named(ebpf, program)?;
    prog.load().map_err(|error| DatapathError::Program {
        what: "loading (verifying)",
        program,
        error: Box::new(error),
    })?;
    let fd = prog
        .fd()
        .and_then(|fd| {
            fd.try_clone()
                .map_err(|io_error| ProgramError::SyscallError(aya::sys::SyscallError { call: "dup", io_error }))
        })
        .map_err(|error| DatapathError::Program {
            what: "duplicating the fd of",
            program,
            error: Box::new(error),
        })?;
    let id = prog
        .info()
        .map_err(|error| DatapathError::Program {
            what: "reading the id of",
            program,
            error: Box::new(error),
        })?
        .id();
    Ok((fd, id))
}

#[cfg(test)]
pub(crate) mod tests;
