//! The service traffic helpers against their own server, in one network
//! namespace over loopback: names come back over new, batched, held and
//! UDP connections; the UDP stream counts every answer; a closed port is
//! refused. Needs root (a network namespace).

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::Duration;

use rivet_common::testing::netns::NetNs;
use rivet_testkit::service::{HeldConnection, NameServer, UdpStream, ask_name, ask_name_udp, ask_names};

const WITHIN: Duration = Duration::from_secs(5);

#[test]
fn the_name_server_answers_new_held_and_udp_requests_with_its_name() {
    let ns = NetNs::new("svcname").expect("a network namespace");
    let v4: SocketAddr = "127.0.0.1:8080".parse().unwrap();
    let v6: SocketAddr = "[::1]:8080".parse().unwrap();
    let _server = NameServer::start(&ns, "be-1", &[v4, v6]).expect("the name server starts");
    for dst in [v4, v6] {
        assert_eq!(ask_name(&ns, dst, WITHIN).unwrap(), "be-1");
        let answers = ask_names(&ns, dst, 20, WITHIN);
        assert_eq!(answers.len(), 20);
        assert!(answers.iter().all(|a| a.as_deref().ok() == Some("be-1")), "{answers:?}");
        let mut held = HeldConnection::open(&ns, dst, WITHIN).unwrap();
        assert_eq!(held.first, "be-1");
        assert_eq!(held.ask().unwrap(), "be-1");
        assert_eq!(held.ask().unwrap(), "be-1");
        assert_eq!(ask_name_udp(&ns, dst, WITHIN).unwrap(), "be-1");

        let stream = UdpStream::start(&ns, dst).unwrap();
        stream.wait_more_answers(200, WITHIN);
        let totals = stream.stop();
        assert_eq!(totals.lost(), 0, "{totals:?}");
        assert_eq!(totals.servers.iter().collect::<Vec<_>>(), ["be-1"]);

        let closed = SocketAddr::new(dst.ip(), 8081);
        let refused = ask_name(&ns, closed, WITHIN);
        assert!(
            matches!(&refused, Err(e) if e.kind() == ErrorKind::ConnectionRefused),
            "{refused:?}"
        );
        let refused = ask_name_udp(&ns, closed, WITHIN);
        assert!(
            matches!(&refused, Err(e) if e.kind() == ErrorKind::ConnectionRefused),
            "{refused:?}"
        );
    }
}
