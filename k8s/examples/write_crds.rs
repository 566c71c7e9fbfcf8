//! Writes `deploy/crds/` from the CRD types (`cargo xtask crds` runs this):
//! one file per CRD and the kustomization listing them, stale `*.yaml`
//! files removed.
//!
//! Usage: `cargo run -p rivet-k8s --example write_crds -- <dir>`

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let dir: PathBuf = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds"));
    std::fs::create_dir_all(&dir)?;
    let manifests = rivet_k8s::crd_manifests();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.ends_with(".yaml")
            && name != rivet_k8s::CRD_KUSTOMIZATION
            && !manifests.iter().any(|m| m.file_name == name)
        {
            std::fs::remove_file(&path)?;
            println!("removed {}", path.display());
        }
    }
    for manifest in manifests {
        let path = dir.join(&manifest.file_name);
        std::fs::write(&path, manifest.yaml)?;
        println!("wrote {}", path.display());
    }
    let path = dir.join(rivet_k8s::CRD_KUSTOMIZATION);
    std::fs::write(&path, rivet_k8s::crd_kustomization())?;
    println!("wrote {}", path.display());
    Ok(())
}
