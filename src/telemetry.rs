//! Traces out of ebb: OpenTelemetry's SDK with an OTLP exporter, configured by the standard
//! `OTEL_*` environment variables, and ebb's `tracing` spans of interest as OpenTelemetry spans
//! (`tracing-opentelemetry`).
//!
//! * On when an OTLP endpoint is named (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
//!   `OTEL_EXPORTER_OTLP_ENDPOINT`) or `OTEL_TRACES_EXPORTER=otlp`; off with
//!   `OTEL_TRACES_EXPORTER=none` or `OTEL_SDK_DISABLED=true`, and by default.
//! * The protocol: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else `OTEL_EXPORTER_OTLP_PROTOCOL`:
//!   `http/protobuf` (the default, as the specification says) or `grpc`. The exporter reads the
//!   endpoint, `OTEL_EXPORTER_OTLP_HEADERS` and `OTEL_EXPORTER_OTLP_TIMEOUT` itself; the
//!   resource is `OTEL_SERVICE_NAME` (else `ebb`) with `OTEL_RESOURCE_ATTRIBUTES`. The sampler
//!   is `OTEL_TRACES_SAMPLER` with `OTEL_TRACES_SAMPLER_ARG` (default parent-based, always on),
//!   read here rather than by the SDK so that a sampler ebb does not have or a ratio outside 0 to
//!   1 is an error, and so that the proxy holds the same sampler to drop a request's span before
//!   the SDK is asked ([`ebb_proxy::trace::enable`]).
//! * Spans are batched by the SDK's batch processor (`OTEL_BSP_*`: queue size, delay, batch
//!   size, export timeout) behind a bound of ebb's own: a span that finds the queue full is
//!   dropped and counted, never waited for, so a collector that is down or slow never blocks a
//!   request. Exports run on a thread and a runtime of their own. What was exported, dropped at
//!   the queue and lost with a failed export are counters ([`spans`]), on `/metrics` as
//!   `ebb_trace_spans_total`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use ebb_proxy::trace::Sampling;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, Span, SpanData, SpanExporter,
    SpanProcessor,
};

/// The names of ebb's `tracing` spans that become OpenTelemetry spans (the request's own span,
/// `proxy.request`, is made with the OpenTelemetry API directly, off the `tracing` path).
pub const SPANS: &[&str] = &[
    "proxy.hold",
    "scale",
    "call.queue",
    "call.run",
    "function.step",
    "cleaner.evaluate",
    "cleaner.fire",
];

static EXPORTED: AtomicU64 = AtomicU64::new(0);
static QUEUE_FULL: AtomicU64 = AtomicU64::new(0);
static EXPORT_FAILED: AtomicU64 = AtomicU64::new(0);

/// Spans so far: exported, dropped because the queue was full, lost with a failed export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanCounts {
    pub exported: u64,
    pub queue_full: u64,
    pub export_failed: u64,
}

/// What became of the spans ended so far.
pub fn spans() -> SpanCounts {
    SpanCounts {
        exported: EXPORTED.load(Ordering::Relaxed),
        queue_full: QUEUE_FULL.load(Ordering::Relaxed),
        export_failed: EXPORT_FAILED.load(Ordering::Relaxed),
    }
}

/// The OTLP protocols ebb exports with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Grpc,
    HttpProtobuf,
}

/// Whether traces are on and how they go out, from the environment as `var` reads it.
#[derive(Debug, Clone, PartialEq)]
struct Settings {
    protocol: Protocol,
    service_name: Option<String>,
    max_queue: usize,
    sampler: Sampling,
}

/// The sampler `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG` name.
fn sampling(var: &dyn Fn(&str) -> Option<String>) -> Result<Sampling> {
    let name = var("OTEL_TRACES_SAMPLER").map(|v| v.trim().to_ascii_lowercase());
    let name = name.as_deref().unwrap_or("parentbased_always_on");
    let (parent_based, root) = match name.strip_prefix("parentbased_") {
        Some(root) => (true, root),
        None => (false, name),
    };
    let ratio = match root {
        "always_on" => 1.0,
        "always_off" => 0.0,
        // The specification's default ratio is 1.
        "traceidratio" => match var("OTEL_TRACES_SAMPLER_ARG") {
            None => 1.0,
            Some(v) => match v.trim().parse::<f64>() {
                Ok(r) if (0.0..=1.0).contains(&r) => r,
                _ => bail!("OTEL_TRACES_SAMPLER_ARG={v:?}: a ratio from 0 to 1"),
            },
        },
        _ => bail!(
            "OTEL_TRACES_SAMPLER={name:?}: ebb samples with always_on, always_off, \
             traceidratio or their parentbased_ forms"
        ),
    };
    Ok(Sampling {
        parent_based,
        ratio,
    })
}

