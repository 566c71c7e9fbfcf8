//! A real Kubernetes API server under test: kube-apiserver v1.34 (built by
//! `cargo xtask install`) on 127.0.0.1 with a free port, its own etcd 3.6,
//! certificates and service-account keys generated per server, RBAC
//! authorisation on; killed and removed on drop, also on panic.
//!
//! What a test gets:
//! - an admin kubeconfig (client certificate in group `system:masters`) and
//!   a [`kube::Client`] for it ([`KubeApiServer::admin_client`]);
//! - Rivet's CRDs from `deploy/crds/`, applied and Established on request
//!   ([`KubeApiServer::apply_crds`]);
//! - a component's ServiceAccount with exactly the RBAC of
//!   `deploy/rbac/<component>.yaml`, as a kubeconfig holding a token from the
//!   TokenRequest API ([`KubeApiServer::service_account_client`]): the daemons
//!   run with it, so least privilege is tested, not assumed;
//! - `kubectl` with the admin kubeconfig ([`KubeApiServer::kubectl`]);
//! - [`KubeApiServer::restart`]: kube-apiserver killed and started again on
//!   the same port and etcd data (the restart tests).
//!
//! Choices, and why:
//! - The `ServiceAccount` admission plugin is disabled: it refuses pods in a
//!   namespace whose `default` ServiceAccount does not exist yet, and only
//!   kube-controller-manager creates those. Without a controller-manager (no
//!   kubelet either: the tests' pods are network namespaces made by
//!   rivet-cni) a test could not create a pod right after its namespace.
//! - API Priority and Fairness is off and the endpoint reconciler is `none`:
//!   neither is under test, APF's configuration objects cost start-up time,
//!   and the reconciler would try to publish the loopback advertise address
//!   as the `kubernetes` Service's endpoint, which validation refuses.
//! - Service cluster IPs come from [`SERVICE_CLUSTER_IP_RANGE`], inside the
//!   benchmarking range the tests own.
//! - Nothing confirms a graceful pod deletion (no kubelet), so tests delete
//!   pods with a grace period of 0: [`delete_pod_now`].
//!
//! ```no_run
//! # async fn t() -> Result<(), rivet_testkit::kube::KubeApiServerError> {
//! use k8s_openapi::api::core::v1::Namespace;
//! use kube::api::{Api, PostParams};
//! use rivet_testkit::kube::KubeApiServer;
//!
//! let server = KubeApiServer::start().await?;
//! server.apply_crds().await?;
//! let namespaces: Api<Namespace> = Api::all(server.admin_client());
//! let sync = server.service_account_client("svc-k8s-sync").await?;
//! // run svc-k8s-sync with `--kubeconfig <sync.kubeconfig>`
//! # Ok(()) }
//! ```

use std::fs::OpenOptions;
use std::io::Write as _;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{Scope, pinned_kind};
use kube::runtime::wait::{await_condition, conditions};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use rivet_common::testing::etcd::{EtcdError, EtcdServer};
use rivet_common::testing::{last_lines, read_log};
use rivet_k8s::{ClientError, ClusterAccess};
use rivet_tools::{Tool, ToolError, tool_path};

/// The service cluster IP range (`--service-cluster-ip-range`).
pub const SERVICE_CLUSTER_IP_RANGE: &str = "198.19.255.0/24";
/// The field manager of everything the fixture applies.
pub const FIELD_MANAGER: &str = "rivet-testkit";
/// The service-account token issuer (and audience).
const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";
/// How long [`KubeApiServer::start`] and [`KubeApiServer::restart`] wait for
/// `/readyz` (a cold start is a few seconds on an idle machine; tests share
/// two cores with other builds).
const READY_TIMEOUT: Duration = Duration::from_secs(90);
/// How often `/readyz` is polled.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How long applied CRDs may take to be Established, and a pod to go.
const CONDITION_TIMEOUT: Duration = Duration::from_secs(30);
/// Lifetime of a service-account token (tests are shorter).
const TOKEN_SECONDS: i64 = 24 * 3600;
/// Retries with a new port when the chosen one was taken meanwhile.
const PORT_RETRIES: u32 = 3;
/// Lines of the log quoted in errors.
const LOG_TAIL_LINES: usize = 40;

