//! `--policy-dir`: policies kept as YAML/JSON files in a directory (a
//! mounted ConfigMap, or files an operator drops in). The directory is the
//! desired set of policies of origin DIRECTORY: on every change (inotify,
//! plus a periodic rescan because ConfigMap symlink swaps can be missed) it
//! is read whole, new and changed policies are upserted and policies whose
//! file disappeared are deleted. A file that does not parse changes nothing:
//! its previously applied policies stay, and the error is logged with the
//! file and field.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use rivet_common::controller::{Action, Controller, Controllers, Trigger};

use crate::manager::EndpointManager;
use rivet_policy::{Policy, PolicyKey, PolicyOrigin};

/// How long changes settle before the directory is read.
const SETTLE: Duration = Duration::from_millis(100);

/// Deadline of the regenerations a directory change triggers (not waited for).
const APPLY_DEADLINE: Duration = Duration::from_secs(30);

/// The watched policy directory.
#[derive(Debug)]
pub struct PolicyDirectory {
    dir: PathBuf,
    manager: EndpointManager,
    rescan: Duration,
    /// Keys applied from each file at the last successful read of it.
    applied: BTreeMap<PathBuf, Vec<Policy>>,
}

impl PolicyDirectory {
    /// Watches `dir`, rereading it at least every `rescan`.
    pub fn new(dir: impl Into<PathBuf>, manager: EndpointManager, rescan: Duration) -> Self {
        Self {
            dir: dir.into(),
            manager,
            rescan,
            applied: BTreeMap::new(),
        }
    }

    /// Starts the `policy-dir` controller: applies the directory now, then
    /// again on every change it is told of and at least every `rescan`.
    pub fn start(self, controllers: &Controllers) {
        let trigger = Trigger::new();
        let changed = trigger.clone();
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            if event.is_ok() {
                changed.trigger();
            }
        })
        .and_then(|mut w| w.watch(&self.dir, RecursiveMode::NonRecursive).map(|()| w));
        let watcher = match watcher {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot watch the policy dir; rescanning every {:?}", self.rescan);
                None
            }
        };
        let rescan = self.rescan;
        let directory = Arc::new(tokio::sync::Mutex::new(self));
        controllers.reconcile(Controller::new("policy-dir").trigger(&trigger), move || {
            // Kept as long as the controller: dropping it ends the watch.
            let _watcher = &watcher;
            let directory = directory.clone();
            async move {
                // Let a burst of changes (a ConfigMap update) settle.
                tokio::time::sleep(SETTLE).await;
                directory.lock().await.sync().await;
                Ok::<_, std::convert::Infallible>(Action::requeue(rescan))
            }
        });
    }

    /// Reads the directory and makes the repository's DIRECTORY policies
    /// match it.
    pub async fn sync(&mut self) {
        let files = match policy_files(&self.dir) {
            Ok(files) => files,
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "reading the policy dir failed; nothing changed");
                self.manager
                    .policy_dir_scanned(&self.dir, &[(self.dir.clone(), format!("reading the directory: {e}"))]);
                return;
            }
        };
        let mut rejected = Vec::new();
        let mut next: BTreeMap<PathBuf, Vec<Policy>> = BTreeMap::new();
        for file in files {
            let parsed = std::fs::read_to_string(&file)
                .map_err(|e| e.to_string())
                .and_then(|text| Policy::parse_all(&text).map_err(|e| e.to_string()));
            match parsed {
                Ok(policies) => {
                    next.insert(file, policies);
                }
                Err(e) => {
                    if let Some(previous) = self.applied.get(&file) {
                        next.insert(file.clone(), previous.clone());
                    }
                    rejected.push((file, e));
                }
            }
        }
        let mut desired: BTreeMap<PolicyKey, (&Path, &Policy)> = BTreeMap::new();
        for (file, policies) in &next {
            for policy in policies {
                if let Some((other, _)) = desired.insert(policy.key().clone(), (file, policy)) {
                    tracing::warn!(policy = %policy.key(), file = %file.display(), other = %other.display(), "policy defined twice; the later file wins");
                }
            }
        }
        for (key, (file, policy)) in &desired {
            match self
                .manager
                .upsert_policy((*policy).clone(), PolicyOrigin::Directory, false, APPLY_DEADLINE)
                .await
            {
                Ok(update) if update.change.changed => {
                    tracing::info!(policy = %key, file = %file.display(), revision = update.change.revision, "policy applied from the policy dir");
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(policy = %key, file = %file.display(), error = %e, "policy from the policy dir not applied")
                }
            }
        }
        let stale: BTreeSet<PolicyKey> = {
            let (policies, _) = self.manager.policies();
            policies
                .into_iter()
                .filter(|p| p.origin == PolicyOrigin::Directory && !desired.contains_key(p.policy.key()))
                .map(|p| p.policy.key().clone())
                .collect()
        };
        for key in stale {
            match self
                .manager
                .delete_policy(&key, PolicyOrigin::Directory, false, APPLY_DEADLINE)
                .await
            {
                Ok(_) => tracing::info!(policy = %key, "policy removed: its file is gone from the policy dir"),
                Err(e) => tracing::error!(policy = %key, error = %e, "removing a policy of the policy dir failed"),
            }
        }
        self.applied = next;
        self.manager.policy_dir_scanned(&self.dir, &rejected);
    }
}

/// `*.yaml`, `*.yml` and `*.json` files of `dir`, sorted; hidden entries
/// (ConfigMap `..data` links and editors' temp files) skipped.
fn policy_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if name.starts_with('.') || !path.is_file() {
            continue;
        }
        if [".yaml", ".yml", ".json"].iter().any(|ext| name.ends_with(ext)) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_visible_policy_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["b.yaml", "a.json", "c.yml", ".hidden.yaml", "notes.txt", "..data"] {
            std::fs::write(dir.path().join(name), "").unwrap();
        }
        std::fs::create_dir(dir.path().join("sub.yaml")).unwrap();
        let names: Vec<String> = policy_files(dir.path())
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            ["a.json", "b.yaml", "c.yml"],
            "only visible yaml/json files are policies"
        );
    }
}
