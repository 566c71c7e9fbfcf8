//! Compiles the Kubernetes CRI API (`proto/runtime/v1/api.proto`, runtime.v1)
//! with protox (pure Rust, no system `protoc`): client side only, the tests
//! play kubelet against containerd.

use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new("proto");
    let file = root.join("runtime/v1/api.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(fds)?;
    Ok(())
}
