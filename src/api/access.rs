//! Who may use ebb's APIs.
//!
//! Each API (admin, dashboard, functions, runner) has a bearer token of its own, compared in
//! constant time; without one (and without `--kube-auth`) the API is disabled. On Kubernetes with
//! `--kube-auth`, a bearer token that is none of them is asked about instead: a `TokenReview` says
//! whose it is (a ServiceAccount's, or any user's the API server authenticates), and a
//! `SubjectAccessReview` whether RBAC lets that user do the request's verb on the API's resource
//! of group `api.ebb.dev` in ebb's own namespace:
//!
//! | API | resource | verbs |
//! |---|---|---|
//! | `/admin/*` | `admin` | `get` (GET), `update` (PUT), `delete` (DELETE) |
//! | `/ui/*` (the dashboard) | `dashboard` | `get` |
//! | `/api/funcs/*` | `functions` | `get`, `create` (POST), `update` (PUT), `delete` |
//! | `/runner/*`, `/v1/calls` | `runner` | `get`, `create` (POST); `/v1/calls` also takes `admin` |
//!
//! Both answers are kept for `--kube-auth-cache-seconds` (a grant or a revocation counts within
//! that), at most [`MAX_CACHED`] of each, and at most [`MAX_ASKING`] reviews are asked at once,
//! each within 5 s. The dashboard's token is `--dashboard-token`, else the admin token.
//! Every API is checked by one middleware ([`guard`]) before its handlers run, so a handler
//! cannot be reached without it.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use ebb_kube::reviews::{self, User};

use super::{ApiError, AppState};
use crate::clock::Stopwatch;

/// The RBAC group of ebb's APIs (no resource of it is served: RBAC names it only).
pub const GROUP: &str = "api.ebb.dev";
/// Answers of each kind (whose a token is; whether it may do a verb on an API) kept at most.
pub const MAX_CACHED: usize = 1_024;
/// Reviews asked of the API server at once, at most; the others wait.
pub const MAX_ASKING: usize = 16;
/// The longest bearer token asked about (ServiceAccount tokens are about a kilobyte).
pub const MAX_TOKEN_BYTES: usize = 8_192;
/// How long a request waits for its turn to ask, and then for the answer.
const ASK_WAIT: Duration = Duration::from_secs(5);
/// The cookie the dashboard's sign-in sets.
pub const COOKIE: &str = "ebb_session";

/// Dashboard sessions kept at most; beyond, the one nearest its end goes.
pub const MAX_SESSIONS: usize = 10_000;

/// How long a dashboard session lasts (its token is checked again on every request).
pub const SESSION_TTL: std::time::Duration = std::time::Duration::from_secs(8 * 3600);

/// The dashboard's sign-ins: a random id (the cookie) for the token it was signed in with,
/// kept in memory only, bounded ([`MAX_SESSIONS`]) and ending after [`SESSION_TTL`] or at
/// sign-out. The token never leaves the server again; a replica restarted forgets its sessions.
#[derive(Default)]
pub struct Sessions {
    by_id: std::sync::Mutex<HashMap<String, (String, Stopwatch)>>,
}

impl Sessions {
    /// A new session for `token`; returns its id.
    pub fn open(&self, token: &str) -> String {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).expect("the OS's randomness");
        let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let mut by_id = self.by_id.lock().expect("sessions lock");
        by_id.retain(|_, (_, at)| at.elapsed() < SESSION_TTL);
        if by_id.len() >= MAX_SESSIONS
            && let Some(oldest) = by_id
                .iter()
                .max_by_key(|(_, (_, at))| at.elapsed())
                .map(|(k, _)| k.clone())
        {
            by_id.remove(&oldest);
        }
        by_id.insert(id.clone(), (token.to_owned(), Stopwatch::start()));
        id
    }

    /// The token of live session `id`.
    pub fn token(&self, id: &str) -> Option<String> {
        let mut by_id = self.by_id.lock().expect("sessions lock");
        match by_id.get(id) {
            Some((token, at)) if at.elapsed() < SESSION_TTL => Some(token.clone()),
            Some(_) => {
                by_id.remove(id);
                None
            }
            None => None,
        }
    }

    /// Ends session `id`; whether it was live.
    pub fn close(&self, id: &str) -> bool {
        self.by_id
            .lock()
            .expect("sessions lock")
            .remove(id)
            .is_some()
    }
}

/// One of ebb's APIs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// `/admin/*`: routes and `explain`.
    Admin,
    /// `/ui/api/*`: the dashboard (read only).
    Dashboard,
    /// `/api/funcs/*`: templates and invocations.
    Functions,
    /// `/runner/*` and `/v1/calls`: the call queue.
    Runner,
}