/// What went wrong with the API server under test; every message says what
/// was being done. `Debug` prints the message too, so `.expect(..)` shows the
/// install hint or the log tail verbatim.
#[derive(thiserror::Error)]
pub enum KubeApiServerError {
    /// The built kube-apiserver is missing (names its version and `cargo
    /// xtask install`).
    #[error("starting kube-apiserver: {0}")]
    NotInstalled(#[from] ToolError),
    /// Its etcd did not start.
    #[error("starting kube-apiserver's etcd: {0}")]
    Etcd(#[from] EtcdError),
    /// A file or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// A certificate or key could not be generated.
    #[error("generating kube-apiserver's {what}: {source}")]
    Certificate {
        /// Which one.
        what: &'static str,
        /// Why.
        #[source]
        source: rcgen::Error,
    },
    /// kube-apiserver exited before it was ready.
    #[error("{action}: kube-apiserver exited with {status} before it was ready; the tail of {}:\n{tail}", log.display())]
    Exited {
        /// Starting or restarting.
        action: &'static str,
        /// Its exit status.
        status: ExitStatus,
        /// Its log.
        log: PathBuf,
        /// The log's last lines.
        tail: String,
    },
    /// kube-apiserver kept running but `/readyz` did not answer 200 in time.
    #[error(
        "{action}: kube-apiserver did not answer GET /readyz with 200 within {timeout:?} (last answer: {last}); the tail of {}:\n{tail}",
        log.display()
    )]
    NotReady {
        /// Starting or restarting.
        action: &'static str,
        /// How long it was given.
        timeout: Duration,
        /// The last probe's error, with the URL.
        last: String,
        /// Its log.
        log: PathBuf,
        /// The log's last lines.
        tail: String,
    },
    /// A request to the API server failed.
    #[error("{action}: {source}")]
    Api {
        /// What was being done, to which object.
        action: String,
        /// The client's error (a refused request carries the API's Status).
        #[source]
        source: kube::Error,
    },
    /// Watching for a condition failed.
    #[error("{action}: {source}")]
    Watch {
        /// What was awaited.
        action: String,
        /// The watch's error.
        #[source]
        source: kube::runtime::wait::Error,
    },
    /// A kubeconfig could not be turned into a client.
    #[error("building a client: {0}")]
    Client(#[from] ClientError),
    /// A manifest could not be read or is not what the fixture expects.
    #[error("{}: {reason}", path.display())]
    Manifest {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A condition was not reached in time.
    #[error("{action}: not done within {timeout:?}")]
    Timeout {
        /// What was awaited.
        action: String,
        /// How long.
        timeout: Duration,
    },
}

impl std::fmt::Debug for KubeApiServerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl KubeApiServerError {
    /// The HTTP status the API server answered, for a refused request.
    pub fn status_code(&self) -> Option<u16> {
        match self {
            Self::Api {
                source: kube::Error::Api(status),
                ..
            } => Some(status.code),
            _ => None,
        }
    }
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> KubeApiServerError {
    let context = context.into();
    move |source| KubeApiServerError::Io { context, source }
}

fn api_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> KubeApiServerError {
    let action = action.into();
    move |source| KubeApiServerError::Api { action, source }
}

/// A ServiceAccount's access to the API server, as a daemon gets it.
#[derive(Clone)]
pub struct ServiceAccountAccess {
    /// A kubeconfig file with the server, its CA and the account's token
    /// (pass it to the daemon under test).
    pub kubeconfig: PathBuf,
    /// A client built from that kubeconfig.
    pub client: Client,
    /// The ServiceAccount's namespace.
    pub namespace: String,
    /// The ServiceAccount's name.
    pub name: String,
}

impl std::fmt::Debug for ServiceAccountAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceAccountAccess")
            .field("kubeconfig", &self.kubeconfig)
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// A real kube-apiserver with its own etcd; see the module docs. Dropping it
/// kills kube-apiserver, then etcd, and removes the temp dir.
pub struct KubeApiServer {
    /// kube-apiserver while it runs.
    child: Option<Child>,
    /// The binary.
    bin: PathBuf,
    /// Its secure port on 127.0.0.1 (the same across restarts).
    port: u16,
    /// Certificates, keys, kubeconfigs and the log; removed on drop.
    dir: tempfile::TempDir,
    /// The client of the admin kubeconfig.
    admin: Client,
    /// Its etcd (dropped after kube-apiserver is killed).
    etcd: EtcdServer,
    /// How long the last start or restart took until `/readyz`.
    ready_after: Duration,
}

impl std::fmt::Debug for KubeApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeApiServer")
            .field("url", &self.url())
            .field("pid", &self.pid())
            .field("dir", &self.dir.path())
            .field("etcd", &self.etcd)
            .finish_non_exhaustive()
    }
}

impl KubeApiServer {
    /// Starts etcd and kube-apiserver and waits until `/readyz` answers 200.
    ///
    /// # Errors
    /// [`KubeApiServerError::NotInstalled`] without the built binaries (before
    /// anything is started); [`KubeApiServerError::Exited`] or
    /// [`KubeApiServerError::NotReady`], quoting its log, when it does not
    /// come up.
    pub async fn start() -> Result<Self, KubeApiServerError> {
        let bin = tool_path(Tool::KubeApiserver)?;
        tool_path(Tool::Etcd)?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("rivet-kube-{}-", std::process::id()))
            .tempdir()
            .map_err(io_err("creating kube-apiserver's temp dir"))?;
        write_pki(dir.path())?;
        let etcd = EtcdServer::start_async().await?;
        let port = free_port()?;
        let admin = admin_client(dir.path(), port).await?;
        let mut server = Self {
            child: None,
            bin,
            port,
            dir,
            admin,
            etcd,
            ready_after: Duration::ZERO,
        };
        let mut attempt = 0;
        loop {
            match server.launch("starting kube-apiserver").await {
                Err(KubeApiServerError::Exited { ref tail, .. }) if attempt < PORT_RETRIES && port_taken(tail) => {
                    attempt += 1;
                    server.note(&format!(
                        "port {} taken, retrying with a new port ({attempt} of {PORT_RETRIES})",
                        server.port
                    ));
                    server.port = free_port()?;
                    server.admin = admin_client(server.dir.path(), server.port).await?;
                }
                Err(err) => return Err(err), // `server` drops: etcd killed, dir removed.
                Ok(()) => return Ok(server),
            }
        }
    }

