//! Setting aside the `lb_services` pin of a loader from before the
//! services' backends moved to `lb_svc_backends` (records of
//! [`LB_SERVICE_V1_SIZE`](rivet_datapath::maps::legacy::LB_SERVICE_V1_SIZE)
//! bytes, 1,024 backend slots inline).
//!
//! [`Datapath::open`](super::Datapath::open) renames such a pin to
//! [`LB_SERVICES_V1_PIN`] before it checks the pins, so the object creates
//! the new `lb_services` beside it; the load balancer's restore
//! ([`crate::lb::LoadBalancer::restore`]) converts every record into the
//! new maps and only then removes the old pin. A loader that dies in
//! between finds the old pin at its next start and converts again (the
//! same writes). No program reads `lb_services`: traffic never notices.

use std::os::fd::AsFd as _;
use std::path::Path;

use rivet_bpf_sys as sys;
use rivet_datapath::maps::legacy::LB_SERVICES_V1;
use rivet_datapath::spec::{MAP_LB_SERVICES, MapSpec};

use super::error::{DatapathError, io_err};

/// The pin an `lb_services` of the first layout is moved to until the
/// load balancer has converted it.
pub const LB_SERVICES_V1_PIN: &str = "lb_services-v1";

/// Renames `<pin_dir>/lb_services` to [`LB_SERVICES_V1_PIN`] if it holds
/// records of the first layout (replacing an older set-aside pin: the
/// pinned map is newer). Returns whether it did.
pub(super) fn set_aside(pin_dir: &Path) -> Result<bool, DatapathError> {
    let pin = pin_dir.join(MAP_LB_SERVICES);
    // No pin, or not a map: nothing to set aside (the pin check names a
    // problem).
    let Ok(fd) = sys::obj_get(&pin) else {
        return Ok(false);
    };
    let info = sys::map_info(fd.as_fd()).map_err(io_err("inspecting the pinned map", &pin))?;
    if !LB_SERVICES_V1.matches(&MapSpec::from(info)) {
        return Ok(false);
    }
    let aside = pin_dir.join(LB_SERVICES_V1_PIN);
    std::fs::rename(&pin, &aside).map_err(io_err("setting aside the first-layout service records", &pin))?;
    Ok(true)
}
