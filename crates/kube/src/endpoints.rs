//! Kubernetes discovery.
//!
//! * [`Endpoints`] resolves `k8s://SERVICE.NAMESPACE[:PORT]` to the Service's endpoints, from its
//!   EndpointSlices (label `kubernetes.io/service-name`), watched; `k8s://MEMBER.SERVICE.NAMESPACE`
//!   to the one endpoint whose hostname or pod is `MEMBER`, as cluster DNS names a StatefulSet
//!   pod behind its headless Service (ebb finds its peer replicas so). `PORT` is the Service's port
//!   (its only one when unsaid); the endpoints' port is the slice port of the same name, as
//!   kube-proxy maps them. Which endpoints serve follows KEP-1669: the ready ones; when none is
//!   ready, the serving ones that are terminating (a rollout's last pods keep answering); an
//!   unknown `ready` counts as ready, an unknown `serving` as `ready` says. With a zone
//!   ([`Endpoints::in_zone`]) and every chosen endpoint carrying hints, only those hinted for
//!   the zone are used when there are any (KEP-2433). The choice is a pure function of the slices
//!   ([`serving`]); the slices come from a kube-runtime watcher and are published once each
//!   relist is complete, so a relist never shows a partial list.
//! * [`Env`] resolves `k8s-env://NAME[:PORT]` from the environment Kubernetes gives every
//!   container: `NAME_SERVICE_HOST` and `NAME_SERVICE_PORT` (`NAME` upper case, `-` as `_`),
//!   read once.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::watch;

pub use ebb_core::discovery::k8s::{Target, check, env_names, parts};
use ebb_proxy::discovery::id::ServiceId;
use ebb_proxy::discovery::{Discovery, Resolved, publish};

/// A Service's EndpointSlices, watched.
#[derive(Clone)]
pub struct Endpoints {
    client: Client,
    zone: Option<String>,
}

impl Endpoints {
    /// Discovery through `client`.
    pub fn new(client: Client) -> Endpoints {
        Endpoints { client, zone: None }
    }

    /// Prefers the endpoints hinted for `zone`.
    pub fn in_zone(mut self, zone: Option<String>) -> Endpoints {
        self.zone = zone;
        self
    }
}

/// An endpoint address: (address, port, ready, serving and terminating, the zones hinted).
type Candidate = (IpAddr, u16, bool, bool, Option<Vec<String>>);

/// The addresses serving, by KEP-1669's rules (and KEP-2433's hints for `zone`), on the slice
/// port named `port_name` (`None`: the slices' only port); with `member`, only the endpoint whose
/// hostname or pod has that name.
pub fn serving(
    slices: &[EndpointSlice],
    port_name: Option<&str>,
    member: Option<&str>,
    zone: Option<&str>,
) -> Vec<SocketAddr> {
    let mut all: Vec<Candidate> = Vec::new();
    for s in slices {
        let port = s.ports.iter().flatten().find(|p| match port_name {
            Some(n) => p.name.as_deref() == Some(n),
            None => true,
        });
        let Some(port) = port.and_then(|p| p.port) else {
            continue;
        };
        let Ok(port) = u16::try_from(port) else {
            continue;
        };
        for e in s.endpoints.iter().flatten() {
            if let Some(m) = member {
                let named = |n: Option<&String>| n.is_some_and(|n| n == m);
                if !named(e.hostname.as_ref())
                    && !named(e.target_ref.as_ref().and_then(|t| t.name.as_ref()))
                {
                    continue;
                }
            }
            let c = e.conditions.as_ref();
            let ready = c.and_then(|c| c.ready).unwrap_or(true);
            let serving = c.and_then(|c| c.serving).unwrap_or(ready);
            let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
            let hints = e.hints.as_ref().and_then(|h| {
                h.for_zones
                    .as_ref()
                    .map(|z| z.iter().map(|z| z.name.clone()).collect())
            });
            for a in &e.addresses {
                if let Ok(ip) = a.parse::<IpAddr>() {
                    all.push((ip, port, ready, serving && terminating, hints.clone()));
                }
            }
        }
    }
    let ready: Vec<_> = all.iter().filter(|e| e.2).collect();
    let chosen: Vec<_> = if ready.is_empty() {
        all.iter().filter(|e| e.3).collect()
    } else {
        ready
    };
    if let Some(z) = zone
        && chosen.iter().all(|e| e.4.is_some())
    {
        let hinted: Vec<SocketAddr> = chosen
            .iter()
            .filter(|e| e.4.as_ref().is_some_and(|h| h.iter().any(|n| n == z)))
            .map(|e| SocketAddr::new(e.0, e.1))
            .collect();
        if !hinted.is_empty() {
            return hinted;
        }
    }
    chosen.iter().map(|e| SocketAddr::new(e.0, e.1)).collect()
}

