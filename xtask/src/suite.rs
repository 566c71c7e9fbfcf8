//! The suite's test binaries run side by side.
//!
//! `cargo test` runs one test binary at a time. Most of Rivet's time in tests
//! is spent in binaries that wait: on a kubelet starting pods, on an etcd
//! held stopped for a minute, on a flood of pings between namespaces. Run one
//! after another they took about 25 minutes; a few at once share the cores
//! those waits leave idle. Every test owns what it creates (its namespaces,
//! pins, processes and etcd, see DESIGN.md §8), so binaries can overlap as
//! the tests inside one binary already do.
//!
//! [`run`] builds the binaries with `cargo test --no-run`, then runs
//! [`Options::jobs`] of them at a time, longest first by the durations kept
//! from the last run ([`TIMES_FILE`] in the target dir) or, for binaries it
//! did not run (a fresh clone), by a reference run's ([`REFERENCE_TIMES`]). Each binary's output
//! is printed whole when it ends, under the same `Running ...` header cargo
//! prints, so `test result:` lines keep their meaning in a CI log. A failed
//! binary does not stop the others; the summary names every failure.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::cmd;

/// Durations of the last run, one `<key>\t<seconds>` line per binary, in the
/// target dir.
pub const TIMES_FILE: &str = "rivet-test-times.tsv";

/// Durations of a reference run, the order of a first run: a long binary
/// started last would hold the whole step (`xtask/test-durations.tsv`).
const REFERENCE_TIMES: &str = include_str!("../test-durations.tsv");

/// How often the names of the binaries still running are printed, so a CI
/// log shows progress while whole outputs wait for their binary's end.
const PROGRESS_EVERY: Duration = Duration::from_secs(60);

/// How the suite runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Binaries running at once.
    pub jobs: usize,
}

impl Options {
    /// `RIVET_TEST_JOBS` if set, else one more than the cores: the heavy
    /// binaries wait more than they compute.
    pub fn from_env() -> Result<Self> {
        let jobs = match std::env::var("RIVET_TEST_JOBS") {
            Ok(value) => value
                .parse::<usize>()
                .ok()
                .filter(|&jobs| jobs > 0)
                .with_context(|| format!("RIVET_TEST_JOBS={value:?} is not a positive number"))?,
            Err(_) => thread::available_parallelism().map_or(2, |n| n.get()) + 1,
        };
        Ok(Self { jobs })
    }
}

/// One test binary cargo built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestBinary {
    /// The package it tests.
    pub package: String,
    /// The package's directory: cargo runs a test binary there.
    pub package_dir: PathBuf,
    /// What cargo's header shows: `unittests src/lib.rs`, `tests/node.rs`.
    pub source: String,
    /// The executable.
    pub executable: PathBuf,
}

impl TestBinary {
    /// A name stable across builds (the executable's hash is not), for the
    /// durations file.
    pub fn key(&self) -> String {
        format!("{} {}", self.package, self.source)
    }

    /// Reads one line of `cargo --message-format=json`: a test binary if it
    /// is the artifact of a test target, `None` for every other message.
    pub fn from_cargo_message(line: &str) -> Option<Self> {
        let message: Value = serde_json::from_str(line).ok()?;
        if message["reason"] != "compiler-artifact" || message["profile"]["test"] != true {
            return None;
        }
        let executable = PathBuf::from(message["executable"].as_str()?);
        let manifest = Path::new(message["manifest_path"].as_str()?);
        let package_dir = manifest.parent()?.to_path_buf();
        let src_path = Path::new(message["target"]["src_path"].as_str()?);
        let relative = src_path.strip_prefix(&package_dir).unwrap_or(src_path).display();
        let kind = message["target"]["kind"][0].as_str()?;
        let source = match kind {
            "test" | "bench" | "example" => relative.to_string(),
            _ => format!("unittests {relative}"),
        };
        let package = package_name(message["package_id"].as_str()?)?;
        Some(Self {
            package,
            package_dir,
            source,
            executable,
        })
    }

