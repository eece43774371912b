//! The process backend: each replica of a workload is a local child process listening on a port
//! ebb assigns (`$PORT` on 127.0.0.1).
//!
//! One reconciler task per workload compares the replicas it has with the replicas wanted and
//! starts or stops one at a time; one task per replica spawns it, checks readiness, and waits for
//! it to exit. A replica that exits while wanted is a failure: it is counted, reported, and
//! replaced after a backoff that doubles with consecutive failures and resets on readiness.
//! Stopping sends SIGTERM to the replica's process group, then SIGKILL after the grace period.
//! stdout and stderr go to `<log_dir>/<workload>/replica-<id>.log`. Readiness is an HTTP path or
//! a TCP connect, polled. A workload's `pre_run` (`sh -c`) runs once before its first replica
//! starts and again only when it changes; a failing one fails the replica's start.
//!
//! No child outlives ebb: every replica runs in its own process group, is killed with it when its
//! task ends, and carries a parent-death signal (SIGKILL) bound to a long-lived spawner thread, so
//! even a SIGKILL of ebb takes its children with it. The `pre_exec` hook that sets the signal is
//! the workspace's only `unsafe` code.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, oneshot, watch};

use super::listener;
use super::{Error, Observed, Orchestrator, Readiness, Result, WorkloadSpec};

/// Tuning of the process backend. Every bound is a named value.
#[derive(Debug, Clone)]
pub struct ProcessOptions {
    /// Where replica logs go.
    pub log_dir: PathBuf,
    /// Interval between readiness checks of a starting replica.
    pub readiness_poll_ms: u64,
    /// Time one readiness check may take.
    pub readiness_check_timeout_ms: u64,
    /// First delay before replacing a failed replica; doubles per consecutive failure.
    pub restart_backoff_min_ms: u64,
    /// Largest delay before replacing a failed replica.
    pub restart_backoff_max_ms: u64,
    /// Upper bound on replicas of one workload.
    pub max_replicas: u32,
}

