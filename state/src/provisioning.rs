//! What the provisioner records: nonces before starts, instances after,
//! provisioning errors, and the strays it sees. Operations on many machines
//! work in transactions of at most [`PROVISIONING_BATCH`] machines, so that a
//! thousand starts cost a handful of commits and no transaction grows with
//! the model; each batch is whole, and calling again finishes what a failure
//! part-way left.

use crate::db::{Store, Tx};
use crate::feed::ChangeKind;
use crate::model::{get_machine, instance_status, machine_status};
use crate::sql::OptionalExtension;
use crate::{Entity, Error, Result};
use jujube_core::Life;

/// Machines per transaction in [`Store::prepare_provisioning`],
/// [`Store::record_instances`] and [`Store::retry_all_provisioning`] (at most
/// three rows each).
pub const PROVISIONING_BATCH: usize = 256;

/// A machine made ready to start: the nonce to start it with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    pub machine: i64,
    pub nonce: String,
}

/// An instance started for a machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started {
    pub machine: i64,
    pub nonce: String,
    pub instance_id: String,
    pub zone: Option<String>,
    pub hardware: String,
}

/// What happened to a [`Started`] record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// The machine now has the instance.
    Recorded,
    /// The machine is gone, or was re-nonced: nobody owns the instance, so
    /// the caller must stop it.
    Orphaned,
}

/// What the stray harvest needs to know of a machine, without the rest of
/// its row: with 100,000 machines a full [`crate::Machine`] list costs tens
/// of megabytes on every pass. (40 bytes: held beside the cloud's whole
/// listing, 100,000 of these with their instance ids as strings were
/// 8 MB of the controller's peak.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub machine: i64,
    /// Its instance's id as [`instance_digest`], 0 without one: the
    /// harvest only asks whether an instance is the one recorded.
    pub instance: u64,
    /// Only while the machine has no instance: the start it is waiting for.
    pub nonce: Option<Box<str>>,
    pub in_error: bool,
    /// A start for it is under way (status `provisioning`).
    pub provisioning: bool,
}

/// What [`Owner::instance`] keeps of an instance id: 64 bits of SipHash
/// (the standard library's, fixed keys), never 0. Two ids alike by chance
/// (once in 2^64) would make a stray look recorded, so it would be left
/// alone: a recorded instance always matches its own, and is never taken
/// for a stray.
pub fn instance_digest(id: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    id.hash(&mut h);
    h.finish() | 1
}

#[cfg(test)]
#[test]
fn an_owner_is_small_and_its_instance_digest_never_means_none() {
    assert!(std::mem::size_of::<Owner>() <= 40);
    assert_eq!(instance_digest("i-0abc"), instance_digest("i-0abc"));
    assert_ne!(instance_digest("i-0abc"), instance_digest("i-0abd"));
    assert!((0..10_000).all(|i| instance_digest(&format!("i-{i:x}")) != 0));
}

pub use jujube_wire::view::{ProviderStatus, Stray};

impl Store {
    /// Commits a nonce (if the machine has none) for each Alive machine
    /// without an instance that is not in error, and returns those machines
    /// with their nonces. The nonce is committed before any start, so a crash
    /// after it never yields a second instance: the next start reuses it, and
    /// providers are idempotent per nonce.
    ///
    /// The machine's status is left alone: a machine is `provisioning` only
    /// once its start request is really under way
    /// ([`Store::mark_provisioning`]), not while it waits for a slot or for
    /// the rate limiter, or when the provider cannot even be reached.
    ///
    /// Each machine is a launch of its own; see [`Store::prepare_batches`].
    pub fn prepare_provisioning(&self, ids: &[i64], env_uuid: &str) -> Result<Vec<Prepared>> {
        let singles: Vec<Vec<i64>> = ids.iter().map(|&id| vec![id]).collect();
        self.prepare_batches(&singles, env_uuid)
    }

