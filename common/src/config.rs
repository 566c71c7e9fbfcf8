//! Daemon configuration: clap flags, each with an environment variable, plus
//! `--config-dir DIR` where every file is named after a flag and holds its
//! value (a mounted Kubernetes ConfigMap). Precedence: flag > env >
//! config-dir > default. Unknown files are an error naming the file.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgAction, Args, Parser};

use crate::telemetry::LogFormat;

/// Flags every daemon shares. Flatten it into the daemon's own flags.
#[derive(Debug, Clone, Args)]
pub struct CommonArgs {
    /// Directory of the daemons' Unix sockets (`<daemon>.sock`).
    #[arg(long, env = "RIVET_SOCKET_DIR", default_value = "/var/run/rivet/sockets")]
    pub socket_dir: PathBuf,

    /// Directory for this node's persistent state.
    #[arg(long, env = "RIVET_STATE_DIR", default_value = "/var/run/rivet")]
    pub state_dir: PathBuf,

    /// Name of this node (default: the hostname).
    #[arg(long, env = "RIVET_NODE_NAME")]
    pub node_name: Option<String>,

    /// Directory of configuration files, one per flag (file name = flag name).
    #[arg(long, env = "RIVET_CONFIG_DIR")]
    pub config_dir: Option<PathBuf>,

    /// Log format on stderr.
    #[arg(long, env = "RIVET_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Address of the HTTP listener for `/metrics` and `/healthz` (off when unset).
    #[arg(long, env = "RIVET_METRICS_ADDRESS")]
    pub metrics_address: Option<SocketAddr>,

    /// UIDs that may call every method on the daemon's socket (comma-separated).
    /// With neither this nor --read-only-gids, every peer may call everything.
    #[arg(long, env = "RIVET_ALLOWED_UIDS", value_delimiter = ',')]
    pub allowed_uids: Vec<u32>,

    /// Groups whose members (primary or supplementary group) may call the
    /// daemon's read-only methods (comma-separated GIDs).
    #[arg(long, env = "RIVET_READ_ONLY_GIDS", value_delimiter = ',')]
    pub read_only_gids: Vec<u32>,

    /// Connections the socket holds open at once before it closes new ones
    /// from peers without full access (`--allowed-uids`), so that readers
    /// and strangers cannot use up the daemon's file descriptors; peers with
    /// full access are always admitted.
    #[arg(long, env = "RIVET_MAX_CONNECTIONS", default_value_t = crate::socket::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,

    /// Group of the socket file (a GID; the daemon's user must be a member);
    /// default: the daemon's primary group.
    #[arg(long, env = "RIVET_SOCKET_GID")]
    pub socket_gid: Option<u32>,

    /// Run as this user (name or UID) with its groups: the daemon starts as
    /// root, switches, and keeps only the capabilities it needs. Without it
    /// the daemon keeps its uid (and still drops every other capability).
    #[arg(long, env = "RIVET_USER")]
    pub user: Option<String>,

    /// Only check the configuration: parse the flags, environment and config
    /// dir, say whether they are valid, and exit (0 when they are) without
    /// touching anything.
    #[arg(long)]
    pub check_config: bool,
}

impl CommonArgs {
    /// `--node-name`, or the hostname when unset.
    pub fn node_name(&self) -> String {
        self.node_name.clone().unwrap_or_else(hostname)
    }

    /// Socket path of `daemon` in `--socket-dir`.
    pub fn socket_path(&self, daemon: &str) -> PathBuf {
        crate::socket::socket_path(&self.socket_dir, daemon)
    }
}

