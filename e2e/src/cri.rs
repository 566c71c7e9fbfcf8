//! A small Kubernetes CRI client (runtime.v1 over tonic on containerd's Unix
//! socket) with the calls kubelet makes for a pod: `RunPodSandbox` (the
//! runtime creates the pod's network namespace and calls CNI ADD),
//! `CreateContainer` + `StartContainer`, `ExecSync`, `PodSandboxStatus`
//! (the pod's IPs as CNI returned them), `StopPodSandbox` (CNI DEL) and
//! `RemovePodSandbox`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};

use crate::runtime::v1 as cri;
use crate::runtime::v1::image_service_client::ImageServiceClient;
use crate::runtime::v1::runtime_service_client::RuntimeServiceClient;
use crate::{Error, Result};

/// Deadline of one CRI call (`RunPodSandbox` includes the CNI ADD; an
/// `ExecSync` has its own, shorter, timeout inside this).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// A CRI client. Methods take `&self` (tonic clients are cheap clones).
#[derive(Debug, Clone)]
pub struct Cri {
    runtime: RuntimeServiceClient<DaemonChannel>,
    images: ImageServiceClient<DaemonChannel>,
}

fn cri_err(call: impl Into<String>) -> impl FnOnce(tonic::Status) -> Error {
    let call = call.into();
    move |status| Error::Cri {
        call,
        status: Box::new(status),
    }
}

/// What kubelet puts in a `PodSandboxConfig`, reduced to what the tests vary.
#[derive(Debug, Clone, Default)]
pub struct PodSpec {
    /// Pod name (`K8S_POD_NAME` in the CNI args).
    pub name: String,
    /// Pod namespace (`K8S_POD_NAMESPACE`).
    pub namespace: String,
    /// Pod UID (`K8S_POD_UID`); [`PodSpec::new`] makes a random one.
    pub uid: String,
    /// Pod labels (kept by the runtime; containerd does not pass them to CNI).
    pub labels: HashMap<String, String>,
    /// Pod annotations (passed to a CNI plugin that declares the
    /// `io.kubernetes.cri.pod-annotations` capability).
    pub annotations: HashMap<String, String>,
    /// `linux.cgroup_parent` (kubelet sets one per pod; see
    /// [`Containerd::cgroup_parent`](crate::containerd::Containerd::cgroup_parent)).
    pub cgroup_parent: String,
    /// Where the runtime writes container logs (`<dir>/<container>/<attempt>.log`).
    pub log_directory: String,
}

impl PodSpec {
    /// A pod `namespace/name` with a fresh UID.
    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            uid: uuid::Uuid::new_v4().to_string(),
            ..Self::default()
        }
    }

    /// Adds a label.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_owned(), value.to_owned());
        self
    }

    /// Sets the cgroup parent.
    pub fn cgroup_parent(mut self, parent: &str) -> Self {
        self.cgroup_parent = parent.to_owned();
        self
    }

    /// Sets the log directory.
    pub fn log_directory(mut self, dir: &Path) -> Self {
        self.log_directory = dir.display().to_string();
        self
    }

    /// The sandbox config kubelet would send.
    pub fn to_config(&self) -> cri::PodSandboxConfig {
        cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: self.name.clone(),
                uid: self.uid.clone(),
                namespace: self.namespace.clone(),
                attempt: 0,
            }),
            hostname: self.name.clone(),
            log_directory: self.log_directory.clone(),
            labels: self.labels.clone(),
            annotations: self.annotations.clone(),
            linux: Some(cri::LinuxPodSandboxConfig {
                cgroup_parent: self.cgroup_parent.clone(),
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: cri::NamespaceMode::Pod.into(),
                        pid: cri::NamespaceMode::Container.into(),
                        ipc: cri::NamespaceMode::Pod.into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

/// A container config: `name` from `image` running `command`.
pub fn container_config(name: &str, image: &str, command: &[&str]) -> cri::ContainerConfig {
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: name.to_owned(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: image.to_owned(),
            ..Default::default()
        }),
        command: command.iter().map(|s| (*s).to_owned()).collect(),
        log_path: format!("{name}/0.log"),
        linux: Some(cri::LinuxContainerConfig::default()),
        ..Default::default()
    }
}

/// The result of `ExecSync`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// Its stdout, lossily decoded.
    pub stdout: String,
    /// Its stderr, lossily decoded.
    pub stderr: String,
    /// Its exit code.
    pub exit_code: i32,
}

impl ExecOutput {
    /// Exit code 0.
    pub fn success(&self) -> bool {
        self.exit_code == 0
    }
}

