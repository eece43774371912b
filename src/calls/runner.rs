//! The runner: dequeues calls, starts them (only a start the API accepts runs), executes them
//! with bounded concurrency and reports each finish. The same loop runs inside `ebb serve` (the
//! built-in runner, calling the service in process) and as `ebb runner --api URL --token T`
//! (over HTTP).
//!
//! The loop dequeues up to its free capacity (while one of its starts is under way, once that is
//! a quarter of its batch), starts the batch (while asking for more), runs each accepted call
//! with a bounded [`Executor`] and reports finishes in batches with bounded retries.
//! [`ProxyExecutor`] runs a call through ebb's proxy or, for a function served elsewhere, sends
//! it to the instance of its `serviceAddress` that its traffic policy picks
//! (through [`crate::discovery::Balanced`]); [`NoopExecutor`] is for benchmarks. [`RunnerApi`]
//! has an in-process face and an HTTP one ([`HttpApi`]: `--api` a service id, the replica picked
//! by consistent hashing on the runner's id, so a runner stays on one replica while it is there).
//! The hidden `--fault kill-after-dequeue|kill-after-start` ([`Fault`]) makes `ebb runner`
//! SIGKILL itself there, for the fault tests.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{Semaphore, mpsc, watch};

use super::wire::{FinishBatchRef, Format, JobJson, Negotiated};
use super::{Calls, Finish, Job, Load, Started};
use crate::discovery::{Balanced, Chosen, Policy, ServiceId};
use crate::event::{CallResult, Outcome};

/// Why a runner API request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerError {
    /// The HTTP status of a refusal (`None`: the request did not get an answer).
    pub status: Option<u16>,
    pub message: String,
}

impl RunnerError {
    fn other(message: impl std::fmt::Display) -> Self {
        Self {
            status: None,
            message: message.to_string(),
        }
    }

    /// The request itself was refused (4xx): sending it again gets the same answer.
    pub fn is_refusal(&self) -> bool {
        self.status.is_some_and(|s| (400..500).contains(&s))
    }
}

impl From<super::wire::Unencodable> for RunnerError {
    fn from(e: super::wire::Unencodable) -> Self {
        Self::other(e)
    }
}

impl std::fmt::Display for RunnerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.status {
            Some(s) => write!(f, "{s}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl From<super::CallError> for RunnerError {
    fn from(e: super::CallError) -> Self {
        use super::CallError;
        let status = match &e {
            CallError::Bad(_) => Some(400),
            CallError::TooLarge(_) => Some(413),
            CallError::TargetFull(_) => Some(503),
            CallError::UnknownTarget(_) => Some(404),
            CallError::Peer(crate::peers::PeerError::Unknown(_)) => Some(404),
            CallError::Peer(crate::peers::PeerError::Misdirected(..)) => Some(421),
            CallError::Queue(_) | CallError::Log(_) | CallError::Peer(_) => None,
        };
        Self {
            status,
            message: e.to_string(),
        }
    }
}

/// A future a runner waits on.
pub type RunnerFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, RunnerError>> + Send + 'a>>;

/// The runner API as a runner sees it.
pub trait RunnerApi: Send + Sync {
    /// Up to `max` calls, waiting up to `wait_ms` for one.
    fn dequeue(
        &self,
        runner: &str,
        max: usize,
        wait_ms: u64,
        load: Load,
    ) -> RunnerFuture<'_, Vec<Job>>;
    /// Starts calls; only those answered `started` may run.
    fn start(&self, runner: &str, ids: Vec<String>, load: Load) -> RunnerFuture<'_, Vec<Started>>;
    /// Reports finished calls. A runner lends them, to report them again should this attempt
    /// fail; an API that records them in this process takes them (leaving `finishes` empty)
    /// once it has checked them, when it records them all itself, so a finish's result and log
    /// move into its event uncopied. A failure after that (the log's writer failed, for good)
    /// leaves nothing to report again: those calls time out, as when a runner gives up.
    fn finish<'a>(
        &'a self,
        runner: &str,
        finishes: &'a mut Vec<Finish>,
        load: Load,
    ) -> RunnerFuture<'a, ()>;
}

impl RunnerApi for Arc<Calls> {
    fn dequeue(
        &self,
        runner: &str,
        max: usize,
        wait_ms: u64,
        load: Load,
    ) -> RunnerFuture<'_, Vec<Job>> {
        let runner = runner.to_owned();
        Box::pin(async move {
            self.seen(&runner, Some(load));
            Ok(Calls::dequeue(self, &runner, max, wait_ms).await?)
        })
    }

    fn start(&self, runner: &str, ids: Vec<String>, load: Load) -> RunnerFuture<'_, Vec<Started>> {
        let runner = runner.to_owned();
        Box::pin(async move {
            self.seen(&runner, Some(load));
            Ok(Calls::start(self, &runner, ids).await?)
        })
    }

    fn finish<'a>(
        &'a self,
        runner: &str,
        finishes: &'a mut Vec<Finish>,
        load: Load,
    ) -> RunnerFuture<'a, ()> {
        let runner = runner.to_owned();
        Box::pin(async move {
            self.seen(&runner, Some(load));
            self.check_finishes(finishes)?;
            self.finish_checked(&runner, finishes, false).await?;
            Ok(())
        })
    }
}