/// The machine's hostname (`localhost` if it cannot be read).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Bad flags, env values or config-dir values (also `--help`).
    #[error(transparent)]
    Flags(#[from] clap::Error),
    /// A file in the config dir names no flag.
    #[error("config dir: {file} does not name a flag of this daemon")]
    UnknownKey {
        /// The offending file.
        file: PathBuf,
    },
    /// A config-dir file holds a bad value for a switch.
    #[error("config dir: {file} must hold true or false, found {value:?}")]
    NotABool {
        /// The file.
        file: PathBuf,
        /// What it holds.
        value: String,
    },
    /// The config dir or one of its files could not be read.
    #[error("reading config dir {path}: {source}")]
    Read {
        /// What was read.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// The id of the `--check-config` switch ([`CommonArgs::check_config`];
/// a daemon without [`CommonArgs`] declares its own under this id).
pub const CHECK_CONFIG: &str = "check_config";

/// Parses `T` from the process arguments, environment and config dir; prints
/// the error (or help) and exits like [`Parser::parse`] on failure. With
/// `--check-config` it says the configuration is valid and exits 0 instead
/// of returning.
pub fn load<T: Parser>() -> T {
    match try_load_checked(std::env::args_os()) {
        Ok((t, false)) => t,
        Ok((_, true)) => {
            println!("{}: the configuration is valid", T::command().get_name());
            std::process::exit(0);
        }
        Err(ConfigError::Flags(e)) => e.exit(),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}

/// Parses `T` from `args`, the environment and the config dir named by the
/// flag `--config-dir` (or its env var) of a flattened [`CommonArgs`].
///
/// ```
/// use clap::Parser;
/// #[derive(Parser)]
/// struct Flags {
///     #[command(flatten)]
///     common: rivet_common::config::CommonArgs,
///     #[arg(long, env = "EXAMPLE_POOL_SIZE", default_value_t = 8)]
///     pool_size: u32,
/// }
/// let dir = tempfile::tempdir().unwrap();
/// std::fs::write(dir.path().join("pool-size"), "16\n").unwrap();
/// let flags: Flags = rivet_common::config::try_load_from([
///     "daemon".as_ref(), "--config-dir".as_ref(), dir.path().as_os_str(),
/// ]).unwrap();
/// assert_eq!(flags.pool_size, 16);
/// ```
pub fn try_load_from<T, I, A>(args: I) -> Result<T, ConfigError>
where
    T: Parser,
    I: IntoIterator<Item = A>,
    A: Into<OsString> + Clone,
{
    try_load_checked(args).map(|(t, _)| t)
}

/// [`try_load_from`], and whether `--check-config` ([`CHECK_CONFIG`]) was given.
fn try_load_checked<T, I, A>(args: I) -> Result<(T, bool), ConfigError>
where
    T: Parser,
    I: IntoIterator<Item = A>,
    A: Into<OsString> + Clone,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let command = T::command();
    let first = command.clone().try_get_matches_from(&args)?;
    let checking = first
        .try_get_one::<bool>(CHECK_CONFIG)
        .ok()
        .flatten()
        .copied()
        .unwrap_or(false);
    let Some(dir) = first.try_get_one::<PathBuf>("config_dir").ok().flatten() else {
        return Ok((T::from_arg_matches(&first)?, checking));
    };

    let mut extra = Vec::new();
    for (name, file, value) in read_config_dir(dir)? {
        let arg = command
            .get_arguments()
            .find(|a| a.get_long() == Some(name.as_str()))
            .ok_or_else(|| ConfigError::UnknownKey { file: file.clone() })?;
        let id = arg.get_id().as_str();
        if matches!(
            first.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        match arg.get_action() {
            ArgAction::SetTrue | ArgAction::SetFalse => match value.as_str() {
                "true" => extra.push(OsString::from(format!("--{name}"))),
                "false" => {}
                _ => return Err(ConfigError::NotABool { file, value }),
            },
            // Multi-valued flags take one value per line.
            ArgAction::Append => {
                for line in value.lines().map(str::trim).filter(|l| !l.is_empty()) {
                    extra.push(OsString::from(format!("--{name}={line}")));
                }
            }
            _ => extra.push(OsString::from(format!("--{name}={value}"))),
        }
    }
    let mut full = args;
    full.extend(extra);
    let matches = command.try_get_matches_from(full)?;
    Ok((T::from_arg_matches(&matches)?, checking))
}

/// (flag name, file, trimmed value) for every regular entry of `dir`,
/// skipping the `..data`-style entries Kubernetes creates in ConfigMap mounts.
fn read_config_dir(dir: &Path) -> Result<Vec<(String, PathBuf, String)>, ConfigError> {
    let read_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ConfigError::Read { path, source }
    };
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_err(dir))? {
        let entry = entry.map_err(read_err(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with('.') || path.is_dir() {
            continue;
        }
        let value = std::fs::read_to_string(&path).map_err(read_err(&path))?;
        out.push((name, path, value.trim().to_string()));
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Parser)]
    struct Flags {
        #[command(flatten)]
        common: CommonArgs,
        #[arg(long, env = "RIVET_TEST_CONFIG_COLOR", default_value = "red")]
        color: String,
        #[arg(long, env = "RIVET_TEST_CONFIG_SHAPE", default_value = "round")]
        shape: String,
        #[arg(long, env = "RIVET_TEST_CONFIG_SIZE", default_value = "small")]
        size: String,
        #[arg(long, env = "RIVET_TEST_CONFIG_VERBOSE")]
        verbose: bool,
        #[arg(long = "pool", env = "RIVET_TEST_CONFIG_POOL")]
        pools: Vec<String>,
    }

    fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, value) in files {
            std::fs::write(dir.path().join(name), value).unwrap();
        }
        dir
    }

    fn load_with(dir: &tempfile::TempDir, extra: &[&str]) -> Result<Flags, ConfigError> {
        let mut args = vec![
            "daemon".to_string(),
            "--config-dir".into(),
            dir.path().display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        try_load_from::<Flags, _, _>(args)
    }

    #[test]
    fn config_dir_fills_what_flags_leave_unset() {
        let dir = dir_with(&[("color", "blue\n"), ("verbose", "true"), ("pool", "a=1\nb=2\n")]);
        let f = load_with(&dir, &[]).unwrap();
        assert_eq!(f.color, "blue", "a config-dir value beats the default");
        assert_eq!(f.shape, "round", "an absent file leaves the default");
        assert!(f.verbose, "a switch file holding true sets the switch");
        assert_eq!(f.pools, ["a=1", "b=2"], "multi-valued flags take one value per line");
    }

    #[test]
    fn command_line_beats_config_dir() {
        let dir = dir_with(&[("color", "blue")]);
        let f = load_with(&dir, &["--color", "green"]).unwrap();
        assert_eq!(f.color, "green", "a flag beats the config dir");
    }

    #[test]
    fn env_beats_config_dir() {
        let dir = dir_with(&[("size", "large")]);
        // SAFETY: this variable is read only by this test.
        unsafe { std::env::set_var("RIVET_TEST_CONFIG_SIZE", "huge") };
        let f = load_with(&dir, &[]).unwrap();
        unsafe { std::env::remove_var("RIVET_TEST_CONFIG_SIZE") };
        assert_eq!(f.size, "huge", "an env var beats the config dir");
    }

    #[test]
    fn unknown_file_is_an_error_naming_it() {
        let dir = dir_with(&[("colour", "blue")]);
        let err = load_with(&dir, &[]).expect_err("a misspelt key must not be ignored");
        assert!(err.to_string().contains("colour"), "the error names the file: {err}");
    }

    #[test]
    fn bad_value_in_config_dir_is_reported_by_clap() {
        let dir = dir_with(&[("metrics-address", "not an address")]);
        let err = load_with(&dir, &[]).expect_err("a bad value must be refused");
        assert!(matches!(err, ConfigError::Flags(_)), "{err}");
        let dir = dir_with(&[("verbose", "yes")]);
        assert!(matches!(load_with(&dir, &[]), Err(ConfigError::NotABool { .. })));
    }

    #[test]
    fn check_config_is_reported_and_still_validates() {
        let dir = dir_with(&[("color", "blue")]);
        let args = |extra: &[&str]| {
            let mut a = vec![
                "daemon".to_string(),
                "--config-dir".into(),
                dir.path().display().to_string(),
            ];
            a.extend(extra.iter().map(|s| s.to_string()));
            a
        };
        let (f, checking) = try_load_checked::<Flags, _, _>(args(&["--check-config"])).unwrap();
        assert!(checking && f.common.check_config);
        assert_eq!(f.color, "blue", "the config dir is read when checking");
        let (_, checking) = try_load_checked::<Flags, _, _>(args(&[])).unwrap();
        assert!(!checking);
        let bad = dir_with(&[("colour", "blue")]);
        let err = try_load_checked::<Flags, _, _>([
            "daemon".as_ref(),
            "--config-dir".as_ref(),
            bad.path().as_os_str(),
            "--check-config".as_ref(),
        ])
        .expect_err("checking still refuses a bad config dir");
        assert!(matches!(err, ConfigError::UnknownKey { .. }), "{err}");
    }

    #[test]
    fn kubernetes_configmap_bookkeeping_entries_are_skipped() {
        let dir = dir_with(&[("..data", "x"), ("color", "blue")]);
        std::fs::create_dir(dir.path().join("..2026_11_22")).unwrap();
        assert_eq!(load_with(&dir, &[]).unwrap().color, "blue");
    }
}
