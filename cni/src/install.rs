//! Installing the plugin into a runtime's CNI directories: `rivet-cni
//! install` (the Kubernetes DaemonSet's init container, whose image has no
//! shell) and `rivet node up` share it.
//!
//! [`install`] copies this binary to `<bin-dir>/rivet-cni` and writes the
//! conflist ([`Conflist`]) to `<conf-dir>/10-rivet.conflist`, each through a
//! temp file and a rename (a runtime never reads half a file), the conflist
//! last: a runtime starts using it as soon as it appears. It refuses when the
//! bin dir has no `loopback` plugin (runtimes set up every pod's `lo` with
//! it) before it writes anything.
//!
//! [`uninstall`] removes both again, the conflist first (`rivet node
//! cleanup`, the DaemonSet's last container; `rivet node down`). Not here:
//! the daemons' directories (`rivet node prepare`).

use std::fs::File;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// The installed plugin's file name (the conflist's plugin `type`).
pub const BINARY: &str = "rivet-cni";

/// File name of the installed network configuration list.
pub const CONFLIST_FILE: &str = "10-rivet.conflist";

/// Network name in the conflist.
pub const NETWORK_NAME: &str = "rivet";

/// Plugins a runtime runs beside rivet-cni from the CNI bin dir:
/// containerd's CRI plugin sets up every pod's `lo` with `loopback`, and a
/// sandbox whose `loopback` is missing fails (and so does its cleanup).
pub const COMPANION_PLUGINS: [&str; 1] = ["loopback"];

/// The CNI spec versions rivet-cni reads (its VERSION verb's
/// `supportedVersions`), oldest first.
pub const CNI_VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// cniVersion of the conflist by default: the newest version common
/// runtimes read (containerd 1.6's libcni refuses 1.1.0 results).
pub const DEFAULT_CNI_VERSION: &str = "1.0.0";

/// What the conflist tells rivet-cni: where the daemons' sockets are and
/// how to wire pods. Paths are as the runtime (on the host) sees them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflist {
    /// `cniVersion`, one of [`CNI_VERSIONS`].
    pub cni_version: String,
    /// Directory of svc-ipam's and svc-endpoint's sockets.
    pub socket_dir: PathBuf,
    /// The svc-ipam pool pods get addresses from.
    pub ipam_pool: String,
    /// Prefix of the host-side veth names (svc-loader's
    /// `--endpoint-interface-prefix`).
    pub host_interface_prefix: String,
    /// The pods' MTU.
    pub mtu: u32,
    /// rivet-cni's log file, if any.
    pub log_file: Option<PathBuf>,
    /// Deadline of one call, seconds.
    pub timeout_seconds: u64,
    /// Where rivet-cni exports its spans (`tracing.otlpEndpoint`), if
    /// anywhere.
    pub otlp_endpoint: Option<String>,
}

impl Conflist {
    /// The conflist document.
    ///
    /// ```
    /// let list = rivet_cni::install::Conflist {
    ///     cni_version: "1.0.0".into(),
    ///     socket_dir: "/var/run/rivet/sockets".into(),
    ///     ipam_pool: "default".into(),
    ///     host_interface_prefix: "lxc".into(),
    ///     mtu: 1500,
    ///     log_file: None,
    ///     timeout_seconds: 30,
    ///     otlp_endpoint: Some("http://198.19.255.10:4317".into()),
    /// }
    /// .to_json();
    /// assert_eq!(list["plugins"][0]["type"], "rivet-cni");
    /// assert_eq!(list["plugins"][0]["tracing"]["otlpEndpoint"], "http://198.19.255.10:4317");
    /// ```
    pub fn to_json(&self) -> Value {
        let mut plugin = json!({
            "type": BINARY,
            "socketDir": self.socket_dir,
            "ipamPool": self.ipam_pool,
            "hostInterfacePrefix": self.host_interface_prefix,
            "mtu": self.mtu,
            "timeoutSeconds": self.timeout_seconds,
        });
        if let Some(log_file) = &self.log_file {
            plugin["logFile"] = json!(log_file);
        }
        if let Some(endpoint) = &self.otlp_endpoint {
            plugin["tracing"] = json!({ "otlpEndpoint": endpoint });
        }
        json!({
            "cniVersion": self.cni_version,
            "name": NETWORK_NAME,
            "plugins": [plugin],
        })
    }
}