/// A pooled HTTP/1.1 client with `TCP_NODELAY`.
pub fn http_client() -> Client<HttpConnector, Full<Bytes>> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
}

/// The runner API over HTTP, on one of the ebb replicas a service id resolves to: picked by
/// consistent hashing on the runner's id, so a runner keeps to one replica while that one is
/// there and moves when it is gone or keeps failing. Its bodies are MessagePack, JSON while a
/// server does not read that ([`Negotiated`]).
pub struct HttpApi {
    api: ServiceId,
    token: String,
    client: Client<HttpConnector, Full<Bytes>>,
    balanced: Arc<Balanced>,
    policy: Policy,
    format: Negotiated,
}

impl HttpApi {
    /// A client of the API at `api` (its admin listener: `http://host:port`, a DNS name of every
    /// replica, `k8s://ebb.namespace:8081`), resolved through `balanced`.
    pub fn new(api: ServiceId, token: &str, balanced: Arc<Balanced>) -> Self {
        Self {
            api,
            token: token.to_owned(),
            client: http_client(),
            balanced,
            policy: Policy {
                balancer: crate::discovery::Balancer::ConsistentHash,
                eject_after_failures: 2,
                ejection_ms: 10_000,
                ..Policy::default()
            },
            format: Negotiated::default(),
        }
    }

    /// Posts `body` (MessagePack unless the server did not read it: [`Negotiated`]) and
    /// returns the answer's status, format and body.
    async fn post(
        &self,
        runner: &str,
        path: &str,
        body: &(impl serde::Serialize + Sync),
        load: Load,
    ) -> Result<(u16, Format, Bytes), RunnerError> {
        let (status, answer_format, answer) = self
            .format
            .exchange(
                body,
                |format, encoded| self.post_once(runner, path, format, encoded, load),
                |(status, _, answer): &(u16, Format, Bytes)| (*status, &answer[..]),
            )
            .await?;
        if status >= 400 && status != 409 {
            return Err(RunnerError {
                status: Some(status),
                message: format!("{path}: {}", String::from_utf8_lossy(&answer)),
            });
        }
        Ok((status, answer_format, answer))
    }

    async fn post_once(
        &self,
        runner: &str,
        path: &str,
        format: Format,
        body: Vec<u8>,
        load: Load,
    ) -> Result<(u16, Format, Bytes), RunnerError> {
        let key = crate::discovery::hash_key(runner.as_bytes());
        let chosen = self
            .balanced
            .pick(&self.api, &self.policy, Some(key), RESOLVE_WAIT)
            .await
            .map_err(|e| RunnerError::other(format!("{path}: {e}")))?;
        let req = hyper::Request::post(format!("http://{}{path}", chosen.addr()))
            .header("host", self.api.authority())
            .header("authorization", format!("Bearer {}", self.token))
            .header("content-type", format.media_type())
            .header("accept", format.media_type())
            .header("x-runner-load", load.to_string())
            .body(Full::new(Bytes::from(body)))
            .map_err(RunnerError::other)?;
        let resp = match self.client.request(req).await {
            Ok(r) => r,
            Err(e) => {
                chosen.failed();
                return Err(RunnerError::other(format!("{path}: {e}")));
            }
        };
        let status = resp.status().as_u16();
        chosen.answered(status >= 500);
        let answer_format = Format::of_content_type(
            resp.headers()
                .get(hyper::header::CONTENT_TYPE)
                .map(|v| v.as_bytes()),
        );
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| RunnerError::other(format!("{path}: {e}")))?
            .to_bytes();
        Ok((status, answer_format, body))
    }
}

