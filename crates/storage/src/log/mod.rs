//! The log on disk: [`rocks::RocksStore`] (RocksDB: column families `events`, `snapshots`, `meta`)
//! and [`writer::Log`], the one writer that group-commits appends and decisions and keeps the
//! projection live beside them. The storage contract, the in-memory store and the readers are the
//! core's (`ebb_core::log`), re-exported here, so that the crates above name the whole log by
//! one path.

pub mod rocks;
pub mod writer;

pub use ebb_core::log::*;
pub use rocks::RocksStore;
pub use writer::{Committed, Log, Options, Tail};
