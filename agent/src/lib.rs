//! jujube's agents: the machine agent and the unit agent, and the facade
//! they see the model through.
//!
//! # Layout
//! - [`api`]: the [`Facade`](api::Facade) trait — the wire contract, scoped
//!   to the agent's own entity — and its plain-data types.
//! - [`deployer`]: deploying units (a directory per unit with the charm
//!   copied in, and a running unit agent), recalling them, and the
//!   deployer's duties shared by machine agents (principals) and unit agents
//!   (subordinates). The directories are the record of what was deployed.
//! - [`machine`], [`unit`]: the agents' duties as one idempotent pass each,
//!   run by [`run_loop`] whenever a notice says something they can see
//!   changed.
//!
//! - [`wire`]: the facade on the wire (one `Call` per method), agent
//!   credentials and `agent.conf`; [`remote`]: the facade as a client of
//!   the controller's API server (HTTP/2 over TLS, trusting only the
//!   environment's CA).
//!
//! Agents never import the state store: everything goes through the facade,
//! so the same agent code runs over the in-process implementation
//! (`jujube-agent-state`) or a remote one.

pub mod api;
pub mod deployer;
pub mod hooks;
pub mod machine;
pub mod remote;
pub mod unit;
pub mod wire;

use api::{ApiError, Facade, WatchTarget};
use futures_util::task::AtomicWaker;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tracing::{debug, warn};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("cannot {action} `{}`: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a pass found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing to do until something changes.
    Idle,
    /// It changed something: look again at once.
    Again,
    /// The entity is Dead or gone: the agent stops for good.
    Done,
}

/// An agent: one idempotent pass over its view, and what to watch.
#[allow(async_fn_in_trait)]
pub trait Agent: Send {
    fn api(&self) -> &Arc<dyn Facade>;
    fn target(&self) -> WatchTarget;
    /// Everything the agent watches; it is resubscribed whenever this
    /// changes after a pass (a unit agent watches the scopes it is in).
    fn targets(&self) -> Vec<WatchTarget> {
        vec![self.target()]
    }
    /// The bound on passes shared with the other agents of this process
    /// (its connector's [`Connector::passes`](api::Connector::passes)).
    fn passes(&self) -> Option<Arc<tokio::sync::Semaphore>> {
        None
    }
    async fn step(&mut self) -> Result<Step>;
    /// Reports a failed pass (best effort).
    async fn failed(&mut self, message: &str);
    /// Stops whatever the agent runs (its deployed units' agents).
    async fn finish(&mut self);
}

/// Tells one agent to stop. A flag and the one task that waits on it: a
/// process may run 200,000 agents, and a `tokio::sync::watch` channel per
/// agent cost seven times as much. Clones share the flag; only the agent's
/// own task may wait on it (one waker is kept).
#[derive(Clone, Default)]
pub struct Stop(Arc<StopCell>);

#[derive(Default)]
struct StopCell {
    stopped: AtomicBool,
    waker: AtomicWaker,
}

impl Stop {
    pub fn new() -> Stop {
        Stop::default()
    }

    /// Asks the agent to stop; it finishes the pass it is in first.
    pub fn stop(&self) {
        self.0.stopped.store(true, Ordering::SeqCst);
        self.0.waker.wake();
    }

    pub fn is_stopped(&self) -> bool {
        self.0.stopped.load(Ordering::SeqCst)
    }

