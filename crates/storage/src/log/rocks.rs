//! [`LogStore`] on RocksDB: column family `events` (seq big-endian -> envelope), `snapshots`
//! (seq -> encoded projections), `subjects` (the subject index: `ebb_core::log::index` keys,
//! written in the same batch as their events) and `meta` (the format marker that makes a
//! directory an ebb log, and the mark that the index is complete).
//!
//! Retention deletes events and snapshots by range; the index's keys sort by subject, so its
//! entries of deleted events go through a compaction filter that drops every key whose seq is
//! below the first stored one.
//!
//! One process writes a data directory (RocksDB's lock enforces it). Tools read it while it runs:
//! read-only ([`OpenMode::ReadOnly`], what was written up to the opening) or as a follower
//! ([`RocksStore::open_follower`], caught up on demand).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rocksdb::{
    ColumnFamilyDescriptor, DB, DBCompressionType, IteratorMode, Options as DbOptions, ReadOptions,
    WriteBatch, WriteOptions,
};

use ebb_core::log::index::key_seq as index_seq;
use ebb_core::log::store::{LogStore, RecordBatch, seq_key};
use ebb_core::log::{Error, Result};

const CF_EVENTS: &str = "events";
const CF_SNAPSHOTS: &str = "snapshots";
const CF_META: &str = "meta";
const CF_SUBJECTS: &str = "subjects";
const FORMAT_KEY: &[u8] = b"format";
/// What every mark of a complete index starts with: layout 1's was this alone, a later layout's
/// is this, a slash and the layout ([`indexed_key`]).
const INDEXED_MARKS: &[u8] = b"subjects-indexed";

/// The mark of an index complete in the keys' current layout ([`ebb_core::log::index::LAYOUT`]).
fn indexed_key() -> Vec<u8> {
    format!("subjects-indexed/{}", ebb_core::log::index::LAYOUT).into_bytes()
}
const FORMAT: &[u8] = b"ebb-log/1";

/// Why an opening is refused when the format marker is missing: a log written by something else,
/// or a read-only opening that missed the WAL holding the marker while the writer flushed it.
pub const NO_FORMAT_MARKER: &str = "its format marker is missing";

/// How to open a data directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Open for writing, creating the log if the directory is missing or empty.
    Create,
    /// Open an existing log for writing.
    Existing,
    /// Open an existing log read-only; works while another process writes it, and sees what was
    /// written up to the moment of opening.
    ReadOnly,
}

/// The RocksDB-backed store.
pub struct RocksStore {
    db: DB,
    path: PathBuf,
    /// Index entries with a seq below this are dropped by compaction (the first stored seq).
    floor: Arc<AtomicU64>,
    /// Whether the `subjects` column family exists (a log opened read-only from before the
    /// index has none).
    subjects: bool,
}

impl std::fmt::Debug for RocksStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocksStore")
            .field("path", &self.path)
            .finish()
    }
}

fn storage(e: rocksdb::Error) -> Error {
    Error::Storage(e.into_string())
}

fn db_options() -> DbOptions {
    let mut o = DbOptions::default();
    o.create_if_missing(true);
    o.create_missing_column_families(true);
    o.increase_parallelism(2);
    o.set_compression_type(DBCompressionType::Lz4);
    o.set_write_buffer_size(64 << 20);
    o.set_max_total_wal_size(256 << 20);
    o.set_keep_log_file_num(4);
    // WAL recycling (`recycle_log_file_num`) is left off, though it saves the inode write of
    // each sync: a follower (`ebb log tail`, a RocksDB secondary) catching up over a recycled
    // WAL was seen spinning in RocksDB's log reader at full CPU for minutes, never returning.
    o
}

/// The memtable option that makes the index's inserts cheap. An event's index keys are spread
/// over the key space (a call's later events go beside its `CallQueued`), so each insert into the
/// memtable's skip list would search it from the top; with a hint kept per kind (a key's first
/// byte) and the keys of a batch written in order ([`RocksStore::write`]), an insert starts from
/// where the one before it went and moves as far as the keys between them. Measured on the call
/// path: the index's memtable inserts from 6.5 % to 2.9 % of the process's CPU.
const SUBJECTS_INSERT_HINT: &str =
    "memtable_insert_with_hint_prefix_extractor=rocksdb.FixedPrefix.1";

