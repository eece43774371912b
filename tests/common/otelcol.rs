//! The OpenTelemetry Collector the tracing tests export to: built from its Go modules by
//! `scripts/otelcol` (`$EBB_OTELCOL` names a build), listening for OTLP on loopback (gRPC and
//! HTTP), writing every batch it receives to a file as OTLP JSON, which [`Collector::spans`]
//! reads back.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::free_port;

/// The collector's binary: `$EBB_OTELCOL`, else what `scripts/otelcol build` prints.
pub fn otelcol() -> PathBuf {
    if let Some(p) = std::env::var_os("EBB_OTELCOL") {
        return PathBuf::from(p);
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/otelcol");
    let out = Command::new(&script)
        .arg("build")
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {script:?}: {e}"));
    assert!(out.status.success(), "{script:?} build failed");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// A collector on loopback, killed when dropped.
pub struct Collector {
    child: Option<Child>,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    dir: tempfile::TempDir,
}

/// One span as the collector received it.
#[derive(Debug, Clone)]
pub struct Span {
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent: String,
    pub name: String,
    pub kind: i64,
    /// The service that sent it (its resource's `service.name`).
    pub service: String,
    pub attributes: HashMap<String, serde_json::Value>,
    /// The spans it links to: (trace id, span id).
    pub links: Vec<(String, String)>,
}

impl Span {
    /// An attribute's value as text (strings as they are, numbers as written).
    pub fn attr(&self, key: &str) -> Option<String> {
        let v = self.attributes.get(key)?;
        v.get("stringValue")
            .and_then(|s| s.as_str().map(str::to_owned))
            .or_else(|| {
                v.get("intValue").map(|i| match i {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
            })
            .or_else(|| v.get("boolValue").map(|b| b.to_string()))
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Collector {
    /// Starts a collector on free loopback ports and waits until its HTTP receiver answers.
    pub async fn start() -> Collector {
        let dir = tempfile::tempdir().unwrap();
        let (grpc, http) = (free_port(), free_port());
        let out = dir.path().join("traces.jsonl");
        let config = format!(
            "receivers:\n  otlp:\n    protocols:\n      grpc:\n        endpoint: 127.0.0.1:{grpc}\n      http:\n        endpoint: 127.0.0.1:{http}\n\
             exporters:\n  file:\n    path: {}\n    flush_interval: 50ms\n\
             service:\n  telemetry:\n    metrics:\n      level: none\n  pipelines:\n    traces:\n      receivers: [otlp]\n      exporters: [file]\n",
            out.display()
        );
        let config_path = dir.path().join("config.yaml");
        std::fs::write(&config_path, config).unwrap();
        let log = std::fs::File::create(dir.path().join("collector.log")).unwrap();
        let child = Command::new(otelcol())
            .arg("--config")
            .arg(&config_path)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", otelcol()));
        let mut c = Collector {
            child: Some(child),
            grpc: format!("127.0.0.1:{grpc}").parse().unwrap(),
            http: format!("127.0.0.1:{http}").parse().unwrap(),
            dir,
        };
        let up = async {
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            loop {
                tick.tick().await;
                if let Some(status) = c.child.as_mut().and_then(|ch| ch.try_wait().ok().flatten()) {
                    panic!(
                        "the collector exited while starting ({status}): {}",
                        c.log()
                    );
                }
                let (g, h) = (
                    tokio::net::TcpStream::connect(c.grpc).await,
                    tokio::net::TcpStream::connect(c.http).await,
                );
                if g.is_ok() && h.is_ok() {
                    return;
                }
            }
        };
        if tokio::time::timeout(Duration::from_secs(60), up)
            .await
            .is_err()
        {
            panic!("the collector did not listen in 60 s: {}", c.log());
        }
        c
    }

    /// The collector's own log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("collector.log")).unwrap_or_default()
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        let text =
            std::fs::read_to_string(self.dir.path().join("traces.jsonl")).unwrap_or_default();
        let mut spans = Vec::new();
        // A line still being written does not parse yet: it is read on the next call.
        for batch in text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        {
            for rs in batch["resourceSpans"].as_array().into_iter().flatten() {
                let service = attributes(&rs["resource"]["attributes"])
                    .get("service.name")
                    .and_then(|v| v["stringValue"].as_str())
                    .unwrap_or_default()
                    .to_owned();
                for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                    for s in ss["spans"].as_array().into_iter().flatten() {
                        let text = |k: &str| s[k].as_str().unwrap_or_default().to_owned();
                        spans.push(Span {
                            trace_id: text("traceId"),
                            span_id: text("spanId"),
                            parent: text("parentSpanId"),
                            name: text("name"),
                            kind: s["kind"].as_i64().unwrap_or(0),
                            service: service.clone(),
                            attributes: attributes(&s["attributes"]),
                            links: s["links"]
                                .as_array()
                                .into_iter()
                                .flatten()
                                .map(|l| {
                                    (
                                        l["traceId"].as_str().unwrap_or_default().to_owned(),
                                        l["spanId"].as_str().unwrap_or_default().to_owned(),
                                    )
                                })
                                .collect(),
                        });
                    }
                }
            }
        }
        spans
    }

    /// Polls the spans received until `found` picks what the caller waits for (60 s at most).
    pub async fn spans_until<T>(
        &self,
        what: &str,
        mut found: impl FnMut(&[Span]) -> Option<T>,
    ) -> T {
        let wait = async {
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            loop {
                tick.tick().await;
                if let Some(t) = found(&self.spans()) {
                    return t;
                }
            }
        };
        match tokio::time::timeout(Duration::from_secs(60), wait).await {
            Ok(t) => t,
            Err(_) => panic!(
                "{what}: not received within 60 s; the collector has {:#?}",
                self.spans()
            ),
        }
    }

    /// Kills the collector (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn attributes(list: &serde_json::Value) -> HashMap<String, serde_json::Value> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| Some((a["key"].as_str()?.to_owned(), a["value"].clone())))
        .collect()
}
