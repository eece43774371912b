//! The storage contract of the log, implemented by RocksDB (`ebb_storage`'s `RocksStore`) and by
//! memory for the simulator ([`super::MemStore`]). One contract test suite (`contract::run`)
//! runs against both.
//!
//! Records are keyed by seq (big-endian, so keys sort in log order), snapshots by the seq they
//! cover. [`LogStore::delete_before`] is retention: `ebb serve` compacts with it once the store
//! holds two snapshots, deleting the records and snapshots before the older one, so the log holds
//! one to two snapshot intervals of records and always a snapshot to start a replay from.

use super::Result;

/// Encoded records to write atomically: `(seq, value)` pairs sharing one buffer, and the subject
/// index's keys for them ([`super::index`]).
#[derive(Debug, Default)]
pub struct RecordBatch {
    data: Vec<u8>,
    records: Vec<(u64, usize, usize)>,
    keys: Vec<u8>,
    index: Vec<(usize, usize)>,
}

impl RecordBatch {
    /// Adds a record whose value `encode` writes into the batch's buffer.
    pub fn push_with(&mut self, seq: u64, encode: impl FnOnce(&mut Vec<u8>)) {
        let start = self.data.len();
        encode(&mut self.data);
        self.records.push((seq, start, self.data.len()));
    }

    /// Adds an already encoded record.
    pub fn push(&mut self, seq: u64, value: &[u8]) {
        self.push_with(seq, |buf| buf.extend_from_slice(value));
    }

    /// Adds an index key that `encode` writes.
    pub fn push_index_with(&mut self, encode: impl FnOnce(&mut Vec<u8>)) {
        let start = self.keys.len();
        encode(&mut self.keys);
        self.index.push((start, self.keys.len()));
    }

    /// The index keys, in the order added.
    pub fn index_keys(&self) -> impl Iterator<Item = &[u8]> {
        self.index.iter().map(|&(a, b)| &self.keys[a..b])
    }

    /// Number of index keys.
    pub fn index_len(&self) -> usize {
        self.index.len()
    }

    /// The records, in the order added.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &[u8])> {
        self.records
            .iter()
            .map(|&(seq, a, b)| (seq, &self.data[a..b]))
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// No records and no index keys.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty() && self.index.is_empty()
    }

    /// Empties the batch, keeping its buffers.
    pub fn clear(&mut self) {
        self.data.clear();
        self.records.clear();
        self.keys.clear();
        self.index.clear();
    }
}

/// Key of a record: its seq, big-endian, so keys sort in log order.
pub fn seq_key(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// Storage for records and snapshots. Implementations are blocking; the log's writer thread and
/// tooling call them, never an async task directly.
pub trait LogStore: Send + Sync + 'static {
    /// Writes the batch (records and index keys) atomically. With `sync`, it is durable when this
    /// returns.
    fn write(&self, batch: &RecordBatch, sync: bool) -> Result<()>;
    /// Makes everything written so far durable.
    fn sync(&self) -> Result<()>;
    /// The last seq written, 0 for an empty log.
    fn last_seq(&self) -> Result<u64>;
    /// The first seq still stored (after compaction), `None` for an empty log.
    fn first_seq(&self) -> Result<Option<u64>>;
    /// One record's bytes.
    fn get(&self, seq: u64) -> Result<Option<Vec<u8>>>;
    /// Visits records with `from <= seq <= to` in order until `visit` returns false.
    fn scan(&self, from: u64, to: u64, visit: &mut dyn FnMut(u64, &[u8]) -> bool) -> Result<()>;
    /// Stores a snapshot of the projections covering every record up to `seq`, durably.
    fn put_snapshot(&self, seq: u64, bytes: &[u8]) -> Result<()>;
    /// Seqs of the stored snapshots, oldest first.
    fn snapshot_seqs(&self) -> Result<Vec<u64>>;
    /// A stored snapshot.
    fn get_snapshot(&self, seq: u64) -> Result<Option<Vec<u8>>>;
    /// Deletes records with seq < `before` and snapshots older than `before`, and their index
    /// entries; returns how many records were deleted.
    fn delete_before(&self, before: u64) -> Result<u64>;
    /// Visits, in log order, the seqs `>= from` indexed under `subject` (an [`super::index`]
    /// prefix) until `visit` returns false. Entries of compacted records may still be visited:
    /// callers read from the first stored seq.
    fn subject_seqs(
        &self,
        subject: &[u8],
        from: u64,
        visit: &mut dyn FnMut(u64) -> bool,
    ) -> Result<()>;
    /// Whether every stored record has its index entries, in the keys' current layout
    /// ([`super::index::LAYOUT`]): true for a log created with the index, and for an older one
    /// once [`super::index::rebuild`] has run.
    fn indexed(&self) -> Result<bool>;
    /// Marks the index complete in the current layout (the end of [`super::index::rebuild`]),
    /// durably.
    fn mark_indexed(&self) -> Result<()>;
    /// Deletes every index entry and the mark, durably (the start of [`super::index::rebuild`]:
    /// an index of another layout, or one part built, goes whole).
    fn clear_index(&self) -> Result<()>;
}