impl Discovery for Endpoints {
    fn schemes(&self) -> Vec<&'static str> {
        vec!["k8s"]
    }

    fn watch(&self, id: &ServiceId) -> Result<watch::Receiver<Resolved>, String> {
        let target = parts(id)?;
        let (tx, rx) = watch::channel(Resolved::default());
        let (me, id) = (self.clone(), id.clone());
        tokio::spawn(async move {
            tokio::select! {
                () = me.follow(&id, &target, &tx) => {}
                () = tx.closed() => {}
            }
        });
        Ok(rx)
    }
}

impl Endpoints {
    /// The Service's port name for `port` (its only port when `None`), read until found.
    async fn port_name(
        &self,
        id: &ServiceId,
        svc: &str,
        ns: &str,
        port: Option<u16>,
        tx: &watch::Sender<Resolved>,
    ) -> Option<String> {
        let services: Api<Service> = Api::namespaced(self.client.clone(), ns);
        let mut backoff = std::time::Duration::from_millis(200);
        loop {
            let found = match services.get(svc).await {
                Ok(s) => {
                    let ports = s.spec.and_then(|s| s.ports).unwrap_or_default();
                    let p = match port {
                        Some(n) => ports.iter().find(|p| p.port == n as i32),
                        None if ports.len() == 1 => ports.first(),
                        None => None,
                    };
                    match p {
                        Some(p) => return p.name.clone(),
                        None => {
                            let list: Vec<String> =
                                ports.iter().map(|p| p.port.to_string()).collect();
                            match port {
                                Some(n) => format!(
                                    "{id}: the Service has no port {n} (ports: {})",
                                    list.join(", ")
                                ),
                                None => format!(
                                    "{id}: the Service has several ports ({}): name one",
                                    list.join(", ")
                                ),
                            }
                        }
                    }
                }
                Err(e) => format!("{id}: reading the Service: {e}"),
            };
            tracing::warn!(service = %id, error = %found, "not resolved yet");
            tx.send_modify(|r| r.error = Some(found));
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(ebb_proxy::discovery::dns::MAX_REFRESH);
        }
    }

    async fn follow(&self, id: &ServiceId, target: &Target, tx: &watch::Sender<Resolved>) {
        let (svc, ns) = (&target.service, &target.namespace);
        let port_name = self.port_name(id, svc, ns, target.port, tx).await;
        let slices: Api<EndpointSlice> = Api::namespaced(self.client.clone(), ns);
        let config =
            watcher::Config::default().labels(&format!("kubernetes.io/service-name={svc}"));
        let mut stream = watcher(slices, config).default_backoff().boxed();
        let mut known: BTreeMap<String, EndpointSlice> = BTreeMap::new();
        let mut listing: BTreeMap<String, EndpointSlice> = BTreeMap::new();
        // A relist's slices are published once it is done.
        let mut relisting = false;
        let name = |s: &EndpointSlice| s.metadata.name.clone().unwrap_or_default();
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(watcher::Event::Init) => {
                    listing.clear();
                    relisting = true;
                }
                Ok(watcher::Event::InitApply(s)) => {
                    listing.insert(name(&s), s);
                }
                Ok(watcher::Event::InitDone) => {
                    known = std::mem::take(&mut listing);
                    relisting = false;
                }
                Ok(watcher::Event::Apply(s)) => {
                    known.insert(name(&s), s);
                }
                Ok(watcher::Event::Delete(s)) => {
                    known.remove(&name(&s));
                }
                Err(e) => {
                    tracing::warn!(service = %id, error = %e, "watching EndpointSlices failed; backing off");
                    continue;
                }
            }
            if !relisting {
                let list: Vec<EndpointSlice> = known.values().cloned().collect();
                publish(
                    tx,
                    id,
                    serving(
                        &list,
                        port_name.as_deref(),
                        target.member.as_deref(),
                        self.zone.as_deref(),
                    ),
                );
            }
        }
    }
}

