//! The real Kubernetes control plane for the kube tests: etcd, kube-apiserver,
//! kube-controller-manager and kube-scheduler, built from their Go modules by
//! `scripts/controlplane build` (its directory in `$EBB_CONTROLPLANE`, which `scripts/test` sets),
//! each a process of its own, stopped when dropped (also when a test fails).
//!
//! Each test runs in a network namespace of its own ([`private_network`]): the API server refuses
//! loopback addresses in EndpointSlices, so the node and its pods need other addresses, and those
//! must never reach beyond this machine. The namespace has only `lo`, carrying 127.0.0.1, the
//! node's [`NODE_IP`] and the pods' addresses. It belongs to the test's thread: a kube test is a
//! plain `#[test]` or a current-thread `#[tokio::test]`, and everything it starts (the
//! components, the pods, the threads it spawns) is inside the namespace with it.
//!
//! The API server has its own CA (made with openssl), users from a token file, RBAC on and an
//! audit log (every request at the Metadata level, one JSON line each). The control-plane
//! components act as `system:masters`; a test user gets only the roles it is given.
//!
//! With `EBB_TEST_KUBECONFIG` naming a kubeconfig, the tests run against that cluster instead
//! ([`ControlPlane::external`]): nothing is started, no network namespace is made, the cluster's
//! own nodes run the pods, and `EBB_TEST_AUDIT_LOG` names its API server's audit log (JSON lines)
//! for the tests that count API writes. The tests then take the cluster one at a time (a lock
//! beside the kubeconfig) and each first deletes what an earlier one left in the namespaces
//! `default` (workloads, Services, Leases, Events; never the Service `kubernetes`) and `ebb`:
//! give them a cluster made for them.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ebb::clock::Stopwatch;

/// The cluster's service addresses, apart from any address a pod gets.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// The node's address in the test's network namespace; the API server listens on it.
pub const NODE_IP: &str = "10.244.0.1";
/// The token of the administrator the tests act as.
pub const ADMIN_TOKEN: &str = "ebb-test-admin";
/// The token of a user with no roles at all.
pub const NOBODY_TOKEN: &str = "ebb-test-nobody";

/// A running control plane.
pub struct ControlPlane {
    /// The cluster of `EBB_TEST_KUBECONFIG`, held for this test alone.
    external: Option<std::fs::File>,
    /// The audit log's length when the test began (earlier tests' requests are not this one's).
    audit_from: usize,
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// Components in start order; stopped in reverse.
    children: Vec<(&'static str, Child)>,
    /// Whether a real kubelet joins ([`Self::start_for_kubelet`]).
    kubelet: bool,
    /// etcd's client URL, and the API server's port (0 until it first starts).
    etcd: String,
    port: u16,
    /// `https://NODE_IP:PORT`.
    pub server: String,
    /// A kubeconfig for the administrator.
    pub kubeconfig: PathBuf,
    /// The CA that signed the API server's certificate.
    pub ca: PathBuf,
    /// One JSON line per request the API server served.
    pub audit_log: PathBuf,
}

/// The directory of the control plane's binaries.
pub fn binaries() -> PathBuf {
    match std::env::var_os("EBB_CONTROLPLANE") {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "EBB_CONTROLPLANE is not set: the kube tests need the control plane that \
             `scripts/controlplane build` builds (scripts/test sets it)"
        ),
    }
}

use super::free_port;

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The last `lines` lines of the file at `path` (empty when there is none).
pub fn tail(path: &std::path::Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let tail: Vec<&str> = text.lines().rev().take(lines).collect();
    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// Starts `cmd` with no input and its output appended to `DIR/NAME.log`.
pub fn spawn_logged(dir: &std::path::Path, name: &str, cmd: &mut Command) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{name}.log")))
        .expect("log file");
    let err = log.try_clone().expect("log file");
    cmd.stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"))
}

/// Fails with the end of its log (`DIR/NAME.log`) when one of `children` has exited.
pub fn assert_running(dir: &std::path::Path, children: &mut [(&'static str, Child)]) {
    for (name, child) in children {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "{name} exited ({status}):\n{}",
                tail(&dir.join(format!("{name}.log")), 40)
            );
        }
    }
}