impl Api {
    /// Its name, which is also its resource in RBAC.
    pub fn name(self) -> &'static str {
        match self {
            Api::Admin => "admin",
            Api::Dashboard => "dashboard",
            Api::Functions => "functions",
            Api::Runner => "runner",
        }
    }

    /// The error of a request to it when it is disabled.
    pub fn disabled(self) -> ApiError {
        let (code, how) = match self {
            Api::Admin => ("admin_disabled", "--admin-token or EBB_ADMIN_TOKEN"),
            Api::Dashboard => (
                "dashboard_disabled",
                "--dashboard-token or EBB_DASHBOARD_TOKEN (or --admin-token)",
            ),
            Api::Functions => ("functions_disabled", "--api-token or EBB_API_TOKEN"),
            Api::Runner => ("runner_disabled", "--runner-token or EBB_RUNNER_TOKEN"),
        };
        ApiError::new(
            StatusCode::FORBIDDEN,
            code,
            format!(
                "the {} API is disabled: start ebb with {how} (or --kube-auth on Kubernetes)",
                self.name()
            ),
        )
    }

    /// The RBAC verb of a request with `method`: the dashboard only reads.
    pub fn verb(self, method: &Method) -> &'static str {
        if self == Api::Dashboard {
            return "get";
        }
        match *method {
            Method::GET | Method::HEAD => "get",
            Method::PUT | Method::PATCH => "update",
            Method::DELETE => "delete",
            _ => "create",
        }
    }
}

/// The APIs' own bearer tokens (`None`: that API has none).
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    pub admin: Option<String>,
    /// None: the admin token signs in to the dashboard.
    pub dashboard: Option<String>,
    pub functions: Option<String>,
    pub runner: Option<String>,
}

/// The check of every request to an API.
pub struct Access {
    tokens: Tokens,
    kube: Option<KubeAccess>,
    /// The dashboard's sign-ins.
    pub sessions: Sessions,
    /// Whether the session cookie is `Secure` (ebb's endpoints are served over TLS).
    pub secure_cookies: bool,
}

impl Access {
    /// Static tokens, and Kubernetes' answers if `kube`.
    pub fn new(mut tokens: Tokens, kube: Option<KubeAccess>) -> Self {
        if tokens.dashboard.is_none() {
            tokens.dashboard = tokens.admin.clone();
        }
        Self {
            tokens,
            kube,
            sessions: Sessions::default(),
            secure_cookies: false,
        }
    }

    /// Marks the session cookie `Secure` (ebb's endpoints are served over TLS).
    pub fn with_secure_cookies(mut self, secure: bool) -> Self {
        self.secure_cookies = secure;
        self
    }

    /// The dashboard's credential in `headers`: the token of the session its cookie names, else
    /// its bearer token.
    pub fn dashboard_token(&self, headers: &HeaderMap) -> Option<String> {
        cookie(headers, COOKIE)
            .and_then(|id| self.sessions.token(id))
            .or_else(|| bearer(headers).map(str::to_owned))
    }

    /// Static tokens only.
    pub fn tokens(tokens: Tokens) -> Self {
        Self::new(tokens, None)
    }

    fn token(&self, api: Api) -> Option<&str> {
        match api {
            Api::Admin => self.tokens.admin.as_deref(),
            Api::Dashboard => self.tokens.dashboard.as_deref(),
            Api::Functions => self.tokens.functions.as_deref(),
            Api::Runner => self.tokens.runner.as_deref(),
        }
    }

    /// Whether anyone could be let in to `api`.
    pub fn enabled(&self, api: Api) -> bool {
        self.token(api).is_some() || self.kube.is_some()
    }

    /// Lets a request with bearer token `given` do `verb` on one of `apis` (the first is the one
    /// named in errors), or says why not: 403 `*_disabled` for an API no one may use, 401
    /// `unauthorized` for a missing or unknown token, 403 `forbidden` for a Kubernetes user RBAC
    /// does not allow, 503 `auth_unavailable` when Kubernetes cannot be asked.
    pub async fn check(
        &self,
        apis: &[Api],
        verb: &'static str,
        given: Option<&str>,
    ) -> Result<(), ApiError> {
        let given = given.unwrap_or("");
        let mut any = false;
        for &api in apis {
            if let Some(token) = self.token(api) {
                any = true;
                if super::token_matches(given, token) {
                    return Ok(());
                }
            }
        }
        match &self.kube {
            None if !any => Err(apis[0].disabled()),
            Some(kube) if !given.is_empty() => kube.check(apis, verb, given).await,
            _ => Err(unauthorized()),
        }
    }
}

