//! The timing rules of the pure core: when a cron schedule fires ([`next_firing`],
//! [`last_firing`]; croner, whole seconds, UTC or a named time zone), which keep-warm window
//! occurrence covers a time ([`window_covering`]), and when a cleaner whose conditions are
//! monotonic in time will first hold ([`earliest_true`]: a binary search over
//! [`SEARCH_HORIZON_MS`] down to [`SEARCH_PRECISION_MS`]). The projections call these, not
//! `functions`. No IO and no clock: every function takes the time it reasons about, so the
//! projections and the simulator get the same answers.

/// Parses a cron schedule: 5 fields (minute hour day-of-month month day-of-week) or 6 with
/// seconds first, as croner (the parser tokio-cron-scheduler uses) reads them, in UTC.
pub fn parse_schedule(s: &str) -> Result<croner::Cron, String> {
    croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Optional)
        .dom_and_dow(true)
        .build()
        .parse(s)
        .map_err(|e| format!("schedule {s:?} is not a cron expression: {e}"))
}

/// Schedules parsed lately, per thread: keep-warm floors are read on every idle check, and a
/// cron expression is parsed once, not each time. Bounded: cleared past [`PARSED_MAX`].
const PARSED_MAX: usize = 256;

thread_local! {
    static PARSED: std::cell::RefCell<std::collections::HashMap<String, Option<croner::Cron>>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// [`parse_schedule`], remembered (a bad schedule as `None`).
fn parsed(s: &str) -> Option<croner::Cron> {
    PARSED.with(|m| {
        let mut m = m.borrow_mut();
        if let Some(c) = m.get(s) {
            return c.clone();
        }
        if m.len() >= PARSED_MAX {
            m.clear();
        }
        let c = parse_schedule(s).ok();
        m.insert(s.to_owned(), c.clone());
        c
    })
}

/// The whole second `ms` falls in, as a UTC time (cron has no finer unit).
fn utc(ms: u64) -> Option<chrono::DateTime<chrono::Utc>> {
    chrono::DateTime::from_timestamp_millis(i64::try_from(ms / 1_000 * 1_000).ok()?)
}

/// The first occurrence of `schedule` strictly after `after_ms` (pure: same input, same answer).
pub fn next_firing(schedule: &str, after_ms: u64) -> Option<u64> {
    let cron = parsed(schedule)?;
    let t = cron.find_next_occurrence(&utc(after_ms)?, false).ok()?;
    u64::try_from(t.timestamp_millis()).ok()
}

/// The latest occurrence of `schedule` at or before `now_ms`.
pub fn last_firing(schedule: &str, now_ms: u64) -> Option<u64> {
    let cron = parsed(schedule)?;
    let t = cron.find_previous_occurrence(&utc(now_ms)?, true).ok()?;
    u64::try_from(t.timestamp_millis()).ok()
}

/// A named time zone (`Europe/Paris`, `America/New_York`, `UTC`), from the IANA database that
/// ebb carries (chrono-tz): no file of the machine's is read, so every replica agrees.
pub fn parse_timezone(name: &str) -> Result<chrono_tz::Tz, String> {
    name.parse::<chrono_tz::Tz>().map_err(|_| {
        format!("time zone {name:?} is not an IANA time zone name (e.g. Europe/Paris)")
    })
}

/// The first occurrence of `schedule`, read in time zone `tz` (none: UTC), strictly after
/// `after_ms`.
pub fn next_firing_in(schedule: &str, tz: Option<&str>, after_ms: u64) -> Option<u64> {
    let Some(tz) = tz else {
        return next_firing(schedule, after_ms);
    };
    let (cron, tz) = (parsed(schedule)?, parse_timezone(tz).ok()?);
    let t = cron
        .find_next_occurrence(&utc(after_ms)?.with_timezone(&tz), false)
        .ok()?;
    u64::try_from(t.timestamp_millis()).ok()
}

/// The latest occurrence of `schedule`, read in time zone `tz` (none: UTC), at or before `now_ms`.
pub fn last_firing_in(schedule: &str, tz: Option<&str>, now_ms: u64) -> Option<u64> {
    let Some(tz) = tz else {
        return last_firing(schedule, now_ms);
    };
    let (cron, tz) = (parsed(schedule)?, parse_timezone(tz).ok()?);
    let t = cron
        .find_previous_occurrence(&utc(now_ms)?.with_timezone(&tz), true)
        .ok()?;
    u64::try_from(t.timestamp_millis()).ok()
}

/// The occurrence whose window of `for_ms` covers `now_ms`: the latest occurrence at or before
/// `now_ms`, if `now_ms` is before its end. A window longer than the schedule's period is covered
/// by its latest occurrence, so consecutive windows join into one.
pub fn window_covering(schedule: &str, tz: Option<&str>, for_ms: u64, now_ms: u64) -> Option<u64> {
    let start = last_firing_in(schedule, tz, now_ms)?;
    (now_ms < start.saturating_add(for_ms)).then_some(start)
}

/// How far ahead the search for a monotonic condition's first true time looks: a year and a day.
/// A condition still false then is evaluated again after its retry period.
pub const SEARCH_HORIZON_MS: u64 = 366 * 24 * 3_600_000;

/// The search's precision: the time it finds is at most this much after the true earliest one
/// (never before it). 26 evaluations cover the horizon.
pub const SEARCH_PRECISION_MS: u64 = 1_000;

/// What a search for the first true time found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    /// The earliest time the condition was seen to hold, within the precision; `None` when it
    /// does not hold at the end of the horizon.
    pub at_ms: Option<u64>,
    /// Evaluations the search made: at most `1 + ceil(log2(horizon / precision))`.
    pub evaluations: u32,
}

