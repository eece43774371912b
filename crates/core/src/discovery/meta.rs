//! Meta services (`conf://name`): Inverno's HTTP meta descriptor in ebb's configuration. A meta
//! service is an ordered list of routes; the first route whose matchers all hold takes the
//! request, changes it (path rewriting with captures, request header changes), splits it among
//! weighted destinations, and changes the response's headers.
//!
//! ```toml
//! [[service]]
//! name = "shop"                       # conf://shop
//! domains = ["shop.localhost"]        # the Hosts ebb's proxy serves it on
//! policy = { balancer = "peak_ewma" } # instances are picked by this unless a route or destination says
//!
//! [[service.route]]
//! path = "/api/{rest:**}"             # exact, `/prefix/**`, or captures: {name} a segment, {name:**} the rest
//! methods = ["GET", "POST"]
//! headers = { "x-canary" = "yes" }    # exact values ("*": present)
//! query = { "v" = "2" }
//! authority = "shop.localhost"        # exact or `*.suffix`
//! rewrite_path = "/v2/{rest}"
//! request_headers = { set = { "x-from" = "ebb" }, add = {}, remove = ["x-debug"] }
//! response_headers = { set = { "cache-control" = "no-store" } }
//! destinations = [
//!   { addresses = ["127.0.0.1:9001", "127.0.0.1:9002"], weight = 9 },
//!   { service = "ebb://shop-v2", weight = 1, policy = { balancer = "least_request" } },
//! ]
//! ```
//!
//! A destination is a set of fixed `addresses` or a `service` id resolved by discovery. The
//! route splits requests among its destinations by weight (a destination of weight 0 gets none);
//! within a destination, the destination's policy picks an instance, or else the route's, or else
//! the service's. Everything is checked when the configuration is loaded ([`MetaService::build`]):
//! unknown fields, malformed ids and unknown schemes, empty or all-zero-weight destination lists,
//! patterns and templates naming captures that are not there.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::Deserialize;

use super::id::ServiceId;
use super::policy::Policy;

/// Schemes a destination's `service` may have: `ebb://app` (the ready replicas of one of ebb's
/// workloads, woken by its requests) and `http://HOST:port` / `ws://HOST:port` (an IP address: one fixed instance; a
/// name: an instance per address DNS gives, refreshed on the records' TTL).
/// `k8s://SERVICE.NAMESPACE[:PORT]` (the Service's EndpointSlices; on Kubernetes) and
/// `k8s-env://NAME[:PORT]` (its environment variables) too.
pub const DESTINATION_SCHEMES: [&str; 5] = ["ebb", "http", "ws", "k8s", "k8s-env"];

/// A meta service as written in `ebb.toml`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    /// `conf://NAME`.
    pub name: String,
    /// Hosts ebb's proxy serves the service on (exact or `*.suffix`).
    #[serde(default)]
    pub domains: Vec<String>,
    /// The default policy of its routes.
    #[serde(default)]
    pub policy: Option<Policy>,
    /// Its routes, first match wins.
    #[serde(default, rename = "route")]
    pub routes: Vec<RouteConfig>,
}

/// Header changes.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HeaderChanges {
    /// Replaced (or added when absent).
    #[serde(default)]
    pub set: BTreeMap<String, String>,
    /// Added beside any already there.
    #[serde(default)]
    pub add: BTreeMap<String, String>,
    /// Removed.
    #[serde(default)]
    pub remove: Vec<String>,
}

/// One route of a meta service, as written.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The Host it matches (exact or `*.suffix`).
    #[serde(default)]
    pub authority: Option<String>,
    /// The path pattern it matches.
    #[serde(default)]
    pub path: Option<String>,
    /// Methods it matches (any when empty).
    #[serde(default)]
    pub methods: Vec<String>,
    /// Headers it requires (exact values; `*`: present).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Query parameters it requires (exact values; `*`: present).
    #[serde(default)]
    pub query: BTreeMap<String, String>,
    /// The path sent on, from the pattern's captures.
    #[serde(default)]
    pub rewrite_path: Option<String>,
    /// Changes to the request's headers.
    #[serde(default)]
    pub request_headers: HeaderChanges,
    /// Changes to the response's headers.
    #[serde(default)]
    pub response_headers: HeaderChanges,
    /// The policy of its destinations (unless one says).
    #[serde(default)]
    pub policy: Option<Policy>,
    /// Where its requests go.
    #[serde(default)]
    pub destinations: Vec<DestinationConfig>,
}

