//! IP addresses, prefixes and MACs on the wire, one encoding for every Rivet
//! API (`rivet/net/v1/net.proto`): an address is its raw bytes (4 = IPv4,
//! 16 = IPv6; IPv4 is never sent as IPv4-mapped IPv6), a prefix is an
//! [`IpPrefix`] (address bytes and a length, no bits set beyond the length),
//! a MAC is 6 bytes. Every crate converts through this module; none has its
//! own copy.
//!
//! Bytes rather than text: a length check is the whole validation (no
//! parser differences, zone ids, leading zeros or IPv4-mapped spellings to
//! argue about at the privileged loader, which takes no free-form strings),
//! and an address costs 4 or 16 bytes in the ipcache pushes of thousands of
//! entries. Tools print them as text (`rivet`, [`format_address`]).
//!
//! ```
//! use std::net::IpAddr;
//! use rivet_proto::net;
//! let a: IpAddr = "2001:2::5".parse().unwrap();
//! assert_eq!(net::address_from_bytes(&net::address_bytes(a)), Ok(a));
//! let p: ipnet::IpNet = "198.18.0.0/15".parse().unwrap();
//! assert_eq!(net::prefix_from_proto(&net::prefix_to_proto(p)), Ok(p));
//! ```

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// The shared messages (`rivet.net.v1`), imported by every API.
pub mod v1 {
    tonic::include_proto!("rivet.net.v1");
}

pub use v1::IpPrefix;

/// Why bytes on the wire are not an address or a prefix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    /// Neither 4 nor 16 bytes.
    #[error("must be 4 or 16 bytes, got {len}")]
    Length {
        /// The length received.
        len: usize,
    },
    /// IPv4 sent as IPv4-mapped IPv6.
    #[error("{address} is IPv4-mapped IPv6; send IPv4 as 4 bytes")]
    Ipv4Mapped {
        /// The address received.
        address: Ipv6Addr,
    },
    /// A prefix length beyond the family's bits.
    #[error("prefix length {length} is longer than {max} bits")]
    PrefixLength {
        /// The length received.
        length: u32,
        /// The family's bits (32 or 128).
        max: u8,
    },
    /// Bits set beyond the prefix length.
    #[error("{address}/{length} has host bits set; did you mean {network}?")]
    HostBits {
        /// The address received.
        address: IpAddr,
        /// Its prefix length.
        length: u8,
        /// The prefix with the host bits cleared.
        network: IpNet,
    },
}

/// Why bytes on the wire are not a MAC.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("must be 6 bytes, got {len}")]
pub struct MacLengthError {
    /// The length received.
    pub len: usize,
}

/// A MAC from the wire: exactly 6 bytes.
pub fn mac_from_bytes(raw: &[u8]) -> Result<[u8; 6], MacLengthError> {
    <[u8; 6]>::try_from(raw).map_err(|_| MacLengthError { len: raw.len() })
}