/// Why the plugin could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// A companion plugin is missing from the bin dir.
    #[error(
        "the CNI plugin `{plugin}` is not in {bin_dir}: runtimes need it beside rivet-cni (containerd sets up \
         every pod's lo with it); install the reference plugins there (Debian: containernetworking-plugins, \
         Kubernetes nodes: kubernetes-cni)"
    )]
    MissingCompanion {
        /// The plugin.
        plugin: &'static str,
        /// Where it was looked for.
        bin_dir: PathBuf,
    },
    /// A file could not be written.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// To which file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> InstallError {
    let path = path.to_path_buf();
    move |source| InstallError::Io { action, path, source }
}

/// Copies `binary` to `<bin_dir>/rivet-cni`, then writes `conflist` to
/// `<conf_dir>/10-rivet.conflist`; returns both paths. Creates missing
/// directories. Fails before writing anything when a
/// [`COMPANION_PLUGINS`] is not in `bin_dir`.
///
/// # Errors
/// [`InstallError`]: a missing companion, or a file that could not be
/// written (naming it).
pub fn install(
    binary: &Path,
    bin_dir: &Path,
    conf_dir: &Path,
    conflist: &Conflist,
) -> Result<[PathBuf; 2], InstallError> {
    // An entry, not necessarily a file here: a node's plugins may be symlinks
    // that resolve on the host and not in the installing container.
    if let Some(plugin) = COMPANION_PLUGINS
        .into_iter()
        .find(|p| bin_dir.join(p).symlink_metadata().is_err())
    {
        return Err(InstallError::MissingCompanion {
            plugin,
            bin_dir: bin_dir.to_path_buf(),
        });
    }
    let target = bin_dir.join(BINARY);
    install_executable(binary, &target)?;
    let path = conf_dir.join(CONFLIST_FILE);
    let text = serde_json::to_string_pretty(&conflist.to_json()).expect("JSON values serialise") + "\n";
    rivet_common::state_file::write_atomic(&path, text.as_bytes()).map_err(|(action, source)| InstallError::Io {
        action,
        path: path.clone(),
        source,
    })?;
    Ok([target, path])
}

/// Removes `<conf_dir>/10-rivet.conflist`, then `<bin_dir>/rivet-cni` (a
/// runtime stops choosing Rivet before the plugin goes); returns the paths
/// it removed. Files already gone are not an error; other plugins and
/// conflists stay.
///
/// # Errors
/// [`InstallError::Io`] naming the file that could not be removed.
pub fn uninstall(bin_dir: &Path, conf_dir: &Path) -> Result<Vec<PathBuf>, InstallError> {
    let mut removed = Vec::new();
    for path in [conf_dir.join(CONFLIST_FILE), bin_dir.join(BINARY)] {
        match std::fs::remove_file(&path) {
            Ok(()) => removed.push(path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("removing", &path)(e)),
        }
    }
    Ok(removed)
}

