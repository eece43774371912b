//! Several ebb replicas: who owns a call or a function instance, and how a replica reaches the
//! owner.
//!
//! **One authority per call and per instance.** The replica that accepts an enqueue or an
//! invocation owns the call or instance, and its id says so: `OWNER.UUID` (`ebb-1.0193…`), where
//! `OWNER` is the replica's name (`--replica`: on Kubernetes the StatefulSet pod's name, whose
//! stable identity and volume keep the owner unique and durable across restarts). Only the owner
//! decides a start, a finish, a cancel or a step, from its own log; every other replica forwards
//! those to it and answers with the owner's answer. While the owner is down nobody decides for its
//! calls: the answer is 503 with `Retry-After`. An id without an owner (one machine, no
//! `--replica`) is this replica's.
//!
//! The owner is found by name through discovery ([`crate::discovery`]): a static map of service
//! ids (`--peer NAME=ID`), or on Kubernetes the headless Service's EndpointSlices, watched
//! (`k8s://NAME.SERVICE.NAMESPACE:PORT`: the endpoint whose hostname, or pod, is the owner).
//! A forwarded request carries `X-Ebb-Forwarded-By`, and a replica never forwards a request that
//! carries it (a misdirected one is refused), so forwarding never loops.
//!
//! [`Peers::send`] forwards a request to an owner, picked through [`crate::discovery::Balanced`]
//! (a connection that fails is tried once more if the owner's endpoints change within
//! `RESOLVE_WAIT`). `api::through_owner` answers any request about an id through its owner (the
//! owner's status, content type and body): 503 `owner_unavailable` with `Retry-After` when it
//! cannot be reached, 421 when a forwarded request names another owner.
//!
//! The design: the StatefulSet's stable pod names and volumes make an owner unique and durable,
//! so no consensus beyond Kubernetes' and Kafka's is needed; the cost is that an owner's calls
//! wait while it is down (Kafka keeps their messages; nothing is decided for them).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::discovery::{Balanced, Policy, ServiceId};
use ebb_core::calls::wire::{Format, Negotiated};

use axum::http;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub use ebb_core::ids::{
    FORWARDED_BY, PeerError, RETRY_AFTER_S, decides_here, id_of, owner_of, parse_id, qualify,
    uuid_part, valid_replica,
};

/// The bearer token a replica presents when it forwards a request to another.
#[derive(Debug)]
pub enum PeerToken {
    /// None: the others' APIs are open.
    None,
    /// The runner token, which every replica shares.
    Static(String),
    /// A file read again whenever it changes (a projected ServiceAccount token, which
    /// Kubernetes rotates): the others check it with a TokenReview.
    File {
        path: std::path::PathBuf,
        /// The token read, with the file's modification time then.
        read: std::sync::Mutex<Option<(std::time::SystemTime, String)>>,
    },
}

impl PeerToken {
    /// A token read from `path`.
    pub fn file(path: std::path::PathBuf) -> Self {
        PeerToken::File {
            path,
            read: std::sync::Mutex::new(None),
        }
    }

    /// The token to present now (`None` when there is none, or the file cannot be read: the
    /// owner then answers 401, logged by the caller).
    pub fn get(&self) -> Option<String> {
        match self {
            PeerToken::None => None,
            PeerToken::Static(t) => Some(t.clone()),
            PeerToken::File { path, read } => {
                let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok()?;
                let mut read = read.lock().expect("peer token lock");
                if let Some((at, token)) = read.as_ref()
                    && *at == modified
                {
                    return Some(token.clone());
                }
                match std::fs::read_to_string(path) {
                    Ok(t) => {
                        let token = t.trim().to_owned();
                        *read = Some((modified, token.clone()));
                        Some(token)
                    }
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "the peer token file cannot be read");
                        None
                    }
                }
            }
        }
    }
}

/// How replicas are found by name: each replica is a service, resolved and watched through
/// discovery.
#[derive(Debug, Clone)]
pub enum Resolver {
    /// A service id by replica name (`--peer NAME=ID`: `http://host:port`, a DNS name, a
    /// `k8s://` id).
    Static(HashMap<String, ServiceId>),
    /// The endpoints of a headless Service (`k8s://SERVICE.NAMESPACE[:PORT]`): replica `NAME` is
    /// `k8s://NAME.SERVICE.NAMESPACE[:PORT]`, its endpoint whose hostname or pod is `NAME`.
    Kubernetes(ServiceId),
}

