//! `ebb.toml`: the apps ebb serves on one machine, their domains and how they scale.
//!
//! ```toml
//! [[app]]
//! name = "demo"
//! domains = ["demo.localhost"]
//! command = ["ebb", "example-app"]   # must listen on 127.0.0.1:$PORT
//! idle_after_ms = 30000
//! ```
//!
//! Parsing is strict (unknown keys are errors) and every error names the file and the problem.
//! The admin API validates a route's JSON with the same rules ([`AppConfig`]), so a route is the
//! same whichever way it came.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::event::{ProcessSpec, RouteSpec};
pub use crate::warm::{MAX_WARM_MS, MAX_WARM_WINDOWS, WarmConfig, check_warm, warm_windows};

/// The whole file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The apps.
    #[serde(default, rename = "app")]
    pub apps: Vec<AppConfig>,
    /// Function templates, with the functions API's fields (`name`, `function`, `command`,
    /// `left`, `right`, `maxInstanceNum`, ...).
    #[serde(default, rename = "function")]
    pub functions: Vec<crate::functions::TemplateJson>,
    /// Cleaners of ebb's own objects (apps, function templates, ended calls and instances),
    /// with the `Cleaner` resource's fields and a `name`.
    #[serde(default, rename = "cleaner")]
    pub cleaners: Vec<crate::cleaner::config::CleanerConfig>,
    /// Meta services (`conf://NAME`): routes, rewriting and weighted destinations, served by the
    /// proxy on their domains ([`crate::discovery::meta`]).
    #[serde(default, rename = "service")]
    pub services: Vec<crate::discovery::meta::ServiceConfig>,
    /// The services checked (built at load).
    #[serde(skip)]
    pub meta: Vec<crate::discovery::meta::MetaService>,
}

/// One app: a route and the workload behind it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppConfig {
    /// Route and workload name.
    pub name: String,
    /// Host names (exact or `*.suffix`).
    pub domains: Vec<String>,
    /// Program and arguments; the program `ebb` means this ebb binary.
    pub command: Vec<String>,
    /// Extra environment.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// Working directory (relative to the config file).
    #[serde(default)]
    pub cwd: Option<PathBuf>,
    /// HTTP readiness path (default `/health`); empty for a TCP connect check.
    #[serde(default = "default_health")]
    pub readiness_path: Option<String>,
    /// Scale to zero after this long without a request.
    #[serde(default = "default_idle")]
    pub idle_after_ms: u64,
    /// Replicas kept when idle.
    #[serde(default)]
    pub min_replicas: u32,
    /// Upper bound on replicas.
    #[serde(default = "default_max")]
    pub max_replicas: u32,
    /// How long a request waits for a ready replica.
    #[serde(default = "default_hold_timeout")]
    pub hold_timeout_ms: u64,
    /// How many requests may wait at once.
    #[serde(default = "default_hold_queue")]
    pub hold_queue_max: u32,
    /// A replica not ready after this long has failed to start.
    #[serde(default = "default_startup_timeout")]
    pub startup_timeout_ms: u64,
    /// Time between SIGTERM and SIGKILL.
    #[serde(default = "default_grace")]
    pub stop_grace_ms: u64,
    /// Requests one replica serves at once (0: no bound), like Knative's
    /// `containerConcurrency`; more wait in the hold queue for a slot.
    #[serde(default)]
    pub concurrency: u32,
    /// Connections ebb opens to one replica at once (default 4): an app with a small accept
    /// backlog is never sent more connection attempts than this at a time.
    #[serde(default)]
    pub max_connecting: u32,
    /// How a replica is picked for each request ([`crate::discovery::Policy`]; absent: peak
    /// EWMA).
    #[serde(default)]
    pub policy: crate::discovery::Policy,
    /// Replicas an idle app is scaled down to, and runs from ebb's start (absent:
    /// `min_replicas`).
    #[serde(default)]
    pub idle_replicas: Option<u32>,
    /// Keep-warm windows: `[{ schedule = "0 8 * * 1-5", for = "10h", min = 1, timezone =
    /// "Europe/Paris" }]`.
    #[serde(default)]
    pub warm: Vec<WarmConfig>,
    /// How long a replica may take to begin answering (0: no bound): 504 `response_timeout`.
    #[serde(default)]
    pub response_timeout_ms: u64,
    /// How long a request under way may move no byte either way (0: `--request-stall-timeout-ms`):
    /// 504 `stream_idle_timeout` before the answer began, else closed.
    #[serde(default)]
    pub stream_idle_timeout_ms: u64,
    /// How long a client connection may sit idle after a request of this app, and a WebSocket
    /// may move no byte (0: `--client-idle-timeout-ms`, and no bound on WebSockets).
    #[serde(default)]
    pub connection_idle_timeout_ms: u64,
    /// A page for browsers while the app wakes (`{}`: ebb's built-in page).
    #[serde(default)]
    pub waiting_page: Option<WaitingPageConfig>,
    /// A TCP app: the address ebb listens on for it (`127.0.0.1:6380`); `domains` may be empty
    /// and its readiness is a TCP connect.
    #[serde(default)]
    pub listen: Option<String>,
    /// Scaling on load between `min_replicas` (at least one once woken) and `max_replicas`:
    /// `{ target_concurrency = 4 }` or `{ target_rps = 50 }`, with Knative's other knobs
    /// ([`crate::event::LoadSpec`]).
    #[serde(default)]
    pub load: Option<crate::event::LoadSpec>,
}