/// A Service's environment variables, as Kubernetes sets them in every container.
#[derive(Debug, Clone, Default)]
pub struct Env;

/// The instance `k8s-env://NAME[:PORT]` names in `env`.
pub fn from_env(
    id: &ServiceId,
    env: impl Fn(&str) -> Option<String>,
) -> Result<SocketAddr, String> {
    let (host_var, port_var) = env_names(id)?;
    let host = env(&host_var).ok_or_else(|| format!("{id}: ${host_var} is not set"))?;
    let ip: IpAddr = host
        .parse()
        .map_err(|_| format!("{id}: ${host_var} is {host:?}, not an IP address"))?;
    let port = match id.port() {
        Some(p) => p,
        None => {
            let v = env(&port_var).ok_or_else(|| format!("{id}: ${port_var} is not set"))?;
            v.parse()
                .map_err(|_| format!("{id}: ${port_var} is {v:?}, not a port"))?
        }
    };
    Ok(SocketAddr::new(ip, port))
}

impl Discovery for Env {
    fn schemes(&self) -> Vec<&'static str> {
        vec!["k8s-env"]
    }

    fn watch(&self, id: &ServiceId) -> Result<watch::Receiver<Resolved>, String> {
        let addr = from_env(id, |k| std::env::var(k).ok())?;
        let (tx, rx) = watch::channel(Resolved::default());
        publish(&tx, id, vec![addr]);
        Ok(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::{
        Endpoint, EndpointConditions, EndpointHints, EndpointPort, ForZone,
    };

    /// (address, ready, serving, terminating, zones hinted).
    type Ep<'a> = (
        &'a str,
        Option<bool>,
        Option<bool>,
        Option<bool>,
        &'a [&'a str],
    );

    fn slice(ports: &[(&str, i32)], eps: &[Ep<'_>]) -> EndpointSlice {
        EndpointSlice {
            address_type: "IPv4".into(),
            ports: Some(
                ports
                    .iter()
                    .map(|(n, p)| EndpointPort {
                        name: Some((*n).into()),
                        port: Some(*p),
                        ..Default::default()
                    })
                    .collect(),
            ),
            endpoints: Some(
                eps.iter()
                    .map(|(a, ready, serving, terminating, zones)| Endpoint {
                        addresses: vec![(*a).into()],
                        conditions: Some(EndpointConditions {
                            ready: *ready,
                            serving: *serving,
                            terminating: *terminating,
                        }),
                        hints: (!zones.is_empty()).then(|| EndpointHints {
                            for_zones: Some(
                                zones
                                    .iter()
                                    .map(|z| ForZone { name: (*z).into() })
                                    .collect(),
                            ),
                            ..Default::default()
                        }),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }
    }

    fn addrs(v: &[SocketAddr]) -> Vec<String> {
        let mut v: Vec<String> = v.iter().map(|a| a.to_string()).collect();
        v.sort();
        v
    }

    #[test]
    fn ready_endpoints_serve_and_terminating_ones_only_when_none_is_ready() {
        let s = slice(
            &[("http", 8080), ("admin", 9090)],
            &[
                ("10.0.0.1", Some(true), Some(true), Some(false), &[]),
                ("10.0.0.2", Some(false), Some(true), Some(true), &[]),
                ("10.0.0.3", None, None, None, &[]),
                ("10.0.0.4", Some(false), Some(false), Some(false), &[]),
            ],
        );
        assert_eq!(
            addrs(&serving(std::slice::from_ref(&s), Some("http"), None, None)),
            ["10.0.0.1:8080", "10.0.0.3:8080"]
        );
        assert_eq!(
            addrs(&serving(&[s], Some("admin"), None, None)),
            ["10.0.0.1:9090", "10.0.0.3:9090"]
        );
        // None ready: the serving terminating ones (a rollout's last pods still answer).
        let s = slice(
            &[("http", 80)],
            &[
                ("10.0.0.2", Some(false), Some(true), Some(true), &[]),
                ("10.0.0.4", Some(false), Some(false), Some(true), &[]),
            ],
        );
        assert_eq!(addrs(&serving(&[s], None, None, None)), ["10.0.0.2:80"]);
        // A port the slices do not have: nothing.
        let s = slice(
            &[("http", 80)],
            &[("10.0.0.1", Some(true), None, None, &[])],
        );
        assert!(serving(&[s], Some("grpc"), None, None).is_empty());
    }

    #[test]
    fn a_member_names_one_endpoint_by_hostname_or_pod() {
        let mut s = slice(
            &[("admin", 8081)],
            &[
                ("10.0.0.1", Some(true), None, None, &[]),
                ("10.0.0.2", Some(true), None, None, &[]),
                ("10.0.0.3", Some(true), None, None, &[]),
            ],
        );
        let eps = s.endpoints.as_mut().unwrap();
        eps[0].hostname = Some("ebb-0".into());
        eps[1].target_ref = Some(k8s_openapi::api::core::v1::ObjectReference {
            name: Some("ebb-1".into()),
            ..Default::default()
        });
        let one = |m: &str| addrs(&serving(std::slice::from_ref(&s), None, Some(m), None));
        assert_eq!(one("ebb-0"), ["10.0.0.1:8081"]);
        assert_eq!(one("ebb-1"), ["10.0.0.2:8081"]);
        assert!(one("ebb-2").is_empty());

        let id = |t: &str| parts(&ServiceId::parse(t).unwrap());
        let t = id("k8s://ebb-1.ebb-peers.prod:8081").unwrap();
        assert_eq!(
            (t.member.as_deref(), &*t.service, &*t.namespace, t.port),
            (Some("ebb-1"), "ebb-peers", "prod", Some(8081))
        );
        assert_eq!(id("k8s://api.prod").unwrap().member, None);
        for bad in ["k8s://api", "k8s://a.b.c.d", "k8s://a..b"] {
            assert!(id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn zone_hints_narrow_the_endpoints_when_every_one_has_them() {
        let s = slice(
            &[("http", 80)],
            &[
                ("10.0.0.1", Some(true), None, None, &["a"]),
                ("10.0.0.2", Some(true), None, None, &["b"]),
            ],
        );
        assert_eq!(
            addrs(&serving(std::slice::from_ref(&s), None, None, Some("a"))),
            ["10.0.0.1:80"]
        );
        assert_eq!(
            addrs(&serving(std::slice::from_ref(&s), None, None, Some("c"))).len(),
            2,
            "none for c: all"
        );
        assert_eq!(addrs(&serving(&[s], None, None, None)).len(), 2);
        let mixed = slice(
            &[("http", 80)],
            &[
                ("10.0.0.1", Some(true), None, None, &["a"]),
                ("10.0.0.2", Some(true), None, None, &[]),
            ],
        );
        assert_eq!(
            addrs(&serving(&[mixed], None, None, Some("a"))).len(),
            2,
            "hints ignored"
        );
    }

    #[test]
    fn environment_variables_name_a_services_address() {
        let env = |k: &str| match k {
            "SHOP_API_SERVICE_HOST" => Some("10.96.0.7".to_owned()),
            "SHOP_API_SERVICE_PORT" => Some("8080".to_owned()),
            "BAD_SERVICE_HOST" => Some("shop".to_owned()),
            _ => None,
        };
        let id = |s: &str| ServiceId::parse(s).unwrap();
        assert_eq!(
            from_env(&id("k8s-env://shop-api"), env)
                .unwrap()
                .to_string(),
            "10.96.0.7:8080"
        );
        assert_eq!(
            from_env(&id("k8s-env://shop-api:9000"), env)
                .unwrap()
                .to_string(),
            "10.96.0.7:9000"
        );
        assert!(
            from_env(&id("k8s-env://nope"), env)
                .unwrap_err()
                .contains("NOPE_SERVICE_HOST")
        );
        assert!(
            from_env(&id("k8s-env://bad"), env)
                .unwrap_err()
                .contains("not an IP")
        );
        assert!(check(&id("k8s://shop")).is_err());
        assert!(check(&id("k8s://a.b.c.d")).is_err());
        assert!(check(&id("k8s://ebb-1.ebb-peers.prod:8081")).is_ok());
        assert!(check(&id("k8s://api.shop:80")).is_ok());
    }
}
