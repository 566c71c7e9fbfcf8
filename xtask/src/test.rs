//! `cargo xtask test`: the whole suite, as CI runs it (`.ci/run` calls only this).
//!
//! Steps run in order and stop at the first failure, cheapest first, so a formatting
//! slip or a daemon linking test code fails in seconds instead of after a full test
//! build. The whole suite starts clippy, the docs and the fuzz build beside its
//! test binaries, at the lowest priority, and waits for them after: the binaries
//! mostly wait (on kubelets, etcd, floods), and those builds take the idle cores
//! instead of ten minutes of their own before the tests. Output of every step goes
//! straight to the terminal: CI reads cargo test's own summary lines from stdout.

use std::io::{self, Read};
use std::process::{Child, Command, Stdio};
use std::thread::{self, JoinHandle};
use std::time::Instant;

use anyhow::{Context, Result};

use crate::{cmd, deps, fuzz, suite};

/// One step of the suite.
enum Step {
    /// A command that must succeed.
    Run(Command),
    /// A check done here.
    Check(fn() -> Result<()>),
    /// Every test binary, several at a time ([`suite`]), with these commands
    /// started beside them ([`Beside`]).
    Suite(Vec<(&'static str, Command)>),
    /// Waits for the command of this name started beside the test binaries.
    Beside(&'static str),
    /// The fuzz targets' smoke run ([`fuzz_step`]), its build started beside
    /// [`Step::Suite`].
    Fuzz,
}

/// The name of the fuzz build started beside the test binaries.
const FUZZ_BUILD: &str = "fuzz build";

/// Seconds each fuzz target runs in the suite: a smoke run proving that
/// every target builds, loads its seeds and holds its invariants a while.
/// The cold build (unoptimised, no sanitizer, without svc-identity and
/// svc-endpoint: about 5.6 min of CPU, 13.7 optimised with
/// AddressSanitizer) runs beside the test binaries ([`Beside`]).
pub const CI_FUZZ_SECONDS: u64 = 5;

/// Runs fmt check, the dependency rules, clippy, the docs, all tests and doc tests
/// and a short fuzz run;
/// `cargo_test_args` are appended to both `cargo test` invocations (a filter, cargo
/// flags, or `-- <test binary args>`).
pub fn run(cargo_test_args: &[String]) -> Result<()> {
    // Dropped on a failure: what still runs beside the tests is killed.
    let mut beside: Vec<Beside> = Vec::new();
    // Only the fuzz build may be missing (no nightly: the fuzz step says so).
    let finish = |beside: &mut Vec<Beside>, name: &str| match beside.iter().position(|b| b.name == name) {
        Some(at) => beside.remove(at).finish(),
        None => Ok(()),
    };
    for (name, step) in steps(cargo_test_args) {
        println!("==> {name}");
        let started = Instant::now();
        match step {
            Step::Run(mut command) => cmd::run(&mut command),
            Step::Check(check) => check(),
            // Built first: cargo's lock on the target dir would keep the
            // test build waiting for clippy.
            Step::Suite(commands) => suite::Options::from_env().and_then(|options| {
                let binaries = suite::build(&[])?;
                for (name, command) in commands {
                    beside.push(Beside::start(name, command)?);
                }
                suite::run(&options, binaries, &[])
            }),
            Step::Beside(name) => finish(&mut beside, name),
            Step::Fuzz => finish(&mut beside, FUZZ_BUILD).and_then(|()| fuzz_step()),
        }
        .with_context(|| format!("step `{name}` failed"))?;
        println!("==> {name} took {:.1} s", started.elapsed().as_secs_f64());
    }
    println!("==> all steps passed");
    Ok(())
}

/// The steps, each with a short name for its header.
fn steps(cargo_test_args: &[String]) -> Vec<(&'static str, Step)> {
    let mut fmt = cmd::cargo();
    fmt.args(["fmt", "--all", "--", "--check"]);

    let mut clippy = cmd::cargo();
    clippy.args(["clippy", "--workspace", "--all-targets"]);
    // `--locked` makes CI fail instead of silently resolving new versions, but needs a
    // lock file to compare against (the first commit of a workspace may lack one).
    if cmd::workspace_root().join("Cargo.lock").exists() {
        clippy.arg("--locked");
    }
    clippy.args(["--", "-D", "warnings"]);

    // Broken intra-doc links (e.g. to items a move made private) and stray HTML
    // in doc comments fail like clippy warnings do.
    let mut docs = cmd::cargo();
    docs.args(["doc", "--workspace", "--no-deps"])
        .env("RUSTDOCFLAGS", "-D warnings");

    // `--all-targets` does not include doc tests, hence the separate `--doc` run.
    let mut doc_tests = cmd::cargo();
    doc_tests.args(["test", "--workspace", "--doc"]).args(cargo_test_args);

    let mut steps = vec![("fmt", Step::Run(fmt)), ("dependencies", Step::Check(deps::run))];
    if cargo_test_args.is_empty() {
        // The whole suite runs its binaries side by side, clippy, the docs
        // and the fuzz build beside them; a run narrowed by arguments (a
        // filter, `-p`, `--nocapture`) is cargo's own, one at a time.
        let mut beside = vec![("clippy", clippy), ("docs", docs)];
        if crate::install::has_nightly() {
            beside.push((FUZZ_BUILD, fuzz::build(true, true)));
        }
        steps.extend([
            ("test", Step::Suite(beside)),
            ("clippy", Step::Beside("clippy")),
            ("docs", Step::Beside("docs")),
        ]);
    } else {
        let mut tests = cmd::cargo();
        tests
            .args(["test", "--workspace", "--all-targets"])
            .args(cargo_test_args);
        steps.extend([
            ("clippy", Step::Run(clippy)),
            ("docs", Step::Run(docs)),
            ("test", Step::Run(tests)),
        ]);
    }
    steps.extend([("doc tests", Step::Run(doc_tests)), ("fuzz", Step::Fuzz)]);
    steps
}

/// A command run beside the test binaries at the lowest priority, in a
/// session of its own so that its autogroup is niced too (a nice value
/// alone competes only within its session's group): it takes the cores the
/// tests leave idle while they wait on kubelets, etcd and floods, and yields
/// them when the tests compute. Its output is printed when it is waited for.
struct Beside {
    name: &'static str,
    command: String,
    /// `None` once waited for.
    child: Option<Child>,
    output: Option<JoinHandle<Vec<u8>>>,
}

impl Beside {
    /// Starts `command`, its stdout and stderr into one pipe.
    fn start(name: &'static str, mut command: Command) -> Result<Self> {
        let display = cmd::display(&command);
        at_idle_priority(&mut command);
        let starting = || format!("starting `{display}` beside the tests");
        let (mut reader, writer) = io::pipe().with_context(starting)?;
        let child = command
            .stdin(Stdio::null())
            .stdout(writer.try_clone().with_context(starting)?)
            .stderr(writer)
            .spawn()
            .with_context(starting)?;
        drop(command);
        println!("$ {display} (beside the tests, lowest priority)");
        let output = thread::spawn(move || {
            let mut output = Vec::new();
            let _ = reader.read_to_end(&mut output);
            output
        });
        Ok(Self {
            name,
            command: display,
            child: Some(child),
            output: Some(output),
        })
    }

    /// Waits for the command, prints its output and fails if it failed.
    fn finish(mut self) -> Result<()> {
        let mut child = self.child.take().expect("a command is waited for once");
        let status = child
            .wait()
            .with_context(|| format!("waiting for `{}`", self.command))?;
        let output = self
            .output
            .take()
            .and_then(|output| output.join().ok())
            .unwrap_or_default();
        println!("$ {} (ran beside the tests)", self.command);
        print!("{}", String::from_utf8_lossy(&output));
        if !status.success() {
            anyhow::bail!("`{}` failed ({status})", self.command);
        }
        Ok(())
    }
}

/// Makes `command` run in a session of its own at niceness 19, the session's
/// autogroup niced too: the lowest priority against every other session.
fn at_idle_priority(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls (setsid, open, write, close, nice)
    // run between fork and exec.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() == -1 {
                return Err(io::Error::last_os_error());
            }
            // Kernels without autogroups have no such file: nice alone then.
            let autogroup = libc::open(c"/proc/self/autogroup".as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if autogroup >= 0 {
                libc::write(autogroup, b"19".as_ptr().cast(), 2);
                libc::close(autogroup);
            }
            libc::nice(19);
            Ok(())
        });
    }
}

