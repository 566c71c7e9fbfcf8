//! `cargo xtask install`: make a fresh Debian 12 machine (root, Rust toolchain and Go
//! only) ready for the tests, the demo and the benchmarks. Every other command runs it
//! first, so it must be idempotent and cheap when there is nothing to do: it asks dpkg,
//! /proc/mounts, the user database and the Go tools' stamps first and only acts on what
//! is missing.

mod go_tools;

use std::fs;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::cmd;

/// Debian packages the workspace needs, and why:
/// - clang, llvm, libbpf-dev: compile the C datapath (`clang -target bpf`) in
///   svc-loader's build script;
/// - iproute2, iputils-ping, iperf3: network namespaces, veth and traffic in the
///   cross-process tests, the demo and the benchmarks;
/// - protobuf-compiler, libprotobuf-dev: a `protoc` and the well-known types it imports
///   (`google/protobuf/descriptor.proto`, only a Recommends of protoc) for etcd-client's
///   build script (our own protos are compiled without one);
/// - iptables: kube-proxy's iptables rules (nf_tables backend, as Debian ships it),
///   the peer of the `services` benchmark, loaded into namespaces it owns;
/// - containernetworking-plugins: the reference CNI plugins (bridge, host-local, ptp)
///   rivet-cni is compared with and chained after;
/// - containerd, runc, busybox-static: a real container runtime calling rivet-cni
///   through CRI, with a locally built busybox image;
/// - binutils: `strip`, for the binaries of `cargo xtask image`;
/// - python3-grpcio, python3-venv: gRPC clients of another language calling every
///   daemon's socket (Debian's grpcio, and PyPI's newer one in [`GRPCIO_VENV`]).
///
/// etcd is not among them: Debian's 3.4 is too old for kube-apiserver 1.34; the tests
/// run the etcd 3.6 that `go_tools` builds.
pub const PACKAGES: &[&str] = &[
    "clang",
    "llvm",
    "libbpf-dev",
    "iproute2",
    "iputils-ping",
    "iperf3",
    "iptables",
    "protobuf-compiler",
    "libprotobuf-dev",
    "containernetworking-plugins",
    "containerd",
    "runc",
    "busybox-static",
    "binutils",
    "python3-grpcio",
    "python3-venv",
];

/// A virtualenv with PyPI's grpcio [`GRPCIO_VERSION`]: newer grpc-core sends the
/// socket path as `:authority` over a Unix socket (Debian's 1.51 sends
/// `localhost`), which the daemons must accept. cli/tests/node.rs uses it.
pub const GRPCIO_VENV: &str = "/opt/rivet-test/grpcio-venv";

/// The PyPI grpcio installed in [`GRPCIO_VENV`].
pub const GRPCIO_VERSION: &str = "1.85.3";

/// Its server-reflection client (grpcio-reflection has no 1.85.3).
pub const GRPCIO_REFLECTION_VERSION: &str = "1.85.1";

/// Where BPF programs and maps are pinned; the loader and the tests expect a bpffs here.
const BPFFS: &str = "/sys/fs/bpf";

/// The group whose members may make read-only calls on the daemon sockets.
pub const READER_GROUP: &str = "rivet-readers";

/// The system users the node daemons run as (`rivet node up --daemon-user`,
/// `--datapath-user`), as (name, primary group, what runs as it). Both are
/// members of [`READER_GROUP`] (the sockets' group), and the datapath user's
/// primary group is the daemon user's (the socket dir's group).
pub const USERS: [(&str, &str, &str); 2] = [
    (
        "rivet",
        "rivet",
        "Rivet node daemons (svc-ipam, svc-identity, svc-endpoint)",
    ),
    ("rivet-datapath", "rivet", "Rivet datapath daemons (svc-loader, svc-gc)"),
];

/// Installs the missing Debian packages, mounts bpffs, creates the daemons'
/// users and groups and builds the Go test tools (Kubernetes, etcd, Jaeger) if
/// needed.
pub fn run() -> Result<()> {
    require_root()?;
    install_packages()?;
    install_pypi_grpcio()?;
    mount_bpffs()?;
    create_users()?;
    if has_nightly() {
        cargo_fuzz()?;
    } else {
        println!("cargo-fuzz: skipped: no nightly toolchain (only `cargo xtask fuzz` needs them)");
    }
    go_tools::install()
}

