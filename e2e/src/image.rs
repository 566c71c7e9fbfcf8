//! OCI images without a registry: one layer holding the host's static
//! busybox and its applet symlinks, written as an OCI image-layout archive
//! (`oci-layout`, `index.json`, `blobs/sha256/…`) that `ctr images import`
//! reads. Several images may share the layer in one archive: the pause image
//! (the sandbox's process) and the tools image (ping, nc, sh, ip…) differ
//! only in their config.
//!
//! Everything is deterministic (uid/gid 0, mtime 0, sorted entries), so the
//! same busybox always gives the same digests.
//!
//! ```no_run
//! # fn t() -> rivet_e2e::Result<()> {
//! use rivet_e2e::image::{ImageSpec, write_archive, busybox_layer};
//! let layer = busybox_layer("/bin/busybox".as_ref())?;
//! let images = [ImageSpec::pause(), ImageSpec::busybox()];
//! write_archive("/tmp/images.tar".as_ref(), &layer, &images)?;
//! # Ok(()) }
//! ```

use std::io::Write;
use std::path::Path;

use serde_json::json;
use sha2::{Digest, Sha256};

use crate::{Error, Missing, Result, io_context};

/// The sandbox ("pause") image: busybox sleeping until killed.
pub const PAUSE_IMAGE: &str = "docker.io/rivet/pause:e2e";

/// The tools image for containers: busybox, no entrypoint of its own
/// (containers give their command).
pub const BUSYBOX_IMAGE: &str = "docker.io/rivet/busybox:e2e";

/// Where the static busybox is on Debian (package busybox-static).
pub const HOST_BUSYBOX: &str = "/bin/busybox";

/// Applets linked in `/bin` of the layer.
pub const APPLETS: &[&str] = &[
    "cat", "echo", "false", "grep", "hostname", "ip", "kill", "ls", "nc", "ping", "ping6", "ps", "sh", "sleep",
    "timeout", "true", "wget",
];

/// The pause image's process: PID 1 of the sandbox, exits on SIGTERM (a
/// shell as PID 1 gets no default signal handling) and is SIGKILLed by
/// containerd anyway on StopPodSandbox.
pub const PAUSE_SCRIPT: &str = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done";

const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MEDIA_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const MEDIA_LAYER: &str = "application/vnd.oci.image.layer.v1.tar";

/// One image of an archive: its reference and the config of its process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSpec {
    /// Full reference, e.g. `docker.io/rivet/busybox:e2e` (what the CRI
    /// `ImageSpec.image` and containerd's `sandbox_image` name).
    pub name: String,
    /// `Entrypoint`.
    pub entrypoint: Vec<String>,
    /// `Cmd`.
    pub cmd: Vec<String>,
}

impl ImageSpec {
    /// [`PAUSE_IMAGE`]: `sh -c` [`PAUSE_SCRIPT`].
    pub fn pause() -> Self {
        Self {
            name: PAUSE_IMAGE.to_owned(),
            entrypoint: vec!["/bin/sh".into(), "-c".into(), PAUSE_SCRIPT.into()],
            cmd: Vec::new(),
        }
    }

    /// [`BUSYBOX_IMAGE`]: `sh` by default.
    pub fn busybox() -> Self {
        Self {
            name: BUSYBOX_IMAGE.to_owned(),
            entrypoint: Vec::new(),
            cmd: vec!["/bin/sh".into()],
        }
    }
}

