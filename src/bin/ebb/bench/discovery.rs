//! `ebb bench discovery`, two parts:
//!
//! * **Picks**: nanoseconds per pick of each load balancer over 3, 100, 1,000 and 10,000
//!   instances, against the cheapest pick there is measured in the same run (one uniform random
//!   index from the same generator), on one thread. Picks go through the same [`Picker::pick`]
//!   the proxy calls, with a filter that keeps every instance, and the power-of-choices balancers
//!   see requests under way (a quarter of the instances busy).
//! * **Throughput**: requests/s through the proxy in front of 1 and of 4 replicas of the example
//!   app, against the app asked directly, the same closed-loop load from this process.
//! * **The slow replica** (Linkerd's experiment): `ebb serve` in front of four replicas of the
//!   example app, one of them answering 2 s late, under closed-loop load; the latency
//!   percentiles of all requests with peak EWMA and with round robin, against the same load on
//!   four healthy replicas in the same run.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use ebb::clock::Stopwatch;
use ebb::discovery::{Balancer, HashOn, Instance, PickAt, Picker, Policy, hash_key};

/// Arguments of `ebb bench discovery`.
#[derive(Debug, Clone, clap::Args)]
pub struct DiscoveryBenchArgs {
    /// Milliseconds each measurement runs.
    #[arg(long, default_value_t = 300)]
    pub millis: u64,
    /// Instance counts measured.
    #[arg(long, value_delimiter = ',', default_value = "3,100,1000,10000")]
    pub sizes: Vec<usize>,
    /// Seconds of load per policy in the slow-replica experiment (0: skip it).
    #[arg(long, default_value_t = 20)]
    pub slow_seconds: u64,
    /// Requests under way at once in the slow-replica experiment.
    #[arg(long, default_value_t = 16)]
    pub connections: usize,
    /// Requests under way at once in the throughput measurement.
    #[arg(long, default_value_t = 64)]
    pub throughput_connections: usize,
    /// How late the slow replica answers, in ms.
    #[arg(long, default_value_t = 2_000)]
    pub slow_ms: u64,
    /// Seconds of load per target in the throughput measurement (0: skip it).
    #[arg(long, default_value_t = 10)]
    pub throughput_seconds: u64,
}

/// Runs `f` in batches for about `millis`; nanoseconds per call.
fn per_call(millis: u64, mut f: impl FnMut(u64) -> usize) -> f64 {
    let budget = Duration::from_millis(millis);
    let sw = Stopwatch::start();
    let (mut calls, mut sink) = (0u64, 0usize);
    while sw.elapsed() < budget {
        for _ in 0..1_000 {
            sink = sink.wrapping_add(f(calls));
            calls += 1;
        }
    }
    std::hint::black_box(sink);
    sw.elapsed().as_nanos() as f64 / calls as f64
}

/// Runs the benchmark and prints its tables.
pub async fn run(args: DiscoveryBenchArgs) -> Result<()> {
    picks(&args);
    if args.slow_seconds > 0 {
        println!();
        slow_replica(&args).await?;
    }
    if args.throughput_seconds > 0 {
        println!();
        throughput(&args).await?;
    }
    Ok(())
}

