//! Compiles every `.proto` under `proto/` with protox (pure Rust), so building
//! Rivet needs no system `protoc`.

use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new("proto");
    let mut files = Vec::new();
    collect_protos(root, &mut files)?;
    files.sort();
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    println!("cargo:rerun-if-changed={}", root.display());

    let fds = protox::compile(&files, [root])?;
    // Every file (imports included) for gRPC server reflection.
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("rivet_descriptor.bin"), prost::Message::encode_to_vec(&fds))?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}

fn collect_protos(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_protos(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") {
            out.push(path);
        }
    }
    Ok(())
}
