//! The archives Rivet ships, written side by side:
//! `<out>/rivet-<tag>.oci.tar`, `<out>/pause-<tag>.oci.tar` and
//! `<out>/busybox-<tag>.oci.tar`, one image each, named
//! `docker.io/rivet/<image>:<tag>`, and when asked the Jaeger image
//! `<out>/jaeger-<version>.oci.tar` (`docker.io/rivet/jaeger:<version>`).
//! `cargo xtask image` writes them from the release binaries; tests and the
//! cluster fixture from the dev ones.
//!
//! ```no_run
//! # fn t() -> rivet_oci::Result<()> {
//! let written = rivet_oci::images::write_images(&rivet_oci::images::ImageSet {
//!     bin_dir: "target/debug".into(),
//!     busybox: rivet_oci::busybox::HOST_BUSYBOX.into(),
//!     out_dir: "target/images".into(),
//!     tag: "dev".into(),
//!     compression: rivet_oci::Compression::GZIP_FAST,
//!     jaeger: None,
//! })?;
//! println!("{}", written.rivet.path.display());
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};

use crate::archive::{ArchiveSummary, OciArchive};
use crate::layer::Compression;
use crate::{Result, busybox, io_context, jaeger, reference, rivet};

/// What to build and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSet {
    /// Where the Rivet binaries are (`target/release`, `target/debug`).
    pub bin_dir: PathBuf,
    /// The static busybox of the pause and busybox images.
    pub busybox: PathBuf,
    /// Where the archives go (created if missing).
    pub out_dir: PathBuf,
    /// Every image's tag.
    pub tag: String,
    /// The layers' compression ([`Compression::GZIP`] ships,
    /// [`Compression::GZIP_FAST`] for dev images).
    pub compression: Compression,
    /// The Jaeger image's binary and version; `None`: no Jaeger image.
    pub jaeger: Option<JaegerBinary>,
}

/// The Go-built jaeger binary the Jaeger image packs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JaegerBinary {
    /// The binary.
    pub path: PathBuf,
    /// Its version, the image's tag.
    pub version: String,
}

impl JaegerBinary {
    /// The one `cargo xtask install` built, with its pinned version.
    ///
    /// # Errors
    /// Not installed (the error names `cargo xtask install`).
    pub fn installed() -> std::result::Result<Self, rivet_tools::ToolError> {
        Ok(Self {
            path: rivet_tools::tool_path(rivet_tools::Tool::Jaeger)?,
            version: rivet_tools::JAEGER.version.to_owned(),
        })
    }
}

/// The archives written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenImages {
    /// `rivet`: every binary ([`rivet::rivet_image`]).
    pub rivet: ArchiveSummary,
    /// `pause` ([`busybox::pause_image`]).
    pub pause: ArchiveSummary,
    /// `busybox` ([`busybox::busybox_image`]).
    pub busybox: ArchiveSummary,
    /// `jaeger` ([`jaeger::jaeger_image`]), when [`ImageSet::jaeger`] was given.
    pub jaeger: Option<ArchiveSummary>,
}

impl WrittenImages {
    /// Every archive written, rivet first.
    pub fn all(&self) -> Vec<&ArchiveSummary> {
        [&self.rivet, &self.pause, &self.busybox]
            .into_iter()
            .chain(self.jaeger.as_ref())
            .collect()
    }
}

/// `<out_dir>/<image>-<tag>.oci.tar`.
pub fn archive_path(out_dir: &Path, image: &str, tag: &str) -> PathBuf {
    out_dir.join(format!("{image}-{tag}.oci.tar"))
}

/// Builds and writes the archives of `set`.
pub fn write_images(set: &ImageSet) -> Result<WrittenImages> {
    crate::check_tag(&set.tag)?;
    std::fs::create_dir_all(&set.out_dir).map_err(io_context(format!("creating {}", set.out_dir.display())))?;
    let write_one = |name: &str, tag: &str, image| {
        let mut archive = OciArchive::new();
        archive.add(image);
        archive.write(&archive_path(&set.out_dir, name, tag))
    };
    let layer = rivet::rivet_layer(&set.bin_dir, set.compression)?;
    let rivet = write_one(
        rivet::IMAGE,
        &set.tag,
        rivet::rivet_image(&reference(rivet::IMAGE, &set.tag), &layer),
    )?;
    drop(layer);
    let layer = busybox::busybox_layer(&set.busybox, set.compression)?;
    let pause = write_one(
        "pause",
        &set.tag,
        busybox::pause_image(&reference("pause", &set.tag), &layer),
    )?;
    let busybox = write_one(
        "busybox",
        &set.tag,
        busybox::busybox_image(&reference("busybox", &set.tag), &layer),
    )?;
    drop(layer);
    let jaeger = match &set.jaeger {
        Some(binary) => {
            crate::check_tag(&binary.version)?;
            let layer = jaeger::jaeger_layer(&binary.path, set.compression)?;
            Some(write_one(
                jaeger::IMAGE,
                &binary.version,
                jaeger::jaeger_image(&reference(jaeger::IMAGE, &binary.version), &layer),
            )?)
        }
        None => None,
    };
    Ok(WrittenImages {
        rivet,
        pause,
        busybox,
        jaeger,
    })
}
