//! Raw frames for datapath tests: Ethernet, IPv4 (with fragments), IPv6
//! (with extension headers and fragments), TCP, UDP, SCTP, ICMP and ICMPv6,
//! checksums included, and sending them from an interface with an
//! AF_PACKET socket. Built by hand so that tests can also build what a
//! normal stack never sends (long or broken extension header chains,
//! fragments out of order, ND from the wrong source).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// EtherType of IPv4.
pub const ETH_P_IP: u16 = 0x0800;
/// EtherType of IPv6.
pub const ETH_P_IPV6: u16 = 0x86dd;

/// IP protocol numbers used here.
pub mod proto {
    /// IPv6 Hop-by-Hop Options.
    pub const HOP_BY_HOP: u8 = 0;
    /// ICMP.
    pub const ICMP: u8 = 1;
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
    /// IPv6 Routing header.
    pub const ROUTING: u8 = 43;
    /// IPv6 Fragment header.
    pub const FRAGMENT: u8 = 44;
    /// Authentication Header.
    pub const AH: u8 = 51;
    /// ICMPv6.
    pub const ICMPV6: u8 = 58;
    /// IPv6 Destination Options.
    pub const DEST_OPTS: u8 = 60;
    /// SCTP.
    pub const SCTP: u8 = 132;
}

/// TCP flag SYN.
pub const TCP_SYN: u8 = 0x02;
/// TCP flag ACK.
pub const TCP_ACK: u8 = 0x10;

