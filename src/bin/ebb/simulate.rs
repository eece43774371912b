//! `ebb simulate`: the deterministic simulator over scenarios and seeds, in parallel, with a
//! progress bar; a broken invariant prints the command that replays it.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

/// Arguments of `ebb simulate`.
#[derive(Args)]
pub struct SimulateArgs {
    /// Scenario files or directories of them.
    pub scenarios: Vec<PathBuf>,
    /// Seeds per scenario (0, 1, ... unless --first-seed says otherwise).
    #[arg(long, default_value_t = 200, conflicts_with = "seed")]
    pub seeds: u64,
    /// The first seed of --seeds.
    #[arg(long, default_value_t = 0)]
    pub first_seed: u64,
    /// Run only this seed and print its trace (to replay a violation).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep only these fault kinds (comma-separated: api-errors, pauses, replica-crash,
    /// torn-writes, runner-crash, lost-replies, duplicates, skew, rebalances, owner-stall; or
    /// none).
    #[arg(long)]
    pub faults: Option<String>,
    /// Threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Switch on a deliberately broken decision (to show the simulator finds it).
    #[arg(long, hide = true)]
    pub mutation: Option<String>,
}

/// `ebb simulate`.
pub fn run(args: SimulateArgs) -> Result<()> {
    let SimulateArgs {
        scenarios,
        seeds,
        first_seed,
        seed,
        faults,
        threads,
        mutation,
    } = args;
    let mutation = match mutation.as_deref() {
        None => None,
        Some(m) => Some(ebb::mutation::Mutation::parse(m).with_context(|| {
            let names: Vec<&str> = ebb::mutation::Mutation::ALL
                .iter()
                .map(|m| m.name())
                .collect();
            format!(
                "unknown mutation {m:?}; the mutations are {}",
                names.join(", ")
            )
        })?),
    };
    let on = match faults.as_deref() {
        Some(f) => Some(ebb::sim::parse_faults(f).map_err(anyhow::Error::msg)?),
        None => None,
    };
    let paths = if scenarios.is_empty() {
        vec![PathBuf::from("simulations")]
    } else {
        scenarios
    };
    let scenarios = ebb::sim::load(&paths, on.as_ref()).map_err(anyhow::Error::msg)?;
    let threads = threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    if let Some(seed) = seed {
        let mut failed = false;
        for sc in &scenarios {
            let out = ebb::sim::run(sc, seed, mutation);
            for line in &out.trace {
                println!("{line}");
            }
            println!(
                "{}: seed {seed}: {} steps, {:.1} s simulated, trace hash {:016x}",
                sc.name,
                out.stats.steps,
                out.sim_ms as f64 / 1e3,
                out.hash
            );
            println!("{:?}", out.stats);
            if let Some(v) = &out.violation {
                println!("VIOLATION {}: {}", v.invariant, v.detail);
                failed = true;
            }
        }
        anyhow::ensure!(!failed, "an invariant was violated");
        return Ok(());
    }
    anyhow::ensure!(seeds > 0, "--seeds must be at least 1");
    let list: Vec<u64> = (first_seed..first_seed.saturating_add(seeds)).collect();
    let pb = if std::io::stderr().is_terminal() {
        let pb = ProgressBar::new(list.len() as u64 * scenarios.len() as u64);
        pb.set_style(
            ProgressStyle::with_template(
                "simulating [{bar:40}] {pos}/{len} seeds ({per_sec}, {eta})",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        pb
    } else {
        ProgressBar::hidden()
    };
    let clock = ebb::clock::Stopwatch::start();
    let (totals, found) = ebb::sim::search(&scenarios, &list, mutation, threads, &|| pb.inc(1));
    pb.finish_and_clear();
    let wall = clock.elapsed().as_secs_f64().max(1e-9);
    let names: Vec<&str> = scenarios.iter().map(|s| s.name.as_str()).collect();
    println!(
        "{} seeds over {} ({}) in {wall:.1} s on {threads} threads: {:.0} seeds/s, {:.0} simulated s per wall s, {} steps",
        totals.seeds,
        if names.len() == 1 {
            "1 scenario".to_owned()
        } else {
            format!("{} scenarios", names.len())
        },
        names.join(", "),
        totals.seeds as f64 / wall,
        totals.sim_ms as f64 / 1e3 / wall,
        totals.steps
    );
    let Some(f) = found else {
        println!("no invariant violated");
        return Ok(());
    };
    let v = f.outcome.violation.as_ref().expect("a violation");
    println!(
        "\nVIOLATION of {} in {} seed {} at {} ms:",
        v.invariant, f.scenario, f.seed, v.at_ms
    );
    println!("  {}", v.detail);
    println!("\ntrace (last {} lines):", f.outcome.trace.len());
    for line in &f.outcome.trace {
        println!("  {line}");
    }
    let path = scenarios
        .iter()
        .find(|s| s.name == f.scenario)
        .map(|s| s.path.clone())
        .unwrap_or_default();
    println!(
        "\nreplay: {}",
        ebb::sim::replay_command(&path, f.seed, faults.as_deref(), mutation)
    );
    anyhow::bail!("invariant {} violated", v.invariant)
}
