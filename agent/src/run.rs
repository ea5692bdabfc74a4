//! Running agents: the loop of passes, and parking idle agents.
//!
//! An agent subscribes first (so no change after its first read is missed),
//! then runs a pass, and another whenever a notice comes, until its entity
//! is Dead or gone, or it is stopped. A failed pass is reported in the
//! agent's status and retried with exponential backoff (a notice also
//! retries it at once).
//!
//! # Parking
//! A controller runs 200,000 agents, nearly all idle at any moment. An idle
//! agent has no task: its state ([`Looping`]) is parked in its [`Cell`],
//! and the cell itself is the waker its notices, its retry timer and its
//! stop hold. Waking a parked cell spawns a task that looks at what woke it
//! and runs passes until the agent is idle again, then parks it again. A
//! task per idle agent (its 128-byte cell, its boxed future and a separate
//! stop flag) was three fifths of what an idle agent kept.
//!
//! The race between parking and a wake is closed by the cell's state: a
//! wake while a task runs the agent only marks it `woken`, and the task
//! looks again instead of parking.

use crate::api::{self, ApiError, WatchTarget};
use crate::{Agent, Step};
use futures_util::future::BoxFuture;
use futures_util::task::AtomicWaker;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;
use tracing::{debug, warn};

const RETRY_MIN: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// A running agent: stop it, ask whether it ended, wait for it to end.
/// Clones share the agent; only one task at a time may wait in
/// [`Running::finished`]. Dropping every handle leaves the agent running.
#[derive(Clone)]
pub struct Running(Arc<dyn Control>);

impl Running {
    /// Asks the agent to stop; it finishes the pass it is in first, then
    /// stops what it runs (its deployed units' agents).
    pub fn stop(&self) {
        self.0.clone().stop()
    }

    pub fn is_finished(&self) -> bool {
        self.0.is_finished()
    }

    /// Waits until the agent has ended (stopped, or its entity Dead or
    /// gone).
    pub async fn finished(&self) {
        std::future::poll_fn(|cx| self.0.poll_finished(cx)).await
    }
}

trait Control: Send + Sync {
    fn stop(self: Arc<Self>);
    fn is_finished(&self) -> bool;
    fn poll_finished(&self, cx: &mut Context<'_>) -> Poll<()>;
}

/// Makes the task future that runs a cell's agent. A plain function of the
/// concrete agent type (see `MachineAgent::spawn`): a generic one could not
/// prove the future `Send`, and a unit agent's future would contain itself
/// (it starts its subordinates' agents).
pub(crate) type Driver<A> = fn(Arc<Cell<A>>, Box<Looping<A>>) -> BoxFuture<'static, ()>;

/// Starts `agent` on the current tokio runtime.
pub(crate) fn spawn_with<A: Agent + 'static>(agent: A, driver: Driver<A>) -> Running {
    let watching = agent.targets();
    let cell = Arc::new(Cell {
        flags: AtomicU8::new(0),
        park: Mutex::new(Park::Running { woken: false }),
        task: AtomicWaker::new(),
        waiter: AtomicWaker::new(),
        runtime: tokio::runtime::Handle::current(),
        driver,
    });
    let looping = Box::new(Looping {
        agent,
        retry: RETRY_MIN,
        watching,
        notices: None,
        sleep: None,
        wants_pass: true,
        acquiring: None,
    });
    tokio::spawn(driver(cell.clone(), looping));
    Running(cell)
}

const STOPPED: u8 = 1;
const FINISHED: u8 = 2;

/// One agent: its stop and end flags, and its state while parked.
pub(crate) struct Cell<A> {
    flags: AtomicU8,
    park: Mutex<Park<A>>,
    /// The agent's task while it waits for a pass's permit or to retry its
    /// first watch: a stop wakes it.
    task: AtomicWaker,
    /// Whoever waits in [`Running::finished`].
    waiter: AtomicWaker,
    runtime: tokio::runtime::Handle,
    driver: Driver<A>,
}

enum Park<A> {
    /// A task runs the agent; `woken`: something it waits on changed since
    /// it last looked.
    Running { woken: bool },
    /// No task: the first wake spawns one.
    Parked(Box<Looping<A>>),
    Finished,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<A: Agent + 'static> Wake for Cell<A> {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let mut park = lock(&self.park);
        match &mut *park {
            Park::Running { woken } => *woken = true,
            Park::Finished => {}
            Park::Parked(_) => {
                let Park::Parked(looping) =
                    std::mem::replace(&mut *park, Park::Running { woken: false })
                else {
                    unreachable!("matched above")
                };
                drop(park);
                // A runtime shutting down drops the future, and with it the
                // agent's state: as its tasks' futures are dropped.
                self.runtime.spawn((self.driver)(self.clone(), looping));
            }
        }
    }
}

