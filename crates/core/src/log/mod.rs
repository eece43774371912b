//! The event log's storage contract and what reads it, with no IO of its own: the records are
//! [`Envelope`]s keyed by seq, snapshots of the projections keyed by the seq they cover.
//!
//! * [`store`] defines [`LogStore`], the storage contract. `ebb-storage`'s RocksDB store is the
//!   real one; [`MemStore`] is the simulation backend, which can lose what was not synced.
//! * [`replay`] folds records into a projection, from a snapshot or from scratch.
//! * [`Error`] is the log's and its tooling's error, [`decode_at`] the checked record decoder.
//!
//! The log never interprets events beyond decoding them; what they mean is the projections' job.

pub mod index;
pub mod mem;
pub mod replay;
pub mod store;

use std::path::PathBuf;

pub use mem::MemStore;
pub use replay::{Projection, open_state, read_envelopes, replay_range};
pub use store::{LogStore, RecordBatch};

use crate::event::{CodecError, Envelope};

/// How appends reach the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Durability {
    /// Every acknowledged append has been synced to disk (one sync per group-committed batch).
    #[default]
    Sync,
    /// Appends are acknowledged once written to the OS; a power loss may lose the newest ones.
    Buffered,
}

/// Errors of the log and its tooling.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The data directory does not exist.
    #[error("data dir {} does not exist (start `ebb serve --data-dir {}` to create one)", .path.display(), .path.display())]
    Missing { path: PathBuf },
    /// The directory exists but holds no ebb log.
    #[error("{} is not an ebb log: {why}", .path.display())]
    NotALog { path: PathBuf, why: String },
    /// Another process holds the log open for writing.
    #[error("data dir {} is in use by another ebb process", .path.display())]
    Locked { path: PathBuf },
    /// A record could not be read.
    #[error("record at seq {seq}: {source}")]
    Record { seq: u64, source: CodecError },
    /// A key in the events keyspace is not an 8-byte seq.
    #[error("corrupt log: a record key has {len} bytes, expected 8")]
    BadKey { len: usize },
    /// The records are not contiguous.
    #[error("corrupt log: expected seq {expected}, found {found}")]
    Gap { expected: u64, found: u64 },
    /// A record inside the log's range is missing.
    #[error("corrupt log: record {seq} is missing")]
    MissingRecord { seq: u64 },
    /// A seq past the last record was asked for.
    #[error("seq {seq} is past the end of the log (last seq is {last})")]
    PastEnd { seq: u64, last: u64 },
    /// Events before `first` were compacted away.
    #[error(
        "events before seq {first} were compacted away; the oldest state that can be rebuilt is at seq {first_state}"
    )]
    Compacted { first: u64, first_state: u64 },
    /// A snapshot could not be read.
    #[error("snapshot at seq {seq}: {why}")]
    Snapshot { seq: u64, why: String },
    /// RocksDB or the file system failed.
    #[error("storage: {0}")]
    Storage(String),
    /// The writer stopped after a storage failure; state in memory may be ahead of the disk, so the
    /// process must restart and rebuild from the log.
    #[error(
        "the log writer stopped after a storage failure ({0}); restart ebb to recover from the log"
    )]
    Failed(String),
    /// The log was closed.
    #[error("the log is closed")]
    Closed,
}

/// Result with the log's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Decodes a record read at `seq`, checking that it is the record it claims to be.
pub fn decode_at(seq: u64, bytes: &[u8]) -> Result<Envelope> {
    let env = crate::event::decode(bytes).map_err(|source| Error::Record { seq, source })?;
    if env.seq != seq {
        return Err(Error::Record {
            seq,
            source: CodecError::Corrupt(format!("envelope says seq {}", env.seq)),
        });
    }
    Ok(env)
}
