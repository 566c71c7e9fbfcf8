//! Running external commands with a visible trace and errors that say what failed.
//!
//! Every command xtask runs on the user's behalf is echoed as `$ <cmd>` first, so a log
//! shows exactly what to re-run by hand, and a failure names that command (and, where
//! we capture it, its stderr) instead of a bare "exit status 1".

use std::ffi::{OsStr, OsString};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::thread;

use anyhow::{Context, Result, bail};

/// How many trailing stderr lines an error message quotes; apt-get in particular can
/// be verbose, and the last lines are the ones that say why it failed.
const STDERR_TAIL_LINES: usize = 30;

/// The workspace root: every cargo command runs there, wherever `cargo xtask` was
/// started from.
pub fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
}

/// The cargo target directory, honouring `CARGO_TARGET_DIR` like cargo does (a relative
/// value is taken relative to the workspace root, where we run cargo).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => workspace_root().join(dir),
        None => workspace_root().join("target"),
    }
}

/// A `cargo` command in the workspace root. Uses the cargo that runs us (`$CARGO`) so a
/// pinned toolchain is used for the nested builds too.
pub fn cargo() -> Command {
    let program = std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let mut cmd = Command::new(program);
    cmd.current_dir(workspace_root());
    cmd
}

/// Renders a command as a shell-like line for the `$ ...` echo and for error messages:
/// explicitly set environment variables first, the program by its file name (the full
/// path is in spawn errors), then the arguments, quoted where a shell would need it.
pub fn display(cmd: &Command) -> String {
    let mut words = Vec::new();
    for (key, value) in cmd.get_envs() {
        if let Some(value) = value {
            words.push(format!("{}={}", key.to_string_lossy(), quote(value)));
        }
    }
    let program = Path::new(cmd.get_program());
    words.push(quote(program.file_name().unwrap_or(program.as_os_str())));
    words.extend(cmd.get_args().map(quote));
    words.join(" ")
}

/// Single-quotes a word if it contains anything but characters that are safe unquoted.
fn quote(word: &OsStr) -> String {
    let word = word.to_string_lossy();
    let safe = |c: char| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c);
    if !word.is_empty() && word.chars().all(safe) {
        word.into_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Echoes `$ <cmd>` and flushes, so the line appears before the child's own output.
fn echo(cmd: &Command) {
    println!("$ {}", display(cmd));
    // A failed flush of our own stdout is not worth failing the task over.
    let _ = io::stdout().flush();
}

/// The error for a command that could not be started at all (usually: not installed).
fn spawn_error(cmd: &Command) -> String {
    format!(
        "could not start `{}` (program {})",
        display(cmd),
        Path::new(cmd.get_program()).display()
    )
}

/// Runs a command with the terminal's stdin/stdout/stderr, so its output (colours,
/// progress, cargo test's summary lines) reaches the user unchanged; fails naming the
/// command if it exits non-zero. Its stderr was already shown live.
pub fn run(cmd: &mut Command) -> Result<()> {
    echo(cmd);
    let status = cmd.status().with_context(|| spawn_error(cmd))?;
    check_status(cmd, status, "")
}

/// Runs a command with stdout passed through and stderr both shown live and kept, so a
/// failure's error message carries the command's own explanation (for commands whose
/// failure is about the machine: apt-get, mount).
pub fn run_keeping_stderr(cmd: &mut Command) -> Result<()> {
    echo(cmd);
    let mut child = cmd.stderr(Stdio::piped()).spawn().with_context(|| spawn_error(cmd))?;
    let mut pipe = child.stderr.take().expect("stderr was piped");
    let tee = thread::spawn(move || {
        let mut kept = Vec::new();
        let mut chunk = [0u8; 8192];
        loop {
            match pipe.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let _ = io::stderr().write_all(&chunk[..n]);
                    kept.extend_from_slice(&chunk[..n]);
                }
            }
        }
        kept
    });
    let status = child
        .wait()
        .with_context(|| format!("waiting for `{}`", display(cmd)))?;
    let stderr = tee.join().unwrap_or_default();
    check_status(cmd, status, &String::from_utf8_lossy(&stderr))
}

/// Runs a command with its stderr shown live and returns its stdout (for
/// machine-readable output such as cargo's JSON messages); fails naming the
/// command if it exits non-zero.
pub fn output_streaming_stderr(cmd: &mut Command) -> Result<String> {
    echo(cmd);
    let output = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| spawn_error(cmd))?;
    check_status(cmd, output.status, "")?;
    String::from_utf8(output.stdout).with_context(|| format!("`{}` printed output that is not UTF-8", display(cmd)))
}

/// Turns a non-success exit status into an error naming the command and quoting the
/// tail of its stderr, if any was captured.
fn check_status(cmd: &Command, status: ExitStatus, stderr: &str) -> Result<()> {
    if status.success() {
        return Ok(());
    }
    let tail = tail_lines(stderr, STDERR_TAIL_LINES);
    if tail.is_empty() {
        bail!("`{}` failed ({status})", display(cmd));
    }
    bail!("`{}` failed ({status}); its stderr:\n{tail}", display(cmd));
}

/// The last `n` non-blank lines of `text`.
pub fn tail_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_quotes_only_what_needs_it() {
        let mut cmd = Command::new("/usr/bin/apt-get");
        cmd.env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "it's here", "a b", "${Status}"]);
        assert_eq!(
            display(&cmd),
            r"DEBIAN_FRONTEND=noninteractive apt-get install -y 'it'\''s here' 'a b' '${Status}'"
        );
    }

    #[test]
    fn failure_names_command_and_stderr() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo first >&2; echo boom >&2; exit 3"]);
        let err = run_keeping_stderr(&mut cmd).unwrap_err().to_string();
        assert!(err.contains("`sh -c"), "{err}");
        assert!(err.contains("exit status: 3"), "{err}");
        assert!(err.ends_with("first\nboom"), "{err}");
    }

    #[test]
    fn missing_program_is_named() {
        let err = run(&mut Command::new("/nonexistent/rivet-xtask-test"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/rivet-xtask-test"), "{err}");
    }

    #[test]
    fn tail_keeps_last_non_blank_lines() {
        assert_eq!(tail_lines("a\n\nb\nc\n", 2), "b\nc");
        assert_eq!(tail_lines("", 2), "");
    }
}
