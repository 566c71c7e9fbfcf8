//! The policy engine (being written).
