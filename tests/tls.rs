//! TLS on a real `ebb serve`: the proxy (HTTP/1.1 and h2 by ALPN) and ebb's own endpoints serve
//! certificates made here with openssl; a renewed certificate written over the files is served
//! without a restart; a broken pair leaves the last good one in use; a bad pair at start stops
//! ebb with a clear message.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

const DEADLINE: Duration = Duration::from_secs(30);

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA (ca.pem) and a certificate it signs for localhost, edge.localhost and 127.0.0.1, with
/// serial `serial`, written as `NAME.pem` and `NAME.key`.
fn issue(dir: &Path, name: &str, serial: u32) -> (PathBuf, PathBuf) {
    if !dir.join("ca.pem").exists() {
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=ebb test CA",
            ],
        );
        std::fs::write(
            dir.join("san.ext"),
            "subjectAltName=DNS:localhost,DNS:edge.localhost,IP:127.0.0.1\n",
        )
        .unwrap();
    }
    let (key, csr, pem) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.pem"),
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            "/CN=localhost",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-set_serial",
            &serial.to_string(),
            "-days",
            "2",
            "-out",
            &pem,
            "-extfile",
            "san.ext",
        ],
    );
    (dir.join(pem), dir.join(key))
}

fn connector(dir: &Path, alpn: &[&[u8]]) -> TlsConnector {
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(dir.join("ca.pem")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    // Every handshake a full one: a resumed session shows the certificate it began with.
    config.resumption = rustls::client::Resumption::disabled();
    TlsConnector::from(Arc::new(config))
}

/// One HTTP/1.1 request over TLS: the answer's status line and body, and the server's
/// certificate.
async fn get(
    tls: &TlsConnector,
    addr: std::net::SocketAddr,
    name: &str,
    host: &str,
    path: &str,
    auth: Option<&str>,
) -> (String, String, Vec<u8>) {
    let auth = auth
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let (text, cert) = exchange(
        tls,
        addr,
        name,
        &format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n"),
    )
    .await;
    let status = text.lines().next().unwrap_or_default().to_owned();
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body, cert)
}

/// Sends `request` over TLS to `addr` (server name `name`); returns all the server answered
/// until it closed, and its certificate.
async fn exchange(
    tls: &TlsConnector,
    addr: std::net::SocketAddr,
    name: &str,
    request: &str,
) -> (String, Vec<u8>) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut s = tls
        .connect(ServerName::try_from(name.to_owned()).unwrap(), tcp)
        .await
        .unwrap();
    let cert = s.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(DEADLINE, s.read_to_end(&mut out))
        .await
        .expect("an answer in time")
        .ok();
    (String::from_utf8_lossy(&out).into_owned(), cert)
}

fn der(pem: &Path) -> Vec<u8> {
    CertificateDer::from_pem_file(pem).unwrap().to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_and_apis_serve_tls_and_reload_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).unwrap();
    let (cert, key) = issue(&certs, "one", 1);
    let config = dir.path().join("ebb.toml");
    std::fs::write(
        &config,
        "[[app]]\nname = \"edge\"\ndomains = [\"edge.localhost\"]\n\
         command = [\"ebb\", \"example-app\"]\nidle_after_ms = 60000\n",
    )
    .unwrap();
    let (c, k) = (cert.to_str().unwrap(), key.to_str().unwrap());
    let log = dir.path().join("ebb.log");
    let ebb = common::serve_logged(
        &dir.path().join("data"),
        Some(&config),
        Some("admin-secret"),
        &[
            "--tls-cert",
            c,
            "--tls-key",
            k,
            "--admin-tls-cert",
            c,
            "--admin-tls-key",
            k,
        ],
        &[],
        Some(&log),
    );
    let h1 = connector(&certs, &[b"http/1.1"]);

    // The proxy over TLS, woken from zero; the app is told the request came over https.
    let (status, body, served) = get(
        &h1,
        ebb.proxy,
        "edge.localhost",
        "edge.localhost",
        "/headers",
        None,
    )
    .await;
    assert!(status.contains(" 200 "), "{status}: {body}");
    assert_eq!(served, der(&cert));
    assert!(
        body.to_ascii_lowercase()
            .contains("x-forwarded-proto: https\n"),
        "{body}"
    );
    // ebb's own endpoints over TLS.
    let (status, body, _) = get(
        &h1,
        ebb.admin,
        "localhost",
        "localhost",
        "/admin/routes",
        Some("admin-secret"),
    )
    .await;
    assert!(status.contains(" 200 "), "{status}: {body}");
    // The dashboard's session cookie is Secure over TLS.
    let body = r#"{"token":"admin-secret"}"#;
    let (text, _) = exchange(
        &h1,
        ebb.admin,
        "localhost",
        &format!(
            "POST /ui/login HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    )
    .await;
    let text = text.to_ascii_lowercase();
    let cookie = text
        .lines()
        .find(|l| l.starts_with("set-cookie: ebb_session="))
        .unwrap_or_else(|| panic!("no session cookie: {text}"));
    assert!(cookie.contains("; secure"), "{cookie}");

    // h2 by ALPN through the proxy.
    let h2 = connector(&certs, &[b"h2"]);
    let tcp = tokio::net::TcpStream::connect(ebb.proxy).await.unwrap();
    let tls = h2
        .connect(ServerName::try_from("edge.localhost").unwrap(), tcp)
        .await
        .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::get("https://edge.localhost/pid")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let pid = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(!pid.is_empty());

    // A renewed certificate written over the files is served without a restart.
    let (next, next_key) = issue(&certs, "two", 2);
    std::fs::copy(&next_key, certs.join("one.key.new")).unwrap();
    std::fs::copy(&next, certs.join("one.pem.new")).unwrap();
    std::fs::rename(certs.join("one.key.new"), &key).unwrap();
    std::fs::rename(certs.join("one.pem.new"), &cert).unwrap();
    let renewed = der(&next);
    for addr in [ebb.proxy, ebb.admin] {
        common::controlplane::wait_until("the renewed certificate", DEADLINE, || {
            let h1 = h1.clone();
            let renewed = renewed.clone();
            async move {
                let (_, _, served) =
                    get(&h1, addr, "localhost", "edge.localhost", "/pid", None).await;
                (served == renewed).then_some(())
            }
        })
        .await;
    }

    // A key that does not match its certificate: the last good pair stays in use.
    let (_, other_key) = issue(&certs, "three", 3);
    std::fs::copy(&other_key, &key).unwrap();
    common::controlplane::wait_until("the broken pair is refused", DEADLINE, || async {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        (text.matches("TLS certificate not reloaded").count() >= 2).then_some(())
    })
    .await;
    for addr in [ebb.proxy, ebb.admin] {
        let (status, _, served) =
            get(&h1, addr, "edge.localhost", "edge.localhost", "/pid", None).await;
        assert!(!status.is_empty());
        assert_eq!(served, renewed, "the last good pair is still served");
    }
}

#[test]
fn a_bad_pair_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, _) = issue(dir.path(), "one", 1);
    let (_, other_key) = issue(dir.path(), "two", 2);
    let tls = [
        "--tls-cert".as_ref(),
        cert.as_os_str(),
        "--tls-key".as_ref(),
        other_key.as_os_str(),
    ];
    let err = common::serve_refused(&dir.path().join("data"), tls);
    assert!(err.contains("proxy TLS"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_ebb"))
        .args(["serve", "--tls-cert"])
        .arg(&cert)
        .output()
        .unwrap();
    assert!(!out.status.success(), "--tls-cert wants --tls-key");
}
