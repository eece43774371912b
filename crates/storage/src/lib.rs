//! ebb's storage: the event log on RocksDB with its group-committing writer ([`log`]), and the
//! call queue on RocksDB or Apache Kafka ([`queue`]). The only crate of the workspace that
//! depends on RocksDB or librdkafka; everything it stores is the core's (`ebb_core`).

pub mod log;
pub mod queue;
