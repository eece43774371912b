//! `ebb serve`: opens (or creates) the log, runs `ebb::serve` on a multi-threaded runtime until
//! SIGTERM or Ctrl-C, and says why when the log failed.

use std::sync::Arc;

use anyhow::{Result, bail};

use crate::logs::open_writer_with;
use crate::runtime;
use ebb::log::Options;
use ebb::log::rocks::OpenMode;

pub fn run(options: ebb::serve::ServeOptions) -> Result<()> {
    let log = Arc::new(open_writer_with(
        &options.data_dir,
        OpenMode::Create,
        Options {
            durability: options.log.durability,
            snapshot_every_events: options.log.snapshot_every_events,
            ..Options::default()
        },
    )?);
    let rt = runtime()?;
    rt.block_on(async { ebb::serve::run(options, log.clone(), shutdown_signal()).await })?;
    drop(rt);
    if let Some(why) = log.failure() {
        bail!(
            "the log failed ({why}); ebb stopped. Start it again once the disk has room: it \
             recovers from the log"
        );
    }
    if let Ok(log) = Arc::try_unwrap(log) {
        log.close();
    }
    Ok(())
}

/// Resolves on SIGTERM or SIGINT. The handlers are installed when this is called (inside a
/// runtime), not when the future is first polled, so a signal sent right after ebb says it is
/// ready is never missed.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate()).ok();
    let int = signal(SignalKind::interrupt()).ok();
    async move {
        let wait = |s: Option<tokio::signal::unix::Signal>| async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! { _ = wait(term) => {}, _ = wait(int) => {} }
        tracing::info!("shutting down");
    }
}