impl Drop for Beside {
    /// A step failed before this one was waited for: the command and its
    /// children (its own process group) stop with the suite instead of
    /// outliving it.
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Ok(pid) = i32::try_from(child.id()) {
                // SAFETY: a plain syscall on the build's own process group.
                unsafe { libc::kill(-pid, libc::SIGKILL) };
            }
            let _ = child.wait();
        }
    }
}

/// Every fuzz target for [`CI_FUZZ_SECONDS`] (see there for the build);
/// `cargo xtask fuzz` runs them all, optimised and longer. Fails, naming
/// it, on a machine without the nightly toolchain cargo fuzz needs (a
/// missing capability is a failure, not a skip).
fn fuzz_step() -> Result<()> {
    if !crate::install::has_nightly() {
        anyhow::bail!(
            "fuzz: the nightly toolchain is missing (cargo fuzz builds with it): `rustup toolchain install nightly`"
        );
    }
    fuzz::run(&fuzz::Args {
        seconds: CI_FUZZ_SECONDS,
        no_k8s_daemons: true,
        dev: true,
        target: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_args_go_to_both_test_runs_only() {
        let extra = ["ipam".to_string(), "--".to_string(), "--nocapture".to_string()];
        let steps = steps(&extra);
        let names: Vec<&str> = steps.iter().map(|(name, _)| *name).collect();
        assert_eq!(
            names,
            ["fmt", "dependencies", "clippy", "docs", "test", "doc tests", "fuzz"]
        );
        let rendered: Vec<(&str, String)> = steps
            .iter()
            .filter_map(|(name, step)| match step {
                Step::Run(command) => Some((*name, cmd::display(command))),
                Step::Check(_) | Step::Suite(_) | Step::Beside(_) | Step::Fuzz => None,
            })
            .collect();
        assert!(rendered[0].1.ends_with("fmt --all -- --check"));
        assert!(rendered[1].1.ends_with("-- -D warnings"));
        assert!(rendered[2].1.ends_with("doc --workspace --no-deps"));
        assert!(
            rendered[3]
                .1
                .ends_with("test --workspace --all-targets ipam -- --nocapture")
        );
        assert!(rendered[4].1.ends_with("test --workspace --doc ipam -- --nocapture"));
    }

    #[test]
    fn a_background_build_runs_at_the_lowest_priority_in_a_session_of_its_own() {
        let mut probe = Command::new("sh");
        probe.args(["-c", "nice; cut -d' ' -f6 /proc/self/stat; cat /proc/self/autogroup"]);
        at_idle_priority(&mut probe);
        let output = probe.output().expect("sh runs");
        let text = String::from_utf8_lossy(&output.stdout);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "19", "the build must run at niceness 19: {text}");
        // SAFETY: getsid(0) only reads this process's session id.
        let ours = unsafe { libc::getsid(0) }.to_string();
        assert_ne!(lines[1], ours, "the build must not share the suite's session: {text}");
        if let Some(autogroup) = lines.get(2) {
            assert!(autogroup.ends_with("nice 19"), "its autogroup must be niced: {text}");
        }
    }

    #[test]
    fn the_whole_suite_runs_its_binaries_side_by_side_with_clippy_docs_and_fuzz_build_beside() {
        let steps = steps(&[]);
        let names: Vec<&str> = steps.iter().map(|(name, _)| *name).collect();
        assert_eq!(
            names,
            ["fmt", "dependencies", "test", "clippy", "docs", "doc tests", "fuzz"],
            "clippy and the docs are waited for after the test binaries"
        );
        let Some((_, Step::Suite(beside))) = steps.iter().find(|(name, _)| *name == "test") else {
            panic!("without arguments the test step must be the parallel suite");
        };
        let beside: Vec<(&str, String)> = beside.iter().map(|(name, c)| (*name, cmd::display(c))).collect();
        assert_eq!(beside[0].0, "clippy");
        assert!(beside[0].1.ends_with("-- -D warnings"), "{beside:?}");
        assert_eq!(beside[1].0, "docs");
        let docs = &steps_docs(&steps);
        let flags = docs
            .get_envs()
            .find(|(key, _)| *key == "RUSTDOCFLAGS")
            .and_then(|(_, v)| v);
        assert_eq!(
            flags,
            Some(std::ffi::OsStr::new("-D warnings")),
            "docs are built with warnings denied"
        );
        if crate::install::has_nightly() {
            assert_eq!(beside.get(2).map(|b| b.0), Some(FUZZ_BUILD), "{beside:?}");
        }
        for name in ["clippy", "docs"] {
            assert!(
                steps
                    .iter()
                    .any(|(n, step)| *n == name && matches!(step, Step::Beside(b) if *b == name)),
                "the {name} step waits for the {name} started beside the tests"
            );
        }
    }

    /// The docs command of the whole suite's steps.
    fn steps_docs<'a>(steps: &'a [(&'static str, Step)]) -> &'a Command {
        steps
            .iter()
            .find_map(|(_, step)| match step {
                Step::Suite(beside) => beside.iter().find(|(name, _)| *name == "docs").map(|(_, c)| c),
                _ => None,
            })
            .expect("the docs run beside the tests")
    }
}