/// The column families to open: all of them, or for a read-only opening those that exist.
fn cf_descriptors(floor: &Arc<AtomicU64>, subjects: bool) -> Result<Vec<ColumnFamilyDescriptor>> {
    let mut out: Vec<_> = [CF_EVENTS, CF_SNAPSHOTS, CF_META]
        .into_iter()
        .map(|n| ColumnFamilyDescriptor::new(n, db_options()))
        .collect();
    if subjects {
        let mut o = db_options()
            .get_options_from_string(SUBJECTS_INSERT_HINT)
            .map_err(storage)?;
        let floor = floor.clone();
        o.set_compaction_filter("ebb-retention", move |_level: u32, key: &[u8], _: &[u8]| {
            match index_seq(key) {
                Some(seq) if seq < floor.load(Ordering::Relaxed) => {
                    rocksdb::compaction_filter::Decision::Remove
                }
                _ => rocksdb::compaction_filter::Decision::Keep,
            }
        });
        out.push(ColumnFamilyDescriptor::new(CF_SUBJECTS, o));
    }
    Ok(out)
}

fn key_seq(key: &[u8]) -> Result<u64> {
    let bytes: [u8; 8] = key
        .try_into()
        .map_err(|_| Error::BadKey { len: key.len() })?;
    Ok(u64::from_be_bytes(bytes))
}

