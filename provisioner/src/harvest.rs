//! What changes in the cloud behind jujube's back, seen in the periodic
//! listing of the environment's instances (every `harvest-interval`):
//!
//! - **the instance poller** ([`Provisioner::poll`]): a machine whose
//!   recorded instance the cloud no longer has goes to `error`, its message
//!   naming the instance, and its `instance-status` to `gone`; `jujube
//!   resolved` then starts a replacement under a new nonce. Listings may lag
//!   behind starts on eventually consistent clouds, so an instance counts as
//!   gone only when it is missing from two listings in a row and from a
//!   lookup by id.
//! - **strays** ([`Provisioner::harvest`]): instances tagged with the
//!   environment's UUID that no machine owns, classified, shown, and reaped
//!   after a grace period under `harvest-mode`. When each was first seen
//!   (and in which class) is kept in state (the `strays` table), so a
//!   controller restart does not restart the grace period; a change of class
//!   (e.g. `errored` → `unknown` after `retry-provisioning`) does. An
//!   instance whose machine is being started is never touched: on LXD the
//!   retry's container has the failed start's name. Providers whose ids are
//!   reused check, right before deleting, that the instance is still the
//!   one listed ([`jujube_providers::Provider::reap_instances`]).

use crate::{lock, Provisioner, Result};
use jujube_core::Life;
use jujube_providers::Instance;
use jujube_state::model::machine_status;
use jujube_state::provisioning::{instance_digest, Owner, Stray};
use jujube_state::Machine;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tracing::{info, warn};

/// When a stray was first seen, and as what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    pub class: String,
    /// Unix milliseconds on the provisioner's [`crate::Clock`].
    pub since_ms: i64,
}

/// What the instance poller watches: the Alive machines not in error that
/// have an instance, as (machine, instance id). Only this is kept of a
/// pass's machine list while the instances are listed.
pub(crate) fn watched(machines: &[Machine]) -> Vec<(i64, String)> {
    machines
        .iter()
        .filter(|m| m.life == Life::Alive && m.status != machine_status::ERROR)
        .filter_map(|m| m.instance_id.as_ref().map(|i| (m.id, i.clone())))
        .collect()
}

impl Provisioner {
    /// The instance poller. `watched` ([`watched`]) must have been read
    /// before `listed` was asked for, so that every instance it records
    /// existed when the listing was made.
    pub(crate) async fn poll(&self, listed: &[Instance], watched: &[(i64, String)]) -> Result<()> {
        let listed: HashSet<&str> = listed.iter().map(|i| i.id.as_str()).collect();
        let missing: Vec<(i64, String)> = watched
            .iter()
            .filter(|(_, i)| !listed.contains(i.as_str()))
            .cloned()
            .collect();
        let before = std::mem::take(&mut *lock(&self.inner.suspects));
        if missing.is_empty() {
            return Ok(());
        }
        let ids: Vec<String> = missing.iter().map(|(_, i)| i.clone()).collect();
        let found: HashSet<String> = self
            .provider_call(
                "looking up instances",
                self.inner.provider.instances_by_id(&ids),
            )
            .await?
            .into_iter()
            .map(|i| i.id)
            .collect();
        let mut suspects = HashMap::new();
        for (m, inst) in missing.into_iter().filter(|(_, i)| !found.contains(i)) {
            if before.get(&m) != Some(&inst) {
                // Missing once: look again at the next listing.
                suspects.insert(m, inst);
                continue;
            }
            let message = format!(
                "instance `{inst}` is gone: the cloud no longer has it (stopped or terminated outside jujube); `jujube resolved {m}` starts a replacement"
            );
            if self.inner.store.set_instance_gone(m, &inst, &message)? {
                warn!(machine = m, instance = %inst, "instance gone behind jujube's back");
            }
        }
        *lock(&self.inner.suspects) = suspects;
        Ok(())
    }

    /// True when the poller suspects an instance is gone and wants the next
    /// listing to confirm it.
    pub(crate) fn has_suspects(&self) -> bool {
        !lock(&self.inner.suspects).is_empty()
    }

    /// First-seen times: in memory, seeded from state once per
    /// provisioner (so that they survive restarts).
    fn seen(&self) -> Result<HashMap<String, Seen>> {
        if let Some(seen) = lock(&self.inner.seen).clone() {
            return Ok(seen);
        }
        Ok(self
            .inner
            .store
            .strays()?
            .into_iter()
            .map(|s| {
                (
                    s.instance_id,
                    Seen {
                        class: s.class,
                        since_ms: s.first_seen * 1000,
                    },
                )
            })
            .collect())
    }

