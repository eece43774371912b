//! The deterministic simulator (`ebb simulate`). It drives the production decisions and
//! projections (scaling, the shared-scaling protocol of [`ebb_core::scaler::shared`], the call
//! state machine, the proxy's retry rule, the log codec, replay) through simulated parts: time,
//! the cluster ([`cluster::SimCluster`]: a [`ebb_core::scaler::shared::Coordinator`] and an
//! [`ebb_core::orchestrator::Orchestrator`]), the queue ([`queue::SimQueue`], a
//! [`ebb_core::queue::Queue`]) and the log store ([`ebb_core::log::MemStore`], which loses the
//! unsynced tail in a crash). A run is one thread and one seed: the same seed gives the same
//! trace, byte for byte ([`Outcome::hash`]): a trace line is hashed as it is written. Scenarios
//! are TOML files in `simulations/` ([`scenario`]); [`search`] runs seeds on several threads and
//! a violation comes with the command that replays it ([`replay_command`]). A run reads no clock,
//! spawns nothing and iterates no unordered collection in a way that reaches its trace:
//! everything it does follows from the seed. Of ebb's crates it depends on `ebb-core` alone.
//!
//! The invariants, by name:
//! * `request_not_lost`: every request is answered by a ready replica (a request that met a
//!   stopping one was retried), none is held past its hold timeout, none is left at the end.
//!   Requests on a proxy replica that crashed are the crash's, not a scaling decision's.
//! * `no_downscale_while_used`: when a scale-down takes effect, no request arrived within
//!   `idle_after_ms` before it (except within `sync_lag_ms`, which no replica could know yet)
//!   and none older than that is in flight.
//! * `call_at_most_once`: no call is executed twice.
//! * `finish_idempotent`: a call's finish is recorded once and every finish gets the same answer.
//! * `call_reaches_final`: every acknowledged call is final once the faults have stopped for
//!   `settle_ms`.
//! * `replay_equals_live`, `schedule_rebuilt_equals_live`: each log replayed from its store
//!   equals the live projection, schedule heap included.
//! * `warm_on_time`, `warm_floor_held`, `in_flight_served`: keep-warm windows open, renew and
//!   close at their time, across restarts, and hold their replicas, without scaling below the
//!   traffic in flight ([`warm`]).
//! * `load_floor_held`, `cold_surge_met`, `no_scale_down_in_panic`: scaling on load never asks
//!   for fewer replicas than the requests in flight need at the target, asks at once for all a
//!   surge no replica has answered yet needs, and never lowers its count while in panic
//!   ([`load`]).

pub mod cluster;
pub mod load;
pub mod log;
pub mod queue;
pub mod scenario;
pub mod warm;
pub mod world;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use ebb_core::mutation::Mutation;
pub use scenario::Scenario;
pub use world::{Outcome, Stats, Violation};

/// Runs one seed of a scenario (faults as the scenario has them), with `mutation` on.
pub fn run(scenario: &Scenario, seed: u64, mutation: Option<Mutation>) -> Outcome {
    ebb_core::mutation::with(mutation, || match (&scenario.warm, &scenario.load) {
        (Some(w), _) => warm::run(scenario, w, seed),
        (None, Some(l)) => load::run_scenario(l, seed),
        (None, None) => world::World::new(scenario, seed).run(),
    })
}

/// Reads scenarios: each path a file, or a directory whose `*.toml` files are read in name
/// order. `faults`, when given, keeps only those fault kinds.
pub fn load(paths: &[PathBuf], faults: Option<&BTreeSet<String>>) -> Result<Vec<Scenario>, String> {
    let mut files = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| format!("{}: {e}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.extension().is_some_and(|x| x == "toml"))
                .collect();
            found.sort();
            if found.is_empty() {
                return Err(format!("{}: no scenario (*.toml) in it", p.display()));
            }
            files.extend(found);
        } else {
            files.push(p.clone());
        }
    }
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        let stem = f
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut s = Scenario::parse(&text, &stem).map_err(|e| format!("{}: {e}", f.display()))?;
        if let Some(on) = faults {
            s.faults.restrict(on);
        }
        s.path = f.clone();
        out.push(s);
    }
    Ok(out)
}

/// Parses `--faults`: a comma-separated list of fault kinds, or `none`.
pub fn parse_faults(list: &str) -> Result<BTreeSet<String>, String> {
    let mut on = BTreeSet::new();
    for k in list.split(',').map(str::trim).filter(|k| !k.is_empty()) {
        if !scenario::FAULT_KINDS.contains(&k) {
            return Err(format!(
                "unknown fault kind {k:?}; the kinds are {}",
                scenario::FAULT_KINDS.join(", ")
            ));
        }
        if k != "none" {
            on.insert(k.to_owned());
        }
    }
    Ok(on)
}

/// A violation found by [`search`].
#[derive(Debug, Clone)]
pub struct Found {
    /// The scenario's name.
    pub scenario: String,
    /// The seed.
    pub seed: u64,
    /// The outcome (with the violation and the trace's end).
    pub outcome: Outcome,
}

/// Totals of a [`search`].
#[derive(Debug, Clone, Default)]
pub struct Totals {
    /// Seeds run.
    pub seeds: u64,
    /// Simulated milliseconds.
    pub sim_ms: u64,
    /// Steps.
    pub steps: u64,
}

/// Runs `seeds` (for each scenario) on `threads` threads; stops at the first violation (the
/// lowest seed among those found so far). `progress` is told of each seed finished.
pub fn search(
    scenarios: &[Scenario],
    seeds: &[u64],
    mutation: Option<Mutation>,
    threads: usize,
    progress: &(dyn Fn() + Sync),
) -> (Totals, Option<Found>) {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let jobs: Vec<(usize, u64)> = scenarios
        .iter()
        .enumerate()
        .flat_map(|(i, _)| seeds.iter().map(move |&s| (i, s)))
        .collect();
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let totals = Mutex::new(Totals::default());
    let found: Mutex<Option<(usize, Found)>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| {
                loop {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(i, seed)) = jobs.get(j) else {
                        return;
                    };
                    let outcome = run(&scenarios[i], seed, mutation);
                    {
                        let mut t = totals.lock().expect("totals lock");
                        t.seeds += 1;
                        t.sim_ms += outcome.sim_ms;
                        t.steps += outcome.stats.steps;
                    }
                    progress();
                    if outcome.violation.is_some() {
                        stop.store(true, Ordering::Relaxed);
                        let mut f = found.lock().expect("found lock");
                        if f.as_ref().is_none_or(|(k, _)| j < *k) {
                            *f = Some((
                                j,
                                Found {
                                    scenario: scenarios[i].name.clone(),
                                    seed,
                                    outcome,
                                },
                            ));
                        }
                    }
                }
            });
        }
    });
    let totals = totals.into_inner().expect("totals lock");
    let found = found.into_inner().expect("found lock").map(|(_, f)| f);
    (totals, found)
}

/// The command that replays a violation.
pub fn replay_command(
    scenario_path: &Path,
    seed: u64,
    faults: Option<&str>,
    mutation: Option<Mutation>,
) -> String {
    let mut cmd = format!("ebb simulate {} --seed {seed}", scenario_path.display());
    if let Some(f) = faults {
        cmd.push_str(&format!(" --faults {f}"));
    }
    if let Some(m) = mutation {
        cmd.push_str(&format!(" --mutation {}", m.name()));
    }
    cmd
}
