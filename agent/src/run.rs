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
//! and the cell itself is the waker its notices and its retry timer hold
//! and what it queues in [`Passes`] as; a stop wakes it directly. Waking a
//! parked cell spawns a task that looks at what woke it and runs passes
//! until the agent waits again, then parks it again. A task per idle agent
//! (its 128-byte cell, its boxed future and a separate stop flag) was three
//! fifths of what an idle agent kept.
//!
//! The race between parking and a wake is closed by the cell's `WOKEN`
//! flag: a wake while a task runs the agent only sets it, and the task
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

/// How many agents of a process may be in a pass at once. Agents waiting
/// for a pass queue as their cells — 16 bytes each, no future: a change that
/// wakes 200,000 agents queues 200,000 of them — and a released permit is
/// handed to the first that still wants it.
pub struct Passes {
    gate: Mutex<Gate>,
}

struct Gate {
    free: usize,
    queue: std::collections::VecDeque<Arc<dyn Waiter>>,
}

impl Gate {
    /// Takes a free permit, unless agents queue for one (they come first).
    fn take(&mut self) -> bool {
        let free = self.free > 0 && self.queue.is_empty();
        if free {
            self.free -= 1;
        }
        free
    }
}

/// An agent queued for a pass.
trait Waiter: Send + Sync {
    /// Hands it a permit; `false` if it no longer wants one (stopped or
    /// ended), and the permit goes to the next.
    fn grant(self: Arc<Self>) -> bool;
}

/// A pass's permit; dropping it hands it on.
pub struct PassPermit(Arc<Passes>);

impl Drop for PassPermit {
    fn drop(&mut self) {
        self.0.release();
    }
}

impl Passes {
    pub fn new(permits: usize) -> Arc<Passes> {
        Arc::new(Passes {
            gate: Mutex::new(Gate {
                free: permits.max(1),
                queue: Default::default(),
            }),
        })
    }

    /// How many agents queue for a permit.
    pub fn queued(&self) -> usize {
        lock(&self.gate).queue.len()
    }

    /// A permit if one is free and nobody queues for it (not queuing).
    pub fn try_acquire(self: &Arc<Self>) -> Option<PassPermit> {
        lock(&self.gate).take().then(|| PassPermit(self.clone()))
    }

    /// A permit now, or `waiter` queued for one (it is granted one later).
    fn acquire_or_queue(self: &Arc<Self>, waiter: Arc<dyn Waiter>) -> Option<PassPermit> {
        let mut gate = lock(&self.gate);
        if gate.take() {
            return Some(PassPermit(self.clone()));
        }
        gate.queue.push_back(waiter);
        None
    }

    fn release(&self) {
        loop {
            let next = {
                let mut gate = lock(&self.gate);
                match gate.queue.pop_front() {
                    Some(w) => w,
                    None => {
                        gate.free += 1;
                        return;
                    }
                }
            };
            // Granted outside the gate's lock: granting wakes (and may
            // spawn) the agent.
            if next.grant() {
                return;
            }
        }
    }
}

trait Control: Send + Sync {
    fn stop(self: Arc<Self>);
    fn is_finished(&self) -> bool;
    fn poll_finished(&self, cx: &mut Context<'_>) -> Poll<()>;
}

/// An agent type whose agents run in cells: its task future, made by a
/// plain function of the concrete type (see `MachineAgent`'s): a generic
/// one could not prove the future `Send`, and a unit agent's future would
/// contain itself (it starts its subordinates' agents). Found through the
/// type, not kept in each of 200,000 cells.
pub(crate) trait Driven: Agent + Sized + 'static {
    fn drive(cell: Arc<Cell<Self>>, state: Box<Looping<Self>>) -> BoxFuture<'static, ()>;
}

/// Starts `agent` on the current tokio runtime.
pub(crate) fn spawn_with<A: Driven>(agent: A) -> Running {
    let cell = Arc::new(Cell {
        flags: AtomicU8::new(0),
        parked: Mutex::new(None),
        waiter: AtomicWaker::new(),
    });
    let looping = Box::new(Looping {
        agent,
        runtime: tokio::runtime::Handle::current(),
        retry_ms: RETRY_MIN_MS,
        watching: 0,
        notices: None,
        wait: Wait::Idle,
        watched: false,
        passed: false,
    });
    tokio::spawn(A::drive(cell.clone(), looping));
    Running(cell)
}