    /// As [`Store::prepare_provisioning`], for machines grouped into launch
    /// batches (one provider request each). The machines of a batch that have
    /// no nonce yet get `<batch>/<index>` (`jujube_providers::launch_batch`
    /// reads it back), the index counting from 0 in the given order; a batch
    /// with one such machine gets a plain nonce. Machines that already have a
    /// nonce keep it, and with it the batch a crashed controller committed.
    /// Like `prepare_provisioning`, it leaves the status alone
    /// ([`Store::mark_provisioning`] sets it when the batch is sent).
    pub fn prepare_batches(&self, batches: &[Vec<i64>], env_uuid: &str) -> Result<Vec<Prepared>> {
        let mut out = Vec::new();
        // Whole launch batches, [`PROVISIONING_BATCH`] machines or so per
        // transaction: a first pass after `deploy -n 100000` passes them all.
        // A failure part-way leaves earlier transactions committed, which is
        // harmless: preparing again reuses their nonces (and batches).
        for group in transaction_groups(batches, |b| b.len()) {
            out.extend(self.write(|tx| prepare_in(tx, group, env_uuid))?);
        }
        Ok(out)
    }

    /// A start request for these machines is about to be sent: sets status
    /// `provisioning` (clearing the message) on each that is still Alive,
    /// without an instance, not in error and carrying the nonce it was
    /// prepared with. Returns those machines; the others (destroyed or
    /// re-nonced meanwhile) must not be started.
    pub fn mark_provisioning(&self, machines: &[Prepared]) -> Result<Vec<i64>> {
        let mut out = Vec::with_capacity(machines.len());
        for chunk in machines.chunks(PROVISIONING_BATCH) {
            out.extend(self.write(|tx| mark_in(tx, chunk))?);
        }
        Ok(out)
    }

