//! One reader of the change feed for every agent in the process.
//!
//! The feed says *what kind* of entity changed and its id; the hub turns
//! that into notices for exactly the agents that can see the change, so that
//! 100,000 agents cost one feed reader and no polling per agent:
//!
//! | change | who is told |
//! |---|---|
//! | a unit appears, goes, or changes life | the unit; its principal (for a subordinate) or its machine (for a principal) |
//! | a relation appears, goes, or changes life | the units of its services (through the services' keys) |
//! | a service appears, goes, or changes life, relation count or settings | its units |
//! | a machine appears, goes, or changes life or instance | its agent, and the host that runs machine agents |
//! | a unit enters or leaves a scope, or its relation settings change | the units of that scope's container |
//! | the controllers' API addresses change | every machine agent (its view carries them) |
//!
//! Changes that matter to nobody (a status message, a unit count) are
//! dropped: the hub keeps the little it needs to tell (each unit's life,
//! machine and principal; each relation's life, scope and services; each
//! service's life, relation count and settings) and compares.

use futures_util::task::AtomicWaker;
use futures_util::Stream;
use jujube_agent::api::{Notice, NoticeStream};
use jujube_core::charm::Scope;
use jujube_core::Life;
use jujube_state::{ChangeKind, Changes, Store};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{watch, Notify};
use tracing::warn;

/// What a subscription listens to. Names are shared: a subscription's keys
/// are the router's own (a service's name once, not once per unit), and
/// the rare scope key is boxed (24 bytes a key, 300,000 keys).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Key {
    Machine(i64),
    Unit(Arc<str>),
    Service(Arc<str>),
    /// A relation scope's container: the principal's name in a
    /// container-scoped relation, "" in a global one.
    Scope(Box<(i64, Arc<str>)>),
}

/// One subscription: the latest notice not yet read, and the one task
/// reading it. A process may hold 200,000 of these: a `tokio::sync::watch`
/// channel, a boxed `unfold` and a map per key cost five times as much.
struct Slot {
    id: u64,
    keys: Box<[Key]>,
    unread: Mutex<Option<Notice>>,
    /// Set when the hub goes: the stream ends.
    closed: std::sync::atomic::AtomicBool,
    waker: AtomicWaker,
}

impl Slot {
    /// Notices coalesce: a slow reader sees the latest revision, never a
    /// backlog, and a resync is never lost to a later plain notice.
    fn post(&self, notice: Notice) {
        {
            let mut unread = lock(&self.unread);
            *unread = Some(match *unread {
                Some(old) => Notice {
                    revision: old.revision.max(notice.revision),
                    resync: old.resync || notice.resync,
                },
                None => notice,
            });
        }
        self.waker.wake();
    }

    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.waker.wake();
    }
}

/// The subscribers of one key: nearly always one (a unit's or a machine's
/// own agent), so no map unless there are more (boxed: the map of keys holds
/// 200,000 of these).
// Boxed on purpose (a map is 48 bytes inline; its rare extra allocation is
// cheaper than 200,000 keys each reserving that room).
#[allow(clippy::box_collection)]
enum Subs {
    One(Arc<Slot>),
    Many(Box<HashMap<u64, Arc<Slot>>>),
}

impl Subs {
    fn add(&mut self, slot: &Arc<Slot>) {
        match self {
            Subs::One(s) => {
                let mut m = HashMap::with_capacity(2);
                m.insert(s.id, s.clone());
                m.insert(slot.id, slot.clone());
                *self = Subs::Many(Box::new(m));
            }
            Subs::Many(m) => {
                m.insert(slot.id, slot.clone());
            }
        }
    }

    /// Whether none remain.
    fn remove(&mut self, id: u64) -> bool {
        match self {
            Subs::One(s) => s.id == id,
            Subs::Many(m) => {
                m.remove(&id);
                m.is_empty()
            }
        }
    }

    fn slots(&self) -> impl Iterator<Item = &Arc<Slot>> {
        let (one, many) = match self {
            Subs::One(s) => (Some(s), None),
            Subs::Many(m) => (None, Some(m.values())),
        };
        one.into_iter().chain(many.into_iter().flatten())
    }
}

type Subscribers = HashMap<Key, Subs>;

