//! From the Gateway API's objects to what ebb serves and what their statuses say.
//!
//! [`compile`] is pure: the same [`World`] always gives the same [`Output`]. It decides, in this
//! order:
//!
//! 1. **Classes**: a `GatewayClass` is ebb's when its `controllerName` is
//!    [`CONTROLLER_NAME`]; it is `Accepted`.
//! 2. **Addresses**: each Gateway of an ebb class gets one ([`Addressing`]). From a pool, a
//!    Gateway keeps the address its status names while no older Gateway holds it, else takes the
//!    first free one, oldest Gateway first; with the pool spent it is not `Programmed`
//!    (`AddressNotAssigned`).
//! 3. **Listeners**: `HTTP` and `HTTPS` (TLS terminated with the Secrets named) are served;
//!    another protocol is `UnsupportedProtocol`. Two listeners on one port with different
//!    protocols conflict (`ProtocolConflict`), with the same hostname (`HostnameConflict`). A
//!    certificate is a `kubernetes.io/tls` Secret in the Gateway's namespace, or another one
//!    that a ReferenceGrant opens to Gateways of this namespace; else `RefNotPermitted` or
//!    `InvalidCertificateRef`. Route kinds other than `HTTPRoute` and `GRPCRoute` are
//!    `InvalidRouteKinds`. A socket the kernel refused is `PortUnavailable`.
//! 4. **Routes** (HTTPRoutes, and GRPCRoutes read as HTTPRoutes whose paths are
//!    `/SERVICE/METHOD`), oldest first: each parent reference to an ebb Gateway attaches the
//!    route to the listeners it names (all, or by `sectionName` and `port`), that allow the
//!    route's namespace and kind and whose hostname intersects the route's, and where no older
//!    route of the other kind holds one of its host names; else the reference is not
//!    `Accepted`, with the reason that failed first (`NoMatchingParent`,
//!    `NotAllowedByListeners`, `NoMatchingListenerHostname`, `HostnameConflict`). A host name
//!    an annotated Service serves is the Service's (the route loses it; `HostnameConflict` when
//!    it had no other). Each backend must be a Service that exists, in the route's
//!    namespace or opened by a ReferenceGrant, with the port named; else `ResolvedRefs` is false
//!    (`InvalidKind`, `RefNotPermitted`, `BackendNotFound`) and that backend's share of requests
//!    gets 500.
//! 5. **Sockets**: every valid listener's routes, for each hostname their hostnames and the
//!    listener's intersect in, become one meta service of routes in precedence order (exact
//!    path, then regular expression, then the longest prefix; then a method; then the most
//!    headers, then the most query parameters; then the oldest route, its `NAMESPACE/NAME`, the
//!    rule's and the match's order; a GRPCRoute's longest service, then longest method, then
//!    most headers, and the same ties). A hostname a more specific listener of the same socket
//!    covers is that listener's alone.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use super::*;
use crate::discovery::id::ServiceId;
use crate::discovery::meta::{
    Changes, Destination, MetaRoute, MetaService, PathMatch, PathRewrite, Redirect, Regex, Source,
    ValueMatch,
};
use crate::discovery::policy::Policy;

/// One status condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    pub type_: &'static str,
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
    pub observed_generation: i64,
}

fn cond(
    type_: &'static str,
    status: bool,
    reason: &'static str,
    message: impl Into<String>,
    generation: i64,
) -> Condition {
    Condition {
        type_,
        status,
        reason,
        message: message.into(),
        observed_generation: generation,
    }
}

/// A GatewayClass's status.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassStatus {
    pub name: String,
    pub conditions: Vec<Condition>,
    /// The conformance features ebb implements ([`super::SUPPORTED_FEATURES`]).
    pub supported_features: Vec<&'static str>,
}

/// A listener's status.
#[derive(Debug, Clone, PartialEq)]
pub struct ListenerStatus {
    pub name: String,
    pub supported_kinds: Vec<RouteGroupKind>,
    pub attached_routes: i32,
    pub conditions: Vec<Condition>,
}

/// A Gateway's status.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayStatus {
    pub meta: Meta,
    /// `IPAddress` values.
    pub addresses: Vec<String>,
    pub conditions: Vec<Condition>,
    pub listeners: Vec<ListenerStatus>,
}

/// The status of one parent reference of a route (ebb's parents only; the others' are not
/// ebb's to write).
#[derive(Debug, Clone, PartialEq)]
pub struct ParentStatus {
    pub parent_ref: ParentRef,
    pub conditions: Vec<Condition>,
}

/// A route's status, as far as it is ebb's.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteStatus {
    /// `HTTPRoute` or `GRPCRoute`.
    pub kind: &'static str,
    pub meta: Meta,
    pub parents: Vec<ParentStatus>,
}

/// A certificate a TLS socket presents, for the hostnames its listener names.
#[derive(Debug, Clone, PartialEq)]
pub struct Certificate {
    /// The listener's hostname (`None`: any).
    pub hostname: Option<String>,
    pub secret: TlsSecret,
}

/// One address and port ebb serves, with what it serves there.
#[derive(Debug, Clone, PartialEq)]
pub struct Socket {
    pub addr: SocketAddr,
    /// TLS: the certificates, the most specific listener hostname first. `None`: plain HTTP.
    pub tls: Option<Vec<Certificate>>,
    /// A request's Host, looked up with `ids::match_host` (exact, then the longest `*.suffix`,
    /// then `*`), leads to one of these.
    pub hosts: BTreeMap<String, MetaService>,
    /// Its listeners' hostnames (lower case, `*` for none): on a TLS socket, a request whose
    /// Host belongs to another listener than its SNI ([`listener_for`]) is misdirected (421).
    pub listeners: Vec<String>,
}

/// The pattern of the most specific listener (of hostname `patterns`) that takes `host`.
pub fn listener_for<'a>(patterns: &'a [String], host: &str) -> Option<&'a str> {
    patterns
        .iter()
        .filter(|p| covers(p, host))
        .min_by_key(|p| specificity(p))
        .map(String::as_str)
}

/// What the objects give.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Output {
    pub classes: Vec<ClassStatus>,
    pub gateways: Vec<GatewayStatus>,
    pub routes: Vec<RouteStatus>,
    pub sockets: Vec<Socket>,
    /// Each route's attachment told in one line, for the log (`GatewayRouteAttached`): by
    /// `KIND/NAMESPACE/NAME` (`HTTPRoute/...`, `GRPCRoute/...`), which listeners took it or why
    /// none did.
    pub attachments: BTreeMap<String, String>,
}

fn group_is(g: &Option<String>, want: &str) -> bool {
    g.as_deref().unwrap_or(want) == want || (want.is_empty() && g.as_deref() == Some("core"))
}

/// Whether a ReferenceGrant in `to_ns` lets a `from_kind` of `from_ns` refer to `to_kind`
/// (core group) `to_name`.
fn granted(
    grants: &[ReferenceGrant],
    from_kind: &str,
    from_ns: &str,
    to_ns: &str,
    to_kind: &str,
    to_name: &str,
) -> bool {
    from_ns == to_ns
        || grants.iter().any(|g| {
            g.meta.namespace == to_ns
                && g.spec
                    .from
                    .iter()
                    .any(|f| f.group == GROUP && f.kind == from_kind && f.namespace == from_ns)
                && g.spec.to.iter().any(|t| {
                    (t.group.is_empty() || t.group == "core")
                        && t.kind == to_kind
                        && t.name.as_deref().is_none_or(|n| n == to_name)
                })
        })
}

/// Whether two hostnames (exact, `*.suffix`, or `None`: any) have a host in common, and the most
/// specific such pattern.
pub fn intersect(a: Option<&str>, b: Option<&str>) -> Option<String> {
    match (a, b) {
        (None, None) => Some("*".to_owned()),
        (Some(x), None) | (None, Some(x)) => Some(x.to_ascii_lowercase()),
        (Some(x), Some(y)) => {
            let (x, y) = (x.to_ascii_lowercase(), y.to_ascii_lowercase());
            let covers = |pat: &str, host: &str| match pat.strip_prefix('*') {
                Some(suffix) => host.ends_with(suffix) && host.len() > suffix.len(),
                None => pat == host,
            };
            if x == y {
                Some(x)
            } else if covers(&x, &y) {
                Some(y)
            } else if covers(&y, &x) {
                Some(x)
            } else {
                None
            }
        }
    }
}

