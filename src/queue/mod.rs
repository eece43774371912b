//! The call queue: the [`Queue`] contract (the core's, `ebb_core::queue`) and its backends,
//! [`embedded::EmbeddedQueue`] (RocksDB, the default) and [`kafka::KafkaQueue`]
//! (`ebb_storage`'s), under one path.

pub use ebb_core::queue::*;
pub use ebb_storage::queue::{embedded, kafka};