const STOPPED: u8 = 1;
const FINISHED: u8 = 2;
/// Something the running task waits on changed since it last looked.
const WOKEN: u8 = 4;
/// Queued for a pass's permit, and handed one: its pass may run.
const GRANTED: u8 = 8;

/// One agent: its flags, and its state while parked. Nothing of it waits
/// in a task: 200,000 of these are most of an idle controller. (48 bytes,
/// 64 with its reference counts: the allocator's 64-byte size class, where
/// with the runtime handle and the driver in it, 88 bytes, it took 96. What
/// a wake needs besides, the runtime to spawn on, is in the parked state,
/// whose size class had room for it.)
pub(crate) struct Cell<A> {
    flags: AtomicU8,
    /// The agent's state while it has no task; a wake spawns one with it.
    parked: Mutex<Option<Box<Looping<A>>>>,
    /// Whoever waits in [`Running::finished`].
    waiter: AtomicWaker,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<A: Driven> Wake for Cell<A> {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let mut parked = lock(&self.parked);
        match parked.take() {
            Some(mut looping) => {
                if self.queues_parked(&mut looping) {
                    *parked = Some(looping);
                    return;
                }
                drop(parked);
                // A runtime shutting down drops the future, and with it the
                // agent's state: as its tasks' futures are dropped.
                let runtime = looping.runtime.clone();
                runtime.spawn(A::drive(self.clone(), looping));
            }
            // Running (the task looks again before it parks), or finished.
            None => {
                self.flags.fetch_or(WOKEN, Ordering::SeqCst);
            }
        }
    }
}

impl<A: Driven> Cell<A> {
    /// Whether a wake of the parked `looping` needs no task: it can only
    /// mean a pass is due (a notice, or the retry timer), and the agent
    /// queues for a permit, or it is queued already and not yet granted
    /// one. A task spawned only to look, queue and park again was 230 bytes
    /// until the runtime ran it: when a destroyed service's cleanup woke
    /// 100,000 agents within a second, most of the controller's peak. A
    /// stop, a grant, a first watch or a free permit still spawn one.
    ///
    /// Called under the `parked` lock, which a grant takes too; the gate's
    /// lock is taken inside it, never the other way round.
    fn queues_parked(self: &Arc<Self>, looping: &mut Looping<A>) -> bool {
        if self.flags.load(Ordering::SeqCst) & (STOPPED | GRANTED) != 0 || looping.notices.is_none()
        {
            return false;
        }
        let Some(passes) = looping.agent.passes() else {
            return false;
        };
        match looping.wait {
            Wait::Queued => true,
            Wait::Idle | Wait::Retry(_) => match passes.acquire_or_queue(self.clone()) {
                None => {
                    looping.wait = Wait::Queued;
                    true
                }
                Some(permit) => {
                    // Handed to the task as a grant (see `poll_wait`).
                    std::mem::forget(permit);
                    self.flags.fetch_or(GRANTED, Ordering::SeqCst);
                    looping.wait = Wait::Queued;
                    false
                }
            },
            Wait::Pass => false,
        }
    }
}

impl<A: Driven> Waiter for Cell<A> {
    fn grant(self: Arc<Self>) -> bool {
        {
            // Under the lock its end takes too: a permit granted is either
            // seen by its end (and released) or refused here.
            let _parked = lock(&self.parked);
            if self.flags.load(Ordering::SeqCst) & (STOPPED | FINISHED) != 0 {
                return false;
            }
            self.flags.fetch_or(GRANTED, Ordering::SeqCst);
        }
        self.wake_by_ref();
        true
    }
}

impl<A: Driven> Control for Cell<A> {
    fn stop(self: Arc<Self>) {
        self.flags.fetch_or(STOPPED, Ordering::SeqCst);
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
}

/// An agent's stop flag, as the pass it runs sees it.
trait Stopping: Send + Sync {
    fn is_stopped(&self) -> bool;
}

impl<A: Agent + 'static> Stopping for Cell<A> {
    fn is_stopped(&self) -> bool {
        Cell::is_stopped(self)
    }
}

