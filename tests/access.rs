//! Each of ebb's APIs takes its own token: a token opens its API and no other (a runner's token
//! cannot change a route, the dashboard's reads and changes nothing), a missing or wrong one is a
//! 401 in JSON, an API without a token is disabled (403), and no token is ever logged.

use crate::common;

use common::http::{client, send, send_body};
use serde_json::Value;

const TOKENS: [(&str, &str); 4] = [
    ("admin", "admin-0123456789"),
    ("runner", "runner-0123456789"),
    ("functions", "fn-0123456789"),
    ("dashboard", "dash-0123456789"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_token_opens_its_own_api_and_no_other() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("ebb.log");
    let ebb = common::serve_logged(
        &dir.path().join("data"),
        None,
        Some(TOKENS[0].1),
        &[
            "--runner-token",
            TOKENS[1].1,
            "--api-token",
            TOKENS[2].1,
            "--dashboard-token",
            TOKENS[3].1,
        ],
        &[("EBB_LOG", std::ffi::OsStr::new("debug"))],
        Some(&log),
    );
    let c = client();
    // One request of each API, and the token it takes.
    let route = r#"{"domains": ["x.localhost"], "command": ["ebb", "example-app"]}"#;
    let apis: [(&str, &str, &str, &str); 4] = [
        ("admin", "PUT", "/admin/routes/x", route),
        ("runner", "POST", "/runner/dequeue", r#"{"runner": "r1"}"#),
        ("functions", "GET", "/api/funcs/template", ""),
        ("dashboard", "GET", "/ui/api/overview", ""),
    ];
    for (api, method, path, body) in apis {
        for (owner, token) in TOKENS {
            let auth = format!("Bearer {token}");
            let r = send_body(
                &c,
                ebb.admin,
                method,
                "localhost",
                path,
                &[
                    ("authorization", &auth),
                    ("content-type", "application/json"),
                ],
                bytes::Bytes::from(body),
            )
            .await;
            if owner == api {
                assert!(
                    r.status < 300,
                    "{api} takes its own token: {} {}",
                    r.status,
                    r.body
                );
            } else {
                assert_eq!(r.status, 401, "{api} refuses the {owner} token: {}", r.body);
                let v: Value = serde_json::from_str(&r.body).unwrap();
                assert_eq!(v["code"], "unauthorized");
            }
        }
        let r = send(&c, ebb.admin, method, "localhost", path, &[]).await;
        assert_eq!(r.status, 401, "{api} without a token");
    }
    // The dashboard signs in with its token and not with the runner's.
    for (token, status) in [(TOKENS[3].1, 204), (TOKENS[1].1, 401)] {
        let r = send_body(
            &c,
            ebb.admin,
            "POST",
            "localhost",
            "/ui/login",
            &[("content-type", "application/json")],
            bytes::Bytes::from(format!(r#"{{"token": "{token}"}}"#)),
        )
        .await;
        assert_eq!(r.status, status, "{}", r.body);
    }
    drop(ebb);
    let text = std::fs::read_to_string(&log).unwrap();
    for (_, token) in TOKENS {
        assert!(!text.contains(token), "a token was logged");
    }

    // Without their tokens, the APIs are disabled.
    let dir = tempfile::tempdir().unwrap();
    let ebb = common::serve(&dir.path().join("data"), None, None);
    for (code, path) in [
        ("admin_disabled", "/admin/routes"),
        ("runner_disabled", "/v1/calls"),
        ("functions_disabled", "/api/funcs/template"),
        ("dashboard_disabled", "/ui/api/overview"),
    ] {
        let r = send(
            &c,
            ebb.admin,
            "GET",
            "localhost",
            path,
            &[("authorization", "Bearer x")],
        )
        .await;
        assert_eq!(r.status, 403, "{path}: {}", r.body);
        let v: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["code"], code, "{path}");
    }

    // Kubernetes' tokens need Kubernetes.
    let err = common::serve_refused(&dir.path().join("other"), ["--kube-auth"]);
    assert!(
        err.contains("--kube-auth") && err.contains("--orchestrator kubernetes"),
        "{err}"
    );
}
