//! [`LogStore`] in memory: the simulation backend. It keeps apart what was synced and what was
//! only written, so a simulated crash ([`MemStore::crash`]) loses exactly the unsynced tail, as a
//! machine losing power would.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::Result;
use super::store::{LogStore, RecordBatch};

#[derive(Debug, Default)]
struct Inner {
    records: BTreeMap<u64, Vec<u8>>,
    snapshots: BTreeMap<u64, Vec<u8>>,
    /// The subject index: key -> seq.
    index: BTreeMap<Vec<u8>, u64>,
    indexed: bool,
    /// Records with seq <= this survive a crash.
    synced_through: u64,
    /// Syncs so far.
    syncs: u64,
}

/// An in-memory store for the simulator and unit tests.
#[derive(Debug, Default)]
pub struct MemStore {
    inner: Mutex<Inner>,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Drops every record that was written without a sync after it.
    pub fn crash(&self) {
        let mut g = self.inner.lock().expect("mem store lock");
        let keep = g.synced_through;
        g.records.retain(|&seq, _| seq <= keep);
        g.index.retain(|_, seq| *seq <= keep);
    }

    /// How many times the store was synced (on its own or with a write).
    pub fn syncs(&self) -> u64 {
        self.lock().syncs
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("mem store lock")
    }
}

impl LogStore for MemStore {
    fn write(&self, batch: &RecordBatch, sync: bool) -> Result<()> {
        let mut g = self.lock();
        for (seq, v) in batch.iter() {
            g.records.insert(seq, v.to_vec());
        }
        for key in batch.index_keys() {
            if let Some(seq) = super::index::key_seq(key) {
                g.index.insert(key.to_vec(), seq);
            }
        }
        if sync {
            g.synced_through = g.records.last_key_value().map_or(0, |(k, _)| *k);
            g.syncs += 1;
        }
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        let mut g = self.lock();
        g.synced_through = g.records.last_key_value().map_or(0, |(k, _)| *k);
        g.syncs += 1;
        Ok(())
    }

    fn last_seq(&self) -> Result<u64> {
        Ok(self.lock().records.last_key_value().map_or(0, |(k, _)| *k))
    }

    fn first_seq(&self) -> Result<Option<u64>> {
        Ok(self.lock().records.first_key_value().map(|(k, _)| *k))
    }

    fn get(&self, seq: u64) -> Result<Option<Vec<u8>>> {
        Ok(self.lock().records.get(&seq).cloned())
    }

    fn scan(&self, from: u64, to: u64, visit: &mut dyn FnMut(u64, &[u8]) -> bool) -> Result<()> {
        if from > to {
            return Ok(());
        }
        let g = self.lock();
        for (seq, v) in g.records.range(from..=to) {
            if !visit(*seq, v) {
                break;
            }
        }
        Ok(())
    }

    fn put_snapshot(&self, seq: u64, bytes: &[u8]) -> Result<()> {
        self.lock().snapshots.insert(seq, bytes.to_vec());
        Ok(())
    }

    fn snapshot_seqs(&self) -> Result<Vec<u64>> {
        Ok(self.lock().snapshots.keys().copied().collect())
    }

    fn get_snapshot(&self, seq: u64) -> Result<Option<Vec<u8>>> {
        Ok(self.lock().snapshots.get(&seq).cloned())
    }

    fn delete_before(&self, before: u64) -> Result<u64> {
        let mut g = self.lock();
        let n = g.records.range(..before).count() as u64;
        g.records.retain(|&seq, _| seq >= before);
        g.snapshots.retain(|&seq, _| seq >= before);
        g.index.retain(|_, seq| *seq >= before);
        Ok(n)
    }

    fn subject_seqs(
        &self,
        subject: &[u8],
        from: u64,
        visit: &mut dyn FnMut(u64) -> bool,
    ) -> Result<()> {
        let g = self.lock();
        let mut start = subject.to_vec();
        start.extend_from_slice(&from.to_be_bytes());
        for (key, seq) in g.index.range(start..) {
            if !key.starts_with(subject) {
                break;
            }
            if key.len() == subject.len() + 8 && !visit(*seq) {
                break;
            }
        }
        Ok(())
    }

    fn indexed(&self) -> Result<bool> {
        Ok(self.lock().indexed)
    }

    fn mark_indexed(&self) -> Result<()> {
        self.lock().indexed = true;
        Ok(())
    }

    fn clear_index(&self) -> Result<()> {
        let mut g = self.lock();
        g.index.clear();
        g.indexed = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract() {
        super::super::store::contract::run(&MemStore::new());
    }

    #[test]
    fn crash_loses_only_the_unsynced_tail() {
        let s = MemStore::new();
        let mut b = RecordBatch::default();
        b.push(1, b"a");
        s.write(&b, true).unwrap();
        b.clear();
        b.push(2, b"b");
        s.write(&b, false).unwrap();
        s.crash();
        assert_eq!(s.last_seq().unwrap(), 1);
    }
}
