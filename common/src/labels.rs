//! Security labels: the `source:key=value` pairs an identity is made of
//! (DESIGN.md §4), label sets, the reserved identities, the namespace labels
//! of §6 and the filter that keeps only identity-relevant labels.
//!
//! ```
//! use rivet_common::labels::{LabelFilter, Labels};
//!
//! let pod: Labels = "k8s:app=web,k8s:pod-template-hash=5d8f9c".parse()?;
//! let identity = LabelFilter::default().filter(&pod.with_namespace("shop", [("team", "a")])?);
//! assert_eq!(
//!     identity.to_string(),
//!     "k8s:app=web,k8s:io.kubernetes.pod.namespace=shop,k8s:ns.labels/team=a"
//! );
//! # Ok::<(), rivet_common::labels::LabelError>(())
//! ```
//!
//! # Text form
//!
//! A label is written `source:key=value`, or `source:key` when the value is
//! empty (`reserved:host`). The source ends at the first `:`, the key at the
//! first `=` after it, so a CIDR key may contain `:` (`cidr:2001:2::/64`).
//! As in Cilium, text without a source (no `:` before the first `=`) has the
//! source `unspec`: `app=web` is `unspec:app=web`. `source:key=` and
//! `source:key` are the same label (empty value). Sources are case-sensitive;
//! Cilium's `$host` shorthand and its `any` source (a selector wildcard, not a
//! label source) are not accepted.
//!
//! # Validation
//!
//! Every constructor validates, so a [`Label`] in hand is always valid and
//! `parse(display(l)) == l`. By source:
//!
//! - `k8s`, `container`, `unspec`: Kubernetes label rules. The key is
//!   `[prefix/]name`: an optional DNS-1123 subdomain prefix (lowercase
//!   alphanumerics, `-` and `.`, each dot-separated part starting and ending
//!   with an alphanumeric, at most 253 characters) and a name of at most 63
//!   characters matching `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`. The value
//!   is empty or at most 63 characters of the name's form. The one exception
//!   is the namespace-label key `ns.labels/<key>` (below), where `<key>` is
//!   itself checked as a Kubernetes label key, so it may carry its own prefix.
//! - `reserved`: the key is one of `host`, `world`, `unmanaged`, `health`,
//!   `init`, `remote-node`, `kube-apiserver` ([`ReservedIdentity`]); no value.
//! - `cidr`: the key is a network address with prefix length, with no host
//!   bits set (`cidr:198.18.0.0/24`, `cidr:2001:2::/64`); no value. The key is
//!   stored in canonical form (`cidr:2001:0002:0::/64` becomes
//!   `cidr:2001:2::/64`), so one network is always one label. IPv6 keys keep
//!   their `:` (Cilium writes them with `-`; we do not).
//!
//! Each failure is a [`LabelError`] that names the label text and the problem.
//!
//! # Order
//!
//! Labels sort by source, then key, then value. Sources sort by name
//! (`cidr` < `container` < `k8s` < `reserved` < `unspec`), so the order never
//! changes: a sorted label set is part of the kvstore's identity keys.
//! A [`Labels`] set holds each label once and each key at most once per source
//! (a second value for the same source and key is an error naming both).
//!
//! # Namespace labels (DESIGN.md §6)
//!
//! A pod's namespace and that namespace's labels are identity labels of the
//! pod, spelled once here:
//!
//! - `k8s:io.kubernetes.pod.namespace=<namespace>` ([`POD_NAMESPACE_LABEL`],
//!   Cilium's spelling);
//! - `k8s:ns.labels/<key>=<value>` for each namespace label
//!   ([`NAMESPACE_LABELS_PREFIX`]), for example
//!   `k8s:ns.labels/kubernetes.io/metadata.name=shop`. Cilium writes
//!   `io.cilium.k8s.namespace.labels.<key>`, which for an unprefixed key
//!   leaves only 32 of the 63 characters of a name; with `ns.labels/` every
//!   valid namespace label maps to a valid label.
//!
//! [`Labels::with_namespace`] adds them and first drops any label of the pod
//! (k8s, container or unspec source) with either key, so a pod cannot claim
//! another namespace or a namespace label by labelling itself (Cilium's
//! `SanitizePodLabels`).
//!
//! # Filter
//!
//! [`LabelFilter`] keeps the identity-relevant labels. Its rules follow
//! Cilium's `--labels` flag, one rule per flag value:
//! `[!][source:]key-prefix`. A rule matches a label whose key starts with
//! `key-prefix` (a plain string prefix, not a regular expression) and, when a
//! source is given, whose source is that source. `!` makes it an exclude.
//!
//! - Excludes always drop a matching label.
//! - When at least one include is configured, only labels matching an include
//!   are kept (besides those below).
//! - `reserved` and `cidr` labels and `k8s:io.kubernetes.pod.namespace` are
//!   never filtered: without the namespace label, pods of different
//!   namespaces would share identities and namespace-scoped policy would
//!   break. Namespace labels (`k8s:ns.labels/...`) count as included (as in
//!   Cilium's default include list) but an exclude drops them.
//! - The defaults ([`DEFAULT_EXCLUDES`]) drop high-cardinality keys of any
//!   source; configured rules add to them ([`LabelFilter::parse`]).
//!
//! An identity's labels are therefore
//! `filter.filter(&pod_labels.with_namespace(ns, ns_labels)?)`: filter last,
//! so that excludes of namespace labels apply.

use std::fmt;
use std::str::FromStr;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::intern::Interned;
use crate::k8s_name;

/// Key of the label holding a pod's namespace (with source `k8s`).
///
/// ```
/// use rivet_common::labels::{Label, POD_NAMESPACE_LABEL};
///
/// assert_eq!(Label::namespace("shop")?.key(), POD_NAMESPACE_LABEL);
/// # Ok::<(), rivet_common::labels::LabelError>(())
/// ```
pub const POD_NAMESPACE_LABEL: &str = "io.kubernetes.pod.namespace";

/// Key prefix of a namespace's labels on its pods (with source `k8s`):
/// namespace label `team=a` is pod label `k8s:ns.labels/team=a`.
///
/// ```
/// use rivet_common::labels::{Label, NAMESPACE_LABELS_PREFIX};
///
/// let label = Label::namespace_label("team", "a")?;
/// assert_eq!(label.key(), format!("{NAMESPACE_LABELS_PREFIX}team"));
/// # Ok::<(), rivet_common::labels::LabelError>(())
/// ```
pub const NAMESPACE_LABELS_PREFIX: &str = "ns.labels/";

/// Label keys [`LabelFilter::default`] drops (as key prefixes, any source):
/// per-pod or per-rollout values that would give every pod or every rollout
/// its own identity. The issue's list plus Cilium's `pod-template-generation`,
/// `apps.kubernetes.io/pod-index` and `batch.kubernetes.io/job-completion-index`.
///
/// ```
/// use rivet_common::labels::{DEFAULT_EXCLUDES, LabelFilter, Labels};
///
/// assert!(DEFAULT_EXCLUDES.contains(&"pod-template-hash"));
/// let pod: Labels = "k8s:app=web,k8s:pod-template-hash=5d8f9c".parse()?;
/// assert_eq!(LabelFilter::default().filter(&pod).to_string(), "k8s:app=web");
/// # Ok::<(), rivet_common::labels::LabelError>(())
/// ```
pub const DEFAULT_EXCLUDES: &[&str] = &[
    "pod-template-hash",
    "pod-template-generation",
    "controller-revision-hash",
    "controller-uid",
    "batch.kubernetes.io/controller-uid",
    "batch.kubernetes.io/job-name",
    "batch.kubernetes.io/job-completion-index",
    "job-name",
    "statefulset.kubernetes.io/pod-name",
    "apps.kubernetes.io/pod-index",
];

/// Why a label, label list or filter rule was rejected. Every message names
/// the offending text and what is wrong with it.
///
/// ```
/// use rivet_common::labels::{Label, LabelError};
///
/// let err = "k8s:app=we b".parse::<Label>().unwrap_err();
/// assert!(matches!(err, LabelError::InvalidValue { .. }));
/// assert!(err.to_string().contains(r#""k8s:app=we b""#));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    /// The source before the first `:` is not a known source.
    #[error(
        "invalid label {label:?}: unknown source {name:?} (expected one of cidr, container, k8s, reserved, unspec)"
    )]
    UnknownSource {
        /// The label text.
        label: String,
        /// The source as written.
        name: String,
    },
    /// The key is empty.
    #[error("invalid label {label:?}: empty key")]
    EmptyKey {
        /// The label text.
        label: String,
    },
    /// The key breaks the Kubernetes label-key rules.
    #[error("invalid label {label:?}: key {key:?} {reason}")]
    InvalidKey {
        /// The label text.
        label: String,
        /// The key as written.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The value breaks the Kubernetes label-value rules.
    #[error("invalid label {label:?}: value {value:?} {reason}")]
    InvalidValue {
        /// The label text.
        label: String,
        /// The value as written.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A `cidr` key that is not a network address with prefix length.
    #[error("invalid label {label:?}: {key:?} {reason}")]
    InvalidCidr {
        /// The label text.
        label: String,
        /// The key as written.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A `reserved` key that names no reserved identity.
    #[error(
        "invalid label {label:?}: unknown reserved label {key:?} \
         (expected one of host, world, unmanaged, health, init, remote-node, kube-apiserver)"
    )]
    UnknownReserved {
        /// The label text.
        label: String,
        /// The key as written.
        key: String,
    },
    /// A `reserved` or `cidr` label with a value.
    #[error("invalid label {label:?}: {kind} labels have no value, found {value:?}")]
    UnexpectedValue {
        /// The label text.
        label: String,
        /// The label's source.
        kind: LabelSource,
        /// The value as written.
        value: String,
    },
    /// Two labels of one set give the same source and key different values.
    #[error("conflicting labels {first:?} and {second:?}: one key of one source can have only one value")]
    Conflict {
        /// The label already in the set.
        first: String,
        /// The label that was added.
        second: String,
    },
    /// A comma-separated label list with an empty item.
    #[error("invalid label list {list:?}: empty item")]
    EmptyItem {
        /// The list as written.
        list: String,
    },
    /// A label filter rule that cannot be parsed.
    #[error("invalid label filter rule {rule:?}: {reason}")]
    InvalidFilter {
        /// The rule as written.
        rule: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// Where a label comes from; the part before the first `:`.
///
/// Sorted by name: `cidr` < `container` < `k8s` < `reserved` < `unspec`.
/// Serialised as its name.
///
/// ```
/// use rivet_common::labels::LabelSource;
///
/// assert_eq!("k8s".parse::<LabelSource>()?, LabelSource::K8s);
/// assert_eq!(LabelSource::Reserved.to_string(), "reserved");
/// assert!("docker".parse::<LabelSource>().unwrap_err().to_string().contains(r#""docker""#));
/// # Ok::<(), rivet_common::labels::LabelError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LabelSource {
    /// `cidr`: a network address (policy ipBlocks); the key is the CIDR.
    Cidr,
    /// `container`: labels of the container from the runtime or the CNI call.
    Container,
    /// `k8s`: Kubernetes pod and namespace labels.
    K8s,
    /// `reserved`: the reserved identities (`reserved:host`, ...).
    Reserved,
    /// `unspec`: no source given.
    Unspec,
}

impl LabelSource {
    /// Every source, in sort order.
    ///
    /// ```
    /// use rivet_common::labels::LabelSource;
    ///
    /// let names: Vec<_> = LabelSource::ALL.iter().map(|s| s.as_str()).collect();
    /// assert_eq!(names, ["cidr", "container", "k8s", "reserved", "unspec"]);
    /// ```
    pub const ALL: [LabelSource; 5] = [Self::Cidr, Self::Container, Self::K8s, Self::Reserved, Self::Unspec];

    /// The source's name as written in labels.
    ///
    /// ```
    /// assert_eq!(rivet_common::labels::LabelSource::Container.as_str(), "container");
    /// ```
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Cidr => "cidr",
            Self::Container => "container",
            Self::K8s => "k8s",
            Self::Reserved => "reserved",
            Self::Unspec => "unspec",
        }
    }

    /// Whether labels of this source follow the Kubernetes key and value rules
    /// (`k8s`, `container`, `unspec`).
    fn is_text(self) -> bool {
        matches!(self, Self::K8s | Self::Container | Self::Unspec)
    }
}

