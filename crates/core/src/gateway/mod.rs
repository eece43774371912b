//! The Gateway API (`gateway.networking.k8s.io`) as ebb reads it: the objects' specs
//! ([`GatewayClass`], [`Gateway`], [`HttpRoute`], [`GrpcRoute`], [`ReferenceGrant`]) as plain
//! serde types, and
//! the pure step from them to what the proxy serves and what each object's status says
//! ([`compile::compile`]).
//!
//! ebb is the controller of every `GatewayClass` whose `controllerName` is [`CONTROLLER_NAME`].
//! Each of its Gateways gets an address ([`Addressing`]) and its listeners become sockets
//! ([`compile::Socket`]) on that address: for each hostname a request may carry, the rules of
//! every HTTPRoute (or GRPCRoute) attached there, as a meta service ([`crate::discovery::meta::MetaService`])
//! whose routes are already in the Gateway API's order of precedence, so the first that matches
//! takes the request. A backend is a Service: `ebb://NAMESPACE/SERVICE` when ebb scales it (an
//! annotated Service's route: woken from zero by the request, its traffic counted), else
//! `k8s://SERVICE.NAMESPACE:PORT` (its EndpointSlices).
//!
//! Nothing here reads the API server: the Kubernetes side (`ebb-kube`'s `gateway` module) lists
//! the objects, calls [`compile::compile`] and writes what it returns, so the same objects always
//! give the same sockets and the same statuses, on every replica.

pub mod compile;

use std::collections::BTreeMap;

use serde::Deserialize;

/// The `controllerName` of the GatewayClasses ebb implements.
pub const CONTROLLER_NAME: &str = "ebb.dev/gateway";
/// The Gateway API conformance features ebb implements, as its GatewayClasses' status names
/// them (`status.supportedFeatures`): the `GATEWAY-HTTP` and `GATEWAY-GRPC` profiles' cores and
/// the extended features ebb passes.
pub const SUPPORTED_FEATURES: &[&str] = &[
    // Core.
    "Gateway",
    "HTTPRoute",
    "GRPCRoute",
    "ReferenceGrant",
    // Extended.
    "GRPCRouteNamedRouteRule",
    "GatewayHTTPListenerIsolation",
    "GatewayPort8080",
    "HTTPRoute303RedirectStatusCode",
    "HTTPRoute307RedirectStatusCode",
    "HTTPRoute308RedirectStatusCode",
    "HTTPRouteBackendProtocolH2C",
    "HTTPRouteBackendProtocolWebSocket",
    "HTTPRouteBackendRequestHeaderModification",
    "HTTPRouteBackendTimeout",
    "GatewayHTTPSListenerDetectMisdirectedRequests",
    "HTTPRouteDestinationPortMatching",
    "HTTPRouteHostRewrite",
    "HTTPRouteMethodMatching",
    "HTTPRouteNamedRouteRule",
    "HTTPRouteParentRefPort",
    "HTTPRoutePathRedirect",
    "HTTPRoutePathRewrite",
    "HTTPRoutePortRedirect",
    "HTTPRouteQueryParamMatching",
    "HTTPRouteRequestTimeout",
    "HTTPRouteResponseHeaderModification",
    "HTTPRouteSchemeRedirect",
];

/// The API group.
pub const GROUP: &str = "gateway.networking.k8s.io";

/// What every object carries that the compile step reads of its metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Meta {
    /// Its namespace (empty for a cluster-scoped object).
    pub namespace: String,
    pub name: String,
    /// `metadata.generation`, echoed as each condition's `observedGeneration`.
    pub generation: i64,
    /// `metadata.creationTimestamp` (RFC 3339): older routes win ties.
    pub created: String,
}