impl RunnerApi for HttpApi {
    fn dequeue(
        &self,
        runner: &str,
        max: usize,
        wait_ms: u64,
        load: Load,
    ) -> RunnerFuture<'_, Vec<Job>> {
        let body = serde_json::json!({ "runner": runner, "max": max, "wait_ms": wait_ms });
        let who = runner.to_owned();
        Box::pin(async move {
            let (status, format, bytes) = self.post(&who, "/runner/dequeue", &body, load).await?;
            if status == 204 {
                return Ok(Vec::new());
            }
            #[derive(serde::Deserialize)]
            struct Answer {
                calls: Vec<JobJson>,
            }
            let a: Answer = format.decode(&bytes).map_err(RunnerError::other)?;
            a.calls
                .into_iter()
                .map(JobJson::into_job)
                .collect::<Result<_, _>>()
                .map_err(RunnerError::other)
        })
    }

    fn start(&self, runner: &str, ids: Vec<String>, load: Load) -> RunnerFuture<'_, Vec<Started>> {
        #[derive(serde::Serialize)]
        struct Body {
            runner: String,
            ids: Vec<String>,
        }
        let body = Body {
            runner: runner.to_owned(),
            ids,
        };
        Box::pin(async move {
            let (_, format, bytes) = self
                .post(&body.runner, "/runner/start", &body, load)
                .await?;
            #[derive(serde::Deserialize)]
            struct Answer {
                results: Vec<Started>,
            }
            let a: Answer = format.decode(&bytes).map_err(RunnerError::other)?;
            Ok(a.results)
        })
    }

    fn finish<'a>(
        &'a self,
        runner: &str,
        finishes: &'a mut Vec<Finish>,
        load: Load,
    ) -> RunnerFuture<'a, ()> {
        let who = runner.to_owned();
        Box::pin(async move {
            let body = FinishBatchRef::of(&who, finishes);
            self.post(&who, "/runner/finish", &body, load).await?;
            Ok(())
        })
    }
}

/// Runs a call's request.
pub trait Executor: Send + Sync {
    /// Runs `job` within `timeout` and says how it ended.
    fn execute(&self, job: Job, timeout: Duration) -> Pin<Box<dyn Future<Output = Finish> + Send>>;
}

/// Sends a call's request through ebb's proxy (which wakes the target from zero), with the
/// target route's Host; or, for a function served elsewhere, to one instance of its service,
/// picked by its traffic policy.
pub struct ProxyExecutor {
    proxy: SocketAddr,
    client: Client<HttpConnector, Full<Bytes>>,
    max_result_bytes: usize,
    balanced: Arc<Balanced>,
}

impl ProxyExecutor {
    /// An executor sending to the proxy at `proxy`, and to the services `balanced` resolves.
    pub fn new(proxy: SocketAddr, max_result_bytes: usize, balanced: Arc<Balanced>) -> Self {
        Self {
            proxy,
            client: http_client(),
            max_result_bytes,
            balanced,
        }
    }
}

/// How long a service (a function's, the runner API's) may take to resolve the first time.
const RESOLVE_WAIT: Duration = Duration::from_secs(5);

/// The instance of `address` (a service id) a job goes to, picked by `policy`.
async fn pick(
    balanced: &Balanced,
    address: &str,
    policy: Option<&Policy>,
    payload: &crate::event::Payload,
    wait: Duration,
) -> Result<(Chosen, String), String> {
    let id = ServiceId::parse_address(address).map_err(|e| e.to_string())?;
    let default = Policy::default();
    let policy = policy.unwrap_or(&default);
    let key = policy.hash_on.as_ref().and_then(|h| {
        crate::discovery::request_key(
            h,
            &payload.path,
            |name| {
                payload
                    .headers
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case(name))
                    .map(|(_, v)| v.as_bytes())
            },
            std::net::Ipv4Addr::LOCALHOST.into(),
        )
    });
    let chosen = balanced
        .pick(&id, policy, key, wait)
        .await
        .map_err(|e| e.to_string())?;
    Ok((chosen, id.authority().to_owned()))
}

fn failed(id: String, log: String) -> Finish {
    Finish {
        id,
        outcome: Outcome::Error,
        result: None,
        log,
    }
}

