//! The functions runtime: invocations create instances, steps are calls through the call queue
//! (the same durability and at-most-once start), and the driver moves every instance along its
//! chain as its steps end. Every change is a decision on the log's writer, checked again there,
//! so two drivers (or a driver and an explicit step) never add the same step twice; a step's call
//! id is derived from the instance and the step's number, so a step decided again after a crash
//! is the same call, not a second run.
//!
//! [`FunctionService`] has `invoke`, `step` (explicit steps and `RETURN`), `advance` (each change
//! decided again on the writer, so no step is added twice) and `fire`. Steps go on the queue
//! through `Calls::put_and_decide`: put first, then the instance's events and `CallQueued` in one
//! decision. Three loops: the driver ([`run_driver`]: moves instances on when calls end, and
//! sweeps every 500 ms), the autoscaler ([`run_autoscaler`]) and the cron loop ([`run_cron`]:
//! fires what is due in the schedule heap, every 250 ms).

use std::sync::Arc;
use std::time::Duration;

use serde_bytes::ByteBuf;
use tokio::sync::watch;

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::{Autoscale, Next, decide_autoscale, decide_next, step_call, step_events};
use super::{decide_fire, firing_instance_id};
use crate::calls::{CallError, Calls};

use crate::clock::Clock;
use crate::event::{CallSpec, CallTrace, Event, Outcome};
use crate::log::Log;
use crate::state::Due;
use crate::state::{InstanceStatus, State};
use ebb_core::orchestrator::Orchestrator;

/// The special function name that ends an instance with the body as its result.
pub const RETURN: &str = "RETURN";

/// How often the driver looks at every running instance even without a change (after a restart,
/// or a change it missed).
const SWEEP_EVERY: Duration = Duration::from_millis(500);

/// Why a functions request failed.
#[derive(Debug, thiserror::Error)]
pub enum FnError {
    /// No template has that name.
    #[error("no function named {0:?}")]
    UnknownFunction(String),
    /// No instance has that id.
    #[error("no instance {0:?}")]
    UnknownInstance(String),
    /// The instance has ended.
    #[error("instance {0} has ended")]
    Ended(String),
    /// Another step was added at the same moment.
    #[error("instance {0} moved on meanwhile; try again")]
    Moved(String),
    /// The instance reached the step bound.
    #[error("instance {0} has run {1} steps, the bound (--max-instance-steps)")]
    Bound(String, usize),
    /// The chain names a function that does not exist.
    #[error("{0}")]
    UnknownNext(String),
    /// This ebb cannot run the function.
    #[error("{0}")]
    NotRunnable(String),
    /// The call queue or the log failed.
    #[error(transparent)]
    Calls(#[from] CallError),
}

/// The functions service.
pub struct FunctionService {
    log: Arc<Log>,
    calls: Arc<Calls>,
    clock: Arc<dyn Clock>,
    autoscale: Autoscale,
    /// Whether workloads run on Kubernetes (image templates run; command ones do not).
    kubernetes: bool,
    /// Steps an instance may run (`--max-instance-steps`).
    max_steps: usize,
    /// Steps queued per function since the autoscaler's last period.
    queued: Mutex<BTreeMap<String, u64>>,
}

impl FunctionService {
    /// A service putting steps on `calls`.
    pub fn new(
        log: Arc<Log>,
        calls: Arc<Calls>,
        clock: Arc<dyn Clock>,
        autoscale: Autoscale,
    ) -> Self {
        Self {
            log,
            calls,
            clock,
            autoscale,
            kubernetes: false,
            max_steps: super::MAX_STEPS,
            queued: Mutex::new(BTreeMap::new()),
        }
    }

    /// The service with instances bounded to `max_steps` steps each.
    pub fn with_max_steps(mut self, max_steps: usize) -> Self {
        self.max_steps = max_steps.max(1);
        self
    }

    /// The service for an ebb whose workloads run on Kubernetes: templates run from their
    /// `image`.
    pub fn on_kubernetes(mut self) -> Self {
        self.kubernetes = true;
        self
    }

    /// Whether templates run from their image on Kubernetes (else from their command).
    pub fn kubernetes(&self) -> bool {
        self.kubernetes
    }

