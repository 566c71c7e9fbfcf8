//! OCI image-layout archives: `oci-layout`, `index.json` and
//! `blobs/sha256/<hex>` in one tar, the format `ctr images import` (and
//! skopeo's `oci-archive:`) reads. Each index entry names its image with
//! `io.containerd.image.name` (the full reference containerd registers)
//! and `org.opencontainers.image.ref.name` (its tag).
//!
//! The manifests, configs and index are the `oci-spec` crate's types,
//! serialised with sorted keys (its annotation and label maps are
//! `HashMap`s), so an archive's bytes depend on its inputs only.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use oci_spec::image::{
    Arch, ConfigBuilder, Descriptor, DescriptorBuilder, Digest, HistoryBuilder, ImageConfigurationBuilder,
    ImageIndexBuilder, ImageManifestBuilder, MediaType, Os, PlatformBuilder, RootFsBuilder,
};
use serde::Serialize;

use crate::layer::{Layer, header, sha256};
use crate::{Error, Result, io_context};

/// When every image was "created": the epoch, for reproducible digests.
const CREATED: &str = "1970-01-01T00:00:00Z";

/// The process an image runs and its environment (the image config's
/// `config` object).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    /// `Entrypoint`.
    pub entrypoint: Vec<String>,
    /// `Cmd`.
    pub cmd: Vec<String>,
    /// `Env`, as `NAME=value`.
    pub env: Vec<String>,
    /// `User` (`uid[:gid]` or a name from the image's `/etc/passwd`);
    /// `None`: root.
    pub user: Option<String>,
    /// `WorkingDir`; empty: `/`.
    pub working_dir: String,
    /// `Labels`.
    pub labels: BTreeMap<String, String>,
    /// The history line written for the image (what made it).
    pub created_by: String,
}

/// One image of an archive: its full reference, its config and its layers
/// (bottom first). Images of one archive may share layers.
#[derive(Debug, Clone)]
pub struct Image {
    /// Full reference, e.g. `docker.io/rivet/rivet:1a2b3c4` (what a pod's
    /// `image:` and containerd's `sandbox_image` name).
    pub name: String,
    /// Its process and environment.
    pub config: ImageConfig,
    /// Its layers, bottom first.
    pub layers: Vec<Arc<Layer>>,
}

/// What [`OciArchive::write`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchiveSummary {
    /// The archive.
    pub path: PathBuf,
    /// Its size.
    pub archive_bytes: u64,
    /// Each image, in the order added.
    pub images: Vec<ImageSummary>,
}

/// One image of a written archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSummary {
    /// Its reference.
    pub name: String,
    /// `sha256:<hex>` of its manifest (what containerd shows as its digest).
    pub manifest_digest: String,
    /// Its layers' blobs (compressed, as stored and pulled).
    pub compressed_bytes: u64,
    /// Its layers' files unpacked.
    pub unpacked_bytes: u64,
}

/// A set of images written as one OCI image-layout archive.
#[derive(Debug, Clone, Default)]
pub struct OciArchive {
    images: Vec<Image>,
}

impl OciArchive {
    /// An archive with no images yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `image`.
    pub fn add(&mut self, image: Image) -> &mut Self {
        self.images.push(image);
        self
    }

