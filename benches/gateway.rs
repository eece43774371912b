//! The Gateway API benchmark (`benches/gateway.sh`): one HTTPRoute with a header match
//! (`x-bench: yes`) and a path rewrite (`/api/...` to `/...`) to a Service whose endpoint is the
//! example app (a manual EndpointSlice: no node needed), with ebb as the Gateway, against nginx
//! configured to do the same (`if` on the header, `rewrite ... break`, a keep-alive upstream) and
//! against the app directly, all in one network namespace on the real control plane. wrk drives
//! each in turn, rounds alternating, and the figures are medians: throughput and p99 latency,
//! with ebb's ratios to nginx and to the app.
//!
//! Not a test (`test = false`): `benches/gateway.sh` runs it on the `ci` profile.

#[path = "../tests/common/mod.rs"]
mod common;

use std::process::Command;
use std::time::Duration;

use common::controlplane::{ControlPlane, NODE_IP, wait_for};
use common::ebbkube::{apply, json, serve_kube};

const ROUNDS: usize = 3;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// wrk's figure with a unit (`812.34us`, `1.20ms`, `2.01s`) in microseconds.
fn micros(text: &str) -> f64 {
    let (n, scale) = if let Some(n) = text.strip_suffix("us") {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix("ms") {
        (n, 1_000.0)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1_000_000.0)
    } else {
        (text, 1.0)
    };
    n.parse::<f64>().unwrap_or(f64::NAN) * scale
}

/// Requests per second and p99 in microseconds of `seconds` of wrk against `url`.
fn wrk(url: &str, seconds: u64, conns: u32, headers: &[&str]) -> (f64, f64) {
    let mut cmd = Command::new("wrk");
    cmd.args([
        "-t2",
        &format!("-c{conns}"),
        &format!("-d{seconds}s"),
        "--latency",
    ]);
    for h in headers {
        cmd.args(["-H", h]);
    }
    let out = cmd
        .arg(url)
        .output()
        .expect("wrk (Debian: apt-get install wrk)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        !text.contains("Non-2xx"),
        "{url}: answers other than 2xx:\n{text}"
    );
    let rps = text
        .lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("wrk printed no throughput:\n{text}"));
    let p99 = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("99%"))
        .map(|v| micros(v.trim()))
        .unwrap_or_else(|| panic!("wrk printed no p99:\n{text}"));
    (rps, p99)
}

