//! MAC addresses as text, `aa:bb:cc:dd:ee:ff`: the form of CNI results, of
//! `ip`'s output and of what `rivet` prints (on the wire a MAC is 6 bytes,
//! `rivet_proto::net`). One formatter and one parser for every crate, so what
//! one side writes the other reads.

use std::fmt::Write as _;

/// Formats as `aa:bb:cc:dd:ee:ff` (lower case, two digits per byte).
pub fn format_mac(mac: &[u8; 6]) -> String {
    let mut out = String::with_capacity(17);
    for (i, byte) in mac.iter().enumerate() {
        if i > 0 {
            out.push(':');
        }
        // Writing to a String cannot fail.
        let _ = write!(out, "{byte:02x}");
    }
    out
}

/// MAC bytes from the wire as text for people: the MAC, `-` for none, and
/// what arrived when it is not 6 bytes.
pub fn format_mac_bytes(raw: &[u8]) -> String {
    match <&[u8; 6]>::try_from(raw) {
        Ok(mac) => format_mac(mac),
        Err(_) if raw.is_empty() => "-".into(),
        Err(_) => format!("<{} bytes>", raw.len()),
    }
}

/// Parses `aa:bb:cc:dd:ee:ff` (either case): exactly six bytes of exactly two
/// hex digits each, nothing around them.
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next()?;
        if part.len() != 2 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_round_trip_and_bad_ones_are_refused() {
        let mac = parse_mac("02:00:c6:12:00:05").expect("a well-formed MAC must parse");
        assert_eq!(mac, [2, 0, 0xc6, 0x12, 0, 5]);
        assert_eq!(format_mac(&mac), "02:00:c6:12:00:05");
        assert_eq!(format_mac(&[2, 0xab, 0, 0x10, 0xff, 1]), "02:ab:00:10:ff:01");
        assert_eq!(format_mac_bytes(&[2, 0xab, 0, 0x10, 0xff, 1]), "02:ab:00:10:ff:01");
        assert_eq!(format_mac_bytes(&[]), "-");
        assert_eq!(format_mac_bytes(&[2, 0]), "<2 bytes>");
        assert_eq!(parse_mac("02:aB:00:10:FF:01"), Some([2, 0xab, 0, 0x10, 0xff, 1]));
        for bad in [
            "",
            "02:00:c6:12:00",
            "02:00:c6:12:00:05:06",
            "02:00:c6:12:00:5",
            "02:00:c6:12:00:+5",
            "zz:00:c6:12:00:05",
            " 02:00:c6:12:00:05",
            "02-00-c6-12-00-05",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad:?} must not parse as a MAC");
        }
    }
}
