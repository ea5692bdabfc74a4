//! The controller's singleton jobs (the provisioner with its stray harvest
//! and instance poller, the cleaner) run only while this controller holds
//! the `singletons` lease in the state database, with a store fenced by its
//! token (see `jujube_state::leases`).
//!
//! # The loop
//!
//! - Claim the lease; a controller starting takes over what its previous
//!   process held at once ([`Store::claim_lease_anew`]: the file lock on its
//!   environment says that process is gone), under a new token.
//! - Held: start the jobs with [`Store::fenced`], renew every
//!   [`LeaseTimes::renew_every`], and stop them at the *local deadline* —
//!   the monotonic instant the last successful claim was sent, plus the
//!   lease's time, minus [`LeaseTimes::margin`] — unless a renewal has
//!   moved it on. A renewal that fails, stalls, finds the lease taken or
//!   returns another token also stops them. Another controller takes the
//!   lease only once its `expires` has passed by the database's clock
//!   ([`database_clock`]), which read the claim's time after it was sent:
//!   after this deadline by the margin at least, whatever the controllers'
//!   own clocks say.
//! - Taken by another controller: look again every `renew_every`.
//! - Asked to stop: stop the jobs, then release the lease so that another
//!   controller need not wait for it to expire.

use jujube_state::leases::{Claim, Fence, LeaseNow, SINGLETONS};
use jujube_state::Store;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

/// How long the lease lasts, how often it is renewed, and the margin by
/// which the jobs stop before it expires (the time they take to stop, and
/// the database clock's drift over a lease).
#[derive(Debug, Clone, Copy)]
pub struct LeaseTimes {
    pub ttl: Duration,
    pub renew_every: Duration,
    pub margin: Duration,
}

impl Default for LeaseTimes {
    /// A controller gone is replaced within 15 s; a renewal every 3 s
    /// writes one small row (never the change feed: no agent wakes).
    fn default() -> LeaseTimes {
        LeaseTimes {
            ttl: Duration::from_secs(15),
            renew_every: Duration::from_secs(3),
            margin: Duration::from_secs(3),
        }
    }
}

/// The jobs' start: given the fenced store and a stop signal, the tasks to
/// await once it is sent.
pub type StartJobs = Box<dyn FnMut(Store, watch::Receiver<bool>) -> Vec<JoinHandle<()>> + Send>;

/// The clock claims are made at (the lease's `expires` is on it).
pub type LeaseClock = Box<dyn Fn() -> LeaseNow + Send + Sync>;

/// The database's clock, one for every controller: a controller whose own
/// clock is ahead cannot take the lease before its holder's deadline.
pub fn database_clock() -> LeaseClock {
    Box::new(|| LeaseNow::Database)
}

type ClaimFuture<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Claimed> + Send + 'a>>;

/// Where claims go: the store (a test stands a database that stops
/// answering in front of it).
trait Claims: Send + Sync {
    fn claim<'a>(
        &'a self,
        holder: &'a str,
        now: LeaseNow,
        ttl: Duration,
        anew: bool,
    ) -> ClaimFuture<'a>;
}

/// Claims straight from a store, from the runtime's blocking pool: what the
/// tests hold with (its tasks hold tokio's paused clock, which a
/// [`Claimer`]'s thread would not); a controller claims through a
/// [`Claimer`].
#[cfg(test)]
impl Claims for Store {
    fn claim<'a>(
        &'a self,
        holder: &'a str,
        now: LeaseNow,
        ttl: Duration,
        anew: bool,
    ) -> ClaimFuture<'a> {
        Box::pin(claim(self, holder, now, ttl, anew))
    }
}

#[cfg(test)]
async fn claim(store: &Store, holder: &str, now: LeaseNow, ttl: Duration, anew: bool) -> Claimed {
    let (store, holder) = (store.clone(), holder.to_string());
    tokio::task::spawn_blocking(move || claim_now(&store, &holder, now, ttl, anew))
        .await
        .unwrap_or_else(|e| Claimed::Failed(e.to_string()))
}

