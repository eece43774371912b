//! Traces (OpenTelemetry): the W3C Trace Context read from each request, a span of ebb's own for
//! it, and that span's context sent on to the replica, so the app's spans are its children.
//!
//! Off until the binary has set a tracer provider up (with its exporter) and calls [`enable`];
//! while off, nothing here runs and the headers pass as any other. Once on, every request on
//! every path (the HTTP/1.1 fast path, hyper's for HTTP/2, gRPC and the rest) starts a
//! `proxy.request` span (kind server) under the context its `traceparent` and `tracestate`
//! carry, sampled by the provider's sampler (parent-based by default). A sampled request's
//! replica gets a `traceparent` naming that span as its parent; a request sampled out goes on
//! with the client's headers as they came, and costs no span. A request that waits for a
//! replica gets a `proxy.hold` span under its own, and the wake it starts a `scale` span under
//! that (`tracing` spans, which the binary's `tracing-opentelemetry` layer exports); the other
//! requests held for the same wake link to it.
//!
//! Attributes follow OpenTelemetry's semantic conventions for HTTP servers where they have a
//! name (`http.request.method`, `url.path`, `server.address`, `client.address`,
//! `http.response.status_code`), and are `ebb.*` for the rest (`ebb.route`, `ebb.replica`,
//! `ebb.request_id`).

use std::net::SocketAddr;
use std::sync::OnceLock;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer};

use ebb_core::event::CallTrace;

/// The proxy's tracer and propagator, once tracing is on.
pub struct Tracing {
    /// The SDK's own tracer, not the global boxed one: a span it starts is not boxed.
    tracer: SdkTracer,
    /// The sampler the tracer's provider was built from, to drop a request's span before the
    /// SDK makes one when the decision cannot be to keep it ([`Sampling::dropped`]).
    sampling: Sampling,
    propagator: TraceContextPropagator,
}

static TRACING: OnceLock<Tracing> = OnceLock::new();

/// Turns tracing on for every proxy of this process, with `tracer` (the provider's tracer named
/// `ebb.proxy`) and the sampling its provider's sampler was built from
/// ([`Sampling::sampler`]).
pub fn enable(tracer: SdkTracer, sampling: Sampling) {
    let _ = TRACING.set(Tracing {
        tracer,
        sampling,
        propagator: TraceContextPropagator::new(),
    });
}

/// A sampler of the kinds `OTEL_TRACES_SAMPLER` names: a root's decision by ratio, under its
/// parent's when parent-based.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    pub parent_based: bool,
    /// The share of roots sampled: 0 (`always_off`) to 1 (`always_on`).
    pub ratio: f64,
}

impl Sampling {
    /// The SDK's sampler for it.
    pub fn sampler(self) -> Sampler {
        let root = if self.ratio >= 1.0 {
            Sampler::AlwaysOn
        } else if self.ratio > 0.0 {
            Sampler::TraceIdRatioBased(self.ratio)
        } else {
            Sampler::AlwaysOff
        };
        if self.parent_based {
            Sampler::ParentBased(Box::new(root))
        } else {
            root
        }
    }

    /// Whether its sampler drops a span under `parent` whatever the span's trace id, as the
    /// SDK's `Sampler::should_sample` decides: parent-based under a parent that was not sampled,
    /// or a root with a ratio of 0. Then a request costs no span, no id and no call into the
    /// SDK. A decision that depends on the trace id (a ratio between 0 and 1) is the SDK's.
    fn dropped(self, parent: &Context) -> bool {
        if self.parent_based && parent.has_active_span() {
            return !parent.span().span_context().is_sampled();
        }
        // The ratio is from 0 to 1 (`OTEL_TRACES_SAMPLER_ARG` is checked).
        self.ratio <= 0.0
    }
}

/// Whether tracing is on.
pub fn enabled() -> bool {
    TRACING.get().is_some()
}

/// The W3C trace context and baggage `headers` carry, as ebb keeps them with a call it enqueues
/// (so its spans join that trace and its target's request carries them on): None when tracing
/// is off or the headers carry no valid context.
pub fn carried(headers: &hyper::HeaderMap) -> Option<CallTrace> {
    let tracing = TRACING.get()?;
    let cx = tracing.propagator.extract(&Reading(headers));
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut out = hyper::HeaderMap::new();
    tracing.inject(&cx, &mut Headers(&mut out));
    let text = |v: &hyper::header::HeaderValue| v.to_str().ok().map(str::to_owned);
    // Several `baggage` headers are one list (W3C Baggage); one longer than the limit is not
    // kept at all rather than cut.
    let baggage = headers
        .get_all("baggage")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    Some(CallTrace {
        traceparent: out.get("traceparent").and_then(text)?,
        tracestate: out
            .get("tracestate")
            .and_then(text)
            .filter(|s| !s.is_empty() && s.len() <= CallTrace::MAX_TRACESTATE),
        baggage: Some(baggage).filter(|b| !b.is_empty() && b.len() <= CallTrace::MAX_BAGGAGE),
    })
}

