//! An HTTP client for the tests, and one exchange through it, answer read whole.

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// The tests' client.
pub type Http = Client<HttpConnector, Full<Bytes>>;

/// A client with a connection pool of its own.
pub fn client() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

/// An HTTP/2 connection with prior knowledge (h2c) to `addr`, driven by a task of its own.
pub async fn h2c<B>(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<B>
where
    B: hyper::body::Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::handshake(
        TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    sender
}

/// An answer, read whole.
pub struct Answer {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: String,
}

impl Answer {
    /// A header's value ("" when absent).
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    }
}

/// `method target` sent to `to` with `Host: host` and `headers`, no body.
pub async fn send(
    c: &Http,
    to: SocketAddr,
    method: &str,
    host: &str,
    target: &str,
    headers: &[(&str, &str)],
) -> Answer {
    send_body(c, to, method, host, target, headers, Bytes::new()).await
}

/// `method target` with a JSON body, sent to `to` (Host: `localhost`).
pub async fn send_json(
    c: &Http,
    to: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> Answer {
    let mut with_type = vec![("content-type", "application/json")];
    with_type.extend_from_slice(headers);
    let body = Bytes::from(body.to_string());
    send_body(c, to, method, "localhost", target, &with_type, body).await
}

/// `method target` sent to `to` with `Host: host`, `headers` and `body`.
pub async fn send_body(
    c: &Http,
    to: SocketAddr,
    method: &str,
    host: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Answer {
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{to}{target}"))
        .header("host", host);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = c
        .request(req.body(Full::new(body)).unwrap())
        .await
        .expect("an answer");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// The value of the sample of ebb's `/metrics` at `admin` named `sample` (the metric's name with
/// its labels as written, e.g. `ebb_limit_refusals_total{limit="max_held"}`).
pub async fn sample(c: &Http, admin: SocketAddr, sample: &str) -> u64 {
    let r = send(c, admin, "GET", "localhost", "/metrics", &[]).await;
    r.body
        .lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {sample:?} in /metrics:\n{}", r.body))
        .trim()
        .parse()
        .unwrap()
}