#[derive(Default)]
pub(crate) struct Hub {
    subs: Mutex<Subscribers>,
    next: AtomicU64,
    /// Machines whose existence, life or instance changed, for the host.
    machine_events: Mutex<BTreeSet<i64>>,
    pub(crate) machines_changed: Notify,
    /// Set once the first load is done (see [`Hub::ready`]).
    loaded: std::sync::atomic::AtomicBool,
    loaded_notify: Notify,
    /// The controllers' API addresses as last read (machine views carry
    /// them).
    api_addresses: Mutex<Arc<[String]>>,
    /// Where agents reach each controller machine's API, when that is not
    /// where the controllers record they serve (see
    /// [`crate::Facades::agents_reach_controllers_at`]).
    reach: std::sync::OnceLock<ControllerAddress>,
    /// Held through a reload's read of the store and its update (not
    /// `api_addresses`, which machine views take meanwhile): a reload
    /// racing the one `reach_controllers_at` makes cannot put back what it
    /// read before `reach` was set.
    reloading: Mutex<()>,
}

/// `addresses` with those on public IP addresses last, the others' order
/// kept: agents run in the controllers' network, where a controller's
/// private address is the short way (EC2 records a controller's public
/// address first, for clients outside).
fn private_first(addresses: Vec<String>) -> Vec<String> {
    let public = |a: &String| {
        let host = a.rsplit_once(':').map_or(a.as_str(), |(h, _)| h);
        match host.trim_start_matches('[').trim_end_matches(']').parse() {
            Ok(std::net::IpAddr::V4(ip)) => {
                !(ip.is_private() || ip.is_loopback() || ip.is_link_local() || ip.is_unspecified())
            }
            Ok(std::net::IpAddr::V6(ip)) => {
                let local = ip.is_loopback()
                    || (ip.segments()[0] & 0xfe00) == 0xfc00
                    || (ip.segments()[0] & 0xffc0) == 0xfe80;
                !local
            }
            Err(_) => false,
        }
    };
    let (public, private): (Vec<String>, Vec<String>) = addresses.into_iter().partition(public);
    private.into_iter().chain(public).collect()
}

#[cfg(test)]
#[test]
fn agents_try_every_controllers_private_address_before_public_ones() {
    let given: Vec<String> = [
        "54.1.2.3:17070",
        "10.0.0.1:17070",
        "unix:/var/lib/jujube/api.socket",
        "52.9.9.9:17070",
        "172.31.0.2:17070",
        "[2600:1f18::1]:17070",
        "[fd00::2]:17070",
        "127.0.0.1:40001",
    ]
    .map(String::from)
    .to_vec();
    assert_eq!(
        private_first(given),
        [
            "10.0.0.1:17070",
            "unix:/var/lib/jujube/api.socket",
            "172.31.0.2:17070",
            "[fd00::2]:17070",
            "127.0.0.1:40001",
            "54.1.2.3:17070",
            "52.9.9.9:17070",
            "[2600:1f18::1]:17070",
        ]
    );
}

/// Where agents reach controller machine N's API.
pub type ControllerAddress = Arc<dyn Fn(i64) -> String + Send + Sync>;