/// One destination, as written.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DestinationConfig {
    /// Fixed instances (`IP:port`).
    #[serde(default)]
    pub addresses: Vec<String>,
    /// A service resolved by discovery.
    #[serde(default)]
    pub service: Option<String>,
    /// Its share of the route's requests.
    #[serde(default = "one")]
    pub weight: u32,
    /// How its instances are picked.
    #[serde(default)]
    pub policy: Option<Policy>,
}

fn one() -> u32 {
    1
}

/// One segment of a path pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    /// `{name}` (or `*`: unnamed): one segment.
    One(Option<String>),
    /// `{name:**}` (or `**`): the rest of the path, perhaps nothing.
    Rest(Option<String>),
}

/// A path pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    segments: Vec<Segment>,
}

impl PathPattern {
    /// Parses `/a/{id}/b/{rest:**}`.
    pub fn parse(text: &str) -> Result<PathPattern, String> {
        if !text.starts_with('/') {
            return Err(format!("path {text:?} does not start with /"));
        }
        let parts: Vec<&str> = text[1..].split('/').collect();
        let mut segments = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            let last = i + 1 == parts.len();
            let seg = match *p {
                "**" => Segment::Rest(None),
                "*" => Segment::One(None),
                p if p.starts_with('{') && p.ends_with('}') => {
                    let inner = &p[1..p.len() - 1];
                    let (name, rest) = match inner.split_once(':') {
                        Some((n, "**")) => (n, true),
                        Some(_) => {
                            return Err(format!(
                                "path {text:?}: {p:?}: a capture is {{name}} or {{name:**}}"
                            ));
                        }
                        None => (inner, false),
                    };
                    if name.is_empty()
                        || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                    {
                        return Err(format!("path {text:?}: {p:?} is not a capture name"));
                    }
                    if rest {
                        Segment::Rest(Some(name.to_owned()))
                    } else {
                        Segment::One(Some(name.to_owned()))
                    }
                }
                p if p.contains(['{', '}', '*']) => {
                    return Err(format!(
                        "path {text:?}: {p:?}: a segment is a literal, *, **, {{name}} or {{name:**}}"
                    ));
                }
                p => Segment::Literal(p.to_owned()),
            };
            if matches!(seg, Segment::Rest(_)) && !last {
                return Err(format!("path {text:?}: ** only at the end"));
            }
            segments.push(seg);
        }
        Ok(PathPattern { segments })
    }

    /// The names it captures.
    pub fn names(&self) -> Vec<&str> {
        self.segments
            .iter()
            .filter_map(|s| match s {
                Segment::One(Some(n)) | Segment::Rest(Some(n)) => Some(n.as_str()),
                _ => None,
            })
            .collect()
    }

    /// Its captures if `path` (without query) matches.
    pub fn matches(&self, path: &str) -> Option<Vec<(String, String)>> {
        let rest = path.strip_prefix('/')?;
        let mut caps = Vec::new();
        let mut left = rest;
        for (i, seg) in self.segments.iter().enumerate() {
            match seg {
                Segment::Rest(name) => {
                    if let Some(n) = name {
                        caps.push((n.clone(), left.to_owned()));
                    }
                    return Some(caps);
                }
                _ => {
                    let (part, after) = match left.split_once('/') {
                        Some((a, b)) => (a, Some(b)),
                        None => (left, None),
                    };
                    match seg {
                        Segment::Literal(l) if l == part => {}
                        Segment::One(name) if !part.is_empty() => {
                            if let Some(n) = name {
                                caps.push((n.clone(), part.to_owned()));
                            }
                        }
                        _ => return None,
                    }
                    let more = i + 1 < self.segments.len();
                    match (after, more) {
                        (Some(a), true) => left = a,
                        (None, false) => return Some(caps),
                        // `/a/**` matches `/a` too.
                        (None, true)
                            if i + 2 == self.segments.len()
                                && matches!(self.segments[i + 1], Segment::Rest(_)) =>
                        {
                            if let Segment::Rest(Some(n)) = &self.segments[i + 1] {
                                caps.push((n.clone(), String::new()));
                            }
                            return Some(caps);
                        }
                        _ => return None,
                    }
                }
            }
        }
        None
    }
}