impl fmt::Display for LabelSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LabelSource {
    type Err = LabelError;

    fn from_str(s: &str) -> Result<Self, LabelError> {
        Self::ALL
            .into_iter()
            .find(|source| source.as_str() == s)
            .ok_or_else(|| LabelError::UnknownSource {
                label: s.to_string(),
                name: s.to_string(),
            })
    }
}

impl Serialize for LabelSource {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for LabelSource {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A reserved identity (DESIGN.md §4): a fixed numeric identity named by a
/// `reserved:<name>` label, resolved without the kvstore.
///
/// ```
/// use rivet_common::labels::ReservedIdentity;
///
/// let host: ReservedIdentity = "host".parse()?;
/// assert_eq!(host.id(), 1);
/// assert_eq!(ReservedIdentity::from_id(7), Some(ReservedIdentity::KubeApiserver));
/// assert_eq!(ReservedIdentity::RemoteNode.to_string(), "remote-node");
/// # Ok::<(), rivet_common::labels::LabelError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum ReservedIdentity {
    /// 1: the local node.
    Host = 1,
    /// 2: everything outside the cluster.
    World = 2,
    /// 3: pods not managed by Rivet.
    Unmanaged = 3,
    /// 4: the health-check endpoint.
    Health = 4,
    /// 5: endpoints whose identity is not resolved yet.
    Init = 5,
    /// 6: other nodes of the cluster.
    RemoteNode = 6,
    /// 7: the Kubernetes API server.
    KubeApiserver = 7,
}

impl ReservedIdentity {
    /// Every reserved identity, by number.
    ///
    /// ```
    /// use rivet_common::labels::ReservedIdentity;
    ///
    /// let ids: Vec<u32> = ReservedIdentity::ALL.iter().map(|r| r.id()).collect();
    /// assert_eq!(ids, [1, 2, 3, 4, 5, 6, 7]);
    /// ```
    pub const ALL: [ReservedIdentity; 7] = [
        Self::Host,
        Self::World,
        Self::Unmanaged,
        Self::Health,
        Self::Init,
        Self::RemoteNode,
        Self::KubeApiserver,
    ];

    /// The numeric identity.
    ///
    /// ```
    /// assert_eq!(rivet_common::labels::ReservedIdentity::World.id(), 2);
    /// ```
    pub const fn id(self) -> u32 {
        self as u32
    }

    /// The reserved identity with number `id`, if any.
    ///
    /// ```
    /// use rivet_common::labels::ReservedIdentity;
    ///
    /// assert_eq!(ReservedIdentity::from_id(4), Some(ReservedIdentity::Health));
    /// assert_eq!(ReservedIdentity::from_id(256), None);
    /// ```
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.id() == id)
    }

    /// The name, the key of its `reserved:` label.
    ///
    /// ```
    /// assert_eq!(rivet_common::labels::ReservedIdentity::KubeApiserver.name(), "kube-apiserver");
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::World => "world",
            Self::Unmanaged => "unmanaged",
            Self::Health => "health",
            Self::Init => "init",
            Self::RemoteNode => "remote-node",
            Self::KubeApiserver => "kube-apiserver",
        }
    }

    /// Its label, `reserved:<name>`.
    ///
    /// ```
    /// use rivet_common::labels::ReservedIdentity;
    ///
    /// assert_eq!(ReservedIdentity::Host.label().to_string(), "reserved:host");
    /// ```
    pub fn label(self) -> Label {
        Label {
            source: LabelSource::Reserved,
            key: Interned::new(self.name()),
            value: Interned::default(),
        }
    }

    /// Its label set: just [`label`](Self::label).
    ///
    /// ```
    /// use rivet_common::labels::ReservedIdentity;
    ///
    /// assert_eq!(ReservedIdentity::from_labels(&ReservedIdentity::Init.labels()), Some(ReservedIdentity::Init));
    /// ```
    pub fn labels(self) -> Labels {
        Labels(Box::new([self.label()]))
    }

    /// The reserved identity of a label set: a set holding exactly one
    /// `reserved` label resolves to it, whatever other labels it holds (like
    /// Cilium's host identity, which carries the node's labels). With no
    /// reserved label, or with two, there is none: the set needs a cluster
    /// identity, or is not a valid identity at all.
    ///
    /// ```
    /// use rivet_common::labels::{Labels, ReservedIdentity};
    ///
    /// let host: Labels = "reserved:host,k8s:node-role=worker".parse()?;
    /// assert_eq!(ReservedIdentity::from_labels(&host), Some(ReservedIdentity::Host));
    /// assert_eq!(ReservedIdentity::from_labels(&"k8s:app=web".parse()?), None);
    /// assert_eq!(ReservedIdentity::from_labels(&"reserved:host,reserved:world".parse()?), None);
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn from_labels(labels: &Labels) -> Option<Self> {
        let mut reserved = labels.iter().filter(|l| l.source == LabelSource::Reserved);
        match (reserved.next(), reserved.next()) {
            (Some(label), None) => label.key.parse().ok(),
            _ => None,
        }
    }
}

impl fmt::Display for ReservedIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReservedIdentity {
    type Err = LabelError;

    /// Parses a name (`host`, not `reserved:host`).
    fn from_str(s: &str) -> Result<Self, LabelError> {
        Self::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| LabelError::UnknownReserved {
                label: label_text(LabelSource::Reserved, s, ""),
                key: s.to_string(),
            })
    }
}

/// One security label, `source:key=value`, always valid (see the module docs
/// for the rules). Fields are private so that no invalid label exists; read
/// them with [`source`](Self::source), [`key`](Self::key) and
/// [`value`](Self::value).
///
/// Parsed with [`FromStr`], printed with [`Display`](fmt::Display)
/// (`source:key` when the value is empty), ordered by source, key, value,
/// serialised as its text.
///
/// ```
/// use rivet_common::labels::{Label, LabelSource};
///
/// let label: Label = "k8s:app.kubernetes.io/name=web".parse()?;
/// assert_eq!(label.source(), LabelSource::K8s);
/// assert_eq!(label.key(), "app.kubernetes.io/name");
/// assert_eq!(label.value(), "web");
/// assert_eq!(label.to_string(), "k8s:app.kubernetes.io/name=web");
///
/// let v6: Label = "cidr:2001:2::/64".parse()?;
/// assert_eq!((v6.source(), v6.key(), v6.value()), (LabelSource::Cidr, "2001:2::/64", ""));
/// assert!("cidr:198.18.0.1/24".parse::<Label>().is_err()); // host bits set
/// # Ok::<(), rivet_common::labels::LabelError>(())
/// ```
///
/// Key and value are [`Interned`]: the labels of every identity of the
/// cluster share one copy of each distinct key and value text.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Label {
    source: LabelSource,
    key: Interned,
    value: Interned,
}

impl Label {
    /// A validated label. A `cidr` key is stored in canonical form.
    ///
    /// ```
    /// use rivet_common::labels::{Label, LabelSource};
    ///
    /// assert_eq!(Label::new(LabelSource::K8s, "app", "web")?.to_string(), "k8s:app=web");
    /// assert_eq!(Label::new(LabelSource::Cidr, "2001:2:0::/48", "")?.key(), "2001:2::/48");
    /// assert!(Label::new(LabelSource::Reserved, "hostt", "").is_err());
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn new(source: LabelSource, key: impl Into<String>, value: impl Into<String>) -> Result<Self, LabelError> {
        let (key, value) = (key.into(), value.into());
        let text = label_text(source, &key, &value);
        Self::validated(&text, source, key, value)
    }

    /// `k8s:io.kubernetes.pod.namespace=<namespace>`, the namespace label of a
    /// pod in `namespace`. The namespace must be a non-empty label value.
    ///
    /// ```
    /// use rivet_common::labels::Label;
    ///
    /// assert_eq!(Label::namespace("kube-system")?.to_string(), "k8s:io.kubernetes.pod.namespace=kube-system");
    /// assert!(Label::namespace("bad namespace").is_err());
    /// assert!(Label::namespace("").is_err());
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn namespace(namespace: &str) -> Result<Self, LabelError> {
        if namespace.is_empty() {
            return Err(LabelError::InvalidValue {
                label: label_text(LabelSource::K8s, POD_NAMESPACE_LABEL, namespace),
                value: String::new(),
                reason: "is empty (a pod's namespace has a name)".into(),
            });
        }
        Self::new(LabelSource::K8s, POD_NAMESPACE_LABEL, namespace)
    }

    /// `k8s:ns.labels/<key>=<value>`, the pod label standing for the
    /// namespace label `key=value`. `key` is checked as a Kubernetes label
    /// key, so it may have a prefix.
    ///
    /// ```
    /// use rivet_common::labels::Label;
    ///
    /// let label = Label::namespace_label("kubernetes.io/metadata.name", "shop")?;
    /// assert_eq!(label.to_string(), "k8s:ns.labels/kubernetes.io/metadata.name=shop");
    /// assert!(Label::namespace_label("", "x").is_err());
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn namespace_label(key: &str, value: &str) -> Result<Self, LabelError> {
        Self::new(LabelSource::K8s, format!("{NAMESPACE_LABELS_PREFIX}{key}"), value)
    }

    /// `cidr:<network>`; host bits of `net` are cleared (a policy ipBlock
    /// `198.18.0.1/24` selects `cidr:198.18.0.0/24`).
    ///
    /// ```
    /// use rivet_common::labels::Label;
    ///
    /// let net = "198.18.0.1/24".parse().unwrap();
    /// assert_eq!(Label::cidr(net).to_string(), "cidr:198.18.0.0/24");
    /// ```
    pub fn cidr(net: IpNet) -> Self {
        Label {
            source: LabelSource::Cidr,
            key: Interned::new(&net.trunc().to_string()),
            value: Interned::default(),
        }
    }