tokio::task_local! {
    /// The agent whose pass this task is in.
    static PASS_OF: Arc<dyn Stopping>;
}

/// Whether the agent whose pass calls this was asked to stop. A pass
/// ends where it stands once it was: one pass may be thousands of hooks
/// (a unit joining a big peer relation), and a controller, or an agent
/// process, that waited for every such pass to finish did not stop for
/// minutes. What the pass did is recorded as it goes (the hook record);
/// the agent's next start goes on from there.
pub(crate) fn stop_requested() -> bool {
    PASS_OF.try_with(|a| a.is_stopped()).unwrap_or(false)
}

/// What a parked agent's wait came to.
enum Next {
    /// Subscribe (first, or again after a failed try).
    Watch,
    /// Run a pass (holding the permit, where passes are bounded).
    Pass(Option<PassPermit>),
    /// Stopped, or no more notices will come.
    End,
}

/// The task of a cell's agent, from its start or from a wake of its parked
/// state: runs what is due until the agent waits (for a notice, its retry
/// timer or a pass's permit), then parks it. Ends with the agent.
pub(crate) async fn drive<A: Driven>(cell: Arc<Cell<A>>, mut state: Box<Looping<A>>) {
    loop {
        let next = loop {
            cell.flags.fetch_and(!WOKEN, Ordering::SeqCst);
            let next = {
                let waker = Waker::from(cell.clone());
                let mut cx = Context::from_waker(&waker);
                poll_wait(&cell, &mut state, &mut cx)
            };
            if let Poll::Ready(next) = next {
                break next;
            }
            let mut parked = lock(&cell.parked);
            if cell.flags.load(Ordering::SeqCst) & WOKEN != 0 {
                // Woken while looking: look again.
                continue;
            }
            *parked = Some(state);
            return;
        };
        match next {
            Next::Watch => {
                if !Box::pin(state.watch()).await {
                    break;
                }
            }
            Next::Pass(permit) => {
                if let Pass::End = Box::pin(state.pass(&cell, permit)).await {
                    break;
                }
            }
            Next::End => break,
        }
    }
    Box::pin(state.agent.finish()).await;
    let granted = {
        let _parked = lock(&cell.parked);
        cell.flags.fetch_or(FINISHED, Ordering::SeqCst) & GRANTED != 0
    };
    if granted {
        // Handed a permit it will not use: on to the next.
        if let Some(passes) = state.agent.passes() {
            passes.release();
        }
    }
    drop(state);
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
fn poll_wait<A: Driven>(
    cell: &Arc<Cell<A>>,
    state: &mut Looping<A>,
    cx: &mut Context<'_>,
) -> Poll<Next> {
    if cell.is_stopped() {
        return Poll::Ready(Next::End);
    }
    let Some(notices) = state.notices.as_mut() else {
        // Not subscribed yet: at once, or when the retry timer fires.
        if let Wait::Retry(timer) = &mut state.wait {
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
        state.wait = Wait::Idle;
        return Poll::Ready(Next::Watch);
    };
    if let Wait::Idle | Wait::Retry(_) = state.wait {
        match notices.as_mut().poll_next(cx) {
            Poll::Ready(Some(_)) => state.wait = Wait::Pass,
            Poll::Ready(None) => return Poll::Ready(Next::End),
            Poll::Pending => {
                let fired = match &mut state.wait {
                    Wait::Retry(timer) => timer.as_mut().poll(cx).is_ready(),
                    _ => false,
                };
                if !fired {
                    return Poll::Pending;
                }
                state.wait = Wait::Pass;
            }
        }
    }
    let Some(passes) = state.agent.passes() else {
        state.wait = Wait::Idle;
        return Poll::Ready(Next::Pass(None));
    };
    match state.wait {
        Wait::Queued => {
            if cell.flags.fetch_and(!GRANTED, Ordering::SeqCst) & GRANTED == 0 {
                return Poll::Pending;
            }
            state.wait = Wait::Idle;
            let permit = PassPermit(passes);
            // The pass about to run reads what every notice posted while
            // the agent queued announced (nothing polled them meanwhile):
            // taken now, each would be another pass after this one.
            loop {
                match notices.as_mut().poll_next(cx) {
                    Poll::Ready(Some(_)) => {}
                    // The permit, dropped, goes to the next.
                    Poll::Ready(None) => return Poll::Ready(Next::End),
                    Poll::Pending => break,
                }
            }
            Poll::Ready(Next::Pass(Some(permit)))
        }
        _ => match passes.acquire_or_queue(cell.clone()) {
            Some(permit) => {
                state.wait = Wait::Idle;
                Poll::Ready(Next::Pass(Some(permit)))
            }
            None => {
                state.wait = Wait::Queued;
                Poll::Pending
            }
        },
    }
}

/// An agent and what its loop keeps between passes.
pub(crate) struct Looping<A> {
    agent: A,
    /// Where a wake spawns the agent's task.
    runtime: tokio::runtime::Handle,
    /// The next retry's delay after a failed pass or watch.
    retry_ms: u32,
    /// What `notices` is subscribed to, as a [`fingerprint`] (a copy of a
    /// unit agent's targets was 80 bytes; whether they changed is all the
    /// loop needs).
    watching: u64,
    notices: Option<api::NoticeStream>,
    wait: Wait,
    /// The steps of its start it has taken (see [`crate::startup`]): its
    /// first watch, its first pass.
    watched: bool,
    passed: bool,
}

const RETRY_MIN_MS: u32 = 500;
const RETRY_MAX_MS: u32 = 30_000;

/// What an agent waits for between passes.
enum Wait {
    /// A notice.
    Idle,
    /// A notice, or this timer: a failed pass (or watch) is retried, or
    /// the agent asked to be woken then ([`Agent::wake_at`]).
    Retry(Pin<Box<tokio::time::Sleep>>),
    /// A pass: a notice came, or the last pass asked for another.
    Pass,
    /// A pass's permit: queued for one (see [`Passes`]).
    Queued,
}

/// What a pass found, for the loop.
enum Pass {
    /// Look again at once (after another permit).
    Again,
    /// Nothing to do until a notice (or the retry timer).
    Idle,
    /// Stopped, or the entity is Dead or gone.
    End,
}

impl<A: Driven> Looping<A> {
    fn retry_later(&mut self) -> Duration {
        let wait = Duration::from_millis(u64::from(self.retry_ms));
        self.wait = Wait::Retry(Box::pin(tokio::time::sleep(wait)));
        self.retry_ms = (self.retry_ms * 2).min(RETRY_MAX_MS);
        wait
    }

    /// The first subscription; `false` when the agent is to end (nothing to
    /// watch). A failure is retried when the retry timer fires.
    async fn watch(&mut self) -> bool {
        let targets = self.agent.targets();
        match Box::pin(subscribe(&self.agent, &targets)).await {
            Ok(n) => {
                if !self.watched {
                    self.watched = true;
                    if self.agent.counts_start() {
                        crate::startup::took(crate::startup::StartStep::Watching);
                    }
                }
                self.notices = Some(n);
                self.watching = fingerprint(&targets);
                self.retry_ms = RETRY_MIN_MS;
                // A first pass at once.
                self.wait = Wait::Pass;
                true
            }
            // The entity is gone (or was never the agent's).
            Err(e) if e.is_unauthorized() => {
                debug!(agent = %self.agent.api().tag(), error = %e, "nothing to watch; stopping");
                false
            }
            Err(e) => {
                let retry_in = self.retry_later();
                warn!(agent = %self.agent.api().tag(), error = %e, ?retry_in, "cannot watch; retrying");
                true
            }
        }
    }

    /// One pass, holding `permit` while the agent steps; then the watch
    /// follows what the agent now wants to see.
    async fn pass(&mut self, cell: &Arc<Cell<A>>, permit: Option<PassPermit>) -> Pass {
        if cell.is_stopped() {
            return Pass::End;
        }
        if !self.passed {
            self.passed = true;
            if self.agent.counts_start() {
                crate::startup::took(crate::startup::StartStep::FirstPass);
            }
        }
        let of: Arc<dyn Stopping> = cell.clone();
        let failed = match PASS_OF.scope(of, Box::pin(self.agent.step())).await {
            Ok(Step::Again) => {
                self.wait = Wait::Pass;
                return Pass::Again;
            }
            Ok(Step::Done) => {
                debug!(agent = %self.agent.api().tag(), "done");
                return Pass::End;
            }
            Ok(Step::Idle) => {
                self.retry_ms = RETRY_MIN_MS;
                false
            }
            Err(e) => {
                let retry_in = self.retry_later();
                warn!(agent = %self.agent.api().tag(), error = %e, ?retry_in, "agent pass failed");
                Box::pin(self.agent.failed(&e.to_string())).await;
                true
            }
        };
        drop(permit);
        let wanted = self.agent.targets();
        let print = fingerprint(&wanted);
        if print != self.watching {
            // Subscribed before the next pass reads, so nothing falls
            // between; a refused scope (left meanwhile) is dropped.
            match Box::pin(subscribe(&self.agent, &wanted)).await {
                Ok(n) => {
                    self.notices = Some(n);
                    self.watching = print;
                    self.wait = Wait::Pass;
                    return Pass::Again;
                }
                Err(e) => {
                    debug!(agent = %self.agent.api().tag(), error = %e, "cannot watch the new targets yet")
                }
            }
        }
        if !failed {
            self.wait = match self.agent.wake_at() {
                Some(at) => Wait::Retry(Box::pin(tokio::time::sleep_until(at))),
                None => Wait::Idle,
            };
        }
        Pass::Idle
    }
}

/// Identifies a list of watch targets (SipHash: two lists alike by chance
/// once in 2^64).
fn fingerprint(targets: &[WatchTarget]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    targets.hash(&mut h);
    h.finish()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::MachineAgent;
    use crate::unit::UnitAgent;

    /// What each of 200,000 parked agents keeps: its cell and its boxed
    /// state (an allocation each; a task, a boxed future and a separate stop
    /// flag each came on top before parking). The allocator rounds each up
    /// to its size class (…, 64, 80, 96, …, 160, 192, …): the cell with its
    /// two reference counts fits 64 bytes (it took 96 with the runtime
    /// handle and the driver kept in it), the states 160 and 192.
    #[test]
    fn a_parked_agent_keeps_little() {
        let sizes = [
            ("cell", std::mem::size_of::<Cell<MachineAgent>>()),
            (
                "machine agent's state",
                std::mem::size_of::<Looping<MachineAgent>>(),
            ),
            (
                "unit agent's state",
                std::mem::size_of::<Looping<UnitAgent>>(),
            ),
        ];
        assert!(sizes[0].1 + 16 <= 64, "{sizes:?}");
        assert!(sizes[1].1 <= 160, "{sizes:?}");
        assert!(sizes[2].1 <= 192, "{sizes:?}");
    }

    struct Wants {
        wants: bool,
        granted: std::sync::atomic::AtomicUsize,
    }

    impl Waiter for Wants {
        fn grant(self: Arc<Self>) -> bool {
            if self.wants {
                self.granted.fetch_add(1, Ordering::SeqCst);
            }
            self.wants
        }
    }

    fn waiter(wants: bool) -> Arc<Wants> {
        Arc::new(Wants {
            wants,
            granted: Default::default(),
        })
    }

    /// Queued agents come first, in order; a permit released goes to the
    /// first that still wants one (a stopped agent is skipped), and back to
    /// the free count when nobody does.
    #[test]
    fn a_released_permit_goes_to_the_first_queued_agent_that_wants_it() {
        let passes = Passes::new(1);
        let held = passes.try_acquire().expect("one free");
        let (a, stopped, c) = (waiter(true), waiter(false), waiter(true));
        for w in [a.clone(), stopped.clone(), c.clone()] {
            assert!(passes.acquire_or_queue(w).is_none());
        }
        assert!(passes.try_acquire().is_none(), "the queue comes first");
        drop(held);
        let granted = |w: &Arc<Wants>| w.granted.load(Ordering::SeqCst);
        assert_eq!((granted(&a), granted(&c)), (1, 0));
        // `a`'s pass ends: `stopped` refuses, `c` gets it.
        drop(PassPermit(passes.clone()));
        assert_eq!((granted(&a), granted(&c)), (1, 1));
        drop(PassPermit(passes.clone()));
        let again = passes.try_acquire().expect("free again");
        assert!(passes.try_acquire().is_none(), "one permit, not two");
        drop(again);
    }
}