/// Fills `{name}` in a template from captures (checked at load: every name is captured).
fn fill(template: &str, caps: &[(String, String)]) -> String {
    let mut out = String::with_capacity(template.len() + 16);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        let name = &rest[open + 1..open + close];
        if let Some((_, v)) = caps.iter().find(|(n, _)| n == name) {
            out.push_str(v);
        }
        rest = &rest[open + close + 1..];
    }
    out.push_str(rest);
    out
}

fn template_names(template: &str) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            return Err(format!("rewrite_path {template:?}: an unclosed {{"));
        };
        names.push(rest[open + 1..open + close].to_owned());
        rest = &rest[open + close + 1..];
    }
    if rest.contains('}') {
        return Err(format!("rewrite_path {template:?}: a }} without {{"));
    }
    Ok(names)
}

/// Where a destination's instances come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Fixed addresses.
    Addresses(Vec<SocketAddr>),
    /// A service resolved by discovery.
    Service(ServiceId),
    /// One of ebb's routes by name (a Gateway API backend that ebb scales: an annotated
    /// Service's route `NAMESPACE/SERVICE`), as `ebb://` names an app.
    Route(String),
    /// None: a Gateway API backend that does not resolve; its share of requests gets 500.
    Invalid(String),
}

/// A checked destination.
#[derive(Debug, Clone, PartialEq)]
pub struct Destination {
    /// Where its instances come from.
    pub source: Source,
    /// Its share.
    pub weight: u32,
    /// The policy its instances are picked by.
    pub policy: Policy,
    /// Changes to the request's headers when it goes here (a Gateway API backend's filter),
    /// after the route's.
    pub request_headers: Changes,
    /// Its instances speak HTTP/2 without TLS (h2c, a Service port's `appProtocol`): every
    /// request goes on over HTTP/2.
    pub h2c: bool,
}

impl Destination {
    /// Its instances when they are fixed: its addresses, or the one of an `http://IP:port` id.
    pub fn fixed(&self) -> Option<Vec<SocketAddr>> {
        match &self.source {
            Source::Addresses(a) => Some(a.clone()),
            Source::Service(id) => super::id::literal(id).map(|a| vec![a]),
            Source::Invalid(_) => Some(Vec::new()),
            Source::Route(_) => None,
        }
    }

    /// The app of an `ebb://app` destination (one of ebb's own workloads).
    pub fn app(&self) -> Option<&str> {
        match &self.source {
            Source::Service(id) if id.scheme() == "ebb" => Some(id.authority()),
            Source::Route(r) => Some(r),
            _ => None,
        }
    }

    /// The id discovery resolves for it (a DNS name, `k8s://`, `k8s-env://`): not fixed
    /// addresses, not an IP address, not one of ebb's own workloads.
    pub fn discovered(&self) -> Option<&ServiceId> {
        match &self.source {
            Source::Service(id) if id.scheme() != "ebb" && super::id::literal(id).is_none() => {
                Some(id)
            }
            _ => None,
        }
    }
}

impl MetaService {
    /// The ids discovery resolves for its destinations.
    pub fn discovered(&self) -> impl Iterator<Item = &ServiceId> {
        self.routes
            .iter()
            .flat_map(|r| &r.destinations)
            .filter_map(Destination::discovered)
    }
}

/// A checked header change list, names in lower case.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Changes {
    /// Replaced.
    pub set: Vec<(String, String)>,
    /// Added.
    pub add: Vec<(String, String)>,
    /// Removed.
    pub remove: Vec<String>,
}

/// A regular expression, compared by its text.
#[derive(Debug, Clone)]
pub struct Regex(pub regex::Regex);

impl PartialEq for Regex {
    fn eq(&self, other: &Regex) -> bool {
        self.0.as_str() == other.0.as_str()
    }
}

