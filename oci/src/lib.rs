//! OCI images without a registry and without a container daemon.
//!
//! - [`layer`]: a [`LayerBuilder`] collects files (with modes), directories
//!   and symlinks and writes one deterministic layer (uid/gid 0, mtime 0,
//!   sorted entries, gzip without a timestamp): the same inputs always give
//!   the same digests;
//! - [`archive`]: an [`OciArchive`] of one or more [`Image`]s written as an
//!   OCI image-layout tar (`oci-layout`, `index.json`, `blobs/sha256/…`)
//!   that `ctr -n k8s.io images import` reads; images sharing a layer store
//!   it once;
//! - [`busybox`]: the pause and busybox images, from the host's static
//!   busybox;
//! - [`rivet`]: the Rivet image, every daemon, the CNI plugin, the operator
//!   and the CLI with only the shared libraries they load;
//! - [`jaeger`]: the Jaeger image deploy/ runs, from the Go-built binary;
//! - [`images`]: the archives Rivet ships (rivet, pause, busybox tagged
//!   alike; jaeger tagged with its version).
//!
//! ```no_run
//! # fn t() -> rivet_oci::Result<()> {
//! use rivet_oci::{OciArchive, busybox};
//! let layer = busybox::busybox_layer(busybox::HOST_BUSYBOX.as_ref(), rivet_oci::Compression::GZIP)?;
//! let mut archive = OciArchive::new();
//! archive.add(busybox::pause_image(busybox::PAUSE_IMAGE, &layer));
//! archive.add(busybox::busybox_image(busybox::BUSYBOX_IMAGE, &layer));
//! let written = archive.write("/tmp/images.tar".as_ref())?;
//! println!("{} bytes", written.archive_bytes);
//! # Ok(()) }
//! ```

pub mod archive;
pub mod busybox;
pub mod images;
pub mod jaeger;
pub mod layer;
pub mod rivet;

use std::path::PathBuf;
use std::process::ExitStatus;

pub use archive::{ArchiveSummary, Image, ImageConfig, ImageSummary, OciArchive};
pub use layer::{Compression, Layer, LayerBuilder};

/// The repository every Rivet image is named under (`<REPOSITORY>/<name>:<tag>`).
pub const REPOSITORY: &str = "docker.io/rivet";

/// The full reference of image `name` with `tag`, e.g.
/// `docker.io/rivet/rivet:1a2b3c4`.
///
/// ```
/// assert_eq!(rivet_oci::reference("pause", "e2e"), "docker.io/rivet/pause:e2e");
/// ```
pub fn reference(name: &str, tag: &str) -> String {
    format!("{REPOSITORY}/{name}:{tag}")
}

/// Checks `tag` is a valid image tag (`[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`,
/// the distribution spec's rule).
///
/// ```
/// assert!(rivet_oci::check_tag("1a2b3c4-dirty").is_ok());
/// assert!(rivet_oci::check_tag("-x").is_err());
/// ```
pub fn check_tag(tag: &str) -> Result<()> {
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let ok = tag.len() <= 128 && tag.starts_with(valid) && tag.chars().all(|c| valid(c) || c == '.' || c == '-');
    if ok {
        Ok(())
    } else {
        Err(Error::BadTag { tag: tag.to_owned() })
    }
}

/// Everything that can go wrong while building or writing images.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The static busybox the pause and busybox images are built from.
    #[error("{} not found: the pause and busybox images are built from a static busybox (Debian package busybox-static)", path.display())]
    MissingBusybox {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// A binary of the Rivet image is not built.
    #[error("{} not found: build the workspace binaries first (`cargo build --bins`, or `--profile release`)", path.display())]
    MissingBinary {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// The Go-built jaeger binary of the Jaeger image.
    #[error("{} not found: the Jaeger image packs the jaeger binary `cargo xtask install` builds", path.display())]
    MissingJaeger {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// An image tag the distribution spec does not allow.
    #[error("image tag `{tag}`: a tag is 1-128 of A-Z a-z 0-9 _ . - and does not start with . or -")]
    BadTag {
        /// The tag given.
        tag: String,
    },
    /// A path inside a layer is not a plain relative path.
    #[error("layer entry `{path}`: {reason}")]
    BadPath {
        /// The path given.
        path: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// An I/O error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
    /// A command (ldd, strip) ran and failed.
    #[error("`{cmd}` failed ({status}): {stderr}")]
    Command {
        /// The command line.
        cmd: String,
        /// Its exit status.
        status: ExitStatus,
        /// Its stderr, trimmed.
        stderr: String,
    },
    /// `ldd` could not resolve a library a binary needs.
    #[error("{}: ldd cannot resolve `{library}` ({line})", binary.display())]
    UnresolvedLibrary {
        /// The binary.
        binary: PathBuf,
        /// The library's name.
        library: String,
        /// ldd's line about it.
        line: String,
    },
    /// The OCI types refused a value (a bad digest, a missing field).
    #[error("building the image {what} of `{image}`: {source}")]
    Spec {
        /// Manifest, config, descriptor, index.
        what: &'static str,
        /// The image's reference.
        image: String,
        /// The error.
        source: oci_spec::OciSpecError,
    },
}

/// This crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io_context(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}