    /// Says, in the status message of machines whose start is under way
    /// (`provisioning`, no instance), why it is taking longer: a transient
    /// failure and when the next attempt comes (provisioning.txt: the
    /// status must communicate the nature of the problem). One transaction
    /// per [`PROVISIONING_BATCH`].
    pub fn note_provisioning(&self, notes: &[(i64, String)]) -> Result<()> {
        for chunk in notes.chunks(PROVISIONING_BATCH) {
            self.write(|tx| {
                for (id, note) in chunk {
                    let n = tx
                        .prepare_cached(
                            "UPDATE machines SET status_info = ?1
                             WHERE id = ?2 AND status = ?3 AND instance_id IS NULL AND status_info != ?1",
                        )?
                        .execute((note, id, machine_status::PROVISIONING))?;
                    if n > 0 {
                        tx.changed(ChangeKind::Machine, id.to_string())?;
                    }
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Starts that were under way and are abandoned (the controller is
    /// shutting down between retries): back to `pending`, nonces kept, so
    /// that the next controller resumes them with the same nonce.
    pub fn abandon_provisioning(&self, ids: &[i64]) -> Result<()> {
        for chunk in ids.chunks(PROVISIONING_BATCH) {
            self.write(|tx| abandon_in(tx, chunk))?;
        }
        Ok(())
    }

    /// Records started instances, one transaction per
    /// [`PROVISIONING_BATCH`]. A machine that no longer exists or carries
    /// another nonce does not own its instance ([`Recorded::Orphaned`]); a
    /// Dying or Dead machine still does, so that the provisioner stops it
    /// through the normal path. A failure part-way leaves earlier batches
    /// recorded; recording again is harmless, and a restarted start with the
    /// same nonce gets the same instance.
    pub fn record_instances(&self, started: &[Started]) -> Result<Vec<Recorded>> {
        let mut out = Vec::with_capacity(started.len());
        for chunk in started.chunks(PROVISIONING_BATCH) {
            out.extend(self.write(|tx| record_in(tx, chunk))?);
        }
        Ok(out)
    }
    /// Marks a machine's start as failed: no instance id, status `error`, and
    /// a message saying what failed and why. Ignored for a machine that has
    /// an instance after all.
    pub fn set_provisioning_error(&self, id: i64, message: &str) -> Result<()> {
        self.write(|tx| {
            let n = tx.execute(
                "UPDATE machines SET status = ?1, status_info = ?2 WHERE id = ?3 AND instance_id IS NULL",
                (machine_status::ERROR, message, id),
            )?;
            if n > 0 {
                tx.changed(ChangeKind::Machine, id.to_string())?;
            }
            Ok(())
        })
    }

    /// The instance poller found that an Alive machine's instance is gone
    /// (stopped or terminated behind jujube's back): status `error` with
    /// `message`, instance status `gone`. The instance id stays recorded, so
    /// that the user sees which instance it was, until `resolved` clears it
    /// and a replacement is started under a new nonce. Returns false (and
    /// changes nothing) when the machine no longer has that instance or is
    /// not Alive.
    pub fn set_instance_gone(&self, id: i64, instance_id: &str, message: &str) -> Result<bool> {
        self.write(|tx| {
            let n = tx.execute(
                "UPDATE machines SET status = ?1, status_info = ?2, instance_status = ?3
                 WHERE id = ?4 AND instance_id = ?5 AND life = 0
                   AND coalesce(instance_status, '') != ?3",
                (
                    machine_status::ERROR,
                    message,
                    instance_status::GONE,
                    id,
                    instance_id,
                ),
            )?;
            if n > 0 {
                tx.changed(ChangeKind::Machine, id.to_string())?;
            }
            Ok(n > 0)
        })
    }

    /// Records that the provider cannot be reached (`Some(message)`), or that
    /// it answers again (`None`). `now` is unix seconds; the first failure's
    /// time is kept while the failures go on. Writes (and wakes watchers)
    /// only on a change.
    pub fn set_provider_status(&self, problem: Option<&str>, now: i64) -> Result<()> {
        self.write(|tx| {
            let old = provider_status_in(tx)?;
            match (problem, old) {
                (None, None) => Ok(()),
                (None, Some(_)) => {
                    tx.execute("DELETE FROM provider_status", [])?;
                    tx.changed(ChangeKind::Environment, "provider-status")
                }
                (Some(m), Some(o)) if o.message == m => Ok(()),
                (Some(m), old) => {
                    let since = old.map_or(now, |o| o.since);
                    tx.execute(
                        "INSERT INTO provider_status (id, message, since) VALUES (1, ?1, ?2)
                         ON CONFLICT (id) DO UPDATE SET message = excluded.message, since = excluded.since",
                        (m, since),
                    )?;
                    tx.changed(ChangeKind::Environment, "provider-status")
                }
            }
        })
    }

    /// Why the provider cannot be reached, if it cannot.
    pub fn provider_status(&self) -> Result<Option<ProviderStatus>> {
        self.read(provider_status_in)
    }

    /// For spreading a service's units over zones (Juju's distribution
    /// groups): per service and zone, how many machines hosting its
    /// principal units have an instance there. Dead machines do not count.
    /// One grouped query: the answer is small whatever the model's size.
    pub fn service_zone_counts(&self) -> Result<Vec<(String, String, i64)>> {
        self.read(|c| {
            let rows = c
                .prepare_cached(
                    "SELECT u.service, m.zone, count(DISTINCT m.id)
                     FROM units u JOIN machines m ON m.id = u.machine_id
                     WHERE u.principal IS NULL AND m.zone IS NOT NULL AND m.life != 2
                     GROUP BY u.service, m.zone",
                )?
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
                .collect::<crate::sql::Result<Vec<(String, String, i64)>>>()?;
            Ok(rows)
        })
    }

    /// The services whose principal units are assigned to each of
    /// `machines`, as (machine, service) pairs.
    pub fn services_on_machines(&self, machines: &[i64]) -> Result<Vec<(i64, String)>> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT DISTINCT service FROM units WHERE machine_id = ?1 AND principal IS NULL",
            )?;
            let mut out = Vec::new();
            for &m in machines {
                for s in stmt.query_map([m], |r| r.get::<_, String>(0))? {
                    out.push((m, s?));
                }
            }
            Ok(out)
        })
    }

    /// `retry-provisioning`: [`Store::resolve_machine`] for several machines,
    /// all or none; at most [`crate::MAX_NAMED_PER_COMMAND`].
    pub fn retry_provisioning(&self, ids: &[i64]) -> Result<()> {
        crate::check_named_count("retry", "machines", ids.len())?;
        self.write(|tx| {
            for &id in ids {
                crate::machines::resolve_in(tx, id, None)?;
            }
            Ok(())
        })
    }

    /// `retry-provisioning --all`: makes every machine in error eligible
    /// again; returns the first [`crate::MAX_LISTED`] of them and how many
    /// they were.
    ///
    /// Each transaction finds the next [`PROVISIONING_BATCH`] machines in
    /// error (after the last one done) and resolves them, reading and
    /// writing in one transaction: a machine resolved or destroyed by
    /// someone else meanwhile is simply no longer found, where a list read
    /// first and written later would fail the whole command. A failure
    /// part-way leaves earlier batches resolved; running it again finishes.
    pub fn retry_all_provisioning(&self) -> Result<(Vec<i64>, u64)> {
        let (mut out, mut count) = (Vec::new(), 0u64);
        let mut after = -1i64;
        loop {
            let batch = self.write(|tx| {
                let ids = tx
                    .prepare_cached(
                        "SELECT id FROM machines WHERE status = ?1 AND life = 0 AND id > ?2
                         ORDER BY id LIMIT ?3",
                    )?
                    .query_map(
                        (machine_status::ERROR, after, PROVISIONING_BATCH as i64),
                        |r| r.get(0),
                    )?
                    .collect::<crate::sql::Result<Vec<i64>>>()?;
                for &id in &ids {
                    crate::machines::resolve_in(tx, id, None)?;
                }
                Ok(ids)
            })?;
            let Some(&last) = batch.last() else {
                return Ok((out, count));
            };
            after = last;
            count += batch.len() as u64;
            let room = crate::MAX_LISTED.saturating_sub(out.len());
            out.extend(batch.into_iter().take(room));
        }
    }

    /// How many machines have an instance (a cheap progress count).
    pub fn provisioned_count(&self) -> Result<usize> {
        self.read(|c| {
            let n: i64 = c.query_row(
                "SELECT count(*) FROM machines WHERE instance_id IS NOT NULL",
                [],
                |r| r.get(0),
            )?;
            Ok(n as usize)
        })
    }

    /// The machines the instance poller watches — Alive, not in error, with
    /// an instance — as (machine, instance id), in id order: what a pass
    /// that only lists the cloud needs of every machine (a few bytes each,
    /// not 100,000 full rows).
    pub fn watched_instances(&self) -> Result<Vec<(i64, String)>> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT id, instance_id FROM machines
                     WHERE life = 0 AND instance_id IS NOT NULL AND status != ?1
                     ORDER BY id",
            )?;
            let rows = stmt.query_map([machine_status::ERROR], |r| Ok((r.get(0)?, r.get(1)?)))?;
            collect_sized(c, rows)
        })
    }

    /// Every machine as the stray harvest sees it ([`Owner`]), in id order.
    pub fn owners(&self) -> Result<Vec<Owner>> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT id, instance_id, CASE WHEN instance_id IS NULL THEN nonce END, status = ?1,
                            status = ?2
                     FROM machines ORDER BY id",
            )?;
            let rows =
                stmt.query_map([machine_status::ERROR, machine_status::PROVISIONING], |r| {
                    let instance: Option<String> = r.get(1)?;
                    let nonce: Option<String> = r.get(2)?;
                    Ok(Owner {
                        machine: r.get(0)?,
                        instance: instance.map_or(0, |id| instance_digest(&id)),
                        nonce: nonce.map(String::into_boxed_str),
                        in_error: r.get(3)?,
                        provisioning: r.get(4)?,
                    })
                })?;
            collect_sized(c, rows)
        })
    }

    /// Alive machines in error, each with its message: the first `limit`
    /// by id, and how many there are. Read through the index of machines
    /// in error, so an answer costs those rows whatever the model's size.
    pub fn machines_in_error(&self, limit: usize) -> Result<(Vec<(i64, String)>, u64)> {
        self.read(|c| {
            let listed = c
                .prepare_cached(
                    "SELECT id, status_info FROM machines INDEXED BY machines_in_error
                     WHERE status = 'error' AND life = 0 ORDER BY id LIMIT ?1",
                )?
                .query_map([limit as i64], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<crate::sql::Result<Vec<(i64, String)>>>()?;
            let all: i64 = c
                .prepare_cached(
                    "SELECT count(*) FROM machines INDEXED BY machines_in_error
                     WHERE status = 'error' AND life = 0",
                )?
                .query_row([], |r| r.get(0))?;
            Ok((listed, all as u64))
        })
    }

    /// The id the next machine will get: every smaller id was once used.
    pub fn next_machine_id(&self) -> Result<i64> {
        self.read(crate::machines::next_machine_id)
    }

    /// Replaces the strays view: the first [`MAX_STRAYS_RECORDED`] of
    /// `strays` by first-seen time (then id), and a count of the rest. Those
    /// kept are the first to be reaped, and their first-seen times survive
    /// a restart; the rest are seen afresh after one (their grace starts
    /// again, the safe side). So the view, `status` and `strays` stay
    /// bounded, and so does this transaction, however many instances the
    /// cloud holds with the environment's tags.
    pub fn set_strays(&self, strays: &[Stray]) -> Result<()> {
        let mut kept: Vec<&Stray> = strays.iter().collect();
        kept.sort_by(|a, b| (a.first_seen, &a.instance_id).cmp(&(b.first_seen, &b.instance_id)));
        let unlisted = kept.len().saturating_sub(MAX_STRAYS_RECORDED) as i64;
        kept.truncate(MAX_STRAYS_RECORDED);
        self.write(|tx| {
            let old = strays_in(tx)?;
            if old.iter().eq(kept.iter().copied()) && unlisted_in(tx)? == unlisted as u64 {
                return Ok(());
            }
            tx.execute("DELETE FROM strays", [])?;
            for s in &kept {
                tx.execute(
                    "INSERT INTO strays (instance_id, machine_tag, class, first_seen, reap_at) VALUES (?1, ?2, ?3, ?4, ?5)",
                    (&s.instance_id, &s.machine_tag, &s.class, s.first_seen, s.reap_at),
                )?;
            }
            tx.execute("DELETE FROM strays_unlisted", [])?;
            if unlisted > 0 {
                tx.execute("INSERT INTO strays_unlisted (id, count) VALUES (1, ?1)", [unlisted])?;
            }
            tx.changed(ChangeKind::Environment, "strays")
        })
    }

    /// The strays view: at most [`MAX_STRAYS_RECORDED`], first seen first.
    pub fn strays(&self) -> Result<Vec<Stray>> {
        self.read(strays_in)
    }

    /// How many strays the view leaves out.
    pub fn strays_unlisted(&self) -> Result<u64> {
        self.read(unlisted_in)
    }

    /// A Dead machine's instance is being stopped.
    pub fn set_stopping(&self, id: i64) -> Result<()> {
        self.write(|tx| {
            let m = get_machine(tx, id)?;
            if m.life != Life::Dead {
                return Err(Error::NotDead {
                    kind: Entity::Machine,
                    id: id.to_string(),
                });
            }
            tx.execute(
                "UPDATE machines SET status = ?1 WHERE id = ?2",
                (machine_status::STOPPING, id),
            )?;
            tx.changed(ChangeKind::Machine, id.to_string())
        })
    }
}