/// The OCI architecture name of this machine (`amd64`, `arm64`, …).
pub fn oci_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// An uncompressed layer tar: `/bin/busybox` (copied from `busybox`), a
/// symlink per [`APPLETS`] entry, the usual empty directories and a minimal
/// `/etc/passwd` and `/etc/group`.
pub fn busybox_layer(busybox: &Path) -> Result<Vec<u8>> {
    let binary = std::fs::read(busybox).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::Missing(Missing::Busybox {
                path: busybox.to_path_buf(),
            })
        } else {
            Error::Io {
                context: format!("reading {}", busybox.display()),
                source: e,
            }
        }
    })?;
    let mut tar = tar::Builder::new(Vec::new());
    let wrap = io_context("writing the layer tar");
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
        let mut header = new_header(tar::EntryType::Directory, mode, 0);
        tar.append_data(&mut header, format!("{dir}/"), std::io::empty())
            .map_err(io_context("writing the layer tar"))?;
    }
    let mut header = new_header(tar::EntryType::Regular, 0o755, binary.len() as u64);
    tar.append_data(&mut header, "bin/busybox", binary.as_slice())
        .map_err(io_context("writing the layer tar"))?;
    for applet in APPLETS {
        let mut header = new_header(tar::EntryType::Symlink, 0o777, 0);
        tar.append_link(&mut header, format!("bin/{applet}"), "busybox")
            .map_err(io_context("writing the layer tar"))?;
    }
    for (file, text) in [
        ("etc/group", "root:x:0:\nnogroup:x:65534:\n"),
        (
            "etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
        ),
    ] {
        let mut header = new_header(tar::EntryType::Regular, 0o644, text.len() as u64);
        tar.append_data(&mut header, file, text.as_bytes())
            .map_err(io_context("writing the layer tar"))?;
    }
    tar.into_inner().map_err(wrap)
}

fn new_header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut header = tar::Header::new_ustar();
    header.set_entry_type(kind);
    header.set_mode(mode);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    header.set_size(size);
    header
}

/// `sha256:<hex>` of `data`.
pub fn digest(data: &[u8]) -> String {
    let hash = Sha256::digest(data);
    let mut text = String::with_capacity(7 + 64);
    text.push_str("sha256:");
    for byte in hash {
        text.push_str(&format!("{byte:02x}"));
    }
    text
}

/// The image config (OCI image spec "application/vnd.oci.image.config.v1+json").
fn config_json(spec: &ImageSpec, layer_digest: &str) -> Vec<u8> {
    let mut config = json!({
        "Env": ["PATH=/bin"],
        "WorkingDir": "/",
    });
    if !spec.entrypoint.is_empty() {
        config["Entrypoint"] = json!(spec.entrypoint);
    }
    if !spec.cmd.is_empty() {
        config["Cmd"] = json!(spec.cmd);
    }
    let value = json!({
        "created": "1970-01-01T00:00:00Z",
        "architecture": oci_arch(),
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "rivet-e2e: /bin/busybox and applet links"}],
    });
    serde_json::to_vec(&value).expect("JSON values serialise")
}

/// Writes an OCI image-layout archive with `images`, all on `layer`, to
/// `path`. Each index entry carries `io.containerd.image.name` (the full
/// reference `ctr images import` registers) and the OCI
/// `org.opencontainers.image.ref.name` (its tag).
pub fn write_archive(path: &Path, layer: &[u8], images: &[ImageSpec]) -> Result<()> {
    let layer_digest = digest(layer);
    let mut blobs: Vec<(String, Vec<u8>)> = vec![(layer_digest.clone(), layer.to_vec())];
    let mut manifests = Vec::new();
    for spec in images {
        let config = config_json(spec, &layer_digest);
        let config_digest = digest(&config);
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": config.len()},
            "layers": [{"mediaType": MEDIA_LAYER, "digest": layer_digest, "size": layer.len()}],
        }))
        .expect("JSON values serialise");
        let manifest_digest = digest(&manifest);
        let tag = spec.name.rsplit_once(':').map(|(_, tag)| tag).unwrap_or("latest");
        manifests.push(json!({
            "mediaType": MEDIA_MANIFEST,
            "digest": manifest_digest,
            "size": manifest.len(),
            "platform": {"architecture": oci_arch(), "os": "linux"},
            "annotations": {
                "io.containerd.image.name": spec.name,
                "org.opencontainers.image.ref.name": tag,
            },
        }));
        blobs.push((config_digest, config));
        blobs.push((manifest_digest, manifest));
    }
    blobs.sort();
    blobs.dedup_by(|a, b| a.0 == b.0);
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": manifests,
    }))
    .expect("JSON values serialise");

    let file = std::fs::File::create(path).map_err(io_context(format!("creating {}", path.display())))?;
    let mut tar = tar::Builder::new(std::io::BufWriter::new(file));
    let context = || format!("writing {}", path.display());
    let mut add = |name: &str, data: &[u8], kind: tar::EntryType| -> Result<()> {
        let mode = if kind == tar::EntryType::Directory {
            0o755
        } else {
            0o644
        };
        let mut header = new_header(kind, mode, data.len() as u64);
        tar.append_data(&mut header, name, data).map_err(io_context(context()))
    };
    add(
        "oci-layout",
        br#"{"imageLayoutVersion":"1.0.0"}"#,
        tar::EntryType::Regular,
    )?;
    add("index.json", &index, tar::EntryType::Regular)?;
    add("blobs/", &[], tar::EntryType::Directory)?;
    add("blobs/sha256/", &[], tar::EntryType::Directory)?;
    for (digest, data) in &blobs {
        let hex = digest.trim_start_matches("sha256:");
        add(&format!("blobs/sha256/{hex}"), data, tar::EntryType::Regular)?;
    }
    let mut out = tar.into_inner().map_err(io_context(context()))?;
    out.flush().map_err(io_context(context()))?;
    Ok(())
}

