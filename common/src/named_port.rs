//! Named container ports (a Kubernetes `containerPort` with a `name`), which
//! NetworkPolicy rules may name instead of a number: the one rule for their
//! names, shared by svc-endpoint, rivet-cni and the CLI.

/// Longest port name (an IANA service name).
pub const MAX_PORT_NAME: usize = 15;

/// Whether `name` is a port name (see [`check_port_name`]), for callers
/// with an error message of their own.
///
/// ```
/// assert!(rivet_common::named_port::is_port_name("metrics"));
/// ```
pub fn is_port_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_PORT_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && name.bytes().any(|b| b.is_ascii_lowercase())
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.contains("--")
}

/// Checks a port name as Kubernetes does (an IANA service name: 1 to 15 of
/// `a-z 0-9 -`, at least one letter, no `-` at either end nor two in a row).
///
/// ```
/// use rivet_common::named_port::check_port_name;
/// assert!(check_port_name("http-alt").is_ok());
/// assert!(check_port_name("8080").is_err());
/// assert!(check_port_name("Web").is_err());
/// ```
pub fn check_port_name(name: &str) -> Result<(), String> {
    if is_port_name(name) {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a valid port name (1 to {MAX_PORT_NAME} of a-z 0-9 -, with a letter, \
             no - at either end or twice in a row)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iana_service_names() {
        for good in ["http", "h2c", "metrics-1", "a", "abcdefghijklmno"] {
            assert!(check_port_name(good).is_ok(), "{good}");
        }
        for bad in ["", "80", "-web", "web-", "we--b", "Web", "web_1", "abcdefghijklmnop"] {
            let err = check_port_name(bad).unwrap_err();
            assert!(err.contains("not a valid port name"), "{bad}: {err}");
        }
    }
}
