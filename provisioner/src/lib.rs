//! The provisioner: makes the machines in state and the instances in a cloud
//! agree.
//!
//! # Layout
//! - [`config`]: settings from environment config, reloaded live.
//! - `limits.rs`: the controller-wide limit on start requests in flight
//!   (`provisioner-concurrency`) and the [`Clock`] grace periods run on.
//! - `zones.rs`: which zones a machine may start in (its `zones=`
//!   constraint), and spreading a service's units over them (Juju's
//!   distribution groups).
//! - `harvest.rs`: the instance poller (recorded instances that are gone)
//!   and stray instances (reported, reaped after a persisted grace period).
//! - this file: [`Provisioner::reconcile`], one idempotent pass shaped like
//!   kube-runtime's reconciler — it reads the whole desired state, acts, and
//!   returns an [`Action`] saying when to look again — and
//!   [`Provisioner::run`], which calls it whenever the change feed moves or
//!   the requeue time comes.
//!
//! # A pass
//! 1. **Stop before start.** Dead machines' instances are stopped (their
//!    agents set them Dead), then the machines removed. Non-Alive machines without an instance are removed —
//!    after stopping anything a half-finished start left under their nonce.
//! 2. **Start.** The provider's zones are listed first (a provider that
//!    cannot be reached is shown in `status` and changes no machine). Alive
//!    machines without an instance and not in error get a nonce *committed
//!    before the start*, a zone their constraints allow, then are started in
//!    batches in background tasks. A batch waits for one of the controller's
//!    `provisioner-concurrency` slots and for the client-side token bucket —
//!    waits that give way to shutdown and to config changes — and only then
//!    marks its machines `provisioning` and sends the request. Transient
//!    errors are retried with jittered exponential backoff for a bounded
//!    time; capacity errors move to the next allowed zone; anything else, or
//!    giving up, leaves the machine with no instance id and an `error`
//!    status saying what failed and why. Starts are idempotent per nonce, so
//!    a crash anywhere yields at most one instance per machine: the next
//!    start with the same nonce returns the instance the lost one made.
//! 3. **The cloud behind our back** (every `harvest-interval`): recorded
//!    instances that are gone put their machines in error; instances tagged
//!    with this environment's UUID that no machine owns are reported, and
//!    reaped after a grace period according to `harvest-mode`, a few per
//!    pass. Instances without the tag are never listed, so never touched.
//!
//! A provider call outside a start that fails (listing zones or instances)
//! is recorded as the provider's status in state (`status` shows it at the
//! environment level, `wait` lists it as what is stuck) until a call
//! succeeds again.

pub mod config;
mod harvest;
mod limits;
mod zones;

