//! The provisioner: makes the machines in state and the instances in a cloud
//! agree.
//!
//! # Layout
//! - [`config`]: settings from environment config, reloaded live.
//! - this file: [`Provisioner::reconcile`], one idempotent pass shaped like
//!   kube-runtime's reconciler — it reads the whole desired state, acts, and
//!   returns an [`Action`] saying when to look again — and
//!   [`Provisioner::run`], which calls it whenever the change feed moves or
//!   the requeue time comes.
//!
//! # A pass
//! 1. **Stop before start.** Dying machines with no units are set Dead (until
//!    machine agents exist). Dead machines' instances are stopped, then the
//!    machines removed. Non-Alive machines without an instance are removed —
//!    after stopping anything a half-finished start left under their nonce.
//! 2. **Start.** Alive machines without an instance and not in error get a
//!    nonce *committed before the start*, then are started in batches, a
//!    bounded number of requests at a time, paced by a client-side token
//!    bucket. Transient errors are retried with jittered exponential backoff
//!    for a bounded time; capacity errors move to the next zone; anything
//!    else, or giving up, leaves the machine with no instance id and an
//!    `error` status saying what failed and why. Starts are idempotent per
//!    nonce, so a crash anywhere yields at most one instance per machine: the
//!    next start with the same nonce returns the instance the lost one made.
//! 3. **Strays.** Instances tagged with this environment's UUID that no
//!    machine owns are reported, and reaped after a grace period according to
//!    `harvest-mode`, a few per pass. Instances without the tag are never
//!    listed, so never touched.

pub mod config;

use backon::BackoffBuilder;
pub use config::{Config, HarvestMode};
use jujube_core::Life;
use jujube_providers::bucket::TokenBucket;
use jujube_providers::{launch_batch, ErrorClass, Instance, Provider, StartSpec};
use jujube_state::model::machine_status;
use jujube_state::provisioning::{Owner, Prepared, Recorded, Started, Stray};
use jujube_state::{Machine, Store};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
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
    cfg: Mutex<Config>,
    applied: Mutex<Option<BTreeMap<String, String>>>,
    limiter: tokio::sync::Mutex<Option<(String, TokenBucket)>>,
    inflight: Mutex<HashSet<i64>>,
    first_seen: Mutex<HashMap<String, (Instant, SystemTime)>>,
    last_listing: Mutex<Option<Instant>>,
    tasks: Mutex<tokio::task::JoinSet<()>>,
    stopping: watch::Sender<bool>,
}

