//! `ebb debug`: hidden helpers for tests (a workload run alone, an append stress).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;
use clap::Subcommand;

use crate::logs::open_writer_on;
use crate::runtime;
use ebb::event::Event;
use ebb::log::rocks::OpenMode;
use ebb::log::{Durability, Options, RocksStore};

#[derive(Subcommand)]
pub enum DebugCommand {
    /// Run one workload with the process orchestrator, print its ready addresses, and keep it
    /// running until killed.
    RunWorkload {
        /// Replicas to run.
        #[arg(long, default_value_t = 1)]
        replicas: u32,
        /// Where replica logs go.
        #[arg(long)]
        log_dir: PathBuf,
        /// The command (after `--`).
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Append as fast as possible, printing every acknowledged seq on its own line.
    AppendStress {
        /// Concurrent appenders.
        #[arg(long, default_value_t = 64)]
        appenders: usize,
        /// Stop after this many acknowledged appends (default: never).
        #[arg(long)]
        count: Option<u64>,
        /// Flush the memtables after every this many acknowledged appends (default: when they
        /// fill), so WAL switches, table writes and deleted WALs happen while appends go on.
        #[arg(long)]
        flush_every: Option<u64>,
    },
}

/// Runs a debug command.
pub fn run(dir: &Path, cmd: DebugCommand) -> Result<()> {
    match cmd {
        DebugCommand::AppendStress {
            appenders,
            count,
            flush_every,
        } => append_stress(dir, appenders, count, flush_every),
        DebugCommand::RunWorkload {
            replicas,
            log_dir,
            command,
        } => runtime()?.block_on(run_workload(replicas, log_dir, command)),
    }
}

fn append_stress(
    dir: &Path,
    appenders: usize,
    count: Option<u64>,
    flush_every: Option<u64>,
) -> Result<()> {
    let store = Arc::new(RocksStore::open(dir, OpenMode::Create)?);
    let options = Options {
        durability: Durability::Sync,
        ..Options::default()
    };
    let log = Arc::new(open_writer_on(store.clone(), options)?);
    let rt = runtime()?;
    rt.block_on(async {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<u64>(65_536);
        let left = Arc::new(std::sync::atomic::AtomicU64::new(count.unwrap_or(u64::MAX)));
        for i in 0..appenders.max(1) {
            let log = log.clone();
            let tx = tx.clone();
            let left = left.clone();
            tokio::spawn(async move {
                let route = format!("route-{i}");
                let mut n = 0u64;
                loop {
                    let take = left.fetch_update(
                        std::sync::atomic::Ordering::SeqCst,
                        std::sync::atomic::Ordering::SeqCst,
                        |v| v.checked_sub(1),
                    );
                    if take.is_err() {
                        return;
                    }
                    n += 1;
                    let event = Event::RequestsSeen {
                        route: route.clone(),
                        count: n,
                        last_at_ms: n,
                    };
                    match log.append(event).await {
                        Ok(seq) => {
                            if tx.send(seq).await.is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            eprintln!("error: {e}");
                            std::process::exit(1);
                        }
                    }
                }
            });
        }
        drop(tx);
        let mut out = std::io::stdout().lock();
        let mut acked = 0u64;
        while let Some(seq) = rx.recv().await {
            writeln!(out, "{seq}")?;
            out.flush()?;
            acked += 1;
            if flush_every.is_some_and(|n| acked.is_multiple_of(n.max(1))) {
                // The appenders go on meanwhile; their acknowledgements wait in the channel.
                let store = store.clone();
                tokio::task::spawn_blocking(move || store.flush()).await??;
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    drop(rt);
    if let Ok(log) = Arc::try_unwrap(log) {
        log.close();
    }
    Ok(())
}

async fn run_workload(replicas: u32, log_dir: PathBuf, command: Vec<String>) -> Result<()> {
    use ebb::orchestrator::{Orchestrator, ProcessOptions, ProcessOrchestrator, Readiness};
    let orch = ProcessOrchestrator::new(ProcessOptions {
        log_dir,
        ..ProcessOptions::default()
    })?;
    orch.register(ebb::orchestrator::WorkloadSpec {
        name: "workload".into(),
        command,
        env: vec![],
        cwd: None,
        readiness: Readiness::Http {
            path: "/health".into(),
        },
        startup_timeout_ms: 30_000,
        stop_grace_ms: 5_000,
        pre_run: None,
    })?;
    orch.scale("workload", replicas)?;
    let mut changes = orch.changes();
    loop {
        let seen = orch.observe("workload").unwrap_or_default();
        if seen.ready.len() as u32 >= replicas {
            for addr in &seen.ready {
                println!("ready {addr}");
            }
            break;
        }
        changes.changed().await?;
    }
    std::future::pending::<()>().await;
    Ok(())
}
