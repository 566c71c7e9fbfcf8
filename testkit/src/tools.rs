//! Finding the Go-built tools (Kubernetes, etcd 3.6, Jaeger) that
//! `cargo xtask install` caches outside the checkout: the `rivet-tools`
//! table, re-exported for the fixtures and tests that run them.
//!
//! ```no_run
//! use rivet_testkit::tools::{Tool, tool_path};
//!
//! let apiserver = tool_path(Tool::KubeApiserver)?;
//! # Ok::<(), rivet_testkit::tools::ToolError>(())
//! ```

pub use rivet_tools::*;