/// A waiting page as written in `ebb.toml` and the admin API.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitingPageConfig {
    /// The page's HTML (`{{route}}`, `{{expected_wait}}`, `{{expected_wait_s}}` and
    /// `{{refresh_s}}` are filled in).
    #[serde(default)]
    pub template: Option<String>,
    /// A file holding the page's HTML, relative to the config file (not in the admin API).
    #[serde(default)]
    pub template_file: Option<PathBuf>,
    /// Seconds between the page's reloads (default 1, at most 60).
    #[serde(default)]
    pub refresh_s: u32,
}

impl WaitingPageConfig {
    /// The page, its file read (relative to `base`) and checked.
    pub fn page(&self, base: Option<&Path>) -> Result<crate::event::WaitingPage, String> {
        let template = match (&self.template, &self.template_file) {
            (Some(_), Some(_)) => {
                return Err("waiting_page: give template or template_file, not both".into());
            }
            (Some(t), None) => Some(t.clone()),
            (None, Some(f)) => {
                let Some(base) = base else {
                    return Err(
                        "waiting_page: template_file is for ebb.toml; give the template itself"
                            .into(),
                    );
                };
                let path = base.join(f);
                let meta = std::fs::metadata(&path)
                    .map_err(|e| format!("waiting_page: {}: {e}", path.display()))?;
                if meta.len() > crate::waiting::MAX_TEMPLATE_BYTES as u64 {
                    return Err(format!(
                        "waiting_page: {} has {} bytes; at most {}",
                        path.display(),
                        meta.len(),
                        crate::waiting::MAX_TEMPLATE_BYTES
                    ));
                }
                Some(
                    std::fs::read_to_string(&path)
                        .map_err(|e| format!("waiting_page: {}: {e}", path.display()))?,
                )
            }
            (None, None) => None,
        };
        let page = crate::event::WaitingPage {
            template,
            refresh_s: self.refresh_s,
        };
        crate::waiting::check(&page)?;
        Ok(page)
    }
}

fn default_health() -> Option<String> {
    Some("/health".into())
}
pub fn default_idle() -> u64 {
    300_000
}
pub fn default_max() -> u32 {
    1
}
pub fn default_hold_timeout() -> u64 {
    30_000
}
pub fn default_hold_queue() -> u32 {
    1_000
}
fn default_startup_timeout() -> u64 {
    30_000
}
fn default_grace() -> u64 {
    10_000
}

/// Why a config file was refused.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {}: {source}", .path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", .path.display())]
    Invalid { path: PathBuf, message: String },
}