use backon::BackoffBuilder;
pub use config::{Config, HarvestMode};
use jujube_core::Life;
use jujube_providers::bucket::TokenBucket;
use jujube_providers::{launch_batch, AgentInstall, ErrorClass, Instance, Provider, StartSpec};
use jujube_state::model::machine_status;
use jujube_state::provisioning::{Prepared, Recorded, Started};
use jujube_state::{AgentOp, Caller, Machine, Store};
pub use limits::Clock;
use limits::{stopped, Slots};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    State(#[from] jujube_state::Error),
    #[error(transparent)]
    Provider(#[from] jujube_providers::Error),
    #[error("invalid provisioner config: {0}")]
    Config(String),
    #[error("cannot prepare the agent of machine `{machine}`: {why}")]
    Agent { machine: i64, why: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What the run loop does after a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Look again after this long, or sooner if the state changes.
    Requeue(Duration),
    /// Nothing is scheduled: wait for the state to change.
    AwaitChange,
}

struct Inner {
    store: Store,
    provider: Arc<dyn Provider>,
    env_uuid: String,
    clock: Clock,
    cfg: Mutex<Config>,
    /// Bumped whenever new config is applied: wakes waits on the limiter.
    cfg_version: watch::Sender<u64>,
    applied: Mutex<Option<BTreeMap<String, String>>>,
    /// The client-side token bucket and the `provisioner-rate` it was made
    /// from.
    limiter: Mutex<Option<(String, TokenBucket)>>,
    slots: Slots,
    /// Machines being started by this provisioner, with the zone chosen.
    inflight: Mutex<HashMap<i64, Option<String>>>,
    /// Strays' first-seen times; `None` until seeded from state.
    seen: Mutex<Option<HashMap<String, harvest::Seen>>>,
    /// Machines whose instance was missing from the last listing.
    suspects: Mutex<HashMap<i64, String>>,
    /// The provider status last written to state (`None`: not yet).
    reach: Mutex<Option<Option<String>>>,
    last_listing: Mutex<Option<Instant>>,
    tasks: Mutex<tokio::task::JoinSet<()>>,
    stopping: watch::Sender<bool>,
    /// Where machines' agents are installed on their instances.
    installer: std::sync::OnceLock<Arc<dyn AgentInstaller>>,
    /// Passes [`Provisioner::run`] has begun.
    passes: std::sync::atomic::AtomicU64,
}

/// The least time from the end of a pass to the next one a change asks
/// for: changes that come meanwhile are taken by that one pass.
pub const PASS_SPACING: Duration = Duration::from_millis(50);

/// How many times its own cost a pass is apart from the next one a change
/// asks for, when that is longer than [`PASS_SPACING`]: passes take at
/// most a quarter of the provisioner's time, however often the state
/// changes. Each pass reads every machine it could act on, and while
/// 100,000 unit agents started they committed all the time: the
/// provisioner passed back to back, re-reading every machine still being
/// started on a worker thread the agents needed, and took five times as
/// long to provision them.
const PASS_COST_SPACING: u32 = 3;

/// Makes what a machine's agent needs on its instance (see
/// [`jujube_providers::AgentInstall`]). Called once per start attempt, right
/// before the start request: each attempt gets a fresh credential whose
/// hash replaces the last one, so whatever instance the attempt ends up with
/// (a new one, or one adopted from an earlier attempt, which the provider
/// re-installs) holds a credential that works, and no earlier one does.
pub trait AgentInstaller: Send + Sync + 'static {
    /// `None` when machine `id`'s agent does not run on its instance.
    /// `nonce` is the start's (a launch batch's instances share user data).
    /// What it writes (a credential's hash, an enrollment) it writes through
    /// `store`, the provisioner's own: under a lease, it carries the lease's
    /// fence, so a provisioner that lost the lease cannot replace the
    /// credential of an instance its successor started.
    fn prepare(
        &self,
        store: &Store,
        machine: i64,
        nonce: &str,
    ) -> std::result::Result<Option<AgentInstall>, String>;
}

/// The provisioner for one environment. Cheap to clone.
#[derive(Clone)]
pub struct Provisioner {
    inner: Arc<Inner>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One machine being started: its nonce, the zone to try, the zones it may
/// use (in order of preference) and those it has tried. Its `StartSpec` is
/// made right before each request (`Attempt::spec`): 100,000 machines being
/// started hold an attempt each until their batch is done, and specs held
/// that long were tens of megabytes.
struct Attempt {
    machine: i64,
    nonce: String,
    zone: Option<String>,
    /// What the machine is started as, shared by a batch's members.
    shape: Arc<Shape>,
    /// The batch's zone order, shared by its members (100,000 machines
    /// being started hold one attempt each until their batch is done).
    zones: Arc<[String]>,
    tried: Vec<String>,
    last_error: String,
}

/// What a launch batch's machines share (a batch is formed of machines
/// alike in these).
struct Shape {
    series: String,
    constraints: jujube_core::Constraints,
    controller: bool,
}

impl Shape {
    fn of(m: &Machine) -> Shape {
        Shape {
            series: m.series.clone(),
            constraints: m.constraints.clone(),
            controller: m.manages_environ(),
        }
    }

    fn fits(&self, m: &Machine) -> bool {
        self.series == m.series
            && self.constraints == m.constraints
            && self.controller == m.manages_environ()
    }
}

fn start_spec(machine: i64, nonce: &str, shape: &Shape, zone: Option<String>) -> StartSpec {
    StartSpec {
        machine_id: machine.to_string(),
        nonce: nonce.to_string(),
        series: shape.series.clone(),
        constraints: shape.constraints.clone(),
        zone,
        controller: shape.controller,
        user_data: format!("#cloud-config\n# jujube machine {machine} nonce {nonce}\n"),
        agent: None,
    }
}

impl Attempt {
    fn prepared(&self) -> Prepared {
        Prepared {
            machine: self.machine,
            nonce: self.nonce.clone(),
        }
    }

    fn spec(&self) -> StartSpec {
        start_spec(self.machine, &self.nonce, &self.shape, self.zone.clone())
    }
}

impl Provisioner {
    pub fn new(store: Store, provider: Arc<dyn Provider>) -> Result<Provisioner> {
        Provisioner::with_clock(store, provider, Clock::system())
    }

    /// A provisioner whose stray grace periods run on `clock` (tests share
    /// one between provisioners to play a restart on tokio's paused clock).
    pub fn with_clock(
        store: Store,
        provider: Arc<dyn Provider>,
        clock: Clock,
    ) -> Result<Provisioner> {
        let env = store.environment()?;
        let cfg = config_for(provider.as_ref(), &store.environment_config()?)?;
        Ok(Provisioner {
            inner: Arc::new(Inner {
                store,
                provider,
                env_uuid: env.uuid,
                clock,
                slots: Slots::new(cfg.concurrency),
                cfg: Mutex::new(cfg),
                cfg_version: watch::channel(0).0,
                applied: Mutex::new(None),
                limiter: Mutex::new(None),
                inflight: Mutex::new(HashMap::new()),
                seen: Mutex::new(None),
                suspects: Mutex::new(HashMap::new()),
                reach: Mutex::new(None),
                last_listing: Mutex::new(None),
                tasks: Mutex::new(tokio::task::JoinSet::new()),
                stopping: watch::channel(false).0,
                installer: std::sync::OnceLock::new(),
                passes: Default::default(),
            }),
        })
    }

    /// How many passes [`Provisioner::run`] has begun.
    pub fn passes(&self) -> u64 {
        self.inner.passes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Installs machines' agents on their instances through `installer`
    /// from now on (the first call wins).
    pub fn install_agents(&self, installer: Arc<dyn AgentInstaller>) {
        let _ = self.inner.installer.set(installer);
    }

    fn cfg(&self) -> Config {
        lock(&self.inner.cfg).clone()
    }

    /// Re-reads environment config; applies it to the provider and to the
    /// provisioner when it changed, waking whatever waits on the old limits.
    async fn reload_config(&self) -> Result<()> {
        let current = self.inner.store.environment_config()?;
        if lock(&self.inner.applied).as_ref() == Some(&current) {
            return Ok(());
        }
        let cfg = config_for(self.inner.provider.as_ref(), &current)?;
        self.inner.provider.update_config(&current).await?;
        self.inner.slots.set_limit(cfg.concurrency);
        *lock(&self.inner.cfg) = cfg;
        *lock(&self.inner.applied) = Some(current);
        self.inner.cfg_version.send_modify(|v| *v += 1);
        Ok(())
    }

    /// Waits for a request token from the client-side limiter. Returns
    /// false when the provisioner stops first. A config change re-reads
    /// `provisioner-rate` at once: a waiting start never keeps an old bucket.
    async fn pace(&self, stopping: &mut watch::Receiver<bool>) -> bool {
        let mut changed = self.inner.cfg_version.subscribe();
        loop {
            let wait = {
                let rate = self.cfg().rate;
                let mut limiter = lock(&self.inner.limiter);
                let Some(rate) = rate else {
                    *limiter = None;
                    return true;
                };
                if limiter.as_ref().is_none_or(|(cur, _)| *cur != rate) {
                    *limiter = TokenBucket::parse(&rate).map(|b| (rate, b));
                }
                let Some((_, bucket)) = limiter.as_mut() else {
                    return true;
                };
                if bucket.try_take(1) {
                    return true;
                }
                bucket
                    .wait_for(1)
                    .clamp(Duration::from_millis(1), Duration::from_secs(3600))
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = changed.changed() => {}
                _ = stopped(stopping) => return false,
            }
        }
    }

    /// Runs until `stop` turns true: a pass whenever the state changes or
    /// the last pass asked to be requeued. Failed passes are retried with
    /// backoff. On stop, starts not yet sent are abandoned (their machines
    /// keep their nonces, so the next controller resumes them safely) and
    /// this returns once the requests in flight have been answered and
    /// recorded.
    pub async fn run(&self, mut stop: watch::Receiver<bool>) -> Result<()> {
        let mut watcher = self.inner.store.watch(self.inner.store.head_revision()?);
        let mut failures = 0u32;
        loop {
            self.inner
                .passes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let began = tokio::time::Instant::now();
            let pass = tokio::select! {
                r = self.reconcile() => Some(r),
                _ = stopped(&mut stop) => None,
            };
            let Some(pass) = pass else { break };
            let ended = tokio::time::Instant::now();
            let spaced = ended + PASS_SPACING.max((ended - began) * PASS_COST_SPACING);
            let failed = pass.is_err();
            let action = match pass {
                Ok(a) => {
                    failures = 0;
                    a
                }
                Err(e) => {
                    failures += 1;
                    let wait = Duration::from_millis(500 * 2u64.pow(failures.min(7)));
                    warn!(error = %e, retry_in = ?wait, "provisioning pass failed");
                    Action::Requeue(wait)
                }
            };
            let sleep = match action {
                Action::Requeue(d) => d,
                Action::AwaitChange => Duration::from_secs(3600),
            };
            // After a failed pass the backoff holds whatever else changes
            // (each pass reconciles everything, so nothing is missed; one on
            // every change re-read every machine to start and asked a
            // failing cloud again): only a config change, which may fix
            // the cause, ends it early.
            let until = tokio::time::Instant::now() + sleep;
            loop {
                tokio::select! {
                    r = watcher.next_head() => {
                        if !failed {
                            // Spaced from the last pass (a requeue that
                            // comes first still ends the wait).
                            tokio::select! {
                                _ = tokio::time::sleep_until(spaced.min(until)) => {}
                                _ = stopped(&mut stop) => {}
                            }
                            break;
                        }
                        // Asked of the store, not read change by change:
                        // a removal meanwhile is 100,000 of them.
                        let (since, head) = r?;
                        if self.inner.store.changed_between(
                            jujube_state::feed::ChangeKind::Environment,
                            since,
                            head,
                        )? {
                            break;
                        }
                    }
                    _ = tokio::time::sleep_until(until) => break,
                    _ = stopped(&mut stop) => break,
                }
            }
            if *stop.borrow() {
                break;
            }
        }
        self.inner.stopping.send_replace(true);
        self.idle().await;
        info!(passes = self.passes(), "the provisioner stopped");
        Ok(())
    }

    /// Waits until no start task is left.
    pub async fn idle(&self) {
        loop {
            let next = {
                let mut tasks = lock(&self.inner.tasks);
                if tasks.is_empty() {
                    return;
                }
                // Take the set out so the lock is not held across awaits.
                std::mem::take(&mut *tasks)
            };
            let mut next = next;
            while next.join_next().await.is_some() {}
        }
    }

    /// Records whether the provider answers, in state for `status` and
    /// `wait`; writes only on a change.
    fn reachable(&self, problem: Option<String>) -> Result<()> {
        let mut reach = lock(&self.inner.reach);
        if reach.as_ref() == Some(&problem) {
            return Ok(());
        }
        self.inner
            .store
            .set_provider_status(problem.as_deref(), self.inner.clock.unix())?;
        *reach = Some(problem);
        Ok(())
    }

    /// A provider call outside a start: its failure is the provider's
    /// status until a call succeeds.
    async fn provider_call<T>(
        &self,
        what: &str,
        call: impl Future<Output = jujube_providers::Result<T>>,
    ) -> Result<T> {
        match call.await {
            Ok(v) => {
                self.reachable(None)?;
                Ok(v)
            }
            Err(e) => {
                self.reachable(Some(format!("{what}: {e}")))?;
                Err(e.into())
            }
        }
    }

    /// One pass. Idempotent: running it again with nothing changed does
    /// nothing but look.
    pub async fn reconcile(&self) -> Result<Action> {
        self.reload_config().await?;
        let cfg = self.cfg();
        let store = &self.inner.store;
        let mut requeue: Option<Duration> = None;
        let soon = |d: Duration, r: &mut Option<Duration>| *r = Some(r.map_or(d, |x| x.min(d)));
        // Forget finished start tasks.
        while lock(&self.inner.tasks).try_join_next().is_some() {}

        // 1. Stop before start.
        // Dying machines are their agents' to set Dead (the agent runs on
        // the machine's instance); the controller only stops Dead ones.
        let inflight: HashSet<i64> = lock(&self.inner.inflight).keys().copied().collect();
        // A pass runs on every commit. Most find nothing to do, so they read
        // only the machines they could act on (an index holds them); every
        // machine is read only when starting some (zones are spread over
        // all of them). When the cloud is to be listed, the poller reads
        // the (machine, instance) pairs it watches and the harvest its lean
        // view of owners: 100,000 full rows every listing were a transient
        // of tens of megabytes.
        let due = lock(&self.inner.last_listing).is_none_or(|t| t.elapsed() >= cfg.list_interval);
        let actionable = store.actionable_machines()?;
        // Starting (or looking for a lost start) needs every machine; a pass
        // that only lists the cloud needs only what the poller watches,
        // read below (`Store::watched_instances`).
        let needs_all = actionable.iter().any(|m| {
            !inflight.contains(&m.id)
                && m.instance_id.is_none()
                && ((m.life != Life::Alive && m.nonce.is_some())
                    || (m.life == Life::Alive && m.status != machine_status::ERROR))
        });
        let machines = if needs_all {
            drop(actionable);
            store.machines()?
        } else {
            actionable
        };
        let dead: Vec<&Machine> = machines
            .iter()
            .filter(|m| m.life == Life::Dead && m.instance_id.is_some())
            .collect();
        for chunk in dead.chunks(100) {
            for m in chunk {
                store.set_stopping(m.id)?;
            }
            let ids: Vec<String> = chunk.iter().filter_map(|m| m.instance_id.clone()).collect();
            match self
                .provider_call(
                    "stopping instances",
                    self.inner.provider.stop_instances(&ids),
                )
                .await
            {
                Ok(()) => {
                    for m in chunk {
                        store.apply(
                            &Caller::Controller,
                            &AgentOp::RemoveMachine { machine: m.id },
                        )?;
                        info!(
                            machine = m.id,
                            instance = m.instance_id.as_deref().unwrap_or(""),
                            "stopped instance and removed machine"
                        );
                    }
                }
                Err(e) => {
                    warn!(error = %e, "stopping instances failed; will retry");
                    soon(Duration::from_secs(2), &mut requeue);
                }
            }
        }
        let mut listing: Option<Vec<Instance>> = None;
        for m in machines.iter().filter(|m| {
            m.life != Life::Alive && m.instance_id.is_none() && !inflight.contains(&m.id)
        }) {
            if let Some(nonce) = &m.nonce {
                // A start may have made an instance whose response was lost.
                if listing.is_none() {
                    listing = Some(self.list().await?);
                }
                let orphans: Vec<String> = listing
                    .iter()
                    .flatten()
                    .filter(|i| i.nonce() == Some(nonce.as_str()))
                    .map(|i| i.id.clone())
                    .collect();
                self.provider_call(
                    "stopping instances",
                    self.inner.provider.stop_instances(&orphans),
                )
                .await?;
            }
            // No instance: no agent can exist, so the controller may set it
            // Dead itself (the store checks that).
            let dead = store.apply(
                &Caller::Controller,
                &AgentOp::EnsureDeadMachine { machine: m.id },
            );
            let removed = dead.and_then(|()| {
                store.apply(
                    &Caller::Controller,
                    &AgentOp::RemoveMachine { machine: m.id },
                )
            });
            if removed.is_ok() {
                info!(machine = m.id, "removed unprovisioned machine");
            }
        }

        // 2. Start.
        let candidates: Vec<i64> = machines
            .iter()
            .filter(|m| {
                m.life == Life::Alive
                    && m.instance_id.is_none()
                    && m.status != machine_status::ERROR
                    && !inflight.contains(&m.id)
            })
            .map(|m| m.id)
            .collect();
        if !candidates.is_empty() {
            self.launch(&candidates, &machines).await?;
        }

        // 3. The cloud behind our back. What the poller needs of the
        // machines (read before the listing, as it needs) is kept; the rest
        // of the pass's machine list is done with: with 100,000 machines it
        // is tens of megabytes, not to be held beside the listing below.
        let watched = if needs_all {
            harvest::watched(&machines)
        } else if due {
            store.watched_instances()?
        } else {
            Vec::new()
        };
        drop(machines);
        if due || listing.is_some() {
            let instances = match listing {
                Some(l) => l,
                None => self.list().await?,
            };
            self.poll(&instances, &watched).await?;
            // Not held beside the harvest's view of every machine.
            drop(watched);
            if let Some(next) = self.harvest(&instances, &cfg).await? {
                soon(next, &mut requeue);
            }
        }
        let until_listing = lock(&self.inner.last_listing).map_or(Duration::ZERO, |t| {
            cfg.list_interval.saturating_sub(t.elapsed())
        });
        soon(until_listing.max(Duration::from_millis(100)), &mut requeue);
        if self.has_suspects() {
            debug!("an instance is missing from the listing; confirming at the next one");
        }
        Ok(requeue.map_or(Action::AwaitChange, Action::Requeue))
    }

    async fn list(&self) -> Result<Vec<Instance>> {
        let instances = self
            .provider_call("listing instances", self.inner.provider.instances())
            .await?;
        *lock(&self.inner.last_listing) = Some(Instant::now());
        Ok(instances)
    }

    #[cfg(test)]
    fn spec_for(&self, m: &Machine, nonce: &str) -> StartSpec {
        start_spec(m.id, nonce, &Shape::of(m), None)
    }

    /// Lists the zones, places the candidates in zones, forms launch batches
    /// of them, commits their nonces (each machine's names its batch and
    /// place in it), then starts each batch in a background task.
    async fn launch(&self, ids: &[i64], machines: &[Machine]) -> Result<()> {
        // Asked first: a provider that cannot be reached leaves the
        // machines as they are (and is shown in `status`).
        let zones = self
            .provider_call("listing zones", self.inner.provider.zones())
            .await?;
        let cfg = self.cfg();
        let by_id: HashMap<i64, &Machine> = machines.iter().map(|m| (m.id, m)).collect();
        let ids: Vec<i64> = ids
            .iter()
            .copied()
            .filter(|id| by_id.contains_key(id))
            .collect();
        let mut spread = {
            let inflight = lock(&self.inner.inflight).clone();
            let mut grouped = ids.clone();
            grouped.extend(inflight.keys());
            let mut spread = zones::Spread::new(
                self.inner.store.service_zone_counts()?,
                self.inner.store.services_on_machines(&grouped)?,
            );
            for m in machines.iter().filter(|m| m.life != Life::Dead) {
                if let Some(z) = &m.zone {
                    spread.count_recorded(z);
                } else if let Some(Some(z)) = inflight.get(&m.id) {
                    spread.count_placed(m.id, z);
                }
            }
            spread
        };
        // Each machine's zones, in the spread's order of preference.
        let mut placed: HashMap<i64, Vec<String>> = HashMap::with_capacity(ids.len());
        // A launch batch is one provider request: machines that share series,
        // constraints (hence instance type, image and disk), chosen zone and
        // whether they manage the environment, up to `provisioner-batch` of
        // them. A machine that has a nonce already keeps it, and with it the
        // batch a crashed controller committed (regrouped below).
        let mut batches: Vec<Vec<i64>> = Vec::new();
        let mut open: HashMap<(String, String, Option<String>, bool), usize> = HashMap::new();
        for id in ids {
            let m = by_id[&id];
            let allowed = match zones::allowed(m, &zones) {
                Ok(z) => z,
                Err(message) => {
                    self.fail(id, &message)?;
                    continue;
                }
            };
            let order = spread.choose(id, &allowed);
            let zone = order.first().cloned();
            placed.insert(id, order);
            if m.nonce.is_some() {
                batches.push(vec![id]);
                continue;
            }
            let key = (
                m.series.clone(),
                m.constraints.to_string(),
                zone,
                m.manages_environ(),
            );
            match open.get(&key) {
                Some(&b) if batches[b].len() < cfg.batch => batches[b].push(id),
                _ => {
                    open.insert(key, batches.len());
                    batches.push(vec![id]);
                }
            }
        }
        // Nonces only: status stays as it is until a start is sent
        // (`Store::mark_provisioning` in `start_batch`).
        let prepared = self
            .inner
            .store
            .prepare_batches(&batches, &self.inner.env_uuid)?;
        if prepared.is_empty() {
            return Ok(());
        }
        // Regroup by the committed batch: a batch re-formed after a crash
        // launches (or adopts) together again.
        let mut launches: Vec<Vec<&Prepared>> = Vec::new();
        let mut of_batch: HashMap<&str, usize> = HashMap::new();
        for p in &prepared {
            match launch_batch(&p.nonce) {
                Some((b, _)) => match of_batch.get(b) {
                    Some(&i) => launches[i].push(p),
                    None => {
                        of_batch.insert(b, launches.len());
                        launches.push(vec![p]);
                    }
                },
                None => launches.push(vec![p]),
            }
        }
        for mut launch in launches {
            launch.sort_by_key(|p| launch_batch(&p.nonce).map_or(0, |(_, k)| k));
            // One zone order for the whole batch, its first member's, so
            // that a capacity error moves the batch on together.
            let order: Arc<[String]> = launch
                .first()
                .and_then(|p| placed.get(&p.machine))
                .cloned()
                .unwrap_or_default()
                .into();
            let mut shape: Option<Arc<Shape>> = None;
            let batch: Vec<Attempt> = launch
                .iter()
                .filter_map(|Prepared { machine, nonce }| {
                    let m = by_id.get(machine)?;
                    let shape = match &shape {
                        Some(s) if s.fits(m) => s.clone(),
                        _ => shape.insert(Arc::new(Shape::of(m))).clone(),
                    };
                    Some(Attempt {
                        nonce: nonce.clone(),
                        zone: order.first().cloned(),
                        shape,
                        machine: *machine,
                        zones: order.clone(),
                        tried: vec![],
                        last_error: String::new(),
                    })
                })
                .collect();
            if batch.is_empty() {
                continue;
            }
            lock(&self.inner.inflight).extend(batch.iter().map(|a| (a.machine, a.zone.clone())));
            let this = self.clone();
            lock(&self.inner.tasks).spawn(async move {
                let machines: Vec<i64> = batch.iter().map(|a| a.machine).collect();
                if let Err(e) = this.start_batch(batch).await {
                    warn!(error = %e, "start batch failed; its machines will be tried again");
                }
                let mut inflight = lock(&this.inner.inflight);
                for m in machines {
                    inflight.remove(&m);
                }
            });
        }
        Ok(())
    }

    /// Starts and provisions machines now, waiting for the outcome (bootstrap
    /// uses this for machine 0). Returns the error status of any that failed.
    pub async fn provision_now(&self, ids: &[i64]) -> Result<Vec<(i64, String)>> {
        self.reload_config().await?;
        let machines = self.inner.store.machines()?;
        self.launch(ids, &machines).await?;
        self.idle().await;
        let mut failed = Vec::new();
        for &id in ids {
            let m = self.inner.store.machine(id)?;
            if m.instance_id.is_none() {
                failed.push((id, m.status_info));
            }
        }
        Ok(failed)
    }

    /// Machines whose start is given up because the provisioner stops:
    /// back to `pending`, nonces kept.
    fn abandon(&self, pending: &[Attempt]) -> Result<()> {
        let ids: Vec<i64> = pending.iter().map(|a| a.machine).collect();
        debug!(machines = ?ids, "shutting down: abandoning starts not yet sent");
        Ok(self.inner.store.abandon_provisioning(&ids)?)
    }

    async fn start_batch(&self, mut pending: Vec<Attempt>) -> Result<()> {
        let cfg = self.cfg();
        let mut backoff = backon::ExponentialBuilder::new()
            .with_jitter()
            .with_min_delay(Duration::from_millis(500))
            .with_max_delay(Duration::from_secs(30))
            .with_total_delay(Some(cfg.retry_for))
            .without_max_times()
            .build();
        let mut stopping = self.inner.stopping.subscribe();
        loop {
            // A slot of the controller's concurrency, then a token: both
            // waits give way to shutdown.
            let Some(slot) = self.inner.slots.acquire(&mut stopping).await else {
                return self.abandon(&pending);
            };
            if !self.pace(&mut stopping).await {
                return self.abandon(&pending);
            }
            // Now the start is really under way.
            let prepared: Vec<Prepared> = pending.iter().map(Attempt::prepared).collect();
            let go: HashSet<i64> = self
                .inner
                .store
                .mark_provisioning(&prepared)?
                .into_iter()
                .collect();
            pending.retain(|a| go.contains(&a.machine));
            if pending.is_empty() {
                return Ok(());
            }
            let mut specs: Vec<StartSpec> = pending.iter().map(Attempt::spec).collect();
            if let Some(installer) = self.inner.installer.get() {
                for (spec, a) in specs.iter_mut().zip(&pending) {
                    spec.agent = installer
                        .prepare(&self.inner.store, a.machine, &spec.nonce)
                        .map_err(|why| Error::Agent {
                            machine: a.machine,
                            why,
                        })?;
                }
            }
            let results = self.inner.provider.start_instances(&specs).await;
            drop(slot);
            let mut started = Vec::new();
            let mut retry = Vec::new();
            let mut moved_zone = false;
            for (mut a, r) in pending.into_iter().zip(results) {
                match r {
                    Ok(inst) => started.push(Started {
                        machine: a.machine,
                        nonce: a.nonce.clone(),
                        instance_id: inst.id,
                        zone: inst.zone.as_deref().map(str::to_string),
                        hardware: inst.hardware.to_string(),
                    }),
                    Err(e) => match e.class() {
                        ErrorClass::Transient => {
                            a.last_error = e.to_string();
                            retry.push(a);
                        }
                        ErrorClass::Capacity => {
                            if let Some(z) = a.zone.take() {
                                a.tried.push(z);
                            }
                            // Only zones the constraints allow, in the
                            // spread's order.
                            let next = a.zones.iter().find(|z| !a.tried.contains(z)).cloned();
                            if let Some(z) = next {
                                info!(machine = a.machine, zone = %z, error = %e, "no capacity; trying the next zone");
                                a.zone = Some(z);
                                a.last_error = e.to_string();
                                moved_zone = true;
                                retry.push(a);
                            } else {
                                let wanted = a.shape.constraints.zones();
                                let tried = a.tried.join(", ");
                                let scope = if wanted.is_empty() {
                                    format!("any zone (tried {tried})")
                                } else {
                                    format!(
                                        "the zones its constraints allow (`zones={}`; tried {tried})",
                                        wanted.join(",")
                                    )
                                };
                                self.fail(
                                    a.machine,
                                    &format!(
                                        "cannot start machine {}: no capacity in {scope}: {e}",
                                        a.machine
                                    ),
                                )?;
                            }
                        }
                        _ => self.fail(
                            a.machine,
                            &format!("cannot start machine {}: {e}", a.machine),
                        )?,
                    },
                }
            }
            self.record(&started).await?;
            if retry.is_empty() {
                return Ok(());
            }
            if *stopping.borrow() {
                return self.abandon(&retry);
            }
            let wait = if moved_zone && retry.iter().all(|a| !a.tried.is_empty()) {
                Some(Duration::ZERO)
            } else {
                backoff.next()
            };
            if let Some(wait) = wait {
                // Said from the first failed attempt on, in the log and in
                // each machine's status message.
                let notes: Vec<(i64, String)> = retry
                    .iter()
                    .map(|a| {
                        info!(machine = a.machine, error = %a.last_error, retry_in = ?wait, "start failed; retrying");
                        (
                            a.machine,
                            format!(
                                "start failed, retrying in {}s (for up to {}s in all): {}",
                                wait.as_secs_f64().ceil() as u64,
                                cfg.retry_for.as_secs(),
                                a.last_error
                            ),
                        )
                    })
                    .collect();
                self.inner.store.note_provisioning(&notes)?;
            }
            let Some(wait) = wait else {
                for a in &retry {
                    self.fail(
                        a.machine,
                        &format!(
                        "cannot start machine {}: gave up after {:?} of transient errors; last: {}",
                        a.machine, cfg.retry_for, a.last_error
                    ),
                    )?;
                }
                return Ok(());
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stopped(&mut stopping) => return self.abandon(&retry),
            }
            pending = retry;
        }
    }

    fn fail(&self, machine: i64, message: &str) -> Result<()> {
        warn!(machine, message, "provisioning failed");
        Ok(self.inner.store.set_provisioning_error(machine, message)?)
    }

    async fn record(&self, started: &[Started]) -> Result<()> {
        if started.is_empty() {
            return Ok(());
        }
        let outcome = self.inner.store.record_instances(started)?;
        let orphans: Vec<String> = started
            .iter()
            .zip(&outcome)
            .filter(|(_, o)| **o == Recorded::Orphaned)
            .map(|(s, _)| s.instance_id.clone())
            .collect();
        if !orphans.is_empty() {
            // The machine went away (or was re-nonced) while starting: nobody
            // owns these, so stop them now rather than leave them to the
            // stray harvest.
            warn!(
                ?orphans,
                "stopping instances whose machines went away during the start"
            );
            self.inner.provider.stop_instances(&orphans).await?;
        }
        for s in started
            .iter()
            .zip(&outcome)
            .filter(|(_, o)| **o == Recorded::Recorded)
        {
            debug!(machine = s.0.machine, instance = %s.0.instance_id, "machine started");
        }
        Ok(())
    }
}

/// The provisioner's settings: environment config, with the provider's
/// preferred batch size where the config names none.
fn config_for(provider: &dyn Provider, env: &BTreeMap<String, String>) -> Result<Config> {
    let mut cfg = Config::from_env(env)?;
    if !env.contains_key("provisioner-batch") {
        cfg.batch = provider.preferred_batch().max(1);
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests;