impl Regex {
    /// Compiles `text`, anchored at both ends (the Gateway API matches whole values), within a
    /// bounded program size.
    pub fn whole(text: &str) -> Result<Regex, String> {
        regex::RegexBuilder::new(&format!("^(?:{text})$"))
            .size_limit(1 << 20)
            .build()
            .map(Regex)
            .map_err(|e| format!("{text:?} is not a regular expression: {e}"))
    }
}

/// How a route matches the request's path.
#[derive(Debug, Clone, PartialEq)]
pub enum PathMatch {
    /// ebb's own patterns, with captures.
    Pattern(PathPattern),
    /// Exactly this path.
    Exact(String),
    /// This path or below it, segment by segment (`/a` takes `/a`, `/a/` and `/a/b`, not `/ab`).
    Prefix(String),
    /// The whole path matches this expression.
    Regex(Regex),
}

impl PathMatch {
    fn matches(&self, path: &str) -> Option<Vec<(String, String)>> {
        match self {
            PathMatch::Pattern(p) => p.matches(path),
            PathMatch::Exact(e) => (path == e).then(Vec::new),
            PathMatch::Prefix(p) => prefix_matches(p, path).then(Vec::new),
            PathMatch::Regex(r) => r.0.is_match(path).then(Vec::new),
        }
    }
}

/// Whether `path` is `prefix` or below it, element by element (a trailing `/` of the prefix
/// ignored).
pub fn prefix_matches(prefix: &str, path: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

/// How a header or query parameter's value must be.
#[derive(Debug, Clone, PartialEq)]
pub enum ValueMatch {
    /// Present, whatever its value.
    Any,
    Exact(String),
    Regex(Regex),
}

impl ValueMatch {
    fn holds(&self, got: &[u8]) -> bool {
        match self {
            ValueMatch::Any => true,
            ValueMatch::Exact(v) => got == v.as_bytes(),
            ValueMatch::Regex(r) => std::str::from_utf8(got).is_ok_and(|g| r.0.is_match(g)),
        }
    }

    /// `*` is presence, anything else an exact value (`ebb.toml`'s spelling).
    fn from_config(v: &str) -> ValueMatch {
        if v == "*" {
            ValueMatch::Any
        } else {
            ValueMatch::Exact(v.to_owned())
        }
    }
}

/// How the path sent on (or redirected to) is made.
#[derive(Debug, Clone, PartialEq)]
pub enum PathRewrite {
    /// From the path pattern's captures (`ebb.toml`).
    Template(String),
    /// This path, whatever the request's.
    Full(String),
    /// The matched prefix `matched` replaced by `with`.
    Prefix { matched: String, with: String },
}

impl PathRewrite {
    fn apply(&self, path: &str, caps: &[(String, String)]) -> String {
        match self {
            PathRewrite::Template(t) => fill(t, caps),
            PathRewrite::Full(p) => p.clone(),
            PathRewrite::Prefix { matched, with } => {
                let matched = matched.trim_end_matches('/');
                let rest = path.strip_prefix(matched).unwrap_or(path);
                let with = with.trim_end_matches('/');
                match (with.is_empty(), rest.is_empty()) {
                    (true, true) => "/".to_owned(),
                    (true, false) => rest.to_owned(),
                    (false, _) => format!("{with}{rest}"),
                }
            }
        }
    }
}

/// A redirect answered instead of forwarding (the Gateway API's `RequestRedirect`).
#[derive(Debug, Clone, PartialEq)]
pub struct Redirect {
    pub scheme: Option<String>,
    pub hostname: Option<String>,
    pub port: Option<u16>,
    pub path: Option<PathRewrite>,
    /// 301, 302, 303, 307 or 308.
    pub status: u16,
}

/// A checked route.
#[derive(Debug, Clone, PartialEq)]
pub struct MetaRoute {
    pub(crate) authority: Option<String>,
    pub(crate) path: Option<PathMatch>,
    pub(crate) methods: Vec<String>,
    pub(crate) headers: Vec<(String, ValueMatch)>,
    pub(crate) query: Vec<(String, ValueMatch)>,
    pub(crate) rewrite_path: Option<PathRewrite>,
    /// The Host sent on instead of the request's.
    pub rewrite_host: Option<String>,
    /// Answered with a redirect instead of forwarded.
    pub redirect: Option<Redirect>,
    /// Answered with 500 instead of forwarded: why (a Gateway API rule whose backends are all
    /// invalid, or a filter ebb does not implement).
    pub fail: Option<String>,
    /// Changes to the request's headers.
    pub request_headers: Changes,
    /// Changes to the response's headers.
    pub response_headers: Changes,
    /// Its destinations.
    pub destinations: Vec<Destination>,
    pub(crate) total_weight: u64,
    /// The bound (ms, 0: none) from the request to its answer's head: a wake, a wait for an
    /// instance and a retry included (504 past it).
    pub request_timeout_ms: u64,
    /// The bound (ms, 0: none) on one try, from sending to the answer's head (504 past it).
    pub backend_timeout_ms: u64,
}

/// A checked meta service.
#[derive(Debug, Clone, PartialEq)]
pub struct MetaService {
    /// `conf://NAME`.
    pub id: ServiceId,
    /// Hosts the proxy serves it on.
    pub domains: Vec<String>,
    /// Its routes.
    pub routes: Vec<MetaRoute>,
}

/// What a request looks like to a route's matchers.
pub struct RequestView<'a> {
    /// The Host, without port, lower case.
    pub authority: &'a str,
    /// The method.
    pub method: &'a str,
    /// The target: path and query.
    pub target: &'a str,
    /// A header's value by lower-case name.
    pub header: &'a dyn Fn(&str) -> Option<&'a [u8]>,
}

