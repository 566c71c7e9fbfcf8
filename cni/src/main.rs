//! rivet-cni: reads the `CNI_*` environment and the netconf on stdin, wires
//! the real netlink, daemon clients and delegated-plugin runner into the
//! verbs of `rivet_cni::plugin`, prints the result (or the error JSON) on
//! stdout and exits. Logs never go to stdout.
//!
//! `rivet-cni install ...` (a runtime never passes arguments) installs the
//! plugin instead ([`rivet_cni::install`]).

use std::io::Write as _;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rivet_cni::delegate::ExecDelegate;
use rivet_cni::env::{self, CniEnv, Command};
use rivet_cni::error::{CniError, codes};
use rivet_cni::grpc::{GrpcEndpoints, GrpcIpam};
use rivet_cni::install;
use rivet_cni::logging::Telemetry;
use rivet_cni::netconf::{self, NetConf};
use rivet_cni::netlink::RtNetlink;
use rivet_cni::plugin::{self, CLEANUP_BUDGET, Deps, Invocation};
use rivet_cni::version::{self, CniVersion};
use rivet_cni::{Outcome, render_outcome};
use tracing::Instrument as _;

/// `rivet-cni install`: copies this binary and writes the conflist into a
/// runtime's CNI directories (the DaemonSet's init container).
#[derive(Debug, clap::Parser)]
#[command(name = "rivet-cni install", version)]
struct InstallArgs {
    /// The runtime's CNI plugin directory (`loopback` must be there).
    #[arg(long, value_name = "DIR")]
    bin_dir: PathBuf,
    /// The runtime's CNI configuration directory.
    #[arg(long, value_name = "DIR")]
    conf_dir: PathBuf,
    /// The daemons' socket directory as the runtime sees it.
    #[arg(long, value_name = "DIR", default_value = "/var/run/rivet/sockets")]
    socket_dir: PathBuf,
    /// The svc-ipam pool pods get addresses from.
    #[arg(long, default_value = "default")]
    ipam_pool: String,
    /// Prefix of the host-side veth names (svc-loader's --endpoint-interface-prefix).
    #[arg(long, default_value = "lxc")]
    host_interface_prefix: String,
    /// The pods' MTU.
    #[arg(long, default_value_t = 1500)]
    mtu: u32,
    /// rivet-cni's log file as the runtime sees it (none: no log file).
    #[arg(long, value_name = "FILE")]
    log_file: Option<PathBuf>,
    /// Deadline of one call, seconds.
    #[arg(long, default_value_t = 30)]
    timeout_seconds: u64,
    /// Where rivet-cni exports its spans over OTLP/gRPC (`http://host:port`;
    /// the conflist's `tracing.otlpEndpoint`). Empty: none in the conflist.
    #[arg(long, env = "RIVET_CNI_OTLP_ENDPOINT", value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// cniVersion of the conflist.
    #[arg(long, default_value = install::DEFAULT_CNI_VERSION,
          value_parser = clap::builder::PossibleValuesParser::new(install::CNI_VERSIONS))]
    cni_version: String,
}

