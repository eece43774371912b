//! Waiting pages through the real proxy: a browser's cold page load gets the route's page (503,
//! `Refresh`, `no-store`) while an API client's request is held and answered by the app; the
//! user's own template is filled in with the route and the wait its last start took; a real
//! headless Chromium sees the page and then the app's answer with no reload of its own.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common;

use common::controlplane::wait_until;
use common::http::{Answer, Http, client, send};

const LIMIT: Duration = Duration::from_secs(60);
const HTML: &str = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8";

fn config(dir: &Path) -> PathBuf {
    std::fs::write(
        dir.join("wait.html"),
        "<p>{{route}} wakes in {{expected_wait_s}} s ({{expected_wait}}); again in {{refresh_s}} s</p>",
    )
    .unwrap();
    let app = |name: &str, extra: &str| {
        format!(
            "[[app]]\nname = \"{name}\"\ndomains = [\"{name}.localhost\"]\ncommand = [\"ebb\", \"example-app\", \"--startup-delay-ms\", \"1500\"]\nstop_grace_ms = 1000\n{extra}\n"
        )
    };
    let text = [
        app("wait", "waiting_page = {}\nidle_after_ms = 60000"),
        app(
            "own",
            "waiting_page = { template_file = \"wait.html\", refresh_s = 2 }\nidle_after_ms = 300",
        ),
        app("plain", ""),
    ]
    .concat();
    let path = dir.join("ebb.toml");
    std::fs::write(&path, text).unwrap();
    path
}

async fn get(c: &Http, proxy: std::net::SocketAddr, host: &str, accept: &str) -> Answer {
    send(c, proxy, "GET", host, "/pid", &[("accept", accept)]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browsers_get_the_waiting_page_and_api_clients_are_held() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let ebb = common::serve(&data, Some(&config(dir.path())), None);
    let c = client();

    // A page load while the app is at zero: the built-in page, at once.
    let page = get(&c, ebb.proxy, "wait.localhost", HTML).await;
    assert_eq!(page.status, 503, "{}", page.body);
    assert_eq!(page.header("content-type"), "text/html; charset=utf-8");
    assert_eq!(page.header("refresh"), "1");
    assert_eq!(page.header("cache-control"), "no-store");
    assert!(!page.header("retry-after").is_empty());
    assert!(
        page.body.contains("<h1>wait is starting</h1>"),
        "{}",
        page.body
    );
    assert!(page.body.contains("a few seconds"), "{}", page.body);
    // An API client meanwhile is held and answered by the app; the page load woke it once.
    let api = get(&c, ebb.proxy, "wait.localhost", "application/json").await;
    assert_eq!(api.status, 200, "{}", api.body);
    let pid: u32 = api.body.trim().parse().unwrap();
    let again = get(&c, ebb.proxy, "wait.localhost", HTML).await;
    assert_eq!(
        (again.status, again.body.trim()),
        (200, pid.to_string().as_str())
    );
    let wakes = common::events(&data)
        .iter()
        .filter(|e| {
            e["event"]["ScaleRequested"]["deployment"] == "wait"
                && e["event"]["ScaleRequested"]["reason"] == "wake"
        })
        .count();
    assert_eq!(wakes, 1);

    // A route without a page holds page loads too.
    let plain = get(&c, ebb.proxy, "plain.localhost", HTML).await;
    assert_eq!(plain.status, 200, "{}", plain.body);

    // The user's template, filled in: no start seen yet, then the one its wake took.
    let first = get(&c, ebb.proxy, "own.localhost", HTML).await;
    assert_eq!((first.status, first.header("refresh")), (503, "2"));
    assert_eq!(
        first.body,
        "<p>own wakes in 0 s (a few seconds); again in 2 s</p>"
    );
    let api = get(&c, ebb.proxy, "own.localhost", "application/json").await;
    assert_eq!(api.status, 200);
    let pid: u32 = api.body.trim().parse().unwrap();
    wait_until("own goes idle and stops", LIMIT, || async {
        (!common::alive(pid)).then_some(())
    })
    .await;
    let second = wait_until("own answers with its page again", LIMIT, || async {
        let a = get(&c, ebb.proxy, "own.localhost", HTML).await;
        (a.status == 503).then_some(a)
    })
    .await;
    let secs: u64 = second
        .body
        .strip_prefix("<p>own wakes in ")
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{}", second.body));
    assert!(secs >= 2, "the app takes 1.5 s to start: {}", second.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_browser_sees_the_waiting_page_then_the_app_without_a_reload() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = common::serve(&dir.path().join("data"), Some(&config(dir.path())), None);
    // Chromium resolves every *.localhost name to loopback itself.
    let url = format!("http://wait.localhost:{}/pid", ebb.proxy.port());
    common::browser_test(
        "waiting",
        vec![("EBB_APP_URL", url), ("EBB_ROUTE", "wait".to_owned())],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_are_checked_in_the_config_and_the_admin_api() {
    let dir = tempfile::tempdir().unwrap();
    for (page, want) in [
        ("{ template_file = \"missing.html\" }", "missing.html"),
        ("{ template = \"\" }", "the template is empty"),
        ("{ refresh_s = 600 }", "refresh_s 600 is above 60"),
        ("{ colour = \"blue\" }", "unknown field"),
    ] {
        let path = dir.path().join("ebb.toml");
        std::fs::write(
            &path,
            format!("[[app]]\nname = \"x\"\ndomains = [\"x.localhost\"]\ncommand = [\"ebb\", \"example-app\"]\nwaiting_page = {page}\n"),
        )
        .unwrap();
        let err = common::serve_refused(
            &dir.path().join("data"),
            ["--config".as_ref(), path.as_os_str()],
        );
        assert!(err.contains(want), "{page}: {err}");
    }

    let token = "waiting-admin";
    let ebb = common::serve(&dir.path().join("api"), None, Some(token));
    let c = client();
    let auth = format!("Bearer {token}");
    let put = |page: serde_json::Value| {
        let (c, auth, admin) = (c.clone(), auth.clone(), ebb.admin);
        async move {
            let body = serde_json::json!({
                "domains": ["shop.localhost"],
                "command": ["ebb", "example-app"],
                "waiting_page": page,
            });
            common::http::send_json(
                &c,
                admin,
                "PUT",
                "/admin/routes/shop",
                &[("authorization", auth.as_str())],
                &body,
            )
            .await
        }
    };
    let ok = put(serde_json::json!({"template": "<p>{{route}}</p>", "refresh_s": 5})).await;
    assert!(ok.status == 200 || ok.status == 201, "{}", ok.body);
    let shown = send(
        &c,
        ebb.admin,
        "GET",
        "localhost",
        "/admin/routes/shop",
        &[("authorization", auth.as_str())],
    )
    .await;
    let v: serde_json::Value = serde_json::from_str(&shown.body).unwrap();
    assert_eq!(
        v["route"]["waiting_page"]["template"], "<p>{{route}}</p>",
        "{v}"
    );
    let page = get(&c, ebb.proxy, "shop.localhost", HTML).await;
    assert_eq!((page.status, page.body.as_str()), (503, "<p>shop</p>"));
    let bad = put(serde_json::json!({"template_file": "/etc/passwd"})).await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    let v: serde_json::Value = serde_json::from_str(&bad.body).unwrap();
    assert_eq!(v["code"], "bad_request");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("template_file is for ebb.toml"),
        "{v}"
    );
}