/// An Ethernet frame around `payload`.
pub fn ethernet(dst: [u8; 6], src: [u8; 6], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(14 + payload.len());
    frame.extend_from_slice(&dst);
    frame.extend_from_slice(&src);
    frame.extend_from_slice(&ethertype.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// The one's complement sum of `data` folded to 16 bits (not inverted).
fn sum16(mut acc: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u32::from(*last) << 8;
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// The Internet checksum of `data` (ICMPv4, the IPv4 header).
pub fn checksum(data: &[u8]) -> u16 {
    fold(sum16(0, data))
}

/// The TCP/UDP/ICMPv6 checksum of `segment` with the pseudo header of
/// `src` → `dst`, protocol `protocol`.
pub fn l4_checksum(src: IpAddr, dst: IpAddr, protocol: u8, segment: &[u8]) -> u16 {
    let mut acc = 0;
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            acc = sum16(acc, &s.octets());
            acc = sum16(acc, &d.octets());
            acc = sum16(acc, &[0, protocol]);
            acc = sum16(acc, &(segment.len() as u16).to_be_bytes());
        }
        (s, d) => {
            acc = sum16(acc, &v6(s).octets());
            acc = sum16(acc, &v6(d).octets());
            acc = sum16(acc, &(segment.len() as u32).to_be_bytes());
            acc = sum16(acc, &[0, 0, 0, protocol]);
        }
    }
    fold(sum16(acc, segment))
}

fn v6(a: IpAddr) -> Ipv6Addr {
    match a {
        IpAddr::V6(a) => a,
        IpAddr::V4(a) => a.to_ipv6_mapped(),
    }
}

/// A TCP segment (20-byte header, no data) with its checksum.
pub fn tcp(src: IpAddr, dst: IpAddr, sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    let mut s = Vec::with_capacity(20);
    s.extend_from_slice(&sport.to_be_bytes());
    s.extend_from_slice(&dport.to_be_bytes());
    s.extend_from_slice(&1u32.to_be_bytes()); // sequence
    s.extend_from_slice(&0u32.to_be_bytes()); // ack
    s.extend_from_slice(&[5 << 4, flags]);
    s.extend_from_slice(&64240u16.to_be_bytes()); // window
    s.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent
    let sum = l4_checksum(src, dst, proto::TCP, &s);
    s[16..18].copy_from_slice(&sum.to_be_bytes());
    s
}

/// A UDP datagram with its checksum.
pub fn udp(src: IpAddr, dst: IpAddr, sport: u16, dport: u16, data: &[u8]) -> Vec<u8> {
    let mut s = Vec::with_capacity(8 + data.len());
    s.extend_from_slice(&sport.to_be_bytes());
    s.extend_from_slice(&dport.to_be_bytes());
    s.extend_from_slice(&((8 + data.len()) as u16).to_be_bytes());
    s.extend_from_slice(&[0, 0]);
    s.extend_from_slice(data);
    let sum = match l4_checksum(src, dst, proto::UDP, &s) {
        0 => 0xffff,
        sum => sum,
    };
    s[6..8].copy_from_slice(&sum.to_be_bytes());
    s
}

/// An SCTP common header (no chunks; the datapath reads only the ports).
pub fn sctp(sport: u16, dport: u16) -> Vec<u8> {
    let mut s = Vec::with_capacity(12);
    s.extend_from_slice(&sport.to_be_bytes());
    s.extend_from_slice(&dport.to_be_bytes());
    s.extend_from_slice(&[0; 8]); // verification tag, checksum
    s
}

/// An ICMP (v4) message: type, code, the 4 bytes after the checksum (echo:
/// identifier and sequence) and `data`.
pub fn icmp4(kind: u8, code: u8, rest: [u8; 4], data: &[u8]) -> Vec<u8> {
    let mut s = vec![kind, code, 0, 0];
    s.extend_from_slice(&rest);
    s.extend_from_slice(data);
    let sum = checksum(&s);
    s[2..4].copy_from_slice(&sum.to_be_bytes());
    s
}

/// An ICMPv6 message from `src` to `dst` (the checksum covers both).
pub fn icmp6(src: Ipv6Addr, dst: Ipv6Addr, kind: u8, code: u8, rest: [u8; 4], data: &[u8]) -> Vec<u8> {
    let mut s = vec![kind, code, 0, 0];
    s.extend_from_slice(&rest);
    s.extend_from_slice(data);
    let sum = l4_checksum(IpAddr::V6(src), IpAddr::V6(dst), proto::ICMPV6, &s);
    s[2..4].copy_from_slice(&sum.to_be_bytes());
    s
}

/// The 4 bytes after an echo's checksum: identifier and sequence number.
pub fn echo_rest(identifier: u16, sequence: u16) -> [u8; 4] {
    let [a, b] = identifier.to_be_bytes();
    let [c, d] = sequence.to_be_bytes();
    [a, b, c, d]
}

/// An IPv4 packet. `fragment`: the offset in bytes (a multiple of 8) and
/// the More Fragments flag; `None` is an unfragmented packet with DF clear.
pub fn ipv4(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    protocol: u8,
    ttl: u8,
    id: u16,
    fragment: Option<(u16, bool)>,
    payload: &[u8],
) -> Vec<u8> {
    let (offset, more) = fragment.unwrap_or((0, false));
    assert_eq!(offset % 8, 0, "fragment offsets are multiples of 8");
    let flags_offset = (offset / 8) | if more { 0x2000 } else { 0 };
    let mut p = Vec::with_capacity(20 + payload.len());
    p.extend_from_slice(&[0x45, 0]);
    p.extend_from_slice(&((20 + payload.len()) as u16).to_be_bytes());
    p.extend_from_slice(&id.to_be_bytes());
    p.extend_from_slice(&flags_offset.to_be_bytes());
    p.extend_from_slice(&[ttl, protocol, 0, 0]);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    let sum = checksum(&p);
    p[10..12].copy_from_slice(&sum.to_be_bytes());
    p.extend_from_slice(payload);
    p
}

/// An IPv6 extension header; [`ipv6`] fills in each one's Next Header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtHeader {
    /// Hop-by-Hop Options of `8 * (1 + len)` bytes (PadN).
    HopByHop {
        /// The Hdr Ext Len field.
        len: u8,
    },
    /// Destination Options of `8 * (1 + len)` bytes (PadN).
    DestinationOptions {
        /// The Hdr Ext Len field.
        len: u8,
    },
    /// A Routing header of type 0 with no segments left, `8 * (1 + len)` bytes.
    Routing {
        /// The Hdr Ext Len field.
        len: u8,
    },
    /// A Fragment header.
    Fragment {
        /// Offset in bytes (a multiple of 8).
        offset: u16,
        /// More Fragments.
        more: bool,
        /// Identification.
        id: u32,
    },
    /// An Authentication Header of `4 * (2 + len)` bytes (its length unit
    /// differs from the other headers').
    Authentication {
        /// The Payload Len field (at least 1).
        len: u8,
    },
    /// Any header: Next Header is prepended, `bytes` follow it as they are.
    Raw {
        /// Its protocol number (what the previous header names).
        kind: u8,
        /// Everything after the Next Header byte.
        bytes: Vec<u8>,
    },
}