fn unauthorized() -> ApiError {
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "missing or wrong bearer token",
    )
}

/// The bearer token of `headers`.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
}

/// The value of cookie `name` in `headers`.
pub fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// The middleware in front of an API's routes: the request goes on only if [`Access::check`]
/// lets it. The dashboard's token may come as its sign-in session's cookie (a browser's
/// `EventSource` cannot send headers).
pub async fn guard(
    State((app, apis)): State<(AppState, &'static [Api])>,
    req: Request,
    next: Next,
) -> Response {
    let headers = req.headers();
    let given = match apis.first() {
        Some(Api::Dashboard) => app.access.dashboard_token(headers),
        _ => bearer(headers).map(str::to_owned),
    };
    let verb = apis.first().map_or("get", |api| api.verb(req.method()));
    match app.access.check(apis, verb, given.as_deref()).await {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

/// Answers kept for a while, at most [`MAX_CACHED`].
struct Cache<K, V> {
    entries: HashMap<K, (Stopwatch, V)>,
}

impl<K: Eq + Hash, V: Clone> Cache<K, V> {
    fn new() -> Self {
        Self {
            entries: HashMap::new(),
        }
    }

    fn get(&self, key: &K, ttl: Duration) -> Option<V> {
        self.entries
            .get(key)
            .filter(|(at, _)| at.elapsed() < ttl)
            .map(|(_, v)| v.clone())
    }

    fn put(&mut self, key: K, value: V, ttl: Duration) {
        if self.entries.len() >= MAX_CACHED {
            self.entries.retain(|_, (at, _)| at.elapsed() < ttl);
            if self.entries.len() >= MAX_CACHED {
                self.entries.clear();
            }
        }
        self.entries.insert(key, (Stopwatch::start(), value));
    }
}

/// `--kube-auth`: how Kubernetes is asked about tokens.
#[derive(Debug, Clone)]
pub struct KubeAuthOptions {
    /// The audiences a token must be for (none: the API server's own).
    pub audiences: Vec<String>,
    /// How long an answer is kept.
    pub cache: Duration,
}

/// Bearer tokens checked by Kubernetes: `TokenReview` and `SubjectAccessReview`.
pub struct KubeAccess {
    client: kube::Client,
    namespace: String,
    audiences: Vec<String>,
    ttl: Duration,
    /// Token → its user (`None`: not authenticated).
    users: Mutex<Cache<String, Option<User>>>,
    /// (token, API, verb) → allowed.
    decisions: Mutex<Cache<(String, Api, &'static str), bool>>,
    asking: tokio::sync::Semaphore,
}

impl KubeAccess {
    /// Asks through `client` about ebb's APIs as resources in `namespace` (ebb's own); tokens
    /// must be for one of `audiences` (none: the API server's own); answers kept for `ttl`.
    pub fn new(
        client: kube::Client,
        namespace: String,
        audiences: Vec<String>,
        ttl: Duration,
    ) -> Self {
        Self {
            client,
            namespace,
            audiences,
            ttl,
            users: Mutex::new(Cache::new()),
            decisions: Mutex::new(Cache::new()),
            asking: tokio::sync::Semaphore::new(MAX_ASKING),
        }
    }

    async fn check(&self, apis: &[Api], verb: &'static str, token: &str) -> Result<(), ApiError> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(unauthorized());
        }
        let Some(user) = self.user(token).await? else {
            return Err(unauthorized());
        };
        for &api in apis {
            if self.allowed(token, &user, api, verb).await? {
                return Ok(());
            }
        }
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "user {:?} cannot {verb} resource {:?} in API group {GROUP:?} in the namespace {:?}",
                user.name,
                apis[0].name(),
                self.namespace
            ),
        ))
    }

    /// Whose `token` is, from a `TokenReview`.
    async fn user(&self, token: &str) -> Result<Option<User>, ApiError> {
        let known = lock(&self.users).get(&token.to_owned(), self.ttl);
        if let Some(user) = known {
            return Ok(user);
        }
        let user = self
            .ask(
                "TokenReview",
                reviews::user_of(&self.client, token, &self.audiences),
            )
            .await?;
        if let Some(u) = &user {
            tracing::debug!(user = %u.name, "a Kubernetes token was reviewed");
        }
        lock(&self.users).put(token.to_owned(), user.clone(), self.ttl);
        Ok(user)
    }

    /// Whether RBAC lets `user` do `verb` on `api`, from a `SubjectAccessReview`.
    async fn allowed(
        &self,
        token: &str,
        user: &User,
        api: Api,
        verb: &'static str,
    ) -> Result<bool, ApiError> {
        let key = (token.to_owned(), api, verb);
        let known = lock(&self.decisions).get(&key, self.ttl);
        if let Some(allowed) = known {
            return Ok(allowed);
        }
        let request = reviews::Request {
            group: GROUP,
            resource: api.name(),
            verb,
            namespace: &self.namespace,
        };
        let allowed = self
            .ask(
                "SubjectAccessReview",
                reviews::allowed(&self.client, user, request),
            )
            .await?;
        tracing::debug!(user = %user.name, api = api.name(), verb, allowed, "RBAC was asked");
        lock(&self.decisions).put(key, allowed, self.ttl);
        Ok(allowed)
    }

    /// One review, when it is its turn, within [`ASK_WAIT`] for the turn and for the answer.
    async fn ask<T>(
        &self,
        what: &str,
        request: impl std::future::Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, ApiError> {
        let unavailable = |why: String| ApiError {
            retry_after_s: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "auth_unavailable",
                format!("the token could not be checked with Kubernetes: {why}"),
            )
        };
        let Ok(Ok(_turn)) = tokio::time::timeout(ASK_WAIT, self.asking.acquire()).await else {
            return Err(unavailable(format!(
                "{MAX_ASKING} reviews are under way; none ended within {} s",
                ASK_WAIT.as_secs()
            )));
        };
        match tokio::time::timeout(ASK_WAIT, request).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "a {what} failed");
                Err(unavailable(format!("the {what} failed: {e}")))
            }
            Err(_) => Err(unavailable(format!(
                "no answer to the {what} within {} s",
                ASK_WAIT.as_secs()
            ))),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An API's routes behind [`guard`] for `apis`.
