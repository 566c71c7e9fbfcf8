//! The Rivet image: every daemon, the CNI plugin, the operator and the CLI
//! in one image (as Cilium ships one agent image: a node pulls one image and
//! the DaemonSet's containers share its layer), on no base at all: the
//! binaries, the shared libraries `ldd` says they load, `/etc/passwd` and
//! `/etc/group` with the Rivet accounts, and empty `/tmp`, `/run`, `/proc`,
//! `/sys`, `/dev`. No shell, no package manager.
//!
//! The binaries are copied with their debug info stripped (`strip
//! --strip-debug`: symbols stay, so panics still name functions): a dev
//! build's binaries carry 50-110 MB of line tables each. svc-loader's
//! datapath object is embedded in its binary (`svc_loader::DATAPATH_OBJECT`),
//! so there is no BPF file to ship.
//!
//! ```no_run
//! # fn t() -> rivet_oci::Result<()> {
//! use rivet_oci::{OciArchive, rivet};
//! let layer = rivet::rivet_layer("target/release".as_ref(), rivet_oci::Compression::GZIP)?;
//! let mut archive = OciArchive::new();
//! archive.add(rivet::rivet_image(&rivet_oci::reference(rivet::IMAGE, "1a2b3c4"), &layer));
//! archive.write("target/images/rivet-1a2b3c4.oci.tar".as_ref())?;
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use crate::archive::{Image, ImageConfig};
use crate::layer::{Compression, Layer, LayerBuilder};
use crate::{Error, Result, io_context};

/// The image's name under [`REPOSITORY`](crate::REPOSITORY).
pub const IMAGE: &str = "rivet";

/// The binaries in the image, all in [`BIN_DIR`].
pub const BINARIES: &[&str] = &[
    "svc-loader",
    "svc-gc",
    "svc-ipam",
    "svc-identity",
    "svc-endpoint",
    "svc-k8s-sync",
    "svc-health",
    "rivet-operator",
    "rivet-cni",
    "rivet",
];

/// Where the binaries are inside the image (also the image's `PATH`).
pub const BIN_DIR: &str = "/usr/bin";

/// A user of the image's `/etc/passwd`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Account {
    /// The user's name (what `--user` takes).
    pub name: &'static str,
    /// Its uid.
    pub uid: u32,
    /// Its primary gid.
    pub gid: u32,
}

/// The unprivileged node daemons (svc-ipam, svc-identity, svc-endpoint,
/// svc-k8s-sync, svc-health) and the operator; the image's default user.
pub const DAEMON: Account = Account {
    name: "rivet",
    uid: 10001,
    gid: 10001,
};

/// The datapath daemons (svc-loader, svc-gc) when they run as non-root with
/// capabilities; primary group `rivet` (the socket directory's group).
pub const DATAPATH: Account = Account {
    name: "rivet-datapath",
    uid: 10002,
    gid: 10001,
};

/// The group whose members may make read-only calls on the daemons' sockets
/// (`--reader-group`); both accounts are members.
pub const READER_GROUP: (&str, u32) = ("rivet-readers", 10003);

/// The image's `/etc/passwd`.
pub fn passwd() -> String {
    let mut text = String::from("root:x:0:0:root:/:/nonexistent\n");
    for account in [DAEMON, DATAPATH] {
        text.push_str(&format!(
            "{}:x:{}:{}::/nonexistent:/nonexistent\n",
            account.name, account.uid, account.gid
        ));
    }
    text.push_str("nobody:x:65534:65534:nobody:/nonexistent:/nonexistent\n");
    text
}

/// The image's `/etc/group`.
pub fn group() -> String {
    format!(
        "root:x:0:\n{}:x:{}:\n{}:x:{}:{},{}\nnogroup:x:65534:\n",
        DAEMON.name, DAEMON.gid, READER_GROUP.0, READER_GROUP.1, DAEMON.name, DATAPATH.name
    )
}

/// The layer of [`BINARIES`] from `bin_dir` (`target/release` or
/// `target/debug`), stripped of debug info, with the shared libraries they
/// load at the paths `ldd` gives.
pub fn rivet_layer(bin_dir: &Path, compression: Compression) -> Result<Arc<Layer>> {
    let stripped = tempfile::Builder::new()
        .prefix("rivet-oci-strip-")
        .tempdir()
        .map_err(io_context("creating a directory for the stripped binaries"))?;
    let mut layer = LayerBuilder::new();
    let mut libraries = BTreeSet::new();
    for name in BINARIES {
        let binary = bin_dir.join(name);
        if !binary.is_file() {
            return Err(Error::MissingBinary { path: binary });
        }
        libraries.extend(shared_libraries(&binary)?);
        let out = stripped.path().join(name);
        strip_debug(&binary, &out)?;
        layer.file_from_host(&format!("{BIN_DIR}/{name}"), 0o755, &out);
    }
    for library in &libraries {
        layer.file_from_host(&library.to_string_lossy(), 0o755, library);
    }
    for (dir, mode) in [
        ("dev", 0o755),
        ("proc", 0o555),
        ("run", 0o755),
        ("sys", 0o555),
        ("tmp", 0o1777),
    ] {
        layer.dir(dir, mode);
    }
    layer.file("etc/passwd", 0o644, passwd().into_bytes());
    layer.file("etc/group", 0o644, group().into_bytes());
    Ok(Arc::new(layer.build(compression)?))
}

