//! Policy documents: parse (YAML or JSON), validate, normalise.
//!
//! Parsing runs in two steps so that errors come in a useful order: first
//! the envelope (`apiVersion`, `kind`, `metadata`, `spec`, `status`; other
//! top-level fields are a Syntax error) with the kind and apiVersion checked,
//! then `metadata` leniently (only `name` and `namespace` are read; uid,
//! labels, annotations, managedFields... are accepted and ignored) and `spec`
//! strictly (every unknown field is a Syntax error naming its path). Duplicate
//! mapping keys are a Syntax error everywhere (YAML and JSON parsers would
//! otherwise silently keep the last one). Validation then produces Invalid
//! errors with the field path and the rule broken.

use std::collections::BTreeMap;
use std::fmt;

use ipnet::IpNet;
use rivet_common::k8s_name::{check_dns_subdomain, check_label_key, check_label_value, check_namespace};
use rivet_common::labels::Labels;
use serde::de::{self, DeserializeOwned, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::documents::{Document, DocumentsError, split_documents};

use super::selector::{Entity, LabelSelector, Operator, Peer, Requirement, inside};
use super::{
    Direction, NamedPort, PolicyError, PolicyKey, PolicyKind, Protocol, SelectorCache, SelectorChanges, Verdict,
};

/// One parsed, validated and normalised policy document. Immutable; see
/// [`Policy::parse`].
#[derive(Debug, Clone)]
pub struct Policy {
    key: PolicyKey,
    api_version: String,
    document: String,
    pub(crate) spec: Spec,
}

impl Policy {
    /// Parses one document (YAML or JSON). Errors name the field path and
    /// the reason; an empty document is a Syntax error.
    ///
    /// ```
    /// use rivet_policy::{Policy, PolicyKind};
    ///
    /// let policy = Policy::parse(
    ///     r#"
    /// apiVersion: networking.k8s.io/v1
    /// kind: NetworkPolicy
    /// metadata:
    ///   name: db-from-web
    ///   namespace: shop
    /// spec:
    ///   podSelector:
    ///     matchLabels: {app: db}
    ///   ingress:
    ///   - from:
    ///     - podSelector:
    ///         matchLabels: {app: web}
    ///     ports:
    ///     - port: 5432
    /// "#,
    /// )?;
    /// assert_eq!(policy.key().kind, PolicyKind::NetworkPolicy);
    /// assert_eq!(policy.key().to_string(), "NetworkPolicy/shop/db-from-web");
    /// assert!(policy.selects(&"k8s:app=db,k8s:io.kubernetes.pod.namespace=shop".parse()?));
    /// assert!(!policy.selects(&"k8s:app=db,k8s:io.kubernetes.pod.namespace=other".parse()?));
    ///
    /// // Errors name the field and the rule.
    /// let err = Policy::parse(
    ///     r#"{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
    ///         "metadata": {"name": "x"},
    ///         "spec": {"podSelector": {}, "ingress": [{"ports": [{"port": 80, "endPort": 79}]}]}}"#,
    /// )
    /// .unwrap_err();
    /// assert_eq!(err.to_string(), "spec.ingress[0].ports[0].endPort: must be >= port (80), found 79");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn parse(document: &str) -> Result<Policy, PolicyError> {
        parse_document(document)?.ok_or_else(|| PolicyError::Syntax {
            path: String::new(),
            reason: "empty document (expected a NetworkPolicy or RivetNetworkPolicy object)".into(),
        })
    }

    /// Parses an input that may hold several documents, split as
    /// [`split_documents`] splits them (YAML `---`/`...` markers or a JSON
    /// array; empty documents skipped). An error names the document by its
    /// number and location, then the field path:
    /// `document 2 (line 14): spec.podSelector: ...`. Two documents with the
    /// same key are an error: an input defines each policy once.
    ///
    /// ```
    /// use rivet_policy::Policy;
    ///
    /// let head = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {namespace: shop, name: ";
    /// let text = format!("# shop\n---\n{head}a}}\nspec: {{podSelector: {{}}}}\n---\n{head}b}}\nspec: {{policyTypes: [ingress]}}\n");
    /// let err = Policy::parse_all(&text).unwrap_err();
    /// assert!(err.to_string().starts_with("document 2 (line 8): spec.policyTypes[0]: must be Ingress or Egress"), "{err}");
    /// ```
    pub fn parse_all(text: &str) -> Result<Vec<Policy>, DocumentsError> {
        let mut policies: Vec<(Document, Policy)> = Vec::new();
        for document in split_documents(text)? {
            let failed = |error: PolicyError| DocumentsError::Document {
                number: document.number,
                location: document.location,
                error,
            };
            let policy = Policy::parse(&document.text).map_err(failed)?;
            if let Some((first, _)) = policies.iter().find(|(_, p)| p.key == policy.key) {
                return Err(failed(PolicyError::invalid(
                    "metadata.name",
                    format!("{} is already defined by {first}", policy.key),
                )));
            }
            policies.push((document, policy));
        }
        Ok(policies.into_iter().map(|(_, p)| p).collect())
    }

    /// Kind, namespace and name.
    pub fn key(&self) -> &PolicyKey {
        &self.key
    }

    /// The document's apiVersion.
    pub fn api_version(&self) -> &str {
        &self.api_version
    }

    /// The source text as given.
    pub fn document(&self) -> &str {
        &self.document
    }

    /// What Rivet understood, as compact JSON: kind, apiVersion, namespace and
    /// name, and the normalised spec (defaults applied, `policyTypes`
    /// explicit, matchLabels as `In` requirements, host bits of prefixes
    /// cleared, `endPort` equal to `port` dropped).
    pub fn normalized_json(&self) -> String {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Normalized<'a> {
            api_version: &'a str,
            kind: PolicyKind,
            metadata: Metadata<'a>,
            spec: &'a Spec,
        }
        #[derive(Serialize)]
        struct Metadata<'a> {
            namespace: &'a str,
            name: &'a str,
        }
        let normalized = Normalized {
            api_version: &self.api_version,
            kind: self.key.kind,
            metadata: Metadata {
                namespace: &self.key.namespace,
                name: &self.key.name,
            },
            spec: &self.spec,
        };
        serde_json::to_string(&normalized).expect("a normalised policy always serialises")
    }

    /// Whether both have the same key, apiVersion and normalised spec, so
    /// replacing one by the other changes no behaviour (metadata other than
    /// the key, `status` and formatting do not count).
    pub fn same_spec(&self, other: &Policy) -> bool {
        self.key == other.key && self.api_version == other.api_version && self.spec == other.spec
    }

    /// Whether the policy selects an endpoint with these identity labels: the
    /// endpoint is in the policy's namespace and matches `spec.podSelector`.
    pub fn selects(&self, subject: &Labels) -> bool {
        subject.namespace() == Some(self.key.namespace.as_str()) && self.spec.pod_selector.matches_pod(subject)
    }

    /// The peers of every rule (allow and deny, both directions).
    pub(crate) fn peers(&self) -> impl Iterator<Item = &Peer> {
        Direction::ALL
            .into_iter()
            .flat_map(|d| [Verdict::Allow, Verdict::Deny].map(|v| self.spec.rules(d, v)))
            .flatten()
            .flat_map(|rule| &rule.peers)
    }

    /// Whether the resolution of an endpoint it selects can change with
    /// `changes`: a peer of a rule that takes effect matches a changed
    /// identity differently before and after, the CIDR identity of one of
    /// an ipBlock's own prefixes (`cidr` or an `except`: the endpoint's
    /// address prefixes) changed, or named ports changed and an egress rule
    /// names a port (those resolve against the peers' ports).
    pub fn reacts_to(&self, changes: &SelectorChanges) -> bool {
        self.spec.policy_types.iter().any(|direction| {
            [Verdict::Allow, Verdict::Deny].into_iter().any(|verdict| {
                self.spec.rules(*direction, verdict).iter().any(|rule| {
                    let named = *direction == Direction::Egress
                        && changes.named_ports_changed()
                        && rule.ports.iter().any(|p| matches!(p.port, Some(PortRef::Name(_))));
                    let prefixes = |peer: &Peer| match peer {
                        Peer::IpBlock { cidr, except } => std::iter::once(cidr)
                            .chain(except)
                            .any(|prefix| changes.touches_prefix(prefix)),
                        _ => false,
                    };
                    named
                        || rule
                            .peers
                            .iter()
                            .any(|peer| !peer.is_any() && (changes.moves(peer) || prefixes(peer)))
                })
            })
        })
    }

    /// The host prefixes (/32, /128) of the local endpoints' addresses that
    /// an ipBlock of an egress rule naming a port selects (allow or deny),
    /// where the endpoint has a port of that name: the caller allocates a
    /// CIDR identity for each too, so that the endpoint's prefixes tell that
    /// pod's address apart from the rest of the block and the rule allows
    /// exactly that pod's own port number there (see the module docs).
    pub fn named_port_hosts(&self, cache: &SelectorCache) -> Vec<IpNet> {
        let mut out = Vec::new();
        if !self.spec.applies(Direction::Egress) {
            return out;
        }
        for verdict in [Verdict::Allow, Verdict::Deny] {
            for rule in self.spec.rules(Direction::Egress, verdict) {
                // A rule for any peer resolves per identity, not per address.
                if rule.peers.iter().any(Peer::is_any) {
                    continue;
                }
                for peer in &rule.peers {
                    let Peer::IpBlock { cidr, except } = peer else {
                        continue;
                    };
                    let hosts = cache.addresses_with_named_ports().filter(|(address, ports)| {
                        cidr.contains(address)
                            && !except.iter().any(|e| e.contains(address))
                            && ports.iter().any(|p| rule.names(p))
                    });
                    out.extend(hosts.map(|(address, _)| IpNet::from(address)));
                }
            }
        }
        out
    }

    /// Every ipBlock prefix (cidr and except) of the rules that take effect
    /// (those of the directions in policyTypes), sorted and unique, host bits
    /// cleared. The caller allocates a CIDR identity for each.
    pub fn cidrs(&self) -> Vec<IpNet> {
        let mut out = Vec::new();
        for direction in &self.spec.policy_types {
            for verdict in [Verdict::Allow, Verdict::Deny] {
                for rule in self.spec.rules(*direction, verdict) {
                    for peer in &rule.peers {
                        if let Peer::IpBlock { cidr, except } = peer {
                            out.push(*cidr);
                            out.extend(except.iter().copied());
                        }
                    }
                }
            }
        }
        out.sort();
        out.dedup();
        out
    }
}