/// Splits `items` into runs whose summed `size` stays near
/// [`PROVISIONING_BATCH`] (an item is never split: a launch batch is
/// prepared whole), one transaction each.
fn transaction_groups<T>(items: &[T], size: impl Fn(&T) -> usize) -> Vec<&[T]> {
    let mut groups = Vec::new();
    let (mut start, mut rows) = (0, 0);
    for (i, item) in items.iter().enumerate() {
        let n = size(item);
        if rows > 0 && rows + n > PROVISIONING_BATCH {
            groups.push(&items[start..i]);
            (start, rows) = (i, 0);
        }
        rows += n;
    }
    if start < items.len() {
        groups.push(&items[start..]);
    }
    groups
}

fn prepare_in(tx: &mut Tx<'_>, batches: &[Vec<i64>], env_uuid: &str) -> Result<Vec<Prepared>> {
    let short = &env_uuid[..8.min(env_uuid.len())];
    let mut out = Vec::new();
    for batch in batches {
        let mut eligible = Vec::with_capacity(batch.len());
        for &id in batch {
            let Ok(m) = get_machine(tx, id) else { continue };
            if m.life != Life::Alive || m.instance_id.is_some() || m.status == machine_status::ERROR
            {
                continue;
            }
            eligible.push(m);
        }
        let fresh = eligible.iter().filter(|m| m.nonce.is_none()).count();
        let batch_id = (fresh > 1).then(|| format!("{short}-{}", uuid::Uuid::new_v4().simple()));
        let mut index = 0u32;
        for m in eligible {
            let id = m.id;
            let nonce = match m.nonce {
                Some(n) => n,
                None => {
                    let n = match &batch_id {
                        Some(b) => {
                            index += 1;
                            format!("{b}/{}", index - 1)
                        }
                        None => format!("{short}:{id}:{}", uuid::Uuid::new_v4().simple()),
                    };
                    tx.prepare_cached("UPDATE machines SET nonce = ?1 WHERE id = ?2")?
                        .execute((&n, id))?;
                    n
                }
            };
            out.push(Prepared { machine: id, nonce });
        }
    }
    Ok(out)
}

