//! Whether the API server can be reached, told once per change: one WARN when it goes, one INFO
//! when it is back. The Kubernetes client logs an ERROR for every request that fails while it is
//! away (the binary's log filter leaves those out, `kube_client::client::builder=off`); ebb's
//! watches retry quietly meanwhile and serve from what they know.

use std::time::Duration;

use tokio::sync::watch;

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
