//! `rivet node up`: preflight, directories, the node namespace, the CNI
//! install, the supervisor in the foreground or detached.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rivet_common::controller::{Action, Controller, Controllers};
use rivet_common::state_file::write_atomic;
use tokio::sync::watch;

use super::down::{after_daemons_stop, before_daemons_stop};
use super::health;
use super::supervisor::{answering_pid, describe_exit, log_tail, stopped};
use super::{
    CNI_BINARY, CompanionPlugin, DaemonStatus, LOADER, NODE_FILE, NodePhase, NodePlan, NodeRecord, NodeSupervisor,
    RestartPolicy, StatusObserver, Underlay, UpArgs, describe_node, supervisor_alive,
};
use crate::accounts::{self, NodeAccounts};
use crate::{Context, netns};

/// Set in the environment of the background supervisor of `--detach`.
const DETACHED_ENV: &str = "RIVET_NODE_DETACHED";

/// The directory of the running `rivet`.
fn own_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the running rivet binary")?;
    Ok(exe
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".")))
}

pub(super) async fn up(ctx: &Context, state_dir: &Path, args: &UpArgs) -> Result<bool> {
    let plan = NodePlan::new(&ctx.socket_dir, state_dir, args, &own_dir()?)?;
    let plan = match &args.underlay_interface {
        Some(interface) => {
            let underlay = read_underlay(plan.netns.as_deref(), interface)?;
            plan.with_underlay(underlay)?
        }
        None => plan,
    };
    if args.detach && std::env::var_os(DETACHED_ENV).is_none() {
        return detach(ctx, &plan).await;
    }
    // Signals first: a SIGTERM while starting must tear down, not kill us.
    // A parent may have left them blocked (a blocked mask is inherited):
    // unblock them, here and so in every daemon.
    let mut shutdown = nix::sys::signal::SigSet::empty();
    shutdown.add(Signal::SIGINT);
    shutdown.add(Signal::SIGTERM);
    shutdown.thread_unblock().context("unblocking SIGINT and SIGTERM")?;
    let (cancel_tx, cancel) = watch::channel(false);
    let sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // Supervised like every background loop; stopped when `up` returns.
    let controllers = Controllers::new();
    let signals = Arc::new(tokio::sync::Mutex::new((sigint, sigterm, cancel_tx)));
    controllers.reconcile(Controller::new("node-signals"), move || {
        let signals = Arc::clone(&signals);
        async move {
            let mut signals = signals.lock().await;
            let (sigint, sigterm, cancel_tx) = &mut *signals;
            tokio::select! {
                _ = sigint.recv() => {}
                _ = sigterm.recv() => {}
            }
            let _ = cancel_tx.send(true);
            Ok::<_, std::convert::Infallible>(Action::done())
        }
    });

    preflight(&plan).await?;
    let companions = plan.companion_plugins()?;
    let accounts = args.accounts.resolve()?;
    check_reachable(&plan, &accounts)?;
    let socket_dir_created = !plan.socket_dir.exists();
    std::fs::create_dir_all(&plan.socket_dir).with_context(|| format!("creating {}", plan.socket_dir.display()))?;
    if socket_dir_created {
        accounts::set_up_socket_dir(&plan.socket_dir, &accounts)?;
    }
    std::fs::create_dir_all(&plan.log_dir).with_context(|| format!("creating {}", plan.log_dir.display()))?;
    let specs = plan.specs(&accounts);
    let record = Arc::new(Mutex::new(plan.record(socket_dir_created, &specs)));
    let save = {
        let record = Arc::clone(&record);
        move |f: &dyn Fn(&mut NodeRecord)| {
            let mut r = record.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            f(&mut r);
            if let Err(e) = r.store() {
                eprintln!("rivet node: writing node.json: {e:#}");
            }
        }
    };
    save(&|_| {});

    let observer: StatusObserver = {
        let record = Arc::clone(&record);
        Arc::new(move |statuses: &[DaemonStatus]| {
            let mut r = record.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            r.daemons = statuses.to_vec();
            if let Err(e) = r.store() {
                eprintln!("rivet node: writing node.json: {e:#}");
            }
        })
    };
    let mut supervisor = NodeSupervisor::new(
        specs,
        RestartPolicy::default(),
        Duration::from_secs(args.ready_timeout_seconds),
        Duration::from_secs(args.stop_grace_seconds),
        observer,
    );

    let started = async {
        if plan.create_netns {
            let ns = plan.netns.as_deref().expect("--create-netns requires --netns");
            netns::create(ns)?;
            save(&|r| r.netns_created = true);
            configure_node_netns(&plan)?;
            eprintln!("rivet node: created network namespace {ns}");
        } else if let Some(ns) = &plan.netns
            && !netns::exists(ns)
        {
            bail!("network namespace `{ns}` does not exist (add --create-netns to create it)");
        } else if let (Some(ns), Some(_)) = (&plan.netns, plan.args.routing) {
            // A node of a cluster forwards between its pods and the underlay.
            netns::sysctls(&netns::path(ns), super::NODE_NETNS_SYSCTLS)?;
        }
        give_daemons_their_dirs(
            &plan.state_dir,
            &plan.socket_dir,
            &plan.pin_dir,
            &plan.daemons(),
            &accounts,
        )?;
        allow_health_echo(&plan, &accounts)?;
        if let Some(ns) = &plan.health_netns {
            // Recorded first: node down removes it even if this fails halfway.
            save(&|r| r.health_netns = Some(ns.clone()));
            health::create_namespace(ns)?;
        }
        supervisor.start(&cancel).await?;
        // Recorded before the copy: node down removes whatever was started.
        let copied: Vec<PathBuf> = companions
            .iter()
            .filter(|c| c.source.is_some())
            .map(|c| c.target.clone())
            .collect();
        save(&|r| r.cni_plugins = copied.clone());
        install_cni(&plan, &companions)?;
        if let Some(ns) = &plan.health_netns {
            let (name, plan) = (ns.clone(), plan.clone());
            tokio::task::spawn_blocking(move || {
                health::attach(
                    &name,
                    &plan.conflist_path(),
                    &plan.args.cni_bin_dir,
                    plan.netns_path(),
                    &plan.log_dir,
                )
            })
            .await??;
            eprintln!("rivet node: created the health endpoint in {ns}");
        }
        anyhow::Ok(())
    }
    .await;

    let outcome = match started {
        Ok(()) => {
            save(&|r| r.phase = NodePhase::Running);
            let snapshot = record.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
            print!("{}", describe_node(&snapshot));
            println!(
                "stop it with Ctrl-C, or `rivet --state-dir {} node down`",
                plan.state_dir.display()
            );
            let _ = std::io::stdout().flush();
            let mut cancel = cancel.clone();
            stopped(&mut cancel).await;
            eprintln!("rivet node: stopping node {}", plan.node_name);
            Ok(true)
        }
        Err(e) => Err(e),
    };
    save(&|r| r.phase = NodePhase::Stopping);
    let snapshot = record.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    for message in before_daemons_stop(&snapshot).await {
        eprintln!("rivet node: {message}");
    }
    supervisor.stop().await;
    for message in after_daemons_stop(&snapshot) {
        eprintln!("rivet node: {message}");
    }
    eprintln!("rivet node: node {} stopped", plan.node_name);
    outcome
}