/// Copies an executable to `target` (mode 0755) through a temp file beside
/// it, synced before the rename: a runtime never runs half a binary.
///
/// # Errors
/// [`InstallError::Io`] naming the step and the file.
pub fn install_executable(source: &Path, target: &Path) -> Result<(), InstallError> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = target.parent() {
        std::fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
    }
    let name = target.file_name().unwrap_or_default().to_string_lossy();
    let tmp = target.with_file_name(format!(".{name}.tmp"));
    std::fs::copy(source, &tmp).map_err(io_err("copying the plugin to", &tmp))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
        .map_err(io_err("making executable", &tmp))?;
    File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(io_err("syncing", &tmp))?;
    std::fs::rename(&tmp, target).map_err(io_err("installing", target))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conflist() -> Conflist {
        Conflist {
            cni_version: DEFAULT_CNI_VERSION.into(),
            socket_dir: "/var/run/rivet/sockets".into(),
            ipam_pool: "default".into(),
            host_interface_prefix: "lxc".into(),
            mtu: 1450,
            log_file: Some("/var/run/rivet/rivet-cni.log".into()),
            timeout_seconds: 30,
            otlp_endpoint: Some("http://198.19.255.10:4317".into()),
        }
    }

    #[test]
    fn installs_the_binary_and_the_conflist_rivet_cni_reads() {
        let dir = tempfile::tempdir().unwrap();
        let (bin, conf) = (dir.path().join("bin"), dir.path().join("net.d"));
        std::fs::create_dir(&bin).unwrap();
        // As on a node whose plugins link to where the host keeps them.
        std::os::unix::fs::symlink("/nonexistent-on-this-side/loopback", bin.join("loopback")).unwrap();
        let source = dir.path().join("source");
        std::fs::write(&source, "plugin").unwrap();
        let [binary, list] = install(&source, &bin, &conf, &conflist()).unwrap();
        assert_eq!(binary, bin.join("rivet-cni"));
        assert_eq!(std::fs::read_to_string(&binary).unwrap(), "plugin");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&binary).unwrap().permissions().mode() & 0o777, 0o755);
        // What a runtime hands the plugin: its entry with the list's name and version.
        let list: Value = serde_json::from_str(&std::fs::read_to_string(&list).unwrap()).unwrap();
        let mut plugin = list["plugins"][0].clone();
        plugin["name"] = list["name"].clone();
        plugin["cniVersion"] = list["cniVersion"].clone();
        let conf = crate::netconf::NetConf::parse(plugin.to_string().as_bytes()).unwrap();
        assert_eq!(conf.plugin_type, BINARY);
        assert_eq!(conf.socket_dir, Path::new("/var/run/rivet/sockets"));
        assert_eq!(conf.mtu, 1450);
        assert_eq!(conf.timeout, std::time::Duration::from_secs(30));
        assert_eq!(
            conf.log_file.as_deref(),
            Some(Path::new("/var/run/rivet/rivet-cni.log"))
        );
        assert_eq!(conf.otlp_endpoint.as_deref(), Some("http://198.19.255.10:4317"));
        // Nothing else left behind (temp files renamed).
        let mut names: Vec<String> = std::fs::read_dir(&bin)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["loopback", "rivet-cni"]);
    }

    #[test]
    fn uninstall_removes_the_binary_and_the_conflist_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let (bin, conf) = (dir.path().join("bin"), dir.path().join("net.d"));
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::write(bin.join("loopback"), b"").unwrap();
        std::fs::create_dir_all(&conf).unwrap();
        std::fs::write(conf.join("05-other.conflist"), b"{}").unwrap();
        let source = dir.path().join("source");
        std::fs::write(&source, "plugin").unwrap();
        install(&source, &bin, &conf, &conflist()).unwrap();

        let removed = uninstall(&bin, &conf).unwrap();
        assert_eq!(removed, [conf.join(CONFLIST_FILE), bin.join(BINARY)]);
        assert!(bin.join("loopback").exists() && conf.join("05-other.conflist").exists());
        assert!(!bin.join(BINARY).exists() && !conf.join(CONFLIST_FILE).exists());
        assert_eq!(uninstall(&bin, &conf).unwrap(), Vec::<PathBuf>::new(), "idempotent");
    }

    #[test]
    fn a_bin_dir_without_loopback_is_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let (bin, conf) = (dir.path().join("bin"), dir.path().join("net.d"));
        std::fs::create_dir(&bin).unwrap();
        let source = dir.path().join("source");
        std::fs::write(&source, "plugin").unwrap();
        let err = install(&source, &bin, &conf, &conflist()).unwrap_err();
        assert!(
            matches!(err, InstallError::MissingCompanion { plugin: "loopback", .. }),
            "{err}"
        );
        assert!(err.to_string().contains(&bin.display().to_string()), "{err}");
        assert!(!bin.join("rivet-cni").exists() && !conf.exists());
    }
}
