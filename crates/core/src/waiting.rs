//! Waiting pages: a browser's cold request gets a page that reloads itself until the workload is
//! ready, instead of a connection that hangs (Sablier's dynamic strategy, KEDA's cold-start
//! placeholder). API clients are held as ever: only a `GET` whose `Accept` names `text/html` gets
//! the page ([`wanted`]).
//!
//! The proxy answers such a request, for a route that has a page and no ready replica, with the
//! page ([`render`]: a 503 with `Refresh`, every [`refresh_s`] seconds) after starting the wake,
//! instead of holding it. A route's own template is checked when the route is ([`check`]), at
//! most [`MAX_TEMPLATE_BYTES`], since it travels in every `RouteUpserted`.

use crate::event::WaitingPage;

/// The largest template a route may carry (a template is in every `RouteUpserted`).
pub const MAX_TEMPLATE_BYTES: usize = 64 * 1024;

/// ebb's own page: no script, nothing fetched from elsewhere, readable by screen readers (its
/// status is announced politely), still for those who prefer reduced motion.
pub const BUILT_IN: &str = r#"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="refresh" content="{{refresh_s}}">
<title>{{route}} is starting</title>
<style>
  :root { color-scheme: light dark; font-family: system-ui, sans-serif; }
  body { margin: 0; min-height: 100vh; display: grid; place-items: center; }
  main { text-align: center; padding: 2rem; max-width: 32rem; }
  .dot { display: inline-block; width: .8rem; height: .8rem; margin: 0 .2rem; border-radius: 50%;
         background: currentColor; opacity: .3; animation: pulse 1.2s infinite ease-in-out; }
  .dot:nth-child(2) { animation-delay: .2s; } .dot:nth-child(3) { animation-delay: .4s; }
  @keyframes pulse { 50% { opacity: 1; } }
  @media (prefers-reduced-motion: reduce) { .dot { animation: none; opacity: .6; } }
</style>
</head>
<body>
<main>
<h1>{{route}} is starting</h1>
<p role="status" aria-live="polite">It was idle and is waking up. This usually takes {{expected_wait}}; this page reloads by itself every {{refresh_s}} s.</p>
<p aria-hidden="true"><span class="dot"></span><span class="dot"></span><span class="dot"></span></p>
</main>
</body>
</html>
"#;

/// Whether a request is a browser's page load: a `GET` accepting `text/html`.
pub fn wanted(method: &[u8], accept: Option<&[u8]>) -> bool {
    method == b"GET"
        && accept.is_some_and(|a| a.windows(9).any(|w| w.eq_ignore_ascii_case(b"text/html")))
}

/// Seconds between reloads.
pub fn refresh_s(page: &WaitingPage) -> u32 {
    page.refresh_s.max(1)
}

/// The page for `route`, whose last start from zero took `cold_start_ms` (0: not known).
pub fn render(page: &WaitingPage, route: &str, cold_start_ms: u64) -> String {
    let template = page.template.as_deref().unwrap_or(BUILT_IN);
    let expected = if cold_start_ms == 0 {
        "a few seconds".to_owned()
    } else {
        format!(
            "about {}",
            crate::timing::human_duration(cold_start_ms.max(1_000))
        )
    };
    template
        .replace("{{route}}", &escape(route))
        .replace("{{expected_wait}}", &escape(&expected))
        .replace(
            "{{expected_wait_s}}",
            &cold_start_ms.div_ceil(1_000).to_string(),
        )
        .replace("{{refresh_s}}", &refresh_s(page).to_string())
}

/// Checks a route's page: a template of at most [`MAX_TEMPLATE_BYTES`], a refresh of 1 to 60 s.
pub fn check(page: &WaitingPage) -> Result<(), String> {
    if let Some(t) = &page.template {
        if t.len() > MAX_TEMPLATE_BYTES {
            return Err(format!(
                "waiting page: the template has {} bytes; at most {MAX_TEMPLATE_BYTES}",
                t.len()
            ));
        }
        if t.trim().is_empty() {
            return Err("waiting page: the template is empty".into());
        }
    }
    if page.refresh_s > 60 {
        return Err(format!(
            "waiting page: refresh_s {} is above 60",
            page.refresh_s
        ));
    }
    Ok(())
}

/// `text` with HTML's special characters escaped.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_page_loads_of_browsers_get_the_page() {
        let html = Some(&b"text/html,application/xhtml+xml,*/*;q=0.8"[..]);
        assert!(wanted(b"GET", html));
        assert!(wanted(b"GET", Some(b"TEXT/HTML")));
        assert!(!wanted(b"HEAD", html));
        assert!(!wanted(b"POST", html));
        assert!(!wanted(b"GET", Some(b"application/json")));
        assert!(!wanted(b"GET", Some(b"*/*")));
        assert!(!wanted(b"GET", None));
    }

    #[test]
    fn the_page_is_filled_in_and_escaped() {
        let built_in = WaitingPage::default();
        let page = render(&built_in, "ns/<shop>", 2_400);
        assert!(page.contains("ns/&lt;shop&gt; is starting"), "{page}");
        assert!(page.contains("about 2.4 s"), "{page}");
        assert!(page.contains(r#"content="1""#), "{page}");
        let own = WaitingPage {
            template: Some(
                "<p>{{route}} in {{expected_wait_s}} s, again in {{refresh_s}}</p>".into(),
            ),
            refresh_s: 3,
        };
        assert_eq!(
            render(&own, "a&b", 2_400),
            "<p>a&amp;b in 3 s, again in 3</p>"
        );
        assert_eq!(render(&own, "a", 0), "<p>a in 0 s, again in 3</p>");
        assert!(check(&own).is_ok());
        let huge = WaitingPage {
            template: Some("x".repeat(MAX_TEMPLATE_BYTES + 1)),
            refresh_s: 0,
        };
        assert!(check(&huge).unwrap_err().contains("at most"));
    }
}
