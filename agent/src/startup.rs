//! How far this process's unit agents have come in their start, step by
//! step: for each step, how many agents took it and when the last one did
//! (from the first call here). A start of 100,000 agents is otherwise one
//! figure; this says which step the time goes to — the deploy, the first
//! watch, the wait for the first pass's permit, the hooks and their
//! records, the status report. The controller logs it as it stops.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// A step of a unit agent's start, each taken once per agent, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartStep {
    /// Its deployer laid its directory and charm, and started it.
    Deployed = 0,
    /// Its first watch is subscribed.
    Watching = 1,
    /// Its first pass began (it had the permit, where passes are bounded).
    FirstPass = 2,
    /// The start hooks ran and their records were written.
    HooksRun = 3,
    /// It reported `started`.
    Reported = 4,
}

const STEPS: [(StartStep, &str); 5] = [
    (StartStep::Deployed, "deployed"),
    (StartStep::Watching, "watching"),
    (StartStep::FirstPass, "first_pass"),
    (StartStep::HooksRun, "hooks_run"),
    (StartStep::Reported, "reported"),
];

static EPOCH: OnceLock<Instant> = OnceLock::new();
static COUNT: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];
static LAST_MS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];

/// Starts the clock the steps are timed on (the controller calls it as it
/// starts; otherwise the first step starts it).
pub fn begin() {
    EPOCH.get_or_init(Instant::now);
}

/// One agent took `step`.
pub fn took(step: StartStep) {
    record(
        step,
        EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64,
    );
}

/// One agent took `step` `at_ms` after [`begin`].
fn record(step: StartStep, at_ms: u64) {
    COUNT[step as usize].fetch_add(1, Ordering::Relaxed);
    LAST_MS[step as usize].fetch_max(at_ms, Ordering::Relaxed);
}

/// `deployed=N@S ...`: each step's count and when its last was taken, in
/// seconds since [`begin`].
pub fn summary() -> String {
    STEPS
        .iter()
        .map(|&(s, name)| {
            format!(
                "{name}={}@{:.1}s",
                COUNT[s as usize].load(Ordering::Relaxed),
                LAST_MS[s as usize].load(Ordering::Relaxed) as f64 / 1000.0
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_count_and_keep_their_latest_time() {
        record(StartStep::HooksRun, 31_800);
        record(StartStep::HooksRun, 1_200);
        took(StartStep::HooksRun);
        let s = summary();
        let hooks = s
            .split_whitespace()
            .find_map(|w| w.strip_prefix("hooks_run="))
            .unwrap();
        let (n, at) = hooks.split_once('@').unwrap();
        assert_eq!(n, "3", "{s}");
        assert_eq!(at, "31.8s", "{s}");
    }
}