impl std::fmt::Display for ExecOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {}; stdout: {:?}; stderr: {:?}",
            self.exit_code,
            self.stdout.trim(),
            self.stderr.trim()
        )
    }
}

/// A pod the tests started: its sandbox, one container and what it took.
#[derive(Debug, Clone)]
pub struct RunningPod {
    /// The spec it was created from.
    pub spec: PodSpec,
    /// The sandbox id (also the CNI container id).
    pub sandbox_id: String,
    /// The container's id.
    pub container_id: String,
    /// The pod's addresses (primary first), as the CNI result gave them.
    pub ips: Vec<IpAddr>,
    /// Duration of `RunPodSandbox` (pause container + netns + CNI ADD).
    pub run_sandbox: Duration,
    /// Duration of `CreateContainer` + `StartContainer`.
    pub start_container: Duration,
}

impl RunningPod {
    /// The pod's first IPv4 address.
    pub fn ipv4(&self) -> Option<IpAddr> {
        self.ips.iter().copied().find(IpAddr::is_ipv4)
    }

    /// The pod's first IPv6 address.
    pub fn ipv6(&self) -> Option<IpAddr> {
        self.ips.iter().copied().find(IpAddr::is_ipv6)
    }
}

impl Cri {
    /// Connects to the CRI socket (containerd's gRPC address).
    pub async fn connect(socket: &Path) -> Result<Self> {
        let options = ClientOptions {
            connect_timeout: Duration::from_secs(10),
            request_timeout: CALL_TIMEOUT,
            ..ClientOptions::default()
        };
        let channel = connect_unix(socket, &options).await?;
        Ok(Self {
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
        })
    }

    /// `Version`: runtime name and version.
    pub async fn version(&self) -> Result<cri::VersionResponse> {
        let request = cri::VersionRequest { version: "v1".into() };
        Ok(self
            .runtime
            .clone()
            .version(request)
            .await
            .map_err(cri_err("Version"))?
            .into_inner())
    }

    /// `Status`: the runtime's conditions (`RuntimeReady`, `NetworkReady`).
    pub async fn status(&self) -> Result<Vec<cri::RuntimeCondition>> {
        let response = self
            .runtime
            .clone()
            .status(cri::StatusRequest { verbose: false })
            .await
            .map_err(cri_err("Status"))?
            .into_inner();
        Ok(response.status.map(|s| s.conditions).unwrap_or_default())
    }

    /// `ImageStatus`: whether the runtime has `image`.
    pub async fn has_image(&self, image: &str) -> Result<bool> {
        let response = self
            .images
            .clone()
            .image_status(cri::ImageStatusRequest {
                image: Some(cri::ImageSpec {
                    image: image.to_owned(),
                    ..Default::default()
                }),
                verbose: false,
            })
            .await
            .map_err(cri_err(format!("ImageStatus {image}")))?
            .into_inner();
        Ok(response.image.is_some())
    }