impl Config {
    /// Reads and checks a config file.
    pub fn load(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses and checks the text of a config file; `path` names it in errors, and relative
    /// working directories are taken from its directory.
    pub fn parse(text: &str, path: &Path) -> Result<Self, Error> {
        let invalid = |message: String| Error::Invalid {
            path: path.to_owned(),
            message,
        };
        let mut cfg: Config = toml::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let mut fn_names = std::collections::BTreeSet::new();
        for f in &cfg.functions {
            if !fn_names.insert(f.name.clone()) {
                return Err(invalid(format!("function {:?} is defined twice", f.name)));
            }
            f.clone()
                .into_spec()
                .map_err(|e| invalid(format!("function {:?}: {e}", f.name)))?;
        }
        let mut cleaner_names = std::collections::BTreeSet::new();
        for c in &cfg.cleaners {
            if !cleaner_names.insert(c.name.clone()) {
                return Err(invalid(format!("cleaner {:?} is defined twice", c.name)));
            }
            let spec = crate::cleaner::config::config_spec(c);
            if !spec.invalid.is_empty() {
                return Err(invalid(format!("cleaner {:?}: {}", c.name, spec.invalid)));
            }
            if let Err(e) = crate::cleaner::compile(&spec) {
                return Err(invalid(format!("cleaner {:?}: {e}", c.name)));
            }
        }
        let base = path.parent().unwrap_or(Path::new("."));
        let mut names = std::collections::BTreeSet::new();
        let mut domains = std::collections::BTreeMap::new();
        let mut listens = std::collections::BTreeMap::new();
        for app in &mut cfg.apps {
            if !names.insert(app.name.clone()) {
                return Err(invalid(format!("app {:?} is defined twice", app.name)));
            }
            if let Some(w) = &mut app.waiting_page {
                let page = w
                    .page(Some(base))
                    .map_err(|e| invalid(format!("app {:?}: {e}", app.name)))?;
                *w = WaitingPageConfig {
                    template: page.template,
                    template_file: None,
                    refresh_s: page.refresh_s,
                };
            }
            app.validate().map_err(invalid)?;
            if let Some(l) = &app.listen
                && let Some(other) = listens.insert(l.clone(), app.name.clone())
            {
                return Err(invalid(format!(
                    "listen {l:?} belongs to both {other:?} and {:?}",
                    app.name
                )));
            }
            for d in &app.domains {
                if let Some(other) = domains.insert(d.clone(), app.name.clone()) {
                    return Err(invalid(format!(
                        "domain {d:?} belongs to both {other:?} and {:?}",
                        app.name
                    )));
                }
            }
            if let Some(cwd) = &app.cwd {
                app.cwd = Some(base.join(cwd));
            }
        }
        let mut service_names = std::collections::BTreeSet::new();
        for s in &cfg.services {
            if !service_names.insert(s.name.clone()) {
                return Err(invalid(format!("service {:?} is defined twice", s.name)));
            }
            let meta = crate::discovery::meta::MetaService::build(s).map_err(invalid)?;
            for d in &meta.domains {
                if let Some(other) = domains.insert(d.clone(), format!("service {}", s.name)) {
                    return Err(invalid(format!(
                        "domain {d:?} belongs to both {other:?} and service {:?}",
                        s.name
                    )));
                }
            }
            cfg.meta.push(meta);
        }
        Ok(cfg)
    }
}

impl AppConfig {
    /// Checks one app on its own (and lower-cases its domains).
    pub fn validate(&mut self) -> Result<(), String> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 63
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !self.name.starts_with('-');
        if !name_ok {
            return Err(format!(
                "app name {:?}: use 1-63 letters, digits, '-' and '_'",
                self.name
            ));
        }
        if self.command.is_empty() {
            return Err(format!("app {:?}: command is empty", self.name));
        }
        if self.domains.is_empty() && self.listen.is_none() {
            return Err(format!(
                "app {:?}: no domains (and no listen address of a TCP app)",
                self.name
            ));
        }
        if let Some(l) = &self.listen {
            l.parse::<std::net::SocketAddr>().map_err(|_| {
                format!(
                    "app {:?}: listen {l:?} is not an IP:port address",
                    self.name
                )
            })?;
        }
        self.policy
            .validate()
            .map_err(|e| format!("app {:?}: {e}", self.name))?;
        if self.max_replicas == 0 || self.min_replicas > self.max_replicas {
            return Err(format!(
                "app {:?}: need 0 <= min_replicas <= max_replicas and max_replicas >= 1",
                self.name
            ));
        }
        if self.idle_replicas.is_some_and(|n| n > self.max_replicas) {
            return Err(format!(
                "app {:?}: need idle_replicas <= max_replicas",
                self.name
            ));
        }
        warm_windows(&self.warm, self.max_replicas)
            .map_err(|e| format!("app {:?}: {e}", self.name))?;
        if let Some(l) = &self.load {
            crate::scaler::load::Settings::of(l, self.min_replicas, self.max_replicas)
                .map_err(|e| format!("app {:?}: load: {e}", self.name))?;
        }
        if let Some(w) = &self.waiting_page {
            w.page(None)
                .map_err(|e| format!("app {:?}: {e}", self.name))?;
        }
        for d in &mut self.domains {
            *d = d.to_ascii_lowercase();
            if !crate::ids::valid_domain(d) {
                return Err(format!("app {:?}: {d:?} is not a host name", self.name));
            }
        }
        Ok(())
    }