/// One claim (a new holding's first is `anew`), answered.
fn claim_now(store: &Store, holder: &str, now: LeaseNow, ttl: Duration, anew: bool) -> Claimed {
    let r = if anew {
        store.claim_lease_anew(SINGLETONS, holder, now, ttl)
    } else {
        store.claim_lease(SINGLETONS, holder, now, ttl)
    };
    match r {
        Ok(c) => Claimed::Answer(c),
        Err(e) => Claimed::Failed(e.to_string()),
    }
}

enum Claimed {
    Answer(Claim),
    Failed(String),
}

/// Sends claims from a thread of its own, on a store handle of its own
/// (its own connections): a renewal never waits behind the agents' writes
/// for the store's writer, nor behind their blocking calls for a thread of
/// the runtime's pool — under load, either made renewals miss their
/// deadline and the lease move between live controllers.
pub struct Claimer {
    requests: std::sync::mpsc::Sender<(ClaimArgs, tokio::sync::oneshot::Sender<Claimed>)>,
}

struct ClaimArgs {
    holder: String,
    now: LeaseNow,
    ttl: Duration,
    anew: bool,
}

impl Claimer {
    /// Starts the claiming thread on `store` (open a handle for it alone:
    /// `Store::open_at`). It ends when the `Claimer` is dropped.
    pub fn start(store: Store) -> std::io::Result<Claimer> {
        let (tx, rx) =
            std::sync::mpsc::channel::<(ClaimArgs, tokio::sync::oneshot::Sender<Claimed>)>();
        std::thread::Builder::new()
            .name("lease-claims".into())
            .spawn(move || {
                for (a, answer) in rx {
                    let t0 = std::time::Instant::now();
                    let claimed = claim_now(&store, &a.holder, a.now, a.ttl, a.anew);
                    if t0.elapsed() > Duration::from_secs(1) {
                        warn!(
                            took_ms = t0.elapsed().as_millis() as u64,
                            "a lease claim was slow"
                        );
                    }
                    let _ = answer.send(claimed);
                }
            })?;
        Ok(Claimer { requests: tx })
    }
}

impl Claims for Claimer {
    fn claim<'a>(
        &'a self,
        holder: &'a str,
        now: LeaseNow,
        ttl: Duration,
        anew: bool,
    ) -> ClaimFuture<'a> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let args = ClaimArgs {
            holder: holder.to_string(),
            now,
            ttl,
            anew,
        };
        let sent = self.requests.send((args, tx)).is_ok();
        Box::pin(async move {
            if !sent {
                return Claimed::Failed("the lease-claiming thread has ended".into());
            }
            rx.await
                .unwrap_or_else(|_| Claimed::Failed("the lease-claiming thread has ended".into()))
        })
    }
}

/// Runs the singleton jobs whenever this controller (`holder`) holds the
/// lease, until `stop` is set; claims go through `claimer`.
///
/// The holding itself — its renewals and its deadline — runs on a thread
/// and runtime of its own; the jobs are started on the caller's runtime.
/// Its timers must fire on time whatever the jobs do: with a thousand
/// in-process agents deploying, the controller's runtime sent renewals up
/// to five seconds late, and then later than the deadline, and the lease
/// moved between live controllers. The returned task ends when the
/// holding has stopped its jobs and released the lease.
pub fn hold(
    store: Store,
    claimer: Claimer,
    holder: String,
    times: LeaseTimes,
    clock: LeaseClock,
    start: StartJobs,
    stop: watch::Receiver<bool>,
) -> std::io::Result<tokio::sync::oneshot::Receiver<()>> {
    let jobs_on = tokio::runtime::Handle::current();
    let (done, finished) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("lease-holding".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the lease's holding");
            rt.block_on(hold_via(
                &claimer, store, holder, times, clock, &jobs_on, start, stop,
            ));
            let _ = done.send(());
        })?;
    Ok(finished)
}

