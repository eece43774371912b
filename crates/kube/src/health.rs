//! Whether the API server can be reached, told once per change: one WARN when it goes, one INFO
//! when it is back. The Kubernetes client logs an ERROR for every request that fails while it is
//! away (the binary's log filter leaves those out, `kube_client::client::builder=off`); ebb's
//! watches retry quietly meanwhile and serve from what they know.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, watch};

/// How often the API server is asked for its version.
pub const EVERY: Duration = Duration::from_secs(2);

/// How long one ask may take.
const ASK_LIMIT: Duration = Duration::from_secs(2);

/// Asks the API server for its version every `every` until `stop`, and says when it stops
/// answering and when it answers again.
pub async fn watch(client: kube::Client, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut reachable = true;
    loop {
        let asked = tokio::time::timeout(ASK_LIMIT, client.apiserver_version()).await;
        let why = match asked {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!("no answer within {ASK_LIMIT:?}")),
        };
        match (&why, reachable) {
            (Some(why), true) => {
                tracing::warn!(error = %why, "the Kubernetes API server cannot be reached: ebb serves from what it knows and its watches retry");
                reachable = false;
            }
            (None, false) => {
                tracing::info!("the Kubernetes API server is reachable again");
                reachable = true;
            }
            _ => {}
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// What Kubernetes' RBAC refuses ebb to watch (HTTP 403), shared by the watches, `/readyz` and
/// the task that tells it as Events (`orchestrator::tell_refusals`). A refusal is not transient: the watch
/// asks again after a delay that doubles from [`FORBIDDEN_FIRST`] up to [`FORBIDDEN_MAX`], says
/// so once (a WARN, a Warning Event `Forbidden` on ebb's pod, a reason in `/readyz`), and once
/// allowed again says that once too (an INFO, a Normal Event `Allowed`).
#[derive(Clone, Default)]
pub struct Access {
    refused: Arc<std::sync::Mutex<BTreeMap<String, String>>>,
    changed: Arc<Notify>,
}

impl Access {
    /// Waits until what is refused changes.
    pub async fn changed(&self) {
        self.changed.notified().await
    }
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("refused", &self.refused())
            .finish()
    }
}

/// The first delay before a refused watch asks again.
pub const FORBIDDEN_FIRST: Duration = Duration::from_secs(2);
/// The longest delay before a refused watch asks again.
pub const FORBIDDEN_MAX: Duration = Duration::from_secs(300);

impl Access {
    /// What is refused now: the watch, and the API server's words.
    pub fn refused(&self) -> BTreeMap<String, String> {
        self.refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set(&self, what: &str, why: Option<String>) {
        let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        let changed = match why {
            Some(why) => refused.insert(what.to_owned(), why).is_none(),
            None => refused.remove(what).is_some(),
        };
        if changed {
            self.changed.notify_one();
        }
    }

    /// The guard of one watch, named for people (`Func resources in namespace fns`).
    pub fn watch(&self, what: impl Into<String>) -> Guard {
        Guard {
            what: what.into(),
            access: self.clone(),
            delay: Duration::ZERO,
        }
    }
}

/// One watch's refusals: see [`Access`].
#[derive(Debug)]
pub struct Guard {
    what: String,
    access: Access,
    delay: Duration,
}

/// The API server's words when `e` is a refusal (HTTP 403).
pub fn forbidden(e: &kube::runtime::watcher::Error) -> Option<String> {
    use kube::runtime::watcher::Error as W;
    match e {
        W::InitialListFailed(kube::Error::Api(s))
        | W::WatchStartFailed(kube::Error::Api(s))
        | W::WatchFailed(kube::Error::Api(s))
            if s.code == 403 =>
        {
            Some(s.message.clone())
        }
        W::WatchError(s) if s.code == 403 => Some(s.message.clone()),
        _ => None,
    }
}

impl Guard {
    /// The watch, as named for people.
    pub fn what(&self) -> &str {
        &self.what
    }

    /// Takes an item of the watch: `Some(delay)` when it is a refusal, to wait before polling the
    /// watch again (the watch asks again when polled). A (re)list starting (`Init`) says nothing
    /// yet; what it lists, or a change, says the watch is allowed.
    pub fn saw<K>(
        &mut self,
        item: &Result<kube::runtime::watcher::Event<K>, kube::runtime::watcher::Error>,
    ) -> Option<Duration> {
        match item {
            Ok(kube::runtime::watcher::Event::Init) => None,
            Ok(_) => {
                self.allowed();
                None
            }
            Err(e) => forbidden(e).map(|why| self.refused(why)),
        }
    }

    /// The watch was refused: the delay before it asks again.
    pub fn refused(&mut self, why: String) -> Duration {
        self.delay = next_delay(self.delay);
        if !self.access.refused().contains_key(&self.what) {
            tracing::warn!(watch = %self.what, error = %why, retry_in = ?self.delay, "Kubernetes refuses ebb this watch (RBAC): ebb goes on without it and asks again, less and less often (at most every {} s)", FORBIDDEN_MAX.as_secs());
        }
        self.access.set(&self.what, Some(why));
        self.delay
    }

    /// The watch works.
    pub fn allowed(&mut self) {
        self.delay = Duration::ZERO;
        if self.access.refused().contains_key(&self.what) {
            tracing::info!(watch = %self.what, "Kubernetes allows ebb this watch again");
            self.access.set(&self.what, None);
        }
    }
}

impl Drop for Guard {
    /// A watch that stops (its kind no longer needed) is no longer refused.
    fn drop(&mut self) {
        self.access.set(&self.what, None);
    }
}

/// Waits `delay` (a refusal's) unless `stop` changes first; false when it did.
pub async fn pause(delay: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        _ = stop.changed() => false,
        () = tokio::time::sleep(delay) => true,
    }
}

/// The delay after `last`: [`FORBIDDEN_FIRST`], then twice the last, at most [`FORBIDDEN_MAX`].
pub fn next_delay(last: Duration) -> Duration {
    if last.is_zero() {
        FORBIDDEN_FIRST
    } else {
        (last * 2).min(FORBIDDEN_MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_watch_asks_again_less_and_less_often_up_to_minutes() {
        let mut delays = Vec::new();
        let mut d = Duration::ZERO;
        for _ in 0..12 {
            d = next_delay(d);
            delays.push(d.as_secs());
        }
        assert_eq!(delays, [2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300, 300]);
    }

    #[test]
    fn a_refusal_is_kept_until_the_watch_works_or_stops() {
        let access = Access::default();
        let mut g = access.watch("Func resources in namespace fns");
        let refusal: Result<kube::runtime::watcher::Event<()>, _> = Err(
            kube::runtime::watcher::Error::InitialListFailed(kube::Error::Api(Box::new(
                kube::core::Status::failure("no", "Forbidden").with_code(403),
            ))),
        );
        assert_eq!(g.saw(&refusal), Some(FORBIDDEN_FIRST));
        assert_eq!(g.saw(&refusal), Some(FORBIDDEN_FIRST * 2));
        assert_eq!(access.refused().len(), 1);
        // Another failure (the API server away) is not a refusal: kube's own backoff.
        let away: Result<kube::runtime::watcher::Event<()>, _> =
            Err(kube::runtime::watcher::Error::NoResourceVersion);
        assert_eq!(g.saw(&away), None);
        // A relist starting says nothing yet; what it lists does.
        assert_eq!(g.saw(&Ok(kube::runtime::watcher::Event::<()>::Init)), None);
        assert_eq!(access.refused().len(), 1);
        assert_eq!(
            g.saw(&Ok(kube::runtime::watcher::Event::<()>::InitDone)),
            None
        );
        assert!(access.refused().is_empty());
        assert_eq!(
            g.saw(&refusal),
            Some(FORBIDDEN_FIRST),
            "the delay starts over"
        );
        drop(g);
        assert!(access.refused().is_empty());
    }
}
