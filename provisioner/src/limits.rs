//! What paces the provisioner: the controller-wide limit on start requests
//! in flight ([`Slots`], `provisioner-concurrency`), and the clock that
//! stray grace periods are measured on ([`Clock`]).
//!
//! Every wait here gives way to shutdown: a start that has not been sent
//! when the controller stops is abandoned (its nonce stays committed, so the
//! next controller resumes it safely).

use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{watch, Semaphore, SemaphorePermit};
use tokio::time::Instant;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Resolves once `stopping` is true (at once if it already is).
pub(crate) async fn stopped(stopping: &mut watch::Receiver<bool>) {
    if stopping.wait_for(|s| *s).await.is_err() {
        // The sender lives as long as the provisioner; without it nobody can
        // ask us to stop.
        std::future::pending::<()>().await;
    }
}

/// `provisioner-concurrency`: start requests in flight at once, for the
/// whole controller (not per pass: four passes in a row share the same
/// slots). Waiters are served first come, first served (tokio's semaphore is
/// fair), so machines start in the order they were queued. The limit follows
/// config changes, also for requests already waiting.
pub(crate) struct Slots {
    sem: Semaphore,
    /// (limit, permits still to retire after a decrease: they are forgotten
    /// as the requests holding them finish)
    state: Mutex<(usize, usize)>,
}

/// A slot held for one start request; freed on drop.
pub(crate) struct Slot<'a> {
    slots: &'a Slots,
    permit: Option<SemaphorePermit<'a>>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.slots.state);
        if let Some(p) = self.permit.take() {
            if st.1 > 0 {
                st.1 -= 1;
                p.forget();
            }
        }
    }
}

impl Slots {
    pub(crate) fn new(limit: usize) -> Slots {
        let limit = limit.max(1);
        Slots {
            sem: Semaphore::new(limit),
            state: Mutex::new((limit, 0)),
        }
    }

    pub(crate) fn set_limit(&self, limit: usize) {
        let limit = limit.max(1);
        let mut st = lock(&self.state);
        let (old, debt) = *st;
        if limit > old {
            let repay = debt.min(limit - old);
            st.1 -= repay;
            self.sem.add_permits(limit - old - repay);
        } else if limit < old {
            let cut = old - limit;
            let forgotten = self.sem.forget_permits(cut);
            st.1 += cut - forgotten;
        }
        st.0 = limit;
    }

    /// Waits for a free slot; `None` when the provisioner stops first.
    pub(crate) async fn acquire(&self, stopping: &mut watch::Receiver<bool>) -> Option<Slot<'_>> {
        tokio::select! {
            // Stopping wins over a slot that is free at the same moment.
            biased;
            _ = stopped(stopping) => None,
            p = self.sem.acquire() => Some(Slot {
                slots: self,
                permit: Some(p.expect("the semaphore is never closed")),
            }),
        }
    }
}

/// Wall-clock time that advances with tokio's clock: the wall time when the
/// clock was made, plus tokio's time since. In production that is the wall
/// clock; under tokio's paused clock tests move it with
/// `tokio::time::advance`. Stray first-seen times are kept in state in
/// this time, so they survive a controller restart.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    wall0: SystemTime,
    mono0: Instant,
}

impl Clock {
    pub fn system() -> Clock {
        Clock {
            wall0: SystemTime::now(),
            mono0: Instant::now(),
        }
    }

    pub fn now(&self) -> SystemTime {
        self.wall0 + self.mono0.elapsed()
    }

    /// Unix milliseconds.
    pub fn unix_ms(&self) -> i64 {
        self.now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_millis() as i64
    }

    /// Unix seconds.
    pub fn unix(&self) -> i64 {
        self.unix_ms().div_euclid(1000)
    }
}