/// The contract every [`LogStore`] must keep; run by each implementation's tests.
#[doc(hidden)]
pub mod contract {
    use super::*;

    fn batch(range: std::ops::RangeInclusive<u64>) -> RecordBatch {
        let mut b = RecordBatch::default();
        for seq in range {
            b.push(seq, format!("value-{seq}").as_bytes());
        }
        b
    }

    fn collect(store: &dyn LogStore, from: u64, to: u64) -> Vec<u64> {
        let mut out = Vec::new();
        store
            .scan(from, to, &mut |seq, v| {
                assert_eq!(v, format!("value-{seq}").as_bytes());
                out.push(seq);
                true
            })
            .unwrap();
        out
    }

    pub fn run(store: &dyn LogStore) {
        assert_eq!(store.last_seq().unwrap(), 0);
        assert_eq!(store.first_seq().unwrap(), None);
        assert!(collect(store, 1, u64::MAX).is_empty());

        store.write(&batch(1..=10), true).unwrap();
        store.write(&batch(11..=300), false).unwrap();
        store.sync().unwrap();
        assert_eq!(store.last_seq().unwrap(), 300);
        assert_eq!(store.first_seq().unwrap(), Some(1));
        assert_eq!(store.get(7).unwrap().unwrap(), b"value-7");
        assert_eq!(store.get(301).unwrap(), None);
        assert_eq!(collect(store, 255, 260), vec![255, 256, 257, 258, 259, 260]);
        assert_eq!(collect(store, 299, u64::MAX), vec![299, 300]);
        // Big-endian keys sort numerically across byte boundaries.
        assert_eq!(collect(store, 1, u64::MAX), (1..=300).collect::<Vec<_>>());
        let mut first_two = Vec::new();
        store
            .scan(1, u64::MAX, &mut |seq, _| {
                first_two.push(seq);
                first_two.len() < 2
            })
            .unwrap();
        assert_eq!(first_two, vec![1, 2]);

        assert!(store.snapshot_seqs().unwrap().is_empty());
        store.put_snapshot(100, b"snap-100").unwrap();
        store.put_snapshot(200, b"snap-200").unwrap();
        assert_eq!(store.snapshot_seqs().unwrap(), vec![100, 200]);
        assert_eq!(store.get_snapshot(200).unwrap().unwrap(), b"snap-200");
        assert_eq!(store.get_snapshot(150).unwrap(), None);

        // The index: keys written with the records, visited per subject in log order.
        assert!(!store.indexed().unwrap());
        let mut b = RecordBatch::default();
        for seq in [150u64, 5, 250] {
            b.push_index_with(|k| {
                k.extend_from_slice(b"subj");
                k.extend_from_slice(&seq.to_be_bytes());
            });
        }
        b.push_index_with(|k| {
            k.extend_from_slice(b"subjx");
            k.extend_from_slice(&7u64.to_be_bytes());
        });
        store.write(&b, true).unwrap();
        store.mark_indexed().unwrap();
        assert!(store.indexed().unwrap());
        let subject = |from| {
            let mut out = Vec::new();
            store
                .subject_seqs(b"subj", from, &mut |seq| {
                    out.push(seq);
                    true
                })
                .unwrap();
            out
        };
        assert_eq!(subject(1), vec![5, 150, 250]);
        assert_eq!(subject(151), vec![250]);

        assert_eq!(store.delete_before(200).unwrap(), 199);
        assert_eq!(subject(200), vec![250]);
        assert_eq!(store.first_seq().unwrap(), Some(200));
        assert_eq!(store.last_seq().unwrap(), 300);
        assert_eq!(store.snapshot_seqs().unwrap(), vec![200]);
        assert_eq!(collect(store, 1, 201), vec![200, 201]);

        // Clearing the index takes its entries and its mark, and nothing else.
        store.clear_index().unwrap();
        assert!(!store.indexed().unwrap());
        assert_eq!(subject(0), Vec::<u64>::new());
        let mut other = Vec::new();
        store
            .subject_seqs(b"subjx", 0, &mut |seq| {
                other.push(seq);
                true
            })
            .unwrap();
        assert!(other.is_empty());
        assert_eq!(collect(store, 1, 201), vec![200, 201]);
        assert_eq!(store.snapshot_seqs().unwrap(), vec![200]);
        let mut b = RecordBatch::default();
        b.push_index_with(|k| {
            k.extend_from_slice(b"subj");
            k.extend_from_slice(&260u64.to_be_bytes());
        });
        store.write(&b, true).unwrap();
        assert_eq!(subject(0), vec![260]);
    }
}
