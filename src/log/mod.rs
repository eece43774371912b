//! The event log: an append-only sequence of envelopes on disk, the projections kept live beside
//! it, and snapshots of those projections. The storage contract, the in-memory store and the
//! readers are the core's (`ebb_core::log`); the RocksDB store and the one writer (group commit)
//! are `ebb_storage`'s. Both are re-exported here under one path.

pub use ebb_core::log::*;
pub use ebb_storage::log::{rocks, writer};
pub use rocks::RocksStore;
pub use writer::{Committed, Log, Options, Tail};
