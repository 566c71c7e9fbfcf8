//! The Jaeger image deploy/ runs (`base/jaeger/`): the Go-built, static
//! `jaeger` binary that `cargo xtask install` caches (Jaeger v2, the
//! all-in-one: OTLP in, memory storage, the query API), on no base: the
//! binary with its debug info stripped (99 MB instead of 121 MB; Go's
//! stack traces use its own tables, not DWARF), `/etc/passwd` and
//! `/etc/group` naming its user, and an empty `/tmp`. Tagged with Jaeger's
//! version, not Rivet's revision: the image changes only when the tool does.
//!
//! ```no_run
//! # fn t() -> rivet_oci::Result<()> {
//! use rivet_oci::{OciArchive, jaeger};
//! let binary = std::path::Path::new("/root/.cache/rivet/tools/jaeger-v1.76.0/bin/jaeger");
//! let layer = jaeger::jaeger_layer(binary, rivet_oci::Compression::GZIP)?;
//! let mut archive = OciArchive::new();
//! archive.add(jaeger::jaeger_image(&rivet_oci::reference(jaeger::IMAGE, "v1.76.0"), &layer));
//! archive.write("target/images/jaeger-v1.76.0.oci.tar".as_ref())?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use crate::archive::{Image, ImageConfig};
use crate::layer::{Compression, Layer, LayerBuilder};
use crate::rivet::{Account, strip_debug};
use crate::{Error, Result, io_context};

/// The image's name under [`REPOSITORY`](crate::REPOSITORY).
pub const IMAGE: &str = "jaeger";

/// Where the binary is inside the image.
pub const BINARY: &str = "/usr/bin/jaeger";

/// The image's user (deploy/'s `runAsUser`): Rivet's daemon uid, so one
/// number is non-root in every Rivet image.
pub const USER: Account = Account {
    name: "jaeger",
    uid: 10001,
    gid: 10001,
};

/// The layer: `jaeger` (from `binary`, debug info stripped) at [`BINARY`],
/// `/etc/passwd` and `/etc/group` with [`USER`], empty `/tmp`, `/proc`,
/// `/sys`, `/dev`.
pub fn jaeger_layer(binary: &Path, compression: Compression) -> Result<Arc<Layer>> {
    if !binary.is_file() {
        return Err(Error::MissingJaeger {
            path: binary.to_path_buf(),
        });
    }
    let stripped = tempfile::Builder::new()
        .prefix("rivet-oci-strip-")
        .tempdir()
        .map_err(io_context("creating a directory for the stripped jaeger"))?;
    let out = stripped.path().join("jaeger");
    strip_debug(binary, &out)?;
    let mut layer = LayerBuilder::new();
    layer.file_from_host(BINARY, 0o755, &out);
    for (dir, mode) in [("dev", 0o755), ("proc", 0o555), ("sys", 0o555), ("tmp", 0o1777)] {
        layer.dir(dir, mode);
    }
    layer.file(
        "etc/passwd",
        0o644,
        format!(
            "root:x:0:0:root:/:/nonexistent\n{}:x:{}:{}::/nonexistent:/nonexistent\n",
            USER.name, USER.uid, USER.gid
        )
        .into_bytes(),
    );
    layer.file(
        "etc/group",
        0o644,
        format!("root:x:0:\n{}:x:{}:\n", USER.name, USER.gid).into_bytes(),
    );
    Ok(Arc::new(layer.build(compression)?))
}

/// The image `name` on `layer`: [`BINARY`] as entrypoint (deploy/ gives
/// `--config`), user [`USER`].
pub fn jaeger_image(name: &str, layer: &Arc<Layer>) -> Image {
    let version = name.rsplit_once(':').map(|(_, tag)| tag).unwrap_or("latest");
    Image {
        name: name.to_owned(),
        config: ImageConfig {
            entrypoint: vec![BINARY.into()],
            env: vec!["PATH=/usr/bin".into()],
            user: Some(format!("{}:{}", USER.uid, USER.gid)),
            labels: BTreeMap::from([
                ("org.opencontainers.image.title".into(), "jaeger".into()),
                ("org.opencontainers.image.version".into(), version.into()),
            ]),
            created_by: "rivet-oci: the Go-built jaeger of cargo xtask install".into(),
            ..ImageConfig::default()
        },
        layers: vec![layer.clone()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_jaeger_says_how_to_get_it() {
        let dir = tempfile::tempdir().unwrap();
        let err = jaeger_layer(&dir.path().join("jaeger"), Compression::None).unwrap_err();
        assert!(matches!(err, Error::MissingJaeger { .. }), "{err}");
        assert!(err.to_string().contains("cargo xtask install"), "{err}");
    }
}