// ------------------------------------------------------------ normalised form

/// The normalised spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Spec {
    pub(crate) pod_selector: LabelSelector,
    /// Sorted, unique, defaulted.
    pub(crate) policy_types: Vec<Direction>,
    pub(crate) ingress: Vec<Rule>,
    pub(crate) egress: Vec<Rule>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) ingress_deny: Vec<Rule>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) egress_deny: Vec<Rule>,
    pub(crate) enable_default_deny: DefaultDeny,
}

impl Spec {
    /// Whether the policy enforces `direction` (it is in policyTypes).
    pub(crate) fn applies(&self, direction: Direction) -> bool {
        self.policy_types.contains(&direction)
    }

    /// Whether the policy denies by default in `direction` (always for a
    /// NetworkPolicy).
    pub(crate) fn default_deny(&self, direction: Direction) -> bool {
        match direction {
            Direction::Ingress => self.enable_default_deny.ingress,
            Direction::Egress => self.enable_default_deny.egress,
        }
    }

    /// The rules of one direction and verdict.
    pub(crate) fn rules(&self, direction: Direction, verdict: Verdict) -> &[Rule] {
        match (direction, verdict) {
            (Direction::Ingress, Verdict::Allow) => &self.ingress,
            (Direction::Egress, Verdict::Allow) => &self.egress,
            (Direction::Ingress, Verdict::Deny) => &self.ingress_deny,
            (Direction::Egress, Verdict::Deny) => &self.egress_deny,
        }
    }
}