    /// Where the label comes from.
    ///
    /// ```
    /// use rivet_common::labels::{Label, LabelSource};
    ///
    /// assert_eq!("reserved:world".parse::<Label>()?.source(), LabelSource::Reserved);
    /// assert_eq!("app=web".parse::<Label>()?.source(), LabelSource::Unspec);
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn source(&self) -> LabelSource {
        self.source
    }

    /// The key.
    ///
    /// ```
    /// assert_eq!("k8s:app=web".parse::<rivet_common::labels::Label>()?.key(), "app");
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The value; empty for `reserved` and `cidr` labels.
    ///
    /// ```
    /// use rivet_common::labels::Label;
    ///
    /// assert_eq!("k8s:app=web".parse::<Label>()?.value(), "web");
    /// assert_eq!("reserved:host".parse::<Label>()?.value(), "");
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn value(&self) -> &str {
        &self.value
    }

    /// Checks `key` and `value` for `source`; `text` is the label as the
    /// caller wrote it, for errors.
    fn validated(text: &str, source: LabelSource, key: String, value: String) -> Result<Self, LabelError> {
        if key.is_empty() {
            return Err(LabelError::EmptyKey {
                label: text.to_string(),
            });
        }
        match source {
            LabelSource::K8s | LabelSource::Container | LabelSource::Unspec => {
                check_key(text, &key)?;
                check_value(text, &value)?;
                Ok(Label {
                    source,
                    key: Interned::new(&key),
                    value: Interned::new(&value),
                })
            }
            LabelSource::Reserved => {
                check_no_value(text, source, &value)?;
                let reserved: ReservedIdentity = key.parse().map_err(|_| LabelError::UnknownReserved {
                    label: text.to_string(),
                    key: key.clone(),
                })?;
                Ok(reserved.label())
            }
            LabelSource::Cidr => {
                check_no_value(text, source, &value)?;
                let invalid = |reason: String| LabelError::InvalidCidr {
                    label: text.to_string(),
                    key: key.clone(),
                    reason,
                };
                let net: IpNet = key
                    .parse()
                    .map_err(|_| invalid("is not a network address with prefix length (address/length)".into()))?;
                if net.trunc() != net {
                    return Err(invalid(format!("has host bits set (the network is {})", net.trunc())));
                }
                Ok(Label::cidr(net))
            }
        }
    }
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.source, self.key)?;
        if !self.value.is_empty() {
            write!(f, "={}", self.value)?;
        }
        Ok(())
    }
}

impl FromStr for Label {
    type Err = LabelError;

    fn from_str(text: &str) -> Result<Self, LabelError> {
        let colon = text.find(':');
        let (source, rest) = match colon {
            // A ':' after the first '=' is part of the value (and rejected there).
            Some(colon) if text.find('=').is_none_or(|eq| colon < eq) => {
                let name = &text[..colon];
                let source = name.parse().map_err(|_| LabelError::UnknownSource {
                    label: text.to_string(),
                    name: name.to_string(),
                })?;
                (source, &text[colon + 1..])
            }
            _ => (LabelSource::Unspec, text),
        };
        let (key, value) = rest.split_once('=').unwrap_or((rest, ""));
        Self::validated(text, source, key.to_string(), value.to_string())
    }
}

impl Serialize for Label {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Label {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// The text of a label from its parts, for errors before it is valid.
fn label_text(source: LabelSource, key: &str, value: &str) -> String {
    if value.is_empty() {
        format!("{source}:{key}")
    } else {
        format!("{source}:{key}={value}")
    }
}

/// Kubernetes label-key rules ([`k8s_name::check_label_key`]), with
/// `ns.labels/<key>` holding a key.
fn check_key(text: &str, key: &str) -> Result<(), LabelError> {
    let invalid = |reason: String| LabelError::InvalidKey {
        label: text.to_string(),
        key: key.to_string(),
        reason,
    };
    let inner = match key.strip_prefix(NAMESPACE_LABELS_PREFIX) {
        Some("") => {
            return Err(invalid(format!(
                "has an empty namespace label key after {NAMESPACE_LABELS_PREFIX:?}"
            )));
        }
        Some(inner) => inner,
        None => key,
    };
    k8s_name::check_label_key(inner).map_err(|e| invalid(e.to_string()))
}

/// Kubernetes label-value rules ([`k8s_name::check_label_value`]).
fn check_value(text: &str, value: &str) -> Result<(), LabelError> {
    k8s_name::check_label_value(value).map_err(|e| LabelError::InvalidValue {
        label: text.to_string(),
        value: value.to_string(),
        reason: e.to_string(),
    })
}

fn check_no_value(text: &str, source: LabelSource, value: &str) -> Result<(), LabelError> {
    if value.is_empty() {
        return Ok(());
    }
    Err(LabelError::UnexpectedValue {
        label: text.to_string(),
        kind: source,
        value: value.to_string(),
    })
}

/// A sorted, de-duplicated set of valid labels, each key at most once per
/// source: an identity's labels when filtered ([`LabelFilter`]).
///
/// Printed comma-separated in sort order (and parsed back from that form,
/// items may be surrounded by spaces); serialised as a list of label strings.
///
/// ```
/// use rivet_common::labels::{Label, Labels};
///
/// let labels = Labels::parse(["k8s:tier=db", "reserved:host", "k8s:app=web", "k8s:app=web"])?;
/// assert_eq!(labels.to_string(), "k8s:app=web,k8s:tier=db,reserved:host");
/// assert_eq!(labels.len(), 3);
/// assert!(labels.contains(&"k8s:tier=db".parse()?));
/// assert_eq!(labels.get("app").map(Label::value), Some("web"));
///
/// let err = Labels::parse(["k8s:app=web", "k8s:app=db"]).unwrap_err();
/// assert!(err.to_string().contains(r#""k8s:app=web" and "k8s:app=db""#));
/// # Ok::<(), rivet_common::labels::LabelError>(())
/// ```
///
/// Held as one sorted boxed slice (no spare capacity, no tree nodes): a node
/// keeps the labels of every identity of the cluster, and two labels cost
/// 80 bytes here, where a `BTreeSet` of two `String` pairs took a 600-byte
/// node and four allocations.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Labels(Box<[Label]>);

impl Labels {
    /// The empty set.
    ///
    /// ```
    /// assert!(rivet_common::labels::Labels::new().is_empty());
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses a list of labels into a set (duplicates collapse; two values
    /// for one source and key are an error).
    ///
    /// ```
    /// use rivet_common::labels::Labels;
    ///
    /// let labels = Labels::parse(vec!["k8s:app=web".to_string(), "reserved:init".to_string()])?;
    /// assert_eq!(labels.len(), 2);
    /// assert!(Labels::parse(["k8s:"]).is_err());
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn parse<I, S>(items: I) -> Result<Self, LabelError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut labels = Vec::new();
        for item in items {
            insert_sorted(&mut labels, item.as_ref().parse()?)?;
        }
        Ok(Self(labels.into_boxed_slice()))
    }

    /// Collects labels into a set, with the checks of [`insert`](Self::insert).
    ///
    /// ```
    /// use rivet_common::labels::{Labels, ReservedIdentity};
    ///
    /// let labels = Labels::try_from_iter([ReservedIdentity::Host.label(), ReservedIdentity::Host.label()])?;
    /// assert_eq!(labels.to_string(), "reserved:host");
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn try_from_iter(labels: impl IntoIterator<Item = Label>) -> Result<Self, LabelError> {
        let mut set = Vec::new();
        for label in labels {
            insert_sorted(&mut set, label)?;
        }
        Ok(Self(set.into_boxed_slice()))
    }

    /// Labels of one source from `key, value` pairs, such as a pod's
    /// Kubernetes labels.
    ///
    /// ```
    /// use rivet_common::labels::{LabelSource, Labels};
    /// use std::collections::BTreeMap;
    ///
    /// let pod = BTreeMap::from([("app".to_string(), "web".to_string())]);
    /// assert_eq!(Labels::from_pairs(LabelSource::K8s, &pod)?.to_string(), "k8s:app=web");
    /// assert!(Labels::from_pairs(LabelSource::K8s, [("bad key", "x")]).is_err());
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn from_pairs<I, K, V>(source: LabelSource, pairs: I) -> Result<Self, LabelError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut labels = Vec::new();
        for (key, value) in pairs {
            insert_sorted(&mut labels, Label::new(source, key.as_ref(), value.as_ref())?)?;
        }
        Ok(Self(labels.into_boxed_slice()))
    }

    /// Adds a label: `Ok(true)` if it was new, `Ok(false)` if already there,
    /// an error naming both labels if the set holds another value for its
    /// source and key (the set is then unchanged).
    ///
    /// ```
    /// use rivet_common::labels::Labels;
    ///
    /// let mut labels = Labels::new();
    /// assert!(labels.insert("k8s:app=web".parse()?)?);
    /// assert!(!labels.insert("k8s:app=web".parse()?)?);
    /// assert!(labels.insert("k8s:app=db".parse()?).is_err());
    /// assert!(labels.insert("container:app=db".parse()?)?); // another source
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn insert(&mut self, label: Label) -> Result<bool, LabelError> {
        if let Some(existing) = self.get_from(label.source, &label.key) {
            if *existing == label {
                return Ok(false);
            }
            return Err(LabelError::Conflict {
                first: existing.to_string(),
                second: label.to_string(),
            });
        }
        let mut labels = std::mem::take(&mut self.0).into_vec();
        let inserted = insert_sorted(&mut labels, label);
        self.0 = labels.into_boxed_slice();
        inserted
    }

    /// Removes a label; whether it was there.
    ///
    /// ```
    /// use rivet_common::labels::Labels;
    ///
    /// let mut labels: Labels = "k8s:app=web".parse()?;
    /// assert!(labels.remove(&"k8s:app=web".parse()?));
    /// assert!(labels.is_empty());
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn remove(&mut self, label: &Label) -> bool {
        let Ok(at) = self.0.binary_search(label) else {
            return false;
        };
        let mut labels = std::mem::take(&mut self.0).into_vec();
        labels.remove(at);
        self.0 = labels.into_boxed_slice();
        true
    }

    /// The labels in sort order.
    ///
    /// ```
    /// use rivet_common::labels::Labels;
    ///
    /// let labels: Labels = "reserved:host,cidr:198.18.0.0/15".parse()?;
    /// let texts: Vec<String> = labels.iter().map(|l| l.to_string()).collect();
    /// assert_eq!(texts, ["cidr:198.18.0.0/15", "reserved:host"]);
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn iter(&self) -> std::slice::Iter<'_, Label> {
        self.0.iter()
    }