/// Whether every host `host` (a name or a pattern) stands for is one `pattern` (a name,
/// `*.suffix` or `*`) takes.
fn covers(pattern: &str, host: &str) -> bool {
    pattern == "*" || (host != "*" && intersect(Some(pattern), Some(host)).as_deref() == Some(host))
}

/// How specific a hostname pattern is: exact names first, then longer wildcards, `*` last.
fn specificity(pattern: &str) -> (u8, usize) {
    if pattern == "*" {
        (2, 0)
    } else if let Some(s) = pattern.strip_prefix('*') {
        (1, usize::MAX - s.len())
    } else {
        (0, 0)
    }
}

struct ListenerState<'a> {
    spec: &'a Listener,
    status: ListenerStatus,
    /// Accepted, programmed and not conflicted: routes may attach and traffic flows.
    valid: bool,
    /// Valid but for its socket, which the kernel refused: still handed to the proxy, which
    /// tries it again (and reports it until it has it).
    retried: bool,
    /// The route kinds it takes.
    kinds: Vec<&'static str>,
    certs: Vec<Certificate>,
}

const HTTP_ROUTE: &str = "HTTPRoute";
const GRPC_ROUTE: &str = "GRPCRoute";
/// The route kinds ebb serves, as a listener's `supportedKinds` names them.
const ROUTE_KINDS: [&str; 2] = [HTTP_ROUTE, GRPC_ROUTE];

/// A route of either kind as the compile step takes it: a GRPCRoute's rules read as an
/// HTTPRoute's, its service and method a path (`/SERVICE/METHOD`) and its headers headers.
#[derive(Debug, Clone)]
struct Route {
    kind: &'static str,
    meta: Meta,
    spec: HttpRouteSpec,
    /// A GRPCRoute's matches' service and method lengths, by rule and match: the first of its
    /// precedence (an HTTPRoute's paths come first in its own).
    grpc: Option<Vec<Vec<(usize, usize)>>>,
}

impl Route {
    fn http(r: &HttpRoute) -> Route {
        Route {
            kind: HTTP_ROUTE,
            meta: r.meta.clone(),
            spec: r.spec.clone(),
            grpc: None,
        }
    }

    fn grpc(r: &GrpcRoute) -> Route {
        let mut lengths = Vec::new();
        let rules = r
            .spec
            .rules
            .iter()
            .map(|rule| {
                let mut lens = Vec::new();
                let matches = rule
                    .matches
                    .iter()
                    .map(|m| {
                        let (path, len) = match &m.method {
                            None => (None, (0, 0)),
                            Some(mm) => grpc_path(mm),
                        };
                        lens.push(len);
                        HttpRouteMatch {
                            path,
                            headers: m.headers.clone(),
                            query_params: Vec::new(),
                            method: None,
                        }
                    })
                    .collect();
                if rule.matches.is_empty() {
                    lens.push((0, 0));
                }
                lengths.push(lens);
                HttpRouteRule {
                    name: rule.name.clone(),
                    matches,
                    filters: rule.filters.clone(),
                    backend_refs: rule.backend_refs.clone(),
                    timeouts: None,
                }
            })
            .collect();
        Route {
            kind: GRPC_ROUTE,
            meta: r.meta.clone(),
            spec: HttpRouteSpec {
                parent_refs: r.spec.parent_refs.clone(),
                hostnames: r.spec.hostnames.clone(),
                rules,
            },
            grpc: Some(lengths),
        }
    }

    /// `KIND/NAMESPACE/NAME`.
    fn key(&self) -> String {
        format!("{}/{}", self.kind, self.meta.key())
    }
}

/// A gRPC method match as a path match (`/SERVICE/METHOD`), with its service's and method's
/// lengths. Exact names are matched exactly, a name left out is any name (`[^/]+`), and a
/// regular expression is taken as it is.
fn grpc_path(m: &GrpcMethodMatch) -> (Option<HttpPathMatch>, (usize, usize)) {
    let service = m.service.as_deref().filter(|s| !s.is_empty());
    let method = m.method.as_deref().filter(|s| !s.is_empty());
    let lengths = (service.map_or(0, str::len), method.map_or(0, str::len));
    let regex = m.type_.as_deref() == Some("RegularExpression");
    let path = match (service, method) {
        (Some(s), Some(m)) if !regex => HttpPathMatch {
            type_: Some("Exact".into()),
            value: Some(format!("/{s}/{m}")),
        },
        _ => {
            let part = |p: Option<&str>| match p {
                None => "[^/]+".to_owned(),
                Some(p) if regex => format!("(?:{p})"),
                Some(p) => regex::escape(p),
            };
            HttpPathMatch {
                type_: Some("RegularExpression".into()),
                value: Some(format!("/{}/{}", part(service), part(method))),
            }
        }
    };
    (Some(path), lengths)
}

/// Whether two hostname patterns (`*` any host) have a host in common.
fn overlap(a: &str, b: &str) -> bool {
    fn any(h: &str) -> Option<&str> {
        (h != "*").then_some(h)
    }
    intersect(any(a), any(b)).is_some()
}

