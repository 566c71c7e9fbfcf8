//! The external interfaces' programs (NodePort, `bpf/nodeport.h`):
//! `from_netdev` on tc ingress (packets to a NodePort of this node are
//! translated to a backend; replies of SNATed flows go back to their
//! client) and `to_netdev` on tc egress (replies of local backends get the
//! NodePort back as their source). The interfaces are the node operator's
//! choice (svc-loader's flags), never a client's.
//!
//! Like the endpoint and overlay filters, these outlive the loader: a
//! restart replaces their program in place ([`Datapath::serve_nodeport`]),
//! and removes them from interfaces no longer configured.

use std::os::fd::AsFd as _;

use aya::programs::ProgramFd;

use super::{Datapath, DatapathError, attach::interfaces};
use crate::tc;

/// The program on tc ingress of an external interface.
pub const PROG_FROM_NETDEV: &str = "from_netdev";
/// The program on tc egress of an external interface.
pub const PROG_TO_NETDEV: &str = "to_netdev";

/// The loaded external interface programs: fd and kernel id each.
pub(super) struct NodePortPrograms {
    pub(super) from_netdev: (ProgramFd, u32),
    pub(super) to_netdev: (ProgramFd, u32),
}

/// What [`Datapath::serve_nodeport`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodePortServed {
    /// Interfaces (ifindex) now running this loader's programs.
    pub attached: Vec<u32>,
    /// Interfaces whose NodePort filters were removed (no longer configured).
    pub detached: Vec<u32>,
}

impl Datapath {
    /// Makes `ifindexes` (the node's external interfaces) run `from_netdev`
    /// and `to_netdev` as our filters, replacing another instance's in place
    /// (a restart's adoption: no packet sees a missing program), and removes
    /// our NodePort filters from every other interface of the namespace.
    pub fn serve_nodeport(&self, ifindexes: &[u32]) -> Result<NodePortServed, DatapathError> {
        let mut served = NodePortServed::default();
        for &ifindex in ifindexes {
            self.attach_nodeport(ifindex)?;
            served.attached.push(ifindex);
        }
        for ifindex in interfaces()?.into_keys().filter(|i| !ifindexes.contains(i)) {
            let mut removed = false;
            for (direction, program) in Self::nodeport_hooks() {
                if self.nodeport_filter(ifindex, direction, program)?.is_some() {
                    removed |= tc::detach_bpf(ifindex, direction).map_err(|error| DatapathError::Tc {
                        what: format!("removing {program} from an interface no longer external"),
                        ifindex,
                        error,
                    })?;
                }
            }
            if removed {
                served.detached.push(ifindex);
            }
        }
        Ok(served)
    }

    fn attach_nodeport(&self, ifindex: u32) -> Result<(), DatapathError> {
        let tc_err = |what: &str, error| DatapathError::Tc {
            what: format!("{what} on an external (NodePort) interface"),
            ifindex,
            error,
        };
        tc::ensure_clsact(ifindex).map_err(|e| tc_err("adding the clsact qdisc", e))?;
        for ((direction, program), (fd, _)) in Self::nodeport_hooks()
            .into_iter()
            .zip([&self.nodeport.from_netdev, &self.nodeport.to_netdev])
        {
            tc::attach_bpf(ifindex, direction, fd.as_fd(), &self.program_filter_name(program), true)
                .map_err(|e| tc_err(&format!("attaching {program}"), e))?;
        }
        Ok(())
    }

    /// This loader's `from_netdev` and `to_netdev` program ids.
    pub fn nodeport_program_ids(&self) -> (u32, u32) {
        (self.nodeport.from_netdev.1, self.nodeport.to_netdev.1)
    }

    /// The program ids of our NodePort filters on interface `ifindex`:
    /// (tc ingress, tc egress), `None` where there is none.
    pub fn nodeport_attachment(&self, ifindex: u32) -> Result<(Option<u32>, Option<u32>), DatapathError> {
        let [(ingress, from), (egress, to)] = Self::nodeport_hooks();
        Ok((
            self.nodeport_filter(ifindex, ingress, from)?,
            self.nodeport_filter(ifindex, egress, to)?,
        ))
    }

    fn nodeport_hooks() -> [(tc::Direction, &'static str); 2] {
        [
            (tc::Direction::Ingress, PROG_FROM_NETDEV),
            (tc::Direction::Egress, PROG_TO_NETDEV),
        ]
    }

    fn nodeport_filter(
        &self,
        ifindex: u32,
        direction: tc::Direction,
        program: &'static str,
    ) -> Result<Option<u32>, DatapathError> {
        let name = self.program_filter_name(program);
        Ok(tc::bpf_filters(ifindex, direction)
            .map_err(|error| DatapathError::Tc {
                what: format!("listing the filters of {program}"),
                ifindex,
                error,
            })?
            .into_iter()
            .find(|f| f.is_ours(&name))
            .map(|f| f.prog_id))
    }
}