fn settings(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<Settings>> {
    let var = |name: &str| var(name).filter(|v| !v.trim().is_empty());
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let named = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT"))
        .is_some();
    match var("OTEL_TRACES_EXPORTER").map(|v| v.trim().to_ascii_lowercase()) {
        Some(v) if v == "none" => return Ok(None),
        Some(v) if v == "otlp" => {}
        Some(v) => {
            bail!("OTEL_TRACES_EXPORTER={v:?}: ebb exports traces with \"otlp\" (or \"none\")")
        }
        None if named => {}
        None => return Ok(None),
    }
    let protocol = match var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .map(|v| v.trim().to_ascii_lowercase())
        .as_deref()
    {
        None | Some("http/protobuf") => Protocol::HttpProtobuf,
        Some("grpc") => Protocol::Grpc,
        Some(v) => {
            bail!("OTEL_EXPORTER_OTLP_PROTOCOL={v:?}: ebb speaks \"http/protobuf\" or \"grpc\"")
        }
    };
    let max_queue = match var("OTEL_BSP_MAX_QUEUE_SIZE") {
        None => 2048,
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => bail!("OTEL_BSP_MAX_QUEUE_SIZE={v:?}: a number of spans above 0"),
        },
    };
    let service_name = if var("OTEL_SERVICE_NAME").is_some()
        || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("service.name="))
    {
        None
    } else {
        Some("ebb".to_owned())
    };
    let sampler = sampling(&var)?;
    Ok(Some(Settings {
        protocol,
        service_name,
        max_queue,
        sampler,
    }))
}

/// The tracer provider while traces are on; shut it down to send what is queued.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Sets traces up as the process's environment says: None when they are off. Sets the
    /// global tracer provider and turns the proxy's tracing on (the proxy keeps its own W3C
    /// Trace Context propagator). An error for a setting ebb cannot honour.
    pub fn from_env() -> Result<Option<Telemetry>> {
        let Some(settings) = settings(&|name| std::env::var(name).ok())? else {
            return Ok(None);
        };
        let exporter = Counting::new(settings.protocol)?;
        let queued = exporter.queued.clone();
        let batch = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(settings.max_queue)
                    .build(),
            )
            .build();
        let processor = Bounded {
            inner: batch,
            queued,
            max: settings.max_queue,
        };
        let mut resource = opentelemetry_sdk::Resource::builder();
        if let Some(name) = settings.service_name {
            resource = resource.with_service_name(name);
        }
        let provider = SdkTracerProvider::builder()
            .with_sampler(settings.sampler.sampler())
            .with_span_processor(processor)
            .with_resource(resource.build())
            .build();
        opentelemetry::global::set_tracer_provider(provider.clone());
        ebb_proxy::trace::enable(provider.tracer("ebb.proxy"), settings.sampler);
        Ok(Some(Telemetry { provider }))
    }

    /// The `tracing` layer that makes ebb's spans of [`SPANS`] OpenTelemetry spans.
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S> + use<S>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        use tracing_subscriber::Layer as _;
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer("ebb"))
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
                meta.is_span() && SPANS.contains(&meta.name())
            }))
    }

    /// Sends what is queued (within the export timeout) and stops exporting.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "traces: the last spans were not all sent");
        }
    }
}

/// Records a span of a traced call's after the fact, from the log's times (ms since the epoch),
/// under the context the call was enqueued with: `call.queue` (queued to started) and `call.run`
/// or, for a function's step, `function.step` (started to finished). Nothing when traces are
/// off or the call carries no context.
pub fn call_span(
    name: &'static str,
    call: &crate::event::CallSpec,
    start_ms: u64,
    end_ms: u64,
    mut attributes: Vec<opentelemetry::KeyValue>,
) {
    use opentelemetry::KeyValue;
    use opentelemetry::trace::{Span as _, SpanKind, Tracer as _};
    let (Some(traceparent), true) = (&call.trace, ebb_proxy::trace::enabled()) else {
        return;
    };
    let parent = ebb_proxy::trace::parent_of(traceparent);
    let at = |ms: u64| std::time::UNIX_EPOCH + Duration::from_millis(ms);
    attributes.extend([
        KeyValue::new("messaging.system", "ebb"),
        KeyValue::new("messaging.message.id", call.id.clone()),
        KeyValue::new("messaging.destination.name", call.target.clone()),
    ]);
    let kind = if name == "call.queue" {
        SpanKind::Internal
    } else {
        attributes.push(KeyValue::new("messaging.operation.type", "process"));
        SpanKind::Consumer
    };
    let tracer = opentelemetry::global::tracer("ebb");
    let mut span = tracer
        .span_builder(name)
        .with_kind(kind)
        .with_start_time(at(start_ms))
        .with_attributes(attributes)
        .start_with_context(&tracer, &parent);
    span.end_with_timestamp(at(end_ms.max(start_ms)));
}

/// The SDK's batch processor behind ebb's bound, which counts what it drops: a span ended while
/// `max` are queued and not yet handed to the exporter is dropped here, so the batch
/// processor's queue (of the same size) never fills and every drop is counted.
#[derive(Debug)]
struct Bounded {
    inner: BatchSpanProcessor,
    queued: Arc<AtomicUsize>,
    max: usize,
}