/// Refuses to start over a running node, live sockets or missing binaries.
async fn preflight(plan: &NodePlan) -> Result<()> {
    if let Some(existing) = NodeRecord::load(&plan.state_dir)? {
        if supervisor_alive(existing.supervisor_pid) {
            bail!(
                "node {} is already running from {} (supervisor pid {}); stop it with `rivet --state-dir {} node down`",
                existing.node_name,
                plan.state_dir.display(),
                existing.supervisor_pid,
                plan.state_dir.display()
            );
        }
        bail!(
            "{} records node {} whose supervisor (pid {}) is gone; clean up what it left with \
             `rivet --state-dir {} node down`",
            plan.state_dir.join(NODE_FILE).display(),
            existing.node_name,
            existing.supervisor_pid,
            plan.state_dir.display()
        );
    }
    for daemon in plan.daemons() {
        let binary = plan.bin_dir.join(daemon);
        if !binary.is_file() {
            bail!(
                "{} is missing (build it with `cargo build --bins`, or give --bin-dir)",
                binary.display()
            );
        }
        if let Some(pid) = answering_pid(&plan.socket(daemon)).await {
            bail!(
                "{daemon} (pid {pid}) already answers on {}: another node uses this socket dir",
                plan.socket(daemon).display()
            );
        }
    }
    let cni = plan.bin_dir.join(CNI_BINARY);
    if !cni.is_file() {
        bail!(
            "{} is missing (build it with `cargo build --bins`, or give --bin-dir)",
            cni.display()
        );
    }
    Ok(())
}