impl Executor for ProxyExecutor {
    fn execute(&self, job: Job, timeout: Duration) -> Pin<Box<dyn Future<Output = Finish> + Send>> {
        let client = self.client.clone();
        let proxy = self.proxy;
        let max = self.max_result_bytes;
        let balanced = self.balanced.clone();
        Box::pin(async move {
            let id = job.call.id.clone();
            let carried = [
                ("traceparent", job.call.trace.as_deref()),
                ("tracestate", job.call.tracestate.as_deref()),
                ("baggage", job.call.baggage.as_deref()),
            ];
            // The call is the log's (in process, shared): its body is copied into the request.
            let p = &job.call.payload;
            // Through ebb's proxy by Host, or straight to a function served elsewhere.
            let (to, host, chosen) = match &job.address {
                Some(a) => {
                    match pick(
                        &balanced,
                        a,
                        job.policy.as_ref(),
                        p,
                        timeout.min(RESOLVE_WAIT),
                    )
                    .await
                    {
                        Ok((c, host)) => (c.addr().to_string(), host, Some(c)),
                        Err(e) => return failed(id, format!("no instance to send to: {e}\n")),
                    }
                }
                None => (proxy.to_string(), job.host.clone(), None),
            };
            let mut req = hyper::Request::builder()
                .method(p.method.as_str())
                .uri(format!("http://{to}{}", p.path))
                .header("host", host)
                .header("x-ebb-call-id", &id);
            for (k, v) in &p.headers {
                req = req.header(k, v);
            }
            // A traced call's request joins the trace it was enqueued in, with its baggage
            // (unless the caller's payload names a context of its own: then only a header the
            // payload lacks is added).
            let has = |name: &str| p.headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(name));
            if carried[0].1.is_some() {
                let own = has("traceparent");
                for (name, value) in carried {
                    let given = if name == "baggage" { has(name) } else { own };
                    if let (Some(v), false) = (value, given) {
                        req = req.header(name, v);
                    }
                }
            }
            // The call's id is its request's id unless the caller gave one: ebb's lines about
            // the request and the app's own carry it.
            if !p
                .headers
                .iter()
                .any(|(k, _)| k.eq_ignore_ascii_case(ebb_http::request_id::HEADER))
            {
                req = req.header(ebb_http::request_id::HEADER, &id);
            }
            let req = match req.body(Full::new(Bytes::copy_from_slice(&p.body))) {
                Ok(r) => r,
                Err(e) => return failed(id, format!("bad request: {e}")),
            };
            // The instance learns how the request ended once its answer's head is in.
            let mut chosen = chosen;
            let run = async {
                let resp = client.request(req).await.map_err(|e| e.to_string())?;
                let status = resp.status().as_u16();
                if let Some(c) = chosen.take() {
                    c.answered(status >= 500);
                }
                let headers = resp
                    .headers()
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.to_string(),
                            String::from_utf8_lossy(v.as_bytes()).into_owned(),
                        )
                    })
                    .collect();
                let mut body = resp.into_body();
                let mut bytes = Vec::new();
                let mut truncated = false;
                while let Some(frame) = body.frame().await {
                    let frame = frame.map_err(|e| e.to_string())?;
                    if let Ok(data) = frame.into_data() {
                        let room = max.saturating_sub(bytes.len());
                        truncated |= data.len() > room;
                        bytes.extend_from_slice(&data[..data.len().min(room)]);
                    }
                }
                Ok::<_, String>((status, headers, bytes, truncated))
            };
            let ran = tokio::time::timeout(timeout, run).await;
            if let Some(c) = chosen
                && !matches!(ran, Ok(Ok(_)))
            {
                c.failed();
            }
            match ran {
                Ok(Ok((status, headers, bytes, truncated))) => Finish {
                    id,
                    outcome: if (200..300).contains(&status) {
                        Outcome::Success
                    } else {
                        Outcome::Error
                    },
                    result: Some(CallResult {
                        status,
                        headers,
                        body: bytes.into(),
                    }),
                    log: if truncated {
                        format!("the answer was cut at {max} bytes\n")
                    } else {
                        String::new()
                    },
                },
                Ok(Err(e)) => failed(id, format!("request failed: {e}\n")),
                Err(_) => failed(id, format!("no answer within {} ms\n", timeout.as_millis())),
            }
        })
    }
}

/// Finishes every call at once with an empty 200: for measuring the queue and the API alone.
pub struct NoopExecutor;

impl Executor for NoopExecutor {
    fn execute(&self, job: Job, _: Duration) -> Pin<Box<dyn Future<Output = Finish> + Send>> {
        Box::pin(async move {
            Finish {
                id: job.call.id.clone(),
                outcome: Outcome::Success,
                result: Some(CallResult {
                    status: 200,
                    ..CallResult::default()
                }),
                log: String::new(),
            }
        })
    }
}

/// How a runner runs.
#[derive(Debug, Clone)]
pub struct RunnerOptions {
    /// This runner's id (its partition).
    pub id: String,
    /// Calls run at once.
    pub capacity: usize,
    /// Dequeue long-poll.
    pub wait_ms: u64,
    /// Most calls asked for, started or finished in one request.
    pub batch: usize,
    /// Attempts at reporting a finish before giving up on it (the call then times out).
    pub finish_attempts: u32,
    /// Fault injection for tests: the runner SIGKILLs itself at this point.
    pub fault: Option<Fault>,
}

/// Where a runner kills itself, to test what ebb does when runners die.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    /// After calls were dequeued, before they are started.
    KillAfterDequeue,
    /// After calls were started, before they run.
    KillAfterStart,
}

fn die_if(fault: Option<Fault>, at: Fault) {
    if fault == Some(at) {
        tracing::warn!(?at, "fault injection: killing this runner");
        let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
    }
}

