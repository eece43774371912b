//! A real node for the kube tests whose point is the pod itself: the kubelet (from the control
//! plane's program, `scripts/controlplane build`), containerd 2.3 with its runc shim over
//! Debian's runc, and the CNI plugins bridge, host-local and loopback (`scripts/node build`, its
//! directory in `$EBB_NODE`), in the test's network namespace ([`super::controlplane`]). Pods
//! get addresses on a bridge `cni0` there ([`POD_CIDR`]), which the test thread reaches directly;
//! images come from OCI archives imported into containerd ([`RealNode::import`]): no registry.
//! kube-proxy (nftables) makes Services' cluster addresses answer in that namespace.
//!
//! This machine's shape, and what the node is told for it:
//! - cgroups v1 (hybrid): the kubelet refuses them unless `failCgroupV1: false`; its cgroups live
//!   under a root of this node's own (`/ebb-node-PID-N` in every v1 hierarchy), which containerd
//!   and its shims join too, so stopping the node kills everything it started.
//! - The kubelet writes three global sysctls at start (`vm.overcommit_memory=1`,
//!   `kernel.panic=10`, `kernel.panic_on_oops=1`) unless they already read so: in the node's own
//!   mount namespace, files with those values are bound over them, and the machine's stay.
//! - Paths the kubelet and the CNI cache use whatever their flags say (`/var/lib/kubelet/
//!   device-plugins`, `/var/log/containers`, `/var/lib/cni`) get directories of this node's own,
//!   bound in that mount namespace, so nodes side by side do not share them.
//! - The tests may run without CAP_SYS_RESOURCE (so no process may lower its OOM score below
//!   0): containerd keeps the containers' scores no lower than its own.
//! - The disk may be fuller than the kubelet's default eviction thresholds and image garbage
//!   collection allow: only memory evicts, and images are never collected.
//!
//! containerd runs in a mount namespace of its own (its mounts, the kubelet's volumes and the
//! containers' root filesystems go when its processes do), which the kubelet joins.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::controlplane::{ControlPlane, NODE_IP, wait_for};

/// The pods' addresses, on the bridge `cni0` in the test's network namespace.
pub const POD_CIDR: &str = "10.88.0.0/16";
/// The node's name (the Node object the kubelet registers).
pub const NODE: &str = "node-1";
/// The kubelet's token (a user in the group `system:nodes`).
pub const KUBELET_TOKEN: &str = "ebb-test-kubelet";
/// The sandbox image containerd's CRI configuration pins (built by `scripts/node`).
const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10.2";
/// The cgroup v1 hierarchies the node's root is made in.
const HIERARCHIES: [&str; 9] = [
    "blkio", "cpu", "cpuacct", "cpuset", "devices", "freezer", "memory", "pids", "systemd",
];
/// The global sysctls the kubelet sets unless they read so, and the values it wants.
const KUBELET_SYSCTLS: [(&str, &str); 3] = [
    ("vm/overcommit_memory", "1"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
];

/// The directory `scripts/node build` made.
pub fn binaries() -> PathBuf {
    match std::env::var_os("EBB_NODE") {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "EBB_NODE is not set: the real node's tests need containerd and the CNI plugins \
             that `scripts/node build` builds (scripts/test sets it)"
        ),
    }
}