/// Fails unless each daemon's user can reach its state dir and socket dir
/// (and both can create sockets in an existing socket dir).
fn check_reachable(plan: &NodePlan, accounts: &NodeAccounts) -> Result<()> {
    for daemon in plan.daemons() {
        let account = accounts.of(daemon);
        accounts::check_reachable(account, &plan.daemon_state_dir(daemon), "state dir")?;
        accounts::check_reachable(account, &plan.socket(daemon), "socket dir")?;
    }
    accounts::check_reachable(&accounts.datapath, &plan.pin_dir.join(LOADER), "pin dir")?;
    if plan.socket_dir.exists() {
        accounts::check_socket_dir(&plan.socket_dir, accounts)?;
    }
    Ok(())
}

/// What the daemons write becomes their users': each one's state dir
/// (`<state_dir>/<daemon>`, moving the entries of the layout before
/// per-daemon dirs), stale lock files of their sockets, and the pin dir.
pub(super) fn give_daemons_their_dirs(
    state_dir: &Path,
    socket_dir: &Path,
    pin_dir: &Path,
    daemons: &[&str],
    accounts: &NodeAccounts,
) -> Result<()> {
    for message in accounts::migrate_legacy_state(state_dir)? {
        eprintln!("rivet node: {message}");
    }
    for daemon in daemons {
        let account = accounts.of(daemon);
        accounts::give_private_dir(&state_dir.join(daemon), account)?;
        let socket = rivet_common::socket::socket_path(socket_dir, daemon);
        accounts::give_lock_file(&rivet_common::socket::lock_path(&socket), account)?;
    }
    if let Some(bpf_root) = pin_dir.parent() {
        std::fs::create_dir_all(bpf_root).with_context(|| format!("creating {}", bpf_root.display()))?;
    }
    accounts::give_private_dir(pin_dir, &accounts.datapath)
}

/// The underlay interface's global addresses and MTU (`ip -j addr show`),
/// inside the node's namespace when it has one.
fn read_underlay(ns: Option<&str>, interface: &str) -> Result<Underlay> {
    let args = ["-j", "addr", "show", "dev", interface];
    let json = match ns {
        Some(ns) => netns::ip(ns, &args),
        None => netns::run(std::process::Command::new("ip").args(args)),
    }
    .with_context(|| format!("reading the underlay interface {interface}"))?;
    Underlay::from_ip_json(interface, &json)
}

/// Forwarding on, DAD off, the node addresses on `lo`: only inside the
/// node's own namespace.
fn configure_node_netns(plan: &NodePlan) -> Result<()> {
    let ns = plan.netns.as_deref().expect("a node namespace");
    let path = netns::path(ns);
    netns::sysctls(&path, super::NODE_NETNS_SYSCTLS)?;
    for address in &plan.node_addresses {
        if address.contains(':') {
            netns::ip(ns, &["-6", "addr", "add", address, "dev", "lo", "nodad"])?;
        } else {
            netns::ip(ns, &["addr", "add", address, "dev", "lo"])?;
        }
    }
    Ok(())
}