fn mark_in(tx: &mut Tx<'_>, machines: &[Prepared]) -> Result<Vec<i64>> {
    let mut out = Vec::with_capacity(machines.len());
    for p in machines {
        let Ok(m) = get_machine(tx, p.machine) else {
            continue;
        };
        if m.life != Life::Alive
            || m.instance_id.is_some()
            || m.status == machine_status::ERROR
            || m.nonce.as_deref() != Some(p.nonce.as_str())
        {
            continue;
        }
        // A machine already provisioning keeps its note (a retry says why
        // it is taking longer until the start succeeds or fails for good).
        if m.status != machine_status::PROVISIONING {
            tx.prepare_cached("UPDATE machines SET status = ?1, status_info = '' WHERE id = ?2")?
                .execute((machine_status::PROVISIONING, p.machine))?;
            tx.changed(ChangeKind::Machine, p.machine.to_string())?;
        }
        out.push(p.machine);
    }
    Ok(out)
}

fn abandon_in(tx: &mut Tx<'_>, ids: &[i64]) -> Result<()> {
    for &id in ids {
        let n = tx
            .prepare_cached(
                "UPDATE machines SET status = ?1, status_info = ''
                 WHERE id = ?2 AND status = ?3 AND instance_id IS NULL",
            )?
            .execute((machine_status::PENDING, id, machine_status::PROVISIONING))?;
        if n > 0 {
            tx.changed(ChangeKind::Machine, id.to_string())?;
        }
    }
    Ok(())
}

