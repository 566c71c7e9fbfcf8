//! One synchronous rtnetlink request at a time, in the calling thread's
//! network namespace (a socket belongs to the namespace of the thread that
//! creates it): what [`crate::tc`] and [`crate::routing`] speak.

use std::io;

use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// Sends one request and collects the replies until the ACK (or the end of
/// a dump); a NACK becomes its errno.
pub(crate) fn request(message: RouteNetlinkMessage, flags: u16) -> io::Result<Vec<RouteNetlinkMessage>> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | flags | if dump { 0 } else { NLM_F_ACK };
    header.sequence_number = 1;
    let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(message));
    packet.finalize();
    let mut buf = vec![0u8; packet.buffer_len()];
    packet.serialize(&mut buf);
    socket.send(&buf, 0)?;

    let mut replies = Vec::new();
    loop {
        let (receive, _) = socket.recv_from_full()?;
        let mut offset = 0;
        while offset < receive.len() {
            let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&receive[offset..])
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("parsing a netlink reply: {e}")))?;
            let length = reply.header.length as usize;
            if length == 0 {
                break;
            }
            offset += length;
            match reply.payload {
                NetlinkPayload::Done(_) => return Ok(replies),
                NetlinkPayload::Error(e) => {
                    return match e.code {
                        None => Ok(replies),
                        Some(code) => Err(io::Error::from_raw_os_error(-code.get())),
                    };
                }
                NetlinkPayload::InnerMessage(inner) => replies.push(inner),
                _ => {}
            }
        }
    }
}