    /// Classifies unowned instances, reaps the eligible ones whose grace has
    /// passed (up to the cap), and records the view. Returns when the next
    /// stray becomes eligible.
    pub(crate) async fn harvest(
        &self,
        instances: &[Instance],
        cfg: &crate::Config,
    ) -> Result<Option<Duration>> {
        let store = &self.inner.store;
        // Only what ownership needs of each machine (see `Store::owners`).
        let owners = store.owners()?;
        let next_id = store.next_machine_id()?;
        // Machines being started: in flight here, or marked by a start
        // under way.
        let starting: HashSet<i64> = lock(&self.inner.inflight)
            .keys()
            .copied()
            .chain(owners.iter().filter(|m| m.provisioning).map(|m| m.machine))
            .collect();
        // Owners are in machine id order: an instance is found through the
        // machine its tags name (nearly all are), without a set of 100,000
        // ids beside the listing; the set is made only when some instance is
        // not where its tags say (then whichever machine recorded it owns it).
        let owner = |id: i64| {
            owners
                .binary_search_by_key(&id, |o| o.machine)
                .ok()
                .map(|i| &owners[i])
        };
        let mut by_instance: Option<HashSet<u64>> = None;
        let mut recorded = |inst: &Instance| {
            let digest = instance_digest(&inst.id);
            let tagged = inst.machine_id().and_then(|t| t.parse::<i64>().ok());
            if tagged.and_then(owner).is_some_and(|o| o.instance == digest) {
                return true;
            }
            by_instance
                .get_or_insert_with(|| {
                    owners
                        .iter()
                        .map(|m| m.instance)
                        .filter(|&d| d != 0)
                        .collect()
                })
                .contains(&digest)
        };
        // `Owner::nonce` is there only while the machine has no instance.
        let by_nonce: HashMap<&str, &Owner> = owners
            .iter()
            .filter_map(|m| m.nonce.as_deref().map(|n| (n, m)))
            .collect();
        let now = self.inner.clock.unix_ms();
        let grace = i64::try_from(cfg.grace.as_millis()).unwrap_or(i64::MAX);
        let mut seen = self.seen()?;
        let mut view = Vec::new();
        let mut reap: Vec<Instance> = Vec::new();
        let mut next: Option<Duration> = None;
        let mut seen_now = HashSet::new();
        for inst in instances {
            if recorded(inst) {
                continue;
            }
            let machine = inst.machine_id().and_then(|t| t.parse::<i64>().ok());
            if machine.is_some_and(|m| starting.contains(&m)) {
                // Its machine is being started: on LXD this may be the very
                // container the start is making. Leave it alone, keeping
                // its first-seen time.
                seen_now.insert(inst.id.clone());
                continue;
            }
            let class = match inst.nonce().and_then(|n| by_nonce.get(n)) {
                // About to be recorded: it is owned.
                Some(m) if !m.in_error => continue,
                Some(_) => "errored",
                None => match machine {
                    Some(id) if id < next_id && owner(id).is_none() => "destroyed",
                    _ => "unknown",
                },
            };
            seen_now.insert(inst.id.clone());
            let entry = seen.entry(inst.id.clone()).or_insert_with(|| Seen {
                class: class.to_string(),
                since_ms: now,
            });
            if entry.class != class {
                // A new class is a new reason to reap: its grace starts now.
                *entry = Seen {
                    class: class.to_string(),
                    since_ms: now,
                };
            }
            let since = entry.since_ms;
            let eligible = cfg.harvest.reaps(class);
            let reap_at = since.saturating_add(grace);
            if eligible {
                if now >= reap_at && reap.len() < cfg.harvest_cap {
                    reap.push(inst.clone());
                } else {
                    let wait = Duration::from_millis((reap_at - now).max(100) as u64);
                    next = Some(next.map_or(wait, |n: Duration| n.min(wait)));
                }
            }
            view.push(Stray {
                instance_id: inst.id.clone(),
                machine_tag: inst.machine_id().unwrap_or("").to_string(),
                class: class.to_string(),
                first_seen: since.div_euclid(1000),
                reap_at: eligible.then(|| reap_at.div_euclid(1000)),
            });
        }
        seen.retain(|id, _| seen_now.contains(id));
        if !reap.is_empty() {
            let ids: Vec<&str> = reap.iter().map(|i| i.id.as_str()).collect();
            info!(instances = ?ids, mode = ?cfg.harvest, "reaping stray instances");
            self.provider_call(
                "stopping stray instances",
                self.inner.provider.reap_instances(&reap),
            )
            .await?;
            view.retain(|s| !ids.contains(&s.instance_id.as_str()));
            for id in &ids {
                seen.remove(*id);
            }
            // More may be due (the cap), and the listing must catch up.
            *lock(&self.inner.last_listing) = None;
            next = Some(Duration::from_millis(100));
        }
        *lock(&self.inner.seen) = Some(seen);
        store.set_strays(&view)?;
        Ok(next)
    }
}