/// The image `name` on `layer`: user [`DAEMON`], `PATH` [`BIN_DIR`], and
/// `rivet --version` as its default command (every container of the
/// DaemonSet names its own).
pub fn rivet_image(name: &str, layer: &Arc<Layer>) -> Image {
    let version = name.rsplit_once(':').map(|(_, tag)| tag).unwrap_or("latest");
    Image {
        name: name.to_owned(),
        config: ImageConfig {
            cmd: vec![format!("{BIN_DIR}/rivet"), "--version".into()],
            env: vec![format!("PATH={BIN_DIR}")],
            user: Some(format!("{}:{}", DAEMON.uid, DAEMON.gid)),
            labels: BTreeMap::from([
                ("org.opencontainers.image.title".into(), "rivet".into()),
                ("org.opencontainers.image.version".into(), version.into()),
            ]),
            created_by: format!("rivet-oci: {} and their shared libraries", BINARIES.join(", ")),
            ..ImageConfig::default()
        },
        layers: vec![layer.clone()],
    }
}

/// Copies `binary` to `out` without its debug info (`strip --strip-debug`:
/// the symbol table stays).
pub(crate) fn strip_debug(binary: &Path, out: &Path) -> Result<()> {
    run(Command::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(out)
        .arg(binary))
    .map(drop)
}

/// The shared libraries `binary` loads (the dynamic loader included), by
/// `ldd`.
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let output = run(Command::new("ldd").arg(binary))?;
    parse_ldd(&output).map_err(|(library, line)| Error::UnresolvedLibrary {
        binary: binary.to_path_buf(),
        library,
        line,
    })
}

/// The paths in `ldd`'s output; `Err((library, line))` for a library it
/// did not find.
fn parse_ldd(output: &str) -> Result<Vec<PathBuf>, (String, String)> {
    let mut paths = Vec::new();
    for line in output.lines().map(str::trim) {
        let (name, rest) = match line.split_once(" => ") {
            Some((name, rest)) => (name, rest),
            None => (line, line),
        };
        if rest.starts_with("not found") {
            return Err((name.to_owned(), line.to_owned()));
        }
        // `/path (0x…)`; the vDSO (`linux-vdso.so.1 (0x…)`) has no file.
        if let Some(path) = rest.split_whitespace().next().filter(|p| p.starts_with('/')) {
            paths.push(PathBuf::from(path));
        }
    }
    Ok(paths)
}

fn run(command: &mut Command) -> Result<String> {
    let cmd = format!("{command:?}").replace('"', "");
    let output = command.output().map_err(io_context(format!("running {cmd}")))?;
    if !output.status.success() {
        return Err(Error::Command {
            cmd,
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_every_library_path_and_the_loader() {
        let output = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                      \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f97)\n\
                      \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f97)\n\
                      \t/lib64/ld-linux-x86-64.so.2 (0x00007f97)\n";
        assert_eq!(
            parse_ldd(output).unwrap(),
            [
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
        assert_eq!(parse_ldd("\tstatically linked\n").unwrap(), Vec::<PathBuf>::new());
        let (library, _) = parse_ldd("\tlibbpf.so.1 => not found\n").unwrap_err();
        assert_eq!(library, "libbpf.so.1");
    }

    #[test]
    fn the_accounts_are_in_passwd_and_group() {
        let passwd = passwd();
        assert!(passwd.contains("rivet:x:10001:10001:"), "{passwd}");
        assert!(passwd.contains("rivet-datapath:x:10002:10001:"), "{passwd}");
        let group = group();
        assert!(group.contains("rivet:x:10001:\n"), "{group}");
        assert!(
            group.contains("rivet-readers:x:10003:rivet,rivet-datapath\n"),
            "{group}"
        );
    }

    #[test]
    fn a_missing_binary_says_how_to_build_it() {
        let dir = tempfile::tempdir().unwrap();
        let err = rivet_layer(dir.path(), Compression::None).unwrap_err();
        assert!(matches!(err, Error::MissingBinary { .. }), "{err}");
        assert!(err.to_string().contains("cargo build --bins"), "{err}");
    }
}