    /// `https://127.0.0.1:PORT` (the same across restarts).
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The admin kubeconfig (client certificate in `system:masters`).
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.dir.path().join("admin.kubeconfig")
    }

    /// A client with the admin kubeconfig (cheap to clone).
    pub fn admin_client(&self) -> Client {
        self.admin.clone()
    }

    /// `kubectl --kubeconfig <admin kubeconfig>` (the built kubectl v1.34.4),
    /// for what a user sees (`kubectl get rivetendpoints` printer columns).
    ///
    /// # Errors
    /// [`KubeApiServerError::NotInstalled`] without the built kubectl.
    pub fn kubectl(&self) -> Result<Command, KubeApiServerError> {
        let mut kubectl = Command::new(tool_path(Tool::Kubectl)?);
        kubectl
            .arg("--kubeconfig")
            .arg(self.admin_kubeconfig())
            .stdin(Stdio::null());
        Ok(kubectl)
    }

    /// The CA that signed the serving certificate (and the client
    /// certificates the server accepts).
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// Its etcd.
    pub fn etcd(&self) -> &EtcdServer {
        &self.etcd
    }

    /// kube-apiserver's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// How long the last start or restart took until `/readyz` said ok.
    pub fn ready_after(&self) -> Duration {
        self.ready_after
    }

    /// Everything kube-apiserver wrote, across restarts, with a
    /// `=== rivet: ... ===` line for each start, stop and retry.
    pub fn log(&self) -> String {
        read_log(&self.log_path())
    }

    /// SIGKILLs kube-apiserver (a crash or outage) and reaps it; etcd and its
    /// data stay. Does nothing when it is not running.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Err only when it already exited; `wait` reaps it either way.
            let _ = child.kill();
            let _ = child.wait();
            self.note("stopped (SIGKILL)");
        }
    }

    /// Starts kube-apiserver again (stopping it first if it runs) on the same
    /// port, certificates and etcd data, and waits until it is ready.
    ///
    /// # Errors
    /// As [`start`](Self::start); a port taken meanwhile is retried for a
    /// short while (the port cannot change: clients hold the URL).
    pub async fn restart(&mut self) -> Result<(), KubeApiServerError> {
        self.stop();
        let mut attempt = 0;
        loop {
            match self.launch("restarting kube-apiserver").await {
                Err(KubeApiServerError::Exited { ref tail, .. }) if attempt < PORT_RETRIES && port_taken(tail) => {
                    attempt += 1;
                    self.note(&format!("port taken, retrying ({attempt} of {PORT_RETRIES})"));
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => return other,
            }
        }
    }

    /// Applies Rivet's CRDs from `deploy/crds/` (server-side apply; not its
    /// kustomization) and waits until each is Established.
    ///
    /// # Errors
    /// A manifest that cannot be read, a refused apply, or a CRD not
    /// Established within 30 s.
    pub async fn apply_crds(&self) -> Result<Vec<String>, KubeApiServerError> {
        let dir = workspace_root().join("deploy/crds");
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(io_err(format!("listing {}", dir.display())))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .filter(|p| !p.ends_with(rivet_k8s::CRD_KUSTOMIZATION))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(KubeApiServerError::Manifest {
                path: dir,
                reason: "no CRD manifests (*.yaml) found".to_string(),
            });
        }
        let mut names = Vec::new();
        for file in &files {
            for doc in self.apply_file(file).await? {
                if doc["kind"] == "CustomResourceDefinition" {
                    names.push(object_name(file, &doc)?.to_string());
                }
            }
        }
        let crds: Api<CustomResourceDefinition> = Api::all(self.admin_client());
        for name in &names {
            let established = await_condition(crds.clone(), name, conditions::is_crd_established());
            tokio::time::timeout(CONDITION_TIMEOUT, established)
                .await
                .map_err(|_| KubeApiServerError::Timeout {
                    action: format!("waiting for CRD {name} to be Established"),
                    timeout: CONDITION_TIMEOUT,
                })?
                .map_err(|source| KubeApiServerError::Watch {
                    action: format!("waiting for CRD {name} to be Established"),
                    source,
                })?;
        }
        Ok(names)
    }

    /// The ServiceAccount of `deploy/rbac/<component>.yaml` with exactly that
    /// file's RBAC (applied as admin), and a kubeconfig + client for it with
    /// a token from the TokenRequest API.
    ///
    /// # Errors
    /// The file is missing or has no ServiceAccount, an apply is refused, or
    /// the token request fails.
    pub async fn service_account_client(&self, component: &str) -> Result<ServiceAccountAccess, KubeApiServerError> {
        let file = workspace_root().join("deploy/rbac").join(format!("{component}.yaml"));
        let docs = self.apply_file(&file).await?;
        let account =
            docs.iter()
                .find(|doc| doc["kind"] == "ServiceAccount")
                .ok_or_else(|| KubeApiServerError::Manifest {
                    path: file.clone(),
                    reason: "has no ServiceAccount".to_string(),
                })?;
        let name = object_name(&file, account)?.to_string();
        let namespace = account["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string();
        self.token_access(component, &namespace, &name).await
    }

    /// A kubeconfig and client for an existing ServiceAccount, with a token
    /// from the TokenRequest API; the file is `<component>.kubeconfig`.
    async fn token_access(
        &self,
        component: &str,
        namespace: &str,
        name: &str,
    ) -> Result<ServiceAccountAccess, KubeApiServerError> {
        let accounts: Api<ServiceAccount> = Api::namespaced(self.admin_client(), namespace);
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![ISSUER.to_string()],
                expiration_seconds: Some(TOKEN_SECONDS),
                ..TokenRequestSpec::default()
            },
            ..TokenRequest::default()
        };
        let token = accounts
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .map_err(api_err(format!(
                "requesting a token for ServiceAccount {namespace}/{name}"
            )))?
            .status
            .map(|s| s.token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| KubeApiServerError::Manifest {
                path: PathBuf::from(format!("serviceaccounts/{namespace}/{name}/token")),
                reason: "the TokenRequest came back without a token".to_string(),
            })?;
        let kubeconfig = self.dir.path().join(format!("{component}.kubeconfig"));
        let text = kubeconfig_yaml(
            &self.url(),
            &self.ca_cert(),
            &format!("system:serviceaccount:{namespace}:{name}"),
            &format!("    token: {token}\n"),
        );
        write_file(&kubeconfig, &text)?;
        let client = ClusterAccess::Kubeconfig(kubeconfig.clone()).client().await?;
        Ok(ServiceAccountAccess {
            kubeconfig,
            client,
            namespace: namespace.to_string(),
            name: name.to_string(),
        })
    }

    /// Applies every document of a YAML file as admin (server-side apply,
    /// field manager [`FIELD_MANAGER`]); returns the documents.
    ///
    /// # Errors
    /// An unreadable file, a document without apiVersion/kind/name, an
    /// unknown kind, or a refused apply.
    pub async fn apply_file(&self, path: &Path) -> Result<Vec<serde_json::Value>, KubeApiServerError> {
        let text = std::fs::read_to_string(path).map_err(io_err(format!("reading {}", path.display())))?;
        self.apply_yaml(path, &text).await
    }

    /// Applies every document of `yaml` (named `source` in errors), creating
    /// a document's namespace first if it does not exist.
    ///
    /// # Errors
    /// As [`apply_file`](Self::apply_file).
    pub async fn apply_yaml(&self, source: &Path, yaml: &str) -> Result<Vec<serde_json::Value>, KubeApiServerError> {
        let docs = yaml_documents(source, yaml)?;
        for doc in &docs {
            self.apply_document(source, doc).await?;
        }
        Ok(docs)
    }

    async fn apply_document(&self, source: &Path, doc: &serde_json::Value) -> Result<(), KubeApiServerError> {
        let bad = |reason: &str| KubeApiServerError::Manifest {
            path: source.to_path_buf(),
            reason: reason.to_string(),
        };
        let api_version = doc["apiVersion"]
            .as_str()
            .ok_or_else(|| bad("a document without apiVersion"))?;
        let kind = doc["kind"].as_str().ok_or_else(|| bad("a document without kind"))?;
        let name = object_name(source, doc)?;
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let client = self.admin_client();
        let (resource, caps) = pinned_kind(&client, &gvk).await.map_err(api_err(format!(
            "{}: finding the API of {api_version} {kind}",
            source.display()
        )))?;
        let api: Api<kube::api::DynamicObject> = match caps.scope {
            Scope::Cluster => Api::all_with(client, &resource),
            Scope::Namespaced => {
                let namespace = doc["metadata"]["namespace"].as_str().unwrap_or("default");
                self.ensure_namespace(namespace).await?;
                Api::namespaced_with(client, namespace, &resource)
            }
        };
        api.patch(name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(doc))
            .await
            .map_err(api_err(format!("{}: applying {kind} {name}", source.display())))?;
        Ok(())
    }

    /// Creates a namespace unless it exists.
    ///
    /// # Errors
    /// A refused create other than AlreadyExists.
    pub async fn ensure_namespace(&self, name: &str) -> Result<(), KubeApiServerError> {
        let namespaces: Api<Namespace> = Api::all(self.admin_client());
        let namespace = Namespace {
            metadata: kube::api::ObjectMeta {
                name: Some(name.to_string()),
                ..Default::default()
            },
            ..Default::default()
        };
        match namespaces.create(&PostParams::default(), &namespace).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.is_already_exists() => Ok(()),
            Err(source) => Err(KubeApiServerError::Api {
                action: format!("creating namespace {name}"),
                source,
            }),
        }
    }

    /// Spawns kube-apiserver on the current port and waits until ready.
    async fn launch(&mut self, action: &'static str) -> Result<(), KubeApiServerError> {
        let dir = self.dir.path().to_path_buf();
        self.note(&format!("{action}: {} with etcd {}", self.url(), self.etcd.endpoint()));
        let log = self.log_path();
        let stdout = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(io_err(format!("{action}: opening the log {}", log.display())))?;
        let stderr = stdout
            .try_clone()
            .map_err(io_err(format!("{action}: duplicating the log file {}", log.display())))?;
        let file = |name: &str| dir.join(name).display().to_string();
        let mut cmd = Command::new(&self.bin);
        cmd.arg(format!("--etcd-servers={}", self.etcd.endpoint()))
            .arg("--bind-address=127.0.0.1")
            .arg("--advertise-address=127.0.0.1")
            .arg(format!("--secure-port={}", self.port))
            .arg(format!("--cert-dir={}", file("cert-dir")))
            .arg(format!("--tls-cert-file={}", file("apiserver.crt")))
            .arg(format!("--tls-private-key-file={}", file("apiserver.key")))
            .arg(format!("--client-ca-file={}", file("ca.crt")))
            .arg("--authorization-mode=RBAC")
            .arg(format!("--service-account-issuer={ISSUER}"))
            .arg(format!("--service-account-key-file={}", file("sa.pub")))
            .arg(format!("--service-account-signing-key-file={}", file("sa.key")))
            .arg(format!("--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}"))
            .arg("--disable-admission-plugins=ServiceAccount")
            .arg("--enable-priority-and-fairness=false")
            .arg("--endpoint-reconciler-type=none")
            .arg("--profiling=false")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        let child = cmd
            .spawn()
            .map_err(io_err(format!("{action}: spawning {}", self.bin.display())))?;
        let pid = child.id();
        self.child = Some(child);
        let started = Instant::now();
        let deadline = started + READY_TIMEOUT;
        loop {
            let exited = self
                .child
                .as_mut()
                .map(Child::try_wait)
                .transpose()
                .map_err(io_err(format!("{action}: checking on kube-apiserver (pid {pid})")))?
                .flatten();
            if let Some(status) = exited {
                self.child = None;
                return Err(KubeApiServerError::Exited {
                    action,
                    status,
                    tail: last_lines(&read_log(&log), LOG_TAIL_LINES),
                    log,
                });
            }
            let last = match self.readyz().await {
                Ok(()) => {
                    self.ready_after = started.elapsed();
                    self.note(&format!("ready after {:?}", self.ready_after));
                    return Ok(());
                }
                Err(err) => err,
            };
            if Instant::now() >= deadline {
                self.stop();
                return Err(KubeApiServerError::NotReady {
                    action,
                    timeout: READY_TIMEOUT,
                    last,
                    tail: last_lines(&read_log(&log), LOG_TAIL_LINES),
                    log,
                });
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// One `GET /readyz` as admin: Ok on 200, else the error's text.
    async fn readyz(&self) -> Result<(), String> {
        let request = http::Request::get("/readyz")
            .body(Vec::new())
            .map_err(|e| e.to_string())?;
        self.admin
            .request_text(request)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("kube-apiserver.log")
    }

    /// Appends a marker line to the log (best effort).
    fn note(&self, what: &str) {
        if let Ok(mut log) = OpenOptions::new().create(true).append(true).open(self.log_path()) {
            let _ = writeln!(log, "=== rivet: kube-apiserver {what} ===");
        }
    }
}

impl Drop for KubeApiServer {
    fn drop(&mut self) {
        self.stop();
        // Then etcd (killed, its data removed) and the temp dir, as fields.
    }
}

/// Deletes a pod at once (grace period 0) and waits until it is gone. No
/// kubelet runs in the tests, so nothing would confirm a graceful deletion:
/// a pod deleted with the default grace period stays, with a
/// deletionTimestamp, until its grace period runs out.
///
/// # Errors
/// A refused delete (a pod already gone is fine), or a pod still there
/// after 30 s.
pub async fn delete_pod_now(client: Client, namespace: &str, name: &str) -> Result<(), KubeApiServerError> {
    let pods: Api<Pod> = Api::namespaced(client, namespace);
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    let uid = match pods.delete(name, &params).await {
        Ok(either) => either.left().and_then(|pod| pod.metadata.uid),
        Err(kube::Error::Api(status)) if status.is_not_found() => return Ok(()),
        Err(source) => {
            return Err(KubeApiServerError::Api {
                action: format!("deleting pod {namespace}/{name}"),
                source,
            });
        }
    };
    let Some(uid) = uid else { return Ok(()) };
    let action = format!("waiting for pod {namespace}/{name} to be deleted");
    tokio::time::timeout(
        CONDITION_TIMEOUT,
        await_condition(pods, name, conditions::is_deleted(&uid)),
    )
    .await
    .map_err(|_| KubeApiServerError::Timeout {
        action: action.clone(),
        timeout: CONDITION_TIMEOUT,
    })?
    .map_err(|source| KubeApiServerError::Watch { action, source })?;
    Ok(())
}

/// The workspace root (testkit lives one level below it).
fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit lives one level below the workspace root")
}

/// `metadata.name` of a document.
fn object_name<'a>(source: &Path, doc: &'a serde_json::Value) -> Result<&'a str, KubeApiServerError> {
    doc["metadata"]["name"]
        .as_str()
        .ok_or_else(|| KubeApiServerError::Manifest {
            path: source.to_path_buf(),
            reason: format!("a {} document without metadata.name", doc["kind"]),
        })
}