impl<A: Agent + 'static> Control for Cell<A> {
    fn stop(self: Arc<Self>) {
        self.flags.fetch_or(STOPPED, Ordering::SeqCst);
        self.task.wake();
        self.wake_by_ref();
    }

    fn is_finished(&self) -> bool {
        self.flags.load(Ordering::SeqCst) & FINISHED != 0
    }

    fn poll_finished(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.is_finished() {
            return Poll::Ready(());
        }
        self.waiter.register(cx.waker());
        if self.is_finished() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

impl<A> Cell<A> {
    fn is_stopped(&self) -> bool {
        self.flags.load(Ordering::SeqCst) & STOPPED != 0
    }

    /// Ready once stopped; registers the agent's running task.
    fn poll_stopped(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.is_stopped() {
            return Poll::Ready(());
        }
        self.task.register(cx.waker());
        if self.is_stopped() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    async fn stopped(&self) {
        std::future::poll_fn(|cx| self.poll_stopped(cx)).await
    }
}

/// What a parked agent's wait came to.
enum Next {
    /// Run a pass (holding the permit, where passes are bounded).
    Pass(Option<tokio::sync::OwnedSemaphorePermit>),
    /// Stopped, or no more notices will come.
    End,
}

/// The task of a cell's agent, from its start or from a wake of its parked
/// state: runs passes until the agent waits (for a notice, its retry timer
/// or a pass's permit), then parks it. Ends with the agent.
pub(crate) async fn drive<A: Agent + 'static>(cell: Arc<Cell<A>>, mut state: Box<Looping<A>>) {
    'agent: loop {
        if state.notices.is_none() && !Box::pin(state.first_watch(&cell)).await {
            break;
        }
        let permit = loop {
            *lock(&cell.park) = Park::Running { woken: false };
            let next = {
                let waker = Waker::from(cell.clone());
                let mut cx = Context::from_waker(&waker);
                poll_wait(&cell, &mut state, &mut cx)
            };
            match next {
                Poll::Ready(Next::Pass(permit)) => break permit,
                Poll::Ready(Next::End) => break 'agent,
                Poll::Pending => {
                    let mut park = lock(&cell.park);
                    if let Park::Running { woken: true } = *park {
                        // Woken while looking: look again.
                        continue;
                    }
                    *park = Park::Parked(state);
                    return;
                }
            }
        };
        match Box::pin(state.pass(&cell, permit)).await {
            Pass::Again => state.wants_pass = true,
            Pass::Idle => {}
            Pass::End => break,
        }
    }
    Box::pin(state.agent.finish()).await;
    drop(state);
    *lock(&cell.park) = Park::Finished;
    cell.flags.fetch_or(FINISHED, Ordering::SeqCst);
    cell.waiter.wake();
}

/// What an agent waits for, polled with its cell's own waker (registered
/// with its notices, its timer or its place in the queue for permits; its
/// stop needs no registration: stopping wakes the cell).
///
/// A permit per pass where agents share a process: when one change wakes
/// 100,000 agents (a service destroyed, a controller started), at most a
/// few hundred hold a pass's state (its future, the views it read, its
/// pending writes) at once. The others wait parked, holding only their
/// place in the queue: waiting in a task held the task, and waiting inside
/// the pass's future 100,000 pass-sized futures — most of the controller's
/// peak either way.
fn poll_wait<A: Agent>(cell: &Cell<A>, state: &mut Looping<A>, cx: &mut Context<'_>) -> Poll<Next> {
    if cell.is_stopped() {
        return Poll::Ready(Next::End);
    }
    if !state.wants_pass {
        let Some(notices) = state.notices.as_mut() else {
            return Poll::Ready(Next::End);
        };
        match notices.as_mut().poll_next(cx) {
            Poll::Ready(Some(_)) => state.wants_pass = true,
            Poll::Ready(None) => return Poll::Ready(Next::End),
            Poll::Pending => {
                let timer = state.sleep.as_mut().map(|s| s.as_mut().poll(cx));
                if !timer.is_some_and(|t| t.is_ready()) {
                    return Poll::Pending;
                }
                state.wants_pass = true;
            }
        }
    }
    let Some(passes) = state.agent.passes() else {
        state.wants_pass = false;
        return Poll::Ready(Next::Pass(None));
    };
    let acquire = state
        .acquiring
        .get_or_insert_with(|| Box::pin(passes.acquire_owned()));
    match acquire.as_mut().poll(cx) {
        Poll::Ready(permit) => {
            state.acquiring = None;
            state.wants_pass = false;
            // Closed only if its owner went: pass without it.
            Poll::Ready(Next::Pass(permit.ok()))
        }
        Poll::Pending => Poll::Pending,
    }
}

