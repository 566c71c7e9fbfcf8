//! svc-gc's ground: the datapath's conntrack maps, created from the
//! datapath ABI's definitions and pinned in a unique test directory under
//! `/sys/fs/bpf/rivet/`, synthetic conntrack entries, and the svc-gc daemon
//! command.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use rivet_common::testing::DaemonCommand;
use rivet_datapath::maps::{CT_TCP_ESTABLISHED, Ct4Key, Ct6Key, CtEntry, DIR_EGRESS};
use rivet_datapath::pin::{self, create_pinned_map};
use rivet_datapath::spec;
use svc_gc::map::{BatchMode, PinnedMap};
use svc_gc::pass::GcMaps;

/// One second in nanoseconds.
pub const SECOND: u64 = 1_000_000_000;

/// The bpffs of the tests.
pub const BPFFS: &str = pin::DEFAULT_BPFFS;

static DIRS: AtomicU32 = AtomicU32::new(0);

/// The datapath's `ct4` and `ct6` maps as svc-loader creates them (the
/// ABI's types, key and value sizes, flags) in `<bpffs>/rivet/<node_name>/`,
/// removed on drop. svc-gc opens no other map.
#[derive(Debug)]
pub struct TestMaps {
    /// The pin directory (removed on drop).
    pub pin_dir: PathBuf,
    /// The node name: svc-gc's `--node-name` with `--bpffs /sys/fs/bpf`.
    pub node_name: String,
    sizes: (u32, u32),
}

impl Drop for TestMaps {
    fn drop(&mut self) {
        if let Err(e) = self.remove() {
            eprintln!("removing test pins {}: {e}", self.pin_dir.display());
        }
    }
}

impl TestMaps {
    /// Creates the maps with `ct4_max` / `ct6_max` entries (the others tiny).
    pub fn create(label: &str, ct4_max: u32, ct6_max: u32) -> std::io::Result<Self> {
        let node_name = format!(
            "gc{}-{}-{label}",
            std::process::id(),
            DIRS.fetch_add(1, Ordering::Relaxed)
        );
        let maps = Self {
            pin_dir: pin::pin_dir(BPFFS, &node_name).expect("a test node name is one path component"),
            node_name,
            sizes: (ct4_max, ct6_max),
        };
        maps.load()?;
        Ok(maps)
    }

    fn load(&self) -> std::io::Result<()> {
        // The pins hold the maps; the handles are not needed.
        create_pinned_map(&self.pin_dir, &spec::CT4, self.sizes.0).map_err(std::io::Error::other)?;
        create_pinned_map(&self.pin_dir, &spec::CT6, self.sizes.1).map_err(std::io::Error::other)?;
        Ok(())
    }

    /// Also creates the service maps svc-gc sweeps or reads (`lb4_flows`,
    /// `lb6_flows`, `lb_affinity`, `lb_frontends`), with `max_entries` each.
    pub fn with_service_maps(self, max_entries: u32) -> std::io::Result<Self> {
        for def in [
            &spec::LB4_FLOWS,
            &spec::LB6_FLOWS,
            &spec::LB_AFFINITY,
            &spec::LB_FRONTENDS,
            &spec::LB_SOCK_REV,
        ] {
            create_pinned_map(&self.pin_dir, def, max_entries).map_err(std::io::Error::other)?;
        }
        Ok(self)
    }

    /// Replaces every map by a new, empty one under the same pins (what an
    /// operator removing the pins and restarting svc-loader does).
    pub fn recreate(&self) -> std::io::Result<()> {
        self.remove()?;
        self.load()
    }

