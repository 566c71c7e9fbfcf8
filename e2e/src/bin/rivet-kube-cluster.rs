//! `rivet-kube-cluster up|down|status`: the real Kubernetes cluster of
//! [`rivet_e2e::kube_cluster`] for people (`cargo xtask cluster up|down`
//! runs this).
//!
//! The cluster's daemons, the API server relay and the teardown belong to
//! one [`KubeCluster`] guard, so `up` starts a background supervisor
//! (`serve`, in its own process group) that holds the guard until SIGTERM; `up`
//! returns once the supervisor says the cluster is ready, printing the
//! kubeconfig and the start time. `down` sends SIGTERM and waits until the
//! supervisor has removed everything and exited; when the supervisor was
//! killed, `down` removes what the cluster's record lists
//! ([`kube_cluster::sweep`]).
//!
//! Files, under the state dir (`--state-dir`, default
//! `$TMPDIR/rivet-kube-cluster`): `supervisor.pid`, `supervisor.log`,
//! `ready` (the kubeconfig path and the start time, written once ready) and
//! `cluster/` (the cluster's own dir).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rivet_e2e::kube_cluster::{self, KubeCluster, KubeClusterOptions, MAX_WORKERS, WorkerCni};

/// How long `up` waits for the supervisor to report the cluster ready.
const UP_TIMEOUT: Duration = Duration::from_secs(300);
/// How long `down` waits for the supervisor to finish the teardown.
const DOWN_TIMEOUT: Duration = Duration::from_secs(180);

/// A real Kubernetes cluster (kubelet workers in network namespaces) on this machine.
#[derive(Debug, Parser)]
#[command(name = "rivet-kube-cluster", version, about)]
struct Cli {
    /// Where the supervisor's files and the cluster dir are.
    #[arg(long, global = true, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Start the cluster in the background; prints the kubeconfig path.
    Up(UpArgs),
    /// Stop the cluster and remove everything it made.
    Down,
    /// Whether a cluster runs, and its kubeconfig.
    Status,
    /// Run the cluster in the foreground until SIGTERM or SIGINT (what `up`
    /// starts in the background).
    Serve(UpArgs),
}

