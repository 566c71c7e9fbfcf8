//! The images `cargo xtask image` writes (`rivet_oci::images`), built here
//! from the dev binaries the test run already built (a release build would
//! not fit CI's time), imported into a real containerd with `ctr -n k8s.io
//! images import`, and run:
//!
//! - `rivet_image_runs_every_binary_under_containerd`: every binary of the
//!   Rivet image starts in a container of it (`--version`, rivet-cni's
//!   `CNI_COMMAND=VERSION`) with only the libraries the image carries, as
//!   the image's default user (`id` of a static busybox mounted in), with
//!   no shell; the busybox image runs `sh` and `ping`; the Jaeger image
//!   (the jaeger of `cargo xtask install`, tag v1.76.0) runs `jaeger
//!   version` as uid 10001; two builds of the same binaries give the same
//!   digests and the same archive bytes.
//!
//! Needs root, containerd, ctr, runc, strip and ldd (binutils, libc-bin),
//! /bin/busybox (busybox-static), /usr/lib/cni/loopback and the Go-built
//! jaeger (`cargo xtask install`): a missing one
//! fails the test with its name.

use std::path::Path;

use rivet_common::testing::netns::NetNs;
use rivet_common::testing::workspace_binary;
use rivet_e2e::containerd::{Containerd, ContainerdConfig, REFERENCE_CNI_DIR};
use rivet_oci::busybox::HOST_BUSYBOX;
use rivet_oci::images::{ImageSet, JaegerBinary, write_images};
use rivet_oci::rivet::{BINARIES, DAEMON};

/// A CNI config dir with a loopback-only conflist: the CRI plugin reports
/// NetworkReady (the containers here run without pods, so without CNI).
fn loopback_cni(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let (bin, conf) = (dir.join("bin"), dir.join("conf"));
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&conf).unwrap();
    std::os::unix::fs::symlink(Path::new(REFERENCE_CNI_DIR).join("loopback"), bin.join("loopback")).unwrap();
    std::fs::write(
        conf.join("10-lo.conflist"),
        br#"{"cniVersion":"1.0.0","name":"lo","plugins":[{"type":"loopback"}]}"#,
    )
    .unwrap();
    (bin, conf)
}

#[tokio::test(flavor = "multi_thread")]
async fn rivet_image_runs_every_binary_under_containerd() {
    let bin_dir = workspace_binary("rivet").parent().unwrap().to_path_buf();
    let dir = tempfile::Builder::new().prefix("rivet-images-").tempdir().unwrap();
    let tag = format!("test-{}", std::process::id());
    let set = ImageSet {
        bin_dir,
        busybox: HOST_BUSYBOX.into(),
        out_dir: dir.path().join("one"),
        tag: tag.clone(),
        compression: rivet_oci::Compression::GZIP_FAST,
        jaeger: Some(JaegerBinary::installed().unwrap_or_else(|e| panic!("{e}"))),
    };
    let started = std::time::Instant::now();
    let written = write_images(&set).unwrap_or_else(|e| panic!("{e}"));
    let took = started.elapsed();
    for archive in written.all() {
        let image = &archive.images[0];
        eprintln!(
            "{}: archive {} bytes, layers {} compressed, {} unpacked ({took:?} for all four)",
            image.name, archive.archive_bytes, image.compressed_bytes, image.unpacked_bytes
        );
    }
    let again = write_images(&ImageSet {
        out_dir: dir.path().join("two"),
        ..set.clone()
    })
    .unwrap();
    for (one, two) in written.all().into_iter().zip(again.all()) {
        assert_eq!(one.images, two.images, "two builds give the same digests");
        assert_eq!(
            std::fs::read(&one.path).unwrap(),
            std::fs::read(&two.path).unwrap(),
            "{} and {} differ",
            one.path.display(),
            two.path.display()
        );
    }
    drop(again);

    let node = NetNs::new("rvimg").unwrap();
    let (cni_bin, cni_conf) = loopback_cni(dir.path());
    let containerd = Containerd::start(ContainerdConfig::new(&cni_bin, &cni_conf).netns(node.path()))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for archive in written.all() {
        let name = archive.images[0].name.as_str();
        containerd
            .import_images(&archive.path, &[name])
            .await
            .unwrap_or_else(|e| panic!("importing {}: {e}", archive.path.display()));
    }
    let rivet = &written.rivet.images[0].name;
    assert_eq!(rivet, &format!("docker.io/rivet/rivet:{tag}"));
    for (n, binary) in BINARIES.iter().enumerate() {
        let id = format!("rivet-img-{}-{n}", std::process::id());
        let out = if *binary == "rivet-cni" {
            containerd.run_container(rivet, &id, &[("CNI_COMMAND", "VERSION")], &[], &[binary])
        } else {
            containerd.run_container(rivet, &id, &[], &[], &[binary, "--version"])
        }
        .unwrap_or_else(|e| panic!("{binary} in {rivet}: {e}"));
        if *binary == "rivet-cni" {
            let version: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out}: {e}"));
            assert!(
                version["supportedVersions"].as_array().is_some_and(|v| !v.is_empty()),
                "{out}"
            );
        } else {
            assert_eq!(out.trim(), format!("{binary} {}", env!("CARGO_PKG_VERSION")));
        }
    }
    // The image's default user, seen by a process of it (no shell in the
    // image: the host's static busybox is mounted in for `id`).
    let busybox = Path::new(HOST_BUSYBOX);
    for (flag, want) in [("-u", DAEMON.uid), ("-g", DAEMON.gid)] {
        let id = format!("rivet-img-{}-id{flag}", std::process::id());
        let out = containerd
            .run_container(
                rivet,
                &id,
                &[],
                &[(busybox, "/bin/busybox")],
                &["/bin/busybox", "id", flag],
            )
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(out.trim(), want.to_string(), "id {flag} in {rivet}");
    }
    let no_shell = containerd.run_container(
        rivet,
        &format!("rivet-img-{}-sh", std::process::id()),
        &[],
        &[],
        &["sh"],
    );
    assert!(no_shell.is_err(), "the Rivet image has no shell: {no_shell:?}");

    let pong = containerd
        .run_container(
            &written.busybox.images[0].name,
            &format!("rivet-img-{}-bb", std::process::id()),
            &[],
            &[],
            &["sh", "-c", "ping -c1 -W1 127.0.0.1 >/dev/null && echo pong"],
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(pong.trim(), "pong");

    let jaeger = &written.jaeger.as_ref().expect("asked for the Jaeger image").images[0].name;
    assert_eq!(jaeger, "docker.io/rivet/jaeger:v1.76.0");
    let out = containerd
        .run_container(
            jaeger,
            &format!("rivet-img-{}-jaeger", std::process::id()),
            &[],
            &[],
            &["/usr/bin/jaeger", "version"],
        )
        .unwrap_or_else(|e| panic!("jaeger version in {jaeger}: {e}"));
    // Its log line (stderr) and the JSON (stdout, no newline) share the log in
    // either order, even on one line: read the first JSON value from its brace.
    let version = &out[out.find('{').unwrap_or(out.len())..];
    let version: serde_json::Value = serde_json::Deserializer::from_str(version)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no JSON in `jaeger version`: {out}"))
        .unwrap_or_else(|e| panic!("{out}: {e}"));
    assert!(version.get("gitVersion").is_some(), "{out}");
    let out = containerd
        .run_container(
            jaeger,
            &format!("rivet-img-{}-jaeger-id", std::process::id()),
            &[],
            &[(busybox, "/bin/busybox")],
            &["/bin/busybox", "id", "-u"],
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.trim(), "10001", "the Jaeger image's user");
}
