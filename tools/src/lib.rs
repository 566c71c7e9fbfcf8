//! The Go-built tools Rivet's tests run for real — Kubernetes (kube-apiserver
//! and friends), etcd 3.6 and Jaeger v2 — in one table: the pinned version of
//! each, how `cargo xtask install` builds it from the Go module proxy, and
//! where the binaries are cached.
//!
//! No Rust, Debian or PyPI package provides these versions (Debian's etcd
//! 3.4 is too old for kube-apiserver 1.34), so xtask builds each tool set in
//! its own wrapper Go module (their gRPC/OpenTelemetry versions differ) into
//! `<root>/<set>-<version>/bin/`, writing `<root>/<set>-<version>/.installed`
//! last. The root is `$RIVET_TOOLS_DIR`, or `~/.cache/rivet/tools`: outside
//! the checkout, so a fresh clone (CI) on the same machine finds the tools
//! built before and a warm install costs nothing.
//!
//! Test fixtures find a binary with [`tool_path`], which fails with the tool,
//! its version and "run `cargo xtask install`" when it is not installed: a
//! test needing a tool fails with that message, it is never skipped.
//!
//! ```no_run
//! use rivet_tools::{Tool, tool_path};
//!
//! let etcd = tool_path(Tool::Etcd)?; // ~/.cache/rivet/tools/etcd-v3.6.16/bin/etcd
//! let status = std::process::Command::new(etcd).arg("--version").status();
//! # Ok::<(), rivet_tools::ToolError>(())
//! ```

use std::fmt;
use std::path::{Path, PathBuf};

/// Environment variable naming the cache root (default `~/.cache/rivet/tools`).
pub const TOOLS_DIR_ENV: &str = "RIVET_TOOLS_DIR";

/// The stamp file in a tool set's directory, written after every binary was
/// built: a set without it is (re)built, a set with it is never touched.
pub const STAMP_FILE: &str = ".installed";

/// One binary of a [`ToolSet`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tool {
    /// `etcd` (the server), v3.6.
    Etcd,
    /// `etcdctl`.
    Etcdctl,
    /// `kube-apiserver`.
    KubeApiserver,
    /// `kube-controller-manager`.
    KubeControllerManager,
    /// `kube-scheduler`.
    KubeScheduler,
    /// `kubelet`.
    Kubelet,
    /// `kubectl`.
    Kubectl,
    /// `jaeger`, the Jaeger v2 all-in-one (OTLP in, query API out).
    Jaeger,
}

impl Tool {
    /// Every tool.
    pub const ALL: [Tool; 8] = [
        Tool::Etcd,
        Tool::Etcdctl,
        Tool::KubeApiserver,
        Tool::KubeControllerManager,
        Tool::KubeScheduler,
        Tool::Kubelet,
        Tool::Kubectl,
        Tool::Jaeger,
    ];

    /// The binary's file name.
    pub const fn name(self) -> &'static str {
        match self {
            Tool::Etcd => "etcd",
            Tool::Etcdctl => "etcdctl",
            Tool::KubeApiserver => "kube-apiserver",
            Tool::KubeControllerManager => "kube-controller-manager",
            Tool::KubeScheduler => "kube-scheduler",
            Tool::Kubelet => "kubelet",
            Tool::Kubectl => "kubectl",
            Tool::Jaeger => "jaeger",
        }
    }

    /// The tool set that builds it.
    pub fn set(self) -> &'static ToolSet {
        match self {
            Tool::Etcd | Tool::Etcdctl => &ETCD,
            Tool::Jaeger => &JAEGER,
            Tool::KubeApiserver | Tool::KubeControllerManager | Tool::KubeScheduler | Tool::Kubelet | Tool::Kubectl => {
                &KUBERNETES
            }
        }
    }
}

impl fmt::Display for Tool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A binary and the Go package it is built from.
#[derive(Debug, Clone, Copy)]
pub struct Binary {
    /// Which tool.
    pub tool: Tool,
    /// The `main` package, e.g. `k8s.io/kubernetes/cmd/kube-apiserver`.
    pub package: &'static str,
}

