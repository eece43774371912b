//! Scaling on load with several ebb replicas in front of the same workloads (Kubernetes): each
//! replica sees only its share of a route's traffic, and one decides on the sum.
//!
//! * **Every replica samples** its own traffic each second (`proxy::load::LoadScaler::poll`).
//! * **The others report to the lease holder**: each second a replica that does not hold the
//!   scale-down lease posts its shares (`POST /runner/load`, with the peer token, to the holder
//!   found by name through [`crate::peers`]). One report is under way at a time, with the
//!   peers' timeout; a report that fails is not sent again: the next second's replaces it.
//! * **The holder decides on the sum**: its own sample plus the newest share of each replica
//!   that reported within `STALE_MS` (3 s): a replica that stops reporting (gone, cut off) is
//!   dropped then, never counted forever. So the figures the holder decides on are at most one
//!   sample period plus a report's way old for the others' traffic.
//! * **A new holder starts humble**: until it has a whole stable window of the sum it never asks
//!   for fewer replicas than were asked before it (`LoadScaler::decide`), so a takeover under
//!   load makes no burst of scale-downs from a window that holds only its own share.
//!
//! * **A scale-down keeps the busy pods**: a report also names the replicas with requests under
//!   way through its sender, and the holder's orchestrator weighs each ready pod by its requests
//!   through every replica before it writes a lower count (`pod-deletion-cost`).
//!
//! The count is written through the orchestrator (the Deployment's `/scale`); the other replicas
//! record it as a peer's change, as for every scaling.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

use crate::clock::Clock;
use crate::log::Log;
use crate::orchestrator::Orchestrator;
use crate::peers::{PeerToken, Peers};
use crate::proxy::Traffic;
use crate::proxy::load::{LoadScaler, run_with};

/// Who this replica is among the others, and how it reaches the holder.
pub struct Shared {
    /// Whether this replica holds the lease now.
    pub leading: Arc<AtomicBool>,
    /// The holder as last read.
    pub holder: Arc<std::sync::RwLock<Option<String>>>,
    /// The way to the others, and the token to present.
    pub peers: Arc<Peers>,
    pub token: PeerToken,
    /// The last kind of failure told (a refusal's status, or `unreachable`): each is told once,
    /// and the recovery once.
    pub told: std::sync::Mutex<Option<String>>,
    /// The replicas with requests under way through this ebb, and how many (reported with the
    /// shares: the holder keeps them in a scale-down).
    pub busy: Arc<dyn Fn() -> std::collections::BTreeMap<std::net::SocketAddr, u32> + Send + Sync>,
}

/// The loop of one replica among several: samples every `POLL_MS`; each second decides on the
/// sum while holding the lease, else reports its shares to the holder.
pub async fn run_shared(
    scaler: Arc<LoadScaler>,
    log: Arc<Log>,
    orch: Arc<dyn Orchestrator>,
    traffic: Arc<Traffic>,
    clock: Arc<dyn Clock>,
    shared: Shared,
    stop: watch::Receiver<bool>,
) {
    let shared = Arc::new(shared);
    let sending = Arc::new(AtomicBool::new(false));
    let mut was_leading = false;
    let decides = move |scaler: &LoadScaler, traffic: &Traffic| {
        let leading = shared.leading.load(Ordering::Relaxed);
        if leading != was_leading {
            // Taking over, or handing over: what was decided before is not this window's.
            scaler.reset_all();
            was_leading = leading;
        }
        if !leading {
            report(scaler, traffic, &shared, &sending);
        }
        leading
    };
    run_with(scaler, log, orch, traffic, clock, stop, decides).await;
}

/// Posts this replica's shares to the holder, unless a report is still under way or there is no
/// holder other than this replica.
fn report(scaler: &LoadScaler, traffic: &Traffic, shared: &Arc<Shared>, sending: &Arc<AtomicBool>) {
    let Some(me) = shared.peers.me().map(str::to_owned) else {
        return;
    };
    let holder = shared
        .holder
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let Some(holder) = holder.clone().filter(|h| *h != me) else {
        tracing::debug!(?holder, %me, "no other lease holder to report load to");
        return;
    };
    let shares = scaler.shares(traffic);
    if shares.is_empty() || sending.swap(true, Ordering::AcqRel) {
        return;
    }
    let body = serde_json::json!({ "replica": me, "shares": shares, "busy": (shared.busy)() });
    let (shared, sending) = (shared.clone(), sending.clone());
    tokio::spawn(async move {
        let token = shared.token.get();
        let sent = shared
            .peers
            .post::<serde_json::Value>(&holder, "/runner/load", token.as_deref(), &body)
            .await;
        let failure = match sent {
            Ok(Ok(_)) => None,
            Ok(Err((status, body))) => {
                Some((status.to_string(), format!("refused with {status}: {body}")))
            }
            Err(e) => Some(("unreachable".to_owned(), e.to_string())),
        };
        let mut told = shared.told.lock().unwrap_or_else(|e| e.into_inner());
        match failure {
            None if told.is_some() => {
                tracing::info!(%holder, "load reports reach the lease holder again");
                *told = None;
            }
            None => {}
            Some((kind, why)) if told.as_deref() != Some(kind.as_str()) => {
                tracing::warn!(%holder, %why, "the lease holder does not take this replica's load reports: its traffic is not counted while this lasts");
                *told = Some(kind);
            }
            Some((_, why)) => tracing::debug!(%holder, %why, "load report not taken"),
        }
        drop(told);
        sending.store(false, Ordering::Release);
    });
}
