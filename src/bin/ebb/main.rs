//! The `ebb` command line: `serve`, the tools that read the log (`log`, `replay`, `explain`),
//! the simulator, the remote runner and `bench`, one module a subcommand. Errors are one line on
//! stderr and a non-zero exit.

mod bench;
mod debug;
mod log_filter;
mod logs;
mod runner;
mod serve;
mod simulate;

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

/// mimalloc instead of the system allocator: replay decodes on one thread and frees on another,
/// and glibc's allocator spends a fifth of the replay there (see `ebb bench log`).
///
/// Built without transparent huge pages (`no_thp`: mimalloc does not `madvise` its memory
/// `MADV_HUGEPAGE`). With them, every page mimalloc took fresh from its arena faulted in a 2 MiB
/// huge page cleared whole, and memory it purged split them again: measured under `ebb bench
/// calls` on Kafka, page faults were 15-20% of ebb's CPU with them and 2% without. The kernel's
/// own setting still applies (`always` gives huge pages anyway); workloads ebb starts are not
/// touched.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "ebb",
    version,
    about = "Serverless HTTP workloads and functions on one event log",
    args_override_self = true
)]
struct Cli {
    #[command(flatten)]
    data: DataDir,
    /// How ebb's own log lines (stderr) are written: `text` for people, `json` (one object per
    /// line, with the spans' fields such as a request's id) for a log collector.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "EBB_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Args, Clone)]
struct DataDir {
    /// The data directory holding ebb's log.
    #[arg(
        long,
        global = true,
        env = "EBB_DATA_DIR",
        default_value = "./ebb-data",
        value_name = "DIR"
    )]
    data_dir: PathBuf,
}

// Parsed once per run: the size of `serve`'s flags does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run ebb: open (or create) the log, start the apps' workloads on demand, and proxy HTTP to
    /// them by Host.
    Serve(ebb::serve::ServeOptions),
    /// Run calls from a remote ebb: dequeue, start, execute through ebb's proxy, finish.
    Runner(runner::RunnerArgs),
    /// Inspect the log.
    #[command(subcommand)]
    Log(logs::LogCommand),
    /// Print the state the projections had at a point of the log (default: its end).
    Replay(logs::ReplayArgs),
    /// List the events that shaped an object, and the object as it is now.
    Explain(logs::ExplainArgs),
    /// Measure ebb on this machine.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Run the deterministic simulator: scenarios (files or directories; default `simulations/`)
    /// over many seeds, checking ebb's invariants after every step.
    Simulate(simulate::SimulateArgs),
    /// A small HTTP app for demos, tests and benchmarks (echo, /sleep, /bytes, /ws, /health).
    ExampleApp(ebb::example_app::ExampleAppArgs),
    /// The custom resource definitions of ebb's Kubernetes API, generated from its types: each
    /// as `NAME.json` in --out (what deploy/ holds), or all on stdout.
    Crds {
        /// Write one file per definition into this directory.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Test helpers.
    #[command(subcommand, hide = true)]
    Debug(debug::DebugCommand),
}

fn main() {
    let cli = Cli::parse();
    let filter = std::env::var("EBB_LOG")
        .ok()
        .and_then(|spec| {
            tracing_subscriber::EnvFilter::try_new(log_filter::quiet(&log_filter::translate(&spec)))
                .ok()
        })
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new(log_filter::quiet("info")));
    // Traces (OpenTelemetry, by the OTEL_* variables) for the commands that serve.
    let telemetry = match &cli.command {
        Command::Serve(_) | Command::Runner(_) => match ebb::telemetry::Telemetry::from_env() {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: {e:#}");
                std::process::exit(2);
            }
        },
        _ => None,
    };
    match &telemetry {
        None => {
            let lines = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr);
            match cli.log_format {
                LogFormat::Text => lines.with_ansi(std::io::stderr().is_terminal()).init(),
                LogFormat::Json => lines
                    .json()
                    .with_current_span(true)
                    .with_span_list(true)
                    .init(),
            }
        }
        Some(t) => {
            // The log lines under their filter, and ebb's spans of interest as OpenTelemetry
            // spans whatever the log level.
            use tracing_subscriber::Layer as _;
            use tracing_subscriber::layer::SubscriberExt as _;
            use tracing_subscriber::util::SubscriberInitExt as _;
            let lines = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
            let registry = tracing_subscriber::registry().with(t.layer());
            match cli.log_format {
                LogFormat::Text => registry
                    .with(
                        lines
                            .with_ansi(std::io::stderr().is_terminal())
                            .with_filter(filter),
                    )
                    .init(),
                LogFormat::Json => registry
                    .with(
                        lines
                            .json()
                            .with_current_span(true)
                            .with_span_list(true)
                            .with_filter(filter),
                    )
                    .init(),
            }
        }
    }
    let result = run(cli);
    if let Some(t) = telemetry {
        t.shutdown();
    }
    if let Err(e) = result {
        if is_broken_pipe(&e) {
            std::process::exit(0);
        }
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = std::env::var("EBB_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        b.worker_threads(n.max(1));
    }
    b.enable_all().build().context("starting the async runtime")
}

fn run(cli: Cli) -> Result<()> {
    let dir = cli.data.data_dir;
    match cli.command {
        Command::Serve(mut options) => {
            options.check().map_err(anyhow::Error::msg)?;
            if let Some(seed) = options.balance_seed {
                ebb::discovery::set_seed(seed);
            }
            options.data_dir = dir.clone();
            serve::run(options)
        }
        Command::Log(cmd) => logs::log_command(&dir, cmd),
        Command::Replay(args) => logs::replay(&dir, args),
        Command::Explain(args) => logs::explain(&dir, args),
        Command::Bench(cmd) => bench::run(cmd),
        Command::ExampleApp(args) => runtime()?.block_on(ebb::example_app::run(args)),
        Command::Crds { out } => crds(out.as_deref()),
        Command::Simulate(args) => simulate::run(args),
        Command::Runner(args) => runtime()?.block_on(runner::run(args)),
        Command::Debug(cmd) => debug::run(&dir, cmd),
    }
}

/// `ebb crds`: the definitions as pretty JSON (which kubectl, kustomize and Helm read as YAML),
/// labelled as `deploy/` labels every object of ebb's (Helm's `crds/` are not templated, so the
/// labels are theirs already).
fn crds(out: Option<&std::path::Path>) -> anyhow::Result<()> {
    for mut crd in ebb::functions::crds()
        .into_iter()
        .chain(ebb::cleaner::crds())
    {
        let labels = crd.metadata.labels.get_or_insert_default();
        for (key, value) in [
            ("app.kubernetes.io/name", "ebb"),
            ("app.kubernetes.io/part-of", "ebb"),
        ] {
            labels.insert(key.to_owned(), value.to_owned());
        }
        let name = crd.metadata.name.clone().unwrap_or_default();
        let mut text = serde_json::to_string_pretty(&crd)?;
        text.push('\n');
        match out {
            Some(dir) => {
                let path = dir.join(format!("{name}.json"));
                std::fs::write(&path, text)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            None => print!("{text}"),
        }
    }
    Ok(())
}
