//! Keep-warm windows as they are written (`ebb.toml`, the admin API, annotations, function
//! templates) and the checks that make them the log's [`WarmWindow`]s (at most
//! [`MAX_WARM_WINDOWS`] a route, each at most [`MAX_WARM_MS`] long, none asking for more than the
//! route's `max_replicas`). Whether a window is open at a time is [`crate::timing`]'s and the
//! scaler's.
//!
//! How the windows act: whether one is open is a pure function of its schedule, time zone, length
//! and the time ([`crate::state::routes::warm_wanted`]), so every idle decision reads the floor
//! from the time itself ([`crate::scaler::floor`]): no replica can scale below an open window
//! because it has not logged the window's start yet. The log records each start, renewal and end
//! (`WarmStarted`, `WarmEnded`) for the story and for the schedule heap (`Due::RouteWarm`, the
//! next edge, recomputed by `apply`); [`crate::scaler::decide_warm`] makes the log agree with the
//! windows open now and asks for the floor. The simulator's `keep-warm` scenario
//! (`crates/sim/src/warm.rs`) checks, tick by tick across crashes with torn writes, that the
//! record is what is open, the floor holds and nothing scales down under a request in flight.

use serde::Deserialize;

use crate::event::WarmWindow;

/// A keep-warm window as written in `ebb.toml`, the admin API, annotations and function templates.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct WarmConfig {
    /// When the window opens: cron, 5 fields or 6 with seconds first.
    pub schedule: String,
    /// How long it stays open: `10h`, `90m`, `1h30m`, `30s`.
    #[serde(rename = "for")]
    pub open_for: String,
    /// Replicas kept while it is open.
    #[serde(default = "default_warm_min")]
    pub min: u32,
    /// The IANA time zone the schedule is read in (absent: UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
}

fn default_warm_min() -> u32 {
    1
}

/// Keep-warm windows one route may have.
pub const MAX_WARM_WINDOWS: usize = 16;

/// The longest a keep-warm window may stay open: a year and a day.
pub const MAX_WARM_MS: u64 = 366 * 24 * 3_600_000;

impl WarmConfig {
    /// How a window is written: its time open in the largest unit that is whole.
    pub fn from_window(w: &WarmWindow) -> Self {
        let ms = w.for_ms;
        let open_for = if ms > 0 && ms.is_multiple_of(3_600_000) {
            format!("{}h", ms / 3_600_000)
        } else if ms > 0 && ms.is_multiple_of(60_000) {
            format!("{}m", ms / 60_000)
        } else if ms.is_multiple_of(1_000) {
            format!("{}s", ms / 1_000)
        } else {
            format!("{ms}ms")
        };
        Self {
            schedule: w.schedule.clone(),
            open_for,
            min: w.min,
            timezone: w.timezone.clone(),
        }
    }

    /// The window, checked (see [`check_warm`]).
    pub fn window(&self) -> Result<WarmWindow, String> {
        let for_ms = crate::timing::parse_duration(&self.open_for)
            .map_err(|e| format!("warm window {:?}: for: {e}", self.schedule))?;
        Ok(WarmWindow {
            schedule: self.schedule.trim().to_owned(),
            for_ms,
            min: self.min,
            timezone: self.timezone.clone(),
        })
    }
}

/// Turns windows as written into checked ones for a route of at most `max_replicas`.
pub fn warm_windows(written: &[WarmConfig], max_replicas: u32) -> Result<Vec<WarmWindow>, String> {
    let windows = written
        .iter()
        .map(WarmConfig::window)
        .collect::<Result<Vec<_>, _>>()?;
    check_warm(&windows, max_replicas)?;
    Ok(windows)
}

/// A route's keep-warm windows can be kept: at most [`MAX_WARM_WINDOWS`], each with a cron
/// schedule, a known time zone, an open time of 1 s to a year, and a `min` of 1 to `max_replicas`.
pub fn check_warm(windows: &[WarmWindow], max_replicas: u32) -> Result<(), String> {
    if windows.len() > MAX_WARM_WINDOWS {
        return Err(format!(
            "{} keep-warm windows; at most {MAX_WARM_WINDOWS}",
            windows.len()
        ));
    }
    for w in windows {
        crate::timing::parse_schedule(&w.schedule).map_err(|e| format!("warm window: {e}"))?;
        if let Some(tz) = &w.timezone {
            crate::timing::parse_timezone(tz)
                .map_err(|e| format!("warm window {:?}: {e}", w.schedule))?;
        }
        if !(1_000..=MAX_WARM_MS).contains(&w.for_ms) {
            return Err(format!(
                "warm window {:?}: it must stay open between 1s and 366d (for)",
                w.schedule
            ));
        }
        if w.min == 0 || w.min > max_replicas {
            return Err(format!(
                "warm window {:?}: min {} must be between 1 and max_replicas ({max_replicas})",
                w.schedule, w.min
            ));
        }
    }
    Ok(())
}