/// The context a call's kept `traceparent` names, as the parent of its spans.
pub fn parent_of(traceparent: &str) -> Context {
    let carried = Carried {
        traceparent: Some(traceparent),
        tracestate: None,
    };
    TraceContextPropagator::new().extract(&carried)
}

/// The tracer, when tracing is on.
pub(crate) fn tracing() -> Option<&'static Tracing> {
    TRACING.get()
}

/// What a request's span starts with.
pub(crate) struct RequestSpan<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub host: &'a str,
    /// Known on the fast path when the span starts; the general path names it later
    /// ([`routed`]).
    pub route: Option<&'a str>,
    pub client: Option<SocketAddr>,
    pub request_id: Option<&'a [u8]>,
}

impl Tracing {
    /// Starts a request's `proxy.request` span under the context `carrier` holds: its context
    /// (with the span in it), or None when the sampler dropped it.
    ///
    /// A request sampled out whatever its trace id is dropped here ([`Sampling::dropped`]);
    /// otherwise the
    /// SDK's sampler decides before the attributes are made (the samplers `OTEL_TRACES_SAMPLER`
    /// names look at the parent and the trace id, never at attributes), so a request sampled out
    /// costs no allocation for them.
    pub(crate) fn request(&self, carrier: &dyn Extractor, r: RequestSpan<'_>) -> Option<Context> {
        use opentelemetry::trace::Span as _;
        let parent = match carrier.get("traceparent") {
            Some(_) => self.propagator.extract(carrier),
            // No context to read: a root (the proxy never makes a context current).
            None => Context::new(),
        };
        if self.sampling.dropped(&parent) {
            return None;
        }
        let mut span = self
            .tracer
            .span_builder("proxy.request")
            .with_kind(SpanKind::Server)
            .start_with_context(&self.tracer, &parent);
        if !span.is_recording() {
            return None;
        }
        let mut attributes = Vec::with_capacity(6);
        attributes.push(KeyValue::new("http.request.method", r.method.to_owned()));
        attributes.push(KeyValue::new("url.path", r.path.to_owned()));
        attributes.push(KeyValue::new("server.address", r.host.to_owned()));
        if let Some(route) = r.route {
            attributes.push(KeyValue::new("ebb.route", route.to_owned()));
        }
        if let Some(c) = r.client {
            attributes.push(KeyValue::new("client.address", c.ip().to_string()));
        }
        if let Some(id) = r.request_id {
            let id = String::from_utf8_lossy(id).into_owned();
            attributes.push(KeyValue::new("ebb.request_id", id));
        }
        span.set_attributes(attributes);
        Some(parent.with_span(span))
    }

    /// Writes `cx`'s trace context (`traceparent`, and `tracestate` when it has one) to `to`.
    pub(crate) fn inject(&self, cx: &Context, to: &mut dyn Injector) {
        self.propagator.inject_context(cx, to);
    }
}

/// A request's span as the general path carries it, in the request's extensions.
#[derive(Clone)]
pub(crate) struct RequestCx(pub Context);

/// Records a request's route and id on its span (the general path knows them once routed).
pub(crate) fn routed(cx: Option<&Context>, route: &dyn std::fmt::Display, id: &[u8]) {
    if let Some(cx) = cx {
        cx.span().set_attributes([
            KeyValue::new("ebb.route", route.to_string()),
            KeyValue::new("ebb.request_id", String::from_utf8_lossy(id).into_owned()),
        ]);
    }
}

/// Names a gRPC call's service and method on its span (`/package.Service/Method`), as the RPC
/// conventions do.
pub(crate) fn rpc(cx: &Context, path: &str) {
    let mut attributes = vec![KeyValue::new("rpc.system", "grpc")];
    if let Some((service, method)) = path.trim_start_matches('/').split_once('/') {
        attributes.push(KeyValue::new("rpc.service", service.to_owned()));
        attributes.push(KeyValue::new("rpc.method", method.to_owned()));
    }
    cx.span().set_attributes(attributes);
}

/// Records a gRPC status given in an answer's head.
pub(crate) fn grpc_status(cx: &Context, status: Option<&hyper::header::HeaderValue>) {
    if let Some(code) = status
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i64>().ok())
    {
        cx.span()
            .set_attribute(KeyValue::new("rpc.grpc.status_code", code));
    }
}

/// Records the replica a request went to on its span.
pub(crate) fn replica(cx: Option<&Context>, addr: SocketAddr) {
    if let Some(cx) = cx {
        cx.span()
            .set_attribute(KeyValue::new("ebb.replica", addr.to_string()));
    }
}

/// Makes a traced answer its route's answer-time exemplar (`ebb_proxy_response_duration_seconds`).
pub(crate) fn exemplar(
    traffic: &crate::traffic::RouteTraffic,
    rtt_us: u64,
    cx: &Context,
    at_ms: u64,
) {
    let trace_id = cx.span().span_context().trace_id().to_string();
    traffic.exemplar(rtt_us, trace_id, at_ms);
}