    /// A template's spec.
    fn template(&self, name: &str) -> Option<crate::event::TemplateSpec> {
        self.log
            .read(|s| s.functions.templates.get(name).map(|t| t.spec.clone()))
    }

    /// The autoscaler's settings.
    pub fn autoscale(&self) -> &Autoscale {
        &self.autoscale
    }

    fn count(&self, function: &str) {
        let mut q = self.queued.lock().expect("queued lock");
        if q.len() < 100_000 || q.contains_key(function) {
            *q.entry(function.to_owned()).or_default() += 1;
        }
    }

    /// The log.
    pub fn log(&self) -> &Arc<Log> {
        &self.log
    }

    /// Invokes template `name` with `args`: a new instance whose first step is queued. Returns
    /// the instance id.
    /// `trace`: the trace context and baggage of the invocation, which its steps' calls keep.
    pub async fn invoke(
        &self,
        name: &str,
        args: Vec<u8>,
        trace: Option<CallTrace>,
    ) -> Result<String, FnError> {
        let template = self
            .template(name)
            .ok_or_else(|| FnError::UnknownFunction(name.to_owned()))?;
        super::runnable(&template, self.kubernetes).map_err(FnError::NotRunnable)?;
        self.log
            .read(|s| super::check_chain(s, name))
            .map_err(FnError::UnknownNext)?;
        let id = self.calls.peers().new_id();
        let mut call = step_call(&id, 1, &template, args.clone());
        if let Some(t) = trace {
            t.keep(&mut call);
        }
        let function = name;
        let (iid, name) = (id.clone(), name.to_owned());
        self.calls
            .put_and_decide(vec![call.clone()], move |s: &State, _| {
                if !s.functions.templates.contains_key(&name) {
                    return (Vec::new(), Err(FnError::UnknownFunction(name)));
                }
                let mut events = vec![Event::InstanceCreated {
                    id: iid.clone(),
                    template: name.clone(),
                    args: ByteBuf::from(args),
                }];
                events.extend(step_events(iid, name, call));
                (events, Ok(()))
            })
            .await??;
        self.count(function);
        Ok(id)
    }

    /// Makes `call` keep the trace context instance `id` was invoked in (its first step's), as
    /// every step does.
    fn keep_instance_trace(&self, id: &str, call: &mut CallSpec) {
        let first = super::step_call_id(id, 1);
        let trace = self
            .log
            .read(|s| s.calls.get(&first).and_then(|c| CallTrace::of(&c.spec)));
        if let Some(t) = trace {
            t.keep(call);
        }
    }

    /// Runs `name` as the next step of instance `id` with `body` as its input (a function that
    /// chains itself); `RETURN` ends the instance with `body` as its result. Returns the step's
    /// number (0 for `RETURN`).
    pub async fn step(&self, name: &str, id: &str, body: Vec<u8>) -> Result<usize, FnError> {
        let (status, steps) = self
            .log
            .read(|s| {
                s.functions
                    .instances
                    .get(id)
                    .map(|i| (i.status, i.steps.len()))
            })
            .ok_or_else(|| FnError::UnknownInstance(id.to_owned()))?;
        if status != InstanceStatus::Running {
            return Err(FnError::Ended(id.to_owned()));
        }
        let iid = id.to_owned();
        if name == RETURN {
            let (r, _) = self
                .log
                .decide(move |s: &State, _| match s.functions.instances.get(&iid) {
                    Some(i) if i.status == InstanceStatus::Running => (
                        vec![Event::InstanceFinished {
                            id: iid,
                            outcome: Outcome::Success,
                            result: ByteBuf::from(body),
                        }],
                        Ok(0),
                    ),
                    _ => (Vec::new(), Err(FnError::Ended(iid))),
                })
                .await
                .map_err(CallError::from)?;
            return r;
        }
        let template = self
            .template(name)
            .ok_or_else(|| FnError::UnknownFunction(name.to_owned()))?;
        super::runnable(&template, self.kubernetes).map_err(FnError::NotRunnable)?;
        if steps >= self.max_steps {
            crate::limits::Limit::InstanceSteps.hit();
            return Err(FnError::Bound(id.to_owned(), self.max_steps));
        }
        let number = steps + 1;
        let mut call = step_call(id, number, &template, body);
        self.keep_instance_trace(id, &mut call);
        let function = name.to_owned();
        let number = self
            .calls
            .put_and_decide(vec![call.clone()], move |s: &State, _| {
                match s.functions.instances.get(&iid) {
                    Some(i) if i.status != InstanceStatus::Running => {
                        (Vec::new(), Err(FnError::Ended(iid)))
                    }
                    Some(i) if i.steps.len() != steps => (Vec::new(), Err(FnError::Moved(iid))),
                    Some(_) => (step_events(iid, function, call).into(), Ok(number)),
                    None => (Vec::new(), Err(FnError::UnknownInstance(iid))),
                }
            })
            .await??;
        self.count(name);
        Ok(number)
    }

