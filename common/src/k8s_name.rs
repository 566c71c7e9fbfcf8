//! Kubernetes name rules: DNS-1123 labels (namespace and pod names under 63
//! characters), DNS-1123 subdomains (object names, label-key prefixes), and
//! label keys and values. The one place these rules are written; labels,
//! policy documents, svc-endpoint's API and the CLI all check names here.
//!
//! Errors say what is wrong, not which value: callers name the value and the
//! field (`metadata.namespace: "a.b" must be a DNS-1123 label: ...`).

/// Longest DNS-1123 label (a namespace, a label key's name, a label value).
pub const MAX_DNS_LABEL: usize = 63;
/// Longest DNS-1123 subdomain (an object name, a label key's prefix).
pub const MAX_DNS_SUBDOMAIN: usize = 253;
/// Longest label key name and label value.
pub const MAX_LABEL_NAME: usize = 63;

/// The form of one DNS-1123 label.
const DNS_LABEL_FORM: &str = "lowercase alphanumerics and '-', starting and ending with an alphanumeric";
/// The form of a label key's name and a label value.
pub const LABEL_NAME_FORM: &str = "alphanumerics, '-', '_' and '.', starting and ending with an alphanumeric";

/// Why a name breaks a Kubernetes name rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// Longer than the rule allows.
    #[error("must be at most {max} characters, found {found}")]
    TooLong {
        /// The longest allowed.
        max: usize,
        /// Its length.
        found: usize,
    },
    /// Not a DNS-1123 label (empty included).
    #[error("must be a DNS-1123 label: {DNS_LABEL_FORM}")]
    NotDnsLabel,
    /// Not a DNS-1123 subdomain (empty included).
    #[error("must be a DNS-1123 subdomain: {DNS_LABEL_FORM}, in parts separated by '.'")]
    NotDnsSubdomain,
    /// A label key `/name` with nothing before the `/`.
    #[error("has an empty prefix before '/'")]
    EmptyPrefix,
    /// A label key whose prefix is not a DNS-1123 subdomain.
    #[error(
        "has prefix {prefix:?}, which is not a DNS subdomain (lowercase alphanumerics, '-' and '.', each part starting and ending with an alphanumeric)"
    )]
    PrefixNotDnsSubdomain {
        /// The prefix.
        prefix: String,
    },
    /// A label key whose prefix is too long.
    #[error("has a prefix of {found} characters (at most {MAX_DNS_SUBDOMAIN})")]
    PrefixTooLong {
        /// Its length.
        found: usize,
    },
    /// A label key with no name (empty, or nothing after `prefix/`).
    #[error("has an empty name")]
    EmptyName,
    /// A label key with two or more `/`.
    #[error("has more than one '/' (a key is [prefix/]name)")]
    SlashInName,
    /// A label key whose name is not of [`LABEL_NAME_FORM`].
    #[error("has name {name:?}, which is not {LABEL_NAME_FORM}")]
    BadName {
        /// The name part.
        name: String,
    },
    /// A label key whose name is too long.
    #[error("has a name of {found} characters (at most {MAX_LABEL_NAME})")]
    NameTooLong {
        /// Its length.
        found: usize,
    },
    /// A label value not of [`LABEL_NAME_FORM`].
    #[error("must be empty or {LABEL_NAME_FORM}")]
    BadValue,
    /// A label value that is too long.
    #[error("is {found} characters long (at most {MAX_LABEL_NAME})")]
    ValueTooLong {
        /// Its length.
        found: usize,
    },
}

/// Whether `s` has the form of a DNS-1123 label, length not checked.
fn is_dns_label_form(s: &str) -> bool {
    let b = s.as_bytes();
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    match (b.first(), b.last()) {
        (Some(first), Some(last)) => alnum(first) && alnum(last) && b.iter().all(|c| alnum(c) || *c == b'-'),
        _ => false,
    }
}

