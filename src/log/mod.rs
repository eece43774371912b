//! The event log: an append-only sequence of envelopes on disk, the projections kept live beside
//! it, and snapshots of those projections: `ebb_storage::log` (the RocksDB store and the one
//! writer) with the core's contract, in-memory store and readers (`ebb_core::log`).

pub use ebb_storage::log::*;