/// Searches `(from_ms, from_ms + horizon_ms]` for the earliest time at which `holds` is true,
/// for a `holds` that is monotonic in time (false, then true for ever) and false at `from_ms`.
/// The answer is within `precision_ms` after the true earliest time and never before it, found
/// with O(log(horizon / precision)) evaluations. An evaluation's error ends the search.
pub fn earliest_true<E>(
    from_ms: u64,
    horizon_ms: u64,
    precision_ms: u64,
    mut holds: impl FnMut(u64) -> Result<bool, E>,
) -> Result<Found, E> {
    let precision = precision_ms.max(1);
    let mut lo = from_ms;
    let mut hi = from_ms.saturating_add(horizon_ms.max(1));
    let mut evaluations = 1;
    if !holds(hi)? {
        return Ok(Found {
            at_ms: None,
            evaluations,
        });
    }
    // Invariant: false at `lo`, true at `hi`.
    while hi - lo > precision {
        let mid = lo + (hi - lo) / 2;
        evaluations += 1;
        if holds(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(Found {
        at_ms: Some(hi),
        evaluations,
    })
}

/// The most evaluations [`earliest_true`] makes over `horizon_ms` at `precision_ms`.
pub fn search_bound(horizon_ms: u64, precision_ms: u64) -> u32 {
    let steps = horizon_ms.max(1).div_ceil(precision_ms.max(1));
    1 + u64::BITS - steps.saturating_sub(1).leading_zeros()
}

/// Parses a duration: one or more `<number><unit>` with units `ms`, `s`, `m`, `h` and `d`, as Go
/// writes them (`360h`, `1h30m`, `1.5h`) plus days.
pub fn parse_duration(s: &str) -> Result<u64, String> {
    let bad = |why: &str| format!("duration {s:?} {why} (write it as 360h, 90m, 1h30m or 7d)");
    let t = s.trim();
    if t.is_empty() {
        return Err(bad("is empty"));
    }
    if t == "0" {
        return Ok(0);
    }
    let mut rest = t;
    let mut total: f64 = 0.0;
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| bad("has a number without a unit"))?;
        if num_end == 0 {
            return Err(bad("does not start with a number"));
        }
        let n: f64 = rest[..num_end]
            .parse()
            .map_err(|_| bad("has a malformed number"))?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let ms = match &rest[..unit_end] {
            "ms" => 1.0,
            "s" => 1_000.0,
            "m" => 60_000.0,
            "h" => 3_600_000.0,
            "d" => 86_400_000.0,
            other => return Err(bad(&format!("has an unknown unit {other:?}"))),
        };
        total += n * ms;
        rest = &rest[unit_end..];
    }
    // Ten thousand years is more than any TTL means.
    if !total.is_finite() || total > 3.2e14 {
        return Err(bad("is too long"));
    }
    Ok(total.round() as u64)
}

/// A time (ms since the epoch) as Kubernetes writes one: RFC 3339 in UTC, whole seconds.
pub fn kube_time(ms: i64) -> Option<String> {
    chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
}

/// A duration for people: `17 ms`, `1.5 s`, `300 s`, `12 min`, `3 h`.
pub fn human_duration(ms: u64) -> String {
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..10_000 => {
            let s = ms as f64 / 1000.0;
            if ms.is_multiple_of(1000) {
                format!("{} s", ms / 1000)
            } else {
                format!("{s:.1} s")
            }
        }
        10_000..600_000 => format!("{} s", ms / 1000),
        600_000..10_800_000 => format!("{} min", ms / 60_000),
        _ => format!("{} h", ms / 3_600_000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;

    #[test]
    fn the_search_finds_the_first_true_time_within_the_precision_in_log_steps() {
        let horizon = SEARCH_HORIZON_MS;
        let bound = search_bound(horizon, SEARCH_PRECISION_MS);
        assert_eq!(bound, 26);
        for truth in [
            1,
            999,
            1_000,
            1_001,
            86_400_000,
            3_600_000 * 360 + 17,
            horizon,
        ] {
            let from = 1_700_000_000_000;
            let found = earliest_true(from, horizon, SEARCH_PRECISION_MS, |t| {
                Ok::<_, Infallible>(t >= from + truth)
            })
            .unwrap();
            let at = found.at_ms.expect("true inside the horizon");
            assert!(at >= from + truth, "never before the true time");
            assert!(
                at - (from + truth) <= SEARCH_PRECISION_MS,
                "within the precision"
            );
            assert!(
                found.evaluations <= bound,
                "{} > {bound}",
                found.evaluations
            );
        }
        let never = earliest_true(0, horizon, SEARCH_PRECISION_MS, |_| {
            Ok::<_, Infallible>(false)
        })
        .unwrap();
        assert_eq!(
            never,
            Found {
                at_ms: None,
                evaluations: 1
            }
        );
    }

    #[test]
    fn an_error_ends_the_search() {
        let mut n = 0;
        let r = earliest_true(0, 1_000_000, 1, |t| {
            n += 1;
            if n == 3 { Err("boom") } else { Ok(t > 10) }
        });
        assert_eq!(r, Err("boom"));
        assert_eq!(n, 3);
    }
}