impl Drop for Hub {
    fn drop(&mut self) {
        for subs in lock(&self.subs).values() {
            for s in subs.slots() {
                s.close();
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A subscription's notices; dropping it unsubscribes.
struct Subscription {
    hub: Weak<Hub>,
    slot: Arc<Slot>,
}

impl Stream for Subscription {
    type Item = Notice;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Notice>> {
        let slot = &self.slot;
        let ready = || match lock(&slot.unread).take() {
            Some(n) => Some(Some(n)),
            None => slot.closed.load(Ordering::SeqCst).then_some(None),
        };
        if let Some(r) = ready() {
            return Poll::Ready(r);
        }
        slot.waker.register(cx.waker());
        // Posted (or closed) between the check and the registration: nobody
        // woke us.
        ready().map_or(Poll::Pending, Poll::Ready)
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Some(hub) = self.hub.upgrade() {
            let mut subs = lock(&hub.subs);
            for k in self.slot.keys.iter() {
                if subs.get_mut(k).is_some_and(|s| s.remove(self.slot.id)) {
                    subs.remove(k);
                }
            }
        }
    }
}

impl Hub {
    /// A stream of notices for changes to any of `keys`. Notices coalesce:
    /// a slow reader sees the latest revision, never a backlog.
    pub(crate) fn subscribe(self: &Arc<Hub>, keys: Vec<Key>) -> NoticeStream {
        let mut subs = lock(&self.subs);
        // The router's own copy of each known key (its names shared).
        let keys: Box<[Key]> = keys
            .into_iter()
            .map(|k| match subs.get_key_value(&k) {
                Some((known, _)) => known.clone(),
                None => k,
            })
            .collect();
        let slot = Arc::new(Slot {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            keys,
            unread: Mutex::new(None),
            closed: Default::default(),
            waker: AtomicWaker::new(),
        });
        for k in slot.keys.iter() {
            match subs.get_mut(k) {
                Some(s) => s.add(&slot),
                None => {
                    subs.insert(k.clone(), Subs::One(slot.clone()));
                }
            }
        }
        drop(subs);
        Box::pin(Subscription {
            hub: Arc::downgrade(self),
            slot,
        })
    }

    fn notify(&self, keys: &HashSet<Key>, notice: Notice) {
        let subs = lock(&self.subs);
        for k in keys {
            if let Some(m) = subs.get(k) {
                for s in m.slots() {
                    s.post(notice);
                }
            }
        }
    }

    fn notify_all(&self, notice: Notice) {
        for m in lock(&self.subs).values() {
            for s in m.slots() {
                s.post(notice);
            }
        }
    }

    /// Waits until the hub routes changes (its first load is done); a
    /// subscription made after this gets no start-up resync notice.
    pub(crate) async fn ready(&self) {
        loop {
            let notified = self.loaded_notify.notified();
            if self.loaded.load(Ordering::SeqCst) {
                return;
            }
            notified.await;
        }
    }

    /// The controllers' API addresses as last read.
    pub(crate) fn api_addresses(&self) -> Arc<[String]> {
        lock(&self.api_addresses).clone()
    }

    /// Agents reach controller machine N at `reach(N)` from now on.
    pub(crate) fn reach_controllers_at(
        &self,
        store: &Store,
        reach: ControllerAddress,
    ) -> jujube_state::Result<()> {
        let _ = self.reach.set(reach);
        self.reload_api_addresses(store)?;
        Ok(())
    }

    /// Reads the controllers' API addresses; whether they changed.
    fn reload_api_addresses(&self, store: &Store) -> jujube_state::Result<bool> {
        let _one = lock(&self.reloading);
        let now: Arc<[String]> = match self.reach.get() {
            Some(reach) => store
                .controller_machines()?
                .into_iter()
                .map(|m| reach(m))
                .collect(),
            // No machine is -1: every controller's, in machine order.
            None => private_first(store.controller_addresses(-1)?).into(),
        };
        let mut held = lock(&self.api_addresses);
        let changed = *held != now;
        *held = now;
        Ok(changed)
    }

    /// Takes the machines changed since the last call.
    pub(crate) fn take_machine_events(&self) -> BTreeSet<i64> {
        std::mem::take(&mut *lock(&self.machine_events))
    }

    /// Gives back events taken but not handled, for the next wake.
    pub(crate) fn keep_machine_events(&self, ids: impl IntoIterator<Item = i64>) {
        lock(&self.machine_events).extend(ids);
    }

    /// Reads the feed from revision `from` (taken by the caller before any
    /// agent subscribes, so that no change after an agent's first read is
    /// missed) and tells subscribers, until `stop`.
    pub(crate) async fn run(
        self: Arc<Hub>,
        store: Store,
        mut from: u64,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            match self.follow(&store, from, &mut stop).await {
                Ok(()) => return,
                Err(e) => {
                    warn!(error = %e, "change routing failed; restarting it");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = stop.changed() => return,
                    }
                    // Whatever was missed: everyone re-reads.
                    match store.head_revision() {
                        Ok(head) => from = head,
                        Err(_) => continue,
                    }
                    self.notify_all(Notice {
                        revision: from,
                        resync: true,
                    });
                }
            }
        }
    }

    async fn follow(
        &self,
        store: &Store,
        from: u64,
        stop: &mut watch::Receiver<bool>,
    ) -> jujube_state::Result<()> {
        let mut known = Known::load(store)?;
        self.reload_api_addresses(store)?;
        // A change between `from` and the load is already in `known`, so it
        // would look like no change: whoever subscribed meanwhile re-reads,
        // and the host looks at every machine again (a machine that got its
        // instance in between would otherwise never get its agent: the
        // host's own first look may have come before the instance).
        self.notify_all(Notice {
            revision: from,
            resync: true,
        });
        lock(&self.machine_events).extend(known.machines.keys().copied());
        self.machines_changed.notify_one();
        self.loaded.store(true, Ordering::SeqCst);
        self.loaded_notify.notify_waiters();
        let mut watcher = store
            .watch(from)
            .with_poll_interval(Duration::from_millis(100));
        loop {
            let batch = tokio::select! {
                b = watcher.next() => b?,
                r = stop.changed() => {
                    if r.is_err() || *stop.borrow() { return Ok(()) }
                    continue;
                }
            };
            if batch.truncated {
                warn!(
                    revision = batch.revision,
                    "the change feed was pruned past what this controller had routed; every agent here reads its state again"
                );
                known = Known::load(store)?;
                self.notify_all(Notice {
                    revision: batch.revision,
                    resync: true,
                });
                lock(&self.machine_events).extend(known.machines.keys().copied());
                self.machines_changed.notify_one();
                continue;
            }
            self.route(store, &mut known, &batch)?;
        }
    }

    fn route(&self, store: &Store, known: &mut Known, batch: &Changes) -> jujube_state::Result<()> {
        let mut units = BTreeSet::new();
        let mut relations = BTreeSet::new();
        let mut services = BTreeSet::new();
        let mut machines = BTreeSet::new();
        let mut scopes = BTreeSet::new();
        let mut runs = BTreeSet::new();
        let mut controllers = false;
        let mut environment = false;
        for c in &batch.changes {
            match c.kind {
                ChangeKind::Unit => {
                    units.insert(c.id.as_str());
                }
                ChangeKind::Relation => {
                    if let Ok(id) = c.id.parse::<i64>() {
                        relations.insert(id);
                    }
                }
                ChangeKind::Service => {
                    services.insert(c.id.as_str());
                }
                ChangeKind::Machine => {
                    if let Ok(id) = c.id.parse::<i64>() {
                        machines.insert(id);
                    }
                }
                ChangeKind::Scope | ChangeKind::Settings => {
                    if let Some((r, u)) = c.id.split_once('#') {
                        if let Ok(r) = r.parse::<i64>() {
                            scopes.insert((r, u));
                        }
                    }
                }
                // A run queued for a unit, or its leadership, is its own
                // agent's business only.
                ChangeKind::Run | ChangeKind::Leader => {
                    runs.insert(c.id.as_str());
                }
                ChangeKind::Controllers => controllers = true,
                ChangeKind::Environment => environment = true,
                ChangeKind::Cleanup => {}
            }
        }
        let mut keys: HashSet<Key> = runs.into_iter().map(|u| Key::Unit(u.into())).collect();
        // Rare (a controller started, or moved): every machine agent
        // re-reads its view, which carries the addresses.
        if controllers && self.reload_api_addresses(store)? {
            keys.extend(
                lock(&self.subs)
                    .keys()
                    .filter(|k| matches!(k, Key::Machine(_)))
                    .cloned(),
            );
        }
        let units: Vec<&str> = units.into_iter().collect();
        for (name, now) in units.iter().copied().zip(store.unit_links(&units)?) {
            let now = now.map(|u| UnitRoute {
                life: u.life,
                machine: u.machine_id,
                principal: u.principal.map(String::into_boxed_str),
                resolved: u.resolved.map(String::into_boxed_str),
            });
            let before = known.units.get(name);
            if before.map(|r| &r.resolved) != now.as_ref().map(|r| &r.resolved) {
                keys.insert(Key::Unit(name.into()));
            }
            if before.map(|r| r.life) != now.as_ref().map(|r| r.life) {
                keys.insert(Key::Unit(name.into()));
                for r in before.into_iter().chain(now.as_ref()) {
                    if let Some(p) = &r.principal {
                        keys.insert(Key::Unit(Arc::from(&**p)));
                    }
                    if let Some(m) = r.machine {
                        keys.insert(Key::Machine(m));
                    }
                }
            }
            match now {
                Some(r) => {
                    known.units.insert(name.to_string(), r);
                }
                None => {
                    known.units.remove(name);
                }
            }
        }
        let mut gone_relations = Vec::new();
        for id in relations {
            let now = match store.relation(id) {
                Ok(r) => Some(RelationRoute {
                    life: r.life,
                    scope: r.scope,
                    services: r.endpoints.into_iter().map(|e| e.service).collect(),
                }),
                Err(jujube_state::Error::NotFound { .. }) => None,
                Err(e) => return Err(e),
            };
            let before = known.relations.get(&id);
            if before.map(|r| r.life) != now.as_ref().map(|r| r.life) {
                for r in before.into_iter().chain(now.as_ref()) {
                    for s in &r.services {
                        keys.insert(Key::Service(s.as_str().into()));
                    }
                }
            }
            // A removed relation's scope changes in this batch still need
            // its scope kind: forget it only after routing them.
            match now {
                Some(r) => {
                    known.relations.insert(id, r);
                }
                None => gone_relations.push(id),
            }
        }
        // Juju's uniter resets its update-status timer when the interval
        // changes: every unit agent reads its view again (through its
        // service's key: a few keys, not one per unit), and a wait longer
        // than the new interval allows is drawn again.
        if environment {
            let now = update_status_setting(store)?;
            if now != known.update_status {
                keys.extend(
                    known
                        .services
                        .keys()
                        .map(|s| Key::Service(s.as_str().into())),
                );
                known.update_status = now;
            }
        }
        for name in services {
            let now = match store.service(name) {
                Ok(s) => Some((
                    s.life,
                    s.relation_count,
                    store.service_settings_raw(name)?,
                    s.charm_url,
                    s.leader_settings_version,
                )),
                Err(jujube_state::Error::NotFound { .. }) => None,
                Err(e) => return Err(e),
            };
            if known.services.get(name) != now.as_ref() {
                keys.insert(Key::Service(name.into()));
            }
            match now {
                Some(sig) => {
                    known.services.insert(name.to_string(), sig);
                }
                None => {
                    known.services.remove(name);
                }
            }
        }
        let mut machine_events = Vec::new();
        let machines: Vec<i64> = machines.into_iter().collect();
        for (id, now) in machines
            .iter()
            .copied()
            .zip(store.machine_links(&machines)?)
        {
            if known.machines.get(&id) != now.as_ref() {
                keys.insert(Key::Machine(id));
                machine_events.push(id);
            }
            match now {
                Some(sig) => {
                    known.machines.insert(id, sig);
                }
                None => {
                    known.machines.remove(&id);
                }
            }
        }
        for (rel, unit) in scopes {
            // An application's bag (its name has no `/`) belongs to no
            // container: every unit of the relation's services may act on
            // it.
            if !unit.contains('/') {
                for s in known
                    .relations
                    .get(&rel)
                    .map(|r| &r.services)
                    .into_iter()
                    .flatten()
                {
                    keys.insert(Key::Service(s.as_str().into()));
                }
                continue;
            }
            let container = match known.relations.get(&rel).map(|r| r.scope) {
                Some(Scope::Container) => known
                    .units
                    .get(unit)
                    .and_then(|u| u.principal.as_deref().map(str::to_string))
                    .unwrap_or_else(|| unit.to_string()),
                Some(Scope::Global) => String::new(),
                None => continue,
            };
            keys.insert(Key::Scope(Box::new((rel, container.into()))));
        }
        for id in gone_relations {
            known.relations.remove(&id);
        }
        if !machine_events.is_empty() {
            lock(&self.machine_events).extend(machine_events);
            self.machines_changed.notify_one();
        }
        self.notify(
            &keys,
            Notice {
                revision: batch.revision,
                resync: false,
            },
        );
        Ok(())
    }
}

/// (Boxed strings: the hub keeps one of these per unit.)
struct UnitRoute {
    life: Life,
    machine: Option<i64>,
    principal: Option<Box<str>>,
    /// `jujube resolved`'s mark: the unit's own agent waits for it.
    resolved: Option<Box<str>>,
}

struct RelationRoute {
    life: Life,
    scope: Scope,
    services: Vec<String>,
}

/// A service as the hub last saw it: life, relation count, settings, charm
/// (`upgrade-charm` wakes its units) and leader settings' version
/// (`leader-settings-changed` does).
type ServiceSeen = (Life, i64, Vec<(String, String)>, String, i64);

/// What the hub remembers to compare against.
struct Known {
    units: HashMap<String, UnitRoute>,
    relations: HashMap<i64, RelationRoute>,
    services: HashMap<String, ServiceSeen>,
    machines: HashMap<i64, (Life, bool)>,
    /// The environment's `update-status-hook-interval` as last read: every
    /// unit's view carries it, so a change of it is every service's.
    update_status: Option<std::time::Duration>,
}

/// The environment's `update-status-hook-interval`, if set (as a duration:
/// `5m` and `300s` are one interval).
fn update_status_setting(store: &Store) -> jujube_state::Result<Option<std::time::Duration>> {
    Ok(store
        .environment_config()?
        .get(jujube_state::environment::UPDATE_STATUS_KEY)
        .and_then(|v| jujube_state::environment::update_status_interval(v)))
}

impl Known {
    fn load(store: &Store) -> jujube_state::Result<Known> {
        let units = store
            .unit_routes()?
            .into_iter()
            .map(|u| {
                (
                    u.name,
                    UnitRoute {
                        life: u.life,
                        machine: u.machine,
                        principal: u.principal.map(String::into_boxed_str),
                        // Agents read it at start; only changes matter.
                        resolved: None,
                    },
                )
            })
            .collect();
        let relations = store
            .relations()?
            .into_iter()
            .map(|r| {
                (
                    r.id,
                    RelationRoute {
                        life: r.life,
                        scope: r.scope,
                        services: r.endpoints.into_iter().map(|e| e.service).collect(),
                    },
                )
            })
            .collect();
        let mut services = HashMap::new();
        for s in store.services()? {
            let settings = store.service_settings_raw(&s.name)?;
            services.insert(
                s.name,
                (
                    s.life,
                    s.relation_count,
                    settings,
                    s.charm_url,
                    s.leader_settings_version,
                ),
            );
        }
        let machines = store
            .machines()?
            .into_iter()
            .map(|m| (m.id, (m.life, m.instance_id.is_some())))
            .collect();
        Ok(Known {
            units,
            relations,
            services,
            machines,
            update_status: update_status_setting(store)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    fn notice(revision: u64, resync: bool) -> Notice {
        Notice { revision, resync }
    }

    fn keys(k: &[Key]) -> HashSet<Key> {
        k.iter().cloned().collect()
    }

    /// Notices coalesce, but a resync (the reader must re-read everything)
    /// survives a later plain notice, and every subscriber of a key is told.
    #[tokio::test]
    async fn coalesced_notices_keep_the_latest_revision_and_any_resync() {
        let hub = Arc::new(Hub::default());
        let unit = Key::Unit("a/0".into());
        let mut one = hub.subscribe(vec![unit.clone(), Key::Service("a".into())]);
        let mut two = hub.subscribe(vec![unit.clone()]);
        hub.notify_all(notice(5, true));
        hub.notify(&keys(std::slice::from_ref(&unit)), notice(7, false));
        assert_eq!(one.next().await, Some(notice(7, true)));
        assert_eq!(two.next().await, Some(notice(7, true)));
        hub.notify(&keys(&[Key::Service("a".into())]), notice(8, false));
        assert_eq!(one.next().await, Some(notice(8, false)));
        // Nothing for `two`: it does not watch the service.
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(two.as_mut().poll_next(&mut cx).is_pending());
    }

    /// A dropped stream leaves nothing behind in the hub; a dropped hub
    /// ends its streams.
    #[tokio::test]
    async fn subscriptions_go_with_their_streams_and_streams_with_the_hub() {
        let hub = Arc::new(Hub::default());
        let unit = Key::Unit("a/0".into());
        let one = hub.subscribe(vec![unit.clone(), Key::Machine(1)]);
        let two = hub.subscribe(vec![unit.clone()]);
        assert_eq!(lock(&hub.subs).len(), 2);
        drop(one);
        assert_eq!(lock(&hub.subs).len(), 1);
        assert!(matches!(lock(&hub.subs).get(&unit), Some(Subs::Many(m)) if m.len() == 1));
        drop(two);
        assert!(lock(&hub.subs).is_empty());
        let mut three = hub.subscribe(vec![unit]);
        drop(hub);
        assert_eq!(three.next().await, None);
    }
}
