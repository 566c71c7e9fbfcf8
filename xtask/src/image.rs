//! `cargo xtask image`: the Rivet, pause and busybox images as OCI archives
//! (`rivet_oci::images`), from the workspace binaries of one profile, tagged
//! with the git revision, and the Jaeger image deploy/ runs (the jaeger of
//! `cargo xtask install`, tagged with its version), ready for
//! `ctr -n k8s.io images import`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use rivet_oci::images::{ImageSet, JaegerBinary, write_images};

use crate::cmd;

/// Arguments of `cargo xtask image`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The cargo profile of the binaries: `release` (what ships) or `dev`
    /// (what the tests build; their debug info is stripped either way).
    #[arg(long, default_value = "release",
          value_parser = clap::builder::PossibleValuesParser::new(["release", "dev"]))]
    profile: String,
    /// Where the archives go (default `target/images`).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// The images' tag (default: `git rev-parse --short HEAD`, plus `-dirty`
    /// when tracked files differ from it).
    #[arg(long, value_name = "TAG")]
    tag: Option<String>,
}

/// Builds the binaries, writes the four archives and prints their sizes.
pub fn run(args: &Args) -> Result<()> {
    let jaeger = JaegerBinary::installed().context("the Jaeger image packs the installed jaeger")?;
    let tag = match &args.tag {
        Some(tag) => tag.clone(),
        None => git_tag()?,
    };
    rivet_oci::check_tag(&tag)?;
    // The workspace's binaries in one build, as CI builds them (a `-p` list
    // would unify features differently and rebuild the dev binaries).
    cmd::run(cmd::cargo().args(["build", "--workspace", "--bins", "--profile", &args.profile]))?;
    let bin_dir = cmd::target_dir().join(profile_dir(&args.profile));
    let out_dir = args.out.clone().unwrap_or_else(|| cmd::target_dir().join("images"));
    let written = write_images(&ImageSet {
        bin_dir,
        busybox: rivet_oci::busybox::HOST_BUSYBOX.into(),
        out_dir,
        tag,
        // A dev image is for tests: gzip's fastest level (about 5x faster, 20% larger).
        compression: match args.profile.as_str() {
            "dev" => rivet_oci::Compression::GZIP_FAST,
            _ => rivet_oci::Compression::GZIP,
        },
        jaeger: Some(jaeger),
    })?;
    println!("{:<40} {:>12} {:>12}  archive", "image", "compressed", "unpacked");
    for archive in written.all() {
        for image in &archive.images {
            println!(
                "{:<40} {:>12} {:>12}  {}",
                image.name,
                mib(archive.archive_bytes),
                mib(image.unpacked_bytes),
                relative(&archive.path).display()
            );
        }
    }
    println!("import on a node: ctr -n k8s.io images import <archive>");
    Ok(())
}

/// The directory under `target/` of a cargo profile.
fn profile_dir(profile: &str) -> &str {
    match profile {
        "dev" => "debug",
        other => other,
    }
}

/// `git rev-parse --short HEAD`, plus `-dirty` when tracked files differ.
fn git_tag() -> Result<String> {
    let root = cmd::workspace_root();
    let output = Command::new("git")
        .current_dir(root)
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .context("running git rev-parse --short HEAD (pass --tag outside a git checkout)")?;
    anyhow::ensure!(
        output.status.success(),
        "git rev-parse --short HEAD failed ({}): {} (pass --tag outside a git checkout)",
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    );
    let revision = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    let clean = Command::new("git")
        .current_dir(root)
        .args(["diff", "--quiet", "HEAD"])
        .status()
        .context("running git diff --quiet HEAD")?;
    Ok(if clean.success() {
        revision
    } else {
        format!("{revision}-dirty")
    })
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn relative(path: &Path) -> &Path {
    path.strip_prefix(cmd::workspace_root()).unwrap_or(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_map_to_their_target_dirs() {
        assert_eq!(profile_dir("dev"), "debug");
        assert_eq!(profile_dir("release"), "release");
    }
}
