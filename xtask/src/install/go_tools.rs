//! The Go-built test tools of `rivet_tools` (Kubernetes, etcd 3.6, Jaeger):
//! built from the Go module proxy, each set in its own wrapper module, into
//! the cache outside the checkout (`~/.cache/rivet/tools/<set>-<version>/`,
//! or `$RIVET_TOOLS_DIR`), stamped `.installed` last.
//!
//! A stamped set is never touched, so a warm install is a few `stat`s. A set
//! without the stamp is built again from a freshly generated go.mod (Go's own
//! module and build caches make a retry cheap). Two installs at once (two
//! checkouts, CI beside a developer) take turns on a lock per set. Go's
//! output goes to `<set>-<version>/build.log`; the terminal gets one line per
//! step with the elapsed time, and a failure names the set, its version, the
//! step and go's first error line.

use std::fs::{self, File, OpenOptions};
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::fcntl::{Flock, FlockArg};
use rivet_tools::{PublishedReplaces, TOOL_SETS, ToolSet, ToolsDir};

use crate::cmd;

/// The `go` directive of a generated wrapper module; `go get` raises it when
/// a requirement needs a newer one.
const GO_DIRECTIVE: &str = "1.24.0";

/// The Go toolchain's command, looked up in PATH.
const GO: &str = "go";

/// Builds every tool set of [`TOOL_SETS`] that is not stamped installed.
pub fn install() -> Result<()> {
    let tools = ToolsDir::from_env()?;
    for set in TOOL_SETS {
        install_set(&tools, set, GO)?;
    }
    Ok(())
}

/// Builds one set with the `go` command `go` unless it is stamped; holds the
/// set's lock while building.
fn install_set(tools: &ToolsDir, set: &ToolSet, go: &str) -> Result<()> {
    if tools.is_installed(set) {
        println!(
            "tools: {} {} present in {}",
            set.name,
            set.version,
            tools.set_dir(set).display()
        );
        return Ok(());
    }
    let _lock = lock_set(tools, set)?;
    if tools.is_installed(set) {
        println!(
            "tools: {} {} installed meanwhile by another install",
            set.name, set.version
        );
        return Ok(());
    }
    let version = go_version(set, go)?;
    let build = Build::new(tools, set, go, &version)?;
    build.run()?;
    Ok(())
}

/// An exclusive lock on `<root>/<set>-<version>.lock` (released on drop);
/// says so when another install holds it.
fn lock_set(tools: &ToolsDir, set: &ToolSet) -> Result<Flock<File>> {
    fs::create_dir_all(tools.root()).with_context(|| format!("creating the tools cache {}", tools.root().display()))?;
    let path = tools.root().join(format!("{}-{}.lock", set.name, set.version));
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening the lock {}", path.display()))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(lock),
        Err((file, nix::errno::Errno::EWOULDBLOCK)) => {
            println!(
                "tools: {} {}: another install is building it; waiting for {}",
                set.name,
                set.version,
                path.display()
            );
            Flock::lock(file, FlockArg::LockExclusive)
                .map_err(|(_, errno)| errno)
                .with_context(|| format!("locking {}", path.display()))
        }
        Err((_, errno)) => Err(errno).with_context(|| format!("locking {}", path.display())),
    }
}

/// `go version`'s output; an error saying how to get Go when `go` is missing.
fn go_version(set: &ToolSet, go: &str) -> Result<String> {
    let mut go = Command::new(go);
    go.arg("version").env("GOTOOLCHAIN", "local");
    match go.output() {
        Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout).trim().to_string()),
        Ok(out) => bail!(
            "building {} {}: `go version` failed ({}): {}",
            set.name,
            set.version,
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => bail!(
            "building {} {}: the Go toolchain is needed but `go` is not in PATH; install Go 1.24 or \
             newer from https://go.dev/dl/ (Debian 12's golang-go is 1.19, too old) and put its bin/ \
             on PATH, then re-run `cargo xtask install`",
            set.name,
            set.version
        ),
        Err(err) => Err(err).with_context(|| format!("building {} {}: running `go version`", set.name, set.version)),
    }
}