fn token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Whether a header value has no control characters (tab aside): a head can carry it as it is.
fn plain_value(v: &str) -> bool {
    !v.bytes().any(|b| (b < b' ' && b != b'\t') || b == 0x7f)
}

impl Changes {
    /// Whether every name is a token and every value plain, as a service's changes are checked
    /// (a Gateway API filter's come unchecked): a head writer can write them as they are.
    pub fn well_formed(&self) -> bool {
        self.set
            .iter()
            .chain(&self.add)
            .all(|(n, v)| token(n) && plain_value(v))
            && self.remove.iter().all(|n| token(n))
    }

    /// Every header name it sets, adds or removes.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.set
            .iter()
            .chain(&self.add)
            .map(|(n, _)| n.as_str())
            .chain(self.remove.iter().map(String::as_str))
    }
}

fn changes(what: &str, c: &HeaderChanges) -> Result<Changes, String> {
    let check = |n: &str, v: Option<&str>| {
        if !token(n) {
            return Err(format!("{what}: {n:?} is not a header name"));
        }
        if let Some(v) = v
            && !plain_value(v)
        {
            return Err(format!("{what}: the value of {n:?} has control characters"));
        }
        Ok(n.to_ascii_lowercase())
    };
    let mut out = Changes::default();
    for (n, v) in &c.set {
        out.set.push((check(n, Some(v))?, v.clone()));
    }
    for (n, v) in &c.add {
        out.add.push((check(n, Some(v))?, v.clone()));
    }
    for n in &c.remove {
        out.remove.push(check(n, None)?);
    }
    Ok(out)
}