/// `enableDefaultDeny`: true in each direction of `policyTypes` unless a
/// Rivet policy says otherwise, false in a direction the policy does not
/// enforce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct DefaultDeny {
    pub(crate) ingress: bool,
    pub(crate) egress: bool,
}

/// One rule: peers x ports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Rule {
    /// Empty = any peer.
    pub(crate) peers: Vec<Peer>,
    /// Empty = every protocol and port.
    pub(crate) ports: Vec<PortSpec>,
}

impl Rule {
    /// Whether one of the rule's ports names `port`: its name and protocol
    /// (a port numbered 0 is never resolved).
    pub(crate) fn names(&self, port: &NamedPort) -> bool {
        port.port != 0 && self.ports.iter().any(|spec| spec.names(port))
    }
}

/// One entry of `ports`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PortSpec {
    pub(crate) protocol: Protocol,
    /// None = every port of the protocol (and the only choice for ICMP,
    /// ICMPv6 and ANY).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) port: Option<PortRef>,
    /// Only with a numeric port, and then > port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) end_port: Option<u16>,
}

impl PortSpec {
    /// Whether this is a named port that names `port` (same name and
    /// protocol, a non-zero number).
    pub(crate) fn names(&self, port: &NamedPort) -> bool {
        matches!(&self.port, Some(PortRef::Name(name)) if *name == port.name)
            && self.protocol == port.protocol
            && port.port != 0
    }
}

/// A port number or a named port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub(crate) enum PortRef {
    Number(u16),
    Name(String),
}

// ----------------------------------------------------------------- documents

/// The top level. `metadata` and `spec` are read later, so that kind and
/// apiVersion are checked first.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    #[serde(rename = "apiVersion")]
    api_version: Option<String>,
    kind: Option<String>,
    metadata: Option<Value>,
    spec: Option<Value>,
    #[allow(dead_code)]
    status: Option<IgnoredAny>,
}