/// Replace directives a wrapper module needs because the tool's own go.mod
/// points modules at directories of its repository (Kubernetes' `./staging/`):
/// every such module is replaced by its published `version`.
#[derive(Debug, Clone, Copy)]
pub struct PublishedReplaces {
    /// The `module@version` whose go.mod lists them (from the proxy).
    pub from_go_mod_of: &'static str,
    /// Only targets starting with this are replaced, e.g. `./staging/`.
    pub local_prefix: &'static str,
    /// The published version that stands in for them, e.g. `v0.34.4`.
    pub version: &'static str,
}

/// One wrapper Go module and what it builds: one cache directory
/// (`<root>/<name>-<version>`), one stamp.
#[derive(Debug)]
pub struct ToolSet {
    /// Short name, the cache directory's prefix (`kubernetes`).
    pub name: &'static str,
    /// The pinned version (`v1.34.4`).
    pub version: &'static str,
    /// `module@version` arguments of `go get` in the wrapper module.
    pub requires: &'static [&'static str],
    /// Replace directives read from a go.mod on the proxy, if any.
    pub replaces: Option<PublishedReplaces>,
    /// The binaries, built in this order.
    pub binaries: &'static [Binary],
    /// Go build tags.
    pub tags: &'static [&'static str],
    /// `-X name=value` link flags (version strings).
    pub ldflags: &'static [(&'static str, &'static str)],
    /// `CGO_ENABLED=0` (a static binary, no C toolchain needed).
    pub static_binary: bool,
}

/// etcd v3.6: the kvstore of svc-identity's tests and the store of every
/// test kube-apiserver (>= 3.5.13 for watch progress requests).
pub static ETCD: ToolSet = ToolSet {
    name: "etcd",
    version: "v3.6.16",
    requires: &[
        "go.etcd.io/etcd/server/v3@v3.6.16",
        "go.etcd.io/etcd/etcdctl/v3@v3.6.16",
    ],
    replaces: None,
    binaries: &[
        Binary {
            tool: Tool::Etcd,
            package: "go.etcd.io/etcd/server/v3",
        },
        Binary {
            tool: Tool::Etcdctl,
            package: "go.etcd.io/etcd/etcdctl/v3",
        },
    ],
    tags: &[],
    ldflags: &[],
    static_binary: true,
};

/// Jaeger v2.13 (tag v1.76.0 of the Go module): all-in-one with memory
/// storage, OTLP gRPC/HTTP in, the query API out.
pub static JAEGER: ToolSet = ToolSet {
    name: "jaeger",
    version: "v1.76.0",
    requires: &["github.com/jaegertracing/jaeger@v1.76.0"],
    replaces: None,
    binaries: &[Binary {
        tool: Tool::Jaeger,
        package: "github.com/jaegertracing/jaeger/cmd/jaeger",
    }],
    tags: &[],
    ldflags: &[],
    static_binary: true,
};

/// Kubernetes v1.34 (kubelet 1.35+ refuses this machine kind's cgroup v1).
/// `go install k8s.io/kubernetes/cmd/...` fails because its go.mod replaces
/// the staging modules with `./staging` paths: the wrapper replaces each
/// with its published v0.34.4.
pub static KUBERNETES: ToolSet = ToolSet {
    name: "kubernetes",
    version: "v1.34.4",
    requires: &["k8s.io/kubernetes@v1.34.4"],
    replaces: Some(PublishedReplaces {
        from_go_mod_of: "k8s.io/kubernetes@v1.34.4",
        local_prefix: "./staging/",
        version: "v0.34.4",
    }),
    binaries: &[
        Binary {
            tool: Tool::KubeApiserver,
            package: "k8s.io/kubernetes/cmd/kube-apiserver",
        },
        Binary {
            tool: Tool::Kubectl,
            package: "k8s.io/kubernetes/cmd/kubectl",
        },
        Binary {
            tool: Tool::KubeControllerManager,
            package: "k8s.io/kubernetes/cmd/kube-controller-manager",
        },
        Binary {
            tool: Tool::KubeScheduler,
            package: "k8s.io/kubernetes/cmd/kube-scheduler",
        },
        Binary {
            tool: Tool::Kubelet,
            package: "k8s.io/kubernetes/cmd/kubelet",
        },
    ],
    tags: &["selinux", "notest"],
    ldflags: &[
        ("k8s.io/component-base/version.gitVersion", "v1.34.4"),
        ("k8s.io/component-base/version.gitMajor", "1"),
        ("k8s.io/component-base/version.gitMinor", "34"),
        ("k8s.io/component-base/version.gitTreeState", "clean"),
    ],
    static_binary: false,
};