pub fn guarded(
    router: axum::Router<AppState>,
    app: &AppState,
    apis: &'static [Api],
) -> axum::Router<AppState> {
    router.route_layer(axum::middleware::from_fn_with_state(
        (app.clone(), apis),
        guard,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access() -> Access {
        Access::tokens(Tokens {
            admin: Some("admin-secret".into()),
            runner: Some("runner-secret".into()),
            ..Tokens::default()
        })
    }

    #[tokio::test]
    async fn each_token_opens_its_own_api_only() {
        let a = access();
        assert!(
            a.check(&[Api::Admin], "get", Some("admin-secret"))
                .await
                .is_ok()
        );
        let e = a.check(&[Api::Admin], "get", Some("runner-secret")).await;
        assert_eq!(e.unwrap_err().code, "unauthorized");
        let e = a.check(&[Api::Runner], "create", None).await;
        assert_eq!(e.unwrap_err().status, StatusCode::UNAUTHORIZED);
        // /v1/calls: the runner's or the admin's.
        let both = [Api::Runner, Api::Admin];
        assert!(a.check(&both, "get", Some("admin-secret")).await.is_ok());
        assert!(a.check(&both, "get", Some("runner-secret")).await.is_ok());
        // The dashboard takes the admin token when it has none of its own.
        assert!(
            a.check(&[Api::Dashboard], "get", Some("admin-secret"))
                .await
                .is_ok()
        );
        let e = a
            .check(&[Api::Functions], "get", Some("admin-secret"))
            .await;
        assert_eq!(e.unwrap_err().code, "functions_disabled");
        assert!(!a.enabled(Api::Functions));
    }

    #[test]
    fn verbs_follow_the_method_and_the_dashboard_only_reads() {
        assert_eq!(Api::Admin.verb(&Method::GET), "get");
        assert_eq!(Api::Admin.verb(&Method::PUT), "update");
        assert_eq!(Api::Admin.verb(&Method::DELETE), "delete");
        assert_eq!(Api::Runner.verb(&Method::POST), "create");
        assert_eq!(Api::Dashboard.verb(&Method::POST), "get");
    }

    #[test]
    fn the_cache_stays_bounded_and_forgets_after_its_time() {
        let mut c = Cache::new();
        let ttl = Duration::from_secs(60);
        for i in 0..(MAX_CACHED * 3) {
            c.put(i, i, ttl);
            assert!(c.entries.len() <= MAX_CACHED);
        }
        assert_eq!(c.get(&(MAX_CACHED * 3 - 1), ttl), Some(MAX_CACHED * 3 - 1));
        assert_eq!(c.get(&(MAX_CACHED * 3 - 1), Duration::ZERO), None);
    }
}
