//! The deterministic simulator: determinism, a sweep of every scenario, proof that it finds each
//! deliberately broken decision, and `ebb simulate` on the command line. The long sweep (2,000+
//! seeds) runs in `scripts/test` on the `ci` profile's binary.

use std::path::PathBuf;
use std::process::Command;

use ebb::mutation::Mutation;
use ebb::sim::{self, Scenario};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("simulations")
}

fn scenarios() -> Vec<Scenario> {
    sim::load(&[dir()], None).unwrap()
}

fn scenario(name: &str) -> Scenario {
    scenarios()
        .into_iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no scenario {name}"))
}

#[test]
fn the_same_seed_gives_the_same_trace_byte_for_byte() {
    for sc in scenarios() {
        let mut hashes = Vec::new();
        for seed in [3, 17, 4242] {
            let a = sim::run(&sc, seed, None);
            let b = sim::run(&sc, seed, None);
            assert_eq!(a.hash, b.hash, "{} seed {seed}", sc.name);
            assert_eq!(a.trace, b.trace, "{} seed {seed}", sc.name);
            assert_eq!(a.stats, b.stats, "{} seed {seed}", sc.name);
            assert!(a.stats.steps > 100, "{} seed {seed} did little", sc.name);
            hashes.push(a.hash);
        }
        hashes.dedup();
        assert_eq!(hashes.len(), 3, "{}: different seeds, same trace", sc.name);
    }
}

#[test]
fn every_scenario_holds_its_invariants_and_exercises_what_it_is_about() {
    let mut seen = ebb::sim::Stats::default();
    for sc in scenarios() {
        for seed in 0..8 {
            let out = sim::run(&sc, seed, None);
            if let Some(v) = &out.violation {
                panic!(
                    "{} seed {seed}: {} {}\n{}",
                    sc.name,
                    v.invariant,
                    v.detail,
                    out.trace.join("\n")
                );
            }
            seen.requests += out.stats.requests;
            seen.retried += out.stats.retried;
            seen.scale_downs += out.stats.scale_downs;
            seen.conflicts += out.stats.conflicts;
            seen.wakes += out.stats.wakes;
            seen.calls += out.stats.calls;
            seen.executed += out.stats.executed;
            seen.crashes += out.stats.crashes;
            seen.forwarded += out.stats.forwarded;
            seen.held_unknown += out.stats.held_unknown;
            seen.recorded_from_copy += out.stats.recorded_from_copy;
            seen.warm_started += out.stats.warm_started;
        }
    }
    assert!(
        seen.warm_started > 20,
        "keep-warm windows hardly opened: {seen:?}"
    );
    // The races the invariants are about did happen.
    assert!(seen.scale_downs > 10, "{seen:?}");
    assert!(seen.wakes > 10, "{seen:?}");
    assert!(
        seen.retried > 0,
        "no request met a stopping replica: {seen:?}"
    );
    assert!(
        seen.conflicts > 0,
        "no scale-down lost its compare-and-swap: {seen:?}"
    );
    assert!(seen.calls > 100 && seen.executed > 100, "{seen:?}");
    assert!(seen.crashes > 5, "{seen:?}");
    assert!(
        seen.forwarded > 100,
        "no start or finish went to another replica: {seen:?}"
    );
    assert!(
        seen.held_unknown > 0,
        "no replica read another's message between its put and its record: {seen:?}"
    );
    assert!(
        seen.recorded_from_copy > 0,
        "no owner stalled past the hold-back bound: {seen:?}"
    );
}

/// Each broken decision is found, as a violation of the invariant it breaks, within the bound.
#[test]
fn the_simulator_finds_every_deliberately_broken_decision() {
    const BOUND: u64 = 100;
    let cases = [
        (
            Mutation::DownscaleWithoutCas,
            "downscale-race",
            "no_downscale_while_used",
        ),
        (
            Mutation::NoRetryOnStopping,
            "downscale-race",
            "request_not_lost",
        ),
        (
            Mutation::StartWithoutCondition,
            "calls-chaos",
            "call_at_most_once",
        ),
        (
            Mutation::FinishNotIdempotent,
            "calls-chaos",
            "finish_idempotent",
        ),
        (
            Mutation::DecideForOthers,
            "calls-replicas",
            "call_at_most_once",
        ),
        (
            Mutation::RefuseUnknownCopy,
            "calls-replicas",
            "call_reaches_final",
        ),
        (Mutation::IdleIgnoresWarm, "keep-warm", "warm_floor_held"),
        (Mutation::LoadIgnoresHeld, "load", "cold_surge_met"),
        (Mutation::ScaleDownInPanic, "load", "no_scale_down_in_panic"),
    ];
    for (mutation, name, invariant) in cases {
        let sc = scenario(name);
        let found = (0..BOUND).find_map(|seed| {
            let out = sim::run(&sc, seed, Some(mutation));
            out.violation.map(|v| (seed, v))
        });
        let Some((seed, v)) = found else {
            panic!("{} not found in {BOUND} seeds of {name}", mutation.name());
        };
        assert_eq!(v.invariant, invariant, "{}: {}", mutation.name(), v.detail);
        eprintln!(
            "{}: found at seed {seed} of {name} ({} seeds run): {}",
            mutation.name(),
            seed + 1,
            v.detail
        );
        // The same seed without the mutation holds.
        assert!(sim::run(&sc, seed, None).violation.is_none());
    }
}