/// The proxy's throughput in front of 1 and of 4 replicas of the example app (peak EWMA),
/// against the app asked directly, the same load generator and connections for each.
async fn throughput(args: &DiscoveryBenchArgs) -> Result<()> {
    let exe = std::env::current_exe()?;
    let (_direct_app, direct, _) = super::spawn_app(&exe, &[], Duration::from_millis(20)).await?;
    let app = |name: &str, n: u32| {
        format!(
            "[[app]]\nname = \"{name}\"\ndomains = [\"{name}.localhost\"]\ncommand = [\"ebb\", \"example-app\"]\nmin_replicas = {n}\nmax_replicas = {n}\nidle_after_ms = 600000\n"
        )
    };
    let ebb = serve(&(app("one", 1) + &app("four", 4)))?;
    // Woken, and every replica seen answering.
    for (host, n) in [("one.localhost", 1), ("four.localhost", 4)] {
        let mut pids = std::collections::BTreeSet::new();
        let sw = Stopwatch::start();
        while pids.len() < n {
            anyhow::ensure!(
                sw.elapsed() < Duration::from_secs(60),
                "{host}: {n} replicas not ready"
            );
            pids.insert(get_body(ebb.proxy, host, "/pid").await?);
        }
    }
    println!(
        "proxy throughput: {} requests under way, {} s each, GET / (echo), closed loop from this process; anchor: the app directly",
        args.throughput_connections, args.throughput_seconds
    );
    println!(
        "{:<30}{:>14}{:>10}{:>10}{:>12}",
        "target", "requests/s", "p50", "p99", "/ anchor"
    );
    let mut anchor = None;
    for (what, addr, host) in [
        ("anchor: the app directly", direct, "direct"),
        ("ebb, 1 replica", ebb.proxy, "one.localhost"),
        ("ebb, 4 replicas", ebb.proxy, "four.localhost"),
    ] {
        let lat = load(
            addr,
            host,
            args.throughput_connections,
            args.throughput_seconds,
        )
        .await?;
        let rate = lat.len() as f64 / args.throughput_seconds as f64;
        let base = *anchor.get_or_insert(rate);
        println!(
            "{what:<30}{rate:>14.0}{:>10.2}{:>10.2}{:>12.2}",
            super::percentile(&lat, 0.5),
            super::percentile(&lat, 0.99),
            rate / base
        );
    }
    Ok(())
}