/// The provisioner for one environment. Cheap to clone.
#[derive(Clone)]
pub struct Provisioner {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn unix(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// One machine being started: its spec and the zones it has tried.
struct Attempt {
    spec: StartSpec,
    machine: i64,
    tried: Vec<String>,
    last_error: String,
}

impl Provisioner {
    pub fn new(store: Store, provider: Arc<dyn Provider>) -> Result<Provisioner> {
        let env = store.environment()?;
        let cfg = config_for(provider.as_ref(), &store.environment_config()?)?;
        Ok(Provisioner {
            inner: Arc::new(Inner {
                store,
                provider,
                env_uuid: env.uuid,
                cfg: Mutex::new(cfg),
                applied: Mutex::new(None),
                limiter: tokio::sync::Mutex::new(None),
                inflight: Mutex::new(HashSet::new()),
                first_seen: Mutex::new(HashMap::new()),
                last_listing: Mutex::new(None),
                tasks: Mutex::new(tokio::task::JoinSet::new()),
                stopping: watch::channel(false).0,
            }),
        })
    }

    fn cfg(&self) -> Config {
        lock(&self.inner.cfg).clone()
    }

    /// Re-reads environment config; applies it to the provider and to the
    /// provisioner when it changed.
    async fn reload_config(&self) -> Result<()> {
        let current = self.inner.store.environment_config()?;
        if lock(&self.inner.applied).as_ref() == Some(&current) {
            return Ok(());
        }
        let cfg = config_for(self.inner.provider.as_ref(), &current)?;
        self.inner.provider.update_config(&current).await?;
        *lock(&self.inner.cfg) = cfg;
        *lock(&self.inner.applied) = Some(current);
        Ok(())
    }

    /// Waits for a request token from the client-side limiter.
    async fn pace(&self) {
        let rate = self.cfg().rate;
        let mut guard = self.inner.limiter.lock().await;
        match (&rate, guard.as_ref()) {
            (None, _) => {
                *guard = None;
                return;
            }
            (Some(r), Some((cur, _))) if r == cur => {}
            (Some(r), _) => *guard = TokenBucket::parse(r).map(|b| (r.clone(), b)),
        }
        if let Some((_, bucket)) = guard.as_mut() {
            loop {
                let wait = bucket.wait_for(1);
                if wait.is_zero() && bucket.try_take(1) {
                    return;
                }
                tokio::time::sleep(wait.max(Duration::from_millis(1))).await;
            }
        }
    }

    /// Runs until `stop` turns true: a pass whenever the state changes or
    /// the last pass asked to be requeued. Failed passes are retried with
    /// backoff. On stop, waits for in-flight starts to finish their current
    /// request (their machines keep their nonces, so nothing is lost).
    pub async fn run(&self, mut stop: watch::Receiver<bool>) -> Result<()> {
        let mut watcher = self.inner.store.watch(self.inner.store.head_revision()?);
        let mut failures = 0u32;
        loop {
            let action = match self.reconcile().await {
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
            tokio::select! {
                r = watcher.next() => { r?; }
                _ = tokio::time::sleep(sleep) => {}
                _ = stop.changed() => {}
            }
            if *stop.borrow() {
                break;
            }
        }
        self.inner.stopping.send_replace(true);
        self.idle().await;
        Ok(())
    }

    /// Waits until no start is in flight.
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

    /// One pass. Idempotent: running it again with nothing changed does
    /// nothing but look.
    pub async fn reconcile(&self) -> Result<Action> {
        self.reload_config().await?;
        let cfg = self.cfg();
        let store = &self.inner.store;
        let mut requeue: Option<Duration> = None;
        let soon = |d: Duration, r: &mut Option<Duration>| *r = Some(r.map_or(d, |x| x.min(d)));

        // 1. Stop before start.
        let inflight = lock(&self.inner.inflight).clone();
        for m in store
            .machines()?
            .iter()
            .filter(|m| m.life == Life::Dying && !m.manages_environ())
        {
            // Until machine agents exist, the controller sets Dying machines
            // Dead once no unit is assigned (refused otherwise: skip).
            if store.units_on_machine(m.id)?.is_empty() {
                let _ = store.ensure_dead_machine(m.id);
            }
        }
        let machines = store.machines()?;
        let dead: Vec<&Machine> = machines
            .iter()
            .filter(|m| m.life == Life::Dead && m.instance_id.is_some())
            .collect();
        for chunk in dead.chunks(100) {
            for m in chunk {
                store.set_stopping(m.id)?;
            }
            let ids: Vec<String> = chunk.iter().filter_map(|m| m.instance_id.clone()).collect();
            match self.inner.provider.stop_instances(&ids).await {
                Ok(()) => {
                    for m in chunk {
                        store.remove_machine(m.id)?;
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
                self.inner.provider.stop_instances(&orphans).await?;
            }
            if store.ensure_dead_machine(m.id).is_ok() && store.remove_machine(m.id).is_ok() {
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

        // The pass's machine list is done with: with 100,000 machines it is
        // tens of megabytes, not to be held beside the listing below.
        drop(machines);

        // 3. Strays.
        let due = lock(&self.inner.last_listing).is_none_or(|t| t.elapsed() >= cfg.list_interval);
        if due || listing.is_some() {
            let instances = match listing {
                Some(l) => l,
                None => self.list().await?,
            };
            if let Some(next) = self.harvest(&instances, &cfg).await? {
                soon(next, &mut requeue);
            }
        }
        let until_listing = lock(&self.inner.last_listing).map_or(Duration::ZERO, |t| {
            cfg.list_interval.saturating_sub(t.elapsed())
        });
        soon(until_listing.max(Duration::from_millis(100)), &mut requeue);
        Ok(requeue.map_or(Action::AwaitChange, Action::Requeue))
    }

    async fn list(&self) -> Result<Vec<Instance>> {
        let instances = self.inner.provider.instances().await?;
        *lock(&self.inner.last_listing) = Some(Instant::now());
        Ok(instances)
    }

    fn spec_for(&self, m: &Machine, nonce: &str) -> StartSpec {
        StartSpec {
            machine_id: m.id.to_string(),
            nonce: nonce.to_string(),
            series: m.series.clone(),
            constraints: m.constraints.clone(),
            zone: None,
            controller: m.manages_environ(),
            user_data: format!("#cloud-config\n# jujube machine {} nonce {nonce}\n", m.id),
        }
    }

    /// Forms launch batches of the candidates, commits their nonces (each
    /// machine's names its batch and place in it), then starts each batch in
    /// a background task.
    async fn launch(&self, ids: &[i64], machines: &[Machine]) -> Result<()> {
        let cfg = self.cfg();
        let zones = self.inner.provider.zones().await?;
        let by_id: HashMap<i64, &Machine> = machines.iter().map(|m| (m.id, m)).collect();
        // Spread machines over zones; constraints may name some.
        let zone_of = |m: &Machine| -> Option<String> {
            let allowed: Vec<&String> = if m.constraints.zones().is_empty() {
                zones.iter().collect()
            } else {
                zones
                    .iter()
                    .filter(|z| m.constraints.zones().contains(z))
                    .collect()
            };
            allowed
                .get(m.id as usize % allowed.len().max(1))
                .map(|z| z.to_string())
        };
        // A launch batch is one provider request: machines that share series,
        // constraints (hence instance type, image and disk) and zone, up to
        // `provisioner-batch` of them. A machine that has a nonce already
        // keeps it, and with it the batch a crashed controller committed.
        let mut batches: Vec<Vec<i64>> = Vec::new();
        let mut open: HashMap<(String, String, Option<String>, bool), usize> = HashMap::new();
        for id in ids {
            let Some(m) = by_id.get(id) else { continue };
            if m.nonce.is_some() {
                batches.push(vec![m.id]);
                continue;
            }
            let key = (
                m.series.clone(),
                m.constraints.to_string(),
                zone_of(m),
                m.manages_environ(),
            );
            match open.get(&key) {
                Some(&b) if batches[b].len() < cfg.batch => batches[b].push(m.id),
                _ => {
                    open.insert(key, batches.len());
                    batches.push(vec![m.id]);
                }
            }
        }
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
        let sem = Arc::new(tokio::sync::Semaphore::new(cfg.concurrency));
        lock(&self.inner.inflight).extend(prepared.iter().map(|p| p.machine));
        for mut launch in launches {
            launch.sort_by_key(|p| launch_batch(&p.nonce).map_or(0, |(_, k)| k));
            // One zone for the whole batch: its first member's.
            let zone = launch
                .first()
                .and_then(|p| by_id.get(&p.machine))
                .and_then(|m| zone_of(m));
            let attempts: Vec<Attempt> = launch
                .iter()
                .filter_map(|Prepared { machine, nonce }| {
                    let m = by_id.get(machine)?;
                    let mut spec = self.spec_for(m, nonce);
                    spec.zone = zone.clone();
                    Some(Attempt {
                        spec,
                        machine: *machine,
                        tried: vec![],
                        last_error: String::new(),
                    })
                })
                .collect();
            let this = self.clone();
            let sem = sem.clone();
            let zones = zones.clone();
            lock(&self.inner.tasks).spawn(async move {
                let _permit = sem.acquire_owned().await;
                let machines: Vec<i64> = attempts.iter().map(|a| a.machine).collect();
                if let Err(e) = this.start_batch(attempts, &zones).await {
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

    async fn start_batch(&self, mut pending: Vec<Attempt>, zones: &[String]) -> Result<()> {
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
            self.pace().await;
            let specs: Vec<StartSpec> = pending.iter().map(|a| a.spec.clone()).collect();
            let results = self.inner.provider.start_instances(&specs).await;
            let mut started = Vec::new();
            let mut retry = Vec::new();
            let mut moved_zone = false;
            for (mut a, r) in pending.into_iter().zip(results) {
                match r {
                    Ok(inst) => started.push(Started {
                        machine: a.machine,
                        nonce: a.spec.nonce.clone(),
                        instance_id: inst.id,
                        zone: inst.zone,
                        hardware: inst.hardware,
                    }),
                    Err(e) => match e.class() {
                        ErrorClass::Transient => {
                            debug!(machine = a.machine, error = %e, "transient start failure; retrying");
                            a.last_error = e.to_string();
                            retry.push(a);
                        }
                        ErrorClass::Capacity => {
                            if let Some(z) = a.spec.zone.take() {
                                a.tried.push(z);
                            }
                            let next = zones.iter().find(|z| !a.tried.contains(z)).cloned();
                            if let Some(z) = next {
                                info!(machine = a.machine, zone = %z, error = %e, "no capacity; trying the next zone");
                                a.spec.zone = Some(z);
                                a.last_error = e.to_string();
                                moved_zone = true;
                                retry.push(a);
                            } else {
                                self.fail(a.machine, &format!(
                                    "cannot start machine {}: no capacity in any zone (tried {}): {e}",
                                    a.machine,
                                    a.tried.join(", ")
                                ))?;
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
                return Ok(());
            }
            let wait = if moved_zone && retry.iter().all(|a| !a.tried.is_empty()) {
                Some(Duration::ZERO)
            } else {
                backoff.next()
            };
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
                _ = stopping.changed() => return Ok(()),
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

    /// Classifies unowned instances, reaps the eligible ones whose grace has
    /// passed (up to the cap), and records the view. Returns when the next
    /// stray becomes eligible.
    async fn harvest(&self, instances: &[Instance], cfg: &Config) -> Result<Option<Duration>> {
        let store = &self.inner.store;
        // Only what ownership needs of each machine (see `Store::owners`).
        let owners = store.owners()?;
        let next_id = store.next_machine_id()?;
        let inflight = lock(&self.inner.inflight).clone();
        let by_instance: HashSet<&str> = owners
            .iter()
            .filter_map(|m| m.instance_id.as_deref())
            .collect();
        let by_nonce: HashMap<&str, &Owner> = owners
            .iter()
            .filter_map(|m| m.nonce.as_deref().map(|n| (n, m)))
            .collect();
        let existing: HashSet<i64> = owners.iter().map(|m| m.machine).collect();
        let now = Instant::now();
        let wall = SystemTime::now();
        let mut first_seen = lock(&self.inner.first_seen).clone();
        let mut view = Vec::new();
        let mut reap = Vec::new();
        let mut next: Option<Duration> = None;
        let mut seen_now = HashSet::new();
        for inst in instances {
            if by_instance.contains(inst.id.as_str()) {
                continue;
            }
            let class = match inst.nonce().and_then(|n| by_nonce.get(n)) {
                // Being started, or about to be recorded: it is owned.
                Some(m) if inflight.contains(&m.machine) || !m.in_error => continue,
                Some(_) => "errored",
                None => match inst.machine_id().and_then(|t| t.parse::<i64>().ok()) {
                    Some(id) if id < next_id && !existing.contains(&id) => "destroyed",
                    _ => "unknown",
                },
            };
            seen_now.insert(inst.id.clone());
            let (t0, w0) = *first_seen.entry(inst.id.clone()).or_insert((now, wall));
            let eligible = cfg.harvest.reaps(class);
            let reap_at = t0 + cfg.grace;
            if eligible {
                if now >= reap_at && reap.len() < cfg.harvest_cap {
                    reap.push(inst.id.clone());
                } else {
                    let wait = reap_at
                        .saturating_duration_since(now)
                        .max(Duration::from_millis(100));
                    next = Some(next.map_or(wait, |n: Duration| n.min(wait)));
                }
            }
            view.push(Stray {
                instance_id: inst.id.clone(),
                machine_tag: inst.machine_id().unwrap_or("").to_string(),
                class: class.to_string(),
                first_seen: unix(w0),
                reap_at: eligible.then(|| unix(w0 + cfg.grace)),
            });
        }
        first_seen.retain(|id, _| seen_now.contains(id));
        if !reap.is_empty() {
            info!(instances = ?reap, mode = ?cfg.harvest, "reaping stray instances");
            self.inner.provider.stop_instances(&reap).await?;
            view.retain(|s| !reap.contains(&s.instance_id));
            for id in &reap {
                first_seen.remove(id);
            }
            // More may be due (the cap), and the listing must catch up.
            *lock(&self.inner.last_listing) = None;
            next = Some(Duration::from_millis(100));
        }
        *lock(&self.inner.first_seen) = first_seen;
        store.set_strays(&view)?;
        Ok(next)
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