/// Compiles the Gateway API objects (see the module's documentation).
pub fn compile(world: &World, addressing: &Addressing) -> Output {
    let mut out = Output::default();
    let ours: BTreeSet<&str> = world
        .classes
        .iter()
        .filter(|c| c.spec.controller_name == CONTROLLER_NAME)
        .map(|c| c.meta.name.as_str())
        .collect();
    for c in &world.classes {
        if ours.contains(c.meta.name.as_str()) {
            out.classes.push(ClassStatus {
                name: c.meta.name.clone(),
                conditions: vec![
                    cond(
                        "Accepted",
                        true,
                        "Accepted",
                        "ebb serves it",
                        c.meta.generation,
                    ),
                    cond(
                        "SupportedVersion",
                        true,
                        "SupportedVersion",
                        "",
                        c.meta.generation,
                    ),
                ],
                supported_features: SUPPORTED_FEATURES.to_vec(),
            });
        }
    }
    let mut gateways: Vec<&Gateway> = world
        .gateways
        .iter()
        .filter(|g| ours.contains(g.spec.gateway_class_name.as_str()))
        .collect();
    gateways.sort_by(|a, b| (&a.meta.created, a.meta.key()).cmp(&(&b.meta.created, b.meta.key())));
    let addresses = assign(&gateways, addressing);

    // Listeners.
    let mut states: Vec<Vec<ListenerState<'_>>> = Vec::new();
    for (gi, gw) in gateways.iter().enumerate() {
        let generation = gw.meta.generation;
        let mut ls: Vec<ListenerState<'_>> = Vec::new();
        for l in &gw.spec.listeners {
            let mut conditions = Vec::new();
            let protocol_ok = matches!(l.protocol.as_str(), "HTTP" | "HTTPS");
            // Kinds.
            let mut kinds: Vec<&'static str> = Vec::new();
            let mut bad_kinds = false;
            match l.allowed_routes.as_ref().map(|a| &a.kinds) {
                Some(k) if !k.is_empty() => {
                    for rk in k {
                        match ROUTE_KINDS.iter().find(|&&known| known == rk.kind) {
                            Some(known) if group_is(&rk.group, GROUP) => {
                                if !kinds.contains(known) {
                                    kinds.push(known);
                                }
                            }
                            _ => bad_kinds = true,
                        }
                    }
                }
                _ if protocol_ok => kinds.extend(ROUTE_KINDS),
                _ => {}
            }
            // Certificates.
            let mut refs_problem: Option<(&'static str, String)> = None;
            let mut certs = Vec::new();
            if l.protocol == "HTTPS" {
                let tls = l.tls.clone().unwrap_or_default();
                if tls.mode.as_deref().unwrap_or("Terminate") != "Terminate" {
                    refs_problem = Some((
                        "InvalidCertificateRef",
                        "an HTTPS listener terminates TLS".into(),
                    ));
                } else if tls.certificate_refs.is_empty() {
                    refs_problem = Some((
                        "InvalidCertificateRef",
                        "an HTTPS listener needs a certificate".into(),
                    ));
                }
                for r in &tls.certificate_refs {
                    let ns = r.namespace.clone().unwrap_or(gw.meta.namespace.clone());
                    let key = format!("{ns}/{}", r.name);
                    let problem = if !group_is(&r.group, "")
                        || r.kind.as_deref().unwrap_or("Secret") != "Secret"
                    {
                        Some((
                            "InvalidCertificateRef",
                            format!(
                                "{}/{} is not a Secret",
                                r.group.as_deref().unwrap_or(""),
                                r.kind.as_deref().unwrap_or("")
                            ),
                        ))
                    } else if !granted(
                        &world.grants,
                        "Gateway",
                        &gw.meta.namespace,
                        &ns,
                        "Secret",
                        &r.name,
                    ) {
                        Some((
                            "RefNotPermitted",
                            format!("no ReferenceGrant in {ns} lets this Gateway use {key}"),
                        ))
                    } else {
                        match world.secrets.get(&key) {
                            Some(Some(s)) => {
                                certs.push(Certificate {
                                    hostname: l.hostname.clone(),
                                    secret: s.clone(),
                                });
                                None
                            }
                            Some(None) => Some((
                                "InvalidCertificateRef",
                                format!(
                                    "{key} is not a kubernetes.io/tls Secret with a certificate and key"
                                ),
                            )),
                            None => Some((
                                "InvalidCertificateRef",
                                format!("the Secret {key} does not exist"),
                            )),
                        }
                    };
                    if refs_problem.is_none() {
                        refs_problem = problem;
                    }
                }
            }
            if bad_kinds && refs_problem.is_none() {
                refs_problem = Some((
                    "InvalidRouteKinds",
                    "ebb serves HTTPRoutes and GRPCRoutes".into(),
                ));
            }
            let bound = addresses[gi]
                .and_then(|a| u16::try_from(l.port).ok().map(|p| SocketAddr::new(a, p)));
            let accepted = if !protocol_ok {
                cond(
                    "Accepted",
                    false,
                    "UnsupportedProtocol",
                    format!("ebb serves HTTP and HTTPS, not {}", l.protocol),
                    generation,
                )
            } else if bound.is_some_and(|b| world.unbindable.contains(&b)) {
                cond(
                    "Accepted",
                    false,
                    "PortUnavailable",
                    format!("ebb could not listen on port {}", l.port),
                    generation,
                )
            } else {
                cond("Accepted", true, "Accepted", "", generation)
            };
            let resolved = match &refs_problem {
                Some((reason, msg)) => cond("ResolvedRefs", false, reason, msg.clone(), generation),
                None => cond("ResolvedRefs", true, "ResolvedRefs", "", generation),
            };
            conditions.push(accepted);
            conditions.push(resolved);
            if !protocol_ok {
                kinds.clear();
            }
            ls.push(ListenerState {
                spec: l,
                status: ListenerStatus {
                    name: l.name.clone(),
                    supported_kinds: kinds
                        .iter()
                        .map(|k| RouteGroupKind {
                            group: Some(GROUP.into()),
                            kind: (*k).into(),
                        })
                        .collect(),
                    attached_routes: 0,
                    conditions,
                },
                valid: false,
                retried: false,
                kinds,
                certs,
            });
        }
        // Conflicts on one port.
        for i in 0..ls.len() {
            let (port, proto, host) = (
                ls[i].spec.port,
                ls[i].spec.protocol.clone(),
                ls[i].spec.hostname.clone().map(|h| h.to_ascii_lowercase()),
            );
            let mut conflict = None;
            for (j, other) in ls.iter().enumerate() {
                if i == j || other.spec.port != port {
                    continue;
                }
                if other.spec.protocol != proto {
                    conflict = Some("ProtocolConflict");
                    break;
                }
                if other.spec.hostname.as_ref().map(|h| h.to_ascii_lowercase()) == host {
                    conflict = Some("HostnameConflict");
                }
            }
            let c = match conflict {
                Some(reason) => cond(
                    "Conflicted",
                    true,
                    reason,
                    "another listener of this Gateway takes the same port",
                    generation,
                ),
                None => cond("Conflicted", false, "NoConflicts", "", generation),
            };
            let ok = conflict.is_none()
                && ls[i].status.conditions.iter().all(|c| c.status)
                && addresses[gi].is_some();
            let unbound = ls[i]
                .status
                .conditions
                .iter()
                .any(|c| c.reason == "PortUnavailable");
            ls[i].retried = unbound
                && conflict.is_none()
                && ls[i]
                    .status
                    .conditions
                    .iter()
                    .all(|c| c.status || c.reason == "PortUnavailable");
            let programmed = if ok {
                cond("Programmed", true, "Programmed", "", generation)
            } else {
                cond(
                    "Programmed",
                    false,
                    if addresses[gi].is_none() {
                        "Pending"
                    } else {
                        "Invalid"
                    },
                    "the listener is not served",
                    generation,
                )
            };
            ls[i].status.conditions.push(c);
            ls[i].status.conditions.push(programmed);
            ls[i].valid = ok;
        }
        states.push(ls);
    }

    // Routes.
    struct Attached<'a> {
        route: &'a Route,
        gateway: usize,
        listener: usize,
    }
    let mut attached: Vec<Attached<'_>> = Vec::new();
    let gw_index: BTreeMap<String, usize> = gateways
        .iter()
        .enumerate()
        .map(|(i, g)| (g.meta.key(), i))
        .collect();
    // Host names an annotated Service's route serves stay the Service's: a route naming one
    // loses it, and says so; one left with none is not accepted.
    let mut dropped: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut routes: Vec<Route> = world
        .http_routes
        .iter()
        .map(Route::http)
        .chain(world.grpc_routes.iter().map(Route::grpc))
        .map(|mut r| {
            let (taken, kept): (Vec<String>, Vec<String>) = r
                .spec
                .hostnames
                .iter()
                .cloned()
                .partition(|h| world.service_hosts.contains_key(&h.to_ascii_lowercase()));
            if !taken.is_empty() {
                dropped.insert(r.key(), taken);
                r.spec.hostnames = kept;
            }
            r
        })
        .collect();
    // Oldest first: where an HTTPRoute and a GRPCRoute both want a host name on one listener,
    // the older one has it (then the first by namespace and name).
    routes.sort_by(|a, b| {
        (&a.meta.created, a.meta.key(), a.kind).cmp(&(&b.meta.created, b.meta.key(), b.kind))
    });
    // The host names each listener's routes hold, with their kind and route, as they attach.
    type Held = Vec<(&'static str, String, Vec<String>)>;
    let mut held: BTreeMap<(usize, usize), Held> = BTreeMap::new();
    for r in &routes {
        let generation = r.meta.generation;
        let taken = dropped.get(&r.key()).map(|t| {
            let by: Vec<String> = t
                .iter()
                .map(|h| {
                    format!(
                        "{h} (route {})",
                        world.service_hosts[&h.to_ascii_lowercase()]
                    )
                })
                .collect();
            format!("host names served by annotated Services: {}", by.join(", "))
        });
        let all_taken = taken.is_some() && r.spec.hostnames.is_empty();
        let mut parents = Vec::new();
        let resolved = backend_problem(world, r);
        let mut told = Vec::new();
        for p in &r.spec.parent_refs {
            if !group_is(&p.group, GROUP) || p.kind.as_deref().unwrap_or("Gateway") != "Gateway" {
                continue;
            }
            let ns = p.namespace.clone().unwrap_or(r.meta.namespace.clone());
            let Some(&gi) = gw_index.get(&format!("{ns}/{}", p.name)) else {
                continue;
            };
            let gw = gateways[gi];
            let ls = &states[gi];
            let named: Vec<usize> = (0..ls.len())
                .filter(|&i| {
                    p.section_name
                        .as_ref()
                        .is_none_or(|s| *s == ls[i].spec.name)
                        && p.port.is_none_or(|port| port == ls[i].spec.port)
                })
                .collect();
            let allowed: Vec<usize> = named
                .iter()
                .copied()
                .filter(|&i| {
                    ls[i].kinds.contains(&r.kind)
                        && allows(world, gw, ls[i].spec, &r.meta.namespace)
                })
                .collect();
            // The listeners whose hostname meets the route's, with the host names they share.
            let hosts: Vec<(usize, Vec<String>)> = allowed
                .iter()
                .filter_map(|&i| {
                    route_hosts(&r.spec.hostnames, ls[i].spec.hostname.as_deref()).map(|h| (i, h))
                })
                .collect();
            let hosts_none = hosts.is_empty();
            // A listener where a route of the other kind (older) holds one of these host names
            // is not this route's.
            let mut clashes = Vec::new();
            let free: Vec<(usize, Vec<String>)> = hosts
                .into_iter()
                .filter(|(i, mine)| {
                    let clash = held.get(&(gi, *i)).and_then(|h| {
                        h.iter().find(|(kind, _, theirs)| {
                            *kind != r.kind
                                && theirs.iter().any(|t| mine.iter().any(|m| overlap(t, m)))
                        })
                    });
                    if let Some((_, key, _)) = clash {
                        clashes.push(format!(
                            "{key} holds these host names on listener {}",
                            ls[*i].spec.name
                        ));
                    }
                    clash.is_none()
                })
                .collect();
            let notes: Vec<String> = taken.iter().cloned().chain(clashes.clone()).collect();
            let accepted = if all_taken {
                cond(
                    "Accepted",
                    false,
                    "HostnameConflict",
                    taken.clone().unwrap_or_default(),
                    generation,
                )
            } else if named.is_empty() {
                cond(
                    "Accepted",
                    false,
                    "NoMatchingParent",
                    "the Gateway has no listener of that name and port",
                    generation,
                )
            } else if allowed.is_empty() {
                cond(
                    "Accepted",
                    false,
                    "NotAllowedByListeners",
                    format!(
                        "no listener of {} allows {}s from namespace {}",
                        gw.meta.key(),
                        r.kind,
                        r.meta.namespace
                    ),
                    generation,
                )
            } else if hosts_none {
                cond(
                    "Accepted",
                    false,
                    "NoMatchingListenerHostname",
                    "no listener's hostname intersects the route's hostnames",
                    generation,
                )
            } else if free.is_empty() {
                cond(
                    "Accepted",
                    false,
                    "HostnameConflict",
                    clashes.join("; "),
                    generation,
                )
            } else {
                cond("Accepted", true, "Accepted", notes.join("; "), generation)
            };
            let names: Vec<&str> = free
                .iter()
                .map(|(i, _)| ls[*i].spec.name.as_str())
                .collect();
            told.push(if accepted.status {
                format!("{} listeners {}", gw.meta.key(), names.join(", "))
            } else {
                format!(
                    "{}: {} ({})",
                    gw.meta.key(),
                    accepted.reason,
                    accepted.message
                )
            });
            if accepted.status {
                for (i, mine) in free {
                    held.entry((gi, i))
                        .or_default()
                        .push((r.kind, r.key(), mine));
                    attached.push(Attached {
                        route: r,
                        gateway: gi,
                        listener: i,
                    });
                }
            }
            let resolved_c = match &resolved {
                Some((reason, msg)) => cond("ResolvedRefs", false, reason, msg.clone(), generation),
                None => cond("ResolvedRefs", true, "ResolvedRefs", "", generation),
            };
            parents.push(ParentStatus {
                parent_ref: ParentRef {
                    group: Some(GROUP.into()),
                    kind: Some("Gateway".into()),
                    namespace: Some(ns.clone()),
                    ..p.clone()
                },
                conditions: vec![accepted, resolved_c],
            });
        }
        if !parents.is_empty() {
            out.attachments.insert(r.key(), told.join("; "));
            out.routes.push(RouteStatus {
                kind: r.kind,
                meta: r.meta.clone(),
                parents,
            });
        }
    }
    // Counted once per listener per route, however many parent references name it.
    let mut seen = BTreeSet::new();
    for a in &attached {
        if seen.insert((a.gateway, a.listener, a.route.key())) {
            states[a.gateway][a.listener].status.attached_routes += 1;
        }
    }

    // Gateways' statuses.
    for (gi, gw) in gateways.iter().enumerate() {
        let generation = gw.meta.generation;
        let ls = &states[gi];
        // A listener refused outright (its protocol, its port) makes the Gateway's listeners not
        // valid; one whose references do not resolve is only not programmed.
        let accepted_listeners = ls
            .iter()
            .filter(|l| {
                l.status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Accepted" && c.status)
            })
            .count();
        let accepted =
            if !gw.spec.addresses.is_empty() && matches!(addressing, Addressing::Shared { .. }) {
                cond(
                    "Accepted",
                    false,
                    "UnsupportedAddress",
                    "ebb does not take addresses from the Gateway's spec",
                    generation,
                )
            } else if accepted_listeners == ls.len() {
                cond("Accepted", true, "Accepted", "", generation)
            } else if accepted_listeners > 0 {
                cond(
                    "Accepted",
                    true,
                    "ListenersNotValid",
                    "some listeners are not valid",
                    generation,
                )
            } else {
                cond(
                    "Accepted",
                    false,
                    "ListenersNotValid",
                    "no listener is valid",
                    generation,
                )
            };
        let programmed = match addresses[gi] {
            None => cond(
                "Programmed",
                false,
                "AddressNotAssigned",
                "ebb's address pool has no free address",
                generation,
            ),
            Some(_) if accepted.status => cond("Programmed", true, "Programmed", "", generation),
            Some(_) => cond(
                "Programmed",
                false,
                "Invalid",
                "the Gateway is not accepted",
                generation,
            ),
        };
        let shown = match addressing {
            Addressing::Pool(_) => addresses[gi]
                .map(|a| vec![a.to_string()])
                .unwrap_or_default(),
            Addressing::Shared { addresses: a, .. } => a.clone(),
        };
        out.gateways.push(GatewayStatus {
            meta: gw.meta.clone(),
            addresses: shown,
            conditions: vec![accepted, programmed],
            listeners: ls.iter().map(|l| l.status.clone()).collect(),
        });
    }

    // Sockets.
    // Each socket's certificates and listeners (gateway, listener).
    type Listeners = Vec<(usize, usize)>;
    let mut sockets: BTreeMap<SocketAddr, (Option<Vec<Certificate>>, Listeners)> = BTreeMap::new();
    for (gi, ls) in states.iter().enumerate() {
        let Some(addr) = addresses[gi] else { continue };
        for (li, l) in ls.iter().enumerate() {
            if !l.valid && !l.retried {
                continue;
            }
            let Ok(port) = u16::try_from(l.spec.port) else {
                continue;
            };
            let entry = sockets
                .entry(SocketAddr::new(addr, port))
                .or_insert((None, Vec::new()));
            if l.spec.protocol == "HTTPS" {
                entry.0.get_or_insert_with(Vec::new).extend(l.certs.clone());
            }
            entry.1.push((gi, li));
        }
    }
    for (addr, (tls, listeners)) in sockets {
        // Each hostname pattern a listener of this socket names, with the listener.
        let patterns: Vec<(String, (usize, usize))> = listeners
            .iter()
            .map(|&(gi, li)| {
                let h = states[gi][li].spec.hostname.clone();
                (
                    h.map(|h| h.to_ascii_lowercase())
                        .unwrap_or_else(|| "*".into()),
                    (gi, li),
                )
            })
            .collect();
        // The most specific listener whose hostname covers `host`.
        let mut names: Vec<String> = patterns.iter().map(|(p, _)| p.clone()).collect();
        names.sort();
        names.dedup();
        let owner = |host: &str| -> Option<(usize, usize)> {
            let p = listener_for(&names, host)?;
            patterns.iter().find(|(q, _)| q == p).map(|(_, l)| *l)
        };
        let mut entries: BTreeMap<String, Vec<(Key, MetaRoute)>> = BTreeMap::new();
        for (p, _) in &patterns {
            entries.entry(p.clone()).or_default();
        }
        for a in attached
            .iter()
            .filter(|a| listeners.contains(&(a.gateway, a.listener)))
        {
            let l = states[a.gateway][a.listener].spec;
            let Some(hosts) = route_hosts(&a.route.spec.hostnames, l.hostname.as_deref()) else {
                continue;
            };
            for h in hosts {
                if owner(&h).is_some_and(|o| o != (a.gateway, a.listener)) {
                    continue;
                }
                let list = entries.entry(h).or_default();
                for (k, m) in rules(world, a.route) {
                    if !list.iter().any(|(k2, _)| *k2 == k) {
                        list.push((k, m));
                    }
                }
            }
        }
        let mut hosts = BTreeMap::new();
        for (h, mut list) in entries {
            list.sort_by(|a, b| a.0.cmp(&b.0));
            let id =
                ServiceId::parse(&format!("conf://gateway-{}", addr.port())).expect("a fixed id");
            hosts.insert(
                h.clone(),
                MetaService {
                    id,
                    domains: vec![h],
                    routes: list.into_iter().map(|(_, m)| m).collect(),
                },
            );
        }
        let tls = tls.map(|mut c| {
            c.sort_by_key(|c| specificity(c.hostname.as_deref().unwrap_or("*")));
            c
        });
        out.sockets.push(Socket {
            addr,
            tls,
            hosts,
            listeners: names,
        });
    }
    out
}

/// Gateways' addresses, in `gateways`' order (oldest first).
fn assign(gateways: &[&Gateway], addressing: &Addressing) -> Vec<Option<IpAddr>> {
    match addressing {
        Addressing::Shared { bind, .. } => vec![Some(*bind); gateways.len()],
        Addressing::Pool(pool) => {
            let mut taken = BTreeSet::new();
            let mut out = vec![None; gateways.len()];
            for (i, g) in gateways.iter().enumerate() {
                let want = g
                    .spec
                    .addresses
                    .iter()
                    .map(|a| a.value.as_str())
                    .chain(g.status_addresses.iter().map(|s| s.as_str()))
                    .filter_map(|s| s.parse::<IpAddr>().ok())
                    .find(|a| pool.contains(a) && !taken.contains(a));
                if let Some(a) = want {
                    taken.insert(a);
                    out[i] = Some(a);
                }
            }
            for slot in out.iter_mut() {
                if slot.is_some() {
                    continue;
                }
                if let Some(a) = pool.iter().find(|a| !taken.contains(*a)) {
                    taken.insert(*a);
                    *slot = Some(*a);
                }
            }
            out
        }
    }
}

/// Whether listener `l` of `gw` takes routes from namespace `ns`.
fn allows(world: &World, gw: &Gateway, l: &Listener, ns: &str) -> bool {
    let from = l
        .allowed_routes
        .as_ref()
        .and_then(|a| a.namespaces.as_ref());
    match from.and_then(|f| f.from.as_deref()).unwrap_or("Same") {
        "All" => true,
        "Same" => ns == gw.meta.namespace,
        "Selector" => {
            let Some(sel) = from.and_then(|f| f.selector.as_ref()) else {
                return false;
            };
            world
                .namespaces
                .get(ns)
                .is_some_and(|labels| sel.matches(labels))
        }
        _ => false,
    }
}

/// The hostnames a route serves on a listener: the intersections of its hostnames with the
/// listener's (`None`: they have none in common).
fn route_hosts(route: &[String], listener: Option<&str>) -> Option<Vec<String>> {
    if route.is_empty() {
        return intersect(None, listener).map(|h| vec![h]);
    }
    let hosts: Vec<String> = route
        .iter()
        .filter_map(|h| intersect(Some(h), listener))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    (!hosts.is_empty()).then_some(hosts)
}

/// The first problem with a route's backends, as a `ResolvedRefs` reason and message.
fn backend_problem(world: &World, r: &Route) -> Option<(&'static str, String)> {
    r.spec
        .rules
        .iter()
        .flat_map(|rule| &rule.backend_refs)
        .find_map(|b| backend(world, r, b).err())
}

/// A backend's destination, or why it has none.
fn backend(world: &World, r: &Route, b: &HttpBackendRef) -> Result<Source, (&'static str, String)> {
    if !group_is(&b.group, "") || b.kind.as_deref().unwrap_or("Service") != "Service" {
        return Err((
            "InvalidKind",
            format!(
                "a backend is a Service, not {}/{}",
                b.group.as_deref().unwrap_or(""),
                b.kind.as_deref().unwrap_or("")
            ),
        ));
    }
    let ns = b.namespace.clone().unwrap_or(r.meta.namespace.clone());
    let key = format!("{ns}/{}", b.name);
    if !granted(
        &world.grants,
        r.kind,
        &r.meta.namespace,
        &ns,
        "Service",
        &b.name,
    ) {
        return Err((
            "RefNotPermitted",
            format!("no ReferenceGrant in {ns} lets this route use {key}"),
        ));
    }
    let Some(svc) = world.services.get(&key) else {
        return Err((
            "BackendNotFound",
            format!("the Service {key} does not exist"),
        ));
    };
    let Some(port) = b.port else {
        return Err(("BackendNotFound", format!("{key}: give the Service's port")));
    };
    if !svc.ports.contains(&port) {
        return Err((
            "BackendNotFound",
            format!("the Service {key} has no port {port}"),
        ));
    }
    if let Some(route) = &svc.route {
        return Ok(Source::Route(route.clone()));
    }
    ServiceId::parse(&format!("k8s://{}.{ns}:{port}", b.name))
        .map(Source::Service)
        .map_err(|e| ("BackendNotFound", e.to_string()))
}

/// Where a compiled match stands among the others (smaller first).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    /// A GRPCRoute's: the longest service, then the longest method.
    grpc_service: std::cmp::Reverse<usize>,
    grpc_method: std::cmp::Reverse<usize>,
    path_class: u8,
    path_len: std::cmp::Reverse<usize>,
    no_method: bool,
    headers: std::cmp::Reverse<usize>,
    query: std::cmp::Reverse<usize>,
    created: String,
    route: String,
    rule: usize,
    matched: usize,
}