/// Ends a request's span with the status it was answered with (0: none, the client left or the
/// connection broke first); 5xx marks the span an error, as the HTTP conventions say of a
/// server's span.
pub(crate) fn answered(cx: Context, status: u16) {
    let span = cx.span();
    if status > 0 {
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        if status >= 500 {
            span.set_status(Status::error(""));
        }
    } else {
        span.set_status(Status::error("no answer was sent"));
    }
    span.end();
}

/// A request head's trace headers as the HTTP/1.1 fast path found them.
pub(crate) struct Carried<'a> {
    pub traceparent: Option<&'a str>,
    pub tracestate: Option<&'a str>,
}

impl Extractor for Carried<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => self.traceparent,
            "tracestate" => self.tracestate,
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        let mut keys = Vec::with_capacity(2);
        if self.traceparent.is_some() {
            keys.push("traceparent");
        }
        if self.tracestate.is_some() {
            keys.push("tracestate");
        }
        keys
    }
}

/// Writes injected headers as head lines.
pub(crate) struct HeadLines<'a>(pub &'a mut Vec<u8>);

impl Injector for HeadLines<'_> {
    fn set(&mut self, key: &str, value: String) {
        ebb_http::h1::push_header(self.0, key.as_bytes(), value.as_bytes());
    }
}

/// A `http::HeaderMap` as a carrier, read.
pub(crate) struct Reading<'a>(pub &'a hyper::HeaderMap);

impl Extractor for Reading<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// A `http::HeaderMap` as a carrier, written. `traceparent` is marked sensitive, as the request
/// id is: it names a span of its own in every request, so HPACK writes it as a literal never
/// indexed rather than filling the HTTP/2 encoder's table with values never sent again.
pub(crate) struct Headers<'a>(pub &'a mut hyper::HeaderMap);

impl Injector for Headers<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(mut value)) = (
            hyper::header::HeaderName::from_bytes(key.as_bytes()),
            hyper::header::HeaderValue::from_str(&value),
        ) {
            value.set_sensitive(name == "traceparent");
            self.0.insert(name, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_span_is_dropped_early_only_when_the_sdk_would_drop_it_for_any_trace_id() {
        use opentelemetry::trace::TraceId;
        use opentelemetry_sdk::trace::{SamplingDecision, ShouldSample};
        let propagator = TraceContextPropagator::new();
        let parent = |tp: Option<&str>| match tp {
            Some(tp) => propagator.extract(&Carried {
                traceparent: Some(tp),
                tracestate: None,
            }),
            None => Context::new(),
        };
        let sampled = parent(Some(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ));
        let unsampled = parent(Some(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        ));
        let malformed = parent(Some("00-zz-b7ad6b7169203331-01"));
        let none = parent(None);
        for parent_based in [false, true] {
            for ratio in [0.0, 0.01, 0.5, 1.0] {
                let sampling = Sampling {
                    parent_based,
                    ratio,
                };
                early(sampling, [&sampled, &unsampled, &malformed, &none]);
            }
        }
        fn early(sampling: Sampling, parents: [&Context; 4]) {
            let sampler = sampling.sampler();
            for cx in parents {
                let decisions: Vec<SamplingDecision> = (0..2_000u128)
                    .map(|i| {
                        let id = TraceId::from(
                            i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835),
                        );
                        let kind = SpanKind::Server;
                        sampler
                            .should_sample(Some(cx), id, "proxy.request", &kind, &[], &[])
                            .decision
                    })
                    .collect();
                let always_dropped = decisions.iter().all(|d| *d == SamplingDecision::Drop);
                assert_eq!(
                    sampling.dropped(cx),
                    always_dropped,
                    "{sampling:?} under {:?}",
                    cx.span().span_context()
                );
            }
        }
    }

    #[test]
    fn a_carried_context_is_read_and_written_as_w3c_trace_context() {
        let propagator = TraceContextPropagator::new();
        let carried = Carried {
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            tracestate: Some("congo=t61rcWkgMzE"),
        };
        let cx = propagator.extract(&carried);
        let sc = cx.span().span_context().clone();
        assert!(sc.is_valid() && sc.is_remote() && sc.is_sampled());
        assert_eq!(
            sc.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        let mut out = Vec::new();
        propagator.inject_context(&cx, &mut HeadLines(&mut out));
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains(
                "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
            )
        );
        assert!(text.contains("tracestate: congo=t61rcWkgMzE\r\n"));
        // Into a header map (the general path): the span's own `traceparent` never indexed by
        // HPACK, the shared `tracestate` indexed as any header.
        let mut headers = hyper::HeaderMap::new();
        propagator.inject_context(&cx, &mut Headers(&mut headers));
        assert_eq!(
            headers["traceparent"],
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        );
        assert!(headers["traceparent"].is_sensitive());
        assert_eq!(headers["tracestate"], "congo=t61rcWkgMzE");
        assert!(!headers["tracestate"].is_sensitive());
        // A malformed one is no context at all.
        let bad = Carried {
            traceparent: Some("00-zz-b7ad6b7169203331-01"),
            tracestate: None,
        };
        assert!(!propagator.extract(&bad).span().span_context().is_valid());
    }
}
