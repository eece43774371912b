//! The cleaners of `ebb.toml` (`[[cleaner]]`): their configuration, their log names, and the
//! standing retention of ended calls and instances. Their targets are ebb's own objects (run by
//! ebb-cleaner's local cleaner backend, `crates/cleaner/src/local.rs`).
//!
//! Their log names start with [`PREFIX`] (`config/`), which is how the two cleaner loops split the
//! log's cleaners ([`is_local`]): these run on every replica, the `Cleaner` resources only on the
//! lease holder. They are standing (`repeat`): `CleanerFired` arms them again after their retry
//! period. The retention ([`retention`], `config/retention`) is one of them: its firing decides
//! `CallsForgotten { finished_before_ms }`, which drops ended calls from the projection (except a
//! running instance's current step, which the instance has yet to read), and `InstancesForgotten`,
//! which drops ended instances; their events stay in the log. Their age alone does not bound the
//! memory they take, so [`RetentionBounds`] also bounds their count and size: past a bound the
//! same events forget the oldest, naming the bounds kept (`within`).

pub use crate::calls::RetentionBounds;
use crate::event::{CleanerSpec, CleanerTarget};
use serde::Deserialize;

use super::spec::{CleanerResourceSpec, Ref, to_spec};

/// The apiVersion of ebb's own objects as cleaner targets.
pub const API_VERSION: &str = "ebb.dev/v1";

/// The prefix of the log names of `ebb.toml`'s cleaners.
pub const PREFIX: &str = "config/";

/// Whether a cleaner of the log is one of `ebb.toml`'s.
pub fn is_local(name: &str) -> bool {
    name.starts_with(PREFIX)
}

/// A `[[cleaner]]` of `ebb.toml`: a name and the `Cleaner` resource's spec.
#[derive(Debug, Clone, Deserialize)]
pub struct CleanerConfig {
    pub name: String,
    #[serde(flatten)]
    pub spec: CleanerResourceSpec,
}

/// The log's spec of an `ebb.toml` cleaner (problems in `invalid`, as for a resource's).
pub fn config_spec(c: &CleanerConfig) -> CleanerSpec {
    let mut spec = to_spec(&format!("{PREFIX}{}", c.name), "", "", 0, &c.spec);
    spec.repeat = true;
    let mut problems: Vec<String> = (!spec.invalid.is_empty())
        .then(|| spec.invalid.clone())
        .into_iter()
        .collect();
    for (i, t) in spec.targets.iter().enumerate() {
        match Ref::parse(&t.reference) {
            Ok(r) if r.api_version != API_VERSION => problems.push(format!(
                "targets[{i}]: apiVersion {} is not {API_VERSION} (ebb's own objects)",
                r.api_version
            )),
            Ok(r) => match r.kind.to_ascii_lowercase().as_str() {
                "app" | "function" => {}
                "call" | "instance" => {
                    if r.name.is_some()
                        || r.labels.get("state").map(String::as_str) != Some("ended")
                        || r.labels.len() != 1
                    {
                        problems.push(format!(
                            "targets[{i}]: {} targets select matchLabels {{state: ended}}",
                            r.kind
                        ));
                    }
                }
                other => problems.push(format!(
                    "targets[{i}]: kind {other:?} is not App, Function, Call or Instance"
                )),
            },
            Err(e) => problems.push(format!("targets[{i}]: {e}")),
        }
    }
    if c.spec.helm.as_ref().is_some_and(|h| h.delete) {
        problems.push("helm: ebb.toml's cleaners have no Helm releases".into());
    }
    spec.invalid = problems.join("; ");
    spec
}