/// Every tool set, in the order `cargo xtask install` builds them (quickest
/// first, so a failure in a long build leaves the short ones installed).
pub static TOOL_SETS: [&ToolSet; 3] = [&ETCD, &JAEGER, &KUBERNETES];

/// Why a tool cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// Neither `RIVET_TOOLS_DIR` nor `HOME` is set.
    #[error(
        "finding the Go-built tools: neither {TOOLS_DIR_ENV} nor HOME is set (the cache is $HOME/.cache/rivet/tools)"
    )]
    NoCacheRoot,
    /// The tool set was never installed (or its build did not finish).
    #[error(
        "{tool} ({set} {version}) is not installed: {stamp} is missing; run `cargo xtask install` \
         (it builds {set} {version} from the Go module proxy into {dir})",
        stamp = .dir.join(STAMP_FILE).display(), dir = .dir.display()
    )]
    NotInstalled {
        /// The binary asked for.
        tool: Tool,
        /// Its tool set's name.
        set: &'static str,
        /// The pinned version.
        version: &'static str,
        /// The tool set's cache directory.
        dir: PathBuf,
    },
    /// The stamp is there but the binary is not (removed by hand?).
    #[error(
        "{tool} ({set} {version}) is missing at {path} although the set is stamped installed; \
         remove {dir} and run `cargo xtask install`",
        path = .path.display(), dir = .dir.display()
    )]
    BinaryMissing {
        /// The binary asked for.
        tool: Tool,
        /// Its tool set's name.
        set: &'static str,
        /// The pinned version.
        version: &'static str,
        /// Where it should be.
        path: PathBuf,
        /// The tool set's cache directory.
        dir: PathBuf,
    },
}

/// The cache of built tools: `<root>/<set>-<version>/{bin/,src/,.installed}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolsDir {
    root: PathBuf,
}

impl ToolsDir {
    /// The root from `RIVET_TOOLS_DIR`, else `$HOME/.cache/rivet/tools`.
    ///
    /// # Errors
    /// [`ToolError::NoCacheRoot`] when neither variable is set.
    pub fn from_env() -> Result<Self, ToolError> {
        Self::from_vars(
            std::env::var_os(TOOLS_DIR_ENV).filter(|v| !v.is_empty()),
            std::env::var_os("HOME").filter(|v| !v.is_empty()),
        )
    }

    fn from_vars(tools_dir: Option<std::ffi::OsString>, home: Option<std::ffi::OsString>) -> Result<Self, ToolError> {
        match (tools_dir, home) {
            (Some(root), _) => Ok(Self::at(root)),
            (None, Some(home)) => Ok(Self::at(Path::new(&home).join(".cache/rivet/tools"))),
            (None, None) => Err(ToolError::NoCacheRoot),
        }
    }

