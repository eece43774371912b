//! The Kafka brokers the tests start on loopback: Apache Kafka (the default: a KRaft broker and
//! controller in one JVM, from the jars `scripts/kafka` fetches from Maven Central) and tansu (a
//! second implementation of the protocol the queue's contract also runs against).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use super::free_port;

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

/// A broker on loopback ports, killed when dropped.
pub struct Broker {
    child: Option<Child>,
    pub addr: SocketAddr,
    kind: Kind,
}

enum Kind {
    /// Apache Kafka: its properties and data directory, kept across restarts.
    Kafka {
        dir: tempfile::TempDir,
        libs: PathBuf,
    },
    Tansu,
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The directory of Apache Kafka's jars: `$EBB_KAFKA_LIBS`, else what `scripts/kafka fetch`
/// prints (it fetches them once per machine).
pub fn kafka_libs() -> PathBuf {
    if let Some(p) = std::env::var_os("EBB_KAFKA_LIBS") {
        return PathBuf::from(p);
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/kafka");
    let out = Command::new(&script)
        .arg("fetch")
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {script:?}: {e}"));
    assert!(
        out.status.success(),
        "{script:?} fetch failed: Apache Kafka's jars come from Maven Central (./scripts/test fetches them)"
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// The tansu binary: `$EBB_TANSU`, then the one `scripts/test` installs, then `tansu` on PATH.
pub fn tansu() -> PathBuf {
    if let Some(p) = std::env::var_os("EBB_TANSU") {
        return PathBuf::from(p);
    }
    if let Some(home) = std::env::var_os("HOME") {
        let p = PathBuf::from(home).join(".cache/ebb/tools/bin/tansu");
        if p.exists() {
            return p;
        }
    }
    PathBuf::from("tansu")
}

fn java() -> PathBuf {
    match std::env::var_os("JAVA_HOME") {
        Some(home) => PathBuf::from(home).join("bin/java"),
        None => PathBuf::from("java"),
    }
}

/// Starts Apache Kafka (one KRaft node, broker and controller, on two free loopback ports, its
/// data in a temporary directory) and waits until it answers metadata requests. A port picked free
/// can be taken by another test's outgoing connection before the broker binds it: a broker that
/// exits while starting is started again on new ports, up to three times.
pub async fn broker() -> Broker {
    let mut last = String::new();
    for _ in 0..3 {
        let mut b = formatted_kafka();
        match b.try_start().await {
            Ok(()) => return b,
            Err(e) => last = e,
        }
    }
    panic!("Apache Kafka did not start in three tries: {last}");
}

/// A formatted Apache Kafka on two free loopback ports, not started.
fn formatted_kafka() -> Broker {
    let dir = tempfile::tempdir().unwrap();
    let (port, controller) = (free_port(), free_port());
    let data = dir.path().join("data");
    let properties = format!(
        "process.roles=broker,controller\n\
         node.id=1\n\
         controller.quorum.voters=1@127.0.0.1:{controller}\n\
         listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}\n\
         advertised.listeners=PLAINTEXT://127.0.0.1:{port}\n\
         controller.listener.names=CONTROLLER\n\
         inter.broker.listener.name=PLAINTEXT\n\
         listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n\
         log.dirs={}\n\
         offsets.topic.replication.factor=1\n\
         offsets.topic.num.partitions=4\n\
         transaction.state.log.replication.factor=1\n\
         transaction.state.log.min.isr=1\n\
         share.coordinator.state.topic.replication.factor=1\n\
         share.coordinator.state.topic.min.isr=1\n\
         group.initial.rebalance.delay.ms=0\n\
         auto.create.topics.enable=false\n",
        data.display()
    );
    std::fs::write(dir.path().join("server.properties"), properties).unwrap();
    let libs = kafka_libs();
    let format = Command::new(java())
        .arg("-cp")
        .arg(libs.join("*"))
        .args(["kafka.tools.StorageTool", "format", "--cluster-id"])
        .arg("ebb-test-cluster-0001")
        .arg("--config")
        .arg(dir.path().join("server.properties"))
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {:?}: {e} (Apache Kafka runs on Java 17)",
                java()
            )
        });
    assert!(
        format.status.success(),
        "formatting Kafka's storage failed: {}",
        String::from_utf8_lossy(&format.stderr)
    );
    Broker {
        child: None,
        addr: format!("127.0.0.1:{port}").parse().unwrap(),
        kind: Kind::Kafka { dir, libs },
    }
}

/// Starts tansu (memory storage) on a free loopback port and waits until it answers.
pub async fn tansu_broker() -> Broker {
    let mut b = Broker {
        child: None,
        addr: format!("127.0.0.1:{}", free_port()).parse().unwrap(),
        kind: Kind::Tansu,
    };
    b.start().await;
    b
}

/// The topics and the consumer groups a broker lists.
pub struct Names {
    pub topics: Vec<String>,
    pub groups: Vec<String>,
}

impl Broker {
    /// The names of the topics and consumer groups the broker lists now; `None` when it did not
    /// answer within 5 s.
    pub async fn names(&self) -> Option<Names> {
        let addr = self.addr.to_string();
        tokio::task::spawn_blocking(move || {
            let client: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", addr)
                .create()
                .ok()?;
            let wait = Duration::from_secs(5);
            let metadata = client.fetch_metadata(None, wait).ok()?;
            let groups = client.fetch_group_list(None, wait).ok()?;
            Some(Names {
                topics: metadata
                    .topics()
                    .iter()
                    .map(|t| t.name().to_owned())
                    .collect(),
                groups: groups
                    .groups()
                    .iter()
                    .map(|g| g.name().to_owned())
                    .collect(),
            })
        })
        .await
        .unwrap()
    }

