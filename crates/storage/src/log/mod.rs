//! The log on disk: [`rocks::RocksStore`] (RocksDB: column families `events`, `snapshots`, `meta`)
//! and [`writer::Log`], the one writer that group-commits appends and decisions and keeps the
//! projection live beside them. The storage contract and the readers are the core's
//! (`ebb_core::log`).

pub mod rocks;
pub mod writer;