impl ExtHeader {
    /// The protocol number naming this header.
    pub fn kind(&self) -> u8 {
        match self {
            Self::HopByHop { .. } => proto::HOP_BY_HOP,
            Self::DestinationOptions { .. } => proto::DEST_OPTS,
            Self::Routing { .. } => proto::ROUTING,
            Self::Fragment { .. } => proto::FRAGMENT,
            Self::Authentication { .. } => proto::AH,
            Self::Raw { kind, .. } => *kind,
        }
    }

    fn encode(&self, next: u8, out: &mut Vec<u8>) {
        match self {
            Self::HopByHop { len } | Self::DestinationOptions { len } => {
                let total = 8 * (1 + usize::from(*len));
                out.extend_from_slice(&[next, *len, 1, (total - 4) as u8]);
                out.extend(std::iter::repeat_n(0, total - 4));
            }
            Self::Routing { len } => {
                let total = 8 * (1 + usize::from(*len));
                out.extend_from_slice(&[next, *len, 0, 0]);
                out.extend(std::iter::repeat_n(0, total - 4));
            }
            Self::Fragment { offset, more, id } => {
                assert_eq!(offset % 8, 0, "fragment offsets are multiples of 8");
                let field = offset | u16::from(*more);
                out.extend_from_slice(&[next, 0]);
                out.extend_from_slice(&field.to_be_bytes());
                out.extend_from_slice(&id.to_be_bytes());
            }
            Self::Authentication { len } => {
                let total = 4 * (2 + usize::from(*len));
                out.extend_from_slice(&[next, *len, 0, 0]);
                out.extend_from_slice(&0x100u32.to_be_bytes()); // SPI
                out.extend(std::iter::repeat_n(0, total - 8));
            }
            Self::Raw { bytes, .. } => {
                out.push(next);
                out.extend_from_slice(bytes);
            }
        }
    }
}

/// An IPv6 packet: the header, `headers` in order, then `payload` of
/// protocol `protocol`.
pub fn ipv6(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    hop_limit: u8,
    headers: &[ExtHeader],
    protocol: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut body = Vec::new();
    for (i, h) in headers.iter().enumerate() {
        let next = headers.get(i + 1).map_or(protocol, ExtHeader::kind);
        h.encode(next, &mut body);
    }
    body.extend_from_slice(payload);
    let first = headers.first().map_or(protocol, ExtHeader::kind);
    let mut p = Vec::with_capacity(40 + body.len());
    p.extend_from_slice(&[0x60, 0, 0, 0]);
    p.extend_from_slice(&(body.len() as u16).to_be_bytes());
    p.extend_from_slice(&[first, hop_limit]);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(&body);
    p
}

/// Splits an L4 `datagram` into IPv4 fragments of at most `chunk` payload
/// bytes (a multiple of 8), all with identification `id`.
pub fn ipv4_fragments(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    protocol: u8,
    id: u16,
    datagram: &[u8],
    chunk: usize,
) -> Vec<Vec<u8>> {
    fragment_pieces(datagram, chunk)
        .map(|(offset, more, piece)| ipv4(src, dst, protocol, 64, id, Some((offset, more)), piece))
        .collect()
}

/// Splits an L4 `datagram` into IPv6 fragments of at most `chunk` payload
/// bytes (a multiple of 8) behind `unfragmentable` headers, all with
/// identification `id`.
pub fn ipv6_fragments(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    unfragmentable: &[ExtHeader],
    protocol: u8,
    id: u32,
    datagram: &[u8],
    chunk: usize,
) -> Vec<Vec<u8>> {
    fragment_pieces(datagram, chunk)
        .map(|(offset, more, piece)| {
            let mut headers = unfragmentable.to_vec();
            headers.push(ExtHeader::Fragment { offset, more, id });
            ipv6(src, dst, 64, &headers, protocol, piece)
        })
        .collect()
}

/// `datagram` in pieces of at most `chunk` bytes (a multiple of 8), each
/// with its offset in bytes and its More Fragments flag.
fn fragment_pieces(datagram: &[u8], chunk: usize) -> impl Iterator<Item = (u16, bool, &[u8])> {
    assert_eq!(chunk % 8, 0, "fragment offsets are multiples of 8");
    let n = datagram.len().div_ceil(chunk);
    datagram
        .chunks(chunk)
        .enumerate()
        .map(move |(i, piece)| ((i * chunk) as u16, i + 1 < n, piece))
}

