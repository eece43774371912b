//! `ebb bench autoscale`: scaling on load in the simulator, ebb's policy against Knative's KPA
//! (the anchor) on the same generated traces, seeds and replica start times: per trace and
//! policy, the p50 and p99 wait for a replica, the replica-seconds used and the scale changes
//! per minute ([`ebb::sim::load`]).

use std::time::Duration;

use anyhow::Result;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;

use ebb::sim::load::{Config, Policy, Report, Trace, run};

/// Arguments of `ebb bench autoscale`.
#[derive(Debug, Clone, clap::Args)]
pub struct AutoscaleBenchArgs {
    /// Seconds of traffic per run.
    #[arg(long, default_value_t = 600)]
    pub seconds: u64,
    /// Seeds per trace and policy (the figures are the means over them).
    #[arg(long, default_value_t = 5)]
    pub seeds: u64,
    /// Target requests in flight per replica.
    #[arg(long, default_value_t = 10.0)]
    pub target: f64,
    /// Steps in load timed on local processes through a real `ebb serve` (0: the simulation
    /// alone).
    #[arg(long, default_value_t = 3)]
    pub live_rounds: usize,
}

fn mean(runs: &[Report], f: impl Fn(&Report) -> f64) -> f64 {
    runs.iter().map(f).sum::<f64>() / runs.len().max(1) as f64
}

pub fn run_bench(args: AutoscaleBenchArgs) -> Result<()> {
    anyhow::ensure!(args.seeds > 0, "--seeds must be at least 1");
    anyhow::ensure!(
        args.target.is_finite() && args.target > 0.0,
        "--target must be above 0"
    );
    println!(
        "ebb bench autoscale: {} s per run, {} seeds, target {} in flight per replica at 70 %, replicas start in 1-4 s and serve 10 at once",
        args.seconds, args.seeds, args.target
    );
    println!(
        "| trace | policy | wait p50 | wait p99 | replica-s | changes/min | reversals | peak | floor violations |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for trace in Trace::ALL {
        for policy in [Policy::Kpa, Policy::Ebb] {
            let mut c = Config {
                trace,
                seconds: args.seconds,
                ..Config::default()
            };
            c.settings.target = args.target;
            let runs: Vec<Report> = (0..args.seeds).map(|s| run(&c, policy, s)).collect();
            println!(
                "| {} | {} | {:.0} ms | {:.0} ms | {:.0} | {:.2} | {:.1} | {:.0} | {} |",
                trace.name(),
                policy.name(),
                mean(&runs, |r| r.wait_p50_ms as f64),
                mean(&runs, |r| r.wait_p99_ms as f64),
                mean(&runs, |r| r.replica_seconds),
                mean(&runs, |r| r.changes_per_minute(args.seconds)),
                mean(&runs, |r| f64::from(r.reversals)),
                mean(&runs, |r| f64::from(r.peak)),
                runs.iter().map(|r| r.violations.len()).sum::<usize>(),
            );
        }
    }
    if args.live_rounds > 0 {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(live(args.live_rounds))?;
    }
    Ok(())
}

const LIVE_TOKEN: &str = "bench";
const LIVE_CLIENTS: usize = 24;

/// A step in load on local processes: a route at one warm replica (an app answering in 100 ms,
/// target concurrency 2), then 24 clients at once. Timed from the step: the decision
/// (`ScaleRequested { reason: load }`: the admin API showing more than one replica asked for,
/// polled every 5 ms) and the first new replica's spawn. The anchor, measured in the same run: one request's answer time through ebb at one
/// client (the app's own 100 ms and ebb's share).
async fn live(rounds: usize) -> Result<()> {
    use ebb::clock::Stopwatch;
    let config = r#"[[app]]
name = "web"
domains = ["web.localhost"]
command = ["ebb", "example-app", "--answer-delay-ms", "100"]
max_replicas = 20
idle_after_ms = 600000
load = { target_concurrency = 2, window_ms = 6000 }
"#;
    let serve = super::serve_child(&["--admin-token", LIVE_TOKEN], Some(config))?;
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
    let get = move |to: std::net::SocketAddr, host: &'static str, path: String| {
        let client = client.clone();
        async move {
            let req = hyper::Request::get(format!("http://{to}{path}"))
                .header("host", host)
                .header("authorization", format!("Bearer {LIVE_TOKEN}"))
                .body(Full::new(Bytes::new()))?;
            let resp = client.request(req).await?;
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok((status, body))
        }
    };
    let route = || async {
        let (_, body) = get(serve.admin, "localhost", "/admin/routes/web".into()).await?;
        anyhow::Ok(serde_json::from_slice::<serde_json::Value>(&body)?)
    };
    let (mut answer, mut decided, mut spawned) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        // One warm replica, and the anchor: answers at one client.
        for _ in 0..10 {
            let sw = Stopwatch::start();
            let (status, _) = get(serve.proxy, "web.localhost", "/".into()).await?;
            anyhow::ensure!(status == 200, "the app answered {status}");
            answer.push(sw.elapsed().as_secs_f64() * 1e3);
        }
        let pids_before = children(serve.pid())?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let step = Stopwatch::start();
        let tasks: Vec<_> = (0..LIVE_CLIENTS)
            .map(|_| {
                let (get, stop) = (get.clone(), stop.clone());
                let to = serve.proxy;
                tokio::spawn(async move {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let _ = get(to, "web.localhost", "/".into()).await;
                    }
                })
            })
            .collect();
        let mut spawn_ms = None;
        let decision_ms = loop {
            if spawn_ms.is_none() && children(serve.pid())?.len() > pids_before.len() {
                spawn_ms = Some(step.elapsed().as_secs_f64() * 1e3);
            }
            // The route runs one replica until the load asks for more.
            if route().await?["desired"].as_u64().unwrap_or(0) > 1 {
                break step.elapsed().as_secs_f64() * 1e3;
            }
            anyhow::ensure!(
                step.elapsed() < Duration::from_secs(30),
                "no load decision within 30 s of the step"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        while spawn_ms.is_none() {
            if children(serve.pid())?.len() > pids_before.len() {
                spawn_ms = Some(step.elapsed().as_secs_f64() * 1e3);
            }
            anyhow::ensure!(
                step.elapsed() < Duration::from_secs(30),
                "no replica spawned"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        decided.push(decision_ms);
        spawned.extend(spawn_ms);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in tasks {
            t.await?;
        }
        // Back to one replica before the next step (the window, then halving each second).
        let back = Stopwatch::start();
        while children(serve.pid())?.len() > 1 {
            anyhow::ensure!(
                back.elapsed() < Duration::from_secs(60),
                "not back to one replica"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let anchor = median(answer);
    let (d, sp) = (median(decided), median(spawned));
    println!();
    println!(
        "Step in load on local processes ({rounds} steps from 1 to {LIVE_CLIENTS} clients, target 2 in flight per replica, medians):"
    );
    println!("| measure | value | ratio to the anchor |");
    println!("|---|---|---|");
    println!(
        "| anchor: one answer through ebb at one client (app: 100 ms) | {anchor:.1} ms | 1.00 |"
    );
    println!(
        "| step to ScaleRequested {{ reason: load }} | {d:.0} ms | {:.2} |",
        d / anchor
    );
    println!(
        "| step to the first new replica's spawn | {sp:.0} ms | {:.2} |",
        sp / anchor
    );
    Ok(())
}

/// The app processes `ebb serve` (pid `pid`) runs.
fn children(pid: u32) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let Ok(p) = entry?.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        let ppid = super::stat_field(&stat, 4).and_then(|v| v.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(p);
        }
    }
    Ok(out)
}