impl Default for RunnerOptions {
    fn default() -> Self {
        Self {
            id: "builtin".into(),
            capacity: 64,
            wait_ms: 5_000,
            batch: 64,
            finish_attempts: 20,
            fault: None,
        }
    }
}

/// Backoff between failed API requests: 50 ms doubling to 2 s.
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis((50u64 << attempt.min(6)).min(2_000))
}

/// Runs the runner until `stop` changes; calls under way finish and are reported first.
pub async fn run(
    api: Arc<dyn RunnerApi>,
    executor: Arc<dyn Executor>,
    options: RunnerOptions,
    mut stop: watch::Receiver<bool>,
) {
    let capacity = options.capacity.max(1);
    let permits = Arc::new(Semaphore::new(capacity));
    // Calls running now (permits held only for a dequeue under way do not count).
    let running = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let load = {
        let running = running.clone();
        move || Load {
            in_flight: running.load(std::sync::atomic::Ordering::Relaxed) as u32,
            capacity: capacity as u32,
        }
    };
    let (done_tx, done_rx) = mpsc::channel::<Finish>(capacity);
    let finisher = tokio::spawn(report(api.clone(), options.clone(), done_rx, load.clone()));
    // Starts under way, and a wake as each ends: while one is, a dequeue waits for room for a
    // worthwhile batch (`least`). A full runner frees its room a call at a time; asking for each
    // freed slot made batches of one or two calls under load, each paying a dequeue's and a
    // start's whole cost (measured: a runner of 500 behind a backlog asked 2 calls a dequeue
    // and ran 0.6x the calls it runs asking 100 or more).
    let starts = Starts::default();
    let least = least_batch(capacity, options.batch);
    let mut failures = 0u32;
    'dequeue: loop {
        // Wait for room, then ask for as much work as there is room for. A small batch waits for
        // more room only while a start is under way: that start's calls free their room soon,
        // and with no start under way nothing would come sooner.
        let mut held = Vec::new();
        loop {
            while held.len() < options.batch {
                match permits.clone().try_acquire_owned() {
                    Ok(p) => held.push(p),
                    Err(_) => break,
                }
            }
            if !held.is_empty() && (held.len() >= least || starts.none_under_way()) {
                break;
            }
            tokio::select! {
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => held.push(p),
                    Err(_) => break 'dequeue,
                },
                _ = starts.ended.notified() => {}
                _ = stop.changed() => break 'dequeue,
            }
        }
        let jobs = tokio::select! {
            j = api.dequeue(&options.id, held.len(), options.wait_ms, load()) => j,
            _ = stop.changed() => break,
        };
        let jobs = match jobs {
            Ok(j) => {
                failures = 0;
                j
            }
            Err(e) => {
                tracing::warn!(runner = %options.id, error = %e, "dequeue failed");
                failures += 1;
                drop(held);
                tokio::time::sleep(backoff(failures)).await;
                continue;
            }
        };
        // Never more calls than room: extra ones are not started and come back.
        let mut jobs = jobs;
        jobs.truncate(held.len());
        held.truncate(jobs.len());
        if jobs.is_empty() {
            continue;
        }
        die_if(options.fault, Fault::KillAfterDequeue);
        // The start (and the runs) go on while the loop asks for more work.
        let api = api.clone();
        let executor = executor.clone();
        let done = done_tx.clone();
        let runner_id = options.id.clone();
        let fault = options.fault;
        let running = running.clone();
        let load_now = load();
        let start = starts.begin();
        tokio::spawn(async move {
            let ids = jobs.iter().map(|j| j.call.id.clone()).collect();
            let started = api.start(&runner_id, ids, load_now).await;
            drop(start);
            let started = match started {
                Ok(s) => s,
                Err(e) => {
                    // Not started: the calls come back after the visibility timeout.
                    tracing::warn!(runner = %runner_id, error = %e, "start failed");
                    return;
                }
            };
            let accepted = accepted(&jobs, started);
            if accepted.iter().any(|a| *a) {
                die_if(fault, Fault::KillAfterStart);
            }
            // The batch's calls run in this task, each its own future (no task of its own a
            // call): an executor's future waits on IO, whose work is its connection's task.
            let mut runs = FuturesUnordered::new();
            let (done, running) = (&done, &running);
            for ((job, permit), accepted) in jobs.into_iter().zip(held).zip(accepted) {
                if !accepted {
                    continue;
                }
                running.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let timeout = Duration::from_millis(job.call.timeout_ms);
                let execution = std::panic::AssertUnwindSafe(executor.execute(job, timeout));
                runs.push(async move {
                    // A call whose executor panicked is not finished: it comes back after its
                    // timeout, as one whose runner died; the batch's others run on.
                    let finish = execution.catch_unwind().await;
                    running.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                    if let Ok(finish) = finish {
                        let _ = done.send(finish).await;
                    }
                    drop(permit);
                });
            }
            while runs.next().await.is_some() {}
        });
    }
    // Let the calls under way end, then the reports.
    let _ = permits.acquire_many(capacity as u32).await;
    drop(done_tx);
    let _ = finisher.await;
}

