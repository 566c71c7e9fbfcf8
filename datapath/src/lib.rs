//! rivet-datapath: the datapath ABI, the one owner of the contract between
//! the BPF programs (`svc-loader/bpf/datapath.c`) and every Rust process
//! that reads or writes their maps (svc-loader, svc-gc, inspection).
//!
//! - `include/rivet.h`: the C side (map layouts and constants); dependents'
//!   build scripts find it through `DEP_RIVET_DATAPATH_INCLUDE`;
//! - [`maps`]: the `#[repr(C)]` mirrors of `rivet.h`, checked against
//!   clang's view of it, and the conntrack default lifetimes;
//! - [`spec`]: every map's name (also its pin name), type, key and value
//!   sizes, flags and default size;
//! - [`pin`]: the pin directory layout and opening a pinned map from
//!   another process, checked against its [`spec::MapDef`].
//!
//! Not here: loading the object, attaching programs, map writes with
//! meaning (svc-loader), garbage collection (svc-gc).
//!
//! ```
//! use rivet_datapath::{pin, spec};
//!
//! let dir = pin::pin_dir(pin::DEFAULT_BPFFS, "node-1").unwrap();
//! assert_eq!(dir, std::path::Path::new("/sys/fs/bpf/rivet/node-1"));
//! assert_eq!(spec::CT4.name, "ct4");
//! // svc-gc: let ct4 = pin::open_pinned_map(&dir, &spec::CT4)?;
//! ```

pub mod maps;
pub mod pin;
pub mod spec;

pub use pin::{PinDirError, PinnedMapError, open_pinned_map, pin_dir};