impl Resolver {
    /// The service of replica `name` (a replica name, checked).
    fn id(&self, name: &str) -> Result<ServiceId, PeerError> {
        match self {
            Resolver::Static(map) => map
                .get(name)
                .cloned()
                .ok_or_else(|| PeerError::Unknown(name.to_owned())),
            Resolver::Kubernetes(service) => {
                ServiceId::parse(&format!("k8s://{name}.{}", service.authority()))
                    .map_err(|e| PeerError::Unknown(format!("{name} ({e})")))
            }
        }
    }
}

/// How long a forwarded request may take, connection included.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a replica's service may take to resolve the first time, and how long a failed
/// connection waits for its instances to change (the owner moved) before it is tried again.
const RESOLVE_WAIT: Duration = Duration::from_secs(2);

/// An answer from a peer.
#[derive(Debug, Clone)]
pub struct PeerAnswer {
    pub status: u16,
    pub content_type: Option<String>,
    pub body: Bytes,
}

/// This replica's name and the way to the others.
pub struct Peers {
    me: Option<String>,
    resolver: Resolver,
    balanced: Arc<Balanced>,
    policy: Policy,
    client: Client<HttpConnector, Full<Bytes>>,
    /// The bodies' format ([`Negotiated`]: MessagePack while the replicas read it).
    format: Negotiated,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers").field("me", &self.me).finish()
    }
}

