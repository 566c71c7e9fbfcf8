//! Compiles the datapath (bpf/*.c) with clang into one BPF object that is
//! embedded in the binary: nodes never run a compiler. The map layouts come
//! from the datapath ABI crate's `rivet.h` (rivet-datapath).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let object = out.join("datapath.o");
    let include = PathBuf::from(
        std::env::var("DEP_RIVET_DATAPATH_INCLUDE").expect("rivet-datapath's build script exports its include dir"),
    );
    println!("cargo:rerun-if-changed=bpf");
    println!("cargo:rerun-if-changed={}", include.join("rivet.h").display());
    println!("cargo:rerun-if-env-changed=CLANG");
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
    let status = Command::new(&clang)
        .args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"])
        .args(["-I", "/usr/include/x86_64-linux-gnu", "-I"])
        .arg(&include)
        .args(["-c", "bpf/datapath.c", "-o"])
        .arg(&object)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("clang failed to compile bpf/datapath.c ({s}); see the errors above"),
        Err(e) => panic!(
            "cannot run {clang} ({e}): the datapath needs clang and the BPF headers; \
             install them with `apt-get install clang llvm libbpf-dev` (cargo xtask install does)"
        ),
    }
}