/// Whether `s` has the form of a label name or value, length not checked.
fn is_label_name_form(s: &str) -> bool {
    let b = s.as_bytes();
    match (b.first(), b.last()) {
        (Some(first), Some(last)) => {
            first.is_ascii_alphanumeric()
                && last.is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

/// Checks a DNS-1123 label: 1 to 63 of `a-z 0-9 -`, an alphanumeric at
/// both ends. Namespace names are DNS labels.
///
/// ```
/// use rivet_common::k8s_name::{NameError, check_dns_label};
///
/// assert!(check_dns_label("kube-system").is_ok());
/// assert_eq!(check_dns_label("a.b"), Err(NameError::NotDnsLabel));
/// ```
pub fn check_dns_label(s: &str) -> Result<(), NameError> {
    if s.len() > MAX_DNS_LABEL {
        return Err(NameError::TooLong {
            max: MAX_DNS_LABEL,
            found: s.len(),
        });
    }
    if !is_dns_label_form(s) {
        return Err(NameError::NotDnsLabel);
    }
    Ok(())
}

/// Checks a DNS-1123 subdomain: at most 253 characters of DNS labels joined
/// by `.`. Most object names (pods, policies) are DNS subdomains.
///
/// ```
/// use rivet_common::k8s_name::check_dns_subdomain;
///
/// assert!(check_dns_subdomain("web-1.shop").is_ok());
/// assert!(check_dns_subdomain("web..1").is_err());
/// ```
pub fn check_dns_subdomain(s: &str) -> Result<(), NameError> {
    if s.len() > MAX_DNS_SUBDOMAIN {
        return Err(NameError::TooLong {
            max: MAX_DNS_SUBDOMAIN,
            found: s.len(),
        });
    }
    if !s.split('.').all(is_dns_label_form) {
        return Err(NameError::NotDnsSubdomain);
    }
    Ok(())
}

/// Checks a namespace name (a DNS-1123 label).
pub fn check_namespace(s: &str) -> Result<(), NameError> {
    check_dns_label(s)
}

/// Checks a label key: `[prefix/]name`, the prefix a DNS-1123 subdomain of
/// at most 253 characters, the name 1 to 63 of [`LABEL_NAME_FORM`].
///
/// ```
/// use rivet_common::k8s_name::{NameError, check_label_key};
///
/// assert!(check_label_key("app.kubernetes.io/name").is_ok());
/// assert_eq!(check_label_key("a/b/c"), Err(NameError::SlashInName));
/// ```
pub fn check_label_key(key: &str) -> Result<(), NameError> {
    let name = match key.split_once('/') {
        Some((prefix, name)) => {
            if prefix.is_empty() {
                return Err(NameError::EmptyPrefix);
            }
            if prefix.len() > MAX_DNS_SUBDOMAIN {
                return Err(NameError::PrefixTooLong { found: prefix.len() });
            }
            if !prefix.split('.').all(is_dns_label_form) {
                return Err(NameError::PrefixNotDnsSubdomain { prefix: prefix.into() });
            }
            if name.contains('/') {
                return Err(NameError::SlashInName);
            }
            name
        }
        None => key,
    };
    if name.is_empty() {
        return Err(NameError::EmptyName);
    }
    if !is_label_name_form(name) {
        return Err(NameError::BadName { name: name.into() });
    }
    if name.len() > MAX_LABEL_NAME {
        return Err(NameError::NameTooLong { found: name.len() });
    }
    Ok(())
}

/// Checks a label value: empty, or 1 to 63 of [`LABEL_NAME_FORM`].
///
/// ```
/// use rivet_common::k8s_name::check_label_value;
///
/// assert!(check_label_value("").is_ok());
/// assert!(check_label_value("v1.2_b").is_ok());
/// assert!(check_label_value("-x").is_err());
/// ```
pub fn check_label_value(value: &str) -> Result<(), NameError> {
    if value.is_empty() {
        return Ok(());
    }
    if !is_label_name_form(value) {
        return Err(NameError::BadValue);
    }
    if value.len() > MAX_LABEL_NAME {
        return Err(NameError::ValueTooLong { found: value.len() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_labels_and_subdomains() {
        for good in ["a", "kube-system", "0", "a1-b2", &"a".repeat(63)] {
            assert_eq!(check_dns_label(good), Ok(()), "{good}");
        }
        for (bad, err) in [
            ("", NameError::NotDnsLabel),
            ("a.b", NameError::NotDnsLabel),
            ("-a", NameError::NotDnsLabel),
            ("a-", NameError::NotDnsLabel),
            ("A", NameError::NotDnsLabel),
            ("a_b", NameError::NotDnsLabel),
            (&"a".repeat(64), NameError::TooLong { max: 63, found: 64 }),
        ] {
            assert_eq!(check_dns_label(bad), Err(err), "{bad}");
        }
        for good in [
            "a",
            "a.b-c.d",
            "web-1.shop",
            &format!("{}.{}", "a".repeat(63), "b".repeat(63)),
        ] {
            assert_eq!(check_dns_subdomain(good), Ok(()), "{good}");
        }
        for bad in ["", "A", "a_b", "-a", "a-", "a..b", ".a", "a.", "a.-b"] {
            assert_eq!(check_dns_subdomain(bad), Err(NameError::NotDnsSubdomain), "{bad}");
        }
        assert_eq!(
            check_dns_subdomain(&"a".repeat(254)),
            Err(NameError::TooLong { max: 253, found: 254 })
        );
        assert_eq!(check_namespace("a.b"), Err(NameError::NotDnsLabel));
    }

    #[test]
    fn label_keys_and_values() {
        for good in ["app", "app.kubernetes.io/name", "A_b.c-D", "x/y", &"a".repeat(63)] {
            assert_eq!(check_label_key(good), Ok(()), "{good}");
        }
        let name64 = "a".repeat(64);
        for (bad, err) in [
            ("", NameError::EmptyName),
            ("/a", NameError::EmptyPrefix),
            ("a/", NameError::EmptyName),
            ("a/b/c", NameError::SlashInName),
            ("a b", NameError::BadName { name: "a b".into() }),
            ("-a", NameError::BadName { name: "-a".into() }),
            ("A/b", NameError::PrefixNotDnsSubdomain { prefix: "A".into() }),
            ("a..b/c", NameError::PrefixNotDnsSubdomain { prefix: "a..b".into() }),
            (&name64, NameError::NameTooLong { found: 64 }),
            (
                &format!("{}/a", "a".repeat(254)),
                NameError::PrefixTooLong { found: 254 },
            ),
        ] {
            assert_eq!(check_label_key(bad), Err(err), "{bad}");
        }
        for good in ["", "v1", "a.b_c-D", &"a".repeat(63)] {
            assert_eq!(check_label_value(good), Ok(()), "{good}");
        }
        for (bad, err) in [
            ("-a", NameError::BadValue),
            ("a b", NameError::BadValue),
            ("a/b", NameError::BadValue),
            ("é", NameError::BadValue),
            (&name64, NameError::ValueTooLong { found: 64 }),
        ] {
            assert_eq!(check_label_value(bad), Err(err), "{bad}");
        }
    }
}