    /// Starts the broker's process (again, for Apache Kafka: same ports, same data) and waits
    /// until it answers.
    pub async fn start(&mut self) {
        if let Err(e) = self.try_start().await {
            panic!("{e}");
        }
    }

    /// Starts the broker's process and waits until it answers metadata requests: an error if
    /// it exits first (with the end of its stderr) or does not answer in 60 s.
    async fn try_start(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "the broker runs already");
        let child = match &self.kind {
            Kind::Kafka { dir, libs } => {
                // Its log (log4j's default writes errors to stdout) and stderr, in one file.
                let log = std::fs::File::create(dir.path().join("broker.err")).unwrap();
                Command::new(java())
                    .args(["-Xms128m", "-Xmx512m", "-XX:+UseSerialGC"])
                    .arg("-cp")
                    .arg(libs.join("*"))
                    .arg("kafka.Kafka")
                    .arg(dir.path().join("server.properties"))
                    .stdout(log.try_clone().unwrap())
                    .stderr(log)
                    .spawn()
                    .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", java()))
            }
            Kind::Tansu => {
                let url = format!("tcp://{}", self.addr);
                Command::new(tansu())
                    .args(["broker", "--listener-url", &url])
                    .args(["--advertised-listener-url", &url])
                    .args(["--storage-engine", "memory://tansu/"])
                    .env("RUST_LOG", "warn")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap_or_else(|e| {
                        panic!(
                            "cannot start tansu {:?}: {e} (./scripts/test installs it)",
                            tansu()
                        )
                    })
            }
        };
        self.child = Some(child);
        let addr = self.addr;
        let client: Arc<BaseConsumer> = Arc::new(
            ClientConfig::new()
                .set("bootstrap.servers", addr.to_string())
                .create()
                .unwrap(),
        );
        // Polled with a deadline: a metadata request (blocking, so off the runtime) until one
        // lists the broker, or the process has exited.
        let answering = async {
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            loop {
                tick.tick().await;
                if let Some(status) = self
                    .child
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten())
                {
                    self.child = None;
                    return Err(format!(
                        "the broker at {addr} exited while starting ({status}): {}",
                        self.stderr_tail()
                    ));
                }
                let c = client.clone();
                let up = tokio::task::spawn_blocking(move || {
                    c.fetch_metadata(None, Duration::from_millis(500))
                        .is_ok_and(|m| !m.brokers().is_empty())
                })
                .await
                .unwrap();
                if up {
                    return Ok(());
                }
            }
        };
        match tokio::time::timeout(Duration::from_secs(60), answering).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "the broker at {addr} did not answer in 60 s: {}",
                self.stderr_tail()
            )),
        }
    }

    /// The last lines of Apache Kafka's stderr (tansu's is not kept).
    fn stderr_tail(&self) -> String {
        match &self.kind {
            Kind::Kafka { dir, .. } => {
                let err =
                    std::fs::read_to_string(dir.path().join("broker.err")).unwrap_or_default();
                let lines: Vec<&str> = err.lines().collect();
                lines[lines.len().saturating_sub(20)..].join("\n")
            }
            Kind::Tansu => String::from("(tansu's stderr is not kept)"),
        }
    }

    /// Kills the broker's process (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