    /// A cache rooted at `root`.
    pub fn at(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/<set>-<version>`.
    pub fn set_dir(&self, set: &ToolSet) -> PathBuf {
        self.root.join(format!("{}-{}", set.name, set.version))
    }

    /// Where the binaries go.
    pub fn bin_dir(&self, set: &ToolSet) -> PathBuf {
        self.set_dir(set).join("bin")
    }

    /// The wrapper module (go.mod, go.sum).
    pub fn module_dir(&self, set: &ToolSet) -> PathBuf {
        self.set_dir(set).join("src")
    }

    /// The stamp, written last by the install.
    pub fn stamp(&self, set: &ToolSet) -> PathBuf {
        self.set_dir(set).join(STAMP_FILE)
    }

    /// Whether the set's stamp exists.
    pub fn is_installed(&self, set: &ToolSet) -> bool {
        self.stamp(set).is_file()
    }

    /// The path of an installed tool.
    ///
    /// # Errors
    /// [`ToolError::NotInstalled`] without the stamp,
    /// [`ToolError::BinaryMissing`] when stamped but the file is gone.
    pub fn path(&self, tool: Tool) -> Result<PathBuf, ToolError> {
        let set = tool.set();
        if !self.is_installed(set) {
            return Err(ToolError::NotInstalled {
                tool,
                set: set.name,
                version: set.version,
                dir: self.set_dir(set),
            });
        }
        let path = self.bin_dir(set).join(tool.name());
        if !path.is_file() {
            return Err(ToolError::BinaryMissing {
                tool,
                set: set.name,
                version: set.version,
                path,
                dir: self.set_dir(set),
            });
        }
        Ok(path)
    }
}

/// The path of an installed tool in the cache of [`ToolsDir::from_env`].
///
/// # Errors
/// As [`ToolsDir::path`], each naming the tool, its version and
/// `cargo xtask install`.
pub fn tool_path(tool: Tool) -> Result<PathBuf, ToolError> {
    ToolsDir::from_env()?.path(tool)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tool_is_built_by_its_set_exactly_once() {
        for tool in Tool::ALL {
            let builders: Vec<&str> = TOOL_SETS
                .iter()
                .filter(|set| set.binaries.iter().any(|b| b.tool == tool))
                .map(|set| set.name)
                .collect();
            assert_eq!(builders, [tool.set().name], "{tool}");
            let binary = tool.set().binaries.iter().find(|b| b.tool == tool).expect("listed");
            assert!(
                binary.package.ends_with(tool.name()) || tool.set().name == "etcd",
                "{binary:?}"
            );
        }
    }

    #[test]
    fn root_comes_from_rivet_tools_dir_then_home() {
        let root = ToolsDir::from_vars(Some("/x/tools".into()), Some("/home/u".into())).expect("root");
        assert_eq!(root.root(), Path::new("/x/tools"));
        let root = ToolsDir::from_vars(None, Some("/home/u".into())).expect("root");
        assert_eq!(root.root(), Path::new("/home/u/.cache/rivet/tools"));
        assert!(matches!(ToolsDir::from_vars(None, None), Err(ToolError::NoCacheRoot)));
        assert_eq!(
            root.bin_dir(&ETCD),
            Path::new("/home/u/.cache/rivet/tools/etcd-v3.6.16/bin")
        );
        assert_eq!(
            root.stamp(&KUBERNETES),
            Path::new("/home/u/.cache/rivet/tools/kubernetes-v1.34.4/.installed")
        );
    }

    #[test]
    fn a_tool_is_found_only_once_its_set_is_stamped() {
        let dir = tempfile::tempdir().expect("temp dir");
        let tools = ToolsDir::at(dir.path());
        let bin = tools.bin_dir(&KUBERNETES);
        std::fs::create_dir_all(&bin).expect("bin dir");
        std::fs::write(bin.join("kube-apiserver"), "").expect("binary");

        // Built but not stamped (a build cut off half-way): not installed.
        let err = tools.path(Tool::KubeApiserver).expect_err("no stamp").to_string();
        assert!(
            err.contains("kube-apiserver (kubernetes v1.34.4) is not installed"),
            "{err}"
        );
        assert!(err.contains("run `cargo xtask install`"), "{err}");

        std::fs::write(tools.stamp(&KUBERNETES), "").expect("stamp");
        assert_eq!(
            tools.path(Tool::KubeApiserver).expect("found"),
            bin.join("kube-apiserver")
        );

        // Stamped but a binary removed by hand.
        let err = tools.path(Tool::Kubelet).expect_err("no kubelet").to_string();
        assert!(err.contains("kubelet (kubernetes v1.34.4) is missing at"), "{err}");

        // Other sets are independent.
        assert!(matches!(
            tools.path(Tool::Etcd),
            Err(ToolError::NotInstalled {
                set: "etcd",
                version: "v3.6.16",
                ..
            })
        ));
    }
}