impl Default for ProcessOptions {
    fn default() -> Self {
        Self {
            log_dir: PathBuf::from("./ebb-data/workloads"),
            readiness_poll_ms: 2,
            readiness_check_timeout_ms: 1_000,
            restart_backoff_min_ms: 100,
            restart_backoff_max_ms: 10_000,
            max_replicas: 64,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Starting,
    Ready,
    Stopping,
}

struct Replica {
    addr: SocketAddr,
    pid: Option<u32>,
    phase: Phase,
    stop: Arc<Notify>,
}

struct Workload {
    spec: WorkloadSpec,
    desired: u32,
    replicas: BTreeMap<u64, Replica>,
    next_id: u64,
    spawns: u64,
    failures: u64,
    consecutive_failures: u32,
    last_failure: Option<String>,
    wake: Arc<Notify>,
    /// Whether the spec's `pre_run` ran and succeeded; replicas starting together wait on it, so
    /// it runs once.
    pre_ran: Arc<tokio::sync::Mutex<bool>>,
}

struct SpawnJob {
    command: std::process::Command,
    reply: oneshot::Sender<std::io::Result<tokio::process::Child>>,
}

struct Inner {
    workloads: Mutex<BTreeMap<String, Workload>>,
    changes: watch::Sender<u64>,
    options: ProcessOptions,
    spawner: Mutex<Option<std::sync::mpsc::Sender<SpawnJob>>>,
    runtime: tokio::runtime::Handle,
    /// Requests under way on the replica at an address (the proxy's count): a scale-down picks
    /// the replica with the fewest and stops it once it has none (see [`ProcessOrchestrator::drain_with`]).
    in_flight: std::sync::OnceLock<InFlightProbe>,
}

/// Tells how many requests are under way on the replica at an address.
pub type InFlightProbe = Arc<dyn Fn(SocketAddr) -> u32 + Send + Sync>;

/// How often a replica being drained is looked at.
const DRAIN_POLL: Duration = Duration::from_millis(10);

/// Runs workloads as local processes.
pub struct ProcessOrchestrator {
    inner: Arc<Inner>,
}

impl ProcessOrchestrator {
    /// Starts the backend on the current tokio runtime.
    pub fn new(options: ProcessOptions) -> std::io::Result<Self> {
        std::fs::create_dir_all(&options.log_dir)?;
        let runtime = tokio::runtime::Handle::current();
        let (spawner, jobs) = std::sync::mpsc::channel::<SpawnJob>();
        let handle = runtime.clone();
        // Children get SIGKILL when the thread that forked them ends, so they are all forked here,
        // on a thread that lives exactly as long as the orchestrator.
        std::thread::Builder::new()
            .name("ebb-spawner".into())
            .spawn(move || {
                let _rt = handle.enter();
                for job in jobs {
                    let mut cmd = tokio::process::Command::from(job.command);
                    cmd.kill_on_drop(true);
                    let _ = job.reply.send(cmd.spawn());
                }
            })?;
        let (changes, _) = watch::channel(0);
        Ok(Self {
            inner: Arc::new(Inner {
                workloads: Mutex::new(BTreeMap::new()),
                changes,
                options,
                spawner: Mutex::new(Some(spawner)),
                runtime,
                in_flight: std::sync::OnceLock::new(),
            }),
        })
    }

    /// Drains replicas before stopping them: a scale-down picks, among the ready replicas, one
    /// with the fewest requests under way by `probe`, takes it out of the ready list, and sends
    /// it SIGTERM only once `probe` says none is left (or its `stop_grace_ms` has passed). Set
    /// once, by the proxy that owns the counts.
    pub fn drain_with(&self, probe: InFlightProbe) {
        let _ = self.inner.in_flight.set(probe);
    }

    /// Scales every workload to zero and waits (up to each one's grace period plus `extra`) until
    /// their replicas are gone.
    pub async fn shutdown(&self, extra: Duration) {
        let names: Vec<String> = self.inner.lock().keys().cloned().collect();
        let mut grace = Duration::ZERO;
        for n in &names {
            let _ = self.scale(n, 0);
            if let Some(w) = self.inner.lock().get(n) {
                grace = grace.max(Duration::from_millis(w.spec.stop_grace_ms));
            }
        }
        let mut rx = self.changes();
        let all_gone = || self.inner.lock().values().all(|w| w.replicas.is_empty());
        let _ = tokio::time::timeout(grace + extra, async {
            while !all_gone() {
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
    }
}

impl Drop for ProcessOrchestrator {
    fn drop(&mut self) {
        // Whatever is still running goes now, with its whole process group; the workloads are
        // forgotten, which ends their reconcilers.
        let workloads = std::mem::take(&mut *self.inner.lock());
        for w in workloads.values() {
            for r in w.replicas.values() {
                if let Some(pid) = r.pid {
                    signal_group(pid, Signal::SIGKILL);
                }
            }
            w.wake.notify_one();
        }
        // Closing the channel ends the spawner thread.
        self.inner.spawner.lock().expect("spawner lock").take();
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Workload>> {
        self.workloads.lock().expect("workloads lock poisoned")
    }

    fn bump(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && !name.starts_with('.')
}

impl Orchestrator for ProcessOrchestrator {
    fn register(&self, spec: WorkloadSpec) -> Result<()> {
        if !valid_name(&spec.name) {
            return Err(Error::InvalidSpec {
                name: spec.name,
                why: "names are 1-63 characters of letters, digits, '-', '_' and '.'".into(),
            });
        }
        if spec.command.is_empty() {
            return Err(Error::InvalidSpec {
                name: spec.name,
                why: "the command is empty".into(),
            });
        }
        let mut all = self.inner.lock();
        if let Some(w) = all.get_mut(&spec.name) {
            // A changed setup runs again before the next replica.
            if w.spec.pre_run != spec.pre_run {
                w.pre_ran = Arc::new(tokio::sync::Mutex::new(false));
            }
            w.spec = spec;
            w.wake.notify_one();
            return Ok(());
        }
        let wake = Arc::new(Notify::new());
        let name = spec.name.clone();
        all.insert(
            name.clone(),
            Workload {
                spec,
                desired: 0,
                replicas: BTreeMap::new(),
                next_id: 1,
                spawns: 0,
                failures: 0,
                consecutive_failures: 0,
                last_failure: None,
                wake: wake.clone(),
                pre_ran: Arc::new(tokio::sync::Mutex::new(false)),
            },
        );
        drop(all);
        self.inner
            .runtime
            .spawn(reconcile(self.inner.clone(), name, wake));
        Ok(())
    }

    fn scale(&self, name: &str, replicas: u32) -> Result<()> {
        let mut all = self.inner.lock();
        let w = all
            .get_mut(name)
            .ok_or_else(|| Error::UnknownWorkload(name.to_owned()))?;
        w.desired = replicas.min(self.inner.options.max_replicas);
        w.wake.notify_one();
        drop(all);
        self.inner.bump();
        Ok(())
    }

    fn observe(&self, name: &str) -> Option<Observed> {
        let all = self.inner.lock();
        let w = all.get(name)?;
        let count = |p: Phase| w.replicas.values().filter(|r| r.phase == p).count() as u32;
        Some(Observed {
            desired: w.desired,
            starting: count(Phase::Starting),
            ready: w
                .replicas
                .values()
                .filter(|r| r.phase == Phase::Ready)
                .map(|r| r.addr)
                .collect(),
            stopping: count(Phase::Stopping),
            spawns: w.spawns,
            failures: w.failures,
            last_failure: w.last_failure.clone(),
        })
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.inner.changes.subscribe()
    }
}

enum Action {
    Start {
        id: u64,
        addr: SocketAddr,
        backoff: Duration,
    },
    Stop(Arc<Notify>),
    Wait,
}

/// Converges one workload: one start or stop at a time, then waits to be woken.
async fn reconcile(inner: Arc<Inner>, name: String, wake: Arc<Notify>) {
    loop {
        let action = {
            let mut all = inner.lock();
            let taken: Vec<u16> = all
                .values()
                .flat_map(|w| w.replicas.values().map(|r| r.addr.port()))
                .collect();
            let Some(w) = all.get_mut(&name) else { return };
            let live: Vec<u64> = w
                .replicas
                .iter()
                .filter(|(_, r)| r.phase != Phase::Stopping)
                .map(|(id, _)| *id)
                .collect();
            if (live.len() as u32) < w.desired {
                match free_port(&taken, kernel_port) {
                    Ok(addr) => {
                        let id = w.next_id;
                        w.next_id += 1;
                        w.replicas.insert(
                            id,
                            Replica {
                                addr,
                                pid: None,
                                phase: Phase::Starting,
                                stop: Arc::new(Notify::new()),
                            },
                        );
                        let backoff = match w.consecutive_failures {
                            0 => Duration::ZERO,
                            n => Duration::from_millis(
                                inner
                                    .options
                                    .restart_backoff_min_ms
                                    .saturating_mul(1u64 << (n - 1).min(20))
                                    .min(inner.options.restart_backoff_max_ms),
                            ),
                        };
                        Action::Start { id, addr, backoff }
                    }
                    Err(e) => {
                        w.failures += 1;
                        w.last_failure = Some(format!("no free port: {e}"));
                        Action::Wait
                    }
                }
            } else if (live.len() as u32) > w.desired {
                // Stop replicas that are still starting first, then the ready one with the
                // fewest requests under way (the newest among equals).
                let busy = |id: &u64| {
                    inner
                        .in_flight
                        .get()
                        .map_or(0, |probe| probe(w.replicas[id].addr))
                };
                let victim = live
                    .iter()
                    .rev()
                    .find(|id| w.replicas[id].phase == Phase::Starting)
                    .or_else(|| live.iter().rev().min_by_key(|id| busy(id)))
                    .copied()
                    .expect("live is not empty");
                let r = w.replicas.get_mut(&victim).expect("victim exists");
                r.phase = Phase::Stopping;
                Action::Stop(r.stop.clone())
            } else {
                Action::Wait
            }
        };
        match action {
            Action::Start { id, addr, backoff } => {
                inner.bump();
                let inner2 = inner.clone();
                let name2 = name.clone();
                inner.runtime.spawn(async move {
                    if !backoff.is_zero() {
                        tokio::time::sleep(backoff).await;
                    }
                    run_replica(inner2, name2, id, addr).await;
                });
            }
            Action::Stop(stop) => {
                stop.notify_one();
                inner.bump();
            }
            Action::Wait => wake.notified().await,
        }
    }
}

/// How many ports [`free_port`] asks the kernel for before it gives up.
const PORT_PICKS: usize = 16;

/// A port for a new replica: one the kernel has free now (`pick`) that no replica of this
/// orchestrator was given (`taken`). The kernel may hand out a port again as soon as its
/// listener here is gone, before the replica it was picked for has bound it; two replicas
/// starting at once could then get the same port, one fail to bind it, and its readiness probe
/// reach the other's app (a request for one function answered by another's). Each port the
/// kernel offers stays bound until the pick is over, so it is not offered twice.
fn free_port<H>(
    taken: &[u16],
    mut pick: impl FnMut() -> std::io::Result<(SocketAddr, H)>,
) -> std::io::Result<SocketAddr> {
    let mut held = Vec::new();
    for _ in 0..PORT_PICKS {
        let (addr, listener) = pick()?;
        if !taken.contains(&addr.port()) {
            return Ok(addr);
        }
        held.push(listener);
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("the kernel offered only ports replicas hold, {PORT_PICKS} times"),
    ))
}

/// A port the kernel has free on loopback, with the listener that holds it.
fn kernel_port() -> std::io::Result<(SocketAddr, std::net::TcpListener)> {
    let l = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok((l.local_addr()?, l))
}

/// Records that a replica is gone; a replica that was not being stopped counts as a failure.
fn replica_gone(inner: &Inner, name: &str, id: u64, failure: Option<String>) {
    let mut all = inner.lock();
    if let Some(w) = all.get_mut(name) {
        let was_stopping = w
            .replicas
            .remove(&id)
            .is_some_and(|r| r.phase == Phase::Stopping);
        if let Some(why) = failure.filter(|_| !was_stopping) {
            tracing::warn!(workload = name, replica = id, %why, "replica failed");
            w.failures += 1;
            w.consecutive_failures = w.consecutive_failures.saturating_add(1);
            w.last_failure = Some(why);
        }
        w.wake.notify_one();
    }
    drop(all);
    inner.bump();
}

fn command_for(spec: &WorkloadSpec, addr: SocketAddr, log: std::fs::File) -> std::process::Command {
    let mut cmd = std::process::Command::new(&spec.command[0]);
    cmd.args(&spec.command[1..])
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .env("PORT", addr.port().to_string())
        .stdin(Stdio::null());
    if let Ok(err) = log.try_clone() {
        cmd.stderr(err);
    }
    cmd.stdout(log);
    if let Some(dir) = &spec.cwd {
        cmd.current_dir(dir);
    }
    die_with_parent(&mut cmd);
    cmd
}

/// Puts the child in its own process group and has the kernel SIGKILL it when the thread that
/// forked it (the spawner thread) ends, which includes ebb being killed.
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs in the child between fork and exec, where only async-signal-safe
    // calls are allowed; it makes two raw syscalls (prctl, getppid) and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)?;
            // The parent may have died before prctl took effect.
            if nix::unistd::getppid() != parent {
                return Err(std::io::Error::other("parent exited during spawn"));
            }
            Ok(())
        });
    }
}

async fn spawn(
    inner: &Inner,
    cmd: std::process::Command,
) -> std::io::Result<tokio::process::Child> {
    let (reply, rx) = oneshot::channel();
    let sent = match &*inner.spawner.lock().expect("spawner lock") {
        Some(tx) => tx.send(SpawnJob {
            command: cmd,
            reply,
        }),
        None => return Err(std::io::Error::other("the orchestrator is shutting down")),
    };
    sent.map_err(|_| std::io::Error::other("the spawner thread has stopped"))?;
    rx.await
        .map_err(|_| std::io::Error::other("the spawner thread has stopped"))?
}

/// Runs a workload's `pre_run` (`sh -c`, its environment and directory, output to the replica's
/// log) to its end, within the start-up timeout.
async fn pre_run(
    inner: &Inner,
    spec: &WorkloadSpec,
    script: &str,
    log: &std::fs::File,
) -> Result<(), String> {
    let mut cmd = std::process::Command::new("sh");
    cmd.arg("-c")
        .arg(script)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null());
    if let (Ok(out), Ok(err)) = (log.try_clone(), log.try_clone()) {
        cmd.stdout(out).stderr(err);
    }
    if let Some(dir) = &spec.cwd {
        cmd.current_dir(dir);
    }
    die_with_parent(&mut cmd);
    let mut child = spawn(inner, cmd)
        .await
        .map_err(|e| format!("preRun: spawning sh: {e}"))?;
    let limit = Duration::from_millis(spec.startup_timeout_ms);
    match tokio::time::timeout(limit, child.wait()).await {
        Ok(Ok(s)) if s.success() => Ok(()),
        Ok(Ok(s)) => Err(format!("preRun {script:?} failed ({s})")),
        Ok(Err(e)) => Err(format!("preRun {script:?}: {e}")),
        Err(_) => {
            if let Some(pid) = child.id() {
                signal_group(pid, Signal::SIGKILL);
            }
            Err(format!(
                "preRun {script:?} did not end within {} ms",
                spec.startup_timeout_ms
            ))
        }
    }
}

fn signal_group(pid: u32, sig: Signal) {
    let _ = killpg(Pid::from_raw(pid as i32), sig);
}

/// Starts one replica, waits for readiness, then for its exit; stops it when told to.
async fn run_replica(inner: Arc<Inner>, name: String, id: u64, addr: SocketAddr) {
    let (spec, stop) = {
        let all = inner.lock();
        let Some(w) = all.get(&name) else { return };
        let Some(r) = w.replicas.get(&id) else { return };
        (w.spec.clone(), r.stop.clone())
    };
    let log_path = inner.options.log_dir.join(&name);
    let log = std::fs::create_dir_all(&log_path).and_then(|_| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path.join(format!("replica-{id}.log")))
    });
    let log = match log {
        Ok(f) => f,
        Err(e) => {
            return replica_gone(&inner, &name, id, Some(format!("opening its log: {e}")));
        }
    };
    let pre = inner.lock().get(&name).map(|w| w.pre_ran.clone());
    if let (Some(script), Some(pre)) = (&spec.pre_run, pre) {
        let mut ran = pre.lock().await;
        if !*ran {
            if let Err(why) = pre_run(&inner, &spec, script, &log).await {
                drop(ran);
                return replica_gone(&inner, &name, id, Some(why));
            }
            *ran = true;
        }
    }
    let mut child = match spawn(&inner, command_for(&spec, addr, log)).await {
        Ok(c) => c,
        Err(e) => {
            let why = format!("spawning {:?}: {e}", spec.command[0]);
            return replica_gone(&inner, &name, id, Some(why));
        }
    };
    let pid = child.id().unwrap_or(0);
    {
        let mut all = inner.lock();
        if let Some(r) = all.get_mut(&name).and_then(|w| {
            w.spawns += 1;
            w.replicas.get_mut(&id)
        }) {
            r.pid = Some(pid);
        }
    }
    inner.bump();
    tracing::debug!(workload = %name, replica = id, pid, %addr, "replica started");

    let startup = Duration::from_millis(spec.startup_timeout_ms);
    // Why the last probe that passed did not count (another process held the port).
    let refused = Mutex::new(None);
    let waiting = wait_ready(&inner.options, addr, &spec.readiness, pid, &refused);
    let ready = tokio::select! {
        r = tokio::time::timeout(startup, waiting) => {
            r.map_err(|_| format!("not ready after {} ms", spec.startup_timeout_ms))
        }
        status = child.wait() => {
            let why = match status {
                Ok(s) => format!("exited before it was ready ({s})"),
                Err(e) => format!("lost before it was ready: {e}"),
            };
            return replica_gone(&inner, &name, id, Some(with_refusal(why, &refused)));
        }
        _ = stop.notified() => Err(String::new()),
    };
    let ready = ready.map_err(|why| with_refusal(why, &refused));
    match ready {
        Ok(()) => {
            if let Some(w) = inner.lock().get_mut(&name) {
                w.consecutive_failures = 0;
                if let Some(r) = w.replicas.get_mut(&id)
                    && r.phase == Phase::Starting
                {
                    r.phase = Phase::Ready;
                }
            }
            inner.bump();
            tracing::debug!(workload = %name, replica = id, "replica ready");
            let failure = tokio::select! {
                status = child.wait() => Some(match status {
                    Ok(s) => format!("exited ({s})"),
                    Err(e) => format!("lost: {e}"),
                }),
                _ = stop.notified() => {
                    drain(&inner, addr, &spec).await;
                    stop_child(&mut child, pid, &spec).await;
                    None
                }
            };
            replica_gone(&inner, &name, id, failure);
        }
        Err(why) => {
            stop_child(&mut child, pid, &spec).await;
            replica_gone(&inner, &name, id, Some(why).filter(|w| !w.is_empty()));
        }
    }
}

