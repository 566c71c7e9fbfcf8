//! The `CNI_*` environment of one invocation, checked per verb as the spec
//! requires, and `CNI_ARGS` with the Kubernetes keys.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use crate::error::CniError;

/// Longest Linux interface name (IFNAMSIZ - 1).
pub const IFNAME_MAX: usize = 15;

/// The verb (`CNI_COMMAND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    /// Attach a container.
    Add,
    /// Detach a container.
    Del,
    /// Verify an attachment.
    Check,
    /// Is the plugin ready for ADD?
    Status,
    /// Which spec versions are supported.
    Version,
    /// Remove resources of attachments that are no longer valid.
    Gc,
}

impl Command {
    /// Parses `CNI_COMMAND`.
    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "ADD" => Self::Add,
            "DEL" => Self::Del,
            "CHECK" => Self::Check,
            "STATUS" => Self::Status,
            "VERSION" => Self::Version,
            "GC" => Self::Gc,
            _ => return None,
        })
    }

    /// The verb as written in `CNI_COMMAND`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Add => "ADD",
            Self::Del => "DEL",
            Self::Check => "CHECK",
            Self::Status => "STATUS",
            Self::Version => "VERSION",
            Self::Gc => "GC",
        }
    }

    /// Whether the verb is about one attachment (needs container id and ifname).
    pub fn is_attachment(self) -> bool {
        matches!(self, Self::Add | Self::Del | Self::Check)
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The Kubernetes keys of `CNI_ARGS` (all optional).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniArgs {
    /// `K8S_POD_NAMESPACE`.
    pub pod_namespace: Option<String>,
    /// `K8S_POD_NAME`.
    pub pod_name: Option<String>,
    /// `K8S_POD_INFRA_CONTAINER_ID`.
    pub infra_container_id: Option<String>,
    /// `K8S_POD_UID`.
    pub pod_uid: Option<String>,
    /// `IgnoreUnknown`: unknown keys were allowed.
    pub ignore_unknown: bool,
    /// Keys not known to rivet-cni (only with `IgnoreUnknown`), in order.
    pub ignored: Vec<String>,
}

impl CniArgs {
    /// Parses `CNI_ARGS`: `KEY=VALUE` pairs separated by `;`. Unknown keys
    /// are an error unless `IgnoreUnknown` is `1` or `true` (anywhere in the
    /// list). Empty pairs (a trailing `;`) are skipped; a key given twice is
    /// an error.
    ///
    /// ```
    /// use rivet_cni::env::CniArgs;
    /// let args = CniArgs::parse("IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0;X=1").unwrap();
    /// assert_eq!(args.pod_namespace.as_deref(), Some("shop"));
    /// assert_eq!(args.ignored, ["X"]);
    /// assert_eq!(CniArgs::parse("X=1").unwrap_err().code, 4);
    /// ```
    pub fn parse(text: &str) -> Result<Self, CniError> {
        let mut pairs = BTreeMap::new();
        let mut order = Vec::new();
        for pair in text.split(';').filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| CniError::env(format!("CNI_ARGS: {pair:?} is not KEY=VALUE")))?;
            if key.is_empty() || !key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(CniError::env(format!(
                    "CNI_ARGS: {key:?} is not a valid key (letters, digits and '_')"
                )));
            }
            if value.chars().any(char::is_control) {
                return Err(CniError::env(format!(
                    "CNI_ARGS: the value of {key} contains control characters"
                )));
            }
            if pairs.insert(key, value).is_some() {
                return Err(CniError::env(format!("CNI_ARGS: {key} is given more than once")));
            }
            order.push(key);
        }
        let mut args = Self::default();
        if let Some(value) = pairs.get("IgnoreUnknown") {
            args.ignore_unknown = match value.to_ascii_lowercase().as_str() {
                "1" | "true" => true,
                "0" | "false" => false,
                _ => {
                    return Err(CniError::env(format!(
                        "CNI_ARGS: IgnoreUnknown={value:?} must be 1, true, 0 or false"
                    )));
                }
            };
        }
        for key in order {
            let value = pairs[key].to_string();
            let slot = match key {
                "K8S_POD_NAMESPACE" => &mut args.pod_namespace,
                "K8S_POD_NAME" => &mut args.pod_name,
                "K8S_POD_INFRA_CONTAINER_ID" => &mut args.infra_container_id,
                "K8S_POD_UID" => &mut args.pod_uid,
                "IgnoreUnknown" => continue,
                other if args.ignore_unknown => {
                    args.ignored.push(other.to_string());
                    continue;
                }
                other => {
                    return Err(CniError::env(format!(
                        "CNI_ARGS: unknown key {other} (rivet-cni knows K8S_POD_NAMESPACE, K8S_POD_NAME, \
                         K8S_POD_INFRA_CONTAINER_ID, K8S_POD_UID; set IgnoreUnknown=1 to ignore others)"
                    )));
                }
            };
            *slot = (!value.is_empty()).then_some(value);
        }
        Ok(args)
    }
}