    /// Ready once [`Stop::stop`] was called; registers the waiting task.
    pub fn poll_stopped(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.is_stopped() {
            return Poll::Ready(());
        }
        self.0.waker.register(cx.waker());
        // A stop between the check and the registration woke nobody.
        if self.is_stopped() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Waits for [`Stop::stop`].
    pub async fn stopped(&self) {
        std::future::poll_fn(|cx| self.poll_stopped(cx)).await
    }
}

/// What ended an idle agent's wait.
enum Woken {
    Notice,
    NoMoreNotices,
    Timer,
    Stopped,
}

const RETRY_MIN: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// Runs an agent: subscribes first (so no change after the first read is
/// missed), then a pass, and another whenever a notice comes, until the
/// entity is Dead or gone, or `stop` is called. A failed pass is reported
/// in the agent's status and retried with exponential backoff (a notice
/// also retries it at once).
///
/// An idle agent's task holds one pointer, to the agent and what its loop
/// keeps between passes ([`Looping`]), and its wait (`idle`); the wait for
/// a pass's permit and the pass itself are boxed futures of their own, on
/// the heap only while they run. A process may hold 200,000 idle agents.
pub fn run_loop<A: Agent>(agent: A, stop: Stop) -> impl Future<Output = ()> {
    let watching = agent.targets();
    run_boxed(
        Box::new(Looping {
            agent,
            retry: RETRY_MIN,
            watching,
            notices: None,
            sleep: None,
        }),
        stop,
    )
}

async fn run_boxed<A: Agent>(mut state: Box<Looping<A>>, stop: Stop) {
    'agent: loop {
        if state.notices.is_none() && !Box::pin(state.first_watch(&stop)).await {
            break;
        }
        loop {
            // A permit per pass where agents share a process: when one
            // change wakes 100,000 agents (a service destroyed, a controller
            // started), at most a few hundred hold a pass's state (its
            // future, the views it read, its pending writes) at once. The
            // others wait holding only the wait for a permit: waiting inside
            // the pass's future kept 100,000 pass-sized futures, a fifth of
            // the controller's peak. Waiting never blocks a stop: recalling
            // a unit waits for its agent to end, from inside its deployer's
            // pass.
            let permit = match state.agent.passes() {
                Some(passes) => match Box::pin(permit(passes, &stop)).await {
                    Some(p) => Some(p),
                    None => break 'agent,
                },
                None => None,
            };
            match Box::pin(state.pass(&stop, permit)).await {
                Pass::Again => {}
                Pass::Idle => break,
                Pass::End => break 'agent,
            }
        }
        let s = &mut *state;
        let Some(notices) = s.notices.as_mut() else {
            break;
        };
        match idle(&stop, notices, &mut s.sleep).await {
            Woken::Notice | Woken::Timer => {}
            Woken::NoMoreNotices | Woken::Stopped => break,
        }
    }
    Box::pin(state.agent.finish()).await;
}

/// A pass's permit, or `None` once the agent is stopped.
async fn permit(
    passes: Arc<tokio::sync::Semaphore>,
    stop: &Stop,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    let acquire = passes.acquire_owned();
    tokio::pin!(acquire);
    std::future::poll_fn(|cx| {
        if stop.poll_stopped(cx).is_ready() {
            return Poll::Ready(None);
        }
        acquire.as_mut().poll(cx).map(Result::ok)
    })
    .await
}

/// An agent and what its loop keeps between passes.
struct Looping<A> {
    agent: A,
    /// The next retry's delay after a failed pass or watch.
    retry: Duration,
    /// What `notices` is subscribed to.
    watching: Vec<WatchTarget>,
    notices: Option<api::NoticeStream>,
    /// While a failed pass waits to be retried.
    sleep: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
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

impl<A: Agent> Looping<A> {
    /// The first subscription, retried until it is made; `false` when the
    /// agent is to end (stopped, or nothing to watch).
    async fn first_watch(&mut self, stop: &Stop) -> bool {
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
                        _ = stop.stopped() => true,
                    };
                    if stopped {
                        return false;
                    }
                    self.retry = (self.retry * 2).min(RETRY_MAX);
                }
            }
        }
    }

    /// One pass, holding `_permit` while the agent steps; then the watch
    /// follows what the agent now wants to see.
    async fn pass(
        &mut self,
        stop: &Stop,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Pass {
        self.sleep = None;
        if stop.is_stopped() {
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

/// The wait of an idle agent, polled by hand: `select!` over the same three
/// kept several times their size in an idle task's future.
fn idle<'a>(
    stop: &'a Stop,
    notices: &'a mut api::NoticeStream,
    sleep: &'a mut Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
) -> impl Future<Output = Woken> + 'a {
    std::future::poll_fn(move |cx| {
        if stop.poll_stopped(cx).is_ready() {
            return Poll::Ready(Woken::Stopped);
        }
        if let Poll::Ready(n) = notices.as_mut().poll_next(cx) {
            return Poll::Ready(match n {
                Some(_) => Woken::Notice,
                None => Woken::NoMoreNotices,
            });
        }
        if let Some(s) = sleep.as_mut() {
            if s.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Woken::Timer);
            }
        }
        Poll::Pending
    })
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