    /// The route this app serves, with how to run it.
    pub fn route(&self) -> RouteSpec {
        RouteSpec {
            name: self.name.clone(),
            domains: self.domains.clone(),
            deployment: self.name.clone(),
            idle_after_ms: self.idle_after_ms,
            min_replicas: self.min_replicas,
            max_replicas: self.max_replicas,
            hold_timeout_ms: self.hold_timeout_ms,
            hold_queue_max: self.hold_queue_max,
            process: Some(ProcessSpec {
                command: self.command.clone(),
                env: self.env.clone().into_iter().collect(),
                cwd: self.cwd.as_ref().map(|c| c.to_string_lossy().into_owned()),
                // A TCP app is ready when it accepts a connection.
                readiness_path: self
                    .readiness_path
                    .clone()
                    .filter(|p| !p.is_empty() && self.listen.is_none()),
                startup_timeout_ms: self.startup_timeout_ms,
                stop_grace_ms: self.stop_grace_ms,
                pre_run: None,
            }),
            concurrency: self.concurrency,
            max_connecting: self.max_connecting,
            policy: Box::new(self.policy.clone()),
            idle_replicas: self.idle_replicas,
            // Checked by `validate`.
            warm: warm_windows(&self.warm, self.max_replicas).unwrap_or_default(),
            response_timeout_ms: self.response_timeout_ms,
            stream_idle_timeout_ms: self.stream_idle_timeout_ms,
            connection_idle_timeout_ms: self.connection_idle_timeout_ms,
            // Read and checked by `validate` (a file of ebb.toml's becomes its text at load).
            waiting_page: self.waiting_page.as_ref().and_then(|w| w.page(None).ok()),
            listen: self.listen.clone(),
            load: self.load.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Config, Error> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ebb.toml");
        std::fs::write(&path, text).unwrap();
        Config::load(&path)
    }

    #[test]
    fn the_demo_config_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/demo.toml");
        let cfg = Config::load(&path).unwrap();
        let demo = cfg.apps[0].route();
        assert_eq!(demo.domains, ["demo.localhost", "*.demo.localhost"]);
        let process = demo.process.unwrap();
        assert_eq!(process.command, ["ebb", "example-app"]);
        assert_eq!(process.readiness_path.as_deref(), Some("/health"));
    }

    #[test]
    fn bad_configs_are_refused_with_the_reason() {
        let app = |name: &str, domain: &str| {
            format!("[[app]]\nname = \"{name}\"\ndomains = [\"{domain}\"]\ncommand = [\"x\"]\n")
        };
        let cases = [
            (
                format!("{}{}", app("a", "x.test"), app("b", "X.test")),
                "belongs to both",
            ),
            (
                format!("{}{}", app("a", "x.test"), app("a", "y.test")),
                "defined twice",
            ),
            (
                format!("{}colour = \"red\"\n", app("a", "x.test")),
                "unknown field",
            ),
            (
                "[[app]]\nname = \"a\"\ndomains = [\"a\"]\ncommand = []\n".to_owned(),
                "command is empty",
            ),
            (
                format!("{}min_replicas = 3\nmax_replicas = 2\n", app("a", "x.test")),
                "min_replicas <= max_replicas",
            ),
            ("[[app]]\nname = 1\n".to_owned(), "invalid type"),
            (
                format!("{}max_replicas = 9\nload = {{}}\n", app("a", "x.test")),
                "load: load scaling needs target_concurrency or target_rps",
            ),
            (
                format!("{}load = {{ target_concurrency = 4 }}\n", app("a", "x.test")),
                "max replicas is 1, set it above 1",
            ),
            (
                format!(
                    "{}max_replicas = 9\nload = {{ target_rps = 5, target_concurrency = 4 }}\n",
                    app("a", "x.test")
                ),
                "not both",
            ),
            (
                format!(
                    "{}max_replicas = 9\nload = {{ target_concurrency = 4, window_ms = 1000 }}\n",
                    app("a", "x.test")
                ),
                "the window must be within 6 s and 1 h",
            ),
            (
                format!(
                    "{}max_replicas = 9\nload = {{ target_concurrency = 4, utilisation = 50 }}\n",
                    app("a", "x.test")
                ),
                "unknown field `utilisation`",
            ),
            (
                format!(
                    "{}[[service]]\nname = \"s\"\ndomains = [\"x.test\"]\n[[service.route]]\ndestinations = [{{ addresses = [\"127.0.0.1:1\"] }}]\n",
                    app("a", "x.test")
                ),
                "belongs to both",
            ),
            (
                "[[service]]\nname = \"s\"\n[[service.route]]\ndestinations = [{ service = \"nope://x\" }]\n".to_owned(),
                "unknown scheme",
            ),
            (
                format!("{}policy = {{ balancer = \"consistent_hash\" }}\n", app("a", "x.test")),
                "needs hash_on",
            ),
        ];
        for (text, needle) in cases {
            let err = load(&text).unwrap_err().to_string();
            assert!(err.contains("ebb.toml"), "{err}");
            assert!(err.contains(needle), "{needle:?} not in {err:?}");
        }
        let missing = Config::load(Path::new("/nonexistent/ebb.toml")).unwrap_err();
        assert!(
            missing
                .to_string()
                .contains("reading /nonexistent/ebb.toml")
        );
    }
}