/// The environment of one invocation, validated for its verb.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniEnv {
    /// `CNI_COMMAND`.
    pub command: Command,
    /// `CNI_CONTAINERID` (empty for STATUS, VERSION and GC).
    pub container_id: String,
    /// `CNI_NETNS` (required for ADD and CHECK, optional for DEL).
    pub netns: Option<PathBuf>,
    /// `CNI_IFNAME` (empty for STATUS, VERSION and GC).
    pub ifname: String,
    /// `CNI_ARGS`.
    pub args: CniArgs,
    /// `CNI_PATH`, split at `:` (empty entries dropped).
    pub path: Vec<PathBuf>,
}

/// Reads the variables from `get` (e.g. the process environment). A
/// variable that is set but empty counts as unset.
///
/// ```
/// use std::collections::HashMap;
/// let vars: HashMap<&str, &str> = [
///     ("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "c1"), ("CNI_NETNS", "/run/netns/p"), ("CNI_IFNAME", "eth0"),
/// ].into();
/// let env = rivet_cni::env::parse(|k| vars.get(k).map(|v| v.to_string())).unwrap();
/// assert_eq!(env.command, rivet_cni::env::Command::Add);
/// ```
pub fn parse(get: impl Fn(&str) -> Option<String>) -> Result<CniEnv, CniError> {
    let var = |name: &str| get(name).filter(|v| !v.is_empty());
    let command_text = var("CNI_COMMAND").ok_or_else(|| CniError::env("CNI_COMMAND is not set"))?;
    let command = Command::parse(&command_text).ok_or_else(|| {
        CniError::env(format!(
            "CNI_COMMAND={command_text:?} is not a CNI verb (ADD, DEL, CHECK, STATUS, VERSION, GC)"
        ))
    })?;
    let path: Vec<PathBuf> = var("CNI_PATH")
        .map(|p| p.split(':').filter(|s| !s.is_empty()).map(PathBuf::from).collect())
        .unwrap_or_default();
    let mut env = CniEnv {
        command,
        container_id: String::new(),
        netns: None,
        ifname: String::new(),
        args: CniArgs::default(),
        path,
    };
    if command == Command::Gc && env.path.is_empty() {
        return Err(CniError::env("CNI_PATH is not set (GC requires it)"));
    }
    if !command.is_attachment() {
        return Ok(env);
    }
    let container_id = var("CNI_CONTAINERID")
        .ok_or_else(|| CniError::env(format!("CNI_CONTAINERID is not set ({command} requires it)")))?;
    check_container_id(&container_id)?;
    let ifname =
        var("CNI_IFNAME").ok_or_else(|| CniError::env(format!("CNI_IFNAME is not set ({command} requires it)")))?;
    check_ifname(&ifname).map_err(|reason| CniError::env(format!("CNI_IFNAME={ifname:?}: {reason}")))?;
    let netns = match (var("CNI_NETNS"), command) {
        (Some(ns), _) => {
            let ns = PathBuf::from(ns);
            if !ns.is_absolute() {
                return Err(CniError::env(format!(
                    "CNI_NETNS={:?} must be an absolute path",
                    ns.display()
                )));
            }
            Some(ns)
        }
        (None, Command::Del) => None,
        (None, _) => return Err(CniError::env(format!("CNI_NETNS is not set ({command} requires it)"))),
    };
    env.args = CniArgs::parse(&var("CNI_ARGS").unwrap_or_default())?;
    env.container_id = container_id;
    env.ifname = ifname;
    env.netns = netns;
    Ok(env)
}

