//! Addresses and prefixes written as text in tests, in their wire form
//! (`rivet_proto::net`). Prefixes are taken as written, host bits and all, so
//! tests can also send what a server must refuse.

use std::net::IpAddr;

use rivet_proto::net::{self, IpPrefix};

/// The wire bytes of an address written as text.
///
/// ```
/// assert_eq!(rivet_testkit::wire::address("198.18.0.5"), [198, 18, 0, 5]);
/// ```
pub fn address(text: &str) -> Vec<u8> {
    net::address_bytes(parse_address(text))
}

/// A prefix written as `address/length`, or a bare address for its host
/// prefix, unchecked.
///
/// ```
/// use rivet_testkit::wire::prefix;
/// assert_eq!(prefix("198.18.0.5").prefix_length, 32);
/// assert_eq!(prefix("198.18.0.5/24").address, [198, 18, 0, 5]);
/// ```
pub fn prefix(text: &str) -> IpPrefix {
    let (address, length) = match text.split_once('/') {
        Some((a, l)) => {
            let length = l
                .parse()
                .unwrap_or_else(|e| panic!("{text:?}: a bad prefix length: {e}"));
            (parse_address(a), length)
        }
        None => {
            let a = parse_address(text);
            (a, if a.is_ipv4() { 32 } else { 128 })
        }
    };
    IpPrefix {
        address: net::address_bytes(address),
        prefix_length: length,
    }
}

/// A prefix from the wire as text (`198.18.0.5/32`), for assertions.
pub fn text(prefix: &IpPrefix) -> String {
    net::format_prefix(prefix)
}

fn parse_address(text: &str) -> IpAddr {
    text.parse()
        .unwrap_or_else(|e| panic!("{text:?} is not an address: {e}"))
}