/// Which of `jobs` their start accepted. The API answers in the order it was asked (matched
/// pairwise); an answer in another order is matched by id.
fn accepted(jobs: &[Job], started: Vec<Started>) -> Vec<bool> {
    if started.len() == jobs.len() && started.iter().zip(jobs).all(|(s, j)| s.id == j.call.id) {
        return started.iter().map(|s| s.started).collect();
    }
    let accepted: super::IdHashSet<String> = started
        .into_iter()
        .filter(|s| s.started)
        .map(|s| s.id)
        .collect();
    jobs.iter().map(|j| accepted.contains(&j.call.id)).collect()
}

/// A runner's starts under way, and a wake as each ends.
#[derive(Clone, Default)]
struct Starts {
    under_way: Arc<std::sync::atomic::AtomicUsize>,
    ended: Arc<tokio::sync::Notify>,
}

impl Starts {
    /// Counts a start under way until the guard is dropped (when it was answered, or its task
    /// was dropped).
    fn begin(&self) -> StartUnderWay {
        self.under_way
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        StartUnderWay(self.clone())
    }

    fn none_under_way(&self) -> bool {
        self.under_way.load(std::sync::atomic::Ordering::Acquire) == 0
    }
}

/// A start under way (see [`Starts::begin`]).
struct StartUnderWay(Starts);

impl Drop for StartUnderWay {
    fn drop(&mut self) {
        self.0
            .under_way
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        // A stored wake if the loop is not waiting yet: it looks again before it waits.
        self.0.ended.notify_one();
    }
}

/// The room worth a dequeue while a start is under way: a quarter of the most a runner asks for
/// at once (at least one call).
fn least_batch(capacity: usize, batch: usize) -> usize {
    (capacity.min(batch) / 4).max(1)
}

/// Most result bytes in one finish request (the API reads 16 MiB at most).
const FINISH_BATCH_BYTES: usize = 8 << 20;

/// Reports finishes in batches, retrying each batch with backoff. A batch the API refuses (4xx) is
/// reported call by call, so one bad finish does not take the others with it.
async fn report(
    api: Arc<dyn RunnerApi>,
    options: RunnerOptions,
    mut done: mpsc::Receiver<Finish>,
    load: impl Fn() -> Load + Send + 'static,
) {
    let size = |f: &Finish| f.result.as_ref().map_or(0, |r| r.body.len()) + f.log.len();
    let mut next: Option<Finish> = None;
    loop {
        let first = match next.take() {
            Some(f) => f,
            None => match done.recv().await {
                Some(f) => f,
                None => return,
            },
        };
        let mut bytes = size(&first);
        let mut batch = vec![first];
        while batch.len() < options.batch {
            match done.try_recv() {
                Ok(f) if bytes + size(&f) > FINISH_BATCH_BYTES => {
                    next = Some(f);
                    break;
                }
                Ok(f) => {
                    bytes += size(&f);
                    batch.push(f);
                }
                Err(_) => break,
            }
        }
        match send_finishes(&*api, &options, &mut batch, &load).await {
            Err(e) if e.is_refusal() && batch.len() > 1 => {
                tracing::warn!(runner = %options.id, error = %e, "finish batch refused; reporting one by one");
                for f in batch {
                    let _ = send_finishes(&*api, &options, &mut vec![f], &load).await;
                }
            }
            _ => {}
        }
    }
}

