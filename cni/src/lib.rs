//! rivet-cni (being written).