/// Handing out another replica's unknown call at once (no hold-back) costs refused starts, not
/// calls: the owner that refused a start as unknown puts the message again when it records the
/// call. (Before that fallback, this mutation broke `call_reaches_final`.)
#[test]
fn handing_out_unknown_calls_at_once_loses_none_now() {
    let sc = scenario("calls-replicas");
    for seed in 0..12 {
        let out = sim::run(&sc, seed, Some(Mutation::HandOutUnknown));
        assert!(
            out.violation.is_none(),
            "seed {seed}: {:?}",
            out.violation.map(|v| v.detail)
        );
    }
}

#[test]
fn a_mutation_switched_on_for_a_run_is_off_after_it() {
    let sc = scenario("calls-chaos");
    let _ = sim::run(&sc, 0, Some(Mutation::StartWithoutCondition));
    assert!(!ebb::mutation::active(Mutation::StartWithoutCondition));
}

#[test]
fn bad_scenarios_and_fault_lists_are_refused_clearly() {
    let bad = [
        ("duration_ms = 1\nsettle_ms = 1\n", "needs [proxy], [calls]"),
        ("settle_ms = 1\n", "duration_ms"),
        (
            "duration_ms = 1\nsettle_ms = 1\n[calls]\nrunners = 1\ncapacity = 1\ngap_ms = [5, 1]\nrun_ms = [1, 1]\ntimeout_ms = 1\nvisibility_timeout_ms = 1\nhold_grace_ms = 1\nrestart_ms = [1, 1]\n",
            "calls.gap_ms: [5, 1] is not a range",
        ),
        (
            "duration_ms = 1\nsettle_ms = 1\nsurprise = 1\n",
            "unknown field",
        ),
    ];
    for (text, want) in bad {
        let err = Scenario::parse(text, "x").unwrap_err();
        assert!(err.contains(want), "{err:?} should say {want:?}");
    }
    let err = sim::parse_faults("api-errors,gremlins").unwrap_err();
    assert!(
        err.contains("gremlins") && err.contains("replica-crash"),
        "{err}"
    );
    assert!(sim::parse_faults("none").unwrap().is_empty());
}

#[test]
fn faults_off_means_no_crash_at_all() {
    let on = sim::parse_faults("none").unwrap();
    for sc in sim::load(&[dir()], Some(&on)).unwrap() {
        let out = sim::run(&sc, 5, None);
        assert!(out.violation.is_none(), "{}: {:?}", sc.name, out.violation);
        assert_eq!(out.stats.crashes, 0, "{}", sc.name);
    }
}

fn ebb(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ebb"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap()
}

#[test]
fn ebb_simulate_reports_speed_and_a_violation_with_the_command_that_replays_it() {
    let ok = ebb(&["simulate", "simulations/mixed.toml", "--seeds", "2"]);
    let text = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{text}");
    assert!(
        text.contains("seeds/s") && text.contains("simulated s per wall s"),
        "{text}"
    );
    assert!(text.contains("no invariant violated"), "{text}");

    let bad = ebb(&[
        "simulate",
        "simulations/calls-chaos.toml",
        "--seeds",
        "20",
        "--mutation",
        "finish-not-idempotent",
    ]);
    let text = String::from_utf8_lossy(&bad.stdout);
    assert!(!bad.status.success(), "{text}");
    assert!(text.contains("VIOLATION of finish_idempotent"), "{text}");
    let replay = text
        .lines()
        .find_map(|l| l.strip_prefix("replay: ebb "))
        .unwrap_or_else(|| panic!("no replay command in {text}"));
    // The printed command replays the same violation.
    let args: Vec<&str> = replay.split_whitespace().collect();
    let again = ebb(&args);
    let out = String::from_utf8_lossy(&again.stdout);
    assert!(!again.status.success());
    assert!(out.contains("VIOLATION finish_idempotent"), "{out}");

    let err = ebb(&["simulate", "--faults", "gremlins"]);
    assert!(!err.status.success());
    assert!(String::from_utf8_lossy(&err.stderr).contains("unknown fault kind"));
    let err = ebb(&["simulate", "no/such/scenario.toml"]);
    assert!(!err.status.success());
    assert!(String::from_utf8_lossy(&err.stderr).contains("no/such/scenario.toml"));
}
