//! The CRDs: what `kubectl` users see (names, scope, short names, columns)
//! and that `deploy/crds/` holds exactly the generated files (the CRDs and
//! their kustomization).

use std::collections::BTreeMap;
use std::path::PathBuf;

use rivet_k8s::{CRD_KUSTOMIZATION, crd_kustomization, crd_manifests, crds};

fn deploy_crds() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds")
}

#[test]
fn checked_in_crds_equal_the_generated_ones() {
    let mut generated: BTreeMap<String, String> = crd_manifests().into_iter().map(|m| (m.file_name, m.yaml)).collect();
    generated.insert(CRD_KUSTOMIZATION.to_string(), crd_kustomization());
    let mut checked_in = BTreeMap::new();
    for entry in std::fs::read_dir(deploy_crds()).expect("deploy/crds exists (run `cargo xtask crds`)") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            checked_in.insert(name, std::fs::read_to_string(&path).unwrap());
        }
    }
    let stale: Vec<&String> = generated
        .iter()
        .filter(|(name, yaml)| checked_in.get(*name) != Some(yaml))
        .map(|(name, _)| name)
        .chain(checked_in.keys().filter(|name| !generated.contains_key(*name)))
        .collect();
    assert!(
        stale.is_empty(),
        "deploy/crds/ differs from the CRD types in {stale:?}: run `cargo xtask crds` and commit the result"
    );
}

#[test]
fn each_crd_has_its_names_scope_and_columns() {
    // (name, scope, short name, printer columns)
    let expected = [
        (
            "rivetendpoints.rivet.io",
            "Namespaced",
            "rep",
            &["ID", "Identity", "State", "IPv4", "IPv6", "Node", "Age"][..],
        ),
        ("rivetidentities.rivet.io", "Cluster", "rid", &["Labels", "Age"][..]),
        ("rivetnetworkpolicies.rivet.io", "Namespaced", "rnp", &["Age"][..]),
        (
            "rivetnodes.rivet.io",
            "Cluster",
            "rnode",
            &["Ready", "PodCIDRs", "Encapsulation", "Age"][..],
        ),
    ];
    let crds = crds();
    assert_eq!(crds.len(), expected.len());
    for (crd, (name, scope, short, columns)) in crds.iter().zip(expected) {
        assert_eq!(crd.metadata.name.as_deref(), Some(name));
        assert_eq!(crd.spec.group, "rivet.io");
        assert_eq!(crd.spec.scope, scope, "{name}");
        assert_eq!(
            crd.spec.names.short_names.as_deref(),
            Some(&[short.to_string()][..]),
            "{name}"
        );
        assert_eq!(
            crd.spec.names.categories.as_deref(),
            Some(&["rivet".to_string()][..]),
            "{name}"
        );
        let [version] = &crd.spec.versions[..] else {
            panic!("{name}: one version expected")
        };
        assert_eq!(
            (version.name.as_str(), version.served, version.storage),
            ("v1", true, true)
        );
        let names: Vec<&str> = version
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(names, columns, "{name}");
    }
}