#[derive(Debug, Clone, clap::Args)]
struct UpArgs {
    /// Number of worker nodes.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=MAX_WORKERS as i64))]
    workers: u16,
    /// The workers' pod network until Rivet's DaemonSet installs its own.
    #[arg(long, value_enum, default_value_t = CniArg::Bridge)]
    cni: CniArg,
    /// An OCI archive to import into every worker (repeatable), e.g. the
    /// Rivet image of `cargo xtask image`.
    #[arg(long = "image", value_name = "ARCHIVE")]
    images: Vec<PathBuf>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum CniArg {
    /// The reference bridge + host-local plugins: the nodes become Ready.
    Bridge,
    /// None: the nodes stay NotReady until a CNI is installed.
    None,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let state_dir = cli
        .state_dir
        .unwrap_or_else(|| std::env::temp_dir().join("rivet-kube-cluster"));
    let result = match cli.command {
        Cmd::Up(args) => up(&state_dir, &args),
        Cmd::Down => down(&state_dir),
        Cmd::Status => status(&state_dir),
        Cmd::Serve(args) => serve(&state_dir, &args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn pid_file(state_dir: &Path) -> PathBuf {
    state_dir.join("supervisor.pid")
}

fn ready_file(state_dir: &Path) -> PathBuf {
    state_dir.join("ready")
}

fn log_file(state_dir: &Path) -> PathBuf {
    state_dir.join("supervisor.log")
}

/// The supervisor's pid, if it runs.
fn running_supervisor(state_dir: &Path) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(pid_file(state_dir)).ok()?.trim().parse().ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let cmdline = String::from_utf8_lossy(&cmdline);
    (cmdline.contains("rivet-kube-cluster") && cmdline.contains("serve")).then_some(pid)
}

/// `path` made absolute against the current dir (the supervisor runs
/// elsewhere).
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

fn up(state_dir: &Path, args: &UpArgs) -> Result<()> {
    if let Some(pid) = running_supervisor(state_dir) {
        bail!(
            "a cluster already runs (supervisor pid {pid}, {}); `down` first",
            state_dir.display()
        );
    }
    if state_dir.join("cluster").exists() {
        bail!(
            "{} holds a cluster whose supervisor is gone (killed?): `down` removes what it left",
            state_dir.display()
        );
    }
    std::fs::create_dir_all(state_dir).with_context(|| format!("creating {}", state_dir.display()))?;
    let _ = std::fs::remove_file(ready_file(state_dir));
    let log = std::fs::File::create(log_file(state_dir))
        .with_context(|| format!("creating {}", log_file(state_dir).display()))?;
    let exe = std::env::current_exe().context("finding this program")?;
    let mut command = Command::new(exe);
    command
        .arg("--state-dir")
        .arg(state_dir)
        .args(["serve", "--workers", &args.workers.to_string(), "--cni"])
        .arg(args.cni.to_possible_value().expect("no skipped values").get_name())
        .args(
            args.images
                .iter()
                .flat_map(|image| [PathBuf::from("--image"), absolute(image)]),
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone().context("duplicating the log file")?)
        .stderr(log);
    // Its own process group: it outlives this process, and Ctrl-C in the
    // terminal does not reach it.
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let mut child = command.spawn().context("starting the supervisor")?;
    let started = Instant::now();
    loop {
        if let Ok(ready) = std::fs::read_to_string(ready_file(state_dir)) {
            print!("{ready}");
            return Ok(());
        }
        if let Some(status) = child.try_wait().context("waiting for the supervisor")? {
            let log = std::fs::read_to_string(log_file(state_dir)).unwrap_or_default();
            bail!("the cluster did not start (supervisor {status}):\n{log}");
        }
        if started.elapsed() > UP_TIMEOUT {
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
            bail!(
                "the cluster was not ready within {UP_TIMEOUT:?}; stopping it (see {})",
                log_file(state_dir).display()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn down(state_dir: &Path) -> Result<()> {
    let Some(pid) = running_supervisor(state_dir) else {
        let cluster = state_dir.join("cluster");
        if cluster.exists() {
            println!(
                "no supervisor runs (it was killed?): removing what {} records",
                cluster.display()
            );
            let problems = kube_cluster::sweep(&cluster);
            if !problems.is_empty() {
                bail!("the sweep left:\n{}", problems.join("\n"));
            }
        } else {
            println!("no cluster runs ({})", state_dir.display());
        }
        let _ = std::fs::remove_dir_all(state_dir);
        return Ok(());
    };
    kill(Pid::from_raw(pid), Signal::SIGTERM).with_context(|| format!("signalling the supervisor (pid {pid})"))?;
    let started = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() {
        if started.elapsed() > DOWN_TIMEOUT {
            bail!(
                "the supervisor (pid {pid}) did not finish the teardown within {DOWN_TIMEOUT:?}; see {}",
                log_file(state_dir).display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = std::fs::read_to_string(log_file(state_dir)).unwrap_or_default();
    if state_dir.join("cluster").exists() {
        bail!("the teardown left {}:\n{log}", state_dir.join("cluster").display());
    }
    std::fs::remove_dir_all(state_dir).with_context(|| format!("removing {}", state_dir.display()))?;
    println!("cluster removed in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn status(state_dir: &Path) -> Result<()> {
    match (
        running_supervisor(state_dir),
        std::fs::read_to_string(ready_file(state_dir)),
    ) {
        (Some(pid), Ok(ready)) => print!("running (supervisor pid {pid})\n{ready}"),
        (Some(pid), Err(_)) => println!("starting (supervisor pid {pid})"),
        (None, _) => println!("no cluster runs ({})", state_dir.display()),
    }
    Ok(())
}

/// Runs the cluster until SIGTERM or SIGINT; the guard's drop removes it.
fn serve(state_dir: &Path, args: &UpArgs) -> Result<()> {
    std::fs::write(pid_file(state_dir), std::process::id().to_string()).context("writing the pid file")?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let options = KubeClusterOptions {
        workers: usize::from(args.workers),
        cni: match args.cni {
            CniArg::Bridge => WorkerCni::Bridge,
            CniArg::None => WorkerCni::None,
        },
        dir: Some(state_dir.join("cluster")),
        images: args.images.clone(),
        reference_bridge_handler: false,
    };
    runtime.block_on(async {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("handling SIGTERM")?;
        let cluster = tokio::select! {
            cluster = KubeCluster::start(options) => cluster?,
            _ = term.recv() => bail!("stopped (SIGTERM) while starting"),
            _ = tokio::signal::ctrl_c() => bail!("stopped (SIGINT) while starting"),
        };
        let mut ready = format!(
            "kubeconfig: {}\nstarted in: {:.1} s\nnodes:",
            cluster.kubeconfig().display(),
            cluster.started_in().as_secs_f64(),
        );
        for worker in cluster.workers() {
            ready.push_str(&format!(" {} ({})", worker.name, worker.address));
        }
        ready.push_str(&format!(
            "\nrivet etcd (deploy/overlays/etcd): {}\n",
            cluster.rivet_etcd_endpoint()
        ));
        println!("{ready}");
        std::fs::write(ready_file(state_dir), &ready).context("writing the ready file")?;
        tokio::select! {
            _ = term.recv() => println!("SIGTERM: removing the cluster"),
            _ = tokio::signal::ctrl_c() => println!("SIGINT: removing the cluster"),
        }
        drop(cluster);
        println!("cluster removed");
        Ok(())
    })?;
    let _ = std::fs::remove_file(pid_file(state_dir));
    Ok(())
}
