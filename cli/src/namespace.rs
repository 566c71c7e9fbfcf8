//! `rivet namespace label|list`: namespace labels as svc-endpoint stores
//! them (without Kubernetes; with it svc-k8s-sync feeds them).

use clap::{Args, Subcommand};
use rivet_common::labels::{Label, LabelSource};
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::namespace_service_client::NamespaceServiceClient;
use serde::Serialize;

use crate::table::Table;
use crate::{CliError, Context, age, now_unix_nanos};

const DAEMON: &str = "svc-endpoint";

/// `rivet namespace ...`
#[derive(Debug, Clone, Subcommand)]
pub enum NamespaceCommand {
    /// Replace a namespace's labels; its pods are re-identified. With
    /// `--clear` svc-endpoint forgets the namespace.
    Label {
        /// The namespace.
        namespace: String,
        #[command(flatten)]
        labels: NewLabels,
    },
    /// Known namespaces: with labels or with endpoints.
    List,
}

/// The new labels of `rivet namespace label` and `rivet endpoint label`:
/// the complete set, or `--clear`.
#[derive(Debug, Clone, Args)]
pub struct NewLabels {
    /// The complete new set, `key=value` each (`k8s:key=value` accepted).
    #[arg(
        value_name = "KEY=VALUE",
        required_unless_present = "clear",
        conflicts_with = "clear"
    )]
    pub labels: Vec<String>,
    /// Remove every label.
    #[arg(long)]
    pub clear: bool,
}

impl NewLabels {
    /// The labels as the API takes them ([`parse_labels`]); none with `--clear`.
    pub fn parse(&self) -> Result<Vec<String>, LabelArgError> {
        parse_labels(&self.labels)
    }
}

/// `key=value` (or `k8s:key=value`) from the command line as the API's
/// `k8s:key=value`, checked as a Kubernetes label. The value may be empty.
///
/// ```
/// assert_eq!(rivet_cli::namespace::parse_label("team=shop").unwrap(), "k8s:team=shop");
/// assert!(rivet_cli::namespace::parse_label("team").is_err());
/// ```
pub fn parse_label(text: &str) -> Result<String, LabelArgError> {
    let bare = text.strip_prefix("k8s:").unwrap_or(text);
    let Some((key, value)) = bare.split_once('=') else {
        return Err(LabelArgError::NotKeyValue { text: text.into() });
    };
    Label::new(LabelSource::K8s, key, value)
        .map(|label| label.to_string())
        .map_err(|source| LabelArgError::Invalid {
            text: text.into(),
            source,
        })
}

/// Why a label on the command line is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelArgError {
    /// Not `key=value`.
    #[error("`{text}` is not a label: give key=value")]
    NotKeyValue {
        /// What was given.
        text: String,
    },
    /// Not a valid Kubernetes label.
    #[error("`{text}`: {source}")]
    Invalid {
        /// What was given.
        text: String,
        /// Why.
        source: rivet_common::labels::LabelError,
    },
    /// One key twice.
    #[error("label key of `{text}` given twice")]
    KeyTwice {
        /// The second label with that key.
        text: String,
    },
}

/// Every label of `texts` parsed with [`parse_label`], sorted; one key given
/// twice is an error.
pub fn parse_labels(texts: &[String]) -> Result<Vec<String>, LabelArgError> {
    let mut labels = Vec::new();
    let mut keys = std::collections::BTreeSet::new();
    for text in texts {
        let label = parse_label(text)?;
        let key = label.split_once('=').map_or(label.as_str(), |(key, _)| key).to_string();
        if !keys.insert(key) {
            return Err(LabelArgError::KeyTwice { text: text.clone() });
        }
        labels.push(label);
    }
    labels.sort();
    Ok(labels)
}

/// A label as shown in tables: without the `k8s:` every namespace label has.
fn short(label: &str) -> &str {
    label.strip_prefix("k8s:").unwrap_or(label)
}

/// A namespace as printed.
#[derive(Debug, Clone, Serialize)]
pub struct NamespaceView {
    /// Its name.
    name: String,
    /// Its labels, `k8s:key=value`.
    labels: Vec<String>,
    /// Endpoints of pods in it.
    endpoints: u32,
    /// When its labels last changed, Unix nanoseconds; 0 when never set.
    updated_unix_nanos: i64,
}