    /// Number of labels.
    ///
    /// ```
    /// assert_eq!("k8s:a=1,k8s:b=2".parse::<rivet_common::labels::Labels>()?.len(), 2);
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the set is empty.
    ///
    /// ```
    /// assert!("".parse::<rivet_common::labels::Labels>()?.is_empty());
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the set holds `label` (same source, key and value).
    ///
    /// ```
    /// use rivet_common::labels::Labels;
    ///
    /// let labels: Labels = "k8s:app=web".parse()?;
    /// assert!(labels.contains(&"k8s:app=web".parse()?));
    /// assert!(!labels.contains(&"k8s:app=db".parse()?));
    /// assert!(!labels.contains(&"container:app=web".parse()?));
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn contains(&self, label: &Label) -> bool {
        self.0.binary_search(label).is_ok()
    }

    /// The label with `key`, of any source; if several sources have the key,
    /// the first in source order (`cidr`, `container`, `k8s`, `reserved`,
    /// `unspec`). Use [`get_from`](Self::get_from) for one source.
    ///
    /// ```
    /// use rivet_common::labels::Labels;
    ///
    /// let labels: Labels = "k8s:app=web,container:app=x".parse()?;
    /// assert_eq!(labels.get("app").unwrap().to_string(), "container:app=x");
    /// assert!(labels.get("tier").is_none());
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn get(&self, key: &str) -> Option<&Label> {
        LabelSource::ALL
            .into_iter()
            .find_map(|source| self.get_from(source, key))
    }

    /// The label of `source` with `key`.
    ///
    /// ```
    /// use rivet_common::labels::{LabelSource, Labels};
    ///
    /// let labels: Labels = "k8s:app=web,container:app=x".parse()?;
    /// assert_eq!(labels.get_from(LabelSource::K8s, "app").unwrap().value(), "web");
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn get_from(&self, source: LabelSource, key: &str) -> Option<&Label> {
        // Labels sort by source, then key: the first label not below
        // (source, key) is the one with them if there is one.
        let at = self.0.partition_point(|l| (l.source, l.key.as_str()) < (source, key));
        self.0
            .get(at)
            .filter(|label| label.source == source && label.key == key)
    }

    /// The pod's namespace (the value of `k8s:io.kubernetes.pod.namespace`).
    ///
    /// ```
    /// use rivet_common::labels::Labels;
    ///
    /// let labels = Labels::new().with_namespace("shop", [("team", "a")])?;
    /// assert_eq!(labels.namespace(), Some("shop"));
    /// assert_eq!(Labels::new().namespace(), None);
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn namespace(&self) -> Option<&str> {
        self.get_from(LabelSource::K8s, POD_NAMESPACE_LABEL).map(Label::value)
    }

    /// These labels plus the namespace labels of DESIGN.md §6:
    /// `k8s:io.kubernetes.pod.namespace=<namespace>` and
    /// `k8s:ns.labels/<key>=<value>` for every namespace label. Labels of
    /// this set (sources k8s, container, unspec) with the key
    /// `io.kubernetes.pod.namespace` or a key starting with `ns.labels/` are
    /// dropped first, so a pod's own labels cannot impersonate them.
    ///
    /// ```
    /// use rivet_common::labels::Labels;
    /// use std::collections::BTreeMap;
    ///
    /// let pod: Labels = "k8s:app=web,k8s:ns.labels/team=admin".parse()?;
    /// let ns = BTreeMap::from([("team".to_string(), "shop".to_string())]);
    /// assert_eq!(
    ///     pod.with_namespace("shop", &ns)?.to_string(),
    ///     "k8s:app=web,k8s:io.kubernetes.pod.namespace=shop,k8s:ns.labels/team=shop"
    /// );
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn with_namespace<I, K, V>(&self, namespace: &str, namespace_labels: I) -> Result<Self, LabelError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut labels: Vec<Label> = self
            .0
            .iter()
            .filter(|label| !is_namespace_key(label))
            .cloned()
            .collect();
        insert_sorted(&mut labels, Label::namespace(namespace)?)?;
        for (key, value) in namespace_labels {
            insert_sorted(&mut labels, Label::namespace_label(key.as_ref(), value.as_ref())?)?;
        }
        Ok(Self(labels.into_boxed_slice()))
    }
}

/// Inserts `label` into sorted, de-duplicated `labels` with the checks of
/// [`Labels::insert`]: `Ok(false)` if it is there, an error naming both if
/// another value of its source and key is.
fn insert_sorted(labels: &mut Vec<Label>, label: Label) -> Result<bool, LabelError> {
    let at = labels.partition_point(|l| (l.source, l.key.as_str()) < (label.source, label.key.as_str()));
    match labels.get(at) {
        Some(existing) if existing.source == label.source && existing.key == label.key => {
            if *existing == label {
                Ok(false)
            } else {
                Err(LabelError::Conflict {
                    first: existing.to_string(),
                    second: label.to_string(),
                })
            }
        }
        _ => {
            labels.insert(at, label);
            Ok(true)
        }
    }
}

/// Whether `label` has a key reserved for namespace labels.
fn is_namespace_key(label: &Label) -> bool {
    label.source.is_text() && (label.key == POD_NAMESPACE_LABEL || label.key.starts_with(NAMESPACE_LABELS_PREFIX))
}

impl fmt::Display for Labels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, label) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{label}")?;
        }
        Ok(())
    }
}

impl FromStr for Labels {
    type Err = LabelError;

    /// Parses a comma-separated list; the empty (or blank) string is the empty set.
    fn from_str(list: &str) -> Result<Self, LabelError> {
        if list.trim().is_empty() {
            return Ok(Self::new());
        }
        let mut labels = Vec::new();
        for item in list.split(',') {
            let item = item.trim();
            if item.is_empty() {
                return Err(LabelError::EmptyItem { list: list.to_string() });
            }
            insert_sorted(&mut labels, item.parse()?)?;
        }
        Ok(Self(labels.into_boxed_slice()))
    }
}

impl<'a> IntoIterator for &'a Labels {
    type Item = &'a Label;
    type IntoIter = std::slice::Iter<'a, Label>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl IntoIterator for Labels {
    type Item = Label;
    type IntoIter = std::vec::IntoIter<Label>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_vec().into_iter()
    }
}

impl Serialize for Labels {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter())
    }
}

impl<'de> Deserialize<'de> for Labels {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let labels = Vec::<Label>::deserialize(deserializer)?;
        Self::try_from_iter(labels).map_err(serde::de::Error::custom)
    }
}

/// One filter rule: `[!][source:]key-prefix`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    exclude: bool,
    source: Option<LabelSource>,
    prefix: String,
}

impl Rule {
    fn parse(text: &str) -> Result<Self, LabelError> {
        let invalid = |reason: &str| LabelError::InvalidFilter {
            rule: text.to_string(),
            reason: reason.to_string(),
        };
        let trimmed = text.trim();
        let (exclude, rest) = match trimmed.strip_prefix('!') {
            Some(rest) => (true, rest),
            None => (false, trimmed),
        };
        if rest.is_empty() {
            return Err(invalid("empty rule (expected [!][source:]key-prefix)"));
        }
        let (source, prefix) = match rest.split_once(':') {
            Some((name, prefix)) => {
                let source = name.parse::<LabelSource>().map_err(|_| LabelError::InvalidFilter {
                    rule: text.to_string(),
                    reason: format!(
                        "unknown source {name:?} (expected one of container, k8s, unspec, or no source for any)"
                    ),
                })?;
                if !source.is_text() {
                    return Err(invalid("reserved and cidr labels are never filtered"));
                }
                (Some(source), prefix)
            }
            None => (None, rest),
        };
        if !prefix
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.' | b'/'))
        {
            return Err(invalid(
                "the key prefix may hold only alphanumerics, '-', '_', '.' and '/' (the characters of label keys)",
            ));
        }
        Ok(Rule {
            exclude,
            source,
            prefix: prefix.to_string(),
        })
    }

    fn matches(&self, label: &Label) -> bool {
        self.source.is_none_or(|source| source == label.source) && label.key.starts_with(&self.prefix)
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.exclude {
            f.write_str("!")?;
        }
        if let Some(source) = self.source {
            write!(f, "{source}:")?;
        }
        f.write_str(&self.prefix)
    }
}

/// Keeps the identity-relevant labels of a set (see the module docs for the
/// rules and their `[!][source:]key-prefix` syntax).
///
/// [`LabelFilter::default`] drops [`DEFAULT_EXCLUDES`];
/// [`LabelFilter::parse`] adds configured rules to those;
/// [`LabelFilter::from_rules`] uses only the given rules.
/// Printed as its rules, comma-separated.
///
/// ```
/// use rivet_common::labels::{LabelFilter, Labels};
///
/// let filter = LabelFilter::parse(&["k8s:app", "!k8s:app.kubernetes.io/instance"])?;
/// let pod: Labels = "k8s:app=web,k8s:app.kubernetes.io/instance=web-1,k8s:tier=db,reserved:host".parse()?;
/// assert_eq!(filter.filter(&pod).to_string(), "k8s:app=web,reserved:host");
/// # Ok::<(), rivet_common::labels::LabelError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelFilter {
    rules: Vec<Rule>,
}

impl Default for LabelFilter {
    /// The default filter: excludes [`DEFAULT_EXCLUDES`] of any source.
    fn default() -> Self {
        let rules = DEFAULT_EXCLUDES
            .iter()
            .map(|prefix| Rule {
                exclude: true,
                source: None,
                prefix: prefix.to_string(),
            })
            .collect();
        Self { rules }
    }
}

impl LabelFilter {
    /// The default filter plus `rules` (flag values, one rule each).
    ///
    /// ```
    /// use rivet_common::labels::{LabelFilter, Labels};
    ///
    /// let filter = LabelFilter::parse(&["!k8s:version"])?;
    /// let pod: Labels = "k8s:app=web,k8s:version=3,k8s:pod-template-hash=x".parse()?;
    /// assert_eq!(filter.filter(&pod).to_string(), "k8s:app=web");
    /// assert!(LabelFilter::parse(&["reserved:host"]).is_err());
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn parse<I, S>(rules: I) -> Result<Self, LabelError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut filter = Self::default();
        filter.add_rules(rules)?;
        Ok(filter)
    }

    /// Only `rules`, without the defaults (`from_rules::<_, &str>([])` keeps
    /// every label).
    ///
    /// ```
    /// use rivet_common::labels::{LabelFilter, Labels};
    ///
    /// let pod: Labels = "k8s:app=web,k8s:pod-template-hash=x".parse()?;
    /// assert_eq!(LabelFilter::from_rules::<_, &str>([])?.filter(&pod), pod);
    /// assert_eq!(LabelFilter::from_rules(["!k8s:app"])?.filter(&pod).to_string(), "k8s:pod-template-hash=x");
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn from_rules<I, S>(rules: I) -> Result<Self, LabelError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut filter = Self { rules: Vec::new() };
        filter.add_rules(rules)?;
        Ok(filter)
    }

    fn add_rules<I, S>(&mut self, rules: I) -> Result<(), LabelError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        for rule in rules {
            self.rules.push(Rule::parse(rule.as_ref())?);
        }
        Ok(())
    }

    /// Whether `label` is identity-relevant under this filter.
    ///
    /// ```
    /// use rivet_common::labels::{Label, LabelFilter};
    ///
    /// let filter = LabelFilter::parse(&["k8s:app"])?;
    /// assert!(filter.keeps(&"k8s:app=web".parse()?));
    /// assert!(!filter.keeps(&"k8s:tier=db".parse()?));
    /// assert!(filter.keeps(&"reserved:world".parse()?));
    /// assert!(filter.keeps(&Label::namespace("shop")?));
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn keeps(&self, label: &Label) -> bool {
        if !label.source.is_text() || (label.source == LabelSource::K8s && label.key == POD_NAMESPACE_LABEL) {
            return true;
        }
        if self.rules.iter().any(|rule| rule.exclude && rule.matches(label)) {
            return false;
        }
        let mut includes = self.rules.iter().filter(|rule| !rule.exclude).peekable();
        if includes.peek().is_none() {
            return true;
        }
        (label.source == LabelSource::K8s && label.key.starts_with(NAMESPACE_LABELS_PREFIX))
            || includes.any(|rule| rule.matches(label))
    }

    /// The labels of `labels` this filter keeps.
    ///
    /// ```
    /// use rivet_common::labels::{LabelFilter, Labels};
    ///
    /// let pod: Labels = "k8s:app=web,k8s:controller-revision-hash=7f,reserved:init".parse()?;
    /// assert_eq!(LabelFilter::default().filter(&pod).to_string(), "k8s:app=web,reserved:init");
    /// # Ok::<(), rivet_common::labels::LabelError>(())
    /// ```
    pub fn filter(&self, labels: &Labels) -> Labels {
        Labels(labels.iter().filter(|label| self.keeps(label)).cloned().collect())
    }
}