fn record_in(tx: &mut Tx<'_>, started: &[Started]) -> Result<Vec<Recorded>> {
    let mut out = Vec::with_capacity(started.len());
    for s in started {
        let nonce: Option<Option<String>> = tx
            .prepare_cached("SELECT nonce FROM machines WHERE id = ?1")?
            .query_row([s.machine], |r| r.get(0))
            .optional()?;
        if nonce.flatten().as_deref() != Some(s.nonce.as_str()) {
            out.push(Recorded::Orphaned);
            continue;
        }
        tx.prepare_cached(
            "UPDATE machines SET instance_id = ?1, zone = ?2, hardware = ?3, status = ?4, status_info = '',
                                 instance_status = ?5
             WHERE id = ?6",
        )?
        .execute((
            &s.instance_id,
            &s.zone,
            &s.hardware,
            machine_status::STARTED,
            instance_status::RUNNING,
            s.machine,
        ))?;
        tx.changed(ChangeKind::Machine, s.machine.to_string())?;
        out.push(Recorded::Recorded);
    }
    Ok(out)
}

pub(crate) fn provider_status_in(c: &crate::sql::Connection) -> Result<Option<ProviderStatus>> {
    Ok(
        c.prepare_cached("SELECT message, since FROM provider_status WHERE id = 1")?
            .query_row([], |r| {
                Ok(ProviderStatus {
                    message: r.get(0)?,
                    since: r.get(1)?,
                })
            })
            .optional()?,
    )
}

/// The most strays the view records (see [`Store::set_strays`]): its
/// replacement deletes and inserts at most this many rows.
pub const MAX_STRAYS_RECORDED: usize = 256;

pub(crate) fn unlisted_in(c: &crate::sql::Connection) -> Result<u64> {
    let n: Option<i64> = c
        .prepare_cached("SELECT count FROM strays_unlisted WHERE id = 1")?
        .query_row([], |r| r.get(0))
        .optional()?;
    Ok(n.unwrap_or(0).max(0) as u64)
}

pub(crate) fn strays_in(c: &crate::sql::Connection) -> Result<Vec<Stray>> {
    let rows = c
        .prepare_cached("SELECT instance_id, machine_tag, class, first_seen, reap_at FROM strays ORDER BY first_seen, instance_id")?
        .query_map([], |r| {
            Ok(Stray { instance_id: r.get(0)?, machine_tag: r.get(1)?, class: r.get(2)?, first_seen: r.get(3)?, reap_at: r.get(4)? })
        })?
        .collect::<crate::sql::Result<Vec<_>>>()?;
    Ok(rows)
}

/// Collects rows of the machines table into a vector sized once, by the
/// number of machines (an upper bound): grown by doubling, a list of
/// 100,000 held its old and new buffers at once.
fn collect_sized<T>(
    c: &crate::sql::Connection,
    rows: impl Iterator<Item = crate::sql::Result<T>>,
) -> Result<Vec<T>> {
    let n: i64 = c.query_row("SELECT count(*) FROM machines", [], |r| r.get(0))?;
    let mut out = Vec::with_capacity(n.max(0) as usize);
    for r in rows {
        out.push(r?);
    }
    Ok(out)
}