    /// Fires every template whose cron occurrence is due; returns how many fired.
    pub async fn fire_due(&self) -> usize {
        let now = self.clock.now_ms();
        let due: Vec<String> = self.log.read(|s| {
            s.schedule
                .due_of(crate::state::schedule::DueKind::TemplateFire, now)
                .filter_map(|(_, d)| match d {
                    Due::TemplateFire(name) => Some(name.clone()),
                    _ => None,
                })
                .collect()
        });
        let mut fired = 0;
        for name in due {
            match self.fire(&name, now).await {
                Ok(true) => fired += 1,
                Ok(false) => {}
                Err(e) => tracing::warn!(template = %name, error = %e, "a cron firing failed"),
            }
        }
        fired
    }

    /// Fires template `name` for its latest occurrence at or before `now_ms`, if it has not
    /// fired for it: an instance like any invocation's, with an empty body.
    pub async fn fire(&self, name: &str, now_ms: u64) -> Result<bool, FnError> {
        let Some((template, at)) = self.log.read(|s| decide_fire(s, name, now_ms)) else {
            return Ok(false);
        };
        let id = crate::peers::qualify(self.calls.peers().me(), &firing_instance_id(name, at));
        let call = step_call(&id, 1, &template, Vec::new());
        let n = name.to_owned();
        let fired = self
            .calls
            .put_and_decide(vec![call.clone()], move |s: &State, _| {
                if decide_fire(s, &n, now_ms).map(|(_, a)| a) != Some(at) {
                    return (Vec::new(), false);
                }
                let mut events = vec![
                    Event::TemplateFired {
                        name: n.clone(),
                        scheduled_at_ms: at,
                    },
                    Event::InstanceCreated {
                        id: id.clone(),
                        template: n.clone(),
                        args: ByteBuf::new(),
                    },
                ];
                events.extend(step_events(id, n, call));
                (events, true)
            })
            .await?;
        if fired {
            self.count(name);
        }
        Ok(fired)
    }

    /// Moves instance `id` on if its last step ended: the next step, or its end. Returns
    /// whether it changed.
    pub async fn advance(&self, id: &str) -> Result<bool, FnError> {
        let kubernetes = self.kubernetes;
        let max_steps = self.max_steps;
        let (next, steps) = self.log.read(|s| {
            (
                decide_next(s, id, kubernetes, max_steps),
                s.functions.instances.get(id).map_or(0, |i| i.steps.len()),
            )
        });
        let iid = id.to_owned();
        match next {
            Next::Wait => Ok(false),
            Next::Finish { .. } => {
                let (changed, _) = self
                    .log
                    .decide(
                        move |s: &State, _| match decide_next(s, &iid, kubernetes, max_steps) {
                            Next::Finish { outcome, result } => (
                                vec![Event::InstanceFinished {
                                    id: iid,
                                    outcome,
                                    result: ByteBuf::from(result),
                                }],
                                true,
                            ),
                            _ => (Vec::new(), false),
                        },
                    )
                    .await
                    .map_err(CallError::from)?;
                if changed && steps >= max_steps {
                    crate::limits::Limit::InstanceSteps.hit();
                }
                Ok(changed)
            }
            Next::Step { function, input } => {
                let Some(template) = self.template(&function) else {
                    return Ok(false);
                };
                let mut call = step_call(id, steps + 1, &template, input);
                self.keep_instance_trace(id, &mut call);
                let counted = function.clone();
                let changed = self
                    .calls
                    .put_and_decide(vec![call.clone()], move |s: &State, _| {
                        let still = matches!(decide_next(s, &iid, kubernetes, max_steps), Next::Step { function: ref f, .. } if *f == function)
                            && s.functions.instances.get(&iid).map(|i| i.steps.len()) == Some(steps);
                        if !still {
                            return (Vec::new(), false);
                        }
                        (step_events(iid, function, call).into(), true)
                    })
                    .await?;
                if changed {
                    self.count(&counted);
                }
                Ok(changed)
            }
        }
    }