/// One build of one set: its directories, log and clock.
struct Build<'a> {
    tools: &'a ToolsDir,
    set: &'a ToolSet,
    /// The `go` command.
    go: &'a str,
    /// Its `go version`.
    go_version: &'a str,
    log: PathBuf,
    started: Instant,
}

impl<'a> Build<'a> {
    fn new(tools: &'a ToolsDir, set: &'a ToolSet, go: &'a str, go_version: &'a str) -> Result<Self> {
        for dir in [tools.module_dir(set), tools.bin_dir(set)] {
            fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let log = tools.set_dir(set).join("build.log");
        File::create(&log).with_context(|| format!("creating the build log {}", log.display()))?;
        Ok(Self {
            tools,
            set,
            go,
            go_version,
            log,
            started: Instant::now(),
        })
    }

    fn run(&self) -> Result<()> {
        let set = self.set;
        println!(
            "tools: {} {}: building from the Go module proxy with {} (log: {})",
            set.name,
            set.version,
            self.go_version,
            self.log.display()
        );
        let replaces = match set.replaces {
            Some(replaces) => {
                self.step(&format!("reading the replaces of {}", replaces.from_go_mod_of));
                self.published_replaces(replaces)?
            }
            None => Vec::new(),
        };
        let go_mod = self.tools.module_dir(set).join("go.mod");
        fs::write(&go_mod, wrapper_go_mod(set, &replaces)).with_context(|| format!("writing {}", go_mod.display()))?;

        self.step(&format!("go get {}", set.requires.join(" ")));
        let mut get = self.go_command();
        get.arg("get").args(set.requires);
        self.run_go(get, "go get")?;

        for (i, binary) in set.binaries.iter().enumerate() {
            self.step(&format!("go build {} ({}/{})", binary.tool, i + 1, set.binaries.len()));
            let mut build = self.go_command();
            build.args(build_args(
                set,
                binary.package,
                &self.tools.bin_dir(set).join(binary.tool.name()),
            ));
            self.run_go(build, &format!("go build {}", binary.package))?;
        }

        let stamp = self.tools.stamp(set);
        fs::write(
            &stamp,
            format!(
                "{} {} built with {} in {:?}\n",
                set.name,
                set.version,
                self.go_version,
                self.started.elapsed()
            ),
        )
        .with_context(|| format!("writing the stamp {}", stamp.display()))?;
        println!(
            "tools: {} {} installed in {} ({})",
            set.name,
            set.version,
            elapsed(self.started.elapsed()),
            self.tools.bin_dir(set).display()
        );
        Ok(())
    }

    /// Prints one progress line.
    fn step(&self, what: &str) {
        println!(
            "tools: {} {}: {what} [{}]",
            self.set.name,
            self.set.version,
            elapsed(self.started.elapsed())
        );
        let _ = std::io::stdout().flush();
    }

    /// `go` in the wrapper module with the toolchain pinned to the local one.
    fn go_command(&self) -> Command {
        let mut go = Command::new(self.go);
        go.current_dir(self.tools.module_dir(self.set))
            .env("GOTOOLCHAIN", "local")
            .env("GOFLAGS", "-mod=mod");
        if self.set.static_binary {
            go.env("CGO_ENABLED", "0");
        }
        go
    }

    /// The modules to replace, from the proxy's copy of the tool's go.mod.
    fn published_replaces(&self, replaces: PublishedReplaces) -> Result<Vec<String>> {
        let mut download = self.go_command();
        // Outside the wrapper module: it has no go.mod yet (or a stale one).
        download
            .current_dir(self.tools.set_dir(self.set))
            .args(["mod", "download", "-json", replaces.from_go_mod_of]);
        let json = self.run_go(download, "go mod download")?;
        let info: serde_json::Value = serde_json::from_str(&json).with_context(|| {
            format!(
                "building {} {}: `go mod download -json {}` printed no JSON: {json}",
                self.set.name, self.set.version, replaces.from_go_mod_of
            )
        })?;
        let path = info["GoMod"].as_str().with_context(|| {
            format!(
                "building {} {}: `go mod download -json {}` gave no GoMod path: {json}",
                self.set.name, self.set.version, replaces.from_go_mod_of
            )
        })?;
        let text = fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
        let modules = locally_replaced_modules(&text, replaces.local_prefix);
        if modules.is_empty() {
            bail!(
                "building {} {}: {path} replaces no module with a {} path; the recipe in rivet-tools \
                 no longer fits this version",
                self.set.name,
                self.set.version,
                replaces.local_prefix
            );
        }
        Ok(modules
            .into_iter()
            .map(|module| format!("{module} => {module} {}", replaces.version))
            .collect())
    }

    /// Runs a go command, stderr appended to the build log and stdout
    /// returned; a failure names the set, the step and go's first error.
    fn run_go(&self, mut go: Command, step: &str) -> Result<String> {
        let mut log = OpenOptions::new()
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening the build log {}", self.log.display()))?;
        let start = log.seek(SeekFrom::End(0)).unwrap_or(0);
        writeln!(log, "$ {}", cmd::display(&go)).with_context(|| format!("writing {}", self.log.display()))?;
        let stderr = log
            .try_clone()
            .with_context(|| format!("duplicating {}", self.log.display()))?;
        let out = go.stdin(Stdio::null()).stderr(stderr).output().with_context(|| {
            format!(
                "building {} {}: starting `{}`",
                self.set.name,
                self.set.version,
                cmd::display(&go)
            )
        })?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            return Ok(stdout);
        }
        let mut output = String::new();
        let mut reread = File::open(&self.log).with_context(|| format!("reading {}", self.log.display()))?;
        reread.seek(SeekFrom::Start(start)).ok();
        reread.read_to_string(&mut output).ok();
        output.push_str(&stdout);
        bail!(
            "building {} {} failed at `{step}` ({}): {}\n(go's whole output: {})",
            self.set.name,
            self.set.version,
            out.status,
            first_error_line(&output).unwrap_or("go printed nothing"),
            self.log.display()
        )
    }
}