impl fmt::Display for LabelFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, rule) in self.rules.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{rule}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn label(text: &str) -> Label {
        text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn labels(text: &str) -> Labels {
        text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn parse_err(text: &str) -> LabelError {
        match text.parse::<Label>() {
            Ok(l) => panic!("{text:?} parsed as {l:?}"),
            Err(e) => {
                // Every message names the label as written.
                assert!(
                    e.to_string().contains(&format!("{text:?}")),
                    "{e} does not name {text:?}"
                );
                e
            }
        }
    }

    #[test]
    fn labels_parse_sources() {
        for (text, source, key, value) in [
            ("k8s:app=web", LabelSource::K8s, "app", "web"),
            ("container:app=web", LabelSource::Container, "app", "web"),
            ("unspec:app=web", LabelSource::Unspec, "app", "web"),
            ("reserved:host", LabelSource::Reserved, "host", ""),
            ("reserved:host=", LabelSource::Reserved, "host", ""),
            ("cidr:198.18.0.0/24", LabelSource::Cidr, "198.18.0.0/24", ""),
            ("cidr:2001:2::/64", LabelSource::Cidr, "2001:2::/64", ""),
            ("k8s:app", LabelSource::K8s, "app", ""),
            ("k8s:app=", LabelSource::K8s, "app", ""),
            // No source: unspec, as in Cilium.
            ("app=web", LabelSource::Unspec, "app", "web"),
            ("app", LabelSource::Unspec, "app", ""),
        ] {
            let l = label(text);
            assert_eq!((l.source(), l.key(), l.value()), (source, key, value), "{text}");
            assert_eq!(Label::new(source, key, value).unwrap(), l, "{text}");
        }
    }

    #[test]
    fn label_sets_share_their_key_and_value_texts() {
        let a = labels("k8s:app=web,k8s:io.kubernetes.pod.namespace=shop");
        let b: Labels = serde_json::from_str(r#"["k8s:io.kubernetes.pod.namespace=shop","k8s:app=db"]"#).unwrap();
        let (a_ns, b_ns) = (a.namespace().unwrap(), b.namespace().unwrap());
        // One allocation for "shop", whichever way each set was made.
        assert_eq!(a_ns.as_ptr(), b_ns.as_ptr());
        assert_eq!(
            a.get("app").unwrap().key().as_ptr(),
            b.get("app").unwrap().key().as_ptr()
        );
        assert_ne!(
            a.get("app").unwrap().value().as_ptr(),
            b.get("app").unwrap().value().as_ptr()
        );
    }

    #[test]
    fn label_sets_round_trip_through_every_form() {
        let text = "cidr:198.18.0.0/15,container:c=1,k8s:app=web,k8s:io.kubernetes.pod.namespace=shop,reserved:host";
        let set = labels(text);
        assert_eq!(set.to_string(), text);
        let json = serde_json::to_string(&set).unwrap();
        assert_eq!(serde_json::from_str::<Labels>(&json).unwrap(), set);
        let items: Vec<String> = set.iter().map(ToString::to_string).collect();
        assert_eq!(Labels::parse(&items).unwrap(), set);
        // Built in any order, by insert or from an iterator: the same sorted set.
        let mut reversed = Labels::new();
        for label in set.clone().into_iter().rev() {
            assert!(reversed.insert(label).unwrap());
        }
        assert_eq!(reversed, set);
        assert_eq!(Labels::try_from_iter(set.iter().rev().cloned()).unwrap(), set);
        for label in &set {
            assert!(reversed.contains(label));
            assert_eq!(set.get_from(label.source(), label.key()), Some(label));
            assert!(reversed.remove(label));
            assert!(!reversed.contains(label));
        }
        assert!(reversed.is_empty());
    }

    #[test]
    fn labels_display() {
        assert_eq!(label("k8s:app=web").to_string(), "k8s:app=web");
        assert_eq!(label("k8s:app=").to_string(), "k8s:app");
        assert_eq!(label("reserved:host").to_string(), "reserved:host");
        assert_eq!(label("app=web").to_string(), "unspec:app=web");
        assert_eq!(label("cidr:2001:0002:0000::/64").to_string(), "cidr:2001:2::/64");
        assert_eq!(label("k8s:app"), label("k8s:app="));
    }

    #[test]
    fn labels_source_names() {
        for source in LabelSource::ALL {
            assert_eq!(source.as_str().parse::<LabelSource>().unwrap(), source);
            assert_eq!(source.to_string(), source.as_str());
        }
        for bad in ["", "K8S", "k8s ", "any", "docker", "$"] {
            let err = bad.parse::<LabelSource>().unwrap_err();
            assert!(
                matches!(&err, LabelError::UnknownSource { name, .. } if name == bad),
                "{err}"
            );
        }
        let mut sorted = LabelSource::ALL;
        sorted.sort_by_key(|s| s.as_str());
        assert_eq!(sorted, LabelSource::ALL, "sources sort by name");
        assert_eq!(serde_json::to_string(&LabelSource::K8s).unwrap(), r#""k8s""#);
        assert_eq!(
            serde_json::from_str::<LabelSource>(r#""cidr""#).unwrap(),
            LabelSource::Cidr
        );
        assert!(serde_json::from_str::<LabelSource>(r#""foo""#).is_err());
    }

    #[test]
    fn labels_unknown_source() {
        for (text, name) in [
            ("foo:app=web", "foo"),
            ("K8s:app=web", "K8s"),
            (":app=web", ""),
            ("any:app", "any"),
            ("$host:x", "$host"),
        ] {
            let err = parse_err(text);
            assert!(
                matches!(&err, LabelError::UnknownSource { name: n, .. } if n == name),
                "{err}"
            );
            assert!(err.to_string().contains(&format!("unknown source {name:?}")), "{err}");
        }
        // A ':' after '=' belongs to the value, which rejects it.
        assert!(matches!(parse_err("app=a:b"), LabelError::InvalidValue { .. }));
    }

    #[test]
    fn labels_empty_key() {
        for text in ["", "k8s:", "k8s:=web", "=web", "reserved:", "cidr:", "container:="] {
            assert!(matches!(parse_err(text), LabelError::EmptyKey { .. }), "{text}");
        }
        assert!(matches!(
            Label::new(LabelSource::K8s, "", "x"),
            Err(LabelError::EmptyKey { .. })
        ));
    }

    #[test]
    fn labels_valid_keys() {
        let name63 = format!("a{}z", "-_.x".repeat(15)) + "9";
        assert_eq!(name63.len(), 63);
        let prefix253 = ["a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61)].join(".");
        assert_eq!(prefix253.len(), 253);
        for key in [
            "a",
            "A",
            "0",
            "app",
            "App_Name.v2",
            "a-b",
            "a_b",
            "a.b",
            "a..b",
            "a--b",
            "example.com/app",
            "app.kubernetes.io/name",
            "a/b",
            "0.0/X",
            "my-domain.io/My_Key.2",
            "a-1.b-2/c",
            &name63,
            &format!("{prefix253}/{name63}"),
            "ns.labels/team",
            "ns.labels/kubernetes.io/metadata.name",
            &format!("ns.labels/{prefix253}/{name63}"),
            "io.kubernetes.pod.namespace",
        ] {
            for source in [LabelSource::K8s, LabelSource::Container, LabelSource::Unspec] {
                let l = Label::new(source, key, "v").unwrap_or_else(|e| panic!("{key}: {e}"));
                assert_eq!(label(&l.to_string()), l);
            }
        }
    }

    #[test]
    fn labels_invalid_keys() {
        let name64 = "a".repeat(64);
        let prefix254 = ["a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(62)].join(".");
        assert_eq!(prefix254.len(), 254);
        for (key, why) in [
            ("-app", "not alphanumerics"),
            ("app-", "not alphanumerics"),
            ("_app", "not alphanumerics"),
            ("app.", "not alphanumerics"),
            (".app", "not alphanumerics"),
            ("a b", "not alphanumerics"),
            ("a:b", "not alphanumerics"),
            ("a,b", "not alphanumerics"),
            ("a\tb", "not alphanumerics"),
            ("äpp", "not alphanumerics"),
            ("a*b", "not alphanumerics"),
            ("/app", "empty prefix"),
            ("example.com/", "empty name"),
            ("a/b/c", "more than one '/'"),
            ("Example.com/app", "not a DNS subdomain"),
            ("exa_mple.com/app", "not a DNS subdomain"),
            ("-example.com/app", "not a DNS subdomain"),
            ("example.com-/app", "not a DNS subdomain"),
            ("example..com/app", "not a DNS subdomain"),
            (".example.com/app", "not a DNS subdomain"),
            ("example.com./app", "not a DNS subdomain"),
            ("example.-com/app", "not a DNS subdomain"),
            ("example.com/-app", "not alphanumerics"),
            (&name64, "64 characters (at most 63)"),
            (&format!("example.com/{name64}"), "64 characters (at most 63)"),
            (&format!("{prefix254}/app"), "254 characters (at most 253)"),
            ("ns.labels/", "empty namespace label key"),
            ("ns.labels//x", "empty prefix"),
            ("ns.labels/a/b/c", "more than one '/'"),
            (&format!("ns.labels/{name64}"), "64 characters (at most 63)"),
        ] {
            for source in [LabelSource::K8s, LabelSource::Container, LabelSource::Unspec] {
                let text = format!("{source}:{key}=v");
                let err = parse_err(&text);
                assert!(
                    matches!(&err, LabelError::InvalidKey { key: k, .. } if k == key),
                    "{text}: {err}"
                );
                assert!(err.to_string().contains(why), "{text}: {err} (expected {why:?})");
                assert_eq!(Label::new(source, key, "v").unwrap_err(), err);
            }
        }
    }

    #[test]
    fn labels_values() {
        let value63 = format!("A{}", "b-_.c".repeat(12)) + "Z";
        assert_eq!(value63.len(), 62);
        let value63 = value63 + "9";
        for value in ["", "a", "Z", "9", "web", "v1.2.3", "a-b_c.d", "UPPER", &value63] {
            let l = Label::new(LabelSource::K8s, "app", value).unwrap_or_else(|e| panic!("{value}: {e}"));
            assert_eq!(l.value(), value);
        }
        let value64 = "v".repeat(64);
        for (value, why) in [
            ("-web", "must be empty or alphanumerics"),
            ("web-", "must be empty or alphanumerics"),
            (".web", "must be empty or alphanumerics"),
            ("web_", "must be empty or alphanumerics"),
            ("we b", "must be empty or alphanumerics"),
            ("a/b", "must be empty or alphanumerics"),
            ("a=b", "must be empty or alphanumerics"),
            ("a:b", "must be empty or alphanumerics"),
            ("a,b", "must be empty or alphanumerics"),
            ("é", "must be empty or alphanumerics"),
            (&value64, "64 characters long (at most 63)"),
        ] {
            for source in [LabelSource::K8s, LabelSource::Container, LabelSource::Unspec] {
                let text = format!("{source}:app={value}");
                let err = parse_err(&text);
                assert!(
                    matches!(&err, LabelError::InvalidValue { value: v, .. } if v == value),
                    "{text}: {err}"
                );
                assert!(err.to_string().contains(why), "{text}: {err}");
            }
        }
    }

    #[test]
    fn labels_reserved() {
        for r in ReservedIdentity::ALL {
            let text = format!("reserved:{}", r.name());
            assert_eq!(label(&text), r.label());
            assert_eq!(r.label().to_string(), text);
            assert_eq!(r.name().parse::<ReservedIdentity>().unwrap(), r);
            assert_eq!(ReservedIdentity::from_id(r.id()), Some(r));
            assert_eq!(ReservedIdentity::from_labels(&r.labels()), Some(r));
        }
        let ids: Vec<_> = ReservedIdentity::ALL.iter().map(|r| (r.name(), r.id())).collect();
        assert_eq!(
            ids,
            [
                ("host", 1),
                ("world", 2),
                ("unmanaged", 3),
                ("health", 4),
                ("init", 5),
                ("remote-node", 6),
                ("kube-apiserver", 7)
            ]
        );
        assert_eq!(ReservedIdentity::from_id(0), None);
        assert_eq!(ReservedIdentity::from_id(8), None);
        for text in [
            "reserved:Host",
            "reserved:hosts",
            "reserved:cluster",
            "reserved:remote_node",
            "reserved:a/b",
        ] {
            let err = parse_err(text);
            assert!(matches!(err, LabelError::UnknownReserved { .. }), "{text}: {err}");
            assert!(err.to_string().contains("expected one of host, world"), "{err}");
        }
        let err = parse_err("reserved:host=yes");
        assert!(
            matches!(&err, LabelError::UnexpectedValue { kind: LabelSource::Reserved, value, .. } if value == "yes"),
            "{err}"
        );
        assert!(err.to_string().contains("reserved labels have no value"), "{err}");
        let err = "nope".parse::<ReservedIdentity>().unwrap_err();
        assert!(err.to_string().contains(r#""reserved:nope""#), "{err}");
    }

    #[test]
    fn labels_reserved_from_labels() {
        use ReservedIdentity::*;
        for (set, want) in [
            ("reserved:host", Some(Host)),
            ("reserved:kube-apiserver", Some(KubeApiserver)),
            ("reserved:host,k8s:node.kubernetes.io/role=worker", Some(Host)),
            ("reserved:health,cidr:198.18.0.0/15", Some(Health)),
            ("", None),
            ("k8s:app=web", None),
            ("cidr:198.18.0.0/15", None),
            ("reserved:host,reserved:kube-apiserver", None),
            ("reserved:world,reserved:init,k8s:app=x", None),
        ] {
            assert_eq!(ReservedIdentity::from_labels(&labels(set)), want, "{set}");
        }
    }

    #[test]
    fn labels_cidr() {
        for (text, key) in [
            ("cidr:198.18.0.0/24", "198.18.0.0/24"),
            ("cidr:198.18.0.0/15", "198.18.0.0/15"),
            ("cidr:0.0.0.0/0", "0.0.0.0/0"),
            ("cidr:198.18.0.1/32", "198.18.0.1/32"),
            ("cidr:2001:2::/64", "2001:2::/64"),
            ("cidr:2001:2::/48", "2001:2::/48"),
            ("cidr:::/0", "::/0"),
            ("cidr:2001:2::1/128", "2001:2::1/128"),
            ("cidr:2001:0002:0000:0000::/64", "2001:2::/64"),
            ("cidr:2001:2:0:0:0:0:0:0/64", "2001:2::/64"),
            ("cidr:2001:DB8::/32", "2001:db8::/32"),
        ] {
            let l = label(text);
            assert_eq!((l.source(), l.key(), l.value()), (LabelSource::Cidr, key, ""), "{text}");
            assert_eq!(label(&l.to_string()), l);
        }
        for (text, why) in [
            ("cidr:198.18.0.1/24", "host bits set (the network is 198.18.0.0/24)"),
            ("cidr:198.19.0.0/15", "host bits set (the network is 198.18.0.0/15)"),
            ("cidr:10.0.0.1/0", "host bits set (the network is 0.0.0.0/0)"),
            ("cidr:2001:2::1/64", "host bits set (the network is 2001:2::/64)"),
            ("cidr:2001:2:1::/47", "host bits set (the network is 2001:2::/47)"),
            ("cidr:198.18.0.0", "not a network address"),
            ("cidr:2001:2::", "not a network address"),
            ("cidr:198.18.0.0/33", "not a network address"),
            ("cidr:2001:2::/129", "not a network address"),
            ("cidr:198.18.0/24", "not a network address"),
            ("cidr:198.18.0.0/", "not a network address"),
            ("cidr:web", "not a network address"),
            ("cidr:2001-2--/64", "not a network address"),
            ("cidr: 198.18.0.0/24", "not a network address"),
        ] {
            let err = parse_err(text);
            assert!(matches!(err, LabelError::InvalidCidr { .. }), "{text}: {err}");
            assert!(err.to_string().contains(why), "{text}: {err}");
        }
        let err = parse_err("cidr:198.18.0.0/24=x");
        assert!(
            matches!(
                err,
                LabelError::UnexpectedValue {
                    kind: LabelSource::Cidr,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("cidr labels have no value"), "{err}");
        assert_eq!(Label::cidr("2001:2::5/48".parse().unwrap()), label("cidr:2001:2::/48"));
        assert_eq!(
            Label::cidr("198.18.7.7/15".parse().unwrap()),
            label("cidr:198.18.0.0/15")
        );
    }

    #[test]
    fn labels_error_messages() {
        assert_eq!(
            parse_err("k8s:app=we b").to_string(),
            r#"invalid label "k8s:app=we b": value "we b" must be empty or alphanumerics, '-', '_' and '.', starting and ending with an alphanumeric"#
        );
        assert_eq!(
            parse_err("k8s:a/b/c").to_string(),
            r#"invalid label "k8s:a/b/c": key "a/b/c" has more than one '/' (a key is [prefix/]name)"#
        );
        assert_eq!(
            parse_err("foo:x").to_string(),
            r#"invalid label "foo:x": unknown source "foo" (expected one of cidr, container, k8s, reserved, unspec)"#
        );
        assert_eq!(parse_err("k8s:").to_string(), r#"invalid label "k8s:": empty key"#);
        assert_eq!(
            parse_err("cidr:198.18.0.1/24").to_string(),
            r#"invalid label "cidr:198.18.0.1/24": "198.18.0.1/24" has host bits set (the network is 198.18.0.0/24)"#
        );
        let err = Label::new(LabelSource::K8s, "a b", "c").unwrap_err();
        assert!(
            err.to_string().starts_with(r#"invalid label "k8s:a b=c": key "a b""#),
            "{err}"
        );
    }

    #[test]
    fn labels_ordering() {
        let mut all = vec![
            label("unspec:a=1"),
            label("reserved:world"),
            label("reserved:host"),
            label("k8s:b=1"),
            label("k8s:a=2"),
            label("k8s:a=1"),
            label("k8s:a"),
            label("container:z=9"),
            label("cidr:198.18.0.0/15"),
            label("cidr:2001:2::/48"),
        ];
        all.sort();
        let texts: Vec<String> = all.iter().map(Label::to_string).collect();
        assert_eq!(
            texts,
            [
                "cidr:198.18.0.0/15",
                "cidr:2001:2::/48",
                "container:z=9",
                "k8s:a",
                "k8s:a=1",
                "k8s:a=2",
                "k8s:b=1",
                "reserved:host",
                "reserved:world",
                "unspec:a=1",
            ]
        );
    }

    #[test]
    fn labels_set_sorted_and_deduplicated() {
        let set = Labels::parse([
            "unspec:x",
            "k8s:b=2",
            "reserved:host",
            "k8s:a=1",
            "k8s:b=2",
            "cidr:10.0.0.0/8",
        ])
        .unwrap();
        assert_eq!(set.len(), 5);
        assert_eq!(
            set.to_string(),
            "cidr:10.0.0.0/8,k8s:a=1,k8s:b=2,reserved:host,unspec:x"
        );
        let order: Vec<&Label> = set.iter().collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]));
        assert_eq!((&set).into_iter().count(), 5);
        assert_eq!(set.clone().into_iter().collect::<Vec<_>>().len(), 5);
        // The same label written two ways is one label.
        let set = Labels::parse(["k8s:a", "k8s:a=", "cidr:2001:2:0::/48", "cidr:2001:2::/48"]).unwrap();
        assert_eq!(set.to_string(), "cidr:2001:2::/48,k8s:a");
        // Sets compare and hash by content, whatever the input order.
        assert_eq!(labels("k8s:a=1,k8s:b=2"), labels("k8s:b=2 , k8s:a=1"));
        use std::hash::{BuildHasher, RandomState};
        let state = RandomState::new();
        assert_eq!(
            state.hash_one(labels("k8s:a=1,reserved:host")),
            state.hash_one(labels("reserved:host,k8s:a=1,k8s:a=1"))
        );
    }

    #[test]
    fn labels_duplicate_key_conflict() {
        let err = Labels::parse(["k8s:app=web", "k8s:app=db"]).unwrap_err();
        assert_eq!(
            err,
            LabelError::Conflict {
                first: "k8s:app=web".into(),
                second: "k8s:app=db".into()
            }
        );
        assert!(err.to_string().contains(r#""k8s:app=web" and "k8s:app=db""#), "{err}");
        // Empty and non-empty values conflict too.
        assert!(matches!(
            Labels::parse(["k8s:app", "k8s:app=x"]),
            Err(LabelError::Conflict { .. })
        ));
        // The same key under two sources is fine.
        let set = Labels::parse(["k8s:app=web", "container:app=db", "unspec:app=x"]).unwrap();
        assert_eq!(set.len(), 3);
        // A failed insert leaves the set unchanged.
        let mut set = labels("k8s:app=web");
        assert!(set.insert(label("k8s:app=db")).is_err());
        assert_eq!(set, labels("k8s:app=web"));
        assert!(matches!(
            "k8s:a=1,k8s:a=2".parse::<Labels>(),
            Err(LabelError::Conflict { .. })
        ));
        assert!(Labels::try_from_iter([label("k8s:a=1"), label("k8s:a=2")]).is_err());
        assert!(Labels::from_pairs(LabelSource::K8s, [("a", "1"), ("a", "2")]).is_err());
    }

    #[test]
    fn labels_set_lookup() {
        let set = labels("k8s:app=web,container:app=c,unspec:tier=db,reserved:host,cidr:10.0.0.0/8");
        assert_eq!(set.get("app"), Some(&label("container:app=c")));
        assert_eq!(set.get_from(LabelSource::K8s, "app"), Some(&label("k8s:app=web")));
        assert_eq!(set.get_from(LabelSource::Unspec, "app"), None);
        assert_eq!(set.get("tier"), Some(&label("unspec:tier=db")));
        assert_eq!(set.get("host"), Some(&label("reserved:host")));
        assert_eq!(set.get("10.0.0.0/8"), Some(&label("cidr:10.0.0.0/8")));
        assert_eq!(set.get("ap"), None);
        assert_eq!(set.get("apps"), None);
        assert!(set.contains(&label("k8s:app=web")));
        assert!(!set.contains(&label("k8s:app=db")));
        assert!(!set.contains(&label("k8s:app")));
        let mut set = set;
        assert!(set.remove(&label("k8s:app=web")));
        assert!(!set.remove(&label("k8s:app=web")));
        assert_eq!(set.get_from(LabelSource::K8s, "app"), None);
        // After the remove, another value is accepted.
        assert!(set.insert(label("k8s:app=db")).unwrap());
    }

    #[test]
    fn labels_list_parse() {
        assert_eq!("".parse::<Labels>().unwrap(), Labels::new());
        assert_eq!("  ".parse::<Labels>().unwrap(), Labels::new());
        assert_eq!(Labels::new().to_string(), "");
        for list in ["k8s:a=1,", ",k8s:a=1", "k8s:a=1,,k8s:b=2", "k8s:a=1, ,k8s:b=2"] {
            let err = list.parse::<Labels>().unwrap_err();
            assert_eq!(err, LabelError::EmptyItem { list: list.into() });
            assert!(err.to_string().contains(&format!("{list:?}")));
        }
        let err = "k8s:a=1,k8s:b c".parse::<Labels>().unwrap_err();
        assert!(err.to_string().contains(r#""k8s:b c""#), "{err}");
    }

    #[test]
    fn labels_serde_round_trip() {
        let l = label("cidr:2001:2::/64");
        let json = serde_json::to_string(&l).unwrap();
        assert_eq!(json, r#""cidr:2001:2::/64""#);
        assert_eq!(serde_json::from_str::<Label>(&json).unwrap(), l);

        let set = labels("reserved:host,k8s:app=web,k8s:a,cidr:198.18.0.0/15");
        let json = serde_json::to_string(&set).unwrap();
        assert_eq!(json, r#"["cidr:198.18.0.0/15","k8s:a","k8s:app=web","reserved:host"]"#);
        assert_eq!(serde_json::from_str::<Labels>(&json).unwrap(), set);
        // Unsorted and duplicated input is accepted and normalised.
        let set2: Labels = serde_json::from_str(r#"["reserved:host","k8s:a=","k8s:app=web","reserved:host"]"#).unwrap();
        assert_eq!(set2.to_string(), "k8s:a,k8s:app=web,reserved:host");

        let err = serde_json::from_str::<Label>(r#""k8s:bad key""#).unwrap_err();
        assert!(err.to_string().contains(r#""k8s:bad key""#), "{err}");
        let err = serde_json::from_str::<Labels>(r#"["k8s:a=1","k8s:a=2"]"#).unwrap_err();
        assert!(err.to_string().contains("conflicting labels"), "{err}");
        assert!(serde_json::from_str::<Labels>(r#""k8s:a=1""#).is_err());
        assert!(serde_json::from_str::<Label>("17").is_err());
    }

    #[test]
    fn labels_namespace() {
        assert_eq!(
            Label::namespace("shop").unwrap().to_string(),
            "k8s:io.kubernetes.pod.namespace=shop"
        );
        let err = Label::namespace("").unwrap_err();
        assert!(matches!(err, LabelError::InvalidValue { .. }), "{err}");
        assert!(
            err.to_string().contains(r#""k8s:io.kubernetes.pod.namespace""#),
            "{err}"
        );
        assert!(Labels::new().with_namespace("", [("a", "b")]).is_err());
        let err = Label::namespace("Bad_NS-").unwrap_err();
        assert!(
            err.to_string().contains(r#""k8s:io.kubernetes.pod.namespace=Bad_NS-""#),
            "{err}"
        );
        assert_eq!(
            Label::namespace_label("team", "a").unwrap().to_string(),
            "k8s:ns.labels/team=a"
        );
        assert_eq!(
            Label::namespace_label("kubernetes.io/metadata.name", "shop")
                .unwrap()
                .to_string(),
            "k8s:ns.labels/kubernetes.io/metadata.name=shop"
        );
        assert_eq!(
            Label::namespace_label("team", "").unwrap().to_string(),
            "k8s:ns.labels/team"
        );
        for (key, value) in [("", "a"), ("a/b/c", "x"), ("bad key", "x"), ("team", "bad value")] {
            let err = Label::namespace_label(key, value).unwrap_err();
            assert!(err.to_string().contains(&format!("k8s:ns.labels/{key}")), "{err}");
        }
        // The name part of a namespace label key may use all 63 characters.
        let long = "n".repeat(63);
        assert_eq!(
            Label::namespace_label(&long, "x").unwrap().key(),
            format!("ns.labels/{long}")
        );
    }

    #[test]
    fn labels_with_namespace() {
        let pod = labels("k8s:app=web,container:x=y,reserved:init");
        let ns = std::collections::HashMap::from([("team", "a"), ("kubernetes.io/metadata.name", "shop")]);
        let got = pod.with_namespace("shop", &ns).unwrap();
        assert_eq!(
            got.to_string(),
            "container:x=y,k8s:app=web,k8s:io.kubernetes.pod.namespace=shop,\
             k8s:ns.labels/kubernetes.io/metadata.name=shop,k8s:ns.labels/team=a,reserved:init"
        );
        assert_eq!(got.namespace(), Some("shop"));
        // Idempotent, and a namespace change replaces the old namespace labels.
        assert_eq!(got.with_namespace("shop", &ns).unwrap(), got);
        let moved = got.with_namespace("other", [("env", "prod")]).unwrap();
        assert_eq!(
            moved.to_string(),
            "container:x=y,k8s:app=web,k8s:io.kubernetes.pod.namespace=other,k8s:ns.labels/env=prod,reserved:init"
        );
        // A pod cannot claim a namespace or namespace labels by itself.
        let sneaky = labels(
            "k8s:io.kubernetes.pod.namespace=kube-system,k8s:ns.labels/team=admin,\
             container:ns.labels/x=y,unspec:io.kubernetes.pod.namespace=z,k8s:app=web",
        );
        assert_eq!(
            sneaky.with_namespace("shop", [("team", "a")]).unwrap().to_string(),
            "k8s:app=web,k8s:io.kubernetes.pod.namespace=shop,k8s:ns.labels/team=a"
        );
        // Labels that merely look alike stay.
        let alike = labels("k8s:io.kubernetes.pod.namespace2=x,k8s:ns.labelsx/y=z");
        assert_eq!(
            alike.with_namespace("shop", Vec::<(&str, &str)>::new()).unwrap().len(),
            3
        );
        // Invalid input names the label.
        let err = pod.with_namespace("shop", [("bad key", "x")]).unwrap_err();
        assert!(err.to_string().contains(r#""k8s:ns.labels/bad key=x""#), "{err}");
        assert!(pod.with_namespace("NOT OK", [("a", "b")]).is_err());
        assert!(pod.with_namespace("shop", [("a", "1"), ("a", "2")]).is_err());
    }

    #[test]
    fn labels_from_pairs() {
        let map = std::collections::BTreeMap::from([("app".to_string(), "web".to_string()), ("x".into(), "".into())]);
        assert_eq!(
            Labels::from_pairs(LabelSource::K8s, &map).unwrap().to_string(),
            "k8s:app=web,k8s:x"
        );
        assert_eq!(
            Labels::from_pairs(LabelSource::Cidr, [("198.18.0.0/15", "")])
                .unwrap()
                .to_string(),
            "cidr:198.18.0.0/15"
        );
        let err = Labels::from_pairs(LabelSource::Container, [("a", "b c")]).unwrap_err();
        assert!(err.to_string().contains(r#""container:a=b c""#), "{err}");
    }

    #[test]
    fn labels_filter_defaults() {
        let pod = labels(
            "k8s:app=web,k8s:pod-template-hash=5d8f9c,k8s:pod-template-generation=3,\
             k8s:controller-revision-hash=7f,k8s:controller-uid=u1,\
             k8s:batch.kubernetes.io/controller-uid=u2,k8s:batch.kubernetes.io/job-name=j,\
             k8s:batch.kubernetes.io/job-completion-index=4,k8s:job-name=j,\
             k8s:statefulset.kubernetes.io/pod-name=db-0,k8s:apps.kubernetes.io/pod-index=0,\
             container:pod-template-hash=x,unspec:job-name=y,k8s:tier=db,reserved:host",
        );
        let filter = LabelFilter::default();
        assert_eq!(filter.filter(&pod).to_string(), "k8s:app=web,k8s:tier=db,reserved:host");
        for key in DEFAULT_EXCLUDES {
            assert!(
                !filter.keeps(&Label::new(LabelSource::K8s, *key, "v").unwrap()),
                "{key}"
            );
        }
        // Namespace labels of those names are not the pod's own.
        let ns = Labels::new()
            .with_namespace("shop", [("pod-template-hash", "x")])
            .unwrap();
        assert_eq!(filter.filter(&ns), ns);
        assert_eq!(LabelFilter::parse::<_, &str>([]).unwrap(), filter);
        assert_eq!(
            filter.to_string(),
            DEFAULT_EXCLUDES
                .iter()
                .map(|k| format!("!{k}"))
                .collect::<Vec<_>>()
                .join(",")
        );
        // No rules: everything stays.
        assert_eq!(LabelFilter::from_rules::<_, &str>([]).unwrap().filter(&pod), pod);
    }

    #[test]
    fn labels_filter_include_exclude() {
        let pod = labels(
            "k8s:app=web,k8s:app.kubernetes.io/name=web,k8s:apple=1,k8s:tier=db,k8s:version=3,\
             container:app=c,container:tier=c,unspec:app=u,k8s:pod-template-hash=x",
        )
        .with_namespace("shop", [("team", "a"), ("env", "prod")])
        .unwrap();

        // Includes: only matching keys (of the rule's source) stay; the
        // namespace labels count as included.
        let filter = LabelFilter::parse(["k8s:app"]).unwrap();
        assert_eq!(
            filter.filter(&pod).to_string(),
            "k8s:app=web,k8s:app.kubernetes.io/name=web,k8s:apple=1,k8s:io.kubernetes.pod.namespace=shop,\
             k8s:ns.labels/env=prod,k8s:ns.labels/team=a"
        );
        // A source-less include matches every source; excludes still win.
        let filter = LabelFilter::parse(["app", "!k8s:app.", "!container:"]).unwrap();
        assert_eq!(
            filter.filter(&pod).to_string(),
            "k8s:app=web,k8s:apple=1,k8s:io.kubernetes.pod.namespace=shop,\
             k8s:ns.labels/env=prod,k8s:ns.labels/team=a,unspec:app=u"
        );
        // Excludes only: everything else stays; namespace labels can be excluded,
        // the namespace itself cannot.
        let filter = LabelFilter::parse(["!k8s:version", "!k8s:ns.labels/env", "!k8s:io.kubernetes"]).unwrap();
        assert_eq!(
            filter.filter(&pod).to_string(),
            "container:app=c,container:tier=c,k8s:app=web,k8s:app.kubernetes.io/name=web,k8s:apple=1,\
             k8s:io.kubernetes.pod.namespace=shop,k8s:ns.labels/team=a,k8s:tier=db,unspec:app=u"
        );
        // An empty prefix with a source matches the whole source.
        let filter = LabelFilter::from_rules(["!k8s:"]).unwrap();
        assert_eq!(
            filter.filter(&pod).to_string(),
            "container:app=c,container:tier=c,k8s:io.kubernetes.pod.namespace=shop,unspec:app=u"
        );
        let filter = LabelFilter::from_rules(["container:"]).unwrap();
        assert_eq!(
            filter.filter(&pod).to_string(),
            "container:app=c,container:tier=c,k8s:io.kubernetes.pod.namespace=shop,\
             k8s:ns.labels/env=prod,k8s:ns.labels/team=a"
        );
        // An include does not bring back a default exclude.
        let filter = LabelFilter::parse(["k8s:pod-template-hash", "k8s:app"]).unwrap();
        assert!(!filter.keeps(&label("k8s:pod-template-hash=x")));
        assert!(filter.keeps(&label("k8s:app=web")));
        // ... unless built without the defaults.
        let filter = LabelFilter::from_rules(["k8s:pod-template-hash"]).unwrap();
        assert!(filter.keeps(&label("k8s:pod-template-hash=x")));
        assert!(!filter.keeps(&label("k8s:app=web")));
        // Rules print back in flag syntax.
        let filter = LabelFilter::from_rules([" k8s:app ", "!container:x", "tier", "!y"]).unwrap();
        assert_eq!(filter.to_string(), "k8s:app,!container:x,tier,!y");
        assert_eq!(LabelFilter::from_rules(filter.to_string().split(',')).unwrap(), filter);
    }

    #[test]
    fn labels_filter_never_filters_reserved_and_cidr() {
        let set = labels("reserved:host,reserved:world,cidr:198.18.0.0/15,cidr:2001:2::/48,k8s:app=web");
        for rules in [
            vec!["k8s:nothing"],
            vec!["!k8s:", "!container:", "!unspec:"],
            vec!["!h", "!w", "!1", "!2", "!198", "!reserved", "!cidr", "!app"],
            vec!["zzz", "!app"],
        ] {
            let filter = LabelFilter::parse(&rules).unwrap();
            let kept = filter.filter(&set);
            for l in set.iter().filter(|l| !l.source().is_text()) {
                assert!(kept.contains(l), "{rules:?} dropped {l}");
            }
            assert!(!kept.contains(&label("k8s:app=web")), "{rules:?}");
            assert!(filter.keeps(&Label::namespace("shop").unwrap()), "{rules:?}");
        }
    }

    #[test]
    fn labels_filter_invalid_rules() {
        for (rule, why) in [
            ("", "empty rule"),
            ("  ", "empty rule"),
            ("!", "empty rule"),
            ("foo:app", r#"unknown source "foo""#),
            ("!any:app", r#"unknown source "any""#),
            ("reserved:host", "never filtered"),
            ("!cidr:10.", "never filtered"),
            ("!k8s:a b", "may hold only"),
            ("k8s:app=web", "may hold only"),
            ("k8s:a:b", "may hold only"),
            ("!!app", "may hold only"),
            ("a*", "may hold only"),
        ] {
            let err = LabelFilter::parse([rule]).unwrap_err();
            assert!(
                matches!(&err, LabelError::InvalidFilter { rule: r, .. } if r == rule),
                "{rule}: {err}"
            );
            assert!(err.to_string().contains(&format!("{rule:?}")), "{err}");
            assert!(err.to_string().contains(why), "{rule}: {err}");
        }
    }

    // ---- property-style: random valid labels round-trip ----

    const ALNUM: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    const LOWER: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

    fn pick(rng: &mut StdRng, set: &[u8]) -> char {
        set[rng.random_range(0..set.len())] as char
    }

    /// A random length in 1..=max, biased to the edges.
    fn len(rng: &mut StdRng, max: usize) -> usize {
        match rng.random_range(0..6) {
            0 => 1,
            1 => max,
            _ => rng.random_range(1..=max),
        }
    }

    fn random_name(rng: &mut StdRng, max: usize) -> String {
        let n = len(rng, max);
        (0..n)
            .map(|i| {
                if i == 0 || i == n - 1 || rng.random_bool(0.6) {
                    pick(rng, ALNUM)
                } else {
                    pick(rng, b"-_.")
                }
            })
            .collect()
    }

    fn random_subdomain(rng: &mut StdRng) -> String {
        let target = len(rng, k8s_name::MAX_DNS_SUBDOMAIN);
        let mut out = String::new();
        while out.len() < target {
            if !out.is_empty() {
                if out.len() + 2 > target {
                    break;
                }
                out.push('.');
            }
            let n = rng.random_range(1..=(target - out.len()).min(70));
            for i in 0..n {
                out.push(if i == 0 || i == n - 1 || rng.random_bool(0.8) {
                    pick(rng, LOWER)
                } else {
                    '-'
                });
            }
        }
        out
    }

    fn random_key(rng: &mut StdRng) -> String {
        let key = if rng.random_bool(0.4) {
            format!(
                "{}/{}",
                random_subdomain(rng),
                random_name(rng, k8s_name::MAX_LABEL_NAME)
            )
        } else {
            random_name(rng, k8s_name::MAX_LABEL_NAME)
        };
        if rng.random_bool(0.1) {
            format!("{NAMESPACE_LABELS_PREFIX}{key}")
        } else {
            key
        }
    }

    fn random_label(rng: &mut StdRng) -> Label {
        let source = LabelSource::ALL[rng.random_range(0..LabelSource::ALL.len())];
        let (key, value) = match source {
            LabelSource::Reserved => (
                ReservedIdentity::ALL[rng.random_range(0..7)].name().to_string(),
                String::new(),
            ),
            LabelSource::Cidr => {
                let net: IpNet = if rng.random_bool(0.5) {
                    ipnet::Ipv4Net::new(rng.random::<u32>().into(), rng.random_range(0..=32))
                        .unwrap()
                        .into()
                } else {
                    ipnet::Ipv6Net::new(rng.random::<u128>().into(), rng.random_range(0..=128))
                        .unwrap()
                        .into()
                };
                (net.trunc().to_string(), String::new())
            }
            _ => {
                let value = if rng.random_bool(0.2) {
                    String::new()
                } else {
                    random_name(rng, k8s_name::MAX_LABEL_NAME)
                };
                (random_key(rng), value)
            }
        };
        Label::new(source, &key, &value).unwrap_or_else(|e| panic!("generated an invalid label: {e}"))
    }

    #[test]
    fn labels_property_round_trip() {
        let mut rng = StdRng::seed_from_u64(0x5eed_1abe1);
        for _ in 0..20_000 {
            let l = random_label(&mut rng);
            let text = l.to_string();
            let back: Label = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(back, l, "{text}");
            assert_eq!(back.to_string(), text);
            let json = serde_json::to_string(&l).unwrap();
            assert_eq!(serde_json::from_str::<Label>(&json).unwrap(), l);
        }
        for _ in 0..2_000 {
            let mut set = Labels::new();
            let mut all = Vec::new();
            for _ in 0..rng.random_range(0..12) {
                let l = random_label(&mut rng);
                all.push(l.clone());
                let _ = set.insert(l); // conflicts (rare) are skipped
            }
            let text = set.to_string();
            assert_eq!(text.parse::<Labels>().unwrap(), set, "{text}");
            let json = serde_json::to_string(&set).unwrap();
            assert_eq!(serde_json::from_str::<Labels>(&json).unwrap(), set);
            let items: Vec<&Label> = set.iter().collect();
            assert!(items.windows(2).all(|w| w[0] < w[1]), "{text}");
            // Shuffled, duplicated input gives the same set.
            let mut again: Vec<Label> = set.iter().cloned().chain(set.iter().cloned()).collect();
            again.reverse();
            assert_eq!(Labels::try_from_iter(again).unwrap(), set);
            assert!(all.iter().all(|l| set.get_from(l.source(), l.key()).is_some()));
        }
    }

    #[test]
    fn labels_property_one_bad_character_is_rejected() {
        let mut rng = StdRng::seed_from_u64(42);
        let bad = [
            ' ', '*', '!', '"', '\'', '@', '#', '$', '%', '&', '(', '+', ';', '<', '|', '~', 'ü', '\n',
        ];
        for _ in 0..5_000 {
            let l = loop {
                let l = random_label(&mut rng);
                if l.source().is_text() && !l.value().is_empty() {
                    break l;
                }
            };
            let c = bad[rng.random_range(0..bad.len())];
            let in_key = rng.random_bool(0.5);
            let target = if in_key { l.key() } else { l.value() };
            let mut chars: Vec<char> = target.chars().collect();
            let at = rng.random_range(0..=chars.len());
            chars.insert(at, c);
            let broken: String = chars.into_iter().collect();
            let result = if in_key {
                Label::new(l.source(), broken.as_str(), l.value())
            } else {
                Label::new(l.source(), l.key(), broken.as_str())
            };
            let err = result.expect_err(&broken);
            assert!(
                matches!(err, LabelError::InvalidKey { .. } | LabelError::InvalidValue { .. }),
                "{broken}: {err}"
            );
        }
    }
}