impl MetaService {
    /// Checks a service as written; every error names where it is.
    pub fn build(cfg: &ServiceConfig) -> Result<MetaService, String> {
        let id = ServiceId::parse(&format!("conf://{}", cfg.name))
            .map_err(|e| format!("service {:?}: {e}", cfg.name))?;
        if !cfg
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        {
            return Err(format!(
                "service {:?}: use letters, digits, '-', '_' and '.'",
                cfg.name
            ));
        }
        let at = |what: String| format!("service {:?}: {what}", cfg.name);
        let service_policy = cfg.policy.clone().unwrap_or_default();
        service_policy.validate().map_err(at)?;
        let mut domains = Vec::new();
        for d in &cfg.domains {
            let d = d.to_ascii_lowercase();
            if !crate::ids::valid_domain(&d) {
                return Err(at(format!("{d:?} is not a host name")));
            }
            domains.push(d);
        }
        if cfg.routes.is_empty() {
            return Err(at("no routes".into()));
        }
        let mut routes = Vec::new();
        for (i, r) in cfg.routes.iter().enumerate() {
            let at = |what: String| at(format!("route {}: {what}", i + 1));
            let route_policy = match &r.policy {
                Some(p) => {
                    p.validate().map_err(at)?;
                    p.clone()
                }
                None => service_policy.clone(),
            };
            let path = r
                .path
                .as_deref()
                .map(PathPattern::parse)
                .transpose()
                .map_err(at)?;
            let names = path.as_ref().map(|p| p.names()).unwrap_or_default();
            if let Some(t) = &r.rewrite_path {
                if !t.starts_with('/') {
                    return Err(at(format!("rewrite_path {t:?} does not start with /")));
                }
                for n in template_names(t).map_err(at)? {
                    if !names.contains(&n.as_str()) {
                        return Err(at(format!(
                            "rewrite_path {t:?} uses {{{n}}}, which the path does not capture"
                        )));
                    }
                }
            }
            let mut methods = Vec::new();
            for m in &r.methods {
                if !token(m) {
                    return Err(at(format!("{m:?} is not a method")));
                }
                methods.push(m.to_ascii_uppercase());
            }
            let mut headers = Vec::new();
            for (n, v) in &r.headers {
                if !token(n) {
                    return Err(at(format!("{n:?} is not a header name")));
                }
                headers.push((n.to_ascii_lowercase(), ValueMatch::from_config(v)));
            }
            let query = r
                .query
                .iter()
                .map(|(k, v)| (k.clone(), ValueMatch::from_config(v)))
                .collect();
            let authority = r.authority.as_ref().map(|a| a.to_ascii_lowercase());
            if let Some(a) = &authority
                && !crate::ids::valid_domain(a)
            {
                return Err(at(format!("authority {a:?} is not a host name")));
            }
            if r.destinations.is_empty() {
                return Err(at("no destinations".into()));
            }
            let mut destinations = Vec::new();
            for (j, d) in r.destinations.iter().enumerate() {
                let at = |what: String| at(format!("destination {}: {what}", j + 1));
                let source = match (&d.service, d.addresses.is_empty()) {
                    (Some(_), false) | (None, true) => {
                        return Err(at("give either addresses or service".into()));
                    }
                    (None, false) => Source::Addresses(
                        d.addresses
                            .iter()
                            .map(|a| {
                                a.parse::<SocketAddr>()
                                    .map_err(|_| at(format!("{a:?} is not IP:port")))
                            })
                            .collect::<Result<_, _>>()?,
                    ),
                    (Some(s), true) => {
                        let id = ServiceId::parse(s).map_err(|e| at(e.to_string()))?;
                        if !DESTINATION_SCHEMES.contains(&id.scheme()) {
                            return Err(at(format!(
                                "{s:?}: unknown scheme {:?} (known: {})",
                                id.scheme(),
                                DESTINATION_SCHEMES.join(", ")
                            )));
                        }
                        super::k8s::check(&id).map_err(at)?;
                        Source::Service(id)
                    }
                };
                let policy = match &d.policy {
                    Some(p) => {
                        p.validate().map_err(at)?;
                        p.clone()
                    }
                    None => route_policy.clone(),
                };
                destinations.push(Destination {
                    source,
                    weight: d.weight,
                    policy,
                    request_headers: Changes::default(),
                    h2c: false,
                });
            }
            let total_weight: u64 = destinations.iter().map(|d| d.weight as u64).sum();
            if total_weight == 0 {
                return Err(at("every destination has weight 0".into()));
            }
            routes.push(MetaRoute {
                authority,
                path: path.map(PathMatch::Pattern),
                methods,
                headers,
                query,
                rewrite_path: r.rewrite_path.clone().map(PathRewrite::Template),
                rewrite_host: None,
                redirect: None,
                fail: None,
                request_headers: changes("request_headers", &r.request_headers).map_err(at)?,
                response_headers: changes("response_headers", &r.response_headers).map_err(at)?,
                destinations,
                total_weight,
                request_timeout_ms: 0,
                backend_timeout_ms: 0,
            });
        }
        Ok(MetaService {
            id,
            domains,
            routes,
        })
    }