/// Moves the calling thread into a network namespace of its own (so every process and thread it
/// starts from now on is in it too), with `lo` up carrying 127.0.0.1 and [`NODE_IP`]. Needs root
/// (CAP_SYS_ADMIN), as `scripts/test` runs.
pub fn private_network() {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap_or_else(|e| {
        panic!(
            "the kube tests run in a network namespace of their own and need root \
             (CAP_SYS_ADMIN) to make it: unshare: {e}"
        )
    });
    run(Command::new("ip").args(["link", "set", "lo", "up"]));
    run(Command::new("ip").args(["addr", "add", &format!("{NODE_IP}/32"), "dev", "lo"]));
}

/// Checks `check` until it holds, failing the test if `limit` passes first. Between checks it
/// gives the thread to the test runtime's other tasks (the node agent) for 50 ms: a check runs
/// kubectl and blocks the thread meanwhile, so an interval, already due again when a check
/// returns, would never let them run.
pub async fn wait_for(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    wait_until(what, limit, || std::future::ready(check().then_some(()))).await
}

/// [`wait_for`] with an asynchronous check that gives a value once the condition holds.
pub async fn wait_until<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> F,
) -> T {
    let wait = async {
        loop {
            if let Some(v) = check().await {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(limit, wait)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {limit:?}"))
}

impl ControlPlane {
    /// Moves the calling thread into a network namespace of its own ([`private_network`]),
    /// starts etcd, the API server, the controller manager and the scheduler in it, and returns
    /// once the API server's `/readyz` answers 200 and the controllers run.
    pub async fn start() -> Self {
        Self::start_with(false).await
    }

    /// [`Self::start`], for a real kubelet ([`super::kubelet::RealNode`]): the node lifecycle
    /// controller runs too, lifting the taint a new node gets once its kubelet reports it Ready
    /// (the test node agent, which sends no heartbeats, goes without it), and the Service
    /// `kubernetes` has the API server as its endpoint.
    pub async fn start_for_kubelet() -> Self {
        Self::start_with(true).await
    }

    async fn start_with(node_lifecycle: bool) -> Self {
        if let Some(kubeconfig) = std::env::var_os("EBB_TEST_KUBECONFIG") {
            return Self::external(PathBuf::from(kubeconfig)).await;
        }
        private_network();
        let bin = binaries();
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let mut cp = Self {
            external: None,
            audit_from: 0,
            server: String::new(),
            kubeconfig: d.join("admin.kubeconfig"),
            ca: d.join("ca.crt"),
            audit_log: d.join("audit.log"),
            bin,
            children: Vec::new(),
            kubelet: node_lifecycle,
            etcd: String::new(),
            port: 0,
            dir,
        };
        cp.make_credentials();
        let etcd = cp.start_etcd().await;
        cp.etcd = etcd;
        cp.start_apiserver().await;
        cp.start_controllers().await;
        cp
    }

    /// The cluster of `kubeconfig`, taken for this test alone and cleared of what earlier tests
    /// left.
    async fn external(kubeconfig: PathBuf) -> Self {
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(kubeconfig.with_extension("ebb-test.lock"))
            .expect("the lock beside EBB_TEST_KUBECONFIG");
        lock.lock().expect("taking the test cluster");
        let audit_log = std::env::var_os("EBB_TEST_AUDIT_LOG")
            .map(PathBuf::from)
            .unwrap_or_default();
        let mut cp = Self {
            external: Some(lock),
            audit_from: 0,
            server: String::new(),
            ca: PathBuf::new(),
            audit_log,
            bin: binaries(),
            children: Vec::new(),
            kubelet: false,
            etcd: String::new(),
            port: 0,
            dir: tempfile::tempdir().expect("tempdir"),
            kubeconfig,
        };
        cp.audit_from = cp.audit_lines().len();
        let view = cp.kubectl(&["config", "view", "--raw", "--minify", "-o", "json"]);
        let view: serde_json::Value = serde_json::from_str(&view).expect("kubectl config view");
        cp.server = view["clusters"][0]["cluster"]["server"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        cp.clear().await;
        cp
    }

    /// Whether the tests run against a cluster of `EBB_TEST_KUBECONFIG`.
    pub fn is_external(&self) -> bool {
        self.external.is_some()
    }

    /// Deletes what earlier tests left in an external cluster, and waits until it is gone.
    async fn clear(&self) {
        self.kubectl(&[
            "delete",
            "namespace",
            "ebb",
            "--ignore-not-found",
            "--wait=true",
            "--timeout=180s",
        ]);
        self.kubectl(&[
            "delete",
            "deployments,statefulsets,services,leases.coordination.k8s.io,events",
            "-n",
            "default",
            "--field-selector",
            "metadata.name!=kubernetes",
            "--ignore-not-found",
            "--wait=true",
            "--timeout=180s",
        ]);
        self.kubectl(&[
            "delete",
            "clusterrole,clusterrolebinding",
            "ebb",
            "ebb-weak",
            "--ignore-not-found",
        ]);
        wait_for(
            "the earlier tests' pods gone",
            Duration::from_secs(180),
            || {
                self.try_kubectl(&["get", "pods", "-n", "default", "-o", "name"])
                    .is_ok_and(|out| out.trim().is_empty())
            },
        )
        .await;
    }

    /// Why this test needs the harness's own control plane, printed and returned when it runs
    /// against an external cluster (the test then ends there); `None` on the harness's.
    pub fn needs_harness(&self, why: &str) -> Option<()> {
        self.is_external().then(|| {
            eprintln!("not run against EBB_TEST_KUBECONFIG's cluster: this test {why}");
        })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A CA, the API server's serving certificate, the service-account signing key, the token
    /// users and the audit policy.
    fn make_credentials(&self) {
        let d = self.dir.path();
        let openssl = |args: &[&str]| run(Command::new("openssl").args(args).current_dir(d));
        openssl(&["genrsa", "-out", "ca.key", "2048"]);
        openssl(&[
            "req",
            "-x509",
            "-new",
            "-key",
            "ca.key",
            "-days",
            "2",
            "-subj",
            "/CN=ebb-test-ca",
            "-out",
            "ca.crt",
        ]);
        openssl(&["genrsa", "-out", "apiserver.key", "2048"]);
        openssl(&[
            "req",
            "-new",
            "-key",
            "apiserver.key",
            "-subj",
            "/CN=kube-apiserver",
            "-out",
            "apiserver.csr",
        ]);
        std::fs::write(
            d.join("apiserver.ext"),
            format!(
                "subjectAltName=IP:{NODE_IP},IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,\
                 DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
            ),
        )
        .expect("write ext");
        openssl(&[
            "x509",
            "-req",
            "-in",
            "apiserver.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "apiserver.ext",
            "-out",
            "apiserver.crt",
        ]);
        openssl(&["genrsa", "-out", "sa.key", "2048"]);
        openssl(&["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"]);
        // token,user,uid,"groups"
        std::fs::write(
            d.join("tokens.csv"),
            format!(
                "{ADMIN_TOKEN},ebb-test-admin,1,\"system:masters\"\n\
                 ebb-test-controllers,system:kube-controller-manager,2,\"system:masters\"\n\
                 ebb-test-scheduler,system:kube-scheduler,3,\"system:masters\"\n\
                 {NOBODY_TOKEN},nobody,4,\"\"\n\
                 {kubelet},system:node:{node},5,\"system:nodes,system:masters\"\n",
                kubelet = super::kubelet::KUBELET_TOKEN,
                node = super::kubelet::NODE,
            ),
        )
        .expect("write tokens");
        std::fs::write(
            d.join("audit-policy.yaml"),
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\n\
             rules:\n- level: Request\n  resources: [{group: apps, resources: [deployments/scale]}]\n\
             - level: Request\n  verbs: [patch]\n  resources: [{group: \"\", resources: [pods]}]\n\
             - level: Metadata\n",
        )
        .expect("write audit policy");
    }

    fn spawn(&mut self, name: &'static str, cmd: &mut Command) {
        let child = spawn_logged(self.dir.path(), name, cmd);
        self.children.push((name, child));
    }

    /// Fails with the component's log when it has exited.
    fn assert_running(&mut self) {
        assert_running(self.dir.path(), &mut self.children);
    }

    /// etcd with a throwaway data dir and no fsync; returns its client URL once it is healthy.
    async fn start_etcd(&mut self) -> String {
        let (client, peer) = (free_port(), free_port());
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let data = self.path("etcd");
        let mut cmd = Command::new(self.bin.join("etcd"));
        cmd.arg("--name=test")
            .arg(format!("--data-dir={}", data.display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=test={peer_url}"))
            .arg("--unsafe-no-fsync")
            .arg("--log-level=warn");
        self.spawn("etcd", &mut cmd);
        wait_for("etcd healthy", Duration::from_secs(30), || {
            self.assert_running();
            http_get(&format!("127.0.0.1:{client}"), "/health")
                .is_some_and(|a| a.starts_with("HTTP/1.1 200"))
        })
        .await;
        client_url
    }

    /// Stops the API server (SIGTERM, SIGKILL after 10 s); etcd, the controllers and the
    /// scheduler keep running.
    pub fn stop_apiserver(&mut self) {
        let i = self
            .children
            .iter()
            .position(|(n, _)| *n == "kube-apiserver")
            .expect("the API server runs");
        let (_, mut child) = self.children.remove(i);
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let (exited, gone) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = child.wait();
            let _ = exited.send(());
        });
        if gone.recv_timeout(Duration::from_secs(10)).is_err() {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = gone.recv();
        }
    }

    /// Starts the API server again, on the same address and etcd, after [`Self::stop_apiserver`].
    pub async fn restart_apiserver(&mut self) {
        self.start_apiserver().await;
    }

    async fn start_apiserver(&mut self) {
        if self.port == 0 {
            self.port = free_port();
        }
        let port = self.port;
        let etcd = self.etcd.clone();
        self.server = format!("https://{NODE_IP}:{port}");
        let dir = self.dir.path().to_path_buf();
        let p = |n: &str| dir.join(n).display().to_string();
        let mut cmd = Command::new(self.bin.join("kube-apiserver"));
        cmd.arg(format!("--etcd-servers={etcd}"))
            .arg(format!("--bind-address={NODE_IP}"))
            .arg(format!("--advertise-address={NODE_IP}"))
            .arg(format!("--secure-port={port}"))
            .arg(format!("--tls-cert-file={}", p("apiserver.crt")))
            .arg(format!("--tls-private-key-file={}", p("apiserver.key")))
            .arg(format!("--client-ca-file={}", p("ca.crt")))
            .arg(format!("--token-auth-file={}", p("tokens.csv")))
            .arg("--authorization-mode=RBAC")
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg(format!("--service-account-key-file={}", p("sa.pub")))
            .arg(format!(
                "--service-account-signing-key-file={}",
                p("sa.key")
            ))
            .arg(format!("--service-cluster-ip-range={SERVICE_CIDR}"))
            // The Service `kubernetes` gets the API server's address as its endpoint only where a
            // real node's pods reach the API server through it (kube-proxy).
            .arg(format!(
                "--endpoint-reconciler-type={}",
                if self.kubelet { "lease" } else { "none" }
            ))
            .arg(format!("--audit-policy-file={}", p("audit-policy.yaml")))
            .arg(format!("--audit-log-path={}", p("audit.log")))
            .arg("--audit-log-format=json");
        self.spawn("kube-apiserver", &mut cmd);
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n    \
             certificate-authority: {}\nusers:\n- name: admin\n  user:\n    token: {ADMIN_TOKEN}\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: admin\n\
             current-context: test\n",
            self.server,
            self.ca.display()
        );
        std::fs::write(&self.kubeconfig, kubeconfig).expect("write kubeconfig");
        for (user, token) in [
            ("controllers", "ebb-test-controllers"),
            ("scheduler", "ebb-test-scheduler"),
        ] {
            let text = std::fs::read_to_string(&self.kubeconfig)
                .expect("kubeconfig")
                .replace(ADMIN_TOKEN, token);
            std::fs::write(self.path(&format!("{user}.kubeconfig")), text).expect("kubeconfig");
        }
        wait_for("kube-apiserver /readyz", Duration::from_secs(90), || {
            self.assert_running();
            self.try_kubectl(&["get", "--raw", "/readyz"])
                .is_ok_and(|out| out.trim() == "ok")
        })
        .await;
    }

    async fn start_controllers(&mut self) {
        let node_lifecycle = self.kubelet;
        let dir = self.dir.path().to_path_buf();
        let p = |n: &str| dir.join(n).display().to_string();
        let mut cm = Command::new(self.bin.join("kube-controller-manager"));
        cm.arg(format!("--kubeconfig={}", p("controllers.kubeconfig")))
            .arg("--leader-elect=false")
            .arg(format!(
                "--controllers=deployment-controller,replicaset-controller,\
                 statefulset-controller,persistentvolume-binder-controller,\
                 persistentvolumeclaim-protection-controller,\
                 persistentvolume-protection-controller,\
                 endpointslice-controller,garbage-collector-controller,namespace-controller,\
                 serviceaccount-controller,serviceaccount-token-controller,\
                 root-ca-certificate-publisher-controller{}",
                if node_lifecycle {
                    ",node-lifecycle-controller"
                } else {
                    ""
                }
            ))
            .arg(format!("--root-ca-file={}", p("ca.crt")))
            .arg(format!(
                "--service-account-private-key-file={}",
                p("sa.key")
            ))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={}", free_port()))
            .arg(format!("--cert-dir={}", p("controller-manager-certs")));
        self.spawn("kube-controller-manager", &mut cm);
        let mut sched = Command::new(self.bin.join("kube-scheduler"));
        sched
            .arg(format!("--kubeconfig={}", p("scheduler.kubeconfig")))
            .arg("--leader-elect=false")
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={}", free_port()))
            .arg(format!("--cert-dir={}", p("scheduler-certs")));
        self.spawn("kube-scheduler", &mut sched);
        // The service-account controller makes every namespace's `default` account: the
        // controller manager is at work once `default` has one.
        wait_for(
            "the default service account",
            Duration::from_secs(60),
            || {
                self.assert_running();
                self.try_kubectl(&["get", "serviceaccount", "default", "-o", "name"])
                    .is_ok()
            },
        )
        .await;
    }

    /// kubectl as the administrator, with `args`.
    fn kubectl_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(self.bin.join("kubectl"));
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .args(args);
        cmd
    }

    /// Runs kubectl as the administrator; its stdout, or its stderr as the error.
    pub fn try_kubectl(&self, args: &[&str]) -> Result<String, String> {
        let out = self
            .kubectl_command(args)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// [`Self::try_kubectl`], failing the test on an error.
    pub fn kubectl(&self, args: &[&str]) -> String {
        self.try_kubectl(args)
            .unwrap_or_else(|e| panic!("kubectl {}: {e}", args.join(" ")))
    }

    /// Runs kubectl with `input` on its stdin (for `apply -f -`).
    pub fn kubectl_stdin(&self, args: &[&str], input: &str) -> String {
        use std::io::Write;
        let mut child = self
            .kubectl_command(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(input.as_bytes())
            .expect("write stdin");
        let out = child.wait_with_output().expect("kubectl");
        assert!(
            out.status.success(),
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A kubeconfig for a user with `token` on the administrator's cluster (its server and CA as
    /// the administrator's kubeconfig has them), written in the test's directory.
    pub fn kubeconfig_with_token(&self, user: &str, token: &str) -> PathBuf {
        let view = self.kubectl(&[
            "config",
            "view",
            "--raw",
            "--minify",
            "--flatten",
            "-o",
            "json",
        ]);
        let mut config: serde_json::Value =
            serde_json::from_str(&view).expect("kubectl config view");
        config["users"] = serde_json::json!([{ "name": user, "user": { "token": token } }]);
        config["contexts"][0]["context"]["user"] = serde_json::json!(user);
        let path = self.path(&format!("{user}.kubeconfig"));
        std::fs::write(&path, config.to_string()).expect("kubeconfig");
        path
    }

    fn audit_lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.audit_log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The audit log's events since the test began (one JSON object per request served).
    pub fn audit_events(&self) -> Vec<serde_json::Value> {
        assert!(
            !self.audit_log.as_os_str().is_empty(),
            "this test counts the API server's requests in its audit log: set EBB_TEST_AUDIT_LOG \
             to the cluster's audit log (JSON lines)"
        );
        self.audit_lines()
            .iter()
            .skip(self.audit_from)
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for ControlPlane {
    /// SIGTERM to every component, then SIGKILL to those still running after 10 s.
    fn drop(&mut self) {
        let (exited, gone) = std::sync::mpsc::channel();
        let mut pids = Vec::new();
        for (_, mut child) in self.children.drain(..).rev() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            pids.push(pid);
            let exited = exited.clone();
            std::thread::spawn(move || {
                let _ = child.wait();
                let _ = exited.send(());
            });
        }
        let sw = Stopwatch::start();
        let limit = Duration::from_secs(10);
        for _ in 0..pids.len() {
            if gone
                .recv_timeout(limit.saturating_sub(sw.elapsed()))
                .is_err()
            {
                for pid in &pids {
                    let _ = nix::sys::signal::kill(*pid, nix::sys::signal::Signal::SIGKILL);
                }
                break;
            }
        }
    }
}

/// `GET path` on a plain-HTTP server at `addr`, with `Connection: close`: the whole answer, or
/// `None` when it cannot be had.
pub fn http_get(addr: &str, path: &str) -> Option<String> {
    http_get_with(addr, path, &[&format!("Host: {addr}")])
}

/// [`http_get`] with these header lines (`Host` among them).
pub fn http_get_with(addr: &str, path: &str, headers: &[&str]) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut head = format!("GET {path} HTTP/1.1\r\n");
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    head.push_str("Connection: close\r\n\r\n");
    s.write_all(head.as_bytes()).ok()?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).ok()?;
    Some(answer)
}
