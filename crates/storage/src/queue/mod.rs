//! The call queue's backends: [`embedded::EmbeddedQueue`] (RocksDB, the default) and
//! [`kafka::KafkaQueue`]. The [`Queue`](ebb_core::queue::Queue) contract is the core's.

pub mod embedded;
pub mod kafka;