/// The spec's rule for `CNI_CONTAINERID`: an alphanumeric, then
/// alphanumerics, `_`, `.` or `-`.
pub fn check_container_id(id: &str) -> Result<(), CniError> {
    let mut bytes = id.bytes();
    let valid = bytes.next().is_some_and(|b| b.is_ascii_alphanumeric())
        && bytes.all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
        && id.len() <= 256;
    if valid {
        Ok(())
    } else {
        Err(CniError::env(format!(
            "CNI_CONTAINERID={id:?} must start with a letter or digit and contain only letters, digits, \
             '_', '.' and '-' (at most 256)"
        )))
    }
}

/// A Linux interface name: 1 to 15 bytes, not `.` or `..`, no `/`, `:`,
/// whitespace or control characters.
pub fn check_ifname(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > IFNAME_MAX {
        return Err(format!("an interface name is 1 to {IFNAME_MAX} bytes"));
    }
    if name == "." || name == ".." {
        return Err("an interface name cannot be . or ..".into());
    }
    if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control())
    {
        return Err("an interface name cannot contain '/', ':', whitespace or control characters".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::error::codes;

    fn env(pairs: &[(&str, &str)]) -> Result<CniEnv, CniError> {
        let vars: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        parse(|k| vars.get(k).cloned())
    }

    const ADD: &[(&str, &str)] = &[
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "abc123"),
        ("CNI_NETNS", "/run/netns/pod"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin::/usr/lib/cni"),
    ];

    fn with(
        base: &[(&'static str, &'static str)],
        key: &'static str,
        value: &'static str,
    ) -> Vec<(&'static str, &'static str)> {
        let mut v: Vec<_> = base.iter().copied().filter(|(k, _)| *k != key).collect();
        v.push((key, value));
        v
    }

    fn without(base: &[(&'static str, &'static str)], key: &str) -> Vec<(&'static str, &'static str)> {
        base.iter().copied().filter(|(k, _)| *k != key).collect()
    }

    #[test]
    fn add_environment() {
        let e = env(ADD).unwrap();
        assert_eq!(e.command, Command::Add);
        assert_eq!(e.container_id, "abc123");
        assert_eq!(e.netns.as_deref(), Some(std::path::Path::new("/run/netns/pod")));
        assert_eq!(e.ifname, "eth0");
        assert_eq!(e.path, [PathBuf::from("/opt/cni/bin"), PathBuf::from("/usr/lib/cni")]);
        assert_eq!(e.args, CniArgs::default());
    }

    #[test]
    fn required_variables_per_verb() {
        let missing = |pairs: &[(&str, &str)], var: &str| {
            let err = env(pairs).unwrap_err();
            assert_eq!(err.code, codes::INVALID_ENVIRONMENT, "{err}");
            assert!(err.msg.contains(var), "{err} names {var}");
        };
        missing(&[], "CNI_COMMAND");
        missing(&without(ADD, "CNI_CONTAINERID"), "CNI_CONTAINERID");
        missing(&without(ADD, "CNI_IFNAME"), "CNI_IFNAME");
        missing(&without(ADD, "CNI_NETNS"), "CNI_NETNS");
        missing(&with(ADD, "CNI_CONTAINERID", ""), "CNI_CONTAINERID");
        missing(&with(&without(ADD, "CNI_NETNS"), "CNI_COMMAND", "CHECK"), "CNI_NETNS");
        missing(&[("CNI_COMMAND", "GC")], "CNI_PATH");
        // DEL may come without a netns (the runtime lost it).
        let del = env(&with(&without(ADD, "CNI_NETNS"), "CNI_COMMAND", "DEL")).unwrap();
        assert_eq!(del.netns, None);
        // STATUS and VERSION need nothing else.
        assert_eq!(env(&[("CNI_COMMAND", "STATUS")]).unwrap().command, Command::Status);
        assert_eq!(env(&[("CNI_COMMAND", "VERSION")]).unwrap().command, Command::Version);
        let gc = env(&[("CNI_COMMAND", "GC"), ("CNI_PATH", "/opt/cni/bin")]).unwrap();
        assert_eq!(gc.container_id, "");
    }

    #[test]
    fn invalid_variables() {
        let invalid = |pairs: Vec<(&str, &str)>, var: &str| {
            let err = env(&pairs).unwrap_err();
            assert_eq!(err.code, codes::INVALID_ENVIRONMENT, "{err}");
            assert!(err.msg.contains(var), "{err} names {var}");
        };
        invalid(with(ADD, "CNI_COMMAND", "add"), "CNI_COMMAND");
        invalid(with(ADD, "CNI_COMMAND", "DELETE"), "CNI_COMMAND");
        invalid(with(ADD, "CNI_CONTAINERID", "-abc"), "CNI_CONTAINERID");
        invalid(with(ADD, "CNI_CONTAINERID", "a/b"), "CNI_CONTAINERID");
        invalid(with(ADD, "CNI_CONTAINERID", "a b"), "CNI_CONTAINERID");
        invalid(with(ADD, "CNI_IFNAME", "eth0123456789012"), "CNI_IFNAME");
        invalid(with(ADD, "CNI_IFNAME", "a/b"), "CNI_IFNAME");
        invalid(with(ADD, "CNI_IFNAME", ".."), "CNI_IFNAME");
        invalid(with(ADD, "CNI_IFNAME", "eth:0"), "CNI_IFNAME");
        invalid(with(ADD, "CNI_NETNS", "run/netns/x"), "CNI_NETNS");
        invalid(with(ADD, "CNI_ARGS", "FOO=bar"), "FOO");
        assert!(env(&with(ADD, "CNI_CONTAINERID", "a.b_c-D9")).is_ok());
        assert!(env(&with(ADD, "CNI_IFNAME", "net1234567890ab")).is_ok());
    }

    #[test]
    fn cni_args() {
        let a =
            CniArgs::parse("K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1;")
                .unwrap();
        assert_eq!(a.pod_namespace.as_deref(), Some("shop"));
        assert_eq!(a.pod_name.as_deref(), Some("web-0"));
        assert_eq!(a.infra_container_id.as_deref(), Some("abc"));
        assert_eq!(a.pod_uid.as_deref(), Some("u-1"));
        assert!(!a.ignore_unknown);
        assert_eq!(CniArgs::parse("").unwrap(), CniArgs::default());

        // IgnoreUnknown may come after the unknown key; both spellings.
        for ignore in ["1", "true", "TRUE", "True"] {
            let a = CniArgs::parse(&format!("FOO=1;IgnoreUnknown={ignore};BAR=2")).unwrap();
            assert!(a.ignore_unknown);
            assert_eq!(a.ignored, ["FOO", "BAR"]);
        }
        let err = |text: &str, needle: &str| {
            let e = CniArgs::parse(text).unwrap_err();
            assert_eq!(e.code, codes::INVALID_ENVIRONMENT);
            assert!(e.msg.contains(needle), "{e} should mention {needle}");
        };
        err("FOO=1;IgnoreUnknown=0", "FOO");
        err("FOO=1", "IgnoreUnknown=1");
        err("IgnoreUnknown=yes", "IgnoreUnknown");
        err("K8S_POD_NAME", "KEY=VALUE");
        err("=x", "valid key");
        err("K8S_POD_NAME=a;K8S_POD_NAME=b", "more than once");
        err("K8S_POD_NAME=a\u{7}", "control");
        // An empty value is no value.
        assert_eq!(CniArgs::parse("K8S_POD_UID=").unwrap().pod_uid, None);
        // '=' inside a value is kept.
        assert_eq!(
            CniArgs::parse("K8S_POD_UID=a=b").unwrap().pod_uid.as_deref(),
            Some("a=b")
        );
    }

    #[test]
    fn ifname_rules() {
        assert!(check_ifname("eth0").is_ok());
        assert!(check_ifname("").is_err());
        assert!(check_ifname("x".repeat(16).as_str()).is_err());
        assert!(check_ifname("a b").is_err());
        assert!(check_ifname(".").is_err());
    }
}
