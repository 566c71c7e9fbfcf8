//! The e2e tests' images, built by `rivet-oci`: the pause image (the
//! sandbox's process) and the busybox tools image (ping, nc, sh, ip…) on one
//! layer from the host's static busybox, in one OCI archive `ctr images
//! import` reads.
//!
//! ```no_run
//! # fn t() -> rivet_e2e::Result<()> {
//! rivet_e2e::image::write_e2e_archive("/tmp/images.tar".as_ref())?;
//! # Ok(()) }
//! ```

use std::path::Path;

pub use rivet_oci::busybox::{APPLETS, BUSYBOX_IMAGE, HOST_BUSYBOX, PAUSE_IMAGE, PAUSE_SCRIPT};
use rivet_oci::{OciArchive, busybox};

use crate::Result;

/// Writes the archive the e2e tests import: [`PAUSE_IMAGE`] and
/// [`BUSYBOX_IMAGE`] on one layer built from [`HOST_BUSYBOX`].
pub fn write_e2e_archive(path: &Path) -> Result<()> {
    let layer = busybox::busybox_layer(Path::new(HOST_BUSYBOX), rivet_oci::Compression::GZIP)?;
    let mut archive = OciArchive::new();
    archive
        .add(busybox::pause_image(PAUSE_IMAGE, &layer))
        .add(busybox::busybox_image(BUSYBOX_IMAGE, &layer));
    archive.write(path)?;
    Ok(())
}