impl Meta {
    /// `NAMESPACE/NAME`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// A `GatewayClass`.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayClass {
    pub meta: Meta,
    pub spec: GatewayClassSpec,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewayClassSpec {
    #[serde(default)]
    pub controller_name: String,
}

/// A `Gateway`.
#[derive(Debug, Clone, PartialEq)]
pub struct Gateway {
    pub meta: Meta,
    pub spec: GatewaySpec,
    /// The addresses its status names now (kept while still valid, so an address does not move).
    pub status_addresses: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewaySpec {
    #[serde(default)]
    pub gateway_class_name: String,
    #[serde(default)]
    pub listeners: Vec<Listener>,
    #[serde(default)]
    pub addresses: Vec<GatewayAddress>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewayAddress {
    #[serde(default, rename = "type")]
    pub type_: Option<String>,
    #[serde(default)]
    pub value: String,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Listener {
    pub name: String,
    #[serde(default)]
    pub hostname: Option<String>,
    pub port: i32,
    pub protocol: String,
    #[serde(default)]
    pub tls: Option<ListenerTls>,
    #[serde(default)]
    pub allowed_routes: Option<AllowedRoutes>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListenerTls {
    #[serde(default)]
    pub mode: Option<String>,
    #[serde(default)]
    pub certificate_refs: Vec<ObjectRef>,
}

/// A reference to an object of some group and kind (a Secret, a Service, ...).
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectRef {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllowedRoutes {
    #[serde(default)]
    pub namespaces: Option<RouteNamespaces>,
    #[serde(default)]
    pub kinds: Vec<RouteGroupKind>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteNamespaces {
    /// `Same` (the default), `All` or `Selector`.
    #[serde(default)]
    pub from: Option<String>,
    #[serde(default)]
    pub selector: Option<LabelSelector>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
    #[serde(default)]
    pub match_expressions: Vec<LabelSelectorRequirement>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelectorRequirement {
    pub key: String,
    pub operator: String,
    #[serde(default)]
    pub values: Vec<String>,
}

impl LabelSelector {
    /// Whether `labels` satisfy it (an empty selector selects everything).
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|e| {
                let has = labels.get(&e.key);
                match e.operator.as_str() {
                    "In" => has.is_some_and(|v| e.values.contains(v)),
                    "NotIn" => has.is_none_or(|v| !e.values.contains(v)),
                    "Exists" => has.is_some(),
                    "DoesNotExist" => has.is_none(),
                    _ => false,
                }
            })
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteGroupKind {
    #[serde(default)]
    pub group: Option<String>,
    pub kind: String,
}

/// An `HTTPRoute`.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpRoute {
    pub meta: Meta,
    pub spec: HttpRouteSpec,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteSpec {
    #[serde(default)]
    pub parent_refs: Vec<ParentRef>,
    #[serde(default)]
    pub hostnames: Vec<String>,
    #[serde(default)]
    pub rules: Vec<HttpRouteRule>,
}

/// A route's reference to the Gateway (and listener) it attaches to.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ParentRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub section_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteRule {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub matches: Vec<HttpRouteMatch>,
    #[serde(default)]
    pub filters: Vec<HttpRouteFilter>,
    #[serde(default)]
    pub backend_refs: Vec<HttpBackendRef>,
    #[serde(default)]
    pub timeouts: Option<HttpRouteTimeouts>,
}

/// A rule's timeouts, as the Gateway API writes durations (`500ms`, `1m30s`; `0s`: none).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteTimeouts {
    /// From the request to its answer's head, a wake and every try included.
    #[serde(default)]
    pub request: Option<String>,
    /// From one try's request to its answer's head.
    #[serde(default)]
    pub backend_request: Option<String>,
}

/// A Gateway API duration (`^([0-9]{1,5}(h|m|s|ms)){1,4}$`) in milliseconds: ebb's duration
/// parser ([`crate::orchestrator::annotations::parse_duration_ms`]) within the API's bounds (at
/// most four parts of at most five digits).
pub fn duration_ms(text: &str) -> Result<u64, String> {
    let mut numbers = text
        .split(|c: char| !c.is_ascii_digit())
        .filter(|n| !n.is_empty());
    if numbers.clone().count() > 4 || numbers.any(|n| n.len() > 5) {
        return Err(format!(
            "{text:?} is not a Gateway API duration (at most four parts of at most five digits)"
        ));
    }
    crate::orchestrator::annotations::parse_duration_ms(text)
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteMatch {
    #[serde(default)]
    pub path: Option<HttpPathMatch>,
    #[serde(default)]
    pub headers: Vec<HttpValueMatch>,
    #[serde(default)]
    pub query_params: Vec<HttpValueMatch>,
    #[serde(default)]
    pub method: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpPathMatch {
    /// `Exact`, `PathPrefix` (the default) or `RegularExpression`.
    #[serde(default, rename = "type")]
    pub type_: Option<String>,
    #[serde(default)]
    pub value: Option<String>,
}

/// A header or query parameter match.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpValueMatch {
    /// `Exact` (the default) or `RegularExpression`.
    #[serde(default, rename = "type")]
    pub type_: Option<String>,
    pub name: String,
    pub value: String,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteFilter {
    #[serde(rename = "type")]
    pub type_: String,
    #[serde(default)]
    pub request_header_modifier: Option<HeaderModifier>,
    #[serde(default)]
    pub response_header_modifier: Option<HeaderModifier>,
    #[serde(default)]
    pub request_redirect: Option<RequestRedirect>,
    #[serde(default)]
    pub url_rewrite: Option<UrlRewrite>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HeaderModifier {
    #[serde(default)]
    pub set: Vec<HeaderValue>,
    #[serde(default)]
    pub add: Vec<HeaderValue>,
    #[serde(default)]
    pub remove: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct HeaderValue {
    pub name: String,
    pub value: String,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestRedirect {
    #[serde(default)]
    pub scheme: Option<String>,
    #[serde(default)]
    pub hostname: Option<String>,
    #[serde(default)]
    pub path: Option<PathModifier>,
    #[serde(default)]
    pub port: Option<i32>,
    #[serde(default)]
    pub status_code: Option<i32>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UrlRewrite {
    #[serde(default)]
    pub hostname: Option<String>,
    #[serde(default)]
    pub path: Option<PathModifier>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PathModifier {
    /// `ReplaceFullPath` or `ReplacePrefixMatch`.
    #[serde(rename = "type")]
    pub type_: String,
    #[serde(default)]
    pub replace_full_path: Option<String>,
    #[serde(default)]
    pub replace_prefix_match: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpBackendRef {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub port: Option<i32>,
    #[serde(default)]
    pub weight: Option<i32>,
    #[serde(default)]
    pub filters: Vec<HttpRouteFilter>,
}

/// A `GRPCRoute`.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpcRoute {
    pub meta: Meta,
    pub spec: GrpcRouteSpec,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrpcRouteSpec {
    #[serde(default)]
    pub parent_refs: Vec<ParentRef>,
    #[serde(default)]
    pub hostnames: Vec<String>,
    #[serde(default)]
    pub rules: Vec<GrpcRouteRule>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrpcRouteRule {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub matches: Vec<GrpcRouteMatch>,
    /// The HTTPRoute's filters of the same names (`RequestHeaderModifier`,
    /// `ResponseHeaderModifier`, ...).
    #[serde(default)]
    pub filters: Vec<HttpRouteFilter>,
    #[serde(default)]
    pub backend_refs: Vec<HttpBackendRef>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrpcRouteMatch {
    #[serde(default)]
    pub method: Option<GrpcMethodMatch>,
    #[serde(default)]
    pub headers: Vec<HttpValueMatch>,
}

/// A gRPC service and method (the path `/SERVICE/METHOD`), either of them left out for any.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrpcMethodMatch {
    /// `Exact` (the default) or `RegularExpression`.
    #[serde(default, rename = "type")]
    pub type_: Option<String>,
    #[serde(default)]
    pub service: Option<String>,
    #[serde(default)]
    pub method: Option<String>,
}

/// A `ReferenceGrant`: lets objects of the `from` kinds in other namespaces refer to the `to`
/// kinds in its own.
#[derive(Debug, Clone, PartialEq)]
pub struct ReferenceGrant {
    pub meta: Meta,
    pub spec: ReferenceGrantSpec,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReferenceGrantSpec {
    #[serde(default)]
    pub from: Vec<GrantFrom>,
    #[serde(default)]
    pub to: Vec<GrantTo>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrantFrom {
    #[serde(default)]
    pub group: String,
    pub kind: String,
    pub namespace: String,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrantTo {
    #[serde(default)]
    pub group: String,
    pub kind: String,
    #[serde(default)]
    pub name: Option<String>,
}

/// A Service as the routes see it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceInfo {
    /// Its ports.
    pub ports: Vec<i32>,
    /// Those whose `appProtocol` is `kubernetes.io/h2c`: requests go on over HTTP/2.
    pub h2c_ports: Vec<i32>,
    /// The ebb route that scales its workload (an annotated Service's `NAMESPACE/NAME`), if any.
    pub route: Option<String>,
}

/// A `kubernetes.io/tls` Secret's certificate and key (PEM), as the listeners use them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSecret {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

/// How Gateways get their addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Addressing {
    /// Each Gateway gets one address of its own from the pool, where ebb binds its listeners.
    Pool(Vec<std::net::IpAddr>),
    /// Every Gateway's listeners bind `bind`; their status names `addresses` (ebb's Service).
    Shared {
        bind: std::net::IpAddr,
        addresses: Vec<String>,
    },
}

/// Everything the compile step reads.
#[derive(Debug, Clone, Default)]
pub struct World {
    pub classes: Vec<GatewayClass>,
    pub gateways: Vec<Gateway>,
    pub http_routes: Vec<HttpRoute>,
    pub grpc_routes: Vec<GrpcRoute>,
    pub grants: Vec<ReferenceGrant>,
    /// Namespaces' labels, by name.
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
    /// Services by `NAMESPACE/NAME`.
    pub services: BTreeMap<String, ServiceInfo>,
    /// TLS Secrets by `NAMESPACE/NAME`: `None` for one that exists but is not a usable
    /// `kubernetes.io/tls` Secret.
    pub secrets: BTreeMap<String, Option<TlsSecret>>,
    /// Host names of ebb's routes from annotated Services (lower case), with the route: an
    /// HTTPRoute cannot take them.
    pub service_hosts: BTreeMap<String, String>,
    /// Sockets ebb could not bind (their listeners say `PortUnavailable`).
    pub unbindable: std::collections::BTreeSet<std::net::SocketAddr>,
}