/// Waits until the replica at `addr`, out of the ready list, has no request under way (at most
/// its grace period; at once without a probe).
async fn drain(inner: &Inner, addr: SocketAddr, spec: &WorkloadSpec) {
    let Some(probe) = inner.in_flight.get() else {
        return;
    };
    let bound = Duration::from_millis(spec.stop_grace_ms);
    let drained = tokio::time::timeout(bound, async {
        while probe(addr) > 0 {
            tokio::time::sleep(DRAIN_POLL).await;
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(workload = %spec.name, %addr, "replica still busy after its grace period: stopping it");
    }
}

/// SIGTERM to the group, SIGKILL after the grace period.
async fn stop_child(child: &mut tokio::process::Child, pid: u32, spec: &WorkloadSpec) {
    signal_group(pid, Signal::SIGTERM);
    let grace = Duration::from_millis(spec.stop_grace_ms);
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        signal_group(pid, Signal::SIGKILL);
        let _ = child.wait().await;
    }
    // Anything the replica left in its group goes too.
    signal_group(pid, Signal::SIGKILL);
}

/// `why` a replica failed, with why its last passing probe did not count, if one did not.
fn with_refusal(why: String, refused: &Mutex<Option<String>>) -> String {
    match refused.lock().expect("refusal lock").take() {
        Some(r) if !why.is_empty() => format!("{why}; {r}"),
        _ => why,
    }
}

/// Polls until the readiness check passes on a listener of the replica's process group (`pgid`,
/// its first process's pid): a probe answered by another process (given the same port before the
/// replica bound it) does not count, and says why in `refused`.
async fn wait_ready(
    options: &ProcessOptions,
    addr: SocketAddr,
    readiness: &Readiness,
    pgid: u32,
    refused: &Mutex<Option<String>>,
) {
    let poll = Duration::from_millis(options.readiness_poll_ms.max(1));
    let check = Duration::from_millis(options.readiness_check_timeout_ms.max(1));
    loop {
        if let Ok(true) = tokio::time::timeout(check, ready_once(addr, readiness)).await {
            match foreign_holder(addr.port(), pgid).await {
                None => return,
                Some(why) => {
                    tracing::debug!(%addr, pgid, %why, "readiness probe answered by another process");
                    *refused.lock().expect("refusal lock") = Some(why);
                }
            }
        }
        tokio::time::sleep(poll).await;
    }
}

/// Why the listener on `port` is not the replica's (process group `pgid`): which other process
/// holds it; `None` when the group holds it, or when this machine cannot tell.
async fn foreign_holder(port: u16, pgid: u32) -> Option<String> {
    let pgid = i32::try_from(pgid).ok().filter(|p| *p > 0)?;
    tokio::task::spawn_blocking(move || listener::holder(port, pgid).refusal(port))
        .await
        .ok()
        .flatten()
}

async fn ready_once(addr: SocketAddr, readiness: &Readiness) -> bool {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let path = match readiness {
        Readiness::Tcp => return true,
        Readiness::Http { path } => path,
    };
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    let mut got = 0;
    while got < head.len() {
        match s.read(&mut head[got..]).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => got += n,
        }
    }
    head.starts_with(b"HTTP/1.") && head[9] == b'2'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_replica_never_gets_a_port_another_replica_was_given() {
        let at = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let mut offers = vec![at(41_000), at(41_001), at(41_002)].into_iter();
        let picked = free_port(&[41_000, 41_001], || Ok((offers.next().unwrap(), ())));
        assert_eq!(picked.unwrap(), at(41_002));
        // A kernel that offers only taken ports: an error, after a bounded number of asks.
        let mut asked = 0;
        let err = free_port(&[41_000], || {
            asked += 1;
            Ok((at(41_000), ()))
        })
        .unwrap_err();
        assert_eq!(
            (err.kind(), asked),
            (std::io::ErrorKind::AddrInUse, PORT_PICKS)
        );
        // The kernel's own pick: a port on loopback.
        let free = free_port(&[], kernel_port).unwrap();
        assert!(free.ip().is_loopback() && free.port() != 0, "{free}");
    }

    #[tokio::test]
    async fn a_probe_answered_by_another_process_does_not_make_a_replica_ready() {
        // The port is held here, by the test's process; the replica is a process of its own
        // group that listens on nothing (as an app that failed to bind the port it was given).
        let held = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = held.local_addr().unwrap();
        let mut replica = tokio::process::Command::new("sleep")
            .arg("60")
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let options = ProcessOptions {
            readiness_poll_ms: 10,
            ..ProcessOptions::default()
        };
        let refused = Mutex::new(None);
        let waiting = wait_ready(
            &options,
            addr,
            &Readiness::Tcp,
            replica.id().unwrap(),
            &refused,
        );
        let refusal = async {
            let deadline = ebb_core::clock::Stopwatch::start();
            loop {
                if let Some(why) = refused.lock().unwrap().clone() {
                    return why;
                }
                assert!(
                    deadline.elapsed() < Duration::from_secs(30),
                    "no probe refused"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let why = tokio::select! {
            () = waiting => panic!("ready on another process's listener"),
            why = refusal => why,
        };
        assert!(
            why.contains(&format!("port {} is held by another process", addr.port())),
            "{why}"
        );
        let _ = replica.kill().await;
        // The same probe for the group that holds the listener (the test's own): ready.
        let mine = nix::unistd::getpgrp().as_raw() as u32;
        let refused = Mutex::new(None);
        wait_ready(&options, addr, &Readiness::Tcp, mine, &refused).await;
        assert_eq!(*refused.lock().unwrap(), None);
    }
}