/// One GET's body.
async fn get_body(proxy: SocketAddr, host: &str, path: &str) -> Result<String> {
    use http_body_util::{BodyExt, Full};
    let client: hyper_util::client::legacy::Client<_, Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let req = hyper::Request::get(format!("http://{proxy}{path}"))
        .header("host", host)
        .body(Full::new(bytes::Bytes::new()))?;
    let resp = client.request(req).await?;
    let body = resp.into_body().collect().await?.to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

fn serve(config: &str) -> Result<super::ServeChild> {
    super::serve_child(&[], Some(config))
}

/// Latencies (ms) of every request sent to `host` by `connections` loops for `seconds`.
async fn load(proxy: SocketAddr, host: &str, connections: usize, seconds: u64) -> Result<Vec<f64>> {
    use http_body_util::{BodyExt, Full};
    let client: hyper_util::client::legacy::Client<_, Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let budget = Duration::from_secs(seconds);
    let sw = Stopwatch::start();
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let (client, host) = (client.clone(), host.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            while sw.elapsed() < budget {
                let req = hyper::Request::get(format!("http://{proxy}/"))
                    .header("host", &host)
                    .body(Full::new(bytes::Bytes::new()))?;
                let t = Stopwatch::start();
                let resp = client.request(req).await?;
                anyhow::ensure!(resp.status() == 200, "{host}: {}", resp.status());
                resp.into_body().collect().await?;
                lat.push(t.elapsed().as_secs_f64() * 1_000.0);
            }
            Ok::<_, anyhow::Error>(lat)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    all.sort_by(f64::total_cmp);
    Ok(all)
}

/// Linkerd's slow-replica experiment.
async fn slow_replica(args: &DiscoveryBenchArgs) -> Result<()> {
    let exe = std::env::current_exe()?;
    let poll = Duration::from_millis(20);
    let mut apps = Vec::new();
    for _ in 0..4 {
        apps.push(super::spawn_app(&exe, &[], poll).await?);
    }
    let delay = args.slow_ms.to_string();
    apps.push(super::spawn_app(&exe, &["--answer-delay-ms", &delay], poll).await?);
    let addrs: Vec<String> = apps.iter().map(|(_, a, _)| format!("\"{a}\"")).collect();
    let healthy = addrs[..4].join(", ");
    let with_slow = format!("{}, {}", addrs[..3].join(", "), addrs[4]);
    let service = |name: &str, balancer: &str, list: &str| {
        format!(
            "[[service]]\nname = \"{name}\"\ndomains = [\"{name}.localhost\"]\npolicy = {{ balancer = \"{balancer}\" }}\n[[service.route]]\ndestinations = [{{ addresses = [{list}] }}]\n"
        )
    };
    let config = [
        service("healthy", "peak_ewma", &healthy),
        service("ewma", "peak_ewma", &with_slow),
        service("rr", "round_robin", &with_slow),
    ]
    .concat();
    let ebb = serve(&config)?;
    println!(
        "the slow replica: 4 replicas of the example app, one answering {} ms late; {} requests under way for {} s each; latency in ms",
        args.slow_ms, args.connections, args.slow_seconds
    );
    println!(
        "{:<34}{:>10}{:>10}{:>10}{:>10}{:>12}{:>16}",
        "policy", "requests", "p50", "p99", "p99.9", "max", "p99.9 / anchor"
    );
    let mut anchor = None;
    for (host, what) in [
        ("healthy.localhost", "anchor: peak EWMA, all healthy"),
        ("ewma.localhost", "peak EWMA, one slow"),
        ("rr.localhost", "round robin, one slow"),
    ] {
        let lat = load(ebb.proxy, host, args.connections, args.slow_seconds).await?;
        let p = |q: f64| super::percentile(&lat, q);
        let p999 = p(0.999);
        let base = *anchor.get_or_insert(p999);
        println!(
            "{what:<34}{:>10}{:>10.2}{:>10.2}{:>10.2}{:>12.2}{:>16.2}",
            lat.len(),
            p(0.5),
            p(0.99),
            p999,
            lat.last().copied().unwrap_or(0.0),
            p999 / base
        );
    }
    drop(ebb);
    drop(apps);
    Ok(())
}

fn picks(args: &DiscoveryBenchArgs) {
    println!(
        "ns per pick, one thread, {} ms per cell; anchor: one uniform random index (ChaCha8)",
        args.millis
    );
    print!("{:<22}", "balancer");
    for n in &args.sizes {
        print!("{:>18}", format!("n={n}"));
    }
    println!();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut anchor = Vec::new();
    print!("{:<22}", "anchor (random index)");
    for &n in &args.sizes {
        let ns = per_call(args.millis, |_| {
            ((rng.next_u64() as u128 * n as u128) >> 64) as usize
        });
        anchor.push(ns);
        print!("{:>18}", format!("{ns:.1}"));
    }
    println!();
    for b in Balancer::ALL {
        let mut policy = Policy::of(b);
        policy.hash_on = Some(HashOn::Path);
        print!("{:<22}", b.name());
        for (k, &n) in args.sizes.iter().enumerate() {
            let items: Vec<Instance> = (0..n)
                .map(|i| {
                    let addr =
                        SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 8080));
                    Instance::new(addr, 1 + (i % 4) as u32, 0, 30)
                })
                .collect();
            for (i, it) in items.iter().enumerate() {
                if i % 4 == 0 {
                    it.try_begin(0);
                }
                it.set_load_factor((i % 10) as f64 / 10.0);
            }
            let picker = Picker::new(&policy, items, &mut rng);
            let keys: Vec<u64> = (0..1_024u64).map(|k| hash_key(&k.to_le_bytes())).collect();
            let ns = per_call(args.millis, |c| {
                let at = PickAt {
                    now_us: 1_000_000,
                    key: Some(keys[(c & 1_023) as usize]),
                };
                picker.pick(&at, &mut rng, |_| true).unwrap_or(0)
            });
            print!("{:>18}", format!("{ns:.1} ({:.1}x)", ns / anchor[k]));
        }
        println!();
    }
}
