//! Compiles the verdict benchmark's floor program (bpf/floor.c) with clang
//! the way svc-loader compiles the datapath, into an object embedded in
//! the benchmark binary.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=bpf/floor.c");
    println!("cargo:rerun-if-env-changed=CLANG");
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
    let status = Command::new(&clang)
        .args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"])
        .args(["-I", "/usr/include/x86_64-linux-gnu"])
        .args(["-c", "bpf/floor.c", "-o"])
        .arg(out.join("floor.o"))
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("clang failed to compile bpf/floor.c ({s}); see the errors above"),
        Err(e) => panic!(
            "cannot run {clang} ({e}): the verdict benchmark needs clang and the BPF headers; \
             install them with `apt-get install clang llvm libbpf-dev` (cargo xtask install does)"
        ),
    }
}
