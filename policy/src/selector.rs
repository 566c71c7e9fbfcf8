//! Label selectors and peer selectors over identities.
//!
//! A [`LabelSelector`] is the normalised Kubernetes selector: `matchLabels`
//! entries become `In` requirements with one value, values are sorted and
//! deduplicated, requirements sorted. A [`Peer`] is one peer of a rule with
//! the policy's namespace already folded in, so equal peers of different
//! policies are one key of the selector cache.

use std::net::IpAddr;

use ipnet::IpNet;
use rivet_common::labels::{LabelSource, Labels, NAMESPACE_LABELS_PREFIX, POD_NAMESPACE_LABEL, ReservedIdentity};
use serde::Serialize;

/// Operator of a selector requirement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub(crate) enum Operator {
    /// The key has one of the values.
    In,
    /// The key has none of the values (or is absent).
    NotIn,
    /// The key is present.
    Exists,
    /// The key is absent.
    DoesNotExist,
}

impl Operator {
    pub(crate) fn parse(text: &str) -> Option<Self> {
        match text {
            "In" => Some(Self::In),
            "NotIn" => Some(Self::NotIn),
            "Exists" => Some(Self::Exists),
            "DoesNotExist" => Some(Self::DoesNotExist),
            _ => None,
        }
    }

    /// Whether the operator takes values (In, NotIn) or none (Exists, DoesNotExist).
    pub(crate) fn takes_values(self) -> bool {
        matches!(self, Self::In | Self::NotIn)
    }
}

/// One requirement: `key operator values`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub(crate) struct Requirement {
    pub(crate) key: String,
    pub(crate) operator: Operator,
    /// Sorted and unique; empty for Exists and DoesNotExist.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) values: Vec<String>,
}

impl Requirement {
    /// Whether the requirement holds for a key with these values (none when
    /// the key is absent; several when sources disagree).
    fn matches<'a>(&self, mut values: impl Iterator<Item = &'a str>) -> bool {
        let listed = |v: &str| self.values.binary_search_by(|x| x.as_str().cmp(v)).is_ok();
        match self.operator {
            Operator::In => values.any(listed),
            Operator::NotIn => !values.any(listed),
            Operator::Exists => values.next().is_some(),
            Operator::DoesNotExist => values.next().is_none(),
        }
    }
}

/// A normalised label selector; empty matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub(crate) struct LabelSelector {
    #[serde(rename = "matchExpressions")]
    requirements: Vec<Requirement>,
}

impl LabelSelector {
    /// A selector from requirements (sorted and deduplicated here; values
    /// must already be sorted and unique).
    pub(crate) fn new(mut requirements: Vec<Requirement>) -> Self {
        requirements.sort();
        requirements.dedup();
        Self { requirements }
    }

    /// Whether an identity's pod labels match (keys of source k8s,
    /// container or unspec; the namespace keys are never pod labels).
    pub(crate) fn matches_pod(&self, labels: &Labels) -> bool {
        self.requirements.iter().all(|r| r.matches(pod_values(labels, &r.key)))
    }

    /// Whether an identity's namespace labels (`k8s:ns.labels/<key>`) match.
    pub(crate) fn matches_namespace(&self, labels: &Labels) -> bool {
        self.requirements
            .iter()
            .all(|r| r.matches(namespace_values(labels, &r.key)))
    }
}

/// Values of a pod label key: every k8s, container or unspec label with the
/// key. The namespace keys belong to the namespace, so a pod never has them.
fn pod_values<'a>(labels: &'a Labels, key: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    let namespace_key = key == POD_NAMESPACE_LABEL || key.starts_with(NAMESPACE_LABELS_PREFIX);
    labels
        .iter()
        .filter(move |l| {
            !namespace_key
                && matches!(
                    l.source(),
                    LabelSource::K8s | LabelSource::Container | LabelSource::Unspec
                )
                && l.key() == key
        })
        .map(|l| l.value())
}

/// Values of a namespace label key: the label `k8s:ns.labels/<key>`.
fn namespace_values<'a>(labels: &'a Labels, key: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    labels
        .iter()
        .filter(move |l| l.source() == LabelSource::K8s && l.key().strip_prefix(NAMESPACE_LABELS_PREFIX) == Some(key))
        .map(|l| l.value())
}

/// A reserved group of identities (Rivet's kind only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Entity {
    /// The reserved world identity (2) and every CIDR identity.
    World,
    /// The local node (1).
    Host,
    /// Every reserved identity but world, and every cluster identity.
    Cluster,
    /// Other nodes (6).
    RemoteNode,
    /// Any identity (peer 0).
    All,
}

impl Entity {
    pub(crate) const NAMES: &'static str = "world, host, cluster, remote-node or all";

    pub(crate) fn parse(text: &str) -> Option<Self> {
        match text {
            "world" => Some(Self::World),
            "host" => Some(Self::Host),
            "cluster" => Some(Self::Cluster),
            "remote-node" => Some(Self::RemoteNode),
            "all" => Some(Self::All),
            _ => None,
        }
    }
}

/// One peer of a rule, with the policy's namespace folded in.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) enum Peer {
    /// Pods: of the namespace `namespace` (a podSelector alone) or of the
    /// namespaces matching `namespace_selector` (exactly one is set).
    #[serde(rename_all = "camelCase")]
    Pods {
        #[serde(skip_serializing_if = "Option::is_none")]
        namespace: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        namespace_selector: Option<LabelSelector>,
        pod_selector: LabelSelector,
    },
    /// CIDR identities inside `cidr` and outside every `except` prefix.
    IpBlock {
        cidr: IpNet,
        /// Sorted, unique, each strictly inside `cidr`.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        except: Vec<IpNet>,
    },
    /// Reserved identities.
    Entity(Entity),
}

