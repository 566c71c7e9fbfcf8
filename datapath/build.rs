//! Tells dependents' build scripts where `rivet.h` is: svc-loader compiles
//! the datapath against it (`DEP_RIVET_DATAPATH_INCLUDE`).

fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::metadata=include={dir}/include");
}
