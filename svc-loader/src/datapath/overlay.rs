//! The tunnel device's programs (vxlan mode): `from_overlay` on its tc
//! ingress (decapsulated packets: the VNI is the source identity) and
//! `to_overlay` on its tc egress (sets the tunnel key of what the stack
//! routes into it); and the `routing` map they and `from_container` read.

use std::os::fd::AsFd as _;

use aya::programs::ProgramFd;
use rivet_datapath::maps::RoutingConfig;
use rivet_datapath::spec::MAP_ROUTING;

use super::error::map_err;
use super::{Datapath, DatapathError};
use crate::tc;

/// The program on tc ingress of the tunnel device.
pub const PROG_FROM_OVERLAY: &str = "from_overlay";
/// The program on tc egress of the tunnel device.
pub const PROG_TO_OVERLAY: &str = "to_overlay";

/// The loaded overlay programs: fd and kernel id each.
pub(super) struct OverlayPrograms {
    pub(super) from_overlay: (ProgramFd, u32),
    pub(super) to_overlay: (ProgramFd, u32),
}

/// The overlay programs on the tunnel device, see
/// [`Datapath::overlay_attachment`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverlayAttachment {
    /// The program id of our filter on its tc ingress (`from_overlay`), if any.
    pub ingress_prog_id: Option<u32>,
    /// The program id of our filter on its tc egress (`to_overlay`), if any.
    pub egress_prog_id: Option<u32>,
    /// This loader's `from_overlay` and `to_overlay` ids.
    pub own_prog_ids: (u32, u32),
}

impl Datapath {
    /// Writes the routing mode and tunnel device for the programs.
    pub fn write_routing(&self, config: RoutingConfig) -> Result<(), DatapathError> {
        self.maps
            .routing
            .lock()
            .set(0, config, 0)
            .map_err(map_err("writing the routing config to", MAP_ROUTING))
    }

    /// Attaches `from_overlay` and `to_overlay` to the tunnel device
    /// `ifindex` as our filters, replacing another instance's in place (the
    /// adoption of a restart: no packet sees a missing program).
    pub fn attach_overlay(&self, ifindex: u32) -> Result<(), DatapathError> {
        let tc_err = |what: &str, error| DatapathError::Tc {
            what: format!("{what} on the tunnel device"),
            ifindex,
            error,
        };
        tc::ensure_clsact(ifindex).map_err(|e| tc_err("adding the clsact qdisc", e))?;
        for (direction, program, (fd, _)) in [
            (tc::Direction::Ingress, PROG_FROM_OVERLAY, &self.overlay.from_overlay),
            (tc::Direction::Egress, PROG_TO_OVERLAY, &self.overlay.to_overlay),
        ] {
            tc::attach_bpf(ifindex, direction, fd.as_fd(), &self.program_filter_name(program), true)
                .map_err(|e| tc_err(&format!("attaching {program}"), e))?;
        }
        Ok(())
    }

    /// This loader's `from_overlay` and `to_overlay` program ids.
    pub fn overlay_program_ids(&self) -> (u32, u32) {
        (self.overlay.from_overlay.1, self.overlay.to_overlay.1)
    }

    /// Our overlay filters on the tunnel device `ifindex`.
    pub fn overlay_attachment(&self, ifindex: u32) -> Result<OverlayAttachment, DatapathError> {
        let ours = |direction, program| -> Result<Option<u32>, DatapathError> {
            let name = self.program_filter_name(program);
            Ok(tc::bpf_filters(ifindex, direction)
                .map_err(|error| DatapathError::Tc {
                    what: format!("listing the filters of {program} on the tunnel device"),
                    ifindex,
                    error,
                })?
                .into_iter()
                .find(|f| f.is_ours(&name))
                .map(|f| f.prog_id))
        };
        Ok(OverlayAttachment {
            ingress_prog_id: ours(tc::Direction::Ingress, PROG_FROM_OVERLAY)?,
            egress_prog_id: ours(tc::Direction::Egress, PROG_TO_OVERLAY)?,
            own_prog_ids: (self.overlay.from_overlay.1, self.overlay.to_overlay.1),
        })
    }

    /// The name of this node's filter running `program`:
    /// `rivet-<node>-<program>` (the pin directory's last component is the
    /// node), for the endpoint, overlay and NodePort filters alike.
    pub(super) fn program_filter_name(&self, program: &str) -> String {
        let node = self.opts.pin_dir.file_name().unwrap_or_default().to_string_lossy();
        format!("rivet-{node}-{program}")
    }
}
