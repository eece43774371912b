//! Crash safety with real processes: a child appends as fast as it can with `sync` durability and
//! prints every acknowledged seq; the test kills it with SIGKILL after a random number of
//! acknowledgements, several rounds on the same data dir, and checks that every acknowledged seq
//! is present, seqs are contiguous and every record decodes. Every other round flushes the
//! memtables every few dozen appends, so the kill lands among WAL switches, table writes and
//! deleted WALs, as it would in a long run (RocksDB flushes by itself every 64 MiB).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use ebb::log::rocks::OpenMode;
use ebb::log::{LogStore, RocksStore, decode_at};

use crate::common;

use common::XorShift;

const ROUNDS: usize = 6;
const DEADLINE: Duration = Duration::from_secs(120);
/// Acknowledged appends between two flushes in a flushing round.
const FLUSH_EVERY: u64 = 64;

#[test]
fn acknowledged_appends_survive_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut rng = XorShift(0x5eed_ebb0_1234_5678);
    let mut max_acked = 0u64;
    for round in 0..ROUNDS {
        // A round that flushes goes on long enough for several flushes.
        let flushing = round % 2 == 1;
        let kill_after = if flushing { 12 * FLUSH_EVERY } else { 50 } + rng.next() % 3_000;
        let appenders = [1, 8, 64, 256][round % 4];
        let mut child = Command::new(env!("CARGO_BIN_EXE_ebb"));
        child
            .args(["debug", "append-stress", "--appenders"])
            .arg(appenders.to_string());
        if flushing {
            child.args(["--flush-every", &FLUSH_EVERY.to_string()]);
        }
        let mut child = child
            .arg("--data-dir")
            .arg(&data)
            .env("EBB_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel::<u64>();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let seq: u64 = line.trim().parse().expect("child prints seqs");
                if tx.send(seq).is_err() {
                    break;
                }
            }
        });
        let mut acked = Vec::new();
        while (acked.len() as u64) < kill_after {
            match rx.recv_timeout(DEADLINE) {
                Ok(seq) => acked.push(seq),
                Err(e) => panic!("round {round}: child stopped acknowledging: {e}"),
            }
        }
        child.kill().unwrap();
        let status = child.wait().unwrap();
        assert!(!status.success(), "the child was killed");
        if flushing {
            // RocksDB's own log of the killed process: it flushed, moving to new WALs.
            let info = std::fs::read_to_string(data.join("LOG")).unwrap();
            let flushes = info.matches("\"event\": \"flush_finished\"").count();
            assert!(
                flushes >= 2,
                "round {round}: {flushes} flushes before the kill, expected several"
            );
        }
        reader.join().unwrap();
        // Acknowledgements the child printed before it died count too.
        acked.extend(rx.try_iter());
        let round_max = *acked.iter().max().unwrap();
        assert!(
            acked.iter().all(|&s| s > max_acked),
            "round {round}: a seq was handed out twice across restarts"
        );
        max_acked = max_acked.max(round_max);

        let store = RocksStore::open(&data, OpenMode::ReadOnly).unwrap();
        let last = store.last_seq().unwrap();
        assert!(
            last >= max_acked,
            "round {round}: acknowledged seq {max_acked} lost (log ends at {last})"
        );
        let mut expected = 1u64;
        store
            .scan(1, u64::MAX, &mut |seq, bytes| {
                assert_eq!(seq, expected, "round {round}: seqs not contiguous");
                decode_at(seq, bytes)
                    .unwrap_or_else(|e| panic!("round {round}: undecodable record: {e}"));
                expected += 1;
                true
            })
            .unwrap();
        assert_eq!(expected - 1, last);
        for seq in &acked {
            assert!(
                store.get(*seq).unwrap().is_some(),
                "acknowledged seq {seq} missing"
            );
        }
        // Every later round starts after what is on disk.
        max_acked = last;
    }
}
