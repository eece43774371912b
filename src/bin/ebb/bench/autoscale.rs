//! `ebb bench autoscale`: scaling on load in the simulator, ebb's policy against Knative's KPA
//! (the anchor) on the same generated traces, seeds and replica start times: per trace and
//! policy, the p50 and p99 wait for a replica, the replica-seconds used and the scale changes
//! per minute ([`ebb::sim::load`]).

use anyhow::Result;

use ebb::sim::load::{Config, Policy, Report, Trace, run};

/// Arguments of `ebb bench autoscale`.
#[derive(Debug, Clone, clap::Args)]
pub struct AutoscaleBenchArgs {
    /// Seconds of traffic per run.
    #[arg(long, default_value_t = 600)]
    pub seconds: u64,
    /// Seeds per trace and policy (the figures are the means over them).
    #[arg(long, default_value_t = 5)]
    pub seeds: u64,
    /// Target requests in flight per replica.
    #[arg(long, default_value_t = 10.0)]
    pub target: f64,
}

fn mean(runs: &[Report], f: impl Fn(&Report) -> f64) -> f64 {
    runs.iter().map(f).sum::<f64>() / runs.len().max(1) as f64
}

pub fn run_bench(args: AutoscaleBenchArgs) -> Result<()> {
    anyhow::ensure!(args.seeds > 0, "--seeds must be at least 1");
    anyhow::ensure!(
        args.target.is_finite() && args.target > 0.0,
        "--target must be above 0"
    );
    println!(
        "ebb bench autoscale: {} s per run, {} seeds, target {} in flight per replica at 70 %, replicas start in 1-4 s and serve 10 at once",
        args.seconds, args.seeds, args.target
    );
    println!(
        "| trace | policy | wait p50 | wait p99 | replica-s | changes/min | reversals | peak | floor violations |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for trace in Trace::ALL {
        for policy in [Policy::Kpa, Policy::Ebb] {
            let mut c = Config {
                trace,
                seconds: args.seconds,
                ..Config::default()
            };
            c.settings.target = args.target;
            let runs: Vec<Report> = (0..args.seeds).map(|s| run(&c, policy, s)).collect();
            println!(
                "| {} | {} | {:.0} ms | {:.0} ms | {:.0} | {:.2} | {:.1} | {:.0} | {} |",
                trace.name(),
                policy.name(),
                mean(&runs, |r| r.wait_p50_ms as f64),
                mean(&runs, |r| r.wait_p99_ms as f64),
                mean(&runs, |r| r.replica_seconds),
                mean(&runs, |r| r.changes_per_minute(args.seconds)),
                mean(&runs, |r| f64::from(r.reversals)),
                mean(&runs, |r| f64::from(r.peak)),
                runs.iter().map(|r| r.violations.len()).sum::<usize>(),
            );
        }
    }
    Ok(())
}
