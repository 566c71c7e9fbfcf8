//! rivet-datapath: the datapath ABI, the one owner of the contract between
//! the BPF programs (`svc-loader/bpf/datapath.c`) and every Rust process
//! that reads or writes their maps (svc-loader, svc-gc, inspection).
//!
//! - `include/rivet.h`: the C side (map layouts and constants); dependents'
//!   build scripts find it through `DEP_RIVET_DATAPATH_INCLUDE`;
//! - [`maps`]: the `#[repr(C)]` mirrors of `rivet.h`, checked against
//!   clang's view of it.
//!
//! Not here: loading the object, attaching programs, map writes with
//! meaning (svc-loader), garbage collection (svc-gc).

pub mod maps;