fn changes(m: &HeaderModifier) -> Changes {
    Changes {
        set: m
            .set
            .iter()
            .map(|h| (h.name.to_ascii_lowercase(), h.value.clone()))
            .collect(),
        add: m
            .add
            .iter()
            .map(|h| (h.name.to_ascii_lowercase(), h.value.clone()))
            .collect(),
        remove: m.remove.iter().map(|h| h.to_ascii_lowercase()).collect(),
    }
}

fn value_match(m: &HttpValueMatch) -> Result<ValueMatch, String> {
    match m.type_.as_deref().unwrap_or("Exact") {
        "Exact" => Ok(ValueMatch::Exact(m.value.clone())),
        "RegularExpression" => Regex::whole(&m.value).map(ValueMatch::Regex),
        t => Err(format!("match type {t:?}")),
    }
}

/// A route's rules as meta routes, one per match, with their precedence.
fn rules(world: &World, r: &Route) -> Vec<(Key, MetaRoute)> {
    let mut out = Vec::new();
    for (ri, rule) in r.spec.rules.iter().enumerate() {
        let default = [HttpRouteMatch::default()];
        let matches: &[HttpRouteMatch] = if rule.matches.is_empty() {
            &default
        } else {
            &rule.matches
        };
        // Filters.
        let mut fail: Option<String> = None;
        let mut request_headers = Changes::default();
        let mut response_headers = Changes::default();
        let mut redirect = None;
        let mut rewrite = None;
        for f in &rule.filters {
            match (f.type_.as_str(), f) {
                (
                    "RequestHeaderModifier",
                    HttpRouteFilter {
                        request_header_modifier: Some(m),
                        ..
                    },
                ) => request_headers = changes(m),
                (
                    "ResponseHeaderModifier",
                    HttpRouteFilter {
                        response_header_modifier: Some(m),
                        ..
                    },
                ) => response_headers = changes(m),
                (
                    "RequestRedirect",
                    HttpRouteFilter {
                        request_redirect: Some(m),
                        ..
                    },
                ) => redirect = Some(m.clone()),
                (
                    "URLRewrite",
                    HttpRouteFilter {
                        url_rewrite: Some(m),
                        ..
                    },
                ) => rewrite = Some(m.clone()),
                (t, _) => fail = Some(format!("ebb does not implement the filter {t}")),
            }
        }
        // Backends.
        let mut destinations = Vec::new();
        for b in &rule.backend_refs {
            let mut source = backend(world, r, b).unwrap_or_else(|(_, why)| Source::Invalid(why));
            // A backend's own filters: header changes; another filter makes its share fail.
            let mut request_headers = Changes::default();
            for f in &b.filters {
                match (f.type_.as_str(), &f.request_header_modifier) {
                    ("RequestHeaderModifier", Some(m)) => request_headers = changes(m),
                    (t, _) => {
                        source = Source::Invalid(format!(
                            "ebb does not implement the backend filter {t}"
                        ))
                    }
                }
            }
            let ns = b.namespace.as_deref().unwrap_or(&r.meta.namespace);
            let h2c = b.port.is_some_and(|port| {
                world
                    .services
                    .get(&format!("{ns}/{}", b.name))
                    .is_some_and(|s| s.h2c_ports.contains(&port))
            });
            destinations.push(Destination {
                source,
                weight: u32::try_from(b.weight.unwrap_or(1)).unwrap_or(0),
                policy: Policy::default(),
                request_headers,
                h2c,
            });
        }
        // Timeouts.
        let timeout = |t: Option<&String>| match t.map(|t| duration_ms(t)) {
            None => Ok(0),
            Some(r) => r,
        };
        let timeouts = rule.timeouts.clone().unwrap_or_default();
        let (request_timeout_ms, backend_timeout_ms) = match (
            timeout(timeouts.request.as_ref()),
            timeout(timeouts.backend_request.as_ref()),
        ) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => {
                fail = Some(e);
                (0, 0)
            }
        };
        let total_weight: u64 = destinations.iter().map(|d| d.weight as u64).sum();
        if redirect.is_none() && fail.is_none() && destinations.is_empty() {
            fail = Some("the rule has no backend".into());
        }
        for (mi, m) in matches.iter().enumerate() {
            let mut fail = fail.clone();
            let (path, class, len, prefix) = match &m.path {
                None => (PathMatch::Prefix("/".into()), 2, 0, Some("/".to_owned())),
                Some(p) => {
                    let v = p.value.clone().unwrap_or_else(|| "/".into());
                    match p.type_.as_deref().unwrap_or("PathPrefix") {
                        "Exact" => (PathMatch::Exact(v.clone()), 0, v.len(), None),
                        "RegularExpression" => match Regex::whole(&v) {
                            Ok(re) => (PathMatch::Regex(re), 1, v.len(), None),
                            Err(e) => {
                                fail = Some(e);
                                (PathMatch::Exact(v.clone()), 1, v.len(), None)
                            }
                        },
                        _ => (
                            PathMatch::Prefix(v.clone()),
                            2,
                            v.trim_end_matches('/').len(),
                            Some(v.clone()),
                        ),
                    }
                }
            };
            let mut headers = Vec::new();
            for h in &m.headers {
                let name = h.name.to_ascii_lowercase();
                if headers.iter().any(|(n, _)| *n == name) {
                    continue;
                }
                match value_match(h) {
                    Ok(v) => headers.push((name, v)),
                    Err(e) => fail = Some(e),
                }
            }
            let mut query = Vec::new();
            for q in &m.query_params {
                if query.iter().any(|(n, _)| *n == q.name) {
                    continue;
                }
                match value_match(q) {
                    Ok(v) => query.push((q.name.clone(), v)),
                    Err(e) => fail = Some(e),
                }
            }
            let modifier = |pm: &PathModifier| match pm.type_.as_str() {
                "ReplaceFullPath" => pm.replace_full_path.clone().map(PathRewrite::Full),
                "ReplacePrefixMatch" => match (&prefix, &pm.replace_prefix_match) {
                    (Some(matched), Some(with)) => Some(PathRewrite::Prefix {
                        matched: matched.clone(),
                        with: with.clone(),
                    }),
                    _ => None,
                },
                _ => None,
            };
            let redirect_out = redirect.as_ref().map(|rd| Redirect {
                scheme: rd.scheme.clone(),
                hostname: rd.hostname.clone(),
                port: rd.port.and_then(|p| u16::try_from(p).ok()),
                path: rd.path.as_ref().and_then(modifier),
                status: rd
                    .status_code
                    .and_then(|s| u16::try_from(s).ok())
                    .unwrap_or(302),
            });
            // A GRPCRoute's service and method come first, its paths do not count.
            let (grpc_service, grpc_method, class, len) = match &r.grpc {
                Some(lengths) => {
                    let (s, m) = lengths
                        .get(ri)
                        .and_then(|l| l.get(mi))
                        .copied()
                        .unwrap_or_default();
                    (s, m, 0, 0)
                }
                None => (0, 0, class, len),
            };
            let key = Key {
                grpc_service: std::cmp::Reverse(grpc_service),
                grpc_method: std::cmp::Reverse(grpc_method),
                path_class: class,
                path_len: std::cmp::Reverse(len),
                no_method: m.method.is_none(),
                headers: std::cmp::Reverse(headers.len()),
                query: std::cmp::Reverse(query.len()),
                created: r.meta.created.clone(),
                route: r.key(),
                rule: ri,
                matched: mi,
            };
            out.push((
                key,
                MetaRoute {
                    authority: None,
                    path: Some(path),
                    methods: m.method.iter().map(|m| m.to_ascii_uppercase()).collect(),
                    headers,
                    query,
                    rewrite_path: rewrite
                        .as_ref()
                        .and_then(|u| u.path.as_ref())
                        .and_then(modifier),
                    rewrite_host: rewrite.as_ref().and_then(|u| u.hostname.clone()),
                    redirect: redirect_out,
                    fail,
                    request_headers: request_headers.clone(),
                    response_headers: response_headers.clone(),
                    destinations: destinations.clone(),
                    total_weight,
                    request_timeout_ms,
                    backend_timeout_ms,
                },
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::meta::RequestView;
    use serde_json::json;

    fn meta(ns: &str, name: &str, created: &str) -> Meta {
        Meta {
            namespace: ns.into(),
            name: name.into(),
            generation: 3,
            created: created.into(),
        }
    }

    fn gateway(name: &str, listeners: serde_json::Value) -> Gateway {
        Gateway {
            meta: meta("infra", name, "2026-01-01T00:00:00Z"),
            spec: serde_json::from_value(
                json!({"gatewayClassName": "ebb", "listeners": listeners}),
            )
            .unwrap(),
            status_addresses: Vec::new(),
        }
    }

    fn route(ns: &str, name: &str, created: &str, spec: serde_json::Value) -> HttpRoute {
        HttpRoute {
            meta: meta(ns, name, created),
            spec: serde_json::from_value(spec).unwrap(),
        }
    }

    fn world(gateways: Vec<Gateway>, routes: Vec<HttpRoute>) -> World {
        let mut w = World {
            classes: vec![GatewayClass {
                meta: meta("", "ebb", ""),
                spec: GatewayClassSpec {
                    controller_name: CONTROLLER_NAME.into(),
                },
            }],
            gateways,
            http_routes: routes,
            ..World::default()
        };
        for s in ["v1", "v2", "v3"] {
            w.services.insert(
                format!("infra/{s}"),
                ServiceInfo {
                    ports: vec![8080],
                    h2c_ports: Vec::new(),
                    route: None,
                },
            );
        }
        w
    }

    fn pool() -> Addressing {
        Addressing::Pool(vec![
            "127.0.1.1".parse().unwrap(),
            "127.0.1.2".parse().unwrap(),
        ])
    }

    /// Where a request goes: the backend's Service name, or the answer ebb gives itself.
    fn send(out: &Output, port: u16, host: &str, target: &str, headers: &[(&str, &str)]) -> String {
        let Some(socket) = out.sockets.iter().find(|s| s.addr.port() == port) else {
            return "no socket".into();
        };
        let service =
            crate::ids::match_host(host, |d| socket.hosts.get(d)).or_else(|| socket.hosts.get("*"));
        let Some(service) = service else {
            return "404".into();
        };
        let header = |n: &str| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(n))
                .map(|(_, v)| v.as_bytes())
        };
        let Some((i, sent)) = service.route(&RequestView {
            authority: host,
            method: "GET",
            target,
            header: &header,
        }) else {
            return "404".into();
        };
        let r = &service.routes[i];
        if r.fail.is_some() {
            return "500".into();
        }
        if let Some(l) = r.location("http", host, port, target) {
            return format!("{} {l}", r.redirect.as_ref().unwrap().status);
        }
        match &r.destinations[0].source {
            Source::Service(id) => format!("{} {sent}", id.host().unwrap_or_default()),
            Source::Invalid(_) => "500".into(),
            other => format!("{other:?}"),
        }
    }

    fn condition<'a>(cs: &'a [Condition], t: &str) -> (bool, &'a str) {
        let c = cs
            .iter()
            .find(|c| c.type_ == t)
            .unwrap_or_else(|| panic!("{t}: {cs:?}"));
        (c.status, c.reason)
    }

    fn http(name: &str, hostname: Option<&str>) -> serde_json::Value {
        json!({"name": name, "port": 80, "protocol": "HTTP", "hostname": hostname, "allowedRoutes": {"namespaces": {"from": "All"}}})
    }

    fn backend(svc: &str) -> serde_json::Value {
        json!([{"name": svc, "port": 8080}])
    }

    #[test]
    fn paths_take_the_gateway_apis_precedence() {
        let rule = |t: &str, v: &str, svc: &str| json!({"matches": [{"path": {"type": t, "value": v}}], "backendRefs": backend(svc)});
        let r = route(
            "infra",
            "order",
            "2026-01-01T00:00:01Z",
            json!({"parentRefs": [{"name": "g"}], "rules": [
                rule("Exact", "/match", "v1"), rule("Exact", "/match/exact", "v2"),
                rule("Exact", "/match/exact/one", "v3"), rule("PathPrefix", "/match/", "v3"),
                rule("PathPrefix", "/match/prefix/", "v1"), rule("PathPrefix", "/match/prefix/one", "v2"),
            ]}),
        );
        let out = compile(
            &world(vec![gateway("g", json!([http("http", None)]))], vec![r]),
            &pool(),
        );
        for (path, want) in [
            ("/match/exact/one", "v3.infra"),
            ("/match/exact", "v2.infra"),
            ("/match", "v1.infra"),
            ("/match/prefix/one/any", "v2.infra"),
            ("/match/prefix/any", "v1.infra"),
            ("/match/any", "v3.infra"),
            ("/matchless", "404"),
        ] {
            let got = send(&out, 80, "x", path, &[]);
            assert!(got.starts_with(want), "{path}: {got}");
        }
    }

    #[test]
    fn headers_count_and_hostnames_intersect() {
        let r = route(
            "infra",
            "h",
            "2026-01-01T00:00:01Z",
            json!({"parentRefs": [{"name": "g"}], "hostnames": ["*.example.com", "other.org"], "rules": [
                {"matches": [{"headers": [{"name": "version", "value": "two"}]}], "backendRefs": backend("v2")},
                {"matches": [{"headers": [{"name": "version", "value": "two"}, {"name": "color", "value": "orange"}]}], "backendRefs": backend("v1")},
                {"matches": [{"path": {"value": "/"}}], "backendRefs": backend("v3")},
            ]}),
        );
        let g = gateway(
            "g",
            json!([
                http("specific", Some("a.example.com")),
                http("wild", Some("*.example.com"))
            ]),
        );
        let out = compile(&world(vec![g], vec![r]), &pool());
        assert!(send(&out, 80, "a.example.com", "/", &[("Version", "two")]).starts_with("v2."));
        assert!(
            send(
                &out,
                80,
                "b.c.example.com",
                "/",
                &[("Version", "two"), ("color", "orange")]
            )
            .starts_with("v1.")
        );
        assert!(send(&out, 80, "b.example.com", "/x", &[]).starts_with("v3."));
        assert_eq!(send(&out, 80, "other.org", "/", &[]), "404");
        assert_eq!(send(&out, 80, "example.com", "/", &[]), "404");
        let listeners = &out.gateways[0].listeners;
        assert_eq!(
            listeners
                .iter()
                .map(|l| l.attached_routes)
                .collect::<Vec<_>>(),
            [1, 1]
        );
        assert_eq!(out.gateways[0].addresses, ["127.0.1.1"]);
        // Which listener a name belongs to (for TLS, a Host another listener's than the SNI's
        // is misdirected).
        let ls = &out.sockets[0].listeners;
        assert_eq!(ls, &["*.example.com", "a.example.com"]);
        assert_eq!(listener_for(ls, "a.example.com"), Some("a.example.com"));
        assert_eq!(listener_for(ls, "b.example.com"), Some("*.example.com"));
        assert_eq!(listener_for(ls, "other.org"), None);
    }

    #[test]
    fn redirects_rewrites_and_missing_backends() {
        let r = route(
            "infra",
            "f",
            "2026-01-01T00:00:01Z",
            json!({"parentRefs": [{"name": "g"}], "rules": [
                {"matches": [{"path": {"value": "/old"}}], "filters": [{"type": "RequestRedirect", "requestRedirect": {"hostname": "example.org", "statusCode": 301, "path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/new"}}}]},
                {"matches": [{"path": {"value": "/api"}}], "filters": [{"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/"}}}], "backendRefs": backend("v1")},
                {"matches": [{"path": {"type": "Exact", "value": "/none"}}]},
                {"backendRefs": backend("missing")},
            ]}),
        );
        let out = compile(
            &world(vec![gateway("g", json!([http("http", None)]))], vec![r]),
            &pool(),
        );
        assert_eq!(
            send(&out, 80, "x", "/old/a?q=1", &[]),
            "301 http://example.org/new/a?q=1"
        );
        assert_eq!(send(&out, 80, "x", "/api/v/1", &[]), "v1.infra /v/1");
        assert_eq!(send(&out, 80, "x", "/api", &[]), "v1.infra /");
        assert_eq!(send(&out, 80, "x", "/none", &[]), "500");
        assert_eq!(send(&out, 80, "x", "/other", &[]), "500");
        let parent = &out.routes[0].parents[0];
        assert_eq!(
            condition(&parent.conditions, "Accepted"),
            (true, "Accepted")
        );
        assert_eq!(
            condition(&parent.conditions, "ResolvedRefs"),
            (false, "BackendNotFound")
        );
        assert!(parent.conditions.iter().all(|c| c.observed_generation == 3));
    }

    #[test]
    fn listeners_and_parents_say_why_they_are_not_valid() {
        let g = gateway(
            "g",
            json!([
                http("http", None),
                {"name": "odd", "port": 1111, "protocol": "INVALID"},
                {"name": "tls", "port": 443, "protocol": "HTTPS", "tls": {"certificateRefs": [{"name": "cert", "namespace": "other"}]}},
                {"name": "kinds", "port": 81, "protocol": "HTTP", "allowedRoutes": {"kinds": [{"kind": "TCPRoute"}]}},
            ]),
        );
        let routes = vec![
            route(
                "web",
                "far",
                "1",
                json!({"parentRefs": [{"name": "g", "namespace": "infra", "sectionName": "tls"}]}),
            ),
            route(
                "infra",
                "nope",
                "2",
                json!({"parentRefs": [{"name": "g", "sectionName": "http1", "port": 80}]}),
            ),
            route(
                "infra",
                "host",
                "3",
                json!({"parentRefs": [{"name": "g", "sectionName": "tls"}], "hostnames": ["x.org"], "rules": [{"backendRefs": [{"name": "v1", "port": 8080, "kind": "Pod"}]}]}),
            ),
        ];
        let mut w = world(vec![g], routes);
        w.secrets.insert(
            "other/cert".into(),
            Some(TlsSecret {
                cert_pem: Vec::new(),
                key_pem: Vec::new(),
            }),
        );
        let out = compile(&w, &pool());
        let gs = &out.gateways[0];
        assert_eq!(
            condition(&gs.conditions, "Accepted"),
            (true, "ListenersNotValid")
        );
        assert_eq!(
            condition(&gs.conditions, "Programmed"),
            (true, "Programmed")
        );
        let l = |n: &str| gs.listeners.iter().find(|l| l.name == n).unwrap();
        assert_eq!(
            condition(&l("http").conditions, "Programmed"),
            (true, "Programmed")
        );
        assert_eq!(
            condition(&l("odd").conditions, "Accepted"),
            (false, "UnsupportedProtocol")
        );
        assert!(l("odd").supported_kinds.is_empty());
        assert_eq!(
            condition(&l("tls").conditions, "ResolvedRefs"),
            (false, "RefNotPermitted")
        );
        assert_eq!(
            condition(&l("tls").conditions, "Accepted"),
            (true, "Accepted")
        );
        assert_eq!(
            condition(&l("tls").conditions, "Programmed"),
            (false, "Invalid")
        );
        assert_eq!(
            condition(&l("kinds").conditions, "ResolvedRefs"),
            (false, "InvalidRouteKinds")
        );
        assert!(l("kinds").supported_kinds.is_empty());
        let parent = |name: &str| {
            let r = out.routes.iter().find(|r| r.meta.name == name).unwrap();
            assert_eq!(r.parents.len(), 1);
            r.parents[0].conditions.clone()
        };
        assert_eq!(
            condition(&parent("far"), "Accepted"),
            (false, "NotAllowedByListeners")
        );
        assert_eq!(
            condition(&parent("far"), "ResolvedRefs"),
            (true, "ResolvedRefs")
        );
        assert_eq!(
            condition(&parent("nope"), "Accepted"),
            (false, "NoMatchingParent")
        );
        assert_eq!(condition(&parent("host"), "Accepted"), (true, "Accepted"));
        assert_eq!(
            condition(&parent("host"), "ResolvedRefs"),
            (false, "InvalidKind")
        );
        // A route attaches to a listener whose certificate does not resolve, and counts there.
        assert_eq!(l("tls").attached_routes, 1);
        // Only the plain listener is served.
        assert_eq!(out.sockets.len(), 1);
        assert_eq!(out.sockets[0].addr.port(), 80);
    }

    #[test]
    fn a_host_an_annotated_service_serves_stays_the_services() {
        let routes = vec![
            route(
                "infra",
                "both",
                "1",
                json!({"parentRefs": [{"name": "g"}], "hostnames": ["shop.test", "new.test"], "rules": [{"backendRefs": backend("v1")}]}),
            ),
            route(
                "infra",
                "only",
                "2",
                json!({"parentRefs": [{"name": "g"}], "hostnames": ["Shop.test"], "rules": [{"backendRefs": backend("v2")}]}),
            ),
        ];
        let mut w = world(vec![gateway("g", json!([http("http", None)]))], routes);
        w.service_hosts
            .insert("shop.test".into(), "infra/shop".into());
        let out = compile(&w, &pool());
        let parent = |name: &str| {
            out.routes
                .iter()
                .find(|r| r.meta.name == name)
                .unwrap()
                .parents[0]
                .conditions
                .clone()
        };
        let both = parent("both");
        assert_eq!(condition(&both, "Accepted"), (true, "Accepted"));
        assert!(
            both[0].message.contains("shop.test (route infra/shop)"),
            "{both:?}"
        );
        assert_eq!(
            condition(&parent("only"), "Accepted"),
            (false, "HostnameConflict")
        );
        assert!(send(&out, 80, "new.test", "/", &[]).starts_with("v1."));
        assert_eq!(send(&out, 80, "shop.test", "/", &[]), "404");
        assert_eq!(out.gateways[0].listeners[0].attached_routes, 1);
    }

    #[test]
    fn grpc_routes_match_services_and_methods_and_an_older_http_route_keeps_its_host() {
        let grpc = |name: &str, created: &str, spec: serde_json::Value| GrpcRoute {
            meta: meta("infra", name, created),
            spec: serde_json::from_value(spec).unwrap(),
        };
        let method = |s: Option<&str>, m: Option<&str>, svc: &str| json!({"matches": [{"method": {"service": s, "method": m}}], "backendRefs": backend(svc)});
        let rpc = grpc(
            "rpc",
            "2",
            json!({"parentRefs": [{"name": "g"}], "hostnames": ["grpc.test"], "rules": [
                method(None, Some("Echo"), "v3"),
                method(Some("pkg.Svc"), None, "v2"),
                method(Some("pkg.Svc"), Some("Echo"), "v1"),
                {"matches": [{"method": {"type": "RegularExpression", "service": "pkg[.]Other.*", "method": "E.*"}}], "backendRefs": backend("v2")},
                {"matches": [{"headers": [{"name": "version", "value": "two"}]}], "backendRefs": backend("v1")},
            ]}),
        );
        let late = grpc(
            "late",
            "3",
            json!({"parentRefs": [{"name": "g"}], "hostnames": ["both.test"], "rules": [{"backendRefs": backend("v1")}]}),
        );
        let web = route(
            "infra",
            "web",
            "1",
            json!({"parentRefs": [{"name": "g"}], "hostnames": ["both.test"], "rules": [{"backendRefs": backend("v3")}]}),
        );
        let mut w = world(vec![gateway("g", json!([http("http", None)]))], vec![web]);
        w.grpc_routes = vec![late, rpc];
        let out = compile(&w, &pool());
        for (path, headers, want) in [
            ("/pkg.Svc/Echo", &[][..], "v1.infra /pkg.Svc/Echo"),
            ("/pkg.Svc/Other", &[], "v2.infra"),
            ("/x.Y/Echo", &[], "v3.infra"),
            ("/pkg.Other2/Eat", &[], "v2.infra"),
            ("/pkgXSvc/Other", &[("version", "two")][..], "v1.infra"),
            ("/pkgXSvc/Other", &[], "404"),
        ] {
            let got = send(&out, 80, "grpc.test", path, headers);
            assert!(got.starts_with(want), "{path}: {got}");
        }
        // The older HTTPRoute keeps both.test: the GRPCRoute that wants it is refused there.
        assert!(send(&out, 80, "both.test", "/pkg.Svc/Echo", &[]).starts_with("v3."));
        let status = |kind: &str, name: &str| {
            let r = out
                .routes
                .iter()
                .find(|r| r.kind == kind && r.meta.name == name)
                .unwrap();
            r.parents[0].conditions.clone()
        };
        let refused = status("GRPCRoute", "late");
        assert_eq!(condition(&refused, "Accepted"), (false, "HostnameConflict"));
        assert!(
            refused[0].message.contains("HTTPRoute/infra/web"),
            "{refused:?}"
        );
        assert_eq!(
            condition(&status("GRPCRoute", "rpc"), "Accepted"),
            (true, "Accepted")
        );
        let listener = &out.gateways[0].listeners[0];
        assert_eq!(listener.attached_routes, 2);
        assert_eq!(
            listener
                .supported_kinds
                .iter()
                .map(|k| k.kind.as_str())
                .collect::<Vec<_>>(),
            ["HTTPRoute", "GRPCRoute"]
        );
        assert!(out.attachments.contains_key("GRPCRoute/infra/rpc"));
    }

    #[test]
    fn timeouts_backend_filters_and_h2c_ports_reach_the_rules() {
        assert_eq!(duration_ms("1m30s"), Ok(90_000));
        assert_eq!(duration_ms("500ms"), Ok(500));
        assert_eq!(duration_ms("1h1m1s1ms"), Ok(3_661_001));
        assert_eq!(duration_ms("0s"), Ok(0));
        for bad in ["", "5", "5x", "123456s", "1s1s1s1s1s", "-1s"] {
            assert!(duration_ms(bad).is_err(), "{bad:?}");
        }
        let r = route(
            "infra",
            "t",
            "1",
            json!({"parentRefs": [{"name": "g"}], "rules": [
                {"matches": [{"path": {"value": "/a"}}], "timeouts": {"request": "1m30s", "backendRequest": "500ms"}, "backendRefs": [
                    {"name": "v1", "port": 8080, "filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {"set": [{"name": "Backend", "value": "v1"}]}}]},
                    {"name": "rpc", "port": 8081},
                    {"name": "v2", "port": 8080, "filters": [{"type": "RequestMirror", "requestMirror": {}}]},
                ]},
                {"matches": [{"path": {"value": "/b"}}], "timeouts": {"request": "soon"}, "backendRefs": backend("v1")},
            ]}),
        );
        let mut w = world(vec![gateway("g", json!([http("http", None)]))], vec![r]);
        w.services.insert(
            "infra/rpc".into(),
            ServiceInfo {
                ports: vec![8080, 8081],
                h2c_ports: vec![8081],
                route: None,
            },
        );
        let out = compile(&w, &pool());
        let routes = &out.sockets[0].hosts["*"].routes;
        let a = &routes[0];
        assert_eq!((a.request_timeout_ms, a.backend_timeout_ms), (90_000, 500));
        assert_eq!(
            a.destinations[0].request_headers.set,
            [("backend".to_owned(), "v1".to_owned())]
        );
        assert!(!a.destinations[0].h2c && a.destinations[1].h2c);
        assert!(
            matches!(&a.destinations[2].source, Source::Invalid(why) if why.contains("RequestMirror")),
            "{:?}",
            a.destinations[2]
        );
        assert!(
            routes[1]
                .fail
                .as_deref()
                .is_some_and(|f| f.contains("soon"))
        );
    }

    #[test]
    fn each_gateway_keeps_its_address_and_a_spent_pool_is_said() {
        let mut a = gateway("a", json!([http("http", None)]));
        let mut b = gateway("b", json!([http("http", None)]));
        let c = gateway("c", json!([http("http", None)]));
        b.meta.created = "2025-01-01T00:00:00Z".into();
        b.status_addresses = vec!["127.0.1.2".into()];
        a.status_addresses = vec!["127.0.1.2".into()];
        let out = compile(&world(vec![a, b, c], vec![]), &pool());
        let addr = |n: &str| {
            let g = out.gateways.iter().find(|g| g.meta.name == n).unwrap();
            (g.addresses.clone(), condition(&g.conditions, "Programmed"))
        };
        // b is older and holds .2; a wanted it too and takes the first free one.
        assert_eq!(addr("b"), (vec!["127.0.1.2".into()], (true, "Programmed")));
        assert_eq!(addr("a"), (vec!["127.0.1.1".into()], (true, "Programmed")));
        assert_eq!(addr("c"), (vec![], (false, "AddressNotAssigned")));
        assert_eq!(out.sockets.len(), 2);
    }
}