impl SpanProcessor for Bounded {
    fn on_start(&self, span: &mut Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.queued.fetch_add(1, Ordering::AcqRel) >= self.max {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            QUEUE_FULL.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter on a runtime of its own (the batch processor calls it from its thread),
/// counting what it sent and what a failed export lost.
#[derive(Debug)]
struct Counting {
    inner: opentelemetry_otlp::SpanExporter,
    runtime: tokio::runtime::Runtime,
    /// Spans handed to the batch processor and not yet to this exporter ([`Bounded`]).
    queued: Arc<AtomicUsize>,
}

impl Counting {
    fn new(protocol: Protocol) -> Result<Counting> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ebb-otlp")
            .enable_all()
            .build()
            .context("starting the trace exporter's runtime")?;
        let inner = {
            // The gRPC channel's and the HTTP client's tasks run on this runtime.
            let _on = runtime.enter();
            match protocol {
                Protocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_protocol(opentelemetry_otlp::Protocol::Grpc)
                    .build(),
                Protocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .build(),
            }
            .context("setting up the OTLP trace exporter (OTEL_EXPORTER_OTLP_*)")?
        };
        Ok(Counting {
            inner,
            runtime,
            queued: Arc::new(AtomicUsize::new(0)),
        })
    }
}

impl SpanExporter for Counting {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let n = batch.len();
        self.queued.fetch_sub(n, Ordering::AcqRel);
        let result = self.runtime.block_on(self.inner.export(batch));
        let counter = if result.is_ok() {
            &EXPORTED
        } else {
            &EXPORT_FAILED
        };
        counter.fetch_add(n as u64, Ordering::Relaxed);
        std::future::ready(result)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(vars: &[(&str, &str)]) -> Result<Option<Settings>> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        settings(&|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn traces_are_on_when_an_endpoint_or_the_exporter_is_named() {
        assert_eq!(from(&[]).unwrap(), None);
        assert_eq!(
            from(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")]).unwrap(),
            Some(Settings {
                protocol: Protocol::HttpProtobuf,
                service_name: Some("ebb".into()),
                max_queue: 2048,
                sampler: Sampling {
                    parent_based: true,
                    ratio: 1.0,
                },
            })
        );
        let grpc = from(&[
            ("OTEL_TRACES_EXPORTER", "otlp"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_SERVICE_NAME", "edge"),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "64"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(grpc.protocol, Protocol::Grpc);
        assert_eq!(grpc.service_name, None);
        assert_eq!(grpc.max_queue, 64);
        // The traces' own protocol wins over the general one.
        let http = from(&[
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "http://127.0.0.1:4318/v1/traces",
            ),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(http.protocol, Protocol::HttpProtobuf);
        for off in [
            [
                ("OTEL_TRACES_EXPORTER", "none"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x:1"),
            ],
            [
                ("OTEL_SDK_DISABLED", "true"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x:1"),
            ],
        ] {
            assert_eq!(from(&off).unwrap(), None);
        }
    }

    #[test]
    fn settings_ebb_cannot_honour_are_refused_by_name() {
        let refused = |vars: &[(&str, &str)], name: &str| {
            let e = from(vars).unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        };
        refused(
            &[("OTEL_TRACES_EXPORTER", "zipkin")],
            "OTEL_TRACES_EXPORTER",
        );
        refused(
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x:1"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ],
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        );
        refused(
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x:1"),
                ("OTEL_BSP_MAX_QUEUE_SIZE", "0"),
            ],
            "OTEL_BSP_MAX_QUEUE_SIZE",
        );
        let on = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x:1");
        refused(
            &[on, ("OTEL_TRACES_SAMPLER", "jaeger_remote")],
            "OTEL_TRACES_SAMPLER",
        );
        for arg in ["1.5", "-0.1", "half"] {
            refused(
                &[
                    on,
                    ("OTEL_TRACES_SAMPLER", "traceidratio"),
                    ("OTEL_TRACES_SAMPLER_ARG", arg),
                ],
                "OTEL_TRACES_SAMPLER_ARG",
            );
        }
    }

    #[test]
    fn the_sampler_is_read_as_the_specification_names_it() {
        let on = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x:1");
        let sampling = |vars: &[(&str, &str)]| {
            let mut all = vec![on];
            all.extend_from_slice(vars);
            from(&all).unwrap().unwrap().sampler
        };
        let s = |parent_based, ratio| Sampling {
            parent_based,
            ratio,
        };
        assert_eq!(sampling(&[]), s(true, 1.0));
        assert_eq!(
            sampling(&[("OTEL_TRACES_SAMPLER", "always_off")]),
            s(false, 0.0)
        );
        assert_eq!(
            sampling(&[("OTEL_TRACES_SAMPLER", "parentbased_always_off")]),
            s(true, 0.0)
        );
        assert_eq!(
            sampling(&[
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.01"),
            ]),
            s(true, 0.01)
        );
        // The ratio's default is 1.
        assert_eq!(
            sampling(&[("OTEL_TRACES_SAMPLER", "traceidratio")]),
            s(false, 1.0)
        );
    }
}