/// [`hold`], its claims sent through `claims`.
#[allow(clippy::too_many_arguments)]
async fn hold_via(
    claims: &dyn Claims,
    store: Store,
    holder: String,
    times: LeaseTimes,
    clock: LeaseClock,
    jobs_on: &tokio::runtime::Handle,
    start: StartJobs,
    mut stop: watch::Receiver<bool>,
) {
    let start = Arc::new(std::sync::Mutex::new(start));
    let mut anew = true;
    loop {
        if *stop.borrow() {
            return;
        }
        let sent = Instant::now();
        // A claim answered past the deadline its own sending sets is no
        // lease to act on (the database stalled with it queued): waited
        // for no longer, and claimed again; a late answer is ignored.
        let deadline = sent + times.ttl.saturating_sub(times.margin);
        let claimed = tokio::select! {
            c = claims.claim(&holder, clock(), times.ttl, anew) => c,
            _ = tokio::time::sleep_until(deadline) => {
                warn!(holder, "claiming the singletons lease stalled past its deadline: claiming again");
                continue;
            }
            _ = stop.changed() => return,
        };
        if Instant::now() >= deadline {
            warn!(
                holder,
                "the singletons lease was granted too late to act on: claiming again"
            );
            continue;
        }
        match claimed {
            Claimed::Answer(Claim::Held(fence)) => {
                anew = false;
                info!(
                    holder,
                    token = fence.token,
                    "this controller holds the singletons lease: running the provisioner and the cleaner"
                );
                let (jobs_stop, jobs_stop_rx) = watch::channel(false);
                // A job that ends by itself (it failed) ends the holding:
                // the others stop, and all start again after a while.
                let (ended_tx, mut ended) = tokio::sync::mpsc::channel::<()>(1);
                // Started by a task of the jobs' runtime: what they call
                // of the store there may leave its worker for the call.
                let started = {
                    let (start, fenced) = (start.clone(), store.fenced(fence.clone()));
                    jobs_on
                        .spawn(async move {
                            let mut start = start.lock().unwrap_or_else(|p| p.into_inner());
                            (*start)(fenced, jobs_stop_rx)
                        })
                        .await
                        .unwrap_or_default()
                };
                let jobs: Vec<JoinHandle<()>> = started
                    .into_iter()
                    .map(|job| {
                        let ended_tx = ended_tx.clone();
                        tokio::spawn(async move {
                            if let Err(e) = job.await {
                                warn!(error = %e, "a singleton job ended abnormally");
                            }
                            let _ = ended_tx.try_send(());
                        })
                    })
                    .collect();
                let stopping = tokio::select! {
                    s = run_held(claims, &holder, &times, &clock, &fence, sent, &mut stop) => s,
                    _ = ended.recv() => {
                        warn!(holder, "a singleton job ended: restarting them");
                        false
                    }
                };
                jobs_stop.send_replace(true);
                for j in jobs {
                    let _ = j.await;
                }
                if stopping {
                    if let Err(e) = store.release_lease(&fence) {
                        warn!(error = %e, "cannot release the singletons lease; another controller takes it when it expires");
                    }
                    return;
                }
                info!(holder, token = fence.token, "singleton jobs stopped");
            }
            Claimed::Answer(Claim::Taken {
                holder: other,
                expires_ms,
            }) => {
                anew = false;
                info!(
                    holder = other,
                    expires_ms, "another controller holds the singletons lease"
                );
            }
            Claimed::Failed(e) => {
                warn!(error = %e, "cannot claim the singletons lease; trying again")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(times.renew_every) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Renews the lease while held; `true` when asked to stop, `false` when the
/// lease is lost (or its deadline passed without a renewal).
async fn run_held(
    claims: &dyn Claims,
    holder: &str,
    times: &LeaseTimes,
    clock: &LeaseClock,
    fence: &Fence,
    mut sent: Instant,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    let deadline_of = |sent: Instant| sent + times.ttl.saturating_sub(times.margin);
    let mut deadline = deadline_of(sent);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(times.renew_every) => {}
            _ = tokio::time::sleep_until(deadline) => {
                warn!(holder, token = fence.token, "the singletons lease is about to expire unrenewed: stopping the singleton jobs");
                return false;
            }
            _ = stop.changed() => return true,
        }
        let now_sent = Instant::now();
        let late = now_sent.saturating_duration_since(
            deadline - times.ttl.saturating_sub(times.margin) + times.renew_every,
        );
        if late > Duration::from_secs(1) {
            warn!(
                late_ms = late.as_millis() as u64,
                "the lease's renewal was sent late: this controller's runtime is starved"
            );
        }
        let renewal = tokio::select! {
            r = claims.claim(holder, clock(), times.ttl, false) => r,
            _ = tokio::time::sleep_until(deadline) => {
                warn!(holder, token = fence.token, "renewing the singletons lease stalled past its deadline: stopping the singleton jobs");
                return false;
            }
            _ = stop.changed() => return true,
        };
        match renewal {
            Claimed::Answer(Claim::Held(f)) if f.token == fence.token => {
                sent = now_sent;
                deadline = deadline_of(sent);
            }
            Claimed::Answer(Claim::Held(f)) => {
                warn!(holder, old = fence.token, new = f.token, "the singletons lease had expired and was taken anew: restarting the singleton jobs under the new token");
                return false;
            }
            Claimed::Answer(Claim::Taken { holder: other, .. }) => {
                warn!(
                    holder,
                    taken_by = other,
                    "another controller took the singletons lease: stopping the singleton jobs"
                );
                return false;
            }
            Claimed::Failed(e) => {
                // The deadline decides: a renewal may yet succeed before it.
                warn!(error = %e, "renewing the singletons lease failed; trying again until its deadline");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jujube_state::{Durability, Error};
    use std::sync::{Arc, Mutex};

    /// What the jobs wrote: (holder, token, the wall clock, whether the
    /// write went through).
    type Writes = Arc<Mutex<Vec<(&'static str, i64, i64, bool)>>>;

    fn spec() -> jujube_state::environment::EnvironmentSpec {
        jujube_state::environment::EnvironmentSpec {
            name: "test".into(),
            uuid: "6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f".into(),
            provider: "dummy".into(),
            default_series: "jammy".into(),
            constraints: Default::default(),
            config: Default::default(),
        }
    }

    /// Claims at wall-clock milliseconds that follow tokio's (paused) clock.
    fn clock(base: Instant) -> LeaseClock {
        Box::new(move || LeaseNow::At(1_000_000 + base.elapsed().as_millis() as i64))
    }

    /// A job that adds a machine every 100 ms, recording each attempt.
    fn jobs(name: &'static str, writes: Writes, base: Instant) -> StartJobs {
        Box::new(move |store: Store, mut stop: watch::Receiver<bool>| {
            let writes = writes.clone();
            vec![tokio::spawn(async move {
                let token = store.fence().map_or(0, |f| f.token);
                loop {
                    let r = store.add_machines(1, None, None);
                    if let Err(e) = &r {
                        assert!(matches!(e, Error::LeaseLost { .. }), "{e}");
                    }
                    let now = 1_000_000 + base.elapsed().as_millis() as i64;
                    writes.lock().unwrap().push((name, token, now, r.is_ok()));
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                        _ = stop.changed() => return,
                    }
                }
            })]
        })
    }

    /// Two controllers' stores on one initialised database file.
    fn two_stores() -> (tempfile::TempDir, Store, Store) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        let a = Store::open_with(&path, Durability::Relaxed).unwrap();
        a.initialize(&spec()).unwrap();
        let b = Store::open_with(&path, Durability::Relaxed).unwrap();
        (dir, a, b)
    }

    /// A controller named `name` holding its singletons on `store`; its
    /// stop signal.
    fn spawn_hold(
        store: &Store,
        name: &str,
        base: Instant,
        start: StartJobs,
    ) -> (JoinHandle<()>, watch::Sender<bool>) {
        let (stop, stop_rx) = watch::channel(false);
        // Claims from the runtime's blocking pool, whose tasks hold tokio's
        // paused clock (a claiming thread of its own would not).
        let (store, name) = (store.clone(), name.to_string());
        let task = tokio::spawn(async move {
            let claims = store.clone();
            hold_via(
                &claims,
                store,
                name,
                LeaseTimes::default(),
                clock(base),
                &tokio::runtime::Handle::current(),
                start,
                stop_rx,
            )
            .await
        });
        (task, stop)
    }

    async fn until_held_by(store: &Store, name: &str) {
        while holder_of(store).is_none_or(|(h, _)| h != name) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn holder_of(store: &Store) -> Option<(String, i64)> {
        store
            .lease(SINGLETONS)
            .unwrap()
            .map(|l| (l.holder, l.token))
    }

    #[tokio::test(start_paused = true)]
    async fn another_controller_takes_over_within_the_lease_time_and_the_old_one_writes_nothing_after(
    ) {
        let (_dir, a_store, b_store) = two_stores();
        let times = LeaseTimes::default();
        let base = Instant::now();
        let writes: Writes = Default::default();
        let (a, _a_stop) = spawn_hold(&a_store, "a", base, jobs("a", writes.clone(), base));
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (b, b_stop) = spawn_hold(&b_store, "b", base, jobs("b", writes.clone(), base));
        // a holds it for as long as it renews.
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(holder_of(&b_store), Some(("a".into(), 1)));
        assert!(writes.lock().unwrap().iter().all(|w| w.0 == "a" && w.3));

        // a's lease loop gone (its jobs with it), its lease left to expire.
        a.abort();
        let stalled = Instant::now();
        until_held_by(&b_store, "b").await;
        let took = stalled.elapsed();
        assert!(
            took <= times.ttl + times.renew_every,
            "taken over after {took:?}"
        );
        tokio::time::sleep(Duration::from_secs(5)).await;
        let writes = writes.lock().unwrap().clone();
        let b_first = writes
            .iter()
            .find(|w| w.0 == "b" && w.3)
            .expect("b wrote")
            .2;
        assert!(writes
            .iter()
            .filter(|w| w.0 == "b")
            .all(|w| w.1 == 2 && w.3));
        // Nothing of a's went through once b had taken over.
        assert!(writes
            .iter()
            .filter(|w| w.0 == "a" && w.3)
            .all(|w| w.2 < b_first));
        b_stop.send_replace(true);
        b.await.unwrap();
        // Stopping releases it: a controller starting next need not wait.
        assert!(matches!(
            a_store
                .claim_lease(
                    SINGLETONS,
                    "c",
                    1_000_000 + base.elapsed().as_millis() as i64,
                    times.ttl
                )
                .unwrap(),
            Claim::Held(Fence { token: 3, .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_restarted_controller_resumes_at_once_and_a_lost_lease_stops_the_jobs_before_it_expires(
    ) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_with(dir.path().join("state.db"), Durability::Relaxed).unwrap();
        store.initialize(&spec()).unwrap();
        let times = LeaseTimes::default();
        let base = Instant::now();
        // Its previous process held the lease a moment ago.
        let wall_now = 1_000_000;
        let Claim::Held(old) = store
            .claim_lease(SINGLETONS, "m0", wall_now, times.ttl)
            .unwrap()
        else {
            panic!("not held")
        };
        let writes: Writes = Default::default();
        let (task, stop) = spawn_hold(&store, "m0", base, jobs("m0", writes.clone(), base));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(holder_of(&store), Some(("m0".into(), old.token + 1)));
        assert!(writes.lock().unwrap().iter().any(|w| w.3));

        // Someone forces the lease away (its expiry passed by their clock):
        // the next renewal sees it and the jobs stop.
        store
            .fenced(old.clone())
            .add_machines(1, None, None)
            .expect_err("the old process's token is fenced off");
        let far = 1_000_000 + base.elapsed().as_millis() as i64 + times.ttl.as_millis() as i64;
        assert!(matches!(
            store
                .claim_lease(SINGLETONS, "other", far, times.ttl)
                .unwrap(),
            Claim::Held(_)
        ));
        let lost_at = Instant::now();
        tokio::time::sleep(times.renew_every + Duration::from_millis(200)).await;
        let n = writes.lock().unwrap().len();
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(writes.lock().unwrap().len(), n, "the jobs stopped");
        assert!(lost_at.elapsed() < times.ttl);
        stop.send_replace(true);
        task.await.unwrap();
    }

    /// The store, until the test makes it stop answering claims (a
    /// controller cut off from the database: its claims never return).
    struct Stalling {
        store: Store,
        stalled: std::sync::atomic::AtomicBool,
    }

    impl Claims for Stalling {
        fn claim<'a>(
            &'a self,
            holder: &'a str,
            now: LeaseNow,
            ttl: Duration,
            anew: bool,
        ) -> ClaimFuture<'a> {
            if self.stalled.load(std::sync::atomic::Ordering::SeqCst) {
                Box::pin(std::future::pending())
            } else {
                self.store.claim(holder, now, ttl, anew)
            }
        }
    }

    /// The store, its answers to claims delivered `late` after they were
    /// made (a database that stalls with the claim queued).
    struct Late {
        store: Store,
        late: Duration,
    }

    impl Claims for Late {
        fn claim<'a>(
            &'a self,
            holder: &'a str,
            now: LeaseNow,
            ttl: Duration,
            anew: bool,
        ) -> ClaimFuture<'a> {
            Box::pin(async move {
                let answer = self.store.claim(holder, now, ttl, anew).await;
                tokio::time::sleep(self.late).await;
                answer
            })
        }
    }

    /// A lease granted so late that its deadline (ttl less the margin,
    /// from when the claim was sent) has passed is not acted on: the jobs
    /// never start (they did, until `run_held` noticed the deadline).
    #[tokio::test(start_paused = true)]
    async fn a_lease_granted_past_its_deadline_starts_no_job() {
        let (_dir, store, _) = two_stores();
        let times = LeaseTimes::default();
        let ticks: Arc<Mutex<Vec<(&'static str, Instant)>>> = Default::default();
        let claims = Arc::new(Late {
            store: store.clone(),
            late: times.ttl - times.margin + Duration::from_millis(500),
        });
        let (stop, stop_rx) = watch::channel(false);
        let task = {
            let (claims, ticks) = (claims.clone(), ticks.clone());
            tokio::spawn(async move {
                hold_via(
                    &*claims,
                    store,
                    "a".into(),
                    times,
                    clock(Instant::now()),
                    &tokio::runtime::Handle::current(),
                    ticking("a", ticks),
                    stop_rx,
                )
                .await
            })
        };
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(
            ticks.lock().unwrap().is_empty(),
            "a job ran on a lease granted too late"
        );
        stop.send_replace(true);
        task.await.unwrap();
    }

    /// A job that only ticks every 100 ms, recording when (it touches no
    /// database: the one under test stops answering).
    fn ticking(name: &'static str, ticks: Arc<Mutex<Vec<(&'static str, Instant)>>>) -> StartJobs {
        Box::new(move |_store: Store, mut stop: watch::Receiver<bool>| {
            let ticks = ticks.clone();
            vec![tokio::spawn(async move {
                loop {
                    ticks.lock().unwrap().push((name, Instant::now()));
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                        _ = stop.changed() => return,
                    }
                }
            })]
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_controller_cut_off_from_the_database_stops_its_jobs_before_another_may_start_them() {
        let (_dir, a_store, b_store) = two_stores();
        let times = LeaseTimes::default();
        let base = Instant::now();
        let ticks: Arc<Mutex<Vec<(&'static str, Instant)>>> = Default::default();
        let a_claims = Arc::new(Stalling {
            store: a_store.clone(),
            stalled: Default::default(),
        });
        let (_a_stop, a_stop_rx) = watch::channel(false);
        let a = {
            let claims = a_claims.clone();
            let ticks = ticks.clone();
            tokio::spawn(async move {
                hold_via(
                    &*claims,
                    a_store,
                    "a".into(),
                    times,
                    clock(base),
                    &tokio::runtime::Handle::current(),
                    ticking("a", ticks),
                    a_stop_rx,
                )
                .await
            })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (b, b_stop) = spawn_hold(&b_store, "b", base, ticking("b", ticks.clone()));
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(holder_of(&b_store).map(|(h, _)| h), Some("a".into()));

        // a's database stops answering: its renewals hang.
        a_claims
            .stalled
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let cut = Instant::now();
        until_held_by(&b_store, "b").await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let ticks = ticks.lock().unwrap().clone();
        let a_last = ticks
            .iter()
            .filter(|t| t.0 == "a")
            .map(|t| t.1)
            .max()
            .unwrap();
        let b_first = ticks
            .iter()
            .filter(|t| t.0 == "b")
            .map(|t| t.1)
            .min()
            .unwrap();
        // a stopped at its own deadline, before the lease could expire...
        assert!(
            a_last < cut + times.ttl - times.margin,
            "a ran {:?} after it was cut off",
            a_last - cut
        );
        // ...and so before b started, by at least the margin.
        assert!(
            b_first >= a_last + times.margin,
            "b started {:?} after a stopped",
            b_first - a_last
        );
        b_stop.send_replace(true);
        b.await.unwrap();
        a.abort();
    }
}