/// Lets svc-health's group open unprivileged ICMP echo sockets in the
/// node's namespace (`net.ipv4.ping_group_range`, which also governs ICMPv6
/// echo sockets), so it probes peers with no capability. Only in the node's
/// own namespace: a node in the host namespace keeps the machine's setting
/// (and svc-health's ICMP probes fail there unless it allows the group).
fn allow_health_echo(plan: &NodePlan, accounts: &NodeAccounts) -> Result<()> {
    let Some(path) = plan.netns_path() else {
        return Ok(());
    };
    let gid = accounts.of(super::HEALTH).gid;
    netns::sysctls(&path, &[("net.ipv4.ping_group_range", &format!("{gid} {gid}"))])
}

/// Copies rivet-cni and the companion plugins to copy into the CNI bin dir,
/// then writes the conflist (atomically, each).
fn install_cni(plan: &NodePlan, companions: &[CompanionPlugin]) -> Result<()> {
    std::fs::create_dir_all(&plan.args.cni_bin_dir)
        .with_context(|| format!("creating {}", plan.args.cni_bin_dir.display()))?;
    let target = plan.cni_binary_path();
    rivet_cni::install::install_executable(&plan.bin_dir.join(CNI_BINARY), &target)?;
    for plugin in companions {
        if let Some(source) = &plugin.source {
            rivet_cni::install::install_executable(source, &plugin.target)?;
            eprintln!(
                "rivet node: installed {} from {}",
                plugin.target.display(),
                source.display()
            );
        }
    }
    let text = serde_json::to_string_pretty(&plan.conflist()).expect("JSON values serialise") + "\n";
    write_atomic(&plan.conflist_path(), text.as_bytes())
        .map_err(|(action, e)| anyhow!("{action} {}: {e}", plan.conflist_path().display()))?;
    eprintln!(
        "rivet node: installed {} and {}",
        target.display(),
        plan.conflist_path().display()
    );
    Ok(())
}

/// Starts this same command in the background and waits until its node
/// is up; prints the node.
async fn detach(ctx: &Context, plan: &NodePlan) -> Result<bool> {
    use std::os::unix::process::CommandExt;
    std::fs::create_dir_all(&plan.log_dir).with_context(|| format!("creating {}", plan.log_dir.display()))?;
    let log_path = plan.log_dir.join("node.log");
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let exe = std::env::current_exe()?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(std::env::args_os().skip(1))
        .env(DETACHED_ENV, "1")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // Its own session: no terminal signals, survives this process.
    // SAFETY: setsid is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting the background supervisor")?;
    let pid = child.id();
    let deadline =
        Instant::now() + Duration::from_secs(plan.args.ready_timeout_seconds * plan.daemons().len() as u64 + 30);
    loop {
        if let Some(status) = child.try_wait()? {
            bail!(
                "the node did not come up: the supervisor exited ({}); the end of {}:\n{}",
                describe_exit(status),
                log_path.display(),
                log_tail(&log_path, 25)
            );
        }
        if let Ok(Some(record)) = NodeRecord::load(&plan.state_dir)
            && record.supervisor_pid == pid
            && record.phase == NodePhase::Running
        {
            ctx.print(&record, || {
                format!(
                    "{}its log: {}\nstop it with `rivet --state-dir {} node down`\n",
                    describe_node(&record),
                    log_path.display(),
                    plan.state_dir.display()
                )
            });
            return Ok(true);
        }
        if Instant::now() >= deadline {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            bail!(
                "the node did not come up in time; stopping it. The end of {}:\n{}",
                log_path.display(),
                log_tail(&log_path, 25)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
