//! Deliberately broken variants of ebb's decisions, to prove that the simulator finds what they
//! break (`ebb simulate --mutation NAME`, and `tests/simulation.rs`).
//!
//! A mutation is switched on for the current thread only, by [`with`]. Only the simulator, which
//! runs a seed on one thread, does that; nothing else in ebb ever switches one on, so every check
//! of [`active`] outside a simulation is false.
//!
//! The ten ([`Mutation::ALL`]): `downscale-without-cas`, `start-without-condition`,
//! `finish-not-idempotent`, `no-retry-on-stopping`, `decide-for-others`, `hand-out-unknown`,
//! `refuse-unknown-copy`, `idle-ignores-warm`, `load-ignores-held` and `scale-down-in-panic`. Each is checked inside the production decision it breaks, and
//! `tests/simulation.rs` asserts that each is found as a violation of the invariant it breaks
//! (`ebb simulate --mutation` is hidden).

use std::cell::Cell;

/// A broken variant of one decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mutation {
    /// The leader scales a deployment down without the `resourceVersion` precondition, so a
    /// last-used bump that landed after its read does not stop it.
    DownscaleWithoutCas,
    /// `decide_start` accepts a start for a call already running.
    StartWithoutCondition,
    /// `decide_finish` records every finish, not only the first.
    FinishNotIdempotent,
    /// The proxy does not retry a request whose backend refused it (a stopping replica).
    NoRetryOnStopping,
    /// A replica decides starts and finishes of calls another replica owns from its own log,
    /// instead of forwarding them to the owner.
    DecideForOthers,
    /// A replica hands out another replica's message at once when its owner does not know the
    /// call yet (put, not yet recorded), instead of holding it back a moment: the owner refuses
    /// the start as unknown and the message is deleted before the call is recorded as queued.
    /// The owner then puts the message again when it records the call, so this costs refused
    /// starts, not calls (`tests/simulation.rs` checks that it holds).
    HandOutUnknown,
    /// An owner asked to start a call it does not know yet ignores the copy of the call the
    /// forwarding replica handed out past the hold-back bound, refuses the start as unknown
    /// and forgets it did: the message is deleted, and the owner, stalled between its put and
    /// its record, then records a call that no runner can ever get.
    RefuseUnknownCopy,
    /// The idle scale-down keeps only the idle floor, not the replicas of the keep-warm windows
    /// open now.
    IdleIgnoresWarm,
    /// Scaling on load ignores the requests held for a replica: no demand from them, and no
    /// floor from the requests in flight (Knative's rule, where the averages alone decide).
    LoadIgnoresHeld,
    /// Scaling on load forgets the most it asked for in a panic, so the count follows the panic
    /// window down while still panicking.
    ScaleDownInPanic,
}

impl Mutation {
    /// Every mutation.
    pub const ALL: [Mutation; 10] = [
        Mutation::DownscaleWithoutCas,
        Mutation::StartWithoutCondition,
        Mutation::FinishNotIdempotent,
        Mutation::NoRetryOnStopping,
        Mutation::DecideForOthers,
        Mutation::HandOutUnknown,
        Mutation::RefuseUnknownCopy,
        Mutation::IdleIgnoresWarm,
        Mutation::LoadIgnoresHeld,
        Mutation::ScaleDownInPanic,
    ];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mutation::DownscaleWithoutCas => "downscale-without-cas",
            Mutation::StartWithoutCondition => "start-without-condition",
            Mutation::FinishNotIdempotent => "finish-not-idempotent",
            Mutation::NoRetryOnStopping => "no-retry-on-stopping",
            Mutation::DecideForOthers => "decide-for-others",
            Mutation::HandOutUnknown => "hand-out-unknown",
            Mutation::RefuseUnknownCopy => "refuse-unknown-copy",
            Mutation::IdleIgnoresWarm => "idle-ignores-warm",
            Mutation::LoadIgnoresHeld => "load-ignores-held",
            Mutation::ScaleDownInPanic => "scale-down-in-panic",
        }
    }

    /// The mutation named `name`.
    pub fn parse(name: &str) -> Option<Mutation> {
        Mutation::ALL.into_iter().find(|m| m.name() == name)
    }
}

thread_local! {
    static ACTIVE: Cell<Option<Mutation>> = const { Cell::new(None) };
}

/// Whether `m` is switched on for this thread.
pub fn active(m: Mutation) -> bool {
    ACTIVE.with(|a| a.get() == Some(m))
}

/// Runs `f` with `m` switched on for this thread (none for `None`), then switches it off.
pub fn with<R>(m: Option<Mutation>, f: impl FnOnce() -> R) -> R {
    struct Reset(Option<Mutation>);
    impl Drop for Reset {
        fn drop(&mut self) {
            ACTIVE.with(|a| a.set(self.0));
        }
    }
    let _reset = Reset(ACTIVE.with(|a| a.replace(m)));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mutation_is_on_only_inside_with_and_only_on_its_thread() {
        assert!(!active(Mutation::FinishNotIdempotent));
        with(Some(Mutation::FinishNotIdempotent), || {
            assert!(active(Mutation::FinishNotIdempotent));
            assert!(!active(Mutation::StartWithoutCondition));
            let other = std::thread::spawn(|| active(Mutation::FinishNotIdempotent));
            assert!(!other.join().unwrap());
        });
        assert!(!active(Mutation::FinishNotIdempotent));
        for m in Mutation::ALL {
            assert_eq!(Mutation::parse(m.name()), Some(m));
        }
    }
}
