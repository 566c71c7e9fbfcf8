//! Brings the keys under one prefix to the desired values: the plan is
//! pure ([`plan`]), the writes are compare-and-swap transactions fenced on
//! the term ([`apply`]).
//!
//! Rules: a key whose value already matches is not written; a key with a
//! lease is never written or deleted (a node's own record, on its own
//! lease, multi-node); a key no object accounts for is deleted (the
//! leftover sweep). Each write compares the key's mod revision with the one
//! listed, so a key changed in between (a node registering itself) is left
//! to the next pass.

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, GetOptions, Txn, TxnOp};

use crate::kvstore::{RequestError, request};
use crate::term::{NotLeading, Term};

/// Bound of one etcd request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A key as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// Its value.
    pub value: Vec<u8>,
    /// Its mod revision.
    pub mod_revision: i64,
    /// Its lease (0: none).
    pub lease: i64,
}

/// One write of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// Put `value` at `key`, if its mod revision is still `seen` (0: absent).
    Put {
        /// The key.
        key: String,
        /// The value.
        value: String,
        /// Mod revision when listed, 0 when absent.
        seen: i64,
    },
    /// Delete `key`, if its mod revision is still `seen`.
    Delete {
        /// The key.
        key: String,
        /// Mod revision when listed.
        seen: i64,
    },
}

impl Write {
    /// The key written.
    pub fn key(&self) -> &str {
        match self {
            Self::Put { key, .. } | Self::Delete { key, .. } => key,
        }
    }

    /// What the write does: `created`, `updated` or `deleted`.
    pub fn action(&self) -> &'static str {
        match self {
            Self::Put { seen: 0, .. } => "created",
            Self::Put { .. } => "updated",
            Self::Delete { .. } => "deleted",
        }
    }
}

/// The writes that make `listed` (the keys under the prefix) `desired`.
///
/// ```
/// use std::collections::BTreeMap;
/// use rivet_operator::kvstore_mirror::sync::{plan, Listed, Write};
/// let listed = BTreeMap::from([
///     ("p/same".to_string(), Listed { value: b"1".to_vec(), mod_revision: 4, lease: 0 }),
///     ("p/old".to_string(), Listed { value: b"1".to_vec(), mod_revision: 5, lease: 0 }),
///     ("p/leased".to_string(), Listed { value: b"1".to_vec(), mod_revision: 6, lease: 77 }),
/// ]);
/// let desired = BTreeMap::from([("p/same".to_string(), "1".to_string()), ("p/new".to_string(), "2".to_string())]);
/// assert_eq!(plan(&listed, &desired), [
///     Write::Put { key: "p/new".into(), value: "2".into(), seen: 0 },
///     Write::Delete { key: "p/old".into(), seen: 5 },
/// ]);
/// ```
pub fn plan(listed: &BTreeMap<String, Listed>, desired: &BTreeMap<String, String>) -> Vec<Write> {
    let mut writes = Vec::new();
    for (key, value) in desired {
        match listed.get(key) {
            None => writes.push(Write::Put {
                key: key.clone(),
                value: value.clone(),
                seen: 0,
            }),
            // A node's own record: it is the authority on it.
            Some(l) if l.lease != 0 => {}
            Some(l) if l.value == value.as_bytes() => {}
            Some(l) => writes.push(Write::Put {
                key: key.clone(),
                value: value.clone(),
                seen: l.mod_revision,
            }),
        }
    }
    for (key, l) in listed {
        if l.lease == 0 && !desired.contains_key(key) {
            writes.push(Write::Delete {
                key: key.clone(),
                seen: l.mod_revision,
            });
        }
    }
    writes
}

/// Why a pass did not complete.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// This replica does not lead.
    #[error("{action}: {source}")]
    NotLeading {
        /// What was being done.
        action: String,
        /// The term's verdict.
        #[source]
        source: NotLeading,
    },
    /// An etcd request failed.
    #[error(transparent)]
    Request(#[from] RequestError),
}

impl SyncError {
    /// The metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotLeading { .. } => "not_leading",
            Self::Request(e) => e.kind(),
        }
    }
}

/// Every key under `prefix`.
pub async fn list(client: &Client, prefix: &str) -> Result<BTreeMap<String, Listed>, SyncError> {
    let mut kv = client.kv_client();
    let resp = request(
        || format!("listing {prefix}"),
        REQUEST_TIMEOUT,
        kv.get(prefix, Some(GetOptions::new().with_prefix())),
    )
    .await?;
    Ok(resp
        .kvs()
        .iter()
        .map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                Listed {
                    value: kv.value().to_vec(),
                    mod_revision: kv.mod_revision(),
                    lease: kv.lease(),
                },
            )
        })
        .collect())
}

/// What one write came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Done.
    Written,
    /// The key changed since it was listed; the next pass sees it.
    Conflict,
}

/// Applies `write` after [`Term::ensure`], as a transaction comparing the
/// key's mod revision with the one listed.
pub async fn apply(client: &Client, term: &Term, write: &Write) -> Result<Applied, SyncError> {
    let action = || format!("{} {}", write.action(), write.key());
    term.ensure().map_err(|source| SyncError::NotLeading {
        action: action(),
        source,
    })?;
    let (key, seen, op) = match write {
        Write::Put { key, value, seen } => (key, *seen, TxnOp::put(key.as_str(), value.as_str(), None)),
        Write::Delete { key, seen } => (key, *seen, TxnOp::delete(key.as_str(), None)),
    };
    let txn = Txn::new()
        .when([Compare::mod_revision(key.as_str(), CompareOp::Equal, seen)])
        .and_then([op]);
    let mut kv = client.kv_client();
    let resp = request(action, REQUEST_TIMEOUT, kv.txn(txn)).await?;
    Ok(if resp.succeeded() {
        Applied::Written
    } else {
        Applied::Conflict
    })
}
