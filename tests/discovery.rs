//! Service discovery and load balancing through the real proxy: `ebb serve` with meta services
//! (`[[service]]` in `ebb.toml`) in front of real app processes (`ebb example-app`) on loopback.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::common;

use common::controlplane::wait_until;
use common::http::{Http, client, send, send_body, send_json};

const DEADLINE: Duration = Duration::from_secs(60);

/// An app process on a loopback port, killed when dropped.
struct App {
    child: Child,
    addr: SocketAddr,
}

impl Drop for App {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl App {
    fn pid(&self) -> String {
        self.child.id().to_string()
    }
}

/// Starts `ebb example-app` with `args` and waits until it answers.
async fn app(c: &Http, args: &[&str]) -> App {
    let port = common::free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_ebb"))
        .args(["example-app", "--port", &port.to_string()])
        .args(args)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let app = App { child, addr };
    healthy(c, addr).await;
    app
}

/// Waits until the app at `addr` answers `/health`.
async fn healthy(c: &Http, addr: SocketAddr) {
    wait_until("the app answers", DEADLINE, || async {
        let req = hyper::Request::get(format!("http://{addr}/health"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        c.request(req)
            .await
            .is_ok_and(|r| r.status() == 200)
            .then_some(())
    })
    .await;
}

fn start(dir: &Path, config: &str) -> common::Ebb {
    let path = dir.join("ebb.toml");
    std::fs::write(&path, config).unwrap();
    common::serve(&dir.join("data"), Some(&path), None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_meta_service_routes_rewrites_and_changes_headers_through_the_proxy() {
    let c = client();
    let (a, b) = (app(&c, &[]).await, app(&c, &[]).await);
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        r#"
[[app]]
name = "demo"
domains = ["demo.localhost"]
command = ["ebb", "example-app"]
startup_timeout_ms = 20000
idle_after_ms = 300

[[service]]
name = "shop"
domains = ["shop.localhost", "*.shop.localhost"]

[[service.route]]
path = "/api/{{rest:**}}"
headers = {{ "x-canary" = "yes" }}
rewrite_path = "/canary/{{rest}}"
response_headers = {{ set = {{ "x-served-by" = "canary" }} }}
destinations = [{{ addresses = ["{b}"] }}]

[[service.route]]
path = "/api/{{rest:**}}"
rewrite_path = "/v1/{{rest}}"
destinations = [{{ service = "http://{a}" }}]

[[service.route]]
path = "/h"
rewrite_path = "/headers"
request_headers = {{ set = {{ "x-from" = "ebb" }}, add = {{ "x-tag" = "two" }}, remove = ["x-secret"] }}
destinations = [{{ addresses = ["{a}"] }}]

[[service.route]]
authority = "eu.shop.localhost"
destinations = [{{ addresses = ["{b}"] }}]

[[service.route]]
methods = ["POST"]
path = "/demo/**"
destinations = [{{ service = "ebb://demo" }}]

[[service.route]]
path = "/sleep"
destinations = [{{ service = "ebb://demo" }}]

[[service.route]]
path = "/split"
destinations = [{{ addresses = ["{a}"], weight = 3 }}, {{ addresses = ["{b}"], weight = 1 }}]
"#,
        a = a.addr,
        b = b.addr
    );
    let ebb = start(dir.path(), &config);
    let p = ebb.proxy;
    // Routing on a header, rewriting with a capture (the query kept), a response header set.
    let r = send(
        &c,
        p,
        "GET",
        "shop.localhost",
        "/api/books/12?x=1",
        &[("x-canary", "yes")],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-echo-path"), "/canary/books/12?x=1");
    assert_eq!(r.header("x-echo-pid"), b.pid());
    assert_eq!(r.header("x-served-by"), "canary");
    // Without the header: the next route, through a discovered `http://IP:port` destination.
    let r = send(&c, p, "GET", "shop.localhost", "/api/books", &[]).await;
    assert_eq!(r.header("x-echo-path"), "/v1/books");
    assert_eq!(r.header("x-echo-pid"), a.pid());
    assert_eq!(r.header("x-served-by"), "");
    // Request header changes: set, added and removed, as the app received them.
    let r = send(
        &c,
        p,
        "GET",
        "shop.localhost",
        "/h",
        &[("x-secret", "s"), ("x-tag", "one"), ("x-from", "client")],
    )
    .await;
    let lines: Vec<&str> = r.body.lines().collect();
    assert!(lines.contains(&"x-from: ebb"), "{lines:?}");
    assert!(!lines.contains(&"x-from: client"), "{lines:?}");
    assert!(
        lines.contains(&"x-tag: one") && lines.contains(&"x-tag: two"),
        "{lines:?}"
    );
    assert!(
        !lines.iter().any(|l| l.starts_with("x-secret")),
        "{lines:?}"
    );
    // Routing on the authority (a wildcard domain of the service).
    let r = send(&c, p, "GET", "eu.shop.localhost", "/anything", &[]).await;
    assert_eq!(r.header("x-echo-pid"), b.pid());
    // On the method, to one of ebb's own workloads (`ebb://demo`: its ready replicas), woken
    // from zero by the first request, held meanwhile.
    let r = send(&c, p, "POST", "shop.localhost", "/demo/x", &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let pid = r.header("x-echo-pid").to_owned();
    assert!(!pid.is_empty() && pid != a.pid() && pid != b.pid(), "{pid}");
    // Its requests are the app's: one under way for longer than the app's idle time keeps it
    // up until it is answered.
    let r = send(&c, p, "GET", "shop.localhost", "/sleep?ms=1500", &[]).await;
    assert_eq!((r.status, r.body.as_str()), (200, "slept 1500 ms\n"));
    // No route matches: a clear 404.
    let r = send(&c, p, "DELETE", "shop.localhost", "/nothing", &[]).await;
    assert_eq!(r.status, 404);
    let e: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(e["code"], "no_matching_route", "{e}");
    // Weighted destinations: 3 to 1, within a tolerance over 400 requests.
    let mut to_a = 0;
    for _ in 0..400 {
        let r = send(&c, p, "GET", "shop.localhost", "/split", &[]).await;
        if r.header("x-echo-pid") == a.pid() {
            to_a += 1;
        }
    }
    assert!(
        (255..=345).contains(&to_a),
        "{to_a} of 400 went to the weight-3 destination"
    );
    // Workload routes still serve as before beside the services.
    let r = send(&c, p, "GET", "demo.localhost", "/health", &[]).await;
    assert_eq!(r.status, 200);
}

/// Sends `n` requests, `concurrency` at a time, to `host`; how many each pid answered.
async fn spread(
    c: &Http,
    proxy: SocketAddr,
    host: &str,
    n: usize,
    concurrency: usize,
) -> HashMap<String, usize> {
    let counts = Arc::new(std::sync::Mutex::new(HashMap::new()));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (c, counts, next, host) = (c.clone(), counts.clone(), next.clone(), host.to_owned());
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n {
                let r = send(&c, proxy, "GET", &host, "/", &[]).await;
                assert_eq!(r.status, 200, "{}", r.body);
                *counts
                    .lock()
                    .unwrap()
                    .entry(r.header("x-echo-pid").to_owned())
                    .or_insert(0) += 1;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    Arc::try_unwrap(counts).unwrap().into_inner().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_request_min_load_and_peak_ewma_shift_traffic_away_from_a_slow_or_saturated_instance()
{
    let c = client();
    let fast = [app(&c, &[]).await, app(&c, &[]).await];
    let slow = app(&c, &["--answer-delay-ms", "200"]).await;
    let idle = [
        app(&c, &["--report-load", "0/4"]).await,
        app(&c, &["--report-load", "1/4"]).await,
    ];
    let full = app(&c, &["--report-load", "4/4"]).await;
    let dir = tempfile::tempdir().unwrap();
    let service = |name: &str, balancer: &str, addrs: &[SocketAddr]| {
        let list: Vec<String> = addrs.iter().map(|a| format!("\"{a}\"")).collect();
        format!(
            "[[service]]\nname = \"{name}\"\ndomains = [\"{name}.localhost\"]\npolicy = {{ balancer = \"{balancer}\" }}\n[[service.route]]\ndestinations = [{{ addresses = [{}] }}]\n",
            list.join(", ")
        )
    };
    let three = [fast[0].addr, fast[1].addr, slow.addr];
    let config = [
        service("rr", "round_robin", &three),
        service("lr", "least_request", &three),
        service("ewma", "peak_ewma", &three),
        service("load", "min_load", &[idle[0].addr, idle[1].addr, full.addr]),
    ]
    .concat();
    let ebb = start(dir.path(), &config);
    // Round robin, the control: the slow instance gets its third.
    let rr = spread(&c, ebb.proxy, "rr.localhost", 300, 6).await;
    let share = |m: &HashMap<String, usize>, pid: String| *m.get(&pid).unwrap_or(&0) as f64 / 300.0;
    assert!(share(&rr, slow.pid()) > 0.3, "{rr:?}");
    // Least request: requests pile up on the slow one, so it is picked less.
    let lr = spread(&c, ebb.proxy, "lr.localhost", 300, 6).await;
    assert!(share(&lr, slow.pid()) < 0.2, "least request: {lr:?}");
    // Peak EWMA: once it answered late, hardly any.
    let ewma = spread(&c, ebb.proxy, "ewma.localhost", 300, 6).await;
    assert!(share(&ewma, slow.pid()) < 0.1, "peak EWMA: {ewma:?}");
    // Min load: the instance that reports itself full gets only what its first answer took.
    let load = spread(&c, ebb.proxy, "load.localhost", 300, 6).await;
    assert!(share(&load, full.pid()) < 0.1, "min load: {load:?}");
    assert!(
        share(&load, idle[0].pid()) > share(&load, idle[1].pid()),
        "{load:?}"
    );
}

/// dnsmasq on a loopback port, answering from a hosts file with a TTL of one second; killed when
/// dropped.
struct Dnsmasq {
    child: Child,
    addr: SocketAddr,
    hosts: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Dnsmasq {
    fn start(records: &str) -> Dnsmasq {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        // dnsmasq reads the file after dropping its privileges.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let hosts = dir.path().join("hosts");
        std::fs::write(&hosts, records).unwrap();
        std::fs::set_permissions(&hosts, std::fs::Permissions::from_mode(0o644)).unwrap();
        let port = common::free_port();
        let program = if Path::new("/usr/sbin/dnsmasq").exists() {
            "/usr/sbin/dnsmasq"
        } else {
            "dnsmasq"
        };
        let child = Command::new(program)
            .args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
                "--listen-address=127.0.0.1",
                "--local-ttl=1",
                "--log-facility=-",
                &format!("--port={port}"),
                &format!("--addn-hosts={}", hosts.display()),
                &format!("--pid-file={}", dir.path().join("pid").display()),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("dnsmasq (Debian's dnsmasq-base; scripts/test installs it)");
        Dnsmasq {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            hosts,
            _dir: dir,
        }
    }

    /// Replaces the records and has dnsmasq read them again (SIGHUP).
    fn set(&self, records: &str) {
        std::fs::write(&self.hosts, records).unwrap();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGHUP,
        )
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_destinations_follow_their_records_ttl_and_old_instances_drain() {
    let c = client();
    // Two apps on the same port of two loopback addresses: the name moves from one to the other.
    let port = common::free_port();
    let spawn = |ip: &str| {
        Command::new(env!("CARGO_BIN_EXE_ebb"))
            .args(["example-app", "--host", ip, "--port", &port.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    };
    let a = App {
        child: spawn("127.0.0.2"),
        addr: SocketAddr::from(([127, 0, 0, 2], port)),
    };
    let b = App {
        child: spawn("127.0.0.3"),
        addr: SocketAddr::from(([127, 0, 0, 3], port)),
    };
    for app in [&a, &b] {
        healthy(&c, app.addr).await;
    }
    let dns = Dnsmasq::start("127.0.0.2 api.shop.test\n");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ebb.toml");
    std::fs::write(
        &path,
        format!(
            "[[service]]\nname = \"shop\"\ndomains = [\"shop.localhost\"]\n[[service.route]]\ndestinations = [{{ service = \"http://api.shop.test:{port}\" }}]\n"
        ),
    )
    .unwrap();
    let dns_server = dns.addr.to_string();
    let ebb = common::serve_with(
        &dir.path().join("data"),
        Some(&path),
        None,
        &["--dns-server", &dns_server],
    );
    let p = ebb.proxy;
    let r = send(&c, p, "GET", "shop.localhost", "/x", &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-echo-pid"), a.pid());
    // A request under way on the old address when the record changes: its body is still being
    // sent (the app echoes it as it comes), its answer's head already back from the old address.
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    let stream = Box::pin(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| {
            (
                Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(b)),
                rx,
            )
        })
    }));
    let streaming: Client<HttpConnector, _> = Client::builder(TokioExecutor::new()).build_http();
    let req = hyper::Request::post(format!("http://{p}/x"))
        .header("host", "shop.localhost")
        .body(http_body_util::StreamBody::new(stream))
        .unwrap();
    tx.send(Bytes::from_static(b"first ")).await.unwrap();
    let under_way = streaming.request(req).await.unwrap();
    assert_eq!(under_way.headers()["x-echo-pid"].to_str().unwrap(), a.pid());
    dns.set("127.0.0.3 api.shop.test\n");
    // Within the record's TTL (and the cache's refresh), requests go to the new address.
    wait_until("the new address is used", DEADLINE, || async {
        let r = send(&c, p, "GET", "shop.localhost", "/x", &[]).await;
        (r.header("x-echo-pid") == b.pid()).then_some(())
    })
    .await;
    for _ in 0..20 {
        let r = send(&c, p, "GET", "shop.localhost", "/x", &[]).await;
        assert_eq!(
            r.header("x-echo-pid"),
            b.pid(),
            "no new request for the old address"
        );
    }
    // The request under way on the old address finishes there, whole.
    tx.send(Bytes::from_static(b"second")).await.unwrap();
    drop(tx);
    let body = under_way.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"first second");
    // Two addresses for the name: both serve.
    dns.set("127.0.0.2 api.shop.test\n127.0.0.3 api.shop.test\n");
    let seen = std::sync::Mutex::new(std::collections::BTreeSet::new());
    wait_until("both addresses serve", DEADLINE, || async {
        let r = send(&c, p, "GET", "shop.localhost", "/x", &[]).await;
        let mut seen = seen.lock().unwrap();
        seen.insert(r.header("x-echo-pid").to_owned());
        (seen.len() == 2).then_some(())
    })
    .await;
}

/// A function served at a DNS name (`serviceAddress`) is called on the name's addresses, one
/// picked per step by the template's traffic policy, and follows the name's records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_served_at_a_dns_name_is_called_on_the_addresses_its_policy_picks() {
    let c = client();
    // One function server per loopback address, on the same port, each its own function.
    let port = common::free_port();
    let spawn = |ip: &str, function: &str| {
        Command::new(env!("CARGO_BIN_EXE_ebb"))
            .args(["example-app", "--host", ip, "--port", &port.to_string()])
            .args(["--function", function])
            .env_remove("EBB_FUNCTION")
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    };
    let upper = App {
        child: spawn("127.0.0.2", "upper"),
        addr: SocketAddr::from(([127, 0, 0, 2], port)),
    };
    let reverse = App {
        child: spawn("127.0.0.3", "reverse"),
        addr: SocketAddr::from(([127, 0, 0, 3], port)),
    };
    for app in [&upper, &reverse] {
        healthy(&c, app.addr).await;
    }
    let dns = Dnsmasq::start("127.0.0.2 fn.test\n127.0.0.3 fn.test\n");
    let dir = tempfile::tempdir().unwrap();
    let dns_server = dns.addr.to_string();
    let ebb = common::serve_with(
        &dir.path().join("data"),
        None,
        None,
        &["--dns-server", &dns_server, "--api-token", "t"],
    );
    let admin = ebb.admin;
    let auth = [("authorization", "Bearer t")];
    let template = serde_json::json!({
        "name": "spread",
        "function": "x",
        "serviceAddress": format!("http://fn.test:{port}"),
        "trafficPolicy": { "balancer": "round_robin" },
    });
    let r = send_json(&c, admin, "POST", "/api/funcs/template", &auth, &template).await;
    assert_eq!(r.status, 201, "{}", r.body);
    let invoke = || async {
        let body = Bytes::from_static(b"abc");
        let r = send_body(
            &c,
            admin,
            "POST",
            "x",
            "/api/funcs/spread?wait=30",
            &auth,
            body,
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        v["result"].as_str().unwrap_or_default().to_owned()
    };
    // Round robin over both addresses: every other step on each.
    let mut results = Vec::new();
    for _ in 0..10 {
        results.push(invoke().await);
    }
    let count = |want: &str| results.iter().filter(|r| *r == want).count();
    assert_eq!(
        (count("ABC"), count("cba")),
        (5, 5),
        "both addresses, in turn: {results:?}"
    );
    // The name moves to one address: steps follow within its TTL (two in a row on the same
    // address: round robin over both never does that).
    dns.set("127.0.0.3 fn.test\n");
    wait_until("only the remaining address is called", DEADLINE, || async {
        (invoke().await == "cba" && invoke().await == "cba").then_some(())
    })
    .await;
    for _ in 0..10 {
        assert_eq!(invoke().await, "cba", "no step for the address gone");
    }
}

/// A gRPC call whose body no length announces (as gRPC clients send it), drawn onto an instance
/// that refuses the connection: ebb sends it again to the other instance whole, never without
/// its message. Every call is answered with its message echoed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_with_a_body_is_never_sent_again_without_it() {
    use http_body_util::StreamBody;
    use hyper::body::Frame;

    let c = client();
    let live = app(&c, &[]).await;
    // A port bound but never listening: connections to it are refused, and no other process
    // can take it while the socket is held.
    let refusing = tokio::net::TcpSocket::new_v4().unwrap();
    refusing
        .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .unwrap();
    let dead = refusing.local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        r#"
[[service]]
name = "greeter"
domains = ["greeter.localhost"]
policy = {{ balancer = "round_robin" }}

[[service.route]]
destinations = [{{ addresses = ["{dead}", "{live}"] }}]
"#,
        live = live.addr
    );
    let ebb = start(dir.path(), &config);
    let mut h2 = common::http::h2c(ebb.proxy).await;
    // HelloRequest { name: "world" }, which the example app echoes as the reply.
    const HELLO: &[u8] = b"\0\0\0\0\x07\x0a\x05world";
    let (mut echoed, mut refused) = (0, 0);
    for _ in 0..4 {
        let frames = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(Frame::data(
            Bytes::from_static(HELLO),
        ))]);
        let req = hyper::Request::post("http://greeter.localhost/helloworld.Greeter/SayHello")
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(StreamBody::new(frames))
            .unwrap();
        let resp = h2.send_request(req).await.unwrap();
        let head_status = resp.headers().get("grpc-status").cloned();
        let collected = resp.into_body().collect().await.unwrap();
        let status = head_status
            .or_else(|| {
                collected
                    .trailers()
                    .and_then(|t| t.get("grpc-status").cloned())
            })
            .expect("a grpc-status");
        let body = collected.to_bytes();
        if status == "0" {
            assert_eq!(
                &body[..],
                HELLO,
                "a call answered OK carries its message back"
            );
            echoed += 1;
        } else {
            assert_eq!(status, "14", "the refused call is UNAVAILABLE");
            refused += 1;
        }
    }
    // Round robin over the two: half met the refusing one first, and went again, whole.
    assert_eq!((echoed, refused), (4, 0));
    // The same for an HTTP/1.0 request with a body (hyper's hop, not the HTTP/1.1 fast path).
    for _ in 0..2 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut tcp = tokio::net::TcpStream::connect(ebb.proxy).await.unwrap();
        tcp.write_all(
            b"POST /echo HTTP/1.0\r\nHost: greeter.localhost\r\nContent-Length: 5\r\n\r\nhello",
        )
        .await
        .unwrap();
        let mut answer = Vec::new();
        tcp.read_to_end(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
        assert!(answer.ends_with("\r\n\r\nhello"), "{answer}");
    }
    drop(refusing);
}