/// Lenient: every other metadata field is ignored.
#[derive(Deserialize)]
struct MetadataDoc {
    name: Option<String>,
    namespace: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SpecDoc {
    pod_selector: Option<SelectorDoc>,
    policy_types: Option<Vec<String>>,
    ingress: Option<Vec<IngressRuleDoc>>,
    egress: Option<Vec<EgressRuleDoc>>,
    ingress_deny: Option<Vec<IngressRuleDoc>>,
    egress_deny: Option<Vec<EgressRuleDoc>>,
    enable_default_deny: Option<DefaultDenyDoc>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SelectorDoc {
    match_labels: Option<BTreeMap<String, String>>,
    match_expressions: Option<Vec<ExpressionDoc>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExpressionDoc {
    key: String,
    operator: String,
    values: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IngressRuleDoc {
    from: Option<Vec<PeerDoc>>,
    ports: Option<Vec<PortDoc>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EgressRuleDoc {
    to: Option<Vec<PeerDoc>>,
    ports: Option<Vec<PortDoc>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PeerDoc {
    pod_selector: Option<SelectorDoc>,
    namespace_selector: Option<SelectorDoc>,
    ip_block: Option<IpBlockDoc>,
    entities: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IpBlockDoc {
    cidr: String,
    except: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PortDoc {
    protocol: Option<String>,
    port: Option<IntOrString>,
    end_port: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DefaultDenyDoc {
    ingress: Option<bool>,
    egress: Option<bool>,
}

/// Kubernetes' IntOrString: a port number or a port name.
enum IntOrString {
    Int(i128),
    Str(String),
}

impl<'de> Deserialize<'de> for IntOrString {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = IntOrString;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a port number or a port name")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<IntOrString, E> {
                Ok(IntOrString::Int(v.into()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<IntOrString, E> {
                Ok(IntOrString::Int(v.into()))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<IntOrString, E> {
                Ok(IntOrString::Str(v.to_string()))
            }
        }
        deserializer.deserialize_any(V)
    }
}

/// A JSON value read from YAML or JSON that rejects duplicate mapping keys.
struct StrictValue(Value);

impl<'de> Deserialize<'de> for StrictValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StrictValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a YAML or JSON value")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<StrictValue, E> {
                Ok(StrictValue(Value::Bool(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<StrictValue, E> {
                Ok(StrictValue(Value::from(v)))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<StrictValue, E> {
                Ok(StrictValue(Value::from(v)))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<StrictValue, E> {
                serde_json::Number::from_f64(v)
                    .map(|n| StrictValue(Value::Number(n)))
                    .ok_or_else(|| E::custom(format!("unsupported number {v}")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<StrictValue, E> {
                Ok(StrictValue(Value::String(v.to_string())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<StrictValue, E> {
                Ok(StrictValue(Value::String(v)))
            }
            fn visit_unit<E: de::Error>(self) -> Result<StrictValue, E> {
                Ok(StrictValue(Value::Null))
            }
            fn visit_none<E: de::Error>(self) -> Result<StrictValue, E> {
                Ok(StrictValue(Value::Null))
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<StrictValue, D::Error> {
                StrictValue::deserialize(d)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<StrictValue, A::Error> {
                let mut items = Vec::new();
                while let Some(StrictValue(item)) = seq.next_element()? {
                    items.push(item);
                }
                Ok(StrictValue(Value::Array(items)))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<StrictValue, A::Error> {
                let mut object = serde_json::Map::new();
                while let Some(key) = map.next_key::<String>()? {
                    if object.contains_key(&key) {
                        return Err(de::Error::custom(format!("duplicate key `{key}`")));
                    }
                    let StrictValue(value) = map.next_value()?;
                    object.insert(key, value);
                }
                Ok(StrictValue(Value::Object(object)))
            }
        }
        deserializer.deserialize_any(V)
    }
}

// ------------------------------------------------------------------- parsing

/// `None` for an empty document.
fn parse_document(text: &str) -> Result<Option<Policy>, PolicyError> {
    let value = load(text)?;
    let object_kind = match &value {
        Value::Null => return Ok(None),
        Value::Object(_) => None,
        Value::Bool(_) => Some("a boolean"),
        Value::Number(_) => Some("a number"),
        Value::String(_) => Some("a string"),
        Value::Array(_) => Some("a list"),
    };
    if let Some(found) = object_kind {
        return Err(PolicyError::Syntax {
            path: String::new(),
            reason: format!("expected an object with apiVersion, kind, metadata and spec, found {found}"),
        });
    }
    let envelope: Envelope = from_value(value, "")?;

    let kind = match envelope.kind.as_deref() {
        None => {
            return Err(PolicyError::invalid(
                "kind",
                "is required: NetworkPolicy (apiVersion networking.k8s.io/v1) or RivetNetworkPolicy (apiVersion rivet.io/v1)",
            ));
        }
        Some(kind) => kind.parse::<PolicyKind>()?,
    };
    let api_version = envelope.api_version.unwrap_or_default();
    if api_version != kind.api_version() {
        let found = if api_version.is_empty() {
            "none".to_string()
        } else {
            format!("{api_version:?}")
        };
        return Err(PolicyError::invalid(
            "apiVersion",
            format!("must be {} for kind {kind}, found {found}", kind.api_version()),
        ));
    }

    let metadata: MetadataDoc = match envelope.metadata {
        None | Some(Value::Null) => MetadataDoc {
            name: None,
            namespace: None,
        },
        Some(value) => from_value(value, "metadata")?,
    };
    let name = match metadata.name {
        None => return Err(PolicyError::invalid("metadata.name", "is required")),
        Some(name) if name.is_empty() => return Err(PolicyError::invalid("metadata.name", "is required")),
        Some(name) => name,
    };
    if let Err(why) = check_dns_subdomain(&name) {
        return Err(PolicyError::invalid("metadata.name", format!("{name:?} {why}")));
    }
    let namespace = match metadata.namespace {
        None => "default".to_string(),
        Some(ns) if ns.is_empty() => "default".to_string(),
        Some(ns) => ns,
    };
    if let Err(why) = check_namespace(&namespace) {
        return Err(PolicyError::invalid(
            "metadata.namespace",
            format!("{namespace:?} {why}"),
        ));
    }

    // As in Kubernetes: a missing spec is the empty spec (every pod of the
    // namespace, isolated for ingress).
    let spec: SpecDoc = match envelope.spec {
        None | Some(Value::Null) => from_value(Value::Object(Default::default()), "spec")?,
        Some(value) => from_value(value, "spec")?,
    };
    let spec = Validator {
        kind,
        namespace: &namespace,
    }
    .spec(spec)?;

    Ok(Some(Policy {
        key: PolicyKey::new(kind, namespace, name),
        api_version,
        document: text.to_string(),
        spec,
    }))
}

/// Reads YAML or JSON into a value. Text starting with `{` is tried as JSON
/// first (YAML parsers dislike tabs), then as YAML (a YAML flow mapping).
fn load(text: &str) -> Result<Value, PolicyError> {
    let trimmed = text.trim_start_matches('\u{feff}').trim_start();
    if trimmed.starts_with('{') {
        let mut de = serde_json::Deserializer::from_str(trimmed);
        let json = serde_path_to_error::deserialize(&mut de)
            .map_err(|e| syntax(e.path(), "", e.inner()))
            .and_then(|StrictValue(v)| {
                de.end().map_err(|e| PolicyError::Syntax {
                    path: String::new(),
                    reason: e.to_string(),
                })?;
                Ok(v)
            });
        return match json {
            Ok(value) => Ok(value),
            Err(json_err) => load_yaml(trimmed).map_err(|_| json_err),
        };
    }
    load_yaml(text)
}

fn load_yaml(text: &str) -> Result<Value, PolicyError> {
    serde_path_to_error::deserialize(serde_norway::Deserializer::from_str(text))
        .map(|StrictValue(v)| v)
        .map_err(|e| syntax(e.path(), "", e.inner()))
}

/// Deserialises a part of the document, naming the path of a failure.
fn from_value<T: DeserializeOwned>(value: Value, prefix: &str) -> Result<T, PolicyError> {
    serde_path_to_error::deserialize(value).map_err(|e| syntax(e.path(), prefix, e.inner()))
}

fn syntax(path: &serde_path_to_error::Path, prefix: &str, reason: &dyn fmt::Display) -> PolicyError {
    PolicyError::Syntax {
        path: render_path(path, prefix),
        reason: reason.to_string(),
    }
}

/// `spec.ingress[0].ports[1].port` from the path segments.
fn render_path(path: &serde_path_to_error::Path, prefix: &str) -> String {
    use serde_path_to_error::Segment;
    let mut out = prefix.to_string();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } => push_field(&mut out, key),
            Segment::Enum { variant } => push_field(&mut out, variant),
            Segment::Unknown => push_field(&mut out, "?"),
        }
    }
    out
}

fn push_field(out: &mut String, field: &str) {
    if !out.is_empty() {
        out.push('.');
    }
    out.push_str(field);
}

// ---------------------------------------------------------------- validation

struct Validator<'a> {
    kind: PolicyKind,
    namespace: &'a str,
}

impl Validator<'_> {
    fn rivet(&self) -> bool {
        self.kind == PolicyKind::RivetNetworkPolicy
    }

    fn rivet_only(&self, path: &str, what: &str) -> Result<(), PolicyError> {
        if self.rivet() {
            return Ok(());
        }
        Err(PolicyError::invalid(
            path,
            format!("{what} only exist in kind RivetNetworkPolicy (apiVersion rivet.io/v1), not in a NetworkPolicy"),
        ))
    }

    fn spec(&self, doc: SpecDoc) -> Result<Spec, PolicyError> {
        // Optional since Kubernetes 1.31: a missing selector is the empty one,
        // every pod of the policy's namespace.
        let pod_selector = match &doc.pod_selector {
            None => self.selector(&SelectorDoc::default(), "spec.podSelector")?,
            Some(selector) => self.selector(selector, "spec.podSelector")?,
        };
        if doc.ingress_deny.is_some() {
            self.rivet_only("spec.ingressDeny", "deny rules")?;
        }
        if doc.egress_deny.is_some() {
            self.rivet_only("spec.egressDeny", "deny rules")?;
        }
        if doc.enable_default_deny.is_some() {
            self.rivet_only("spec.enableDefaultDeny", "enableDefaultDeny settings")?;
        }

        let ingress = self.rules(
            doc.ingress.unwrap_or_default().into_iter().map(|r| (r.from, r.ports)),
            "spec.ingress",
            "from",
        )?;
        let egress = self.rules(
            doc.egress.unwrap_or_default().into_iter().map(|r| (r.to, r.ports)),
            "spec.egress",
            "to",
        )?;
        let ingress_deny = self.rules(
            doc.ingress_deny
                .unwrap_or_default()
                .into_iter()
                .map(|r| (r.from, r.ports)),
            "spec.ingressDeny",
            "from",
        )?;
        let egress_deny = self.rules(
            doc.egress_deny.unwrap_or_default().into_iter().map(|r| (r.to, r.ports)),
            "spec.egressDeny",
            "to",
        )?;

        let mut policy_types = Vec::new();
        for (i, text) in doc.policy_types.unwrap_or_default().iter().enumerate() {
            let path = format!("spec.policyTypes[{i}]");
            let direction = match text.as_str() {
                "Ingress" => Direction::Ingress,
                "Egress" => Direction::Egress,
                _ => {
                    return Err(PolicyError::invalid(
                        path,
                        format!("must be Ingress or Egress, found {text:?}"),
                    ));
                }
            };
            if policy_types.contains(&direction) {
                return Err(PolicyError::invalid(path, format!("duplicate value {text:?}")));
            }
            policy_types.push(direction);
        }
        if policy_types.is_empty() {
            if self.rivet() {
                // The directions the policy has rules for; Ingress when none.
                if !ingress.is_empty() || !ingress_deny.is_empty() {
                    policy_types.push(Direction::Ingress);
                }
                if !egress.is_empty() || !egress_deny.is_empty() {
                    policy_types.push(Direction::Egress);
                }
                if policy_types.is_empty() {
                    policy_types.push(Direction::Ingress);
                }
            } else {
                // As the API server defaults it: Ingress always, Egress when
                // there are egress rules.
                policy_types.push(Direction::Ingress);
                if !egress.is_empty() {
                    policy_types.push(Direction::Egress);
                }
            }
        }
        policy_types.sort();

        // Default deny only in the directions the policy enforces: a
        // direction outside policyTypes is never restricted by it, and the
        // normalised form (`rivet policy get`) must not say otherwise.
        let (ingress_default, egress_default) = match doc.enable_default_deny {
            None => (true, true),
            Some(d) => (d.ingress.unwrap_or(true), d.egress.unwrap_or(true)),
        };
        let enable_default_deny = DefaultDeny {
            ingress: ingress_default && policy_types.contains(&Direction::Ingress),
            egress: egress_default && policy_types.contains(&Direction::Egress),
        };

        Ok(Spec {
            pod_selector,
            policy_types,
            ingress,
            egress,
            ingress_deny,
            egress_deny,
            enable_default_deny,
        })
    }

    fn rules(
        &self,
        docs: impl Iterator<Item = (Option<Vec<PeerDoc>>, Option<Vec<PortDoc>>)>,
        path: &str,
        peers_field: &str,
    ) -> Result<Vec<Rule>, PolicyError> {
        let mut rules = Vec::new();
        for (i, (peers, ports)) in docs.enumerate() {
            let rule_path = format!("{path}[{i}]");
            let mut rule = Rule {
                peers: Vec::new(),
                ports: Vec::new(),
            };
            for (j, peer) in peers.unwrap_or_default().into_iter().enumerate() {
                self.peer(peer, &format!("{rule_path}.{peers_field}[{j}]"), &mut rule.peers)?;
            }
            for (j, port) in ports.unwrap_or_default().into_iter().enumerate() {
                rule.ports.push(self.port(port, &format!("{rule_path}.ports[{j}]"))?);
            }
            rules.push(rule);
        }
        Ok(rules)
    }

    fn peer(&self, doc: PeerDoc, path: &str, out: &mut Vec<Peer>) -> Result<(), PolicyError> {
        if let Some(entities) = &doc.entities {
            self.rivet_only(&format!("{path}.entities"), "entity peers")?;
            if doc.pod_selector.is_some() || doc.namespace_selector.is_some() || doc.ip_block.is_some() {
                return Err(PolicyError::invalid(
                    path,
                    "entities cannot be combined with podSelector, namespaceSelector or ipBlock in one peer",
                ));
            }
            if entities.is_empty() {
                return Err(PolicyError::invalid(
                    format!("{path}.entities"),
                    format!("must not be empty (name {})", Entity::NAMES),
                ));
            }
            for (k, name) in entities.iter().enumerate() {
                let entity = Entity::parse(name).ok_or_else(|| {
                    PolicyError::invalid(
                        format!("{path}.entities[{k}]"),
                        format!("must be {}, found {name:?}", Entity::NAMES),
                    )
                })?;
                out.push(Peer::Entity(entity));
            }
            return Ok(());
        }
        if let Some(block) = doc.ip_block {
            if doc.pod_selector.is_some() || doc.namespace_selector.is_some() {
                return Err(PolicyError::invalid(
                    path,
                    "ipBlock cannot be combined with podSelector or namespaceSelector in one peer (use separate peers)",
                ));
            }
            out.push(ip_block(block, &format!("{path}.ipBlock"))?);
            return Ok(());
        }
        let pod_selector = match &doc.pod_selector {
            Some(selector) => Some(self.selector(selector, &format!("{path}.podSelector"))?),
            None => None,
        };
        let namespace_selector = match &doc.namespace_selector {
            Some(selector) => Some(self.selector(selector, &format!("{path}.namespaceSelector"))?),
            None => None,
        };
        let peer = match (pod_selector, namespace_selector) {
            (None, None) => {
                let fields = if self.rivet() {
                    "podSelector, namespaceSelector, ipBlock or entities"
                } else {
                    "podSelector, namespaceSelector or ipBlock"
                };
                return Err(PolicyError::invalid(path, format!("must set {fields}")));
            }
            (Some(pod_selector), None) => Peer::Pods {
                namespace: Some(self.namespace.to_string()),
                namespace_selector: None,
                pod_selector,
            },
            (pod_selector, Some(namespace_selector)) => Peer::Pods {
                namespace: None,
                namespace_selector: Some(namespace_selector),
                pod_selector: pod_selector.unwrap_or_default(),
            },
        };
        out.push(peer);
        Ok(())
    }

    fn selector(&self, doc: &SelectorDoc, path: &str) -> Result<LabelSelector, PolicyError> {
        let mut requirements = Vec::new();
        for (key, value) in doc.match_labels.iter().flatten() {
            let path = format!("{path}.matchLabels");
            check_label_key(key).map_err(|why| PolicyError::invalid(&path, format!("key {key:?} {why}")))?;
            check_label_value(value)
                .map_err(|why| PolicyError::invalid(&path, format!("value {value:?} of key {key:?} {why}")))?;
            requirements.push(Requirement {
                key: key.clone(),
                operator: Operator::In,
                values: vec![value.clone()],
            });
        }
        for (i, expression) in doc.match_expressions.iter().flatten().enumerate() {
            let path = format!("{path}.matchExpressions[{i}]");
            check_label_key(&expression.key)
                .map_err(|why| PolicyError::invalid(format!("{path}.key"), format!("{:?} {why}", expression.key)))?;
            let operator = Operator::parse(&expression.operator).ok_or_else(|| {
                PolicyError::invalid(
                    format!("{path}.operator"),
                    format!(
                        "must be In, NotIn, Exists or DoesNotExist, found {:?}",
                        expression.operator
                    ),
                )
            })?;
            let values = expression.values.clone().unwrap_or_default();
            if operator.takes_values() && values.is_empty() {
                return Err(PolicyError::invalid(
                    format!("{path}.values"),
                    format!("must be non-empty for operator {}", expression.operator),
                ));
            }
            if !operator.takes_values() && !values.is_empty() {
                return Err(PolicyError::invalid(
                    format!("{path}.values"),
                    format!("must be empty for operator {}", expression.operator),
                ));
            }
            for (k, value) in values.iter().enumerate() {
                check_label_value(value)
                    .map_err(|why| PolicyError::invalid(format!("{path}.values[{k}]"), format!("{value:?} {why}")))?;
            }
            let mut values = values;
            values.sort();
            values.dedup();
            requirements.push(Requirement {
                key: expression.key.clone(),
                operator,
                values,
            });
        }
        Ok(LabelSelector::new(requirements))
    }

    fn port(&self, doc: PortDoc, path: &str) -> Result<PortSpec, PolicyError> {
        let protocol = match doc.protocol.as_deref() {
            None => Protocol::Tcp,
            Some(text) => {
                let protocol = text.parse::<Protocol>().ok();
                match protocol {
                    Some(p @ (Protocol::Tcp | Protocol::Udp | Protocol::Sctp)) => p,
                    Some(p) if self.rivet() => p,
                    Some(_) => {
                        return Err(PolicyError::invalid(
                            format!("{path}.protocol"),
                            format!(
                                "must be TCP, UDP or SCTP, found {text:?} (ICMP, ICMPv6 and ANY need kind RivetNetworkPolicy)"
                            ),
                        ));
                    }
                    None => {
                        let allowed = if self.rivet() {
                            "TCP, UDP, SCTP, ICMP, ICMPv6 or ANY"
                        } else {
                            "TCP, UDP or SCTP"
                        };
                        return Err(PolicyError::invalid(
                            format!("{path}.protocol"),
                            format!("must be {allowed}, found {text:?}"),
                        ));
                    }
                }
            }
        };
        if !protocol.has_ports() {
            for (field, set) in [("port", doc.port.is_some()), ("endPort", doc.end_port.is_some())] {
                if set {
                    return Err(PolicyError::invalid(
                        format!("{path}.{field}"),
                        format!("must not be set: protocol {protocol} has no ports"),
                    ));
                }
            }
        }
        let port = match doc.port {
            None => None,
            Some(IntOrString::Int(n)) => Some(PortRef::Number(port_number(n, &format!("{path}.port"))?)),
            Some(IntOrString::Str(name)) => {
                check_port_name(&name)
                    .map_err(|why| PolicyError::invalid(format!("{path}.port"), format!("{name:?} {why}")))?;
                Some(PortRef::Name(name))
            }
        };
        let end_port = match (doc.end_port, &port) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(PolicyError::invalid(
                    format!("{path}.endPort"),
                    "requires port (the first port of the range)",
                ));
            }
            (Some(_), Some(PortRef::Name(name))) => {
                return Err(PolicyError::invalid(
                    format!("{path}.endPort"),
                    format!("requires a numeric port, not the named port {name:?}"),
                ));
            }
            (Some(end), Some(PortRef::Number(first))) => {
                let end = port_number(end.into(), &format!("{path}.endPort"))?;
                if end < *first {
                    return Err(PolicyError::invalid(
                        format!("{path}.endPort"),
                        format!("must be >= port ({first}), found {end}"),
                    ));
                }
                (end > *first).then_some(end)
            }
        };
        Ok(PortSpec {
            protocol,
            port,
            end_port,
        })
    }
}

fn port_number(n: i128, path: &str) -> Result<u16, PolicyError> {
    match u16::try_from(n) {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(PolicyError::invalid(
            path,
            format!("must be between 1 and 65535, found {n}"),
        )),
    }
}

fn ip_block(doc: IpBlockDoc, path: &str) -> Result<Peer, PolicyError> {
    let cidr = parse_cidr(&doc.cidr).map_err(|why| PolicyError::invalid(format!("{path}.cidr"), why))?;
    let mut except = Vec::new();
    for (k, text) in doc.except.iter().flatten().enumerate() {
        let path = format!("{path}.except[{k}]");
        let net = parse_cidr(text).map_err(|why| PolicyError::invalid(&path, why))?;
        if net.network().is_ipv4() != cidr.network().is_ipv4() {
            return Err(PolicyError::invalid(
                path,
                format!("{net} must be of the same address family as cidr {cidr}"),
            ));
        }
        if !inside(&net, &cidr) || net.prefix_len() == cidr.prefix_len() {
            return Err(PolicyError::invalid(
                path,
                format!("{net} must lie strictly inside cidr {cidr}"),
            ));
        }
        except.push(net);
    }
    except.sort();
    except.dedup();
    Ok(Peer::IpBlock { cidr, except })
}

/// `address/length`; host bits are cleared.
fn parse_cidr(text: &str) -> Result<IpNet, String> {
    text.parse::<IpNet>()
        .map(|net| net.trunc())
        .map_err(|_| format!("must be a CIDR (address/prefix-length, e.g. 10.0.0.0/16), found {text:?}"))
}

// ------------------------------------------------------ Kubernetes name rules

/// IANA_SVC_NAME: at most 15 characters, lowercase alphanumerics and '-', at
/// least one letter, no leading, trailing or double '-'.
fn check_port_name(name: &str) -> Result<(), String> {
    const FORM: &str = "is neither a port number nor a port name (an IANA service name: at most 15 lowercase \
                        alphanumerics and '-', at least one letter, no leading, trailing or double '-')";
    if rivet_common::named_port::is_port_name(name) {
        Ok(())
    } else {
        Err(FORM.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_names() {
        for good in ["http", "h2c", "a-b", "x", "abcdefghijklmno"] {
            assert!(check_port_name(good).is_ok(), "{good}");
        }
        for bad in ["", "80", "HTTP", "-a", "a-", "a--b", "abcdefghijklmnop", "a_b"] {
            assert!(check_port_name(bad).is_err(), "{bad}");
        }
    }
}