/// The standing cleaner that is the retention of ended calls and instances: every `period_ms`
/// they leave the projection once `retention_ms` old (their events stay in the log).
pub fn retention(retention_ms: u64, period_ms: u64) -> CleanerSpec {
    let target = |name: &str, kind: &str| CleanerTarget {
        name: name.to_owned(),
        reference: format!("{API_VERSION}/{kind}?state=ended"),
        delete: true,
        include_when_evaluating: false,
    };
    CleanerSpec {
        name: format!("{PREFIX}retention"),
        ttl_ms: retention_ms,
        retry_period_ms: period_ms.max(1),
        targets: vec![target("calls", "Call"), target("instances", "Instance")],
        repeat: true,
        ..CleanerSpec::default()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_bytes::ByteBuf;

    use super::*;
    use crate::event::{CallSpec, Event, Kept, Outcome};
    use crate::state::State;

    use crate::state::apply_at as apply;

    /// Bounds on the count alone.
    fn by_count(count: u64) -> RetentionBounds {
        RetentionBounds {
            count,
            bytes: u64::MAX,
        }
    }

    /// Calls `c0`..`c{n-1}` with a 1,000-byte payload each, `ci` cancelled at `100 + i` ms.
    fn ended_calls(s: &mut State, n: u64) {
        for i in 0..n {
            let mut spec = CallSpec::for_test(&format!("c{i}"));
            spec.payload.body = ByteBuf::from(vec![7; 1_000]);
            apply(
                s,
                1,
                Event::CallQueued {
                    call: Arc::new(spec),
                },
            );
        }
        for i in 0..n {
            apply(
                s,
                100 + i,
                Event::CallCancelled {
                    id: format!("c{i}"),
                },
            );
        }
    }

    fn kept(s: &State) -> Vec<&str> {
        let mut ids: Vec<&str> = s.calls.by_id.keys().map(|k| k.as_str()).collect();
        ids.sort_by_key(|id| id[1..].parse::<u32>().unwrap_or(u32::MAX));
        ids
    }

    /// The decisions that bring the ended calls and instances over a bound back within what is
    /// kept at once: one step of any size, begun only past a bound.
    fn decide(bounds: RetentionBounds, s: &State) -> Vec<Event> {
        if !bounds.exceeded(s) {
            return Vec::new();
        }
        bounds.step(s, u64::MAX)
    }

    /// Applies the bounds' decisions, and checks that the tallies the projection kept are what
    /// counting its calls and instances again gives (as a snapshot's reading does).
    fn hold(s: &mut State, bounds: RetentionBounds) -> Vec<Event> {
        let events = decide(bounds, s);
        for e in events.clone() {
            apply(s, 1_000, e);
        }
        let read = State::decode_snapshot(&s.encode_snapshot()).unwrap();
        // The calls with their indexes (which ended when, what is left of forgotten ones).
        assert_eq!(read.calls, s.calls);
        assert_eq!(read.functions.ended, s.functions.ended);
        events
    }

    #[test]
    fn past_the_count_the_oldest_ended_calls_go_and_the_newest_seven_eighths_stay() {
        let mut s = State::default();
        let mut spec = CallSpec::for_test("queued");
        spec.payload.body = ByteBuf::from(vec![7; 1_000]);
        apply(
            &mut s,
            1,
            Event::CallQueued {
                call: Arc::new(spec),
            },
        );
        ended_calls(&mut s, 20);
        assert_eq!(s.calls.ended.count, 20);
        let bounds = by_count(16);
        assert!(bounds.exceeded(&s));
        let events = hold(&mut s, bounds);
        assert_eq!(
            events,
            vec![Event::CallsForgotten {
                finished_before_ms: 106,
                within: Some(Kept {
                    count: 14,
                    bytes: u64::MAX - u64::MAX / 8
                }),
                keep_gone: None,
            }]
        );
        assert!(
            s.calls.get("queued").is_some(),
            "a queued call is not ended"
        );
        let mut ended = kept(&s);
        ended.retain(|id| *id != "queued");
        let want: Vec<String> = (6..20).map(|i| format!("c{i}")).collect();
        assert_eq!(ended, want);
        assert_eq!(s.calls.ended.count, 14);
        assert!(!bounds.exceeded(&s));
        assert!(decide(bounds, &s).is_empty());
    }

    #[test]
    fn the_bounds_forget_in_steps_of_about_the_step_and_end_where_one_forgetting_would() {
        let (mut stepped, mut at_once) = (State::default(), State::default());
        ended_calls(&mut stepped, 40);
        ended_calls(&mut at_once, 40);
        let bounds = by_count(16);
        hold(&mut at_once, bounds);
        let mut counts = vec![stepped.calls.ended.count];
        loop {
            let events = bounds.step(&stepped, 4);
            if events.is_empty() {
                break;
            }
            for e in events {
                apply(&mut stepped, 1_000, e);
            }
            counts.push(stepped.calls.ended.count);
            assert!(counts.len() <= 10, "steps never end: {counts:?}");
        }
        // One call ends a millisecond: 4 a step, down to the 14 kept.
        assert_eq!(counts, [40, 36, 32, 28, 24, 20, 16, 14]);
        assert_eq!(kept(&stepped), kept(&at_once));
        assert_eq!(stepped.calls.gone, at_once.calls.gone);
        assert!(bounds.step(&stepped, 4).is_empty());
        // Within the bound, past what is kept: a step goes on, a forgetting does not begin.
        let mut s = State::default();
        ended_calls(&mut s, 15);
        assert!(decide(bounds, &s).is_empty());
        assert_eq!(bounds.step(&s, 4).len(), 1);
    }

    #[test]
    fn a_call_the_bounds_forgot_stays_ended_until_its_age_passes() {
        use crate::calls::record_handed_out;
        use crate::state::calls::{decide_cancel, decide_finish, decide_start};
        use crate::state::{CallStatus, StartVerdict};
        let mut s = State::default();
        ended_calls(&mut s, 4);
        hold(&mut s, by_count(2));
        assert_eq!(kept(&s), ["c2", "c3"]);
        let gone = s.calls.gone("c0").copied();
        assert_eq!(
            gone.map(|g| (g.status, g.finished_at_ms)),
            Some((CallStatus::Cancelled, 100))
        );
        // Its message delivered again, or its id enqueued again: not recorded, not run.
        assert!(
            record_handed_out(&s, vec![CallSpec::for_test("c0")])
                .0
                .is_empty()
        );
        assert_eq!(
            decide_start(&s.calls, "c0", "r", 1_000).1,
            StartVerdict::Refused(crate::event::RejectReason::AlreadyFinal)
        );
        assert_eq!(
            decide_finish(
                &s.calls,
                "c0".into(),
                "r",
                Outcome::Success,
                None,
                String::new()
            ),
            None
        );
        assert_eq!(
            decide_cancel(&s.calls, "c0"),
            Err(Some(CallStatus::Cancelled))
        );
        assert_eq!(s.calls.status("c1"), Some(CallStatus::Cancelled));
        assert_eq!(s.calls.status("c9"), None);
        // The age's forgetting takes what is left of those it passes.
        assert!(s.calls.any_finished_before(101, &Default::default()));
        apply(
            &mut s,
            2_000,
            Event::CallsForgotten {
                finished_before_ms: 101,
                within: None,
                keep_gone: None,
            },
        );
        assert!(s.calls.gone("c0").is_none());
        assert!(s.calls.gone("c1").is_some());
        assert_eq!(kept(&s), ["c2", "c3"]);
    }

    #[test]
    fn what_is_left_of_forgotten_calls_is_bounded_too() {
        use crate::state::calls::GONE_PER_KEPT;
        let mut s = State::default();
        ended_calls(&mut s, 40);
        hold(&mut s, by_count(2));
        assert_eq!(kept(&s), ["c38", "c39"]);
        // 2 kept: what is left of the newest 16 forgotten stays.
        assert_eq!(s.calls.gone.len() as u64, 2 * GONE_PER_KEPT);
        assert!(s.calls.gone("c21").is_none());
        assert!((22..38).all(|i| s.calls.gone(&format!("c{i}")).is_some()));
    }

    #[test]
    fn an_age_forgetting_sooner_than_messages_age_keeps_the_recent_ones_known_by_id() {
        use crate::event::KeepGone;
        use crate::state::calls::{CallStatus, StartVerdict, decide_start};
        let mut s = State::default();
        ended_calls(&mut s, 10);
        apply(
            &mut s,
            105,
            Event::CallsAborted {
                ids: vec!["a1".into()],
            },
        );
        // The retention forgets c0..c7 (ended 100..107); those that ended since 103 may still
        // have messages read again, and at most 4 of them are kept known: c4..c7.
        let forget = |before, since, most| Event::CallsForgotten {
            finished_before_ms: before,
            within: None,
            keep_gone: Some(KeepGone {
                ended_since_ms: since,
                most,
            }),
        };
        apply(&mut s, 2_000, forget(108, 103, 4));
        assert_eq!(kept(&s), ["c8", "c9"]);
        assert!((0..4).all(|i| s.calls.gone(&format!("c{i}")).is_none()));
        assert!((4..8).all(|i| s.calls.gone(&format!("c{i}")).is_some()));
        assert_eq!(s.calls.status("c5"), Some(CallStatus::Cancelled));
        assert_eq!(
            decide_start(&s.calls, "c5", "r", 2_000).1,
            StartVerdict::Refused(crate::event::RejectReason::AlreadyFinal)
        );
        // The aborted put stays refused as long.
        assert!(s.calls.is_aborted("a1"));
        // A snapshot keeps them.
        let read = State::decode_snapshot(&s.encode_snapshot()).unwrap();
        assert_eq!(read.calls, s.calls);
        // A later forgetting drops what is left of those ended before its own horizon.
        apply(&mut s, 3_000, forget(110, 106, 100));
        assert!(kept(&s).is_empty());
        assert!((0..6).all(|i| s.calls.gone(&format!("c{i}")).is_none()));
        assert!((6..10).all(|i| s.calls.gone(&format!("c{i}")).is_some()));
        assert!(!s.calls.is_aborted("a1"));
        // One with no horizon (a retention as long as messages take to age) keeps none.
        apply(
            &mut s,
            4_000,
            Event::CallsForgotten {
                finished_before_ms: 110,
                within: None,
                keep_gone: None,
            },
        );
        assert!(s.calls.gone.is_empty());
    }

    #[test]
    fn past_the_bytes_the_oldest_ended_calls_go() {
        let mut s = State::default();
        ended_calls(&mut s, 10);
        let one = s.calls.get("c0").unwrap().held_bytes();
        assert!(one > 1_000, "a call's payload is counted: {one}");
        assert_eq!(s.calls.ended.bytes, 10 * one);
        // Room for four; a forgetting keeps 3.5 calls' worth: three.
        let bounds = RetentionBounds {
            count: 1_000,
            bytes: 4 * one,
        };
        hold(&mut s, bounds);
        assert_eq!(kept(&s), ["c7", "c8", "c9"]);
        assert_eq!(s.calls.ended.bytes, 3 * one);
    }

    #[test]
    fn calls_ended_in_one_millisecond_go_together_and_a_current_step_stays() {
        let mut s = State::default();
        ended_calls(&mut s, 6);
        // c0 is the current step of a running instance: it stays, whatever its age.
        apply(
            &mut s,
            200,
            Event::InstanceCreated {
                id: "i".into(),
                template: "f".into(),
                args: ByteBuf::new(),
            },
        );
        apply(
            &mut s,
            200,
            Event::InstanceStepped {
                id: "i".into(),
                function: "f".into(),
                call_id: "c0".into(),
            },
        );
        // Three more calls that end in the same millisecond.
        for i in 6..9 {
            apply(
                &mut s,
                300,
                Event::CallFinished {
                    id: format!("c{i}"),
                    runner: "r".into(),
                    outcome: Outcome::Success,
                    result: None,
                    log: String::new(),
                },
            );
        }
        assert_eq!(s.calls.ended.count, 9);
        // Keeping two would split the three that ended at 300: all three go, with every call
        // before them but c0.
        hold(&mut s, by_count(2));
        assert_eq!(kept(&s), ["c0"]);
        assert_eq!(s.calls.ended.count, 1);
        // The age passes over it as long as it is a current step, and takes it once the
        // instance has moved on.
        let steps = s.functions.current_step_calls();
        assert!(!s.calls.any_ended_before(200, &steps));
        apply(
            &mut s,
            400,
            Event::CallsForgotten {
                finished_before_ms: 200,
                within: None,
                keep_gone: None,
            },
        );
        assert_eq!(kept(&s), ["c0"]);
        apply(
            &mut s,
            500,
            Event::InstanceFinished {
                id: "i".into(),
                outcome: Outcome::Success,
                result: ByteBuf::new(),
            },
        );
        let steps = s.functions.current_step_calls();
        assert!(s.calls.any_ended_before(200, &steps));
        apply(
            &mut s,
            600,
            Event::CallsForgotten {
                finished_before_ms: 200,
                within: None,
                keep_gone: None,
            },
        );
        assert_eq!(kept(&s), [""; 0]);
        assert_eq!(s.calls.ended.count, 0);
    }

    #[test]
    fn over_the_bound_with_only_current_steps_ended_nothing_is_decided() {
        let mut s = State::default();
        ended_calls(&mut s, 2);
        for i in 0..2 {
            let id = format!("i{i}");
            apply(
                &mut s,
                200,
                Event::InstanceCreated {
                    id: id.clone(),
                    template: "f".into(),
                    args: ByteBuf::new(),
                },
            );
            apply(
                &mut s,
                200,
                Event::InstanceStepped {
                    id,
                    function: "f".into(),
                    call_id: format!("c{i}"),
                },
            );
        }
        let bounds = by_count(1);
        assert!(bounds.exceeded(&s));
        assert_eq!(decide(bounds, &s), []);
    }

    #[test]
    fn past_the_count_the_oldest_ended_instances_go() {
        let mut s = State::default();
        for i in 0..6u64 {
            let id = format!("i{i}");
            apply(
                &mut s,
                1,
                Event::InstanceCreated {
                    id: id.clone(),
                    template: "f".into(),
                    args: ByteBuf::from(vec![1; 100]),
                },
            );
            apply(
                &mut s,
                10 + i,
                Event::InstanceFinished {
                    id,
                    outcome: Outcome::Success,
                    result: ByteBuf::from(vec![2; 100]),
                },
            );
        }
        apply(
            &mut s,
            20,
            Event::InstanceCreated {
                id: "running".into(),
                template: "f".into(),
                args: ByteBuf::new(),
            },
        );
        assert_eq!(s.functions.ended.count, 6);
        let events = hold(&mut s, by_count(3));
        assert!(matches!(
            events.as_slice(),
            [Event::InstancesForgotten {
                finished_before_ms: 13,
                within: Some(Kept { count: 3, .. })
            }]
        ));
        let left: Vec<&str> = s.functions.instances.keys().map(String::as_str).collect();
        assert_eq!(left, ["i3", "i4", "i5", "running"]);
        assert_eq!(s.functions.ended.count, 3);
    }
}