/// What the selector cache knows about one identity.
#[derive(Debug, Clone, Copy)]
pub(crate) enum IdentityRef<'a> {
    /// 1..=7.
    Reserved(ReservedIdentity),
    /// 256 <= id < 2^24, with its labels.
    Cluster(&'a Labels),
    /// A node-local CIDR identity and its prefix.
    Cidr(&'a IpNet),
}

impl Peer {
    /// Whether the peer is the wildcard (entity `all`).
    pub(crate) fn is_any(&self) -> bool {
        matches!(self, Self::Entity(Entity::All))
    }

    /// Whether the peer matches an identity.
    pub(crate) fn matches(&self, identity: IdentityRef<'_>) -> bool {
        match (self, identity) {
            (
                Self::Pods {
                    namespace,
                    namespace_selector,
                    pod_selector,
                },
                IdentityRef::Cluster(labels),
            ) => {
                let Some(pod_namespace) = labels.namespace() else {
                    return false;
                };
                let namespace_ok = match (namespace, namespace_selector) {
                    (Some(name), _) => name == pod_namespace,
                    (None, Some(selector)) => selector.matches_namespace(labels),
                    (None, None) => false,
                };
                namespace_ok && pod_selector.matches_pod(labels)
            }
            (Self::IpBlock { cidr, except }, IdentityRef::Cidr(prefix)) => {
                inside(prefix, cidr) && !except.iter().any(|e| inside(prefix, e))
            }
            (Self::Entity(entity), identity) => match (entity, identity) {
                (Entity::All, _) => true,
                (Entity::Host, IdentityRef::Reserved(r)) => r == ReservedIdentity::Host,
                (Entity::RemoteNode, IdentityRef::Reserved(r)) => r == ReservedIdentity::RemoteNode,
                (Entity::World, IdentityRef::Reserved(r)) => r == ReservedIdentity::World,
                (Entity::World, IdentityRef::Cidr(_)) => true,
                (Entity::Cluster, IdentityRef::Reserved(r)) => r != ReservedIdentity::World,
                (Entity::Cluster, IdentityRef::Cluster(_)) => true,
                _ => false,
            },
            _ => false,
        }
    }
}

/// Whether `inner` lies inside `outer` (same family, at least as long a
/// prefix, and its network within `outer`).
pub(crate) fn inside(inner: &IpNet, outer: &IpNet) -> bool {
    let same_family = matches!(
        (inner.network(), outer.network()),
        (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_))
    );
    same_family && inner.prefix_len() >= outer.prefix_len() && outer.contains(&inner.network())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(text: &str) -> Labels {
        text.parse().unwrap()
    }

    fn req(key: &str, operator: Operator, values: &[&str]) -> Requirement {
        Requirement {
            key: key.into(),
            operator,
            values: values.iter().map(|v| v.to_string()).collect(),
        }
    }

    #[test]
    fn requirements_follow_kubernetes_semantics() {
        let pod = labels("k8s:app=web,k8s:tier=front,container:env=prod,k8s:io.kubernetes.pod.namespace=shop");
        for (requirement, expected) in [
            (req("app", Operator::In, &["db", "web"]), true),
            (req("app", Operator::In, &["db"]), false),
            (req("missing", Operator::In, &["x"]), false),
            (req("app", Operator::NotIn, &["db"]), true),
            (req("app", Operator::NotIn, &["web"]), false),
            (req("missing", Operator::NotIn, &["x"]), true),
            (req("tier", Operator::Exists, &[]), true),
            (req("missing", Operator::Exists, &[]), false),
            (req("missing", Operator::DoesNotExist, &[]), true),
            (req("tier", Operator::DoesNotExist, &[]), false),
            // Container labels are pod labels too.
            (req("env", Operator::In, &["prod"]), true),
            // The namespace key is never a pod label.
            (req(POD_NAMESPACE_LABEL, Operator::Exists, &[]), false),
            (req(POD_NAMESPACE_LABEL, Operator::DoesNotExist, &[]), true),
        ] {
            let selector = LabelSelector::new(vec![requirement.clone()]);
            assert_eq!(selector.matches_pod(&pod), expected, "{requirement:?}");
        }
        assert!(
            LabelSelector::default().matches_pod(&pod),
            "an empty selector matches every pod"
        );
    }

    #[test]
    fn namespace_selectors_see_only_namespace_labels() {
        let pod = labels("k8s:team=a,k8s:ns.labels/team=b,k8s:io.kubernetes.pod.namespace=shop");
        let selector = LabelSelector::new(vec![req("team", Operator::In, &["b"])]);
        assert!(selector.matches_namespace(&pod));
        assert!(!selector.matches_pod(&pod));
        let selector = LabelSelector::new(vec![req("team", Operator::In, &["a"])]);
        assert!(!selector.matches_namespace(&pod));
        assert!(selector.matches_pod(&pod));
    }

    #[test]
    fn prefixes_nest_only_within_one_family() {
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        assert!(inside(&net("10.1.0.0/16"), &net("10.0.0.0/8")));
        assert!(inside(&net("10.0.0.0/8"), &net("10.0.0.0/8")));
        assert!(!inside(&net("10.0.0.0/8"), &net("10.1.0.0/16")));
        assert!(!inside(&net("11.0.0.0/16"), &net("10.0.0.0/8")));
        assert!(inside(&net("::/0"), &net("::/0")));
        assert!(!inside(&net("::/0"), &net("0.0.0.0/0")));
        assert!(!inside(&net("0.0.0.0/0"), &net("::/0")));
    }
}