/// An agent and what its loop keeps between passes.
pub(crate) struct Looping<A> {
    agent: A,
    /// The next retry's delay after a failed pass or watch.
    retry: Duration,
    /// What `notices` is subscribed to.
    watching: Vec<WatchTarget>,
    notices: Option<api::NoticeStream>,
    /// While a failed pass waits to be retried.
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    /// A notice (or the timer) came, or the last pass asked for another:
    /// it waits for a pass's permit.
    wants_pass: bool,
    /// Its place in the queue for a pass's permit, while it waits.
    acquiring: Option<Acquiring>,
}

type Acquiring = Pin<
    Box<
        dyn Future<Output = Result<tokio::sync::OwnedSemaphorePermit, tokio::sync::AcquireError>>
            + Send,
    >,
>;

/// What a pass found, for the loop.
enum Pass {
    /// Look again at once (after another permit).
    Again,
    /// Nothing to do until a notice (or the retry timer).
    Idle,
    /// Stopped, or the entity is Dead or gone.
    End,
}

impl<A: Agent> Looping<A> {
    /// The first subscription, retried until it is made; `false` when the
    /// agent is to end (stopped, or nothing to watch).
    async fn first_watch(&mut self, cell: &Cell<A>) -> bool {
        loop {
            match Box::pin(subscribe(&self.agent, &self.watching)).await {
                Ok(n) => {
                    self.notices = Some(n);
                    self.retry = RETRY_MIN;
                    return true;
                }
                // The entity is gone (or was never the agent's).
                Err(e) if e.is_unauthorized() => {
                    debug!(agent = %self.agent.api().tag(), error = %e, "nothing to watch; stopping");
                    return false;
                }
                Err(e) => {
                    warn!(agent = %self.agent.api().tag(), error = %e, "cannot watch; retrying");
                    let stopped = tokio::select! {
                        _ = tokio::time::sleep(self.retry) => false,
                        _ = cell.stopped() => true,
                    };
                    if stopped {
                        return false;
                    }
                    self.retry = (self.retry * 2).min(RETRY_MAX);
                }
            }
        }
    }

    /// One pass, holding `permit` while the agent steps; then the watch
    /// follows what the agent now wants to see.
    async fn pass(
        &mut self,
        cell: &Cell<A>,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Pass {
        self.sleep = None;
        if cell.is_stopped() {
            return Pass::End;
        }
        let wait = match Box::pin(self.agent.step()).await {
            Ok(Step::Again) => return Pass::Again,
            Ok(Step::Done) => {
                debug!(agent = %self.agent.api().tag(), "done");
                return Pass::End;
            }
            Ok(Step::Idle) => {
                self.retry = RETRY_MIN;
                None
            }
            Err(e) => {
                let retry = self.retry;
                warn!(agent = %self.agent.api().tag(), error = %e, retry_in = ?retry, "agent pass failed");
                Box::pin(self.agent.failed(&e.to_string())).await;
                self.retry = (retry * 2).min(RETRY_MAX);
                Some(retry)
            }
        };
        drop(permit);
        let wanted = self.agent.targets();
        if wanted != self.watching {
            // Subscribed before the next pass reads, so nothing falls
            // between; a refused scope (left meanwhile) is dropped.
            match Box::pin(subscribe(&self.agent, &wanted)).await {
                Ok(n) => {
                    self.notices = Some(n);
                    self.watching = wanted;
                    return Pass::Again;
                }
                Err(e) => {
                    debug!(agent = %self.agent.api().tag(), error = %e, "cannot watch the new targets yet")
                }
            }
        }
        self.sleep = wait.map(|d| Box::pin(tokio::time::sleep(d)));
        Pass::Idle
    }
}

/// One stream of notices for all of `targets`; the first target (the
/// agent's own entity) must be watchable, the others are best effort.
async fn subscribe<A: Agent>(
    agent: &A,
    targets: &[WatchTarget],
) -> std::result::Result<api::NoticeStream, ApiError> {
    let mut streams = Vec::with_capacity(targets.len());
    for (i, t) in targets.iter().enumerate() {
        match agent.api().watch(t.clone()).await {
            Ok(s) => streams.push(s),
            Err(e) if i == 0 => return Err(e),
            Err(e) => debug!(agent = %agent.api().tag(), error = %e, target = ?t, "not watched"),
        }
    }
    if streams.len() == 1 {
        return Ok(streams.pop().expect("one"));
    }
    Ok(Box::pin(futures_util::stream::select_all(streams)))
}