/// Runs one `rivet namespace` command.
pub async fn run(ctx: &Context, command: NamespaceCommand) -> Result<(), CliError> {
    // Check the labels before connecting: bad input needs no daemon.
    let (namespace, labels) = match &command {
        NamespaceCommand::Label { namespace, labels } => (namespace.clone(), labels.parse()?),
        NamespaceCommand::List => (String::new(), Vec::new()),
    };
    let mut client = NamespaceServiceClient::new(ctx.connect_with_deadline(DAEMON).await?);
    let rpc = |s| CliError::rpc(DAEMON, s);
    match command {
        NamespaceCommand::Label { .. } => {
            let r = client
                .set_namespace_labels(ctx.request(pb::SetNamespaceLabelsRequest {
                    namespace: namespace.clone(),
                    labels: labels.clone(),
                }))
                .await
                .map_err(rpc)?
                .into_inner();
            #[derive(Serialize)]
            struct View {
                namespace: String,
                labels: Vec<String>,
                changed: bool,
                affected_endpoints: u32,
            }
            let view = View {
                namespace,
                labels,
                changed: r.changed,
                affected_endpoints: r.affected_endpoints,
            };
            ctx.print(&view, || match (view.changed, view.labels.is_empty()) {
                (false, _) => format!("namespace {}: labels unchanged\n", view.namespace),
                (true, cleared) => format!(
                    "namespace {}: labels {}; {} endpoints queued for re-identification\n",
                    view.namespace,
                    if cleared { "cleared" } else { "replaced" },
                    view.affected_endpoints
                ),
            });
        }
        NamespaceCommand::List => {
            let r = client
                .list_namespaces(ctx.request(pb::ListNamespacesRequest {}))
                .await
                .map_err(rpc)?
                .into_inner();
            let rows: Vec<NamespaceView> = r
                .namespaces
                .iter()
                .map(|n| NamespaceView {
                    name: n.name.clone(),
                    labels: n.labels.clone(),
                    endpoints: n.endpoints,
                    updated_unix_nanos: n.updated_unix_nanos,
                })
                .collect();
            let now = now_unix_nanos();
            ctx.print(&rows, || {
                let mut t = Table::new(["NAME", "ENDPOINTS", "AGE", "LABELS"]);
                for n in &rows {
                    t.row([
                        n.name.clone(),
                        n.endpoints.to_string(),
                        age(now, n.updated_unix_nanos),
                        if n.labels.is_empty() {
                            "-".into()
                        } else {
                            n.labels.iter().map(|l| short(l)).collect::<Vec<_>>().join(",")
                        },
                    ]);
                }
                t.render()
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_sent_with_source_k8s() {
        assert_eq!(parse_label("team=shop"), Ok("k8s:team=shop".into()));
        assert_eq!(parse_label("k8s:team=shop"), Ok("k8s:team=shop".into()));
        assert_eq!(
            parse_label("kubernetes.io/metadata.name=shop"),
            Ok("k8s:kubernetes.io/metadata.name=shop".into())
        );
        assert_eq!(parse_label("empty="), Ok("k8s:empty".into()));
        for bad in ["team", "=shop", "te am=shop", "team=sh op", "reserved:host="] {
            assert!(parse_label(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn label_sets() {
        let given = |texts: &[&str]| parse_labels(&texts.iter().map(|t| t.to_string()).collect::<Vec<_>>());
        assert_eq!(
            given(&["tier=web", "k8s:team=shop"]),
            Ok(vec!["k8s:team=shop".into(), "k8s:tier=web".into()])
        );
        assert_eq!(given(&[]), Ok(vec![]));
        assert_eq!(
            given(&["team=a", "k8s:team=b"]),
            Err(LabelArgError::KeyTwice {
                text: "k8s:team=b".into()
            })
        );
    }

    #[test]
    fn label_commands_take_a_complete_set_or_clear() {
        use clap::Parser;

        #[derive(Debug, Parser)]
        struct Cli {
            #[command(subcommand)]
            command: NamespaceCommand,
        }
        let parse = |args: &[&str]| Cli::try_parse_from(["rivet"].iter().chain(args)).map(|cli| cli.command);
        let Ok(NamespaceCommand::Label { namespace, labels }) = parse(&["label", "shop", "team=shop", "tier=web"])
        else {
            panic!("a label set parses");
        };
        assert_eq!(namespace, "shop");
        assert_eq!(labels.parse(), Ok(vec!["k8s:team=shop".into(), "k8s:tier=web".into()]));
        let Ok(NamespaceCommand::Label { labels, .. }) = parse(&["label", "shop", "--clear"]) else {
            panic!("--clear parses");
        };
        assert!(labels.clear);
        assert_eq!(labels.parse(), Ok(vec![]));
        assert!(parse(&["label", "shop"]).is_err(), "labels or --clear is required");
        assert!(parse(&["label", "shop", "team=shop", "--clear"]).is_err(), "not both");
    }

    #[test]
    fn tables_show_labels_without_source() {
        assert_eq!(short("k8s:team=shop"), "team=shop");
        assert_eq!(short("other"), "other");
    }
}