/// The non-empty documents of a YAML stream, as JSON values.
fn yaml_documents(source: &Path, yaml: &str) -> Result<Vec<serde_json::Value>, KubeApiServerError> {
    use serde::Deserialize as _;
    let mut docs = Vec::new();
    for (index, document) in serde_norway::Deserializer::from_str(yaml).enumerate() {
        let value = serde_json::Value::deserialize(document).map_err(|e| KubeApiServerError::Manifest {
            path: source.to_path_buf(),
            reason: format!("document {index} is not valid YAML: {e}"),
        })?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// A kubeconfig for one cluster, user and context; `user` holds the user's
/// indented fields (`    token: ...` or the client certificate and key).
fn kubeconfig_yaml(server: &str, ca: &Path, user_name: &str, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: rivet-test\n  cluster:\n    server: {server}\n    \
         certificate-authority: {ca}\nusers:\n- name: {user_name}\n  user:\n{user}contexts:\n- name: rivet-test\n  \
         context:\n    cluster: rivet-test\n    user: {user_name}\ncurrent-context: rivet-test\n",
        ca = ca.display(),
    )
}

/// Writes the admin kubeconfig for `port` and builds its client.
async fn admin_client(dir: &Path, port: u16) -> Result<Client, KubeApiServerError> {
    let path = dir.join("admin.kubeconfig");
    let user = format!(
        "    client-certificate: {}\n    client-key: {}\n",
        dir.join("admin.crt").display(),
        dir.join("admin.key").display()
    );
    write_file(
        &path,
        &kubeconfig_yaml(
            &format!("https://127.0.0.1:{port}"),
            &dir.join("ca.crt"),
            "rivet-admin",
            &user,
        ),
    )?;
    Ok(ClusterAccess::Kubeconfig(path).client().await?)
}

/// Generates the CA, kube-apiserver's serving certificate, the admin's
/// client certificate and the service-account signing key into `dir`.
fn write_pki(dir: &Path) -> Result<(), KubeApiServerError> {
    let cert_err = |what| move |source| KubeApiServerError::Certificate { what, source };
    let ca_key = KeyPair::generate().map_err(cert_err("CA key"))?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(cert_err("CA"))?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, "rivet-test-ca");
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca_params.self_signed(&ca_key).map_err(cert_err("CA certificate"))?;
    write_file(&dir.join("ca.crt"), &ca_cert.pem())?;
    let issuer = Issuer::new(ca_params, ca_key);

    let leaf = |what: &'static str,
                sans: Vec<String>,
                common_name: &str,
                organization: Option<&str>,
                usage: ExtendedKeyUsagePurpose|
     -> Result<(String, String), KubeApiServerError> {
        let key = KeyPair::generate().map_err(cert_err(what))?;
        let mut params = CertificateParams::new(sans).map_err(cert_err(what))?;
        params.distinguished_name.push(DnType::CommonName, common_name);
        if let Some(organization) = organization {
            params.distinguished_name.push(DnType::OrganizationName, organization);
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &issuer).map_err(cert_err(what))?;
        Ok((cert.pem(), key.serialize_pem()))
    };
    let (cert, key) = leaf(
        "serving certificate",
        [
            "127.0.0.1",
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
        ]
        .map(String::from)
        .to_vec(),
        "kube-apiserver",
        None,
        ExtendedKeyUsagePurpose::ServerAuth,
    )?;
    write_file(&dir.join("apiserver.crt"), &cert)?;
    write_file(&dir.join("apiserver.key"), &key)?;
    let (cert, key) = leaf(
        "admin client certificate",
        Vec::new(),
        "rivet-admin",
        Some("system:masters"),
        ExtendedKeyUsagePurpose::ClientAuth,
    )?;
    write_file(&dir.join("admin.crt"), &cert)?;
    write_file(&dir.join("admin.key"), &key)?;

    let sa_key = KeyPair::generate().map_err(cert_err("service-account signing key"))?;
    write_file(&dir.join("sa.key"), &sa_key.serialize_pem())?;
    write_file(&dir.join("sa.pub"), &sa_key.public_key_pem())?;
    Ok(())
}

fn write_file(path: &Path, text: &str) -> Result<(), KubeApiServerError> {
    std::fs::write(path, text).map_err(io_err(format!("writing {}", path.display())))
}

/// A port free on 127.0.0.1 a moment ago.
fn free_port() -> Result<u16, KubeApiServerError> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(io_err("choosing a free port for kube-apiserver (binding 127.0.0.1:0)"))
}

/// Whether the log says the listener could not bind.
fn port_taken(log_tail: &str) -> bool {
    log_tail.contains("address already in use")
}