    /// One autoscaler period: counters and instance counts decided on the log, then the
    /// workloads scaled.
    pub async fn autoscale_once(&self, orchestrator: &dyn Orchestrator) -> Result<(), FnError> {
        let added = std::mem::take(&mut *self.queued.lock().expect("queued lock"));
        let a = self.autoscale;
        let raise_only = self.kubernetes;
        let (scales, _) = self
            .log
            .decide(move |s: &State, now| decide_autoscale(s, &added, &a, now, raise_only))
            .await
            .map_err(CallError::from)?;
        // Decided now, or decided before and not taken up (a scale that failed, a workload
        // registered after the decision): the orchestrator follows the log.
        let mut scales = scales;
        scales.extend(self.log.read(|s| {
            s.functions
                .templates
                .values()
                .filter_map(|t| super::route_of(&t.spec))
                .filter_map(|r| {
                    let want = s.routes.deployments.get(&r.deployment)?.desired;
                    let has = orchestrator.observe(&r.deployment).map(|o| o.desired);
                    // On Kubernetes another replica may have raised it: never lowered here.
                    (has.is_some_and(|h| h != want && !(raise_only && h > want)))
                        .then_some((r.deployment, want))
                })
                .collect::<Vec<_>>()
        }));
        for (deployment, n) in scales {
            // A workload the backend does not run (yet: an image function's Deployment being
            // made; or ever: an image template on one machine) is scaled once it does.
            if orchestrator.observe(&deployment).is_none() {
                continue;
            }
            if let Err(e) = orchestrator.scale(&deployment, n) {
                tracing::warn!(%deployment, error = %e, "scaling a function failed");
            }
        }
        Ok(())
    }

    /// Moves on every running instance whose last step ended; returns how many changed.
    pub async fn advance_all(&self) -> usize {
        let ready: Vec<String> = self.log.read(|s| {
            s.functions
                .running
                .iter()
                .filter_map(|id| s.functions.instances.get(id).map(|i| (id, i)))
                .filter(|(_, i)| i.status == InstanceStatus::Running)
                .filter(|(_, i)| {
                    i.steps
                        .last()
                        .and_then(|st| s.calls.get(&st.call_id))
                        .is_some_and(|c| c.status.is_final())
                })
                .map(|(id, _)| id.clone())
                .collect()
        });
        let mut changed = 0;
        for id in ready {
            match self.advance(&id).await {
                Ok(true) => changed += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(instance = %id, error = %e, "moving an instance on failed")
                }
            }
        }
        changed
    }
}

/// The function autoscaler: one period every `period_ms`, until `stop`.
pub async fn run_autoscaler(
    service: Arc<FunctionService>,
    orchestrator: Arc<dyn Orchestrator>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick =
        tokio::time::interval(Duration::from_millis(service.autoscale.period_ms.max(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        if let Err(e) = service.autoscale_once(orchestrator.as_ref()).await {
            tracing::warn!(error = %e, "function autoscaler period failed");
        }
    }
}

/// Cron triggers: fires templates whose occurrence is due in the schedule heap, checking every
/// quarter second, until `stop`.
pub async fn run_cron(service: Arc<FunctionService>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        service.fire_due().await;
    }
}

/// The driver: moves instances on whenever a call ends (or a step is added), and sweeps every
/// running instance every half second, until `stop`.
pub async fn run_driver(service: Arc<FunctionService>, mut stop: watch::Receiver<bool>) {
    let mut tail = service.log.subscribe();
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = sweep.tick() => {}
            batch = tail.recv() => match batch {
                Ok(batch) => {
                    let relevant = batch.iter().any(|e| matches!(
                        e.event,
                        Event::CallFinished { .. }
                            | Event::CallTimedOut { .. }
                            | Event::CallRejected { .. }
                            | Event::CallCancelled { .. }
                    ));
                    if !relevant {
                        continue;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            },
        }
        // An instance moved on may end at once (a step refused): go round until quiet.
        while service.advance_all().await > 0 {}
    }
}
