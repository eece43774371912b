//! `ebb bench functions`: function instances end to end through a real `ebb serve` (a child
//! process with its own data directory): instances/s for a one-step no-op function and for a
//! three-step chain (clients invoking with `?wait` in a loop), and the time from `POST` to the
//! result for a warm function, one invocation at a time.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};

use ebb::clock::Stopwatch;

const TOKEN: &str = "bench";

/// Arguments of `ebb bench functions`.
#[derive(Debug, Clone, clap::Args)]
pub struct FunctionsBenchArgs {
    /// Seconds each throughput phase runs.
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    /// Concurrent clients in the throughput phases.
    #[arg(long, default_value_t = 32)]
    pub clients: usize,
    /// Invocations timed one at a time for the latency figures.
    #[arg(long, default_value_t = 500)]
    pub samples: usize,
}

use super::ServeChild as Serve;

fn serve() -> Result<Serve> {
    super::serve_child(&["--api-token", TOKEN, "--runner-capacity", "256"], None)
}

async fn post(
    client: &Client<HttpConnector, Full<Bytes>>,
    admin: SocketAddr,
    path: &str,
    body: String,
) -> Result<(u16, Value)> {
    let req = hyper::Request::post(format!("http://{admin}{path}"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Full::new(Bytes::from(body)))?;
    let resp = client.request(req).await?;
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await?.to_bytes();
    Ok((
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    ))
}

/// One invocation, waiting for its result; fails unless it succeeded.
async fn invoke(
    client: &Client<HttpConnector, Full<Bytes>>,
    admin: SocketAddr,
    function: &str,
) -> Result<()> {
    let (status, v) = post(
        client,
        admin,
        &format!("/api/funcs/{function}?wait=60"),
        "x".into(),
    )
    .await?;
    if status != 200 || v["state"] != "success" {
        bail!("{function}: {status} {v}");
    }
    Ok(())
}

async fn throughput(s: &Serve, function: &str, args: &FunctionsBenchArgs) -> Result<f64> {
    let phase = Duration::from_secs(args.seconds);
    let clock = Stopwatch::start();
    let mut clients = Vec::new();
    for _ in 0..args.clients {
        let admin = s.admin;
        let function = function.to_owned();
        clients.push(tokio::spawn(async move {
            let client = ebb::calls::runner::http_client();
            let clock = Stopwatch::start();
            let mut n = 0u64;
            while clock.elapsed() < phase {
                invoke(&client, admin, &function).await?;
                n += 1;
            }
            anyhow::Ok(n)
        }));
    }
    let mut total = 0;
    for c in clients {
        total += c.await??;
    }
    Ok(total as f64 / clock.elapsed().as_secs_f64())
}

/// Runs the benchmark and prints a table.
pub async fn run(args: FunctionsBenchArgs) -> Result<()> {
    let s = serve()?;
    let client = ebb::calls::runner::http_client();
    let template = |name: &str, function: &str, left: Option<&str>| {
        let mut t = json!({
            "name": name, "function": function, "command": ["ebb", "example-app"],
            "concurrency": 64, "initInstanceNum": 1, "minInstanceNum": 1, "maxInstanceNum": 2,
        });
        if let Some(l) = left {
            t["left"] = json!(l);
        }
        t.to_string()
    };
    for t in [
        template("noop", "noop", None),
        template("step1", "noop", Some("step2")),
        template("step2", "noop", Some("step3")),
        template("step3", "noop", None),
    ] {
        let (status, v) = post(&client, s.admin, "/api/funcs/template", t).await?;
        if status != 201 {
            bail!("creating a template: {status} {v}");
        }
    }
    // Warm: every function's workload up and its connections open.
    for _ in 0..20 {
        invoke(&client, s.admin, "noop").await?;
        invoke(&client, s.admin, "step1").await?;
    }
    println!(
        "ebb bench functions: example-app functions through ebb serve, {} clients, {} s phases",
        args.clients, args.seconds
    );
    println!("| measure | value |");
    println!("|---|---|");
    let one = throughput(&s, "noop", &args).await?;
    println!("| instances/s, one-step no-op function | {one:.0} |");
    let three = throughput(&s, "step1", &args).await?;
    println!("| instances/s, three-step chain | {three:.0} |");
    let mut ms = Vec::with_capacity(args.samples);
    for _ in 0..args.samples {
        let sw = Stopwatch::start();
        invoke(&client, s.admin, "noop").await?;
        ms.push(sw.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    println!(
        "| POST to result, warm one-step function, p50 / p99 ({} one at a time) | {:.2} ms / {:.2} ms |",
        ms.len(),
        super::percentile(&ms, 0.5),
        super::percentile(&ms, 0.99)
    );
    Ok(())
}