/// Writes the archive the e2e tests import: [`ImageSpec::pause`] and
/// [`ImageSpec::busybox`] on one layer built from [`HOST_BUSYBOX`].
pub fn write_e2e_archive(path: &Path) -> Result<()> {
    let layer = busybox_layer(Path::new(HOST_BUSYBOX))?;
    write_archive(path, &layer, &[ImageSpec::pause(), ImageSpec::busybox()])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_archive_is_an_oci_layout_with_both_images_on_one_layer() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("busybox");
        std::fs::write(&fake, b"#!fake busybox").unwrap();
        let layer = busybox_layer(&fake).unwrap();
        let again = busybox_layer(&fake).unwrap();
        assert_eq!(digest(&layer), digest(&again), "layers are deterministic");

        let path = dir.path().join("images.tar");
        write_archive(&path, &layer, &[ImageSpec::pause(), ImageSpec::busybox()]).unwrap();
        let mut archive = tar::Archive::new(std::fs::File::open(&path).unwrap());
        let mut files = std::collections::BTreeMap::new();
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let name = entry.path().unwrap().display().to_string();
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut data).unwrap();
            files.insert(name, data);
        }
        assert!(files.contains_key("oci-layout"));
        let index: serde_json::Value = serde_json::from_slice(&files["index.json"]).unwrap();
        let manifests = index["manifests"].as_array().unwrap();
        assert_eq!(manifests.len(), 2);
        assert_eq!(manifests[0]["annotations"]["io.containerd.image.name"], PAUSE_IMAGE);
        // One layer blob, two configs, two manifests; every digest matches its blob.
        let blobs: Vec<_> = files
            .keys()
            .filter(|k| k.starts_with("blobs/sha256/") && k.len() > 13)
            .collect();
        assert_eq!(blobs.len(), 5, "{blobs:?}");
        for name in blobs {
            assert_eq!(digest(&files[name]), format!("sha256:{}", &name[13..]));
        }
        let manifest_hex = manifests[1]["digest"].as_str().unwrap().trim_start_matches("sha256:");
        let manifest: serde_json::Value =
            serde_json::from_slice(&files[&format!("blobs/sha256/{manifest_hex}")]).unwrap();
        let config_hex = manifest["config"]["digest"]
            .as_str()
            .unwrap()
            .trim_start_matches("sha256:");
        let config: serde_json::Value = serde_json::from_slice(&files[&format!("blobs/sha256/{config_hex}")]).unwrap();
        assert_eq!(config["rootfs"]["diff_ids"][0], digest(&layer));
        assert_eq!(config["config"]["Cmd"][0], "/bin/sh");

        let mut layer_tar = tar::Archive::new(layer.as_slice());
        let names: Vec<String> = layer_tar
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        for want in ["bin/busybox", "bin/nc", "bin/ping", "bin/sh", "tmp/"] {
            assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
        }
    }

    #[test]
    fn a_missing_busybox_names_the_package() {
        let err = busybox_layer(Path::new("/nonexistent/busybox")).unwrap_err();
        assert!(err.to_string().contains("busybox-static"), "{err}");
    }
}