impl Peers {
    /// This replica (`me`, `None` on one machine) and how to find the others: `resolver`
    /// names their services, `balanced` resolves them (its cache resolves the schemes they use).
    pub fn new(me: Option<String>, resolver: Resolver, balanced: Arc<Balanced>) -> Self {
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(Duration::from_secs(1)));
        http.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(http);
        Self {
            me,
            resolver,
            balanced,
            policy: Policy::default(),
            client,
            format: Negotiated::default(),
        }
    }

    /// One replica alone: every id is its own.
    pub fn alone() -> Self {
        Self::with_static(None, HashMap::new())
    }

    /// Replica `me` with the others at fixed service ids, resolved by DNS.
    pub fn with_static(me: Option<String>, others: HashMap<String, ServiceId>) -> Self {
        Self::new(me, Resolver::Static(others), Arc::new(Balanced::dns_only()))
    }

    /// This replica's name.
    pub fn me(&self) -> Option<&str> {
        self.me.as_deref()
    }

    /// A new id owned by this replica.
    pub fn new_id(&self) -> String {
        id_of(self.me(), uuid::Uuid::now_v7())
    }

    /// The replica that owns `id` when it is not this one.
    pub fn other_owner<'a>(&self, id: &'a str) -> Option<&'a str> {
        if decides_here(self.me(), id) {
            None
        } else {
            owner_of(id)
        }
    }

    /// Sends a request to replica `owner` and returns its answer. `headers` are sent as given
    /// (the caller's authorization among them), with [`FORWARDED_BY`] added.
    pub async fn send(
        &self,
        owner: &str,
        method: http::Method,
        path_and_query: &str,
        headers: &[(http::HeaderName, http::HeaderValue)],
        body: Bytes,
    ) -> Result<PeerAnswer, PeerError> {
        let id = self.resolver.id(owner)?;
        let unavailable = |e: String| PeerError::Unavailable(owner.to_owned(), e);
        let watched = self
            .balanced
            .watch(&id)
            .map_err(|e| unavailable(e.to_string()))?;
        let mut last = String::new();
        // A failed connection is tried again once the owner's instances changed (it moved).
        for attempt in 0..2 {
            let generation = watched.generation();
            let chosen = self
                .balanced
                .pick_from(&watched, &self.policy, None, RESOLVE_WAIT)
                .await
                .map_err(|e| unavailable(e.to_string()))?;
            let mut req = http::Request::builder()
                .method(method.clone())
                .uri(format!("http://{}{path_and_query}", chosen.addr()));
            for (k, v) in headers {
                req = req.header(k, v);
            }
            req = req.header(FORWARDED_BY, self.me().unwrap_or(""));
            let req = req
                .body(Full::new(body.clone()))
                .map_err(|e| unavailable(e.to_string()))?;
            let answer = tokio::time::timeout(FORWARD_TIMEOUT, async {
                let resp = self.client.request(req).await.map_err(|e| e.to_string())?;
                let status = resp.status().as_u16();
                let content_type = resp
                    .headers()
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                Ok::<_, String>(PeerAnswer {
                    status,
                    content_type,
                    body,
                })
            })
            .await;
            match answer {
                Ok(Ok(a)) => {
                    chosen.answered(a.status >= 500);
                    return Ok(a);
                }
                Ok(Err(e)) => {
                    chosen.failed();
                    last = e;
                }
                Err(_) => {
                    chosen.failed();
                    return Err(unavailable(format!(
                        "no answer in {} s",
                        FORWARD_TIMEOUT.as_secs()
                    )));
                }
            }
            let mut changes = watched.changes();
            let moved = tokio::time::timeout(
                RESOLVE_WAIT,
                changes.wait_for(|r| r.generation != generation),
            )
            .await;
            if attempt > 0 || !matches!(moved, Ok(Ok(_))) {
                break;
            }
        }
        Err(unavailable(last))
    }

    /// Sends a body to `owner` and decodes its answer, both MessagePack (JSON with a replica
    /// that does not read it: [`Negotiated`]); a non-2xx answer is returned as
    /// `Err(Ok((status, body)))`.
    pub async fn post<T: serde::de::DeserializeOwned>(
        &self,
        owner: &str,
        path: &str,
        token: Option<&str>,
        body: &impl serde::Serialize,
    ) -> Result<Result<T, (u16, String)>, PeerError> {
        let a = self
            .format
            .exchange(
                body,
                |format, encoded| {
                    let media = http::HeaderValue::from_static(format.media_type());
                    let mut headers = vec![
                        (http::header::CONTENT_TYPE, media.clone()),
                        (http::header::ACCEPT, media),
                    ];
                    if let Some(t) = token
                        && let Ok(v) = http::HeaderValue::from_str(&format!("Bearer {t}"))
                    {
                        headers.push((http::header::AUTHORIZATION, v));
                    }
                    async move {
                        self.send(owner, http::Method::POST, path, &headers, encoded.into())
                            .await
                    }
                },
                |a: &PeerAnswer| (a.status, &a.body[..]),
            )
            .await?;
        if !(200..300).contains(&a.status) {
            return Ok(Err((
                a.status,
                String::from_utf8_lossy(&a.body).into_owned(),
            )));
        }
        let format = Format::of_content_type(a.content_type.as_deref().map(str::as_bytes));
        Ok(format.decode(&a.body).map_err(|e| {
            (
                a.status,
                format!("an answer that is not the expected {format:?}: {e}"),
            )
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A projected ServiceAccount token rotates: the file is read again when it changes.
    #[test]
    fn a_peer_token_file_is_read_again_when_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let token = PeerToken::file(path.clone());
        assert_eq!(token.get(), None, "no file yet");
        std::fs::write(&path, "first\n").unwrap();
        assert_eq!(token.get().as_deref(), Some("first"));
        // Rotated as the kubelet does: a new file in its place.
        let next = dir.path().join("token.new");
        std::fs::write(&next, "second").unwrap();
        let later = std::fs::metadata(&path).unwrap().modified().unwrap()
            + std::time::Duration::from_secs(1);
        std::fs::File::options()
            .write(true)
            .open(&next)
            .unwrap()
            .set_modified(later)
            .unwrap();
        std::fs::rename(&next, &path).unwrap();
        assert_eq!(token.get().as_deref(), Some("second"));
        assert_eq!(PeerToken::Static("s".into()).get().as_deref(), Some("s"));
        assert_eq!(PeerToken::None.get(), None);
    }

    #[test]
    fn ids_name_their_owner() {
        let u = "0193aa8e-7c1a-7b3e-9d2f-0123456789ab";
        assert_eq!(parse_id(u).unwrap().0, None);
        let id = qualify(Some("ebb-1"), u);
        assert_eq!(id, format!("ebb-1.{u}"));
        assert_eq!(parse_id(&id).unwrap().0, Some("ebb-1"));
        assert_eq!(uuid_part(&id), u);
        for bad in [
            "nope",
            "ebb-1.nope",
            &format!("Ebb.{u}"),
            &format!(".{u}"),
            &format!("-a.{u}"),
            &format!("a_b.{u}"),
        ] {
            assert!(parse_id(bad).is_err(), "{bad}");
        }
        let me = Peers::with_static(Some("ebb-0".into()), HashMap::new());
        assert_eq!(me.other_owner(&id), Some("ebb-1"));
        assert_eq!(me.other_owner(&qualify(Some("ebb-0"), u)), None);
        assert_eq!(me.other_owner(u), None);
        assert!(me.new_id().starts_with("ebb-0."));
        assert!(parse_id(&me.new_id()).is_ok());
    }
}
