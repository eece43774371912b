//! `ebb log`, `ebb replay` and `ebb explain`: the tools that read the log (read-only, or as a
//! follower while `ebb serve` runs), and the helpers that open it.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use ebb::clock::SystemClock;
use ebb::event::Envelope;
use ebb::log::rocks::OpenMode;
use ebb::log::{Durability, Log, LogStore, Options, RocksStore, open_state};
use ebb::state::State;
use ebb::tools::{self, ExplainKind};

use crate::runtime;

#[derive(Subcommand)]
pub enum LogCommand {
    /// Counts, seq range, times, snapshots and event types.
    Stats {
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print events.
    Dump {
        /// First seq to print.
        #[arg(long, default_value_t = 1)]
        from: u64,
        /// Last seq to print.
        #[arg(long)]
        to: Option<u64>,
        /// JSON lines instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print events as they are appended (also while `ebb serve` runs).
    Tail {
        /// Start at this seq (default: only events appended from now on).
        #[arg(long)]
        from: Option<u64>,
        /// JSON lines instead of text.
        #[arg(long)]
        json: bool,
        /// How often to look for new events, in milliseconds.
        #[arg(long, default_value_t = 200)]
        poll_ms: u64,
    },
    /// Take a snapshot of the projections now (ebb must not be running).
    Snapshot,
    /// Delete the events older than the newest snapshot (ebb must not be running).
    Compact,
}

/// Arguments of `ebb replay`.
#[derive(Args)]
pub struct ReplayArgs {
    /// Replay up to and including this seq.
    #[arg(long, conflicts_with = "at")]
    pub until: Option<u64>,
    /// Replay every event that happened at or before this time (RFC 3339).
    #[arg(long)]
    pub at: Option<String>,
    /// Print the whole state as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `ebb explain`.
#[derive(Args)]
pub struct ExplainArgs {
    /// What kind of object.
    #[arg(value_enum)]
    pub kind: ExplainKind,
    /// Its name or id.
    pub id: String,
    /// JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
}

/// A progress bar on a terminal; nothing when stderr is piped.
pub fn progress(len: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() || len < ebb::log::replay::PROGRESS_EVERY {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} events ({per_sec}, {eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_owned());
    pb
}

pub fn open_reader(dir: &Path) -> Result<RocksStore> {
    Ok(RocksStore::open(dir, OpenMode::ReadOnly)?)
}

/// Readings of a log a writer may be changing: how many times [`read_live`] opens it.
const READ_TRIES: u32 = 10;

/// Opens the log read-only and runs `read` on it, again on a fresh opening (at most
/// [`READ_TRIES`] in all) when what it met is a writer's change under the opening rather than
/// damage. A read-only opening reads the table list, then the WALs after it; a running ebb that
/// flushes a memtable in between (every 64 MiB) or compacts adds a table and deletes the WAL or
/// tables the opening was about to read, and the opening sees the log with a gap, or misses a
/// file. A fresh opening sees the log whole; a gap that stays is reported.
fn read_live<T>(dir: &Path, mut read: impl FnMut(&RocksStore) -> Result<T>) -> Result<T> {
    let mut tries = 0;
    loop {
        tries += 1;
        match open_reader(dir).and_then(|store| read(&store)) {
            Err(e) if tries < READ_TRIES && moved_under(&e) => {
                tracing::debug!(error = %e, tries, "the log changed under its reading; reading again");
                // A little later each time, so that a flush or compaction under way ends first.
                std::thread::sleep(std::time::Duration::from_millis(10 * u64::from(tries)));
            }
            r => return r,
        }
    }
}

/// Whether `e` is what a reading meets when a writer flushed or compacted under it: a gap in
/// the seqs (or a record missing in the range), a file of the log gone, or the format marker
/// missed.
fn moved_under(e: &anyhow::Error) -> bool {
    match e.downcast_ref::<ebb::log::Error>() {
        Some(ebb::log::Error::Gap { .. } | ebb::log::Error::MissingRecord { .. }) => true,
        // RocksDB's words for a file deleted between its listing and its reading.
        Some(ebb::log::Error::Storage(msg)) => msg.contains("No such file or directory"),
        // The meta family's WAL missed the same way (its marker is written once, at creation).
        Some(ebb::log::Error::NotALog { why, .. }) => why == ebb::log::rocks::NO_FORMAT_MARKER,
        _ => false,
    }
}

pub fn open_writer(dir: &Path, mode: OpenMode, durability: Durability) -> Result<Log> {
    open_writer_with(
        dir,
        mode,
        Options {
            durability,
            ..Options::default()
        },
    )
}

pub fn open_writer_with(dir: &Path, mode: OpenMode, options: Options) -> Result<Log> {
    open_writer_on(Arc::new(RocksStore::open(dir, mode)?), options)
}

/// The log's writer on a store opened for writing (a caller that keeps the store too).
pub fn open_writer_on(store: Arc<RocksStore>, options: Options) -> Result<Log> {
    let last = store.last_seq()?;
    let pb = progress(last, "replaying");
    let log = Log::open(store, options, Arc::new(SystemClock), &mut |seq| {
        pb.set_position(seq)
    })?;
    pb.finish_and_clear();
    Ok(log)
}

fn format_time(at_ms: u64) -> String {
    chrono::DateTime::from_timestamp_millis(at_ms as i64)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_else(|| format!("{at_ms}ms"))
}

fn print_envelope(out: &mut impl Write, env: &Envelope, json: bool) -> Result<()> {
    if json {
        serde_json::to_writer(&mut *out, env)?;
        writeln!(out)?;
    } else {
        let body = match serde_json::to_value(&env.event)? {
            serde_json::Value::Object(mut m) => m.remove(env.event.name()).unwrap_or_default(),
            v => v,
        };
        writeln!(
            out,
            "{:>8}  {}  {:<16}  {}",
            env.seq,
            format_time(env.at_ms),
            env.event.name(),
            body
        )?;
    }
    Ok(())
}

/// Prints the events from `*next` up to `to`, moving `*next` past each one printed (also when a
/// later one fails).
fn print_range(
    store: &dyn LogStore,
    next: &mut u64,
    to: u64,
    json: bool,
    out: &mut impl Write,
) -> Result<()> {
    let mut failure = None;
    let read = tools::for_each(
        store,
        *next,
        to,
        &mut |env, _| match print_envelope(out, &env, json) {
            Ok(()) => {
                *next = env.seq + 1;
                true
            }
            Err(e) => {
                failure = Some(e);
                false
            }
        },
    );
    match (read, failure) {
        (Ok(after), None) => {
            *next = after;
            Ok(())
        }
        (_, Some(e)) => Err(e),
        (Err(e), None) => Err(e.into()),
    }
}

/// Catch-ups a follower waits for a gap in what it sees to fill before calling it corruption.
///
/// A follower sees the writer's WAL files and flushed tables as they were at its last catch-up.
/// When the writer flushes a memtable, it deletes the WAL that held it: a catch-up that read the
/// table list just before the flush and the WALs just after it sees the records of the WALs
/// after the flushed one but not the flushed one's last records, a gap that the next catch-up
/// (reading the new table) fills.
const TAIL_GAP_POLLS: u32 = 100;

pub fn log_command(dir: &Path, cmd: LogCommand) -> Result<()> {
    match cmd {
        LogCommand::Stats { json } => {
            let st = read_live(dir, |store| {
                let pb = progress(store.last_seq()?, "scanning");
                let st = tools::stats(store, &mut |seq| pb.set_position(seq))?;
                pb.finish_and_clear();
                Ok(st)
            })?;
            let mut out = std::io::stdout().lock();
            if json {
                serde_json::to_writer_pretty(&mut out, &st)?;
                writeln!(out)?;
                return Ok(());
            }
            writeln!(out, "data dir     {}", dir.display())?;
            writeln!(
                out,
                "seqs         {}..={} ({} events, {} bytes encoded)",
                st.first_seq.unwrap_or(0),
                st.last_seq,
                st.events,
                st.event_bytes
            )?;
            if let (Some(a), Some(b)) = (st.first_at_ms, st.last_at_ms) {
                writeln!(out, "time         {} .. {}", format_time(a), format_time(b))?;
            }
            writeln!(out, "snapshots    {:?}", st.snapshots)?;
            for (name, n) in &st.by_type {
                writeln!(out, "  {name:<18} {n}")?;
            }
            Ok(())
        }
        LogCommand::Dump { from, to, json } => {
            if let Some(to) = to
                && to < from
            {
                bail!("--to {to} is before --from {from}");
            }
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            let mut next = from;
            // A reading again goes on from the first event not printed.
            read_live(dir, |store| {
                let last = store.last_seq()?;
                if next == from && from > last.max(1) {
                    bail!("--from {from} is past the end of the log (last seq is {last})");
                }
                print_range(store, &mut next, to.unwrap_or(u64::MAX), json, &mut out)
            })?;
            out.flush()?;
            Ok(())
        }
        LogCommand::Tail {
            from,
            json,
            poll_ms,
        } => tail(dir, from, json, poll_ms),
        LogCommand::Snapshot => {
            let log = open_writer(dir, OpenMode::Existing, Durability::Sync)?;
            let seq = runtime()?.block_on(log.snapshot())?;
            log.close();
            println!("snapshot taken at seq {seq}");
            Ok(())
        }
        LogCommand::Compact => {
            let store = RocksStore::open(dir, OpenMode::Existing)?;
            let Some(&newest) = store.snapshot_seqs()?.last() else {
                bail!("the log has no snapshot to compact to; run `ebb log snapshot` first");
            };
            let deleted = store.delete_before(newest)?;
            tracing::info!(before = newest, deleted, "log compacted");
            println!("compacted: deleted {deleted} events before seq {newest}");
            Ok(())
        }
    }
}

fn tail(dir: &Path, from: Option<u64>, json: bool, poll_ms: u64) -> Result<()> {
    let scratch = tempfile::Builder::new()
        .prefix("ebb-tail-")
        .tempdir()
        .context("creating the follower's scratch directory")?;
    let store = RocksStore::open_follower(dir, scratch.path())?;
    let mut next = match from {
        Some(s) => s.max(1),
        None => store.last_seq()? + 1,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut out = std::io::stdout().lock();
    // Ends on Ctrl-C or SIGTERM, so the scratch directory is removed.
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut gap_polls = 0u32;
        loop {
            match print_range(&store, &mut next, u64::MAX, json, &mut out) {
                Ok(()) => gap_polls = 0,
                Err(e) if moved_under(&e) && gap_polls < TAIL_GAP_POLLS => gap_polls += 1,
                Err(e) => return Err(e),
            }
            out.flush()?;
            tokio::select! {
                _ = tokio::time::sleep(std::time::Duration::from_millis(poll_ms.max(1))) => {}
                _ = tokio::signal::ctrl_c() => return Ok(()),
                _ = term.recv() => return Ok(()),
            }
            store.catch_up()?;
        }
    })
}

pub fn replay(dir: &Path, args: ReplayArgs) -> Result<()> {
    let ReplayArgs { until, at, json } = args;
    let at = match at {
        Some(t) => Some(
            chrono::DateTime::parse_from_rfc3339(&t)
                .with_context(|| format!("--at {t:?} is not an RFC 3339 time"))?
                .timestamp_millis()
                .max(0) as u64,
        ),
        None => None,
    };
    let (state, snapshot) = read_live(dir, |store| {
        let until = match at {
            Some(at_ms) => Some(tools::seq_at(store, at_ms)?),
            None => until,
        };
        let target = until.unwrap_or(store.last_seq()?);
        let pb = progress(target, "replaying");
        let replayed = open_state::<State>(store, until, &mut |seq| pb.set_position(seq))?;
        pb.finish_and_clear();
        Ok(replayed)
    })?;
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &state)?;
        writeln!(out)?;
        return Ok(());
    }
    print_state(&mut out, &state, snapshot)?;
    Ok(())
}

fn print_state(out: &mut impl Write, s: &State, snapshot: u64) -> Result<()> {
    writeln!(
        out,
        "state at seq {} ({}), rebuilt from {}",
        s.seq,
        if s.seq == 0 {
            "empty log".to_owned()
        } else {
            format_time(s.at_ms)
        },
        if snapshot == 0 {
            "the first event".to_owned()
        } else {
            format!("the snapshot at seq {snapshot}")
        }
    )?;
    writeln!(out, "routes ({})", s.routes.by_name.len())?;
    for r in s.routes.by_name.values() {
        let d = s.routes.deployments.get(&r.spec.deployment);
        writeln!(
            out,
            "  {:<20} {} -> {} (replicas {}, last used {}, {} requests)",
            r.spec.name,
            r.spec.domains.join(","),
            r.spec.deployment,
            d.map_or(0, |d| d.replicas),
            if r.last_used_ms == 0 {
                "never".to_owned()
            } else {
                format_time(r.last_used_ms)
            },
            r.requests_total
        )?;
        // The last decision about its replicas, and why.
        if let Some(d) = d.filter(|d| d.desired_at_ms > 0) {
            writeln!(
                out,
                "  {:<20} asked for {} at {}{}",
                "",
                d.desired,
                format_time(d.desired_at_ms),
                d.reason
                    .map(|r| format!(" ({})", r.name()))
                    .unwrap_or_default()
            )?;
        }
    }
    let mut by_status = std::collections::BTreeMap::new();
    for c in s.calls.by_id.values() {
        *by_status
            .entry(format!("{:?}", c.status).to_lowercase())
            .or_insert(0u64) += 1;
    }
    writeln!(out, "calls ({}) {:?}", s.calls.by_id.len(), by_status)?;
    writeln!(
        out,
        "functions: {} templates, {} instances",
        s.functions.templates.len(),
        s.functions.instances.len()
    )?;
    writeln!(out, "cleaners ({})", s.cleaners.by_name.len())?;
    for c in s.cleaners.by_name.values() {
        writeln!(
            out,
            "  {:<20} last result {:?}, next evaluation {}, fired {}",
            c.spec.name,
            c.last_result,
            c.next_at_ms.map_or("-".to_owned(), format_time),
            c.fired_at_ms.map_or("no".to_owned(), format_time)
        )?;
    }
    writeln!(out, "scheduled deadlines: {}", s.schedule.len())?;
    if let Some((at, due)) = s.schedule.next() {
        writeln!(out, "  next: {:?} at {}", due, format_time(at))?;
    }
    Ok(())
}

pub fn explain(dir: &Path, args: ExplainArgs) -> Result<()> {
    let ExplainArgs { kind, id, json } = args;
    let id = id.as_str();
    let found = read_live(dir, |store| {
        let pb = progress(store.last_seq()?, "scanning");
        let found = tools::explain(store, kind, id, &mut |seq| pb.set_position(seq))?;
        pb.finish_and_clear();
        Ok(found)
    })?;
    let Some(ex) = found else {
        bail!("no {} {id:?} in the log", kind.name());
    };
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer(&mut out, &ex)?;
        writeln!(out)?;
        return Ok(());
    }
    print_story(&mut out, &ex)?;
    Ok(())
}

/// A story for people: a line per event (time, seq, event, what happened and why), the date
/// whenever it changes, and the object as it stands now.
fn print_story(out: &mut impl Write, ex: &tools::Explanation) -> Result<()> {
    writeln!(
        out,
        "{} {}: {} (times in UTC)",
        ex.kind,
        ex.id,
        match ex.story.len() {
            1 => "1 event".to_owned(),
            n => format!("{n} events"),
        }
    )?;
    if ex.compacted_through > 0 {
        writeln!(
            out,
            "(the log was compacted: events up to seq {} are only in its snapshot)",
            ex.compacted_through
        )?;
    }
    let mut day = String::new();
    for line in &ex.story {
        let at = chrono::DateTime::from_timestamp_millis(line.at_ms as i64).unwrap_or_default();
        let today = at.format("%Y-%m-%d").to_string();
        if today != day {
            writeln!(out, "{today}")?;
            day = today;
        }
        writeln!(
            out,
            "  {}  #{:<6} {:<16} {}",
            at.format("%H:%M:%S%.3f"),
            line.seq,
            line.event,
            line.text
        )?;
    }
    writeln!(out, "now: {}", ex.current)?;
    Ok(())
}
