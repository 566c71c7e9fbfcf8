//! The pause and busybox images: one layer holding the host's static busybox
//! and its applet symlinks, shared by both images (they differ only in their
//! config).
//!
//! The pause image is busybox's `sh` sleeping until SIGTERM rather than a
//! dedicated static `pause` binary: it needs no compiler at image build time
//! and shares the busybox layer, so a node stores it once.
//!
//! ```no_run
//! # fn t() -> rivet_oci::Result<()> {
//! use rivet_oci::{OciArchive, busybox};
//! let layer = busybox::busybox_layer(busybox::HOST_BUSYBOX.as_ref(), rivet_oci::Compression::GZIP)?;
//! let mut archive = OciArchive::new();
//! archive.add(busybox::pause_image(&rivet_oci::reference("pause", "v1"), &layer));
//! archive.write("/tmp/pause.tar".as_ref())?;
//! # Ok(()) }
//! ```

use std::path::Path;
use std::sync::Arc;

use crate::archive::{Image, ImageConfig};
use crate::layer::{Compression, Layer, LayerBuilder};
use crate::{Error, Result};

/// The e2e tests' sandbox ("pause") image.
pub const PAUSE_IMAGE: &str = "docker.io/rivet/pause:e2e";

/// The e2e tests' tools image.
pub const BUSYBOX_IMAGE: &str = "docker.io/rivet/busybox:e2e";

/// Where the static busybox is on Debian (package busybox-static).
pub const HOST_BUSYBOX: &str = "/bin/busybox";

/// Applets linked in `/bin` of the layer (what the tests run in pods).
pub const APPLETS: &[&str] = &[
    "cat", "echo", "false", "grep", "hostname", "id", "ip", "kill", "ls", "nc", "nslookup", "ping", "ping6", "ps",
    "sh", "sleep", "timeout", "true", "wget",
];

/// The pause image's process: PID 1 of the sandbox, exits on SIGTERM (a
/// shell as PID 1 gets no default signal handling) and is SIGKILLed by
/// containerd anyway on StopPodSandbox.
pub const PAUSE_SCRIPT: &str = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done";

/// The layer: `/bin/busybox` (copied from `busybox`), a symlink per
/// [`APPLETS`] entry, the usual empty directories and a minimal
/// `/etc/passwd` and `/etc/group` (root and nobody).
pub fn busybox_layer(busybox: &Path, compression: Compression) -> Result<Arc<Layer>> {
    let binary = std::fs::read(busybox).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::MissingBusybox {
                path: busybox.to_path_buf(),
            }
        } else {
            Error::Io {
                context: format!("reading {}", busybox.display()),
                source: e,
            }
        }
    })?;
    let mut layer = LayerBuilder::new();
    for (dir, mode) in [
        ("bin", 0o755),
        ("dev", 0o755),
        ("etc", 0o755),
        ("proc", 0o555),
        ("root", 0o700),
        ("sys", 0o555),
        ("tmp", 0o1777),
        ("var", 0o755),
    ] {
        layer.dir(dir, mode);
    }
    layer.file("bin/busybox", 0o755, binary);
    for applet in APPLETS {
        layer.symlink(&format!("bin/{applet}"), "busybox");
    }
    layer.file("etc/group", 0o644, b"root:x:0:\nnogroup:x:65534:\n".to_vec());
    layer.file(
        "etc/passwd",
        0o644,
        b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n".to_vec(),
    );
    Ok(Arc::new(layer.build(compression)?))
}

/// The sandbox image `name` on `layer`: `sh -c` [`PAUSE_SCRIPT`].
pub fn pause_image(name: &str, layer: &Arc<Layer>) -> Image {
    Image {
        name: name.to_owned(),
        config: ImageConfig {
            entrypoint: vec!["/bin/sh".into(), "-c".into(), PAUSE_SCRIPT.into()],
            env: vec!["PATH=/bin".into()],
            created_by: "rivet-oci: busybox sleeping until SIGTERM".into(),
            ..ImageConfig::default()
        },
        layers: vec![layer.clone()],
    }
}

/// The tools image `name` on `layer`: `sh` by default (containers give
/// their command).
pub fn busybox_image(name: &str, layer: &Arc<Layer>) -> Image {
    Image {
        name: name.to_owned(),
        config: ImageConfig {
            cmd: vec!["/bin/sh".into()],
            env: vec!["PATH=/bin".into()],
            created_by: "rivet-oci: /bin/busybox and applet links".into(),
            ..ImageConfig::default()
        },
        layers: vec![layer.clone()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layer_holds_busybox_and_the_applets_the_tests_run() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("busybox");
        std::fs::write(&fake, b"#!fake busybox").unwrap();
        let layer = busybox_layer(&fake, Compression::GZIP).unwrap();
        assert_eq!(layer, busybox_layer(&fake, Compression::GZIP).unwrap(), "deterministic");
        let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(layer.blob()));
        let names: Vec<String> = tar
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        for want in [
            "bin/busybox",
            "bin/nc",
            "bin/ping",
            "bin/sh",
            "bin/ip",
            "bin/sleep",
            "bin/wget",
            "tmp/",
            "etc/passwd",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
        }
        let pause = pause_image(PAUSE_IMAGE, &layer);
        assert_eq!(pause.config.entrypoint[2], PAUSE_SCRIPT);
        assert!(Arc::ptr_eq(
            &pause.layers[0],
            &busybox_image(BUSYBOX_IMAGE, &layer).layers[0]
        ));
    }

    #[test]
    fn a_missing_busybox_names_the_package() {
        let err = busybox_layer(Path::new("/nonexistent/busybox"), Compression::None).unwrap_err();
        assert!(err.to_string().contains("busybox-static"), "{err}");
    }
}
