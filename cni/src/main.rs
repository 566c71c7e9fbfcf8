//! rivet-cni (being written).
fn main() {}