/// An address as it goes on the wire.
pub fn address_bytes(address: IpAddr) -> Vec<u8> {
    match address {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// An address from the wire: 4 or 16 bytes, IPv4 never as IPv4-mapped IPv6.
pub fn address_from_bytes(raw: &[u8]) -> Result<IpAddr, AddressError> {
    if let Ok(v4) = <[u8; 4]>::try_from(raw) {
        return Ok(IpAddr::V4(Ipv4Addr::from(v4)));
    }
    let v6 = Ipv6Addr::from(<[u8; 16]>::try_from(raw).map_err(|_| AddressError::Length { len: raw.len() })?);
    if v6.to_ipv4_mapped().is_some() {
        return Err(AddressError::Ipv4Mapped { address: v6 });
    }
    Ok(IpAddr::V6(v6))
}

/// An optional address from the wire: empty bytes are `None`.
pub fn optional_address_from_bytes(raw: &[u8]) -> Result<Option<IpAddr>, AddressError> {
    if raw.is_empty() {
        return Ok(None);
    }
    address_from_bytes(raw).map(Some)
}

/// A prefix as it goes on the wire.
pub fn prefix_to_proto(prefix: IpNet) -> IpPrefix {
    IpPrefix {
        address: address_bytes(prefix.addr()),
        prefix_length: u32::from(prefix.prefix_len()),
    }
}

/// The host prefix of an address (/32 or /128) as it goes on the wire.
pub fn host_prefix(address: IpAddr) -> IpPrefix {
    prefix_to_proto(IpNet::from(address))
}

/// A prefix from the wire; host bits must be zero.
pub fn prefix_from_proto(prefix: &IpPrefix) -> Result<IpNet, AddressError> {
    let address = address_from_bytes(&prefix.address)?;
    let max = if address.is_ipv4() { 32 } else { 128 };
    let length = u8::try_from(prefix.prefix_length)
        .ok()
        .filter(|l| *l <= max)
        .ok_or(AddressError::PrefixLength {
            length: prefix.prefix_length,
            max,
        })?;
    let net = IpNet::new(address, length).expect("length checked against the family");
    if net.network() != address {
        return Err(AddressError::HostBits {
            address,
            length,
            network: net.trunc(),
        });
    }
    Ok(net)
}

/// Address bytes as text for people: the address, `-` for none, and what
/// arrived when it is not an address.
pub fn format_address(raw: &[u8]) -> String {
    match optional_address_from_bytes(raw) {
        Ok(Some(a)) => a.to_string(),
        Ok(None) => "-".into(),
        Err(_) => format!("<{} bytes>", raw.len()),
    }
}

/// A prefix as text for people: `198.18.0.0/15`, with the address shown as
/// [`format_address`] shows it when it is not one.
pub fn format_prefix(prefix: &IpPrefix) -> String {
    format!("{}/{}", format_address(&prefix.address), prefix.prefix_length)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_and_bad_lengths_are_named() {
        for text in ["198.18.0.5", "2001:2::5", "0.0.0.0", "::"] {
            let a: IpAddr = text.parse().unwrap();
            assert_eq!(address_from_bytes(&address_bytes(a)), Ok(a));
        }
        assert_eq!(address_bytes("198.18.0.5".parse().unwrap()).len(), 4);
        assert_eq!(address_from_bytes(&[1, 2, 3]), Err(AddressError::Length { len: 3 }));
        assert_eq!(optional_address_from_bytes(&[]), Ok(None));
        let mapped: Ipv6Addr = "::ffff:198.18.0.3".parse().unwrap();
        assert_eq!(
            address_from_bytes(&mapped.octets()),
            Err(AddressError::Ipv4Mapped { address: mapped })
        );
    }

    #[test]
    fn prefixes_round_trip_and_host_bits_are_refused() {
        for text in ["198.18.0.0/15", "2001:2::/48", "0.0.0.0/0", "198.18.0.5/32"] {
            let p: IpNet = text.parse().unwrap();
            assert_eq!(prefix_from_proto(&prefix_to_proto(p)), Ok(p));
        }
        let host_bits = IpPrefix {
            address: vec![198, 18, 0, 5],
            prefix_length: 24,
        };
        assert_eq!(
            prefix_from_proto(&host_bits).unwrap_err().to_string(),
            "198.18.0.5/24 has host bits set; did you mean 198.18.0.0/24?"
        );
        let too_long = IpPrefix {
            address: vec![198, 18, 0, 0],
            prefix_length: 33,
        };
        assert_eq!(
            prefix_from_proto(&too_long),
            Err(AddressError::PrefixLength { length: 33, max: 32 })
        );
    }

    #[test]
    fn macs_are_six_bytes() {
        assert_eq!(mac_from_bytes(&[2, 0, 0, 0, 0, 1]), Ok([2, 0, 0, 0, 0, 1]));
        assert_eq!(mac_from_bytes(b"02:00:00:00:00:01"), Err(MacLengthError { len: 17 }));
        assert_eq!(mac_from_bytes(&[]), Err(MacLengthError { len: 0 }));
    }

    #[test]
    fn formatting_for_people() {
        assert_eq!(format_address(&[198, 18, 0, 1]), "198.18.0.1");
        assert_eq!(format_address(&[]), "-");
        assert_eq!(format_address(&[1, 2]), "<2 bytes>");
        assert_eq!(
            format_prefix(&prefix_to_proto("2001:2::/48".parse().unwrap())),
            "2001:2::/48"
        );
    }
}