    /// Removes the maps (their pins); [`recreate`](Self::recreate) makes new ones.
    pub fn remove(&self) -> std::io::Result<()> {
        match std::fs::remove_dir_all(&self.pin_dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// `<bpffs>/rivet/<node_name>`.
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// `ct4`, opened like svc-gc opens it.
    pub fn ct4(&self) -> PinnedMap<Ct4Key, CtEntry> {
        PinnedMap::open(self.pin_dir(), &spec::CT4, BatchMode::Auto).expect("the test ct4 map opens")
    }

    /// `ct6`, opened like svc-gc opens it.
    pub fn ct6(&self) -> PinnedMap<Ct6Key, CtEntry> {
        PinnedMap::open(self.pin_dir(), &spec::CT6, BatchMode::Auto).expect("the test ct6 map opens")
    }

    /// svc-gc's view of these maps.
    pub fn gc_maps(&self, mode: BatchMode) -> GcMaps {
        GcMaps::pinned(self.pin_dir(), mode)
    }
}

/// An entry as the datapath writes it: last refreshed at `last_refreshed`
/// (kernel monotonic nanoseconds) with `lifetime_s` seconds of lifetime.
pub fn entry(last_refreshed: u64, lifetime_s: u32, tcp_state: u8) -> CtEntry {
    CtEntry {
        expires: last_refreshed + u64::from(lifetime_s) * SECOND,
        lifetime: lifetime_s,
        tcp_state,
        packets_fwd: 1,
        bytes_fwd: 60,
        ..CtEntry::default()
    }
}

/// The `i`-th of up to 2^16 × 45535 distinct egress TCP keys from pod
/// 198.18.0.2 to 198.19.x.y:80.
pub fn synthetic_key(i: u32) -> Ct4Key {
    let dst = Ipv4Addr::new(198, 19, (i >> 8) as u8, i as u8);
    Ct4Key::new(
        SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 2), 20_000 + (i >> 16) as u16),
        SocketAddrV4::new(dst, 80),
        6,
        DIR_EGRESS,
    )
}

/// `count` live established-TCP entries at `now` (refreshed just now, with
/// `lifetime_s`), opened by the pods at `sources` in turn: entry `i` goes
/// from `sources[i % n]` to 198.19.x.y:80, so every entry belongs to a
/// local endpoint (none is an orphan to svc-gc) and each source has up to
/// 2^16 × 45535 distinct ones.
pub fn flows_from(sources: &[Ipv4Addr], count: u32, now: u64, lifetime_s: u32) -> (Vec<Ct4Key>, Vec<CtEntry>) {
    let n = sources.len().max(1) as u32;
    let keys: Vec<Ct4Key> = (0..count)
        .map(|i| {
            let (src, k) = (sources[(i % n) as usize], i / n);
            Ct4Key::new(
                SocketAddrV4::new(src, 20_000 + (k >> 16) as u16),
                SocketAddrV4::new(Ipv4Addr::new(198, 19, (k >> 8) as u8, k as u8), 80),
                6,
                DIR_EGRESS,
            )
        })
        .collect();
    let values = vec![entry(now, lifetime_s, CT_TCP_ESTABLISHED); count as usize];
    (keys, values)
}

/// `live + expired` synthetic established-TCP entries at `now`: the first
/// `live` refreshed just now with `lifetime_s`, the rest refreshed a minute
/// ago with a 10 s lifetime (past the datapath's own deadline: expired
/// whatever svc-gc's timeouts).
pub fn synthetic_entries(now: u64, live: u32, expired: u32, lifetime_s: u32) -> (Vec<Ct4Key>, Vec<CtEntry>) {
    let total = live + expired;
    let keys: Vec<Ct4Key> = (0..total).map(synthetic_key).collect();
    let values = (0..total)
        .map(|i| {
            if i < live {
                entry(now, lifetime_s, CT_TCP_ESTABLISHED)
            } else {
                entry(now.saturating_sub(60 * SECOND), 10, CT_TCP_ESTABLISHED)
            }
        })
        .collect();
    (keys, values)
}

/// The svc-gc command for a node whose maps are `<bpffs>/rivet/<node_name>`,
/// with its socket dir (and svc-endpoint's socket) in `dir/sockets` and its
/// log in `dir/svc-gc.log`.
pub fn daemon_command(bin: &Path, dir: &Path, node_name: &str, args: &[&str]) -> DaemonCommand {
    let sockets = dir.join("sockets");
    DaemonCommand::new(bin, sockets.join("svc-gc.sock"))
        .args(["--socket-dir".as_ref(), sockets.as_os_str()])
        .args(["--state-dir".as_ref(), dir.join("state").as_os_str()])
        .args(["--node-name", node_name, "--bpffs", BPFFS])
        .args(args)
        .log_to(dir.join("svc-gc.log"))
}