/// Sends one finish request, retrying with backoff unless the API refuses it. Each attempt
/// lends the API `batch`, so a failed one leaves it whole for the next (unless the API took it:
/// then there is nothing left to send).
async fn send_finishes(
    api: &dyn RunnerApi,
    options: &RunnerOptions,
    batch: &mut Vec<Finish>,
    load: &impl Fn() -> Load,
) -> Result<(), RunnerError> {
    let mut attempt = 0;
    let calls = batch.len();
    loop {
        match api.finish(&options.id, batch, load()).await {
            Ok(()) => return Ok(()),
            Err(e) if batch.is_empty() => {
                tracing::error!(runner = %options.id, error = %e, calls, "recording finished calls failed; they will time out");
                return Err(e);
            }
            Err(e) if e.is_refusal() => {
                tracing::error!(runner = %options.id, error = %e, calls = batch.len(), "finish refused");
                return Err(e);
            }
            Err(e) if attempt + 1 < options.finish_attempts => {
                attempt += 1;
                tracing::warn!(runner = %options.id, error = %e, attempt, "finish failed; retrying");
                tokio::time::sleep(backoff(attempt)).await;
            }
            Err(e) => {
                tracing::error!(runner = %options.id, error = %e, calls = batch.len(), "giving up reporting finished calls; they will time out");
                return Err(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::sync::Semaphore;

    use super::*;
    use crate::event::CallSpec;
    use crate::state::calls::CallStatus;

    /// A runner API with an endless queue, whose starts end only as the test lets them (`ends`),
    /// noting each dequeue's size and how many starts were under way when it was asked.
    struct Gated {
        made: AtomicUsize,
        starting: AtomicUsize,
        ends: Semaphore,
        dequeues: Mutex<Vec<(usize, usize)>>,
    }

    impl RunnerApi for Gated {
        fn dequeue(&self, _: &str, max: usize, _: u64, _: Load) -> RunnerFuture<'_, Vec<Job>> {
            let under_way = self.starting.load(Ordering::SeqCst);
            self.dequeues
                .lock()
                .expect("dequeues")
                .push((max, under_way));
            let jobs = (0..max)
                .map(|_| {
                    job(&format!(
                        "call-{}",
                        self.made.fetch_add(1, Ordering::SeqCst)
                    ))
                })
                .collect();
            Box::pin(async move { Ok(jobs) })
        }

        fn start(&self, _: &str, ids: Vec<String>, _: Load) -> RunnerFuture<'_, Vec<Started>> {
            self.starting.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                self.ends.acquire().await.expect("open").forget();
                self.starting.fetch_sub(1, Ordering::SeqCst);
                Ok(ids.iter().map(|id| started(id, true)).collect())
            })
        }

        fn finish<'a>(&'a self, _: &str, _: &'a mut Vec<Finish>, _: Load) -> RunnerFuture<'a, ()> {
            Box::pin(async { Ok(()) })
        }
    }

    /// Runs each call until the test lets one more end.
    struct Held(Arc<Semaphore>);

    impl Executor for Held {
        fn execute(&self, job: Job, _: Duration) -> Pin<Box<dyn Future<Output = Finish> + Send>> {
            let gate = self.0.clone();
            Box::pin(async move {
                gate.acquire().await.expect("open").forget();
                Finish {
                    id: job.call.id.clone(),
                    outcome: Outcome::Success,
                    result: None,
                    log: String::new(),
                }
            })
        }
    }

    /// Waits for `cond`, up to 10 s.
    async fn until(what: &str, cond: impl Fn() -> bool) {
        let wait = async {
            while !cond() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .is_err()
        {
            panic!("waited 10 s for {what}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_runner_asks_for_a_worthwhile_batch_while_a_start_is_under_way() {
        let api = Arc::new(Gated {
            made: AtomicUsize::new(0),
            starting: AtomicUsize::new(0),
            ends: Semaphore::new(0),
            dequeues: Mutex::new(Vec::new()),
        });
        let runs = Arc::new(Semaphore::new(0));
        let (stop_tx, stop) = watch::channel(false);
        let options = RunnerOptions {
            capacity: 64,
            batch: 64,
            ..RunnerOptions::default()
        };
        let least = least_batch(64, 64);
        assert_eq!(least, 16);
        let runner = tokio::spawn(run(
            api.clone(),
            Arc::new(Held(runs.clone())),
            options,
            stop,
        ));
        let dequeues = || api.dequeues.lock().expect("dequeues").clone();
        // The empty runner asks for all its room; its start ends and its 64 calls run.
        until("the first dequeue", || dequeues().len() == 1).await;
        assert_eq!(dequeues()[0], (64, 0));
        api.ends.add_permits(1);
        until("the first start's end", || {
            api.starting.load(Ordering::SeqCst) == 0
        })
        .await;
        // One call ends: with no start under way, its room is asked for at once.
        runs.add_permits(1);
        until("the second dequeue's start", || {
            dequeues().len() == 2 && api.starting.load(Ordering::SeqCst) == 1
        })
        .await;
        assert_eq!(dequeues()[1], (1, 0));
        // While that start is under way, calls ending one by one free room a call at a time:
        // the runner waits for a quarter of its batch before it asks again.
        runs.add_permits(20);
        until("the third dequeue", || dequeues().len() >= 3).await;
        let (asked, under_way) = dequeues()[2];
        assert_eq!(under_way, 1, "asked while the second start was under way");
        for (asked, under_way) in dequeues() {
            assert!(
                under_way == 0 || asked >= least,
                "asked for {asked} calls with {under_way} start(s) under way: {:?}",
                dequeues()
            );
        }
        assert!((least..=20).contains(&asked), "asked for {asked}");
        // Everything under way ends, and the runner stops.
        stop_tx.send(true).expect("runner listens");
        api.ends.add_permits(1_000);
        runs.add_permits(10_000);
        tokio::time::timeout(Duration::from_secs(10), runner)
            .await
            .expect("the runner stops")
            .expect("the runner ran");
    }

    /// A runner API with one batch of `calls` calls (then nothing), whose start refuses
    /// `refused`, noting what each finish reported.
    struct OneBatch {
        calls: usize,
        refused: &'static str,
        dequeued: AtomicUsize,
        finished: Mutex<Vec<String>>,
    }

    fn job(id: &str) -> Job {
        Job {
            call: Arc::new(CallSpec::for_test(id)),
            host: String::new(),
            address: None,
            policy: None,
            deliveries: 1,
        }
    }

    fn started(id: &str, started: bool) -> Started {
        Started {
            id: id.to_owned(),
            started,
            code: None,
            state: CallStatus::Running,
            deadline_at_ms: None,
        }
    }

    impl RunnerApi for OneBatch {
        fn dequeue(&self, _: &str, max: usize, _: u64, _: Load) -> RunnerFuture<'_, Vec<Job>> {
            if self.dequeued.fetch_add(1, Ordering::SeqCst) > 0 {
                return Box::pin(std::future::pending());
            }
            assert!(max >= self.calls, "room for the batch");
            let jobs = (0..self.calls).map(|n| job(&format!("call-{n}"))).collect();
            Box::pin(async move { Ok(jobs) })
        }

        fn start(&self, _: &str, ids: Vec<String>, _: Load) -> RunnerFuture<'_, Vec<Started>> {
            let answers = ids
                .iter()
                .map(|id| started(id, id != self.refused))
                .collect();
            Box::pin(async move { Ok(answers) })
        }

        fn finish<'a>(
            &'a self,
            _: &str,
            finishes: &'a mut Vec<Finish>,
            _: Load,
        ) -> RunnerFuture<'a, ()> {
            let mut finished = self.finished.lock().expect("finished");
            finished.extend(finishes.drain(..).map(|f| f.id));
            Box::pin(async { Ok(()) })
        }
    }

    /// Panics on `call-1`; finishes every other call at once, noting it ran.
    struct PanicsOnOne(Mutex<Vec<String>>);

    impl Executor for PanicsOnOne {
        fn execute(&self, job: Job, t: Duration) -> Pin<Box<dyn Future<Output = Finish> + Send>> {
            self.0.lock().expect("ran").push(job.call.id.clone());
            if job.call.id == "call-1" {
                return Box::pin(async { panic!("the executor fails on call-1") });
            }
            NoopExecutor.execute(job, t)
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_runs_its_accepted_calls_and_one_executor_panic_leaves_the_others_finished() {
        let api = Arc::new(OneBatch {
            calls: 5,
            refused: "call-3",
            dequeued: AtomicUsize::new(0),
            finished: Mutex::new(Vec::new()),
        });
        let executor = Arc::new(PanicsOnOne(Mutex::new(Vec::new())));
        let (stop_tx, stop) = watch::channel(false);
        let options = RunnerOptions {
            capacity: 8,
            batch: 8,
            ..RunnerOptions::default()
        };
        let runner = tokio::spawn(run(api.clone(), executor.clone(), options, stop));
        let finished = || {
            let mut f = api.finished.lock().expect("finished").clone();
            f.sort();
            f
        };
        until("the batch's finishes", || finished().len() == 3).await;
        assert_eq!(finished(), ["call-0", "call-2", "call-4"]);
        let mut ran = executor.0.lock().expect("ran").clone();
        ran.sort();
        assert_eq!(
            ran,
            ["call-0", "call-1", "call-2", "call-4"],
            "the refused call never ran"
        );
        // The panicked call's room is free again: the runner stops (it waits for all of it).
        stop_tx.send(true).expect("runner listens");
        tokio::time::timeout(Duration::from_secs(10), runner)
            .await
            .expect("the runner stops")
            .expect("the runner ran");
        assert_eq!(finished().len(), 3, "the panicked call is not finished");
    }

    #[test]
    fn a_start_answer_is_matched_in_order_or_by_id() {
        let jobs: Vec<Job> = ["a", "b", "c"].into_iter().map(job).collect();
        let in_order = vec![started("a", true), started("b", false), started("c", true)];
        assert_eq!(accepted(&jobs, in_order), [true, false, true]);
        let other_order = vec![started("c", true), started("a", true), started("b", false)];
        assert_eq!(accepted(&jobs, other_order), [true, false, true]);
        let fewer = vec![started("b", true)];
        assert_eq!(accepted(&jobs, fewer), [false, true, false]);
        let unknown = vec![started("x", true), started("y", true), started("z", true)];
        assert_eq!(accepted(&jobs, unknown), [false, false, false]);
    }
}