/// The arguments of `go build` for one binary.
fn build_args(set: &ToolSet, package: &str, output: &Path) -> Vec<String> {
    let mut args = vec!["build".to_string(), "-trimpath".to_string()];
    if !set.tags.is_empty() {
        args.push("-tags".to_string());
        args.push(set.tags.join(","));
    }
    if !set.ldflags.is_empty() {
        let flags: Vec<String> = set
            .ldflags
            .iter()
            .map(|(name, value)| format!("-X {name}={value}"))
            .collect();
        args.push("-ldflags".to_string());
        args.push(flags.join(" "));
    }
    args.push("-o".to_string());
    args.push(output.display().to_string());
    args.push(package.to_string());
    args
}

/// The wrapper module's go.mod before `go get`: the module line, the go
/// directive and the replace directives (`go get` adds the requirements).
fn wrapper_go_mod(set: &ToolSet, replaces: &[String]) -> String {
    let mut text = format!("module rivet.local/tools/{}\n\ngo {GO_DIRECTIVE}\n", set.name);
    if !replaces.is_empty() {
        text.push_str("\nreplace (\n");
        for replace in replaces {
            text.push('\t');
            text.push_str(replace);
            text.push('\n');
        }
        text.push_str(")\n");
    }
    text
}

/// The modules a go.mod replaces with a local path starting with `prefix`,
/// from both `replace a => ./x` lines and `replace ( ... )` blocks.
fn locally_replaced_modules(go_mod: &str, prefix: &str) -> Vec<String> {
    let mut modules = Vec::new();
    let mut in_block = false;
    for line in go_mod.lines() {
        let line = line.split("//").next().unwrap_or("").trim();
        let directive = if in_block {
            if line == ")" {
                in_block = false;
                continue;
            }
            line
        } else if let Some(rest) = line.strip_prefix("replace") {
            let rest = rest.trim();
            if rest == "(" {
                in_block = true;
                continue;
            }
            if !line.starts_with("replace ") && !line.starts_with("replace\t") {
                continue;
            }
            rest
        } else {
            continue;
        };
        let Some((from, to)) = directive.split_once("=>") else {
            continue;
        };
        let (Some(module), Some(target)) = (from.split_whitespace().next(), to.split_whitespace().next()) else {
            continue;
        };
        if target.starts_with(prefix) {
            modules.push(module.to_string());
        }
    }
    modules
}