    /// The first route whose matchers hold, and the path to send on (rewritten, query kept).
    pub fn route(&self, req: &RequestView<'_>) -> Option<(usize, String)> {
        let (path, query) = match req.target.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (req.target, None),
        };
        'routes: for (i, r) in self.routes.iter().enumerate() {
            if let Some(a) = &r.authority
                && crate::ids::match_host(req.authority, |d| (d == a).then_some(())).is_none()
            {
                continue;
            }
            if !r.methods.is_empty() && !r.methods.iter().any(|m| m == req.method) {
                continue;
            }
            for (n, v) in &r.headers {
                match (req.header)(n) {
                    Some(got) if v.holds(got) => {}
                    _ => continue 'routes,
                }
            }
            for (k, v) in &r.query {
                let got = query.and_then(|q| {
                    q.split('&').find_map(|kv| {
                        let (a, b) = kv.split_once('=').unwrap_or((kv, ""));
                        (a == k).then_some(b)
                    })
                });
                match got {
                    Some(g) if v.holds(g.as_bytes()) => {}
                    _ => continue 'routes,
                }
            }
            let caps = match &r.path {
                Some(p) => match p.matches(path) {
                    Some(c) => c,
                    None => continue,
                },
                None => Vec::new(),
            };
            let sent = match &r.rewrite_path {
                Some(t) => {
                    let p = t.apply(path, &caps);
                    match query {
                        Some(q) => format!("{p}?{q}"),
                        None => p,
                    }
                }
                None => req.target.to_owned(),
            };
            return Some((i, sent));
        }
        None
    }
}

impl MetaRoute {
    /// The sum of its destinations' weights (0: no destination takes a request).
    pub fn total_weight(&self) -> u64 {
        self.total_weight
    }