    /// Whether it is an integration test (the long ones), not unit tests.
    fn is_integration(&self) -> bool {
        !self.source.starts_with("unittests ")
    }
}

/// A package's name from its id: `path+file:///w/svc-ipam#rivet-svc-ipam@0.1.0`,
/// or `path+file:///w/xtask#0.1.0` when the name is the directory's.
fn package_name(id: &str) -> Option<String> {
    let (url, fragment) = id.rsplit_once('#')?;
    match fragment.split_once('@') {
        Some((name, _version)) => Some(name.to_string()),
        None => url
            .rsplit('/')
            .next()
            .filter(|name| !name.is_empty())
            .map(str::to_string),
    }
}

/// Builds the workspace's test binaries (`cargo_build_args` go to `cargo test
/// --no-run`) and lists them.
pub fn build(cargo_build_args: &[String]) -> Result<Vec<TestBinary>> {
    let mut cargo = cmd::cargo();
    cargo
        .args(["test", "--workspace", "--all-targets", "--no-run"])
        .args(["--message-format", "json-render-diagnostics"])
        .args(cargo_build_args);
    let output = cmd::output_streaming_stderr(&mut cargo)?;
    let mut binaries: Vec<TestBinary> = output.lines().filter_map(TestBinary::from_cargo_message).collect();
    binaries.sort_by(|a, b| a.executable.cmp(&b.executable));
    binaries.dedup_by(|a, b| a.executable == b.executable);
    Ok(binaries)
}

/// Orders `binaries` longest first by `last` (seconds per [`TestBinary::key`]);
/// binaries without a time go before those with one if they are integration
/// tests (a new test is more likely long than short), after them otherwise.
pub fn schedule(mut binaries: Vec<TestBinary>, last: &HashMap<String, f64>) -> Vec<TestBinary> {
    let rank = |binary: &TestBinary| -> (u8, i64) {
        match last.get(&binary.key()) {
            Some(seconds) => (1, -(seconds * 1000.0) as i64),
            None if binary.is_integration() => (0, 0),
            None => (2, 0),
        }
    };
    binaries.sort_by_key(|binary| (rank(binary), binary.key()));
    binaries
}

/// Parses the durations file; lines it cannot read are ignored (it is a hint).
pub fn parse_times(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter_map(|line| {
            let (key, seconds) = line.split_once('\t')?;
            Some((key.to_string(), seconds.trim().parse().ok()?))
        })
        .collect()
}

/// Renders the durations file, longest first.
pub fn render_times(times: &HashMap<String, f64>) -> String {
    let mut lines: Vec<(&String, &f64)> = times.iter().collect();
    lines.sort_by(|a, b| b.1.total_cmp(a.1).then(a.0.cmp(b.0)));
    lines
        .iter()
        .map(|(key, seconds)| format!("{key}\t{seconds:.1}\n"))
        .collect()
}

/// What one binary did.
struct Finished {
    binary: TestBinary,
    elapsed: Duration,
    success: bool,
    output: Vec<u8>,
}