/// Sends each frame once, in order, from interface `ifname` of the calling
/// thread's network namespace through an AF_PACKET socket.
pub fn send_frames(ifname: &str, frames: &[Vec<u8>]) -> std::io::Result<()> {
    let name = std::ffi::CString::new(ifname).map_err(std::io::Error::other)?;
    // SAFETY: if_nametoindex reads a NUL-terminated string.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if ifindex == 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a plain socket call; the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket nobody else owns.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: all-zero is a valid sockaddr_ll.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_ifindex = ifindex as i32;
    addr.sll_halen = 6;
    for frame in frames {
        // SAFETY: a valid buffer and sockaddr_ll of the sizes passed.
        let sent = unsafe {
            libc::sendto(
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                std::ptr::from_ref(&addr).cast(),
                size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if sent != frame.len() as isize {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_verify_to_zero() {
        let (s, d): (Ipv6Addr, Ipv6Addr) = ("2001:2::2".parse().unwrap(), "2001:2::3".parse().unwrap());
        let seg = tcp(s.into(), d.into(), 40000, 80, TCP_SYN);
        assert_eq!(l4_checksum(s.into(), d.into(), proto::TCP, &seg), 0);
        let ip = ipv4(
            "198.18.0.2".parse().unwrap(),
            "198.18.0.3".parse().unwrap(),
            17,
            64,
            1,
            None,
            &[],
        );
        assert_eq!(checksum(&ip[..20]), 0);
    }

    #[test]
    fn fragments_carry_their_offsets_and_more_fragments_flags() {
        let datagram: Vec<u8> = (0..20).collect();
        let (s4, d4) = (Ipv4Addr::new(198, 18, 0, 2), Ipv4Addr::new(198, 18, 0, 3));
        let v4 = ipv4_fragments(s4, d4, proto::UDP, 7, &datagram, 8);
        let fields: Vec<(u16, u16, &[u8])> = v4
            .iter()
            .map(|p| {
                (
                    u16::from_be_bytes([p[4], p[5]]),
                    u16::from_be_bytes([p[6], p[7]]),
                    &p[20..],
                )
            })
            .collect();
        assert_eq!(
            fields,
            [
                (7, 0x2000, &datagram[..8]),
                (7, 0x2000 | 1, &datagram[8..16]),
                (7, 2, &datagram[16..])
            ],
            "identification, flags and offset in 8-byte units, payload"
        );
        let (s6, d6) = (Ipv6Addr::LOCALHOST, Ipv6Addr::LOCALHOST);
        let v6 = ipv6_fragments(s6, d6, &[ExtHeader::HopByHop { len: 0 }], proto::UDP, 9, &datagram, 8);
        let fields: Vec<(u8, u16, u32, &[u8])> = v6
            .iter()
            .map(|p| {
                let f = &p[48..56]; // after the Hop-by-Hop header
                (
                    f[0],
                    u16::from_be_bytes([f[2], f[3]]),
                    u32::from_be_bytes([f[4], f[5], f[6], f[7]]),
                    &p[56..],
                )
            })
            .collect();
        assert_eq!(
            fields,
            [
                (proto::UDP, 1, 9, &datagram[..8]),
                (proto::UDP, 8 | 1, 9, &datagram[8..16]),
                (proto::UDP, 16, 9, &datagram[16..])
            ],
            "next header, offset in bytes with M, identification, payload"
        );
        assert!(v6.iter().all(|p| p[6] == proto::HOP_BY_HOP && p[40] == proto::FRAGMENT));
    }

    #[test]
    fn extension_headers_chain_their_next_header_fields() {
        let p = ipv6(
            Ipv6Addr::LOCALHOST,
            Ipv6Addr::LOCALHOST,
            64,
            &[
                ExtHeader::HopByHop { len: 0 },
                ExtHeader::Authentication { len: 4 },
                ExtHeader::DestinationOptions { len: 1 },
            ],
            proto::TCP,
            &[0; 20],
        );
        assert_eq!(p[6], proto::HOP_BY_HOP);
        assert_eq!(p[40], proto::AH);
        assert_eq!(p[48], proto::DEST_OPTS, "AH follows 8 bytes of Hop-by-Hop");
        assert_eq!(p[48 + 24], proto::TCP, "Destination Options follow 24 bytes of AH");
        assert_eq!(p.len(), 40 + 8 + 24 + 16 + 20);
    }
}
