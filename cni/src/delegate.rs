//! [`DelegateExec`] by running the plugin: found in `CNI_PATH`, with this
//! process's environment and `CNI_COMMAND` set to the verb, the invocation's
//! stdin, killed when its time is up (libcni's `invoke.DelegateAdd` /
//! `DelegateDel` do the same).

use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::Value;
use tokio::io::AsyncWriteExt as _;

use crate::api::DelegateExec;
use crate::env::Command;
use crate::error::{CniError, codes};

/// Runs delegated plugins from `CNI_PATH`.
#[derive(Debug, Clone)]
pub struct ExecDelegate {
    path: Vec<PathBuf>,
}

impl ExecDelegate {
    /// Plugins are looked up in `path` (the split `CNI_PATH`), in order.
    pub fn new(path: Vec<PathBuf>) -> Self {
        Self { path }
    }

    /// The first executable file `plugin` in the path.
    pub fn find(&self, plugin: &str) -> Option<PathBuf> {
        self.path.iter().map(|dir| dir.join(plugin)).find(|candidate| {
            std::fs::metadata(candidate).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    }
}

/// The error a plugin printed (`{code, msg, details}`), or one describing
/// how it failed.
fn plugin_error(
    plugin: &str,
    command: Command,
    status: std::process::ExitStatus,
    stdout: &[u8],
    stderr: &[u8],
) -> CniError {
    if let Ok(Value::Object(error)) = serde_json::from_slice::<Value>(stdout)
        && let Some(code) = error.get("code").and_then(Value::as_u64)
    {
        let msg = error.get("msg").and_then(Value::as_str).unwrap_or_default();
        let details = error.get("details").and_then(Value::as_str).unwrap_or_default();
        return CniError::new(
            u32::try_from(code).unwrap_or(codes::DELEGATED_IPAM),
            format!("delegated IPAM plugin {plugin} {command}: {msg}"),
        )
        .with_details(details);
    }
    let output = String::from_utf8_lossy(if stdout.is_empty() { stderr } else { stdout });
    CniError::new(
        codes::DELEGATED_IPAM,
        format!(
            "delegated IPAM plugin {plugin} {command} failed ({status}): {}",
            output.trim()
        ),
    )
}

impl DelegateExec for ExecDelegate {
    fn exec<'a>(
        &'a self,
        plugin: &'a str,
        command: Command,
        env: &'a [(&'static str, String)],
        stdin: &'a [u8],
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Vec<u8>, CniError>> {
        Box::pin(async move {
            let binary = self.find(plugin).ok_or_else(|| {
                CniError::new(
                    codes::DELEGATED_IPAM,
                    format!(
                        "delegated IPAM plugin {plugin} is not in CNI_PATH ({})",
                        self.path
                            .iter()
                            .map(|p| p.display().to_string())
                            .collect::<Vec<_>>()
                            .join(":")
                    ),
                )
            })?;
            let run = async {
                let mut child = tokio::process::Command::new(&binary)
                    .env("CNI_COMMAND", command.as_str())
                    .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .kill_on_drop(true)
                    .spawn()
                    .map_err(|e| CniError::new(codes::DELEGATED_IPAM, format!("running {}: {e}", binary.display())))?;
                let mut input = child.stdin.take().expect("stdin is piped");
                // A plugin that exits without reading its stdin is not an error here.
                let _ = input.write_all(stdin).await;
                drop(input);
                child
                    .wait_with_output()
                    .await
                    .map_err(|e| CniError::new(codes::IO_FAILURE, format!("waiting for {}: {e}", binary.display())))
            };
            let output = match tokio::time::timeout(timeout, run).await {
                Ok(output) => output?,
                Err(_) => {
                    return Err(CniError::new(
                        codes::TRY_AGAIN_LATER,
                        format!("delegated IPAM plugin {plugin} {command} did not finish within {timeout:?}"),
                    ));
                }
            };
            if !output.stderr.is_empty() {
                tracing::info!(
                    plugin,
                    %command,
                    stderr = %String::from_utf8_lossy(&output.stderr).trim(),
                    "delegated IPAM plugin wrote to stderr"
                );
            }
            if output.status.success() {
                Ok(output.stdout)
            } else {
                Err(plugin_error(
                    plugin,
                    command,
                    output.status,
                    &output.stdout,
                    &output.stderr,
                ))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    fn script(dir: &std::path::Path, name: &str, body: &str) {
        let path = dir.join(name);
        let mut file = std::fs::File::create(&path).unwrap();
        writeln!(file, "#!/bin/sh\n{body}").unwrap();
        drop(file);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[tokio::test]
    async fn runs_the_plugin_with_the_verb_and_stdin() {
        let dir = tempfile::tempdir().unwrap();
        script(
            dir.path(),
            "echo-ipam",
            r#"echo "{\"cmd\": \"$CNI_COMMAND\", \"id\": \"$CNI_CONTAINERID\", \"in\": $(cat)}""#,
        );
        script(
            dir.path(),
            "failing-ipam",
            r#"echo '{"code": 11, "msg": "busy", "details": "d"}'; exit 1"#,
        );
        script(dir.path(), "crashing-ipam", "echo oops >&2; exit 3");
        script(dir.path(), "slow-ipam", "sleep 5");
        std::fs::write(dir.path().join("not-executable"), "").unwrap();
        let empty = tempfile::tempdir().unwrap();
        let delegate = ExecDelegate::new(vec![empty.path().to_path_buf(), dir.path().to_path_buf()]);
        let t = Duration::from_secs(5);

        let out = delegate
            .exec("echo-ipam", Command::Del, &[], br#"{"a": 1}"#, t)
            .await
            .unwrap();
        let out: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(out["cmd"], "DEL");
        assert_eq!(out["in"]["a"], 1);
        // Extra environment on top (GC names the attachment it releases).
        let out = delegate
            .exec("echo-ipam", Command::Del, &[("CNI_CONTAINERID", "c9".into())], b"{}", t)
            .await
            .unwrap();
        let out: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(out["id"], "c9");

        let err = delegate
            .exec("failing-ipam", Command::Add, &[], b"{}", t)
            .await
            .unwrap_err();
        assert_eq!((err.code, err.details.as_str()), (11, "d"));
        assert!(err.msg.contains("failing-ipam ADD: busy"), "{err}");

        let err = delegate
            .exec("crashing-ipam", Command::Add, &[], b"{}", t)
            .await
            .unwrap_err();
        assert_eq!(err.code, codes::DELEGATED_IPAM);
        assert!(err.msg.contains("oops"), "{err}");

        for missing in ["nope", "not-executable"] {
            let err = delegate.exec(missing, Command::Add, &[], b"{}", t).await.unwrap_err();
            assert_eq!(err.code, codes::DELEGATED_IPAM);
            assert!(err.msg.contains("not in CNI_PATH"), "{err}");
        }

        let started = std::time::Instant::now();
        let err = delegate
            .exec("slow-ipam", Command::Add, &[], b"{}", Duration::from_millis(200))
            .await
            .unwrap_err();
        assert_eq!(err.code, codes::TRY_AGAIN_LATER);
        assert!(started.elapsed() < Duration::from_secs(3), "the slow plugin was killed");
    }
}