    /// `RunPodSandbox`; returns the sandbox id.
    pub async fn run_pod_sandbox(&self, config: &cri::PodSandboxConfig) -> Result<String> {
        let name = config.metadata.as_ref().map(|m| m.name.clone()).unwrap_or_default();
        Ok(self
            .runtime
            .clone()
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: String::new(),
            })
            .await
            .map_err(cri_err(format!("RunPodSandbox {name}")))?
            .into_inner()
            .pod_sandbox_id)
    }

    /// `StopPodSandbox`: kills the pod's containers and calls CNI DEL.
    pub async fn stop_pod_sandbox(&self, id: &str) -> Result<()> {
        self.runtime
            .clone()
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: id.to_owned(),
            })
            .await
            .map_err(cri_err(format!("StopPodSandbox {id}")))?;
        Ok(())
    }

    /// `RemovePodSandbox`: removes the stopped sandbox and its containers.
    pub async fn remove_pod_sandbox(&self, id: &str) -> Result<()> {
        self.runtime
            .clone()
            .remove_pod_sandbox(cri::RemovePodSandboxRequest {
                pod_sandbox_id: id.to_owned(),
            })
            .await
            .map_err(cri_err(format!("RemovePodSandbox {id}")))?;
        Ok(())
    }

    /// `PodSandboxStatus`.
    pub async fn pod_sandbox_status(&self, id: &str) -> Result<cri::PodSandboxStatus> {
        self.runtime
            .clone()
            .pod_sandbox_status(cri::PodSandboxStatusRequest {
                pod_sandbox_id: id.to_owned(),
                verbose: false,
            })
            .await
            .map_err(cri_err(format!("PodSandboxStatus {id}")))?
            .into_inner()
            .status
            .ok_or_else(|| Error::Cri {
                call: format!("PodSandboxStatus {id}"),
                status: Box::new(tonic::Status::internal("no status in the response")),
            })
    }

    /// The sandbox's IPs (`network.ip` then `network.additional_ips`).
    pub async fn pod_ips(&self, id: &str) -> Result<Vec<IpAddr>> {
        let status = self.pod_sandbox_status(id).await?;
        let network = status.network.unwrap_or_default();
        let mut ips = Vec::new();
        for text in std::iter::once(network.ip).chain(network.additional_ips.into_iter().map(|p| p.ip)) {
            if text.is_empty() {
                continue;
            }
            let ip = text.parse().map_err(|e| Error::Cri {
                call: format!("PodSandboxStatus {id}"),
                status: Box::new(tonic::Status::internal(format!("pod IP {text:?}: {e}"))),
            })?;
            ips.push(ip);
        }
        Ok(ips)
    }

    /// `ListPodSandbox` (all states).
    pub async fn list_pod_sandboxes(&self) -> Result<Vec<cri::PodSandbox>> {
        Ok(self
            .runtime
            .clone()
            .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
            .await
            .map_err(cri_err("ListPodSandbox"))?
            .into_inner()
            .items)
    }

    /// `CreateContainer` in sandbox `pod_id` (created from `sandbox`).
    pub async fn create_container(
        &self,
        pod_id: &str,
        config: &cri::ContainerConfig,
        sandbox: &cri::PodSandboxConfig,
    ) -> Result<String> {
        let name = config.metadata.as_ref().map(|m| m.name.clone()).unwrap_or_default();
        Ok(self
            .runtime
            .clone()
            .create_container(cri::CreateContainerRequest {
                pod_sandbox_id: pod_id.to_owned(),
                config: Some(config.clone()),
                sandbox_config: Some(sandbox.clone()),
            })
            .await
            .map_err(cri_err(format!("CreateContainer {name}")))?
            .into_inner()
            .container_id)
    }

    /// `StartContainer`.
    pub async fn start_container(&self, id: &str) -> Result<()> {
        self.runtime
            .clone()
            .start_container(cri::StartContainerRequest {
                container_id: id.to_owned(),
            })
            .await
            .map_err(cri_err(format!("StartContainer {id}")))?;
        Ok(())
    }

    /// `ExecSync`: runs `cmd` in container `id`, at most `timeout` (whole
    /// seconds, at least 1).
    pub async fn exec_sync(&self, id: &str, cmd: &[&str], timeout: Duration) -> Result<ExecOutput> {
        let response = self
            .runtime
            .clone()
            .exec_sync(cri::ExecSyncRequest {
                container_id: id.to_owned(),
                cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
                timeout: timeout.as_secs().max(1) as i64,
            })
            .await
            .map_err(cri_err(format!("ExecSync {cmd:?} in {id}")))?
            .into_inner();
        Ok(ExecOutput {
            stdout: String::from_utf8_lossy(&response.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&response.stderr).into_owned(),
            exit_code: response.exit_code,
        })
    }

    /// What kubelet does to start a one-container pod: `RunPodSandbox`,
    /// `PodSandboxStatus` (IPs), `CreateContainer` from `image` running
    /// `command`, `StartContainer`.
    pub async fn run_pod(&self, spec: &PodSpec, image: &str, command: &[&str]) -> Result<RunningPod> {
        let sandbox = spec.to_config();
        let started = Instant::now();
        let sandbox_id = self.run_pod_sandbox(&sandbox).await?;
        let run_sandbox = started.elapsed();
        let ips = self.pod_ips(&sandbox_id).await?;
        let started = Instant::now();
        let container_id = self
            .create_container(&sandbox_id, &container_config("main", image, command), &sandbox)
            .await?;
        self.start_container(&container_id).await?;
        Ok(RunningPod {
            spec: spec.clone(),
            sandbox_id,
            container_id,
            ips,
            run_sandbox,
            start_container: started.elapsed(),
        })
    }

    /// What kubelet does when a pod goes away: `StopPodSandbox` (CNI DEL),
    /// then `RemovePodSandbox`. Returns how long the stop took.
    pub async fn delete_pod(&self, sandbox_id: &str) -> Result<Duration> {
        let started = Instant::now();
        self.stop_pod_sandbox(sandbox_id).await?;
        let stopped = started.elapsed();
        self.remove_pod_sandbox(sandbox_id).await?;
        Ok(stopped)
    }
}