    /// Writes the archive to `path` (replacing it).
    pub fn write(&self, path: &Path) -> Result<ArchiveSummary> {
        let mut blobs: BTreeMap<String, Blob<'_>> = BTreeMap::new();
        let mut manifests = Vec::new();
        let mut images = Vec::new();
        for image in &self.images {
            let spec = |what| {
                let image = image.name.clone();
                move |source| Error::Spec { what, image, source }
            };
            let config = canonical_json(&config_of(image).map_err(spec("config"))?);
            let config_digest = sha256(&config);
            let layers = image
                .layers
                .iter()
                .map(|layer| descriptor(layer.media_type().clone(), layer.digest(), layer.blob().len(), None))
                .collect::<Result<Vec<_>, _>>()
                .map_err(spec("layer descriptor"))?;
            let manifest = ImageManifestBuilder::default()
                .schema_version(2u32)
                .media_type(MediaType::ImageManifest)
                .config(
                    descriptor(MediaType::ImageConfig, &config_digest, config.len(), None)
                        .map_err(spec("config descriptor"))?,
                )
                .layers(layers)
                .build()
                .map_err(spec("manifest"))?;
            let manifest = canonical_json(&manifest);
            let manifest_digest = sha256(&manifest);
            let tag = image.name.rsplit_once(':').map(|(_, tag)| tag).unwrap_or("latest");
            let annotations = HashMap::from([
                ("io.containerd.image.name".to_owned(), image.name.clone()),
                ("org.opencontainers.image.ref.name".to_owned(), tag.to_owned()),
            ]);
            manifests.push(
                descriptor(
                    MediaType::ImageManifest,
                    &manifest_digest,
                    manifest.len(),
                    Some(annotations),
                )
                .map_err(spec("manifest descriptor"))?,
            );
            images.push(ImageSummary {
                name: image.name.clone(),
                manifest_digest: manifest_digest.clone(),
                compressed_bytes: image.layers.iter().map(|l| l.blob().len() as u64).sum(),
                unpacked_bytes: image.layers.iter().map(|l| l.unpacked_bytes()).sum(),
            });
            for layer in &image.layers {
                blobs.insert(layer.digest().to_owned(), Blob::Borrowed(layer.blob()));
            }
            blobs.insert(config_digest, Blob::Owned(config));
            blobs.insert(manifest_digest, Blob::Owned(manifest));
        }
        let index = ImageIndexBuilder::default()
            .schema_version(2u32)
            .media_type(MediaType::ImageIndex)
            .manifests(manifests)
            .build()
            .map_err(|source| Error::Spec {
                what: "index",
                image: path.display().to_string(),
                source,
            })?;
        let index = canonical_json(&index);

        let context = || format!("writing {}", path.display());
        let file = std::fs::File::create(path).map_err(io_context(format!("creating {}", path.display())))?;
        let mut tar = tar::Builder::new(std::io::BufWriter::new(file));
        let mut add = |name: &str, data: &[u8], kind: tar::EntryType| -> Result<()> {
            let mode = if kind == tar::EntryType::Directory {
                0o755
            } else {
                0o644
            };
            let mut header = header(kind, mode, data.len() as u64);
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
            add(&format!("blobs/sha256/{hex}"), data.bytes(), tar::EntryType::Regular)?;
        }
        let mut out = tar.into_inner().map_err(io_context(context()))?;
        out.flush().map_err(io_context(context()))?;
        let archive_bytes = out
            .get_ref()
            .metadata()
            .map_err(io_context(format!("reading the size of {}", path.display())))?
            .len();
        Ok(ArchiveSummary {
            path: path.to_path_buf(),
            archive_bytes,
            images,
        })
    }
}

enum Blob<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
}

impl Blob<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Blob::Borrowed(data) => data,
            Blob::Owned(data) => data,
        }
    }
}

/// JSON with every object's keys sorted, whatever map type `value` used.
fn canonical_json(value: &impl Serialize) -> Vec<u8> {
    let mut value = serde_json::to_value(value).expect("OCI types serialise");
    value.sort_all_objects();
    serde_json::to_vec(&value).expect("JSON values serialise")
}

fn descriptor(
    media_type: MediaType,
    digest: &str,
    size: usize,
    annotations: Option<HashMap<String, String>>,
) -> Result<Descriptor, oci_spec::OciSpecError> {
    let digest: Digest = digest.parse()?;
    let builder = DescriptorBuilder::default()
        .media_type(media_type.clone())
        .digest(digest)
        .size(size as u64);
    let builder = match annotations {
        Some(annotations) => builder.annotations(annotations),
        None => builder,
    };
    let builder = if media_type == MediaType::ImageManifest {
        builder.platform(
            PlatformBuilder::default()
                .architecture(Arch::default())
                .os(Os::Linux)
                .build()?,
        )
    } else {
        builder
    };
    builder.build()
}