/// Runs the test binaries [`build`] built, `options.jobs` at a time;
/// `test_args` go to every binary (a filter, `--nocapture`). Fails naming
/// each binary that failed.
pub fn run(options: &Options, binaries: Vec<TestBinary>, test_args: &[String]) -> Result<()> {
    let times_path = cmd::target_dir().join(TIMES_FILE);
    let mut times = parse_times(&std::fs::read_to_string(&times_path).unwrap_or_default());
    let mut hints = parse_times(REFERENCE_TIMES);
    hints.extend(times.clone());
    let queue = schedule(binaries, &hints);
    let total = queue.len();
    println!(
        "running {total} test binaries, {} at a time (RIVET_TEST_JOBS), longest first",
        options.jobs
    );

    let started = Instant::now();
    let (done_tx, done_rx) = mpsc::channel::<Finished>();
    let mut queue = queue.into_iter();
    let mut running: HashMap<PathBuf, (String, Instant)> = HashMap::new();
    let mut workers = Vec::new();
    let mut failed = Vec::new();
    let mut finished = 0;
    let mut last_progress = Instant::now();

    loop {
        while running.len() < options.jobs {
            let Some(binary) = queue.next() else { break };
            running.insert(binary.executable.clone(), (binary.key(), Instant::now()));
            let done = done_tx.clone();
            let args = test_args.to_vec();
            workers.push(thread::spawn(move || {
                let result = run_one(binary, &args);
                // The receiver outlives every worker: it is joined below.
                let _ = done.send(result);
            }));
        }
        if running.is_empty() {
            break;
        }
        match done_rx.recv_timeout(PROGRESS_EVERY.saturating_sub(last_progress.elapsed())) {
            Ok(end) => {
                running.remove(&end.binary.executable);
                finished += 1;
                report(&end, finished, total)?;
                times.insert(end.binary.key(), end.elapsed.as_secs_f64());
                if !end.success {
                    failed.push(end.binary.key());
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let mut names: Vec<String> = running
                    .values()
                    .map(|(key, since)| format!("{key} ({} s)", since.elapsed().as_secs()))
                    .collect();
                names.sort();
                println!("     still running: {}", names.join(", "));
                last_progress = Instant::now();
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("a test runner thread ended without a result"),
        }
    }
    for worker in workers {
        worker
            .join()
            .map_err(|_| anyhow::anyhow!("a test runner thread panicked"))?;
    }
    // A failed write loses only the schedule hint of the next run.
    if let Err(error) = std::fs::write(&times_path, render_times(&times)) {
        eprintln!(
            "warning: could not keep test durations in {}: {error}",
            times_path.display()
        );
    }
    println!(
        "ran {total} test binaries in {:.1} s, {} failed",
        started.elapsed().as_secs_f64(),
        failed.len()
    );
    if !failed.is_empty() {
        bail!("test binaries failed: {}", failed.join(", "));
    }
    Ok(())
}

/// Runs one binary as cargo would (in its package's dir, with cargo's
/// package variables), its stdout and stderr into one kept buffer.
fn run_one(binary: TestBinary, args: &[String]) -> Finished {
    let started = Instant::now();
    let mut command = Command::new(&binary.executable);
    command
        .args(args)
        .current_dir(&binary.package_dir)
        .env("CARGO_MANIFEST_DIR", &binary.package_dir)
        .env("CARGO_PKG_NAME", &binary.package);
    let (success, output) = match capture_merged(command) {
        Ok(result) => result,
        Err(error) => (
            false,
            format!("could not run {}: {error:#}\n", binary.executable.display()).into_bytes(),
        ),
    };
    Finished {
        binary,
        elapsed: started.elapsed(),
        success,
        output,
    }
}

/// Runs `command` with stdout and stderr on one pipe, so the kept output has
/// them in the order they were written.
fn capture_merged(mut command: Command) -> Result<(bool, Vec<u8>)> {
    let (mut reader, writer) = io::pipe().context("creating a pipe for a test binary's output")?;
    let mut child = command
        .stdin(std::process::Stdio::null())
        .stdout(writer.try_clone().context("duplicating the output pipe")?)
        .stderr(writer)
        .spawn()
        .with_context(|| format!("starting {}", cmd::display(&command)))?;
    // `command` holds our copies of the write end: drop them so the read ends
    // when the child (and whatever it left holding the pipe) exits.
    drop(command);
    let mut output = Vec::new();
    reader
        .read_to_end(&mut output)
        .context("reading a test binary's output")?;
    let status = child.wait().context("waiting for a test binary")?;
    Ok((status.success(), output))
}

/// Prints one binary's whole output under cargo's header.
fn report(end: &Finished, finished: usize, total: usize) -> Result<()> {
    let mut stdout = io::stdout().lock();
    let root = cmd::workspace_root();
    let executable = end
        .binary
        .executable
        .strip_prefix(root)
        .unwrap_or(&end.binary.executable);
    writeln!(
        stdout,
        "     Running {} ({}) [{}] {:.1} s, {finished}/{total}{}",
        end.binary.source,
        executable.display(),
        end.binary.package,
        end.elapsed.as_secs_f64(),
        if end.success { "" } else { " FAILED" },
    )?;
    stdout.write_all(&end.output)?;
    stdout.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifact(kind: &str, src: &str, test: bool) -> String {
        serde_json::json!({
            "reason": "compiler-artifact",
            "package_id": "path+file:///work/main/svc-ipam#rivet-svc-ipam@0.1.0",
            "manifest_path": "/work/main/svc-ipam/Cargo.toml",
            "target": {"kind": [kind], "name": "x", "src_path": format!("/work/main/svc-ipam/{src}")},
            "profile": {"test": test},
            "executable": "/work/main/target/debug/deps/x-0123456789abcdef",
        })
        .to_string()
    }

    #[test]
    fn test_artifacts_are_binaries_and_everything_else_is_not() {
        let binary = TestBinary::from_cargo_message(&artifact("test", "tests/pool.rs", true))
            .expect("a test target's artifact is a test binary");
        assert_eq!(binary.package, "rivet-svc-ipam");
        assert_eq!(binary.package_dir, Path::new("/work/main/svc-ipam"));
        assert_eq!(binary.source, "tests/pool.rs");
        assert_eq!(binary.key(), "rivet-svc-ipam tests/pool.rs");
        let unit = TestBinary::from_cargo_message(&artifact("lib", "src/lib.rs", true)).expect("unit tests");
        assert_eq!(unit.source, "unittests src/lib.rs");
        assert_eq!(
            TestBinary::from_cargo_message(&artifact("bin", "src/main.rs", false)),
            None
        );
        assert_eq!(
            TestBinary::from_cargo_message(r#"{"reason":"build-finished","success":true}"#),
            None
        );
        assert_eq!(TestBinary::from_cargo_message("Compiling x"), None);
    }

    #[test]
    fn the_reference_durations_parse_and_name_the_longest_binaries() {
        let reference = parse_times(REFERENCE_TIMES);
        assert!(
            reference
                .get("rivet-e2e tests/kube_deploy.rs")
                .is_some_and(|&s| s > 60.0),
            "the reference run must hold the long e2e binaries, by package and source"
        );
    }

    #[test]
    fn package_names_come_from_either_form_of_id() {
        assert_eq!(
            package_name("path+file:///w/svc-ipam#rivet-svc-ipam@0.1.0").as_deref(),
            Some("rivet-svc-ipam")
        );
        assert_eq!(package_name("path+file:///w/xtask#0.1.0").as_deref(), Some("xtask"));
        assert_eq!(package_name("no fragment"), None);
    }

    #[test]
    fn longest_first_with_new_integration_tests_before_known_ones() {
        let binary = |source: &str| TestBinary {
            package: "p".into(),
            package_dir: "/p".into(),
            source: source.into(),
            executable: format!("/t/{source}").into(),
        };
        let last = parse_times(&render_times(&HashMap::from([
            ("p tests/short.rs".to_string(), 2.0),
            ("p tests/long.rs".to_string(), 140.5),
            ("p unittests src/lib.rs".to_string(), 30.0),
        ])));
        let order: Vec<String> = schedule(
            vec![
                binary("unittests src/new.rs"),
                binary("tests/short.rs"),
                binary("unittests src/lib.rs"),
                binary("tests/new.rs"),
                binary("tests/long.rs"),
            ],
            &last,
        )
        .iter()
        .map(|b| b.source.clone())
        .collect();
        assert_eq!(
            order,
            [
                "tests/new.rs",
                "tests/long.rs",
                "unittests src/lib.rs",
                "tests/short.rs",
                "unittests src/new.rs"
            ]
        );
    }

    #[test]
    fn a_binary_s_output_keeps_stdout_and_stderr_in_order() {
        let mut command = Command::new("sh");
        command.args(["-c", "echo one; echo two >&2; echo three; exit 4"]);
        let (success, output) = capture_merged(command).expect("sh runs");
        assert!(!success, "exit 4 is a failure");
        assert_eq!(String::from_utf8_lossy(&output), "one\ntwo\nthree\n");
    }
}