fn run_install(args: &[std::ffi::OsString]) -> ExitCode {
    use clap::Parser as _;
    let args = InstallArgs::parse_from(args);
    let otlp_endpoint = args.otlp_endpoint.filter(|e| !e.is_empty());
    if let Some(endpoint) = &otlp_endpoint
        && let Err(why) = netconf::check_otlp_endpoint(endpoint)
    {
        eprintln!("rivet-cni install: --otlp-endpoint {endpoint:?}: {why}");
        return ExitCode::FAILURE;
    }
    let installed = std::env::current_exe()
        .map_err(|e| format!("finding this binary: {e}"))
        .and_then(|binary| {
            let conflist = install::Conflist {
                cni_version: args.cni_version,
                socket_dir: args.socket_dir,
                ipam_pool: args.ipam_pool,
                host_interface_prefix: args.host_interface_prefix,
                mtu: args.mtu,
                log_file: args.log_file,
                timeout_seconds: args.timeout_seconds,
                otlp_endpoint,
            };
            install::install(&binary, &args.bin_dir, &args.conf_dir, &conflist).map_err(|e| e.to_string())
        });
    match installed {
        Ok([binary, conflist]) => {
            println!("rivet-cni: installed {} and {}", binary.display(), conflist.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rivet-cni install: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == "install") {
        return run_install(&args[1..]);
    }
    let started = Instant::now();
    let (stdin, read) = match netconf::read_stdin(std::io::stdin().lock()) {
        Ok(bytes) => (bytes, Ok(())),
        Err(e) => (Vec::new(), Err(e)),
    };
    let env = env::parse(|key| std::env::var_os(key).map(|v| v.to_string_lossy().into_owned()));
    let version = netconf::sniff_version(&stdin).unwrap_or(CniVersion::LATEST);
    let is_version = env.as_ref().is_ok_and(|e| e.command == Command::Version);
    let telemetry = if is_version {
        None
    } else {
        let (log_file, log_level) = netconf::sniff_logging(&stdin);
        let otlp_endpoint = netconf::sniff_otlp_endpoint(&stdin);
        Some(Telemetry::init(
            log_file.as_deref(),
            log_level,
            otlp_endpoint.as_deref(),
        ))
    };
    std::panic::set_hook(Box::new(|info| {
        tracing::error!(panic = %info, "rivet-cni panicked");
        eprintln!("rivet-cni: {info}");
    }));

    let outcome: Outcome = match (read, env) {
        (Err(e), _) => Err(e),
        (Ok(_), Err(e)) => Err(e),
        (Ok(_), Ok(env)) if env.command == Command::Version => version::version_output(&stdin).map(Some),
        (Ok(_), Ok(env)) => match NetConf::parse(&stdin) {
            Err(e) => Err(e),
            Ok(conf) => execute(Invocation { env, conf, stdin }),
        },
    };

    match &outcome {
        Ok(_) => tracing::info!(elapsed = ?started.elapsed(), "done"),
        Err(e) => {
            tracing::error!(code = e.code, msg = %e.msg, details = %e.details, elapsed = ?started.elapsed(), "failed")
        }
    }
    let (text, status) = render_outcome(&outcome, version);
    let printed = match text {
        Some(text) => {
            let mut stdout = std::io::stdout().lock();
            writeln!(stdout, "{text}").and_then(|()| stdout.flush())
        }
        None => Ok(()),
    };
    if let Err(e) = &printed {
        tracing::error!(error = %e, "writing the result to stdout failed");
    }
    if let Some(telemetry) = telemetry {
        telemetry.shutdown();
    }
    if printed.is_err() {
        ExitCode::from(1)
    } else {
        ExitCode::from(status)
    }
}

/// Runs the verb on a current-thread runtime under a hard limit (the
/// netconf's timeout plus the budget of undoing a failed ADD).
fn execute(inv: Invocation) -> Outcome {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CniError::new(codes::IO_FAILURE, format!("starting the runtime: {e}")))?;
    let span = root_span(&inv.env);
    let hard_limit = inv.conf.timeout + CLEANUP_BUDGET + Duration::from_secs(5);
    let run = async {
        let netlink =
            RtNetlink::new().map_err(|e| CniError::new(codes::NETLINK, format!("opening a netlink socket: {e}")))?;
        let ipam = GrpcIpam::new(&inv.conf.ipam_socket(), inv.conf.timeout);
        let endpoints = GrpcEndpoints::new(&inv.conf.endpoint_socket(), inv.conf.timeout);
        let delegate = ExecDelegate::new(inv.env.path.clone());
        let deps = Deps {
            netlink: &netlink,
            ipam: &ipam,
            endpoints: &endpoints,
            delegate: &delegate,
        };
        match tokio::time::timeout(hard_limit, plugin::run(deps, &inv)).await {
            Ok(outcome) => outcome,
            Err(_) => Err(CniError::new(
                codes::TRY_AGAIN_LATER,
                format!("{} did not finish within {hard_limit:?}", inv.env.command),
            )),
        }
    };
    match std::panic::catch_unwind(AssertUnwindSafe(|| runtime.block_on(run.instrument(span)))) {
        Ok(outcome) => outcome,
        Err(_) => Err(CniError::new(
            codes::INTERNAL,
            "rivet-cni panicked (a bug); see its log",
        )),
    }
}

/// The invocation's root span (`cni.add`, ...): the root of the pod's
/// trace, with the pod's OpenTelemetry attributes (`container.id`,
/// `k8s.namespace.name`, `k8s.pod.name` when the runtime passed them).
fn root_span(env: &CniEnv) -> tracing::Span {
    let netns = env.netns.as_ref().map(|p| p.display().to_string()).unwrap_or_default();
    let pid = std::process::id();
    macro_rules! span {
        ($name:literal) => {
            tracing::info_span!(
                $name,
                otel.kind = "internal",
                container.id = %env.container_id,
                k8s.namespace.name = tracing::field::Empty,
                k8s.pod.name = tracing::field::Empty,
                ifname = %env.ifname,
                netns = %netns,
                pid,
            )
        };
    }
    let span = match env.command {
        Command::Add => span!("cni.add"),
        Command::Del => span!("cni.del"),
        Command::Check => span!("cni.check"),
        Command::Status => span!("cni.status"),
        Command::Gc => span!("cni.gc"),
        Command::Version => span!("cni.version"),
    };
    if let Some(namespace) = &env.args.pod_namespace {
        span.record("k8s.namespace.name", namespace.as_str());
    }
    if let Some(name) = &env.args.pod_name {
        span.record("k8s.pod.name", name.as_str());
    }
    span
}