/// A running node; dropping it stops the kubelet, containerd and every container.
pub struct RealNode {
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// containerd, then the kubelet.
    children: Vec<(&'static str, Child)>,
    /// The node's cgroup root, e.g. `ebb-node-123-0`.
    cgroup: String,
    /// The administrator's kubeconfig: what a failed test prints of the cluster.
    kubeconfig: PathBuf,
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl RealNode {
    /// Starts containerd and the kubelet in the test's network namespace, imports the sandbox
    /// image, and returns once the Node is Ready.
    pub async fn start(cp: &ControlPlane) -> Self {
        static NODES: AtomicU32 = AtomicU32::new(0);
        let took = ebb::clock::Stopwatch::start();
        let bin = binaries();
        let dir = tempfile::tempdir().expect("tempdir");
        let cgroup = format!(
            "ebb-node-{}-{}",
            std::process::id(),
            NODES.fetch_add(1, Ordering::Relaxed)
        );
        let mut node = Self {
            dir,
            bin,
            children: Vec::new(),
            cgroup,
            kubeconfig: cp.kubeconfig.clone(),
        };
        node.make_cgroups();
        node.start_containerd().await;
        node.import(&node.bin.join("pause.oci.tar"), &[PAUSE_IMAGE]);
        node.start_kubelet(cp).await;
        node.start_proxy(cp);
        wait_for("the node Ready", Duration::from_secs(120), || {
            node.assert_running();
            cp.try_kubectl(&[
                "get",
                "node",
                NODE,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ])
            .is_ok_and(|s| s == "True")
        })
        .await;
        println!(
            "real node {}: Ready {} ms after its start",
            node.cgroup,
            took.elapsed().as_millis()
        );
        node
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn cgroup_dir(&self, hierarchy: &str) -> PathBuf {
        Path::new("/sys/fs/cgroup")
            .join(hierarchy)
            .join(&self.cgroup)
    }

    /// The node's cgroup root in every v1 hierarchy (cpuset's given its parent's CPUs and
    /// memory nodes), and `runtime` under it for containerd and its shims.
    fn make_cgroups(&self) {
        for h in HIERARCHIES {
            let dir = self.cgroup_dir(h);
            std::fs::create_dir_all(dir.join("runtime"))
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            if h == "cpuset" {
                for f in ["cpuset.cpus", "cpuset.mems"] {
                    let parent =
                        std::fs::read_to_string(Path::new("/sys/fs/cgroup/cpuset").join(f))
                            .expect("the root cpuset");
                    for d in [dir.clone(), dir.join("runtime")] {
                        std::fs::write(d.join(f), parent.trim()).expect("cpuset");
                    }
                }
            }
        }
    }

    fn spawn(&mut self, name: &'static str, cmd: &mut Command) -> u32 {
        let child = super::controlplane::spawn_logged(self.dir.path(), name, cmd);
        let pid = child.id();
        self.children.push((name, child));
        pid
    }

    /// Fails with the component's log when it has exited.
    pub fn assert_running(&mut self) {
        super::controlplane::assert_running(self.dir.path(), &mut self.children);
    }

    /// The last lines of a component's log (`containerd`, `kubelet`, `kube-proxy`).
    pub fn log_tail(&self, name: &str, lines: usize) -> String {
        super::controlplane::tail(&self.path(&format!("{name}.log")), lines)
    }

    async fn start_containerd(&mut self) {
        let d = self.dir.path().to_owned();
        for sub in [
            "ctd",
            "cni-conf",
            "cni-ipam",
            "pod-logs",
            "kubelet",
            "s",
            "binds/device-plugins",
            "binds/containers",
            "binds/cni",
            "sysctl",
        ] {
            std::fs::create_dir_all(d.join(sub)).expect("node dirs");
        }
        std::fs::write(
            d.join("cni-conf/10-ebb.conflist"),
            serde_json::json!({
                "cniVersion": "1.0.0",
                "name": "ebb-pods",
                "plugins": [{
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": true,
                    "ipMasq": false,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_CIDR, "gateway": "10.88.0.1"}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": d.join("cni-ipam"),
                    },
                }],
            })
            .to_string(),
        )
        .expect("CNI configuration");
        let runc = ["/usr/sbin/runc", "/usr/bin/runc"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("runc (Debian: apt-get install runc)");
        let p = |s: &str| d.join(s).display().to_string();
        std::fs::write(
            d.join("containerd.toml"),
            format!(
                r#"version = 3
root = "{root}"
state = "{state}"
temp = "{temp}"
required_plugins = ["io.containerd.grpc.v1.cri"]
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.nri.v1.nri"]
[grpc]
  address = "{sock}"
[plugins.'io.containerd.shim.v1.manager']
  socket_dir = "{shims}"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[plugins.'io.containerd.cri.v1.runtime']
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
  enable_cdi = false
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = "{shim}"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{runc_root}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{cni}"]
    conf_dir = "{cni_conf}"
    max_conf_num = 1
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"#,
                root = p("ctd/root"),
                state = p("ctd/state"),
                temp = p("ctd/tmp"),
                sock = self.socket().display(),
                shims = p("s"),
                shim = self.bin.join("bin/containerd-shim-runc-v2").display(),
                runc_root = p("ctd/runc"),
                cni = self.bin.join("cni").display(),
                cni_conf = p("cni-conf"),
            ),
        )
        .expect("containerd configuration");

        // The mount namespace: private, with the node's own directories bound over the paths
        // the kubelet and CNI share machine-wide, and the sysctls the kubelet would write bound
        // over with the values it wants (so it leaves the machine's alone).
        let mut script = String::from("set -e\nmount --make-rprivate /\n");
        for (host, own) in [
            ("/var/lib/kubelet/device-plugins", "binds/device-plugins"),
            ("/var/log/containers", "binds/containers"),
            ("/var/lib/cni", "binds/cni"),
        ] {
            std::fs::create_dir_all(host).unwrap_or_else(|e| panic!("{host}: {e}"));
            script.push_str(&format!("mount --bind '{}' '{host}'\n", p(own)));
        }
        for (name, value) in KUBELET_SYSCTLS {
            let file = d.join("sysctl").join(name.replace('/', "."));
            std::fs::write(&file, format!("{value}\n")).expect("sysctl file");
            script.push_str(&format!(
                "mount --bind '{}' '/proc/sys/{name}'\n",
                file.display()
            ));
        }
        script.push_str("exec \"$0\" \"$@\"\n");
        let config = d.join("containerd.toml");
        let containerd = self.bin.join("bin/containerd");
        let pid = self.spawn(
            "containerd",
            Command::new("unshare")
                .args([
                    "--mount",
                    "--propagation",
                    "unchanged",
                    "--",
                    "sh",
                    "-c",
                    &script,
                ])
                .arg(&containerd)
                .arg("--config")
                .arg(&config)
                .arg("--log-level=warn")
                .env(
                    "PATH",
                    format!(
                        "{}:/usr/sbin:/usr/bin:/sbin:/bin",
                        self.bin.join("bin").display()
                    ),
                ),
        );
        // containerd and the shims it starts belong to the node's cgroup.
        for h in HIERARCHIES {
            let procs = self.cgroup_dir(h).join("runtime/cgroup.procs");
            std::fs::write(&procs, pid.to_string())
                .unwrap_or_else(|e| panic!("{}: {e}", procs.display()));
        }
        let socket = self.socket();
        wait_for("containerd serving", Duration::from_secs(60), || {
            self.assert_running();
            socket.exists()
                && self
                    .ctr_try(&["version"])
                    .is_ok_and(|v| v.contains("Server:"))
        })
        .await;
    }

    fn socket(&self) -> PathBuf {
        self.path("ctd/c.sock")
    }

    fn ctr_try(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new(self.bin.join("bin/ctr"))
            .arg("--address")
            .arg(self.socket())
            .args(["--namespace", "k8s.io"])
            .args(args)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    fn ctr(&self, args: &[&str]) -> String {
        self.ctr_try(args)
            .unwrap_or_else(|e| panic!("ctr {args:?}: {e}"))
    }

    /// Imports the image of an OCI archive (one image) into containerd, unpacked, under each
    /// of `names` (full references: `registry/name:tag`): the archive's index is written anew
    /// with an entry per name, so containerd (and its CRI plugin) know the image by those names
    /// alone.
    pub fn import(&self, archive: &Path, names: &[&str]) {
        let layout = tempfile::tempdir_in(self.dir.path()).expect("tempdir");
        run(Command::new("tar")
            .arg("-xf")
            .arg(archive)
            .arg("-C")
            .arg(layout.path()));
        let index_path = layout.path().join("index.json");
        let mut index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&index_path).expect("index.json"))
                .expect("index.json");
        let manifest = index["manifests"][0].clone();
        index["manifests"] = names
            .iter()
            .map(|name| {
                let mut m = manifest.clone();
                m["annotations"] = serde_json::json!({ "org.opencontainers.image.ref.name": name });
                m
            })
            .collect();
        std::fs::write(&index_path, index.to_string()).expect("index.json");
        let named = layout.path().with_extension("tar");
        run(Command::new("tar")
            .arg("-cf")
            .arg(&named)
            .arg("-C")
            .arg(layout.path())
            .arg("."));
        self.ctr(&[
            "images",
            "import",
            "--snapshotter",
            "overlayfs",
            named.to_str().unwrap(),
        ]);
        let _ = std::fs::remove_file(&named);
        let listed = self.ctr(&["images", "ls", "-q"]);
        for name in names {
            assert!(
                listed.lines().any(|l| l == *name),
                "{name} not imported from {}: {listed}",
                archive.display()
            );
        }
    }

    async fn start_kubelet(&mut self, cp: &ControlPlane) {
        let d = self.dir.path().to_owned();
        let kubeconfig = cp.kubeconfig_with_token("kubelet", KUBELET_TOKEN);
        std::fs::write(
            d.join("kubelet.yaml"),
            format!(
                r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: true
cgroupRoot: /{cgroup}
failSwapOn: false
containerRuntimeEndpoint: unix://{sock}
podLogsDir: {logs}
evictionHard: {{memory.available: "100Mi"}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
makeIPTablesUtilChains: false
resolvConf: ""
readOnlyPort: 0
address: {NODE_IP}
healthzBindAddress: 127.0.0.1
authentication: {{anonymous: {{enabled: true}}, webhook: {{enabled: false}}}}
authorization: {{mode: AlwaysAllow}}
nodeStatusUpdateFrequency: 2s
serializeImagePulls: false
"#,
                cgroup = self.cgroup,
                sock = self.socket().display(),
                logs = d.join("pod-logs").display(),
            ),
        )
        .expect("kubelet configuration");
        let containerd = self.children[0].1.id();
        let kubelet = super::controlplane::binaries().join("kubelet");
        self.spawn(
            "kubelet",
            Command::new("nsenter")
                .arg(format!("--mount=/proc/{containerd}/ns/mnt"))
                .arg("--")
                .arg(kubelet)
                .arg(format!("--config={}", d.join("kubelet.yaml").display()))
                .arg(format!("--kubeconfig={}", kubeconfig.display()))
                .arg(format!("--root-dir={}", d.join("kubelet").display()))
                .arg(format!("--cert-dir={}", d.join("kubelet/pki").display()))
                .arg(format!("--node-ip={NODE_IP}"))
                .arg(format!("--hostname-override={NODE}"))
                .arg("--v=1")
                .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        );
    }

    /// kube-proxy in nftables mode, in the test's network namespace: Services' cluster
    /// addresses answer there, from the test thread and from the pods. Every connection to one
    /// is masqueraded, so a pod reaching a Service whose endpoint is on its own bridge gets the
    /// answer back through the node (no bridge netfilter needed).
    fn start_proxy(&mut self, cp: &ControlPlane) {
        // A route for the cluster addresses, so a connection to one from the node gets as far as
        // kube-proxy's rewrite (the namespace has no default route).
        run(Command::new("ip").args([
            "route",
            "replace",
            super::controlplane::SERVICE_CIDR,
            "dev",
            "lo",
            "src",
            NODE_IP,
        ]));
        let d = self.dir.path().to_owned();
        let kubeconfig = cp.kubeconfig_with_token("kube-proxy", KUBELET_TOKEN);
        std::fs::write(
            d.join("kube-proxy.yaml"),
            format!(
                r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clientConnection: {{kubeconfig: {kubeconfig}}}
hostnameOverride: {NODE}
clusterCIDR: {POD_CIDR}
detectLocalMode: ClusterCIDR
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nftables: {{masqueradeAll: true}}
conntrack: {{maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
"#,
                kubeconfig = kubeconfig.display(),
            ),
        )
        .expect("kube-proxy configuration");
        let proxy = super::controlplane::binaries().join("kube-proxy");
        self.spawn(
            "kube-proxy",
            Command::new(proxy)
                .arg(format!("--config={}", d.join("kube-proxy.yaml").display()))
                .arg("--v=1")
                .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        );
    }

    /// Every process in the node's cgroup (containerd, the shims, the containers), from the
    /// pids hierarchy.
    fn processes(&self) -> Vec<i32> {
        let root = self.cgroup_dir("pids");
        std::iter::once(root.clone())
            .chain(dirs_under(&root))
            .filter_map(|dir| std::fs::read_to_string(dir.join("cgroup.procs")).ok())
            .flat_map(|procs| {
                procs
                    .lines()
                    .filter_map(|l| l.trim().parse::<i32>().ok())
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

/// Every directory below `dir`, parents before their children.
fn dirs_under(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
                found.push(e.path());
            }
        }
    }
    found
}

/// Every file in `dir` and the directories below it.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    std::iter::once(dir.to_path_buf())
        .chain(dirs_under(dir))
        .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.path())
        .collect()
}

impl Drop for RealNode {
    fn drop(&mut self) {
        use nix::sys::signal::{Signal, kill};
        use nix::unistd::Pid;
        if std::thread::panicking() {
            // What a failed test needs to be understood: the pods, the events, the node's logs.
            let kubectl = super::controlplane::binaries().join("kubectl");
            for args in [
                &["get", "pods", "-A", "-o", "wide"][..],
                &["describe", "pods", "-A"][..],
                &["get", "events", "-A"][..],
            ] {
                if let Ok(out) = Command::new(&kubectl)
                    .arg("--kubeconfig")
                    .arg(&self.kubeconfig)
                    .args(args)
                    .output()
                {
                    eprintln!(
                        "kubectl {}:\n{}",
                        args.join(" "),
                        String::from_utf8_lossy(&out.stdout)
                    );
                }
            }
            for name in ["containerd", "kubelet", "kube-proxy"] {
                eprintln!("{name} (last lines):\n{}", self.log_tail(name, 60));
            }
            // The containers' own output, and runc's words on those it could not start.
            for path in files_under(&self.path("pod-logs")) {
                eprintln!(
                    "{}:\n{}",
                    path.display(),
                    super::controlplane::tail(&path, 30)
                );
            }
            for path in files_under(&self.path("ctd/state")) {
                if path.file_name().is_some_and(|n| n == "log.json") {
                    eprintln!(
                        "{}:\n{}",
                        path.display(),
                        super::controlplane::tail(&path, 30)
                    );
                }
            }
        }
        // The kubelet first (it would restart what dies), then everything in the node's cgroup.
        for (_, child) in self.children.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let sw = ebb::clock::Stopwatch::start();
        loop {
            let pids = self.processes();
            if pids.is_empty() || sw.elapsed() > Duration::from_secs(20) {
                break;
            }
            for pid in pids {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            // Until the kernel has taken them out of the cgroup (bounded by the deadline).
            std::thread::yield_now();
        }
        // The cgroups, deepest first.
        for h in HIERARCHIES {
            let root = self.cgroup_dir(h);
            for dir in dirs_under(&root).iter().rev().chain([&root]) {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}