    /// Where a redirect sends the request for `target` (path and query) that came for `host`
    /// (without port) on a listener of `scheme` and `port`: the Gateway API's rules (the
    /// scheme's well-known port left out; a new scheme without a port takes its well-known one).
    pub fn location(&self, scheme: &str, host: &str, port: u16, target: &str) -> Option<String> {
        let r = self.redirect.as_ref()?;
        let (path, query) = match target.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (target, None),
        };
        let scheme_out = r.scheme.as_deref().unwrap_or(scheme);
        let well_known = |s: &str| match s {
            "https" => 443,
            _ => 80,
        };
        let port_out = match (r.port, &r.scheme) {
            (Some(p), _) => p,
            (None, Some(s)) => well_known(s),
            (None, None) => port,
        };
        let host_out = r.hostname.as_deref().unwrap_or(host);
        let path_out = match &r.path {
            Some(p) => p.apply(path, &[]),
            None => path.to_owned(),
        };
        let mut out = format!("{scheme_out}://{host_out}");
        if port_out != well_known(scheme_out) {
            out.push_str(&format!(":{port_out}"));
        }
        out.push_str(&path_out);
        if let Some(q) = query {
            out.push('?');
            out.push_str(q);
        }
        Some(out)
    }

    /// Which destination takes a request, by weight, from a draw in `[0, 1)`.
    pub fn destination(&self, draw: f64) -> usize {
        let mut x = (draw * self.total_weight as f64) as u64;
        for (i, d) in self.destinations.iter().enumerate() {
            if x < d.weight as u64 {
                return i;
            }
            x -= d.weight as u64;
        }
        self.destinations
            .iter()
            .rposition(|d| d.weight > 0)
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(text: &str) -> Result<MetaService, String> {
        let cfg: ServiceConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        MetaService::build(&cfg)
    }

    #[test]
    fn path_patterns_match_and_capture() {
        let p = PathPattern::parse("/api/{version}/{rest:**}").unwrap();
        assert_eq!(
            p.matches("/api/v1/books/12"),
            Some(vec![
                ("version".into(), "v1".into()),
                ("rest".into(), "books/12".into())
            ])
        );
        assert_eq!(
            p.matches("/api/v1"),
            Some(vec![
                ("version".into(), "v1".into()),
                ("rest".into(), "".into())
            ])
        );
        assert_eq!(p.matches("/api"), None);
        assert_eq!(p.matches("/other/v1/x"), None);
        let exact = PathPattern::parse("/health").unwrap();
        assert!(exact.matches("/health").is_some());
        assert!(exact.matches("/health/x").is_none());
        assert!(exact.matches("/healthz").is_none());
        let prefix = PathPattern::parse("/static/**").unwrap();
        assert!(prefix.matches("/static").is_some());
        assert!(prefix.matches("/static/a/b.css").is_some());
        assert!(prefix.matches("/staticx").is_none());
        for bad in ["api", "/a/**/b", "/{x:*}", "/{}", "/a{x}", "/{a-b}"] {
            assert!(PathPattern::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            fill("/v2/{rest}?x", &[("rest".into(), "a/b".into())]),
            "/v2/a/b?x"
        );
    }

    #[test]
    fn the_first_matching_route_takes_the_request() {
        let s = service(
            r#"
name = "shop"
domains = ["Shop.localhost"]
[[route]]
path = "/api/{rest:**}"
methods = ["get"]
headers = { "X-Canary" = "yes" }
rewrite_path = "/canary/{rest}"
destinations = [{ addresses = ["127.0.0.1:9001"] }]
[[route]]
path = "/api/{rest:**}"
query = { "v" = "2" }
rewrite_path = "/v2/{rest}"
destinations = [{ addresses = ["127.0.0.1:9002"] }]
[[route]]
authority = "*.shop.localhost"
destinations = [{ addresses = ["127.0.0.1:9003"] }]
[[route]]
destinations = [{ addresses = ["127.0.0.1:9004"], weight = 3 }, { service = "ebb://other", weight = 1 }, { service = "http://127.0.0.1:9005", weight = 0 }]
"#,
        )
        .unwrap();
        assert_eq!(s.domains, ["shop.localhost"]);
        let view =
            |authority: &'static str, method: &'static str, target: &'static str, canary: bool| {
                let header: &dyn Fn(&str) -> Option<&'static [u8]> = if canary {
                    &|n| (n == "x-canary").then_some(&b"yes"[..])
                } else {
                    &|_| None
                };
                s.route(&RequestView {
                    authority,
                    method,
                    target,
                    header,
                })
            };
        assert_eq!(
            view("shop.localhost", "GET", "/api/books?x=1", true),
            Some((0, "/canary/books?x=1".into()))
        );
        assert_eq!(
            view("shop.localhost", "POST", "/api/books?v=2", true),
            Some((1, "/v2/books?v=2".into()))
        );
        assert_eq!(
            view("eu.shop.localhost", "GET", "/x", false),
            Some((2, "/x".into()))
        );
        assert_eq!(
            view("shop.localhost", "GET", "/x", false),
            Some((3, "/x".into()))
        );
        let r = &s.routes[3];
        let picks: Vec<usize> = (0..4).map(|k| r.destination(k as f64 / 4.0)).collect();
        assert_eq!(picks, [0, 0, 0, 1]);
    }

    #[test]
    fn bad_descriptors_are_refused_at_load_with_where_and_why() {
        let base = "name = \"shop\"\n[[route]]\n";
        for (body, says) in [
            ("destinations = []", "no destinations"),
            ("", "no destinations"),
            (
                "destinations = [{ addresses = [\"127.0.0.1:1\"], weight = 0 }]",
                "weight 0",
            ),
            (
                "destinations = [{ service = \"ftp://x\" }]",
                "unknown scheme \"ftp\"",
            ),
            ("destinations = [{ service = \"x\" }]", "not absolute"),
            ("destinations = [{ addresses = [\"x:1\"] }]", "not IP:port"),
            (
                "destinations = [{ weight = 1 }]",
                "either addresses or service",
            ),
            (
                "path = \"/a/{id}\"\nrewrite_path = \"/b/{other}\"\ndestinations = [{ addresses = [\"127.0.0.1:1\"] }]",
                "does not capture",
            ),
            (
                "speed = 1\ndestinations = [{ addresses = [\"127.0.0.1:1\"] }]",
                "unknown field `speed`",
            ),
            (
                "destinations = [{ addresses = [\"127.0.0.1:1\"], policy = { balancer = \"x\" } }]",
                "unknown variant",
            ),
            (
                "request_headers = { set = { \"a b\" = \"1\" } }\ndestinations = [{ addresses = [\"127.0.0.1:1\"] }]",
                "not a header name",
            ),
        ] {
            let e = service(&format!("{base}{body}")).unwrap_err();
            assert!(e.contains(says), "{body}: {e}");
        }
        assert!(
            service("name = \"shop\"")
                .unwrap_err()
                .contains("no routes")
        );
    }
}