impl RocksStore {
    /// Opens the log in `path`.
    pub fn open(path: impl AsRef<Path>, mode: OpenMode) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let exists = path.exists();
        let is_db = path.join("CURRENT").is_file();
        if !exists && mode != OpenMode::Create {
            return Err(Error::Missing { path });
        }
        if exists && !path.is_dir() {
            return Err(Error::NotALog {
                path,
                why: "it is a file, not a directory".into(),
            });
        }
        if exists && !is_db {
            let empty = std::fs::read_dir(&path)
                .map_err(|e| Error::Storage(format!("reading {}: {e}", path.display())))?
                .next()
                .is_none();
            if mode != OpenMode::Create || !empty {
                return Err(Error::NotALog {
                    path,
                    why: "it holds no ebb database".into(),
                });
            }
        }
        let mut subjects = mode != OpenMode::ReadOnly;
        if is_db {
            let cfs = DB::list_cf(&DbOptions::default(), &path).map_err(|e| Error::NotALog {
                path: path.clone(),
                why: e.into_string(),
            })?;
            if !cfs.iter().any(|c| c == CF_META) || !cfs.iter().any(|c| c == CF_EVENTS) {
                return Err(Error::NotALog {
                    path,
                    why: "it is a RocksDB database, but not ebb's".into(),
                });
            }
            subjects |= cfs.iter().any(|c| c == CF_SUBJECTS);
        }
        let opts = db_options();
        let floor = Arc::new(AtomicU64::new(0));
        let cfs = cf_descriptors(&floor, subjects)?;
        let db = match mode {
            OpenMode::ReadOnly => DB::open_cf_descriptors_read_only(&opts, &path, cfs, false),
            _ => DB::open_cf_descriptors(&opts, &path, cfs),
        }
        .map_err(|e| {
            let msg = e.into_string();
            if msg.contains("lock") || msg.contains("Resource temporarily unavailable") {
                Error::Locked { path: path.clone() }
            } else {
                Error::Storage(msg)
            }
        })?;
        let store = RocksStore {
            db,
            path,
            floor,
            subjects,
        };
        store
            .floor
            .store(store.first_seq()?.unwrap_or(0), Ordering::Relaxed);
        let meta = store.cf(CF_META);
        match store.db.get_cf(meta, FORMAT_KEY).map_err(storage)? {
            Some(f) if f == FORMAT => {}
            Some(f) => {
                return Err(Error::NotALog {
                    path: store.path.clone(),
                    why: format!("unknown format {:?}", String::from_utf8_lossy(&f)),
                });
            }
            None if is_db => {
                return Err(Error::NotALog {
                    path: store.path.clone(),
                    why: NO_FORMAT_MARKER.into(),
                });
            }
            None => {
                let mut wo = WriteOptions::default();
                wo.set_sync(true);
                store
                    .db
                    .put_cf_opt(meta, FORMAT_KEY, FORMAT, &wo)
                    .map_err(storage)?;
            }
        }
        Ok(store)
    }

    /// Opens a follower of a log that another process writes: it sees what the writer has written
    /// up to the last [`RocksStore::catch_up`]. `scratch` holds the follower's own small files.
    pub fn open_follower(path: impl AsRef<Path>, scratch: impl AsRef<Path>) -> Result<Self> {
        // Validates the directory the same way a reader does.
        drop(Self::open(path.as_ref(), OpenMode::ReadOnly)?);
        let path = path.as_ref().to_path_buf();
        let mut opts = db_options();
        opts.set_max_open_files(-1);
        let cfs = DB::list_cf(&DbOptions::default(), &path).map_err(storage)?;
        let subjects = cfs.iter().any(|c| c == CF_SUBJECTS);
        let mut names = vec![CF_EVENTS, CF_SNAPSHOTS, CF_META];
        if subjects {
            names.push(CF_SUBJECTS);
        }
        let db = DB::open_cf_as_secondary(&opts, &path, &scratch.as_ref().to_path_buf(), names)
            .map_err(storage)?;
        Ok(RocksStore {
            db,
            path,
            floor: Arc::new(AtomicU64::new(0)),
            subjects,
        })
    }

    /// The marks of a complete index the log holds, of any layout.
    fn index_marks(&self) -> Result<Vec<Vec<u8>>> {
        let mut marks = Vec::new();
        let mut it = self.db.raw_iterator_cf(self.cf(CF_META));
        it.seek(INDEXED_MARKS);
        while let Some(key) = it.key().filter(|k| k.starts_with(INDEXED_MARKS)) {
            marks.push(key.to_vec());
            it.next();
        }
        it.status().map_err(storage)?;
        Ok(marks)
    }

    /// Catches a follower up with what the writer has written since.
    pub fn catch_up(&self) -> Result<()> {
        self.db.try_catch_up_with_primary().map_err(storage)
    }

    /// Writes every column family's memtable to a table file and moves the writes that follow to
    /// a new WAL, deleting the ones every column family has flushed past. RocksDB does this by
    /// itself as memtables fill (every 64 MiB); `ebb debug append-stress` does it every few
    /// dozen appends, so that tests meet it while they kill the writer or follow it.
    pub fn flush(&self) -> Result<()> {
        let cfs: Vec<_> = [CF_EVENTS, CF_SNAPSHOTS, CF_META, CF_SUBJECTS]
            .into_iter()
            .filter_map(|name| self.db.cf_handle(name))
            .collect();
        self.db
            .flush_cfs_opt(&cfs, &rocksdb::FlushOptions::default())
            .map_err(storage)
    }

    /// The directory this store lives in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn cf(&self, name: &str) -> &rocksdb::ColumnFamily {
        self.db
            .cf_handle(name)
            .expect("column families are created at open")
    }

    fn subjects_cf(&self) -> Result<&rocksdb::ColumnFamily> {
        if !self.subjects {
            return Err(Error::Storage(
                "this log was opened read-only without a subject index".into(),
            ));
        }
        Ok(self.cf(CF_SUBJECTS))
    }

    fn last_key(&self, cf: &str) -> Result<Option<u64>> {
        let mut it = self.db.raw_iterator_cf(self.cf(cf));
        it.seek_to_last();
        it.status().map_err(storage)?;
        it.key().map(key_seq).transpose()
    }
}

impl LogStore for RocksStore {
    fn write(&self, batch: &RecordBatch, sync: bool) -> Result<()> {
        let cf = self.cf(CF_EVENTS);
        let mut wb = WriteBatch::default();
        for (seq, value) in batch.iter() {
            wb.put_cf(cf, seq_key(seq), value);
        }
        if batch.index_len() > 0 {
            let subjects = self.subjects_cf()?;
            // In order, so each memtable insert starts from the one before ([`SUBJECTS_INSERT_HINT`]).
            let mut keys: Vec<&[u8]> = batch.index_keys().collect();
            keys.sort_unstable();
            for key in keys {
                wb.put_cf(subjects, key, []);
            }
        }
        let mut wo = WriteOptions::default();
        wo.set_sync(sync);
        self.db.write_opt(wb, &wo).map_err(storage)
    }

    fn sync(&self) -> Result<()> {
        self.db.flush_wal(true).map_err(storage)
    }