/// The first line of go's output that says what went wrong: a line with
/// `error`, a `go:` message other than progress (downloading, added, ...),
/// or a compiler diagnostic (`file.go:12:3: ...`); else the last line.
fn first_error_line(output: &str) -> Option<&str> {
    const PROGRESS: &[&str] = &[
        "go: downloading ",
        "go: finding ",
        "go: extracting ",
        "go: added ",
        "go: upgraded ",
        "go: downgraded ",
        "go: found ",
    ];
    let lines = || {
        output
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with("$ "))
    };
    let compiler_diagnostic = |l: &str| {
        l.split_once(".go:")
            .is_some_and(|(_, rest)| rest.starts_with(|c: char| c.is_ascii_digit()))
    };
    lines()
        .find(|l| {
            !PROGRESS.iter().any(|p| l.starts_with(p))
                && (l.to_ascii_lowercase().contains("error") || l.starts_with("go: ") || compiler_diagnostic(l))
        })
        .or_else(|| lines().next_back())
}

/// `1m05s`, `42.3s`.
fn elapsed(d: Duration) -> String {
    let secs = d.as_secs();
    if secs >= 60 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rivet_tools::{ETCD, KUBERNETES};

    /// The shape of kubernetes' go.mod: a replace block of staging modules,
    /// plus forms that must not count (a versioned replace, comments).
    const K8S_GO_MOD: &str = "module k8s.io/kubernetes

go 1.24.0

require (
\tk8s.io/api v0.0.0
\tk8s.io/client-go v0.0.0 // indirect
)

replace github.com/example/x v1.0.0 => github.com/example/x v1.0.1

replace k8s.io/kms => ./staging/src/k8s.io/kms // single line

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\t// k8s.io/commented => ./staging/src/k8s.io/commented
\tk8s.io/client-go v0.0.0 => ./staging/src/k8s.io/client-go
\tk8s.io/other => ../elsewhere
)