/// Whether rustup has a nightly toolchain. Machines of this kind come with
/// one; it cannot be downloaded here, so without it the fuzz targets are
/// skipped, not the rest of the install.
pub fn has_nightly() -> bool {
    Command::new("rustup")
        .args(["run", "nightly", "rustc", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The cargo-fuzz release `cargo xtask fuzz` drives.
pub const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// Installs cargo-fuzz [`CARGO_FUZZ_VERSION`] from crates.io (`cargo install
/// --locked`, about 2 min of CPU) unless `cargo fuzz --version` reports it,
/// and checks that the nightly toolchain it builds with is there (the fuzz
/// targets need `-Zsanitizer`).
pub fn cargo_fuzz() -> Result<()> {
    if !has_nightly() {
        bail!(
            "the nightly toolchain is missing: cargo fuzz builds with it (`rustup toolchain install nightly \
             --profile minimal`)"
        );
    }
    let version = Command::new("cargo")
        .args(["fuzz", "--version"])
        .env_remove("CARGO")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    if version.as_deref() == Some(&format!("cargo-fuzz {CARGO_FUZZ_VERSION}")) {
        println!("cargo-fuzz: {CARGO_FUZZ_VERSION} present");
        return Ok(());
    }
    println!("cargo-fuzz: installing {CARGO_FUZZ_VERSION} from crates.io");
    cmd::run_keeping_stderr(Command::new("cargo").env_remove("CARGO").args([
        "install",
        "--locked",
        "cargo-fuzz",
        "--version",
        CARGO_FUZZ_VERSION,
    ]))
}

/// Creates [`GRPCIO_VENV`] with grpcio [`GRPCIO_VERSION`] and
/// grpcio-reflection [`GRPCIO_REFLECTION_VERSION`] from PyPI, unless it has
/// them already.
fn install_pypi_grpcio() -> Result<()> {
    let python = format!("{GRPCIO_VENV}/bin/python");
    let installed = Command::new(&python)
        .args([
            "-c",
            "import grpc, grpc_reflection, sys; sys.exit(grpc.__version__ != sys.argv[1])",
            GRPCIO_VERSION,
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if installed {
        println!("grpcio: {GRPCIO_VERSION} and grpcio-reflection present in {GRPCIO_VENV}");
        return Ok(());
    }
    println!("grpcio: installing {GRPCIO_VERSION} from PyPI into {GRPCIO_VENV}");
    // Debian's interpreter (a pyenv or other python3 on PATH may lack venv).
    cmd::run_keeping_stderr(Command::new("/usr/bin/python3").args(["-m", "venv", "--clear", GRPCIO_VENV]))?;
    cmd::run_keeping_stderr(Command::new(format!("{GRPCIO_VENV}/bin/pip")).args([
        "install",
        "--quiet",
        "--disable-pip-version-check",
        &format!("grpcio=={GRPCIO_VERSION}"),
        &format!("grpcio-reflection=={GRPCIO_REFLECTION_VERSION}"),
    ]))
}

/// Everything after this needs root: apt-get and mount here, and later the privileged
/// tests, which load BPF programs and create network namespaces (CAP_BPF,
/// CAP_SYS_ADMIN, CAP_NET_ADMIN). Failing here is clearer than failing deep in a test.
fn require_root() -> Result<()> {
    let status = fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let euid = effective_uid(&status).context("no Uid line in /proc/self/status")?;
    if euid != 0 {
        bail!(
            "cargo xtask must run as root (effective uid is {euid}): it installs Debian \
             packages and mounts bpffs at {BPFFS}, and the privileged tests load BPF programs \
             and create network namespaces, which need CAP_BPF, CAP_SYS_ADMIN and \
             CAP_NET_ADMIN. Re-run it as root."
        );
    }
    Ok(())
}

/// The effective uid from the text of `/proc/<pid>/status` (its `Uid:` line lists the
/// real, effective, saved and filesystem uids). Read from procfs to stay within std.
fn effective_uid(proc_status: &str) -> Option<u32> {
    proc_status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Installs the packages of [`PACKAGES`] that are not installed; touches apt only if
/// at least one is missing, so a prepared machine needs no network and no apt lock.
fn install_packages() -> Result<()> {
    let mut missing = Vec::new();
    for &package in PACKAGES {
        if !is_installed(package)? {
            missing.push(package);
        }
    }
    if missing.is_empty() {
        println!("deps: all present");
        return Ok(());
    }
    println!("deps: installing {}", missing.join(" "));
    cmd::run_keeping_stderr(apt_get().args(["-q", "update"]))?;
    cmd::run_keeping_stderr(
        apt_get()
            .args(["-q", "install", "-y", "--no-install-recommends"])
            .args(&missing),
    )
}

/// `apt-get` that never stops to ask a question (CI has no stdin).
fn apt_get() -> Command {
    let mut apt = Command::new("apt-get");
    apt.env("DEBIAN_FRONTEND", "noninteractive");
    apt
}

/// Whether dpkg reports `package` as fully installed. An unknown package makes
/// dpkg-query exit non-zero, which here simply means "not installed"; a package that
/// was removed but left its config files ("deinstall ok config-files") is not installed.
fn is_installed(package: &str) -> Result<bool> {
    let mut query = Command::new("dpkg-query");
    query.args(["-W", "-f=${Status}", package]);
    let output = query
        .output()
        .with_context(|| format!("could not run `{}`", cmd::display(&query)))?;
    Ok(output.status.success() && String::from_utf8_lossy(&output.stdout) == "install ok installed")
}

/// Mounts bpffs at [`BPFFS`] unless a bpf filesystem is already mounted there.
fn mount_bpffs() -> Result<()> {
    let mounts = fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    if is_bpffs_mounted(&mounts) {
        println!("bpffs: already mounted at {BPFFS}");
        return Ok(());
    }
    println!("bpffs: mounting at {BPFFS}");
    fs::create_dir_all(BPFFS).with_context(|| format!("creating {BPFFS}"))?;
    cmd::run_keeping_stderr(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))
}

/// Creates [`READER_GROUP`] and the [`USERS`] (system accounts: no home, no
/// login shell) that do not exist, and adds missing group memberships.
fn create_users() -> Result<()> {
    let mut changed = Vec::new();
    if !exists("group", READER_GROUP)? {
        cmd::run_keeping_stderr(Command::new("groupadd").args(["--system", READER_GROUP]))?;
        changed.push(format!("group {READER_GROUP}"));
    }
    for (user, primary, comment) in USERS {
        if !exists("passwd", user)? {
            let mut useradd = Command::new("useradd");
            useradd.args(["--system", "--no-create-home", "--home-dir", "/nonexistent"]);
            useradd.args(["--shell", "/usr/sbin/nologin", "--comment", comment]);
            if user == primary {
                useradd.arg("--user-group");
            } else {
                useradd.args(["--gid", primary]);
            }
            cmd::run_keeping_stderr(useradd.args(["--groups", READER_GROUP, user]))?;
            changed.push(format!("user {user}"));
        } else if !groups_of(user)?.iter().any(|g| g == READER_GROUP) {
            cmd::run_keeping_stderr(Command::new("usermod").args(["--append", "--groups", READER_GROUP, user]))?;
            changed.push(format!("{user} in {READER_GROUP}"));
        }
    }
    if changed.is_empty() {
        println!("users: all present");
    } else {
        println!("users: created {}", changed.join(", "));
    }
    Ok(())
}

/// Whether `name` is in the `database` (`passwd` or `group`) of getent.
fn exists(database: &str, name: &str) -> Result<bool> {
    let mut getent = Command::new("getent");
    getent.args([database, name]);
    let status = getent
        .stdout(std::process::Stdio::null())
        .status()
        .with_context(|| format!("could not run `{}`", cmd::display(&getent)))?;
    Ok(status.success())
}

/// The names of the groups `user` is in (`id -nG`).
fn groups_of(user: &str) -> Result<Vec<String>> {
    let mut id = Command::new("id");
    id.args(["-nG", user]);
    let out = id
        .output()
        .with_context(|| format!("could not run `{}`", cmd::display(&id)))?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            cmd::display(&id),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect())
}

/// Whether the text of `/proc/mounts` has a filesystem of type `bpf` at [`BPFFS`]
/// (fields: device, mount point, type, options, dump, pass).
fn is_bpffs_mounted(proc_mounts: &str) -> bool {
    proc_mounts.lines().any(|line| {
        let mut fields = line.split_whitespace();
        fields.nth(1) == Some(BPFFS) && fields.next() == Some("bpf")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_effective_not_real_uid() {
        let status = "Name:\tcargo\nUid:\t1000\t0\t0\t0\nGid:\t0\t0\t0\t0\n";
        assert_eq!(effective_uid(status), Some(0));
        assert_eq!(effective_uid("Name:\tx\n"), None);
    }

    #[test]
    fn bpffs_needs_type_bpf_at_the_mount_point() {
        let mounted = "sysfs /sys sysfs rw 0 0\nbpf /sys/fs/bpf bpf rw,nosuid,mode=700 0 0\n";
        assert!(is_bpffs_mounted(mounted));
        assert!(!is_bpffs_mounted("sysfs /sys sysfs rw 0 0\n"));
        assert!(!is_bpffs_mounted("tmpfs /sys/fs/bpf tmpfs rw 0 0\n"));
        assert!(!is_bpffs_mounted("bpf /run/bpf bpf rw 0 0\n"));
    }
}