    fn last_seq(&self) -> Result<u64> {
        Ok(self.last_key(CF_EVENTS)?.unwrap_or(0))
    }

    fn first_seq(&self) -> Result<Option<u64>> {
        let mut it = self.db.raw_iterator_cf(self.cf(CF_EVENTS));
        it.seek_to_first();
        it.status().map_err(storage)?;
        it.key().map(key_seq).transpose()
    }

    fn get(&self, seq: u64) -> Result<Option<Vec<u8>>> {
        self.db
            .get_cf(self.cf(CF_EVENTS), seq_key(seq))
            .map_err(storage)
    }

    fn scan(&self, from: u64, to: u64, visit: &mut dyn FnMut(u64, &[u8]) -> bool) -> Result<()> {
        let mut ro = ReadOptions::default();
        ro.fill_cache(false);
        ro.set_readahead_size(4 << 20);
        let mut it = self.db.raw_iterator_cf_opt(self.cf(CF_EVENTS), ro);
        it.seek(seq_key(from));
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            let seq = key_seq(k)?;
            if seq > to || !visit(seq, v) {
                return Ok(());
            }
            it.next();
        }
        it.status().map_err(storage)
    }

    fn put_snapshot(&self, seq: u64, bytes: &[u8]) -> Result<()> {
        let mut wo = WriteOptions::default();
        wo.set_sync(true);
        self.db
            .put_cf_opt(self.cf(CF_SNAPSHOTS), seq_key(seq), bytes, &wo)
            .map_err(storage)
    }

    fn snapshot_seqs(&self) -> Result<Vec<u64>> {
        let mut out = Vec::new();
        for item in self
            .db
            .iterator_cf(self.cf(CF_SNAPSHOTS), IteratorMode::Start)
        {
            let (k, _) = item.map_err(storage)?;
            out.push(key_seq(&k)?);
        }
        Ok(out)
    }

    fn get_snapshot(&self, seq: u64) -> Result<Option<Vec<u8>>> {
        self.db
            .get_cf(self.cf(CF_SNAPSHOTS), seq_key(seq))
            .map_err(storage)
    }

    fn delete_before(&self, before: u64) -> Result<u64> {
        let first = self.first_seq()?.unwrap_or(before);
        let deleted = before.saturating_sub(first);
        let events = self.cf(CF_EVENTS);
        let snaps = self.cf(CF_SNAPSHOTS);
        let mut wb = WriteBatch::default();
        wb.delete_range_cf(events, seq_key(0), seq_key(before));
        wb.delete_range_cf(snaps, seq_key(0), seq_key(before));
        let mut wo = WriteOptions::default();
        wo.set_sync(true);
        self.db.write_opt(wb, &wo).map_err(storage)?;
        self.db
            .compact_range_cf(events, None::<&[u8]>, Some(&seq_key(before)[..]));
        self.floor.store(before, Ordering::Relaxed);
        if self.subjects {
            // Index keys sort by subject: the whole family goes through the retention filter.
            self.db
                .compact_range_cf(self.cf(CF_SUBJECTS), None::<&[u8]>, None::<&[u8]>);
        }
        Ok(deleted)
    }

    fn subject_seqs(
        &self,
        subject: &[u8],
        from: u64,
        visit: &mut dyn FnMut(u64) -> bool,
    ) -> Result<()> {
        if !self.subjects {
            return Ok(());
        }
        let mut it = self.db.raw_iterator_cf(self.cf(CF_SUBJECTS));
        let mut start = subject.to_vec();
        start.extend_from_slice(&seq_key(from));
        it.seek(&start);
        while let Some(key) = it.key() {
            if !key.starts_with(subject) {
                break;
            }
            if key.len() == subject.len() + 8
                && let Some(seq) = index_seq(key)
                && !visit(seq)
            {
                return Ok(());
            }
            it.next();
        }
        it.status().map_err(storage)
    }

    fn indexed(&self) -> Result<bool> {
        Ok(self.subjects
            && self
                .db
                .get_cf(self.cf(CF_META), indexed_key())
                .map_err(storage)?
                .is_some())
    }

    fn mark_indexed(&self) -> Result<()> {
        let mut wo = WriteOptions::default();
        wo.set_sync(true);
        self.db
            .put_cf_opt(self.cf(CF_META), indexed_key(), b"1", &wo)
            .map_err(storage)
    }

    fn clear_index(&self) -> Result<()> {
        let meta = self.cf(CF_META);
        let mut wb = WriteBatch::default();
        for mark in self.index_marks()? {
            wb.delete_cf(meta, mark);
        }
        if self.subjects {
            // Every key up to and including the last, in one range deletion.
            let subjects = self.subjects_cf()?;
            let mut it = self.db.raw_iterator_cf(subjects);
            it.seek_to_last();
            if let Some(last) = it.key() {
                let mut end = last.to_vec();
                end.push(0);
                wb.delete_range_cf(subjects, [].as_slice(), end.as_slice());
            }
            it.status().map_err(storage)?;
        }
        let mut wo = WriteOptions::default();
        wo.set_sync(true);
        self.db.write_opt(wb, &wo).map_err(storage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract() {
        let dir = tempfile::tempdir().unwrap();
        let store = RocksStore::open(dir.path().join("log"), OpenMode::Create).unwrap();
        ebb_core::log::store::contract::run(&store);
    }

    #[test]
    fn index_entries_of_compacted_records_are_dropped_and_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let subject = ebb_core::log::index::prefix(3, "c");
        let all = |store: &RocksStore| {
            let mut out = Vec::new();
            store
                .subject_seqs(&subject, 0, &mut |seq| {
                    out.push(seq);
                    true
                })
                .unwrap();
            out
        };
        {
            let store = RocksStore::open(dir.path(), OpenMode::Create).unwrap();
            let mut b = RecordBatch::default();
            for seq in 1..=300u64 {
                b.push(seq, b"x");
                b.push_index_with(|k| {
                    k.extend_from_slice(&subject);
                    k.extend_from_slice(&seq.to_be_bytes());
                });
            }
            store.write(&b, true).unwrap();
            store.mark_indexed().unwrap();
            assert_eq!(all(&store).len(), 300);
            store.delete_before(200).unwrap();
            // Not merely skipped by readers: gone from the column family.
            assert_eq!(all(&store), (200..=300).collect::<Vec<_>>());
        }
        let store = RocksStore::open(dir.path(), OpenMode::ReadOnly).unwrap();
        assert!(store.indexed().unwrap());
        assert_eq!(all(&store), (200..=300).collect::<Vec<_>>());
    }

    #[test]
    fn a_batch_of_index_keys_in_any_order_reads_back_per_subject_with_the_insert_hint_on() {
        let dir = tempfile::tempdir().unwrap();
        let store = RocksStore::open(dir.path(), OpenMode::Create).unwrap();
        let subjects: Vec<Vec<u8>> = ["c-2", "c-10", "c-1", "r"]
            .iter()
            .enumerate()
            .map(|(i, id)| ebb_core::log::index::prefix(if i < 3 { 3 } else { 1 }, id))
            .collect();
        let mut b = RecordBatch::default();
        // Each subject's events interleaved with the others', as a call's are in a batch.
        for seq in 1..=40u64 {
            b.push(seq, b"x");
            let subject = &subjects[(seq * 7 % 4) as usize];
            b.push_index_with(|k| {
                k.extend_from_slice(subject);
                k.extend_from_slice(&seq.to_be_bytes());
            });
        }
        store.write(&b, true).unwrap();
        for (i, subject) in subjects.iter().enumerate() {
            let mut seqs = Vec::new();
            store
                .subject_seqs(subject, 0, &mut |seq| {
                    seqs.push(seq);
                    true
                })
                .unwrap();
            let want: Vec<u64> = (1..=40u64).filter(|s| (s * 7 % 4) as usize == i).collect();
            assert_eq!(seqs, want, "subject {i}");
        }
        // The hint is in the options RocksDB opened the index with.
        let options: String = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("OPTIONS-")
            })
            .map(|p| std::fs::read_to_string(p).unwrap())
            .collect();
        let subjects_section = options
            .split("[CFOptions \"subjects\"]")
            .nth(1)
            .expect("the index's options");
        assert!(
            subjects_section
                .contains("memtable_insert_with_hint_prefix_extractor=rocksdb.FixedPrefix.1"),
            "{subjects_section}"
        );
    }

    #[tokio::test]
    async fn an_index_of_the_first_layout_is_rebuilt_when_the_writer_opens_and_its_keys_go() {
        use ebb_core::event::{Event, Kind, encode_into};
        use ebb_core::log::index;
        let seen = |route: &str, n: u64| Event::RequestsSeen {
            route: route.into(),
            count: n,
            last_at_ms: n,
        };
        let seqs_of = |store: &RocksStore, route: &str| {
            index::seqs(store, &[index::of(Kind::Route, route)], 0).unwrap()
        };
        // A name ebb could have written as an id (compact now), and one it keeps as text.
        let id = "01938c52-7a1b-7c3d-8e4f-0123456789ab";
        let dir = tempfile::tempdir().unwrap();
        {
            let store = RocksStore::open(dir.path(), OpenMode::Create).unwrap();
            let mut b = RecordBatch::default();
            for (seq, route) in [(1u64, id), (2, "a"), (3, id)] {
                b.push_with(seq, |buf| encode_into(buf, seq, 1_000, &seen(route, seq)));
                // Layout 1: kind, the name's length (4 bytes), the name, the seq.
                b.push_index_with(|k| {
                    k.push(index::kind_code(Kind::Route));
                    k.extend_from_slice(&(route.len() as u32).to_be_bytes());
                    k.extend_from_slice(route.as_bytes());
                    k.extend_from_slice(&seq.to_be_bytes());
                });
            }
            store.write(&b, true).unwrap();
            store
                .db
                .put_cf(store.cf(CF_META), INDEXED_MARKS, b"1")
                .unwrap();
            // Not complete in this layout: readers scan the log instead.
            assert!(!store.indexed().unwrap());
        }
        let store = Arc::new(RocksStore::open(dir.path(), OpenMode::Existing).unwrap());
        let log = crate::log::Log::<ebb_core::state::State>::open(
            store.clone(),
            crate::log::Options::default(),
            Arc::new(ebb_core::clock::SimClock::new(5_000)),
            &mut |_| {},
        )
        .unwrap();
        assert!(store.indexed().unwrap());
        assert_eq!(seqs_of(&store, id), vec![1, 3]);
        assert_eq!(seqs_of(&store, "a"), vec![2]);
        log.append(seen(id, 4)).await.unwrap();
        log.close();
        assert_eq!(seqs_of(&store, id), vec![1, 3, 4]);
        // Every key left is of the current layout, and one mark is left: the current one.
        let mut keys = Vec::new();
        let mut it = store.db.raw_iterator_cf(store.subjects_cf().unwrap());
        it.seek_to_first();
        while let Some(k) = it.key() {
            keys.push(k.to_vec());
            it.next();
        }
        assert_eq!(keys.len(), 4, "{keys:?}");
        for k in &keys {
            let (code, name) = index::subject_of(&k[..k.len() - 8]).unwrap();
            assert_eq!(code, index::kind_code(Kind::Route));
            assert!(name == id || name == "a", "{name}");
        }
        assert_eq!(keys[0].len(), 3 + 16 + 8, "the id is compact");
        assert_eq!(store.index_marks().unwrap(), vec![indexed_key()]);
    }

    #[test]
    fn refuses_what_is_not_an_ebb_log() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        assert!(matches!(
            RocksStore::open(&missing, OpenMode::Existing),
            Err(Error::Missing { .. })
        ));
        let stuff = dir.path().join("stuff");
        std::fs::create_dir(&stuff).unwrap();
        std::fs::write(stuff.join("notes.txt"), "hello").unwrap();
        let err = RocksStore::open(&stuff, OpenMode::Create).unwrap_err();
        assert!(matches!(err, Error::NotALog { .. }), "{err}");
        let other = dir.path().join("other-rocks");
        {
            let mut o = DbOptions::default();
            o.create_if_missing(true);
            DB::open(&o, &other).unwrap();
        }
        let err = RocksStore::open(&other, OpenMode::ReadOnly).unwrap_err();
        assert!(err.to_string().contains("not an ebb log"), "{err}");
    }

    #[test]
    fn second_writer_is_refused_but_readers_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let _w = RocksStore::open(dir.path(), OpenMode::Create).unwrap();
        let err = RocksStore::open(dir.path(), OpenMode::Existing).unwrap_err();
        assert!(matches!(err, Error::Locked { .. }), "{err}");
        RocksStore::open(dir.path(), OpenMode::ReadOnly).unwrap();
    }
}