fn config_of(image: &Image) -> Result<oci_spec::image::ImageConfiguration, oci_spec::OciSpecError> {
    let wanted = &image.config;
    let mut config = ConfigBuilder::default()
        .env(wanted.env.clone())
        .working_dir(if wanted.working_dir.is_empty() {
            "/".to_owned()
        } else {
            wanted.working_dir.clone()
        });
    if !wanted.entrypoint.is_empty() {
        config = config.entrypoint(wanted.entrypoint.clone());
    }
    if !wanted.cmd.is_empty() {
        config = config.cmd(wanted.cmd.clone());
    }
    if let Some(user) = &wanted.user {
        config = config.user(user.clone());
    }
    if !wanted.labels.is_empty() {
        config = config.labels(wanted.labels.clone().into_iter().collect::<HashMap<_, _>>());
    }
    let diff_ids = image.layers.iter().map(|l| l.diff_id().to_owned()).collect::<Vec<_>>();
    let history = image
        .layers
        .iter()
        .map(|_| {
            HistoryBuilder::default()
                .created(CREATED)
                .created_by(wanted.created_by.clone())
                .build()
        })
        .collect::<Result<Vec<_>, _>>()?;
    ImageConfigurationBuilder::default()
        .created(CREATED)
        .architecture(Arch::default())
        .os(Os::Linux)
        .config(config.build()?)
        .rootfs(RootFsBuilder::default().typ("layers").diff_ids(diff_ids).build()?)
        .history(history)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::{Compression, LayerBuilder};

    fn read_archive(path: &Path) -> BTreeMap<String, Vec<u8>> {
        let mut archive = tar::Archive::new(std::fs::File::open(path).unwrap());
        let mut files = BTreeMap::new();
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let name = entry.path().unwrap().display().to_string();
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut data).unwrap();
            files.insert(name, data);
        }
        files
    }

    fn blob(files: &BTreeMap<String, Vec<u8>>, digest: &serde_json::Value) -> serde_json::Value {
        let hex = digest.as_str().unwrap().trim_start_matches("sha256:");
        serde_json::from_slice(&files[&format!("blobs/sha256/{hex}")]).unwrap()
    }

    #[test]
    fn two_images_on_a_shared_layer_are_one_layout_and_every_digest_matches() {
        let mut shared = LayerBuilder::new();
        shared.file("bin/tool", 0o755, b"tool".to_vec());
        let shared = Arc::new(shared.build(Compression::GZIP).unwrap());
        let mut top = LayerBuilder::new();
        top.file("etc/app.conf", 0o644, b"x=1\n".to_vec());
        let top = Arc::new(top.build(Compression::None).unwrap());
        let mut archive = OciArchive::new();
        archive.add(Image {
            name: "docker.io/rivet/one:t1".into(),
            config: ImageConfig {
                entrypoint: vec!["/bin/tool".into()],
                user: Some("10001:10001".into()),
                labels: BTreeMap::from([("a".into(), "1".into()), ("b".into(), "2".into())]),
                ..ImageConfig::default()
            },
            layers: vec![shared.clone()],
        });
        archive.add(Image {
            name: "docker.io/rivet/two:t2".into(),
            config: ImageConfig {
                cmd: vec!["/bin/tool".into(), "--flag".into()],
                ..ImageConfig::default()
            },
            layers: vec![shared.clone(), top.clone()],
        });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("images.tar");
        let summary = archive.write(&path).unwrap();
        assert_eq!(summary.archive_bytes, std::fs::metadata(&path).unwrap().len());
        assert_eq!(summary.images[1].unpacked_bytes, 4 + 4);

        let files = read_archive(&path);
        assert_eq!(files["oci-layout"], br#"{"imageLayoutVersion":"1.0.0"}"#);
        let index: serde_json::Value = serde_json::from_slice(&files["index.json"]).unwrap();
        let manifests = index["manifests"].as_array().unwrap();
        assert_eq!(manifests.len(), 2);
        assert_eq!(
            manifests[1]["annotations"]["io.containerd.image.name"],
            "docker.io/rivet/two:t2"
        );
        assert_eq!(manifests[1]["annotations"]["org.opencontainers.image.ref.name"], "t2");
        assert_eq!(manifests[1]["digest"], summary.images[1].manifest_digest.as_str());
        // Two layers (the shared one once), two configs, two manifests.
        let blobs: Vec<_> = files
            .keys()
            .filter(|k| k.starts_with("blobs/sha256/") && k.len() > 13)
            .collect();
        assert_eq!(blobs.len(), 6, "{blobs:?}");
        for name in blobs {
            assert_eq!(sha256(&files[name]), format!("sha256:{}", &name[13..]));
        }
        let manifest = blob(&files, &manifests[1]["digest"]);
        assert_eq!(
            manifest["layers"][0]["mediaType"],
            "application/vnd.oci.image.layer.v1.tar+gzip"
        );
        assert_eq!(
            manifest["layers"][1]["mediaType"],
            "application/vnd.oci.image.layer.v1.tar"
        );
        let config = blob(&files, &manifest["config"]["digest"]);
        assert_eq!(config["rootfs"]["diff_ids"][0], shared.diff_id());
        assert_eq!(config["rootfs"]["diff_ids"][1], top.diff_id());
        assert_eq!(config["config"]["Cmd"][1], "--flag");
        assert_eq!(
            config["architecture"],
            Arch::default().to_string(),
            "Go's name of this machine's architecture"
        );
        let first = blob(&files, &manifests[0]["digest"]);
        let first_config = blob(&files, &first["config"]["digest"]);
        assert_eq!(first_config["config"]["User"], "10001:10001");
        assert_eq!(first_config["config"]["Entrypoint"][0], "/bin/tool");

        // The same inputs again: the same bytes.
        let again = dir.path().join("again.tar");
        assert_eq!(archive.write(&again).unwrap().images, summary.images);
        assert_eq!(std::fs::read(&path).unwrap(), std::fs::read(&again).unwrap());
    }
}