require k8s.io/replaced-not v0.0.0
";

    #[test]
    fn staging_modules_are_read_from_kubernetes_go_mod() {
        assert_eq!(
            locally_replaced_modules(K8S_GO_MOD, "./staging/"),
            ["k8s.io/kms", "k8s.io/api", "k8s.io/client-go"]
        );
        assert!(locally_replaced_modules("module x\n\ngo 1.24\n", "./staging/").is_empty());
    }

    #[test]
    fn wrapper_go_mod_replaces_each_staging_module_with_its_published_version() {
        let replaces: Vec<String> = locally_replaced_modules(K8S_GO_MOD, "./staging/")
            .into_iter()
            .map(|m| format!("{m} => {m} v0.34.4"))
            .collect();
        assert_eq!(
            wrapper_go_mod(&KUBERNETES, &replaces),
            "module rivet.local/tools/kubernetes

go 1.24.0

replace (
\tk8s.io/kms => k8s.io/kms v0.34.4
\tk8s.io/api => k8s.io/api v0.34.4
\tk8s.io/client-go => k8s.io/client-go v0.34.4
)
"
        );
        assert_eq!(
            wrapper_go_mod(&ETCD, &[]),
            "module rivet.local/tools/etcd\n\ngo 1.24.0\n"
        );
    }

    #[test]
    fn kubernetes_is_built_with_tags_and_version_ldflags() {
        let args = build_args(
            &KUBERNETES,
            "k8s.io/kubernetes/cmd/kubelet",
            Path::new("/c/bin/kubelet"),
        );
        assert_eq!(
            args,
            [
                "build",
                "-trimpath",
                "-tags",
                "selinux,notest",
                "-ldflags",
                "-X k8s.io/component-base/version.gitVersion=v1.34.4 -X k8s.io/component-base/version.gitMajor=1 \
                 -X k8s.io/component-base/version.gitMinor=34 -X k8s.io/component-base/version.gitTreeState=clean",
                "-o",
                "/c/bin/kubelet",
                "k8s.io/kubernetes/cmd/kubelet",
            ]
        );
        let args = build_args(&ETCD, "go.etcd.io/etcd/server/v3", Path::new("/c/bin/etcd"));
        assert_eq!(
            args,
            ["build", "-trimpath", "-o", "/c/bin/etcd", "go.etcd.io/etcd/server/v3"]
        );
    }

    #[test]
    fn first_error_line_skips_progress() {
        let get = "$ go get x\ngo: downloading k8s.io/api v0.34.4\ngo: added k8s.io/api v0.34.4\n\
                   go: k8s.io/kubernetes@v1.34.4 requires k8s.io/api@v0.0.0: reading k8s.io/api/go.mod at revision v0.0.0: unknown revision v0.0.0\n\
                   go: more\n";
        assert_eq!(
            first_error_line(get),
            Some(
                "go: k8s.io/kubernetes@v1.34.4 requires k8s.io/api@v0.0.0: reading k8s.io/api/go.mod at revision v0.0.0: unknown revision v0.0.0"
            )
        );
        let build = "# k8s.io/kubernetes/pkg/x\npkg/x/y.go:12:3: undefined: z\n";
        assert_eq!(first_error_line(build), Some("pkg/x/y.go:12:3: undefined: z"));
        assert_eq!(first_error_line("something odd\nlast words\n"), Some("last words"));
        assert_eq!(first_error_line("$ go build\n"), None);
    }

    /// A failing `go` step (here a malformed module path, refused before
    /// any download) fails the install naming the set, its version, the step
    /// and go's first error line, and leaves the set unstamped.
    #[test]
    fn a_failed_build_names_the_set_the_step_and_gos_error() {
        static BROKEN: ToolSet = ToolSet {
            name: "broken",
            version: "v0.0.1",
            requires: &["not a module@v0.0.1"],
            replaces: None,
            binaries: &[],
            tags: &[],
            ldflags: &[],
            static_binary: true,
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let tools = ToolsDir::at(dir.path());
        let err = install_set(&tools, &BROKEN, GO).expect_err("go get fails").to_string();
        assert!(
            err.starts_with("building broken v0.0.1 failed at `go get` (exit status: 1): go: "),
            "{err}"
        );
        assert!(err.contains("malformed module path"), "{err}");
        assert!(err.contains("broken-v0.0.1/build.log"), "{err}");
        assert!(!tools.is_installed(&BROKEN));
        let go_mod = std::fs::read_to_string(tools.module_dir(&BROKEN).join("go.mod")).expect("go.mod");
        assert!(go_mod.starts_with("module rivet.local/tools/broken\n"), "{go_mod}");
    }

    /// The stamp decides: a stamped set is left alone (no `go` needed, no
    /// lock), an unstamped one is built. Here the "build" fails at once
    /// because `go` is not in PATH, which proves it was attempted.
    #[test]
    fn only_a_set_without_its_stamp_is_built() {
        let dir = tempfile::tempdir().expect("temp dir");
        let tools = ToolsDir::at(dir.path());
        fs::create_dir_all(tools.set_dir(&ETCD)).expect("set dir");
        fs::write(tools.stamp(&ETCD), "").expect("stamp");
        install_set(&tools, &ETCD, "/nonexistent/go").expect("a stamped set needs nothing");
        assert!(
            !tools.root().join("etcd-v3.6.16.lock").exists(),
            "a stamped set was locked"
        );
        assert!(!tools.module_dir(&ETCD).exists(), "a stamped set was touched");

        let err = install_set(&tools, &KUBERNETES, "/nonexistent/go")
            .expect_err("no go")
            .to_string();
        assert!(
            err.starts_with("building kubernetes v1.34.4: the Go toolchain is needed but `go` is not in PATH"),
            "{err}"
        );
        assert!(!tools.is_installed(&KUBERNETES));
    }
}
