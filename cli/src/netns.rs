//! Network namespaces and child commands for `rivet node` and `rivet pod`:
//! named namespaces (`ip netns add`, so they show in `ip netns list` and live
//! at `/run/netns/<name>`), commands run inside one with
//! `nsenter --net=<path>` (which, unlike `ip netns exec`, keeps the mount
//! namespace and so the bpffs at /sys/fs/bpf), and errors that name the
//! command and quote its stderr.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, Result, bail};

/// Where `ip netns add` puts the namespace files.
pub const NETNS_DIR: &str = "/run/netns";

/// Longest namespace name accepted here (a file name; kept short for messages).
pub const NAME_MAX: usize = 64;

/// `/run/netns/<name>`.
pub fn path(name: &str) -> PathBuf {
    Path::new(NETNS_DIR).join(name)
}

/// Whether the named namespace exists.
pub fn exists(name: &str) -> bool {
    path(name).exists()
}

/// Checks a namespace name: 1 to 64 characters of `[A-Za-z0-9_.-]`, not `.` or `..`.
///
/// ```
/// assert!(rivet_cli::netns::check_name("rivet-pod-default-web").is_ok());
/// assert!(rivet_cli::netns::check_name("a/b").is_err());
/// ```
pub fn check_name(name: &str) -> Result<()> {
    let valid = !name.is_empty()
        && name.len() <= NAME_MAX
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !valid {
        bail!("`{name}` is not a usable network namespace name (1 to {NAME_MAX} characters of A-Z a-z 0-9 - _ .)");
    }
    Ok(())
}

/// `ip netns add <name>` and `lo` up. Fails if it exists already: a
/// namespace this did not create is never taken over.
pub fn create(name: &str) -> Result<()> {
    check_name(name)?;
    if exists(name) {
        bail!("network namespace `{name}` exists already; choose another name or remove it (`ip netns del {name}`)");
    }
    run(Command::new("ip").args(["netns", "add", name]))?;
    if let Err(e) = run(Command::new("ip").args(["-n", name, "link", "set", "lo", "up"])) {
        let _ = delete(name);
        return Err(e);
    }
    Ok(())
}

/// `ip netns del <name>`; nothing to do when it does not exist.
pub fn delete(name: &str) -> Result<()> {
    if !exists(name) {
        return Ok(());
    }
    run(Command::new("ip").args(["netns", "del", name]))?;
    Ok(())
}

/// `ip -n <name> <args>`.
pub fn ip(name: &str, args: &[&str]) -> Result<String> {
    run(Command::new("ip").args(["-n", name]).args(args))
}

/// `program` run inside the namespace at `netns` (`nsenter --net=<netns> --
/// <program>`), or directly when `netns` is `None`. Add arguments as usual;
/// the environment passes through nsenter.
pub fn command(netns: Option<&Path>, program: impl AsRef<OsStr>) -> Command {
    match netns {
        Some(ns) => {
            let mut cmd = Command::new("nsenter");
            let mut net = std::ffi::OsString::from("--net=");
            net.push(ns);
            cmd.arg(net).arg("--").arg(program);
            cmd
        }
        None => Command::new(program),
    }
}

/// Sets `net.*` sysctls inside the namespace at `netns` only.
pub fn sysctls(netns: &Path, settings: &[(&str, &str)]) -> Result<()> {
    if let Some((key, _)) = settings.iter().find(|(key, _)| !key.starts_with("net.")) {
        bail!("sysctl {key} is not per network namespace; refusing to set it");
    }
    let pairs: Vec<String> = settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
    run(command(Some(netns), "sysctl").arg("-qw").args(&pairs))?;
    Ok(())
}

/// Runs `cmd` with stdin closed; its stdout, or an error naming the command
/// with its stderr.
pub fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("could not run `{}`", describe(cmd)))?;
    if !out.status.success() {
        bail!(
            "`{}` failed ({}): {}",
            describe(cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A command as a shell-like line, for messages.
pub fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for good in ["a", "rivet-pod-default-web", "n_1.x"] {
            check_name(good).unwrap();
        }
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn command_enters_the_namespace_with_nsenter() {
        let cmd = command(Some(Path::new("/run/netns/n1")), "svc-loader");
        assert_eq!(describe(&cmd), "nsenter --net=/run/netns/n1 -- svc-loader");
        assert_eq!(describe(&command(None, "svc-loader")), "svc-loader");
    }

    #[test]
    fn only_net_sysctls() {
        let err = sysctls(Path::new("/run/netns/none"), &[("kernel.pid_max", "1")]).unwrap_err();
        assert!(err.to_string().contains("not per network namespace"), "{err}");
    }

    #[test]
    fn failures_name_the_command_and_stderr() {
        let err = run(Command::new("sh").args(["-c", "echo nope >&2; exit 3"])).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("`sh -c echo nope >&2; exit 3`"), "{text}");
        assert!(text.ends_with("nope"), "{text}");
    }
}