async fn run() {
    let seconds: u64 = std::env::var("BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let conns: u32 = std::env::var("BENCH_CONNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64);
    let cp = ControlPlane::start().await;
    let suite =
        std::path::PathBuf::from(std::env::var("EBB_GATEWAY_SUITE").expect("EBB_GATEWAY_SUITE"));
    cp.kubectl(&[
        "apply",
        "--server-side",
        "-f",
        suite.join("crds").to_str().unwrap(),
    ]);

    // The app, on the node's address (the API server takes no loopback endpoint).
    let app_port = 18_101;
    let mut app = Command::new(env!("CARGO_BIN_EXE_ebb"))
        .args([
            "example-app",
            "--host",
            NODE_IP,
            "--port",
            &app_port.to_string(),
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("the example app");
    let app_addr = format!("{NODE_IP}:{app_port}");
    wait_for("the app", Duration::from_secs(30), || {
        common::controlplane::http_get(&app_addr, "/health").is_some()
    })
    .await;

    apply(
        &cp,
        &format!(
            r#"
apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata: {{name: ebb}}
spec: {{controllerName: {controller}}}
---
apiVersion: v1
kind: Service
metadata: {{name: bench, namespace: default}}
spec:
  ports: [{{name: http, port: 80, targetPort: {app_port}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: bench-1
  namespace: default
  labels: {{kubernetes.io/service-name: bench}}
addressType: IPv4
ports: [{{name: http, port: {app_port}, protocol: TCP}}]
endpoints: [{{addresses: ["{NODE_IP}"], conditions: {{ready: true}}}}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: web, namespace: default}}
spec:
  gatewayClassName: ebb
  listeners: [{{name: http, port: 80, protocol: HTTP}}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: bench, namespace: default}}
spec:
  parentRefs: [{{name: web}}]
  hostnames: [bench.test]
  rules:
  - matches: [{{path: {{type: PathPrefix, value: /api}}, headers: [{{name: x-bench, value: "yes"}}]}}]
    filters: [{{type: URLRewrite, urlRewrite: {{path: {{type: ReplacePrefixMatch, replacePrefixMatch: /}}}}}}]
    backendRefs: [{{name: bench, port: 80}}]
"#,
            controller = ebb::gateway::CONTROLLER_NAME,
        ),
    );
    let data = tempfile::tempdir().expect("tempdir");
    let _ebb = serve_kube(
        &cp,
        data.path(),
        &[
            "--kube-lease-ms=3000",
            "--gateway",
            "--gateway-address-pool",
            "127.0.1.1-127.0.1.1",
        ],
    );
    let through_ebb = "127.0.1.1:80";
    wait_for("the route through ebb", Duration::from_secs(60), || {
        let accepted =
            json(&cp.kubectl(&["get", "httproute", "bench", "-o", "json"]))["status"]["parents"][0]
                ["conditions"]
                .as_array()
                .is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c["type"] == "Accepted" && c["status"] == "True")
                });
        accepted
            && common::controlplane::http_get_with(
                through_ebb,
                "/api/pid",
                &["Host: bench.test", "x-bench: yes"],
            )
            .is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    })
    .await;

    // nginx doing the same.
    let work = tempfile::tempdir().expect("tempdir");
    let w = work.path().display();
    let nginx_port = 18_102;
    std::fs::write(
        work.path().join("nginx.conf"),
        format!(
            r#"worker_processes 2;
daemon off;
pid {w}/nginx.pid;
error_log {w}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {w}/body;
  proxy_temp_path {w}/proxy;
  fastcgi_temp_path {w}/fastcgi;
  uwsgi_temp_path {w}/uwsgi;
  scgi_temp_path {w}/scgi;
  upstream bench {{ server {app_addr}; keepalive 256; }}
  server {{
    listen 127.0.0.1:{nginx_port};
    server_name bench.test;
    location / {{ return 404; }}
    location /api {{
      if ($http_x_bench != "yes") {{ return 404; }}
      rewrite ^/api/?(.*)$ /$1 break;
      proxy_pass http://bench;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host $host;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto $scheme;
      proxy_set_header X-Forwarded-Host $host;
      proxy_set_header Forwarded "for=$remote_addr;host=\"$host\";proto=$scheme";
    }}
  }}
}}
"#
        ),
    )
    .unwrap();
    let mut nginx = Command::new("nginx")
        .args(["-p", &w.to_string(), "-c", &format!("{w}/nginx.conf")])
        .spawn()
        .expect("nginx (Debian: apt-get install nginx)");
    let through_nginx = format!("127.0.0.1:{nginx_port}");
    wait_for("nginx", Duration::from_secs(30), || {
        common::controlplane::http_get_with(
            &through_nginx,
            "/api/pid",
            &["Host: bench.test", "x-bench: yes"],
        )
        .is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    })
    .await;

    let headers = ["Host: bench.test", "x-bench: yes"];
    let (mut ebb_rps, mut ebb_p99, mut nginx_rps, mut nginx_p99, mut app_rps, mut app_p99) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..ROUNDS {
        let (r, p) = wrk(
            &format!("http://{through_ebb}/api/pid"),
            seconds,
            conns,
            &headers,
        );
        ebb_rps.push(r);
        ebb_p99.push(p);
        let (r, p) = wrk(
            &format!("http://{through_nginx}/api/pid"),
            seconds,
            conns,
            &headers,
        );
        nginx_rps.push(r);
        nginx_p99.push(p);
        let (r, p) = wrk(&format!("http://{app_addr}/pid"), seconds, conns, &[]);
        app_rps.push(r);
        app_p99.push(p);
    }
    let (er, ep, nr, np, ar, ap) = (
        median(ebb_rps),
        median(ebb_p99),
        median(nginx_rps),
        median(nginx_p99),
        median(app_rps),
        median(app_p99),
    );
    println!(
        "HTTPRoute with a header match and a path rewrite, wrk -t2 -c{conns} -d{seconds}s, median of {ROUNDS} rounds (2 cores shared by wrk, the proxy and the app):"
    );
    println!("| through | requests/s | p99 |");
    println!("|---|---|---|");
    println!(
        "| the app directly (anchor) | {ar:.0} | {:.2} ms |",
        ap / 1000.0
    );
    println!("| nginx | {nr:.0} | {:.2} ms |", np / 1000.0);
    println!("| ebb as the Gateway | {er:.0} | {:.2} ms |", ep / 1000.0);
    println!(
        "ebb/nginx: throughput {:.2}, p99 {:.2}; ebb/app: throughput {:.2}, p99 {:.2}",
        er / nr,
        ep / np,
        er / ar,
        ep / ap
    );
    // SIGTERM: nginx's master stops its workers (SIGKILL would leave them running).
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(nginx.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = nginx.wait();
    let _ = app.kill();
    let _ = app.wait();
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(run());
}
