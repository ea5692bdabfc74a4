//! Agents' credentials: the hash of each agent's secret, never the secret.
//!
//! The API server checks a presented secret against [`Store::agent_credential`];
//! the store knows nothing of how secrets are made or hashed. A credential
//! belongs to a machine or a unit and is deleted with it (a foreign key with
//! `ON DELETE CASCADE`), so it stops working when its entity is removed.

use crate::db::Store;
use crate::sql::OptionalExtension;
use crate::{Entity, Error, Result};

impl Store {
    /// Sets (or replaces) machine `id`'s credential hash under `tag`.
    pub fn set_machine_credential(&self, id: i64, tag: &str, hash: &str) -> Result<()> {
        let r = self.write(|tx| {
            let exists: bool = tx
                .prepare_cached("SELECT EXISTS (SELECT 1 FROM machines WHERE id = ?1)")?
                .query_row([id], |r| r.get(0))?;
            if !exists {
                return Err(Error::not_found(Entity::Machine, id));
            }
            tx.prepare_cached(
                "INSERT INTO agent_credentials (tag, machine_id, unit, hash)
                 VALUES (?1, ?2, NULL, ?3)
                 ON CONFLICT (tag) DO UPDATE SET machine_id = excluded.machine_id,
                   unit = excluded.unit, hash = excluded.hash, refused_at = NULL, seen_at = NULL",
            )?
            .execute((tag, id, hash))?;
            Ok(())
        });
        if r.is_ok() {
            self.credentials_changed();
        }
        r
    }

    /// Sets (or replaces) unit `name`'s credential hash under `tag`.
    pub fn set_unit_credential(&self, name: &str, tag: &str, hash: &str) -> Result<()> {
        let r = self.write(|tx| {
            let exists: bool = tx
                .prepare_cached("SELECT EXISTS (SELECT 1 FROM units WHERE name = ?1)")?
                .query_row([name], |r| r.get(0))?;
            if !exists {
                return Err(Error::not_found(Entity::Unit, name));
            }
            insert_unit_credential(tx, name, tag, hash)
        });
        if r.is_ok() {
            self.credentials_changed();
        }
        r
    }

    /// Sets (or replaces) unit `name`'s credential hash under `tag`, for
    /// `by`: the unit's deployer (the machine agent of a principal's
    /// machine, the principal's unit agent for a subordinate) or the agent
    /// of the machine its principal runs on — checked in the same
    /// transaction as the write, so a unit moved or removed meanwhile is
    /// refused. Refused alike whether the unit exists or not.
    /// With `stamp`, it is one of `by`'s writes in order (see
    /// [`crate::agents::Stamp`]): [`Error::Superseded`] when a later one
    /// was applied, done without writing when it was this one.
    pub fn set_unit_credential_as(
        &self,
        by: &crate::Caller,
        stamp: Option<&crate::agents::Stamp>,
        name: &str,
        tag: &str,
        hash: &str,
    ) -> Result<()> {
        let denied = || Error::Unauthorized {
            caller: by.to_string(),
            action: format!("set the credential of unit `{name}`"),
        };
        let r = self.write(|tx| {
            let Ok(u) = crate::model::get_unit(tx, name) else {
                return Err(denied());
            };
            let allowed = *by == crate::agents::deployer_of(&u)
                || match (by, &u.principal) {
                    (crate::Caller::Machine(m), Some(p)) => crate::model::get_unit(tx, p)
                        .map(|p| p.machine_id == Some(*m))
                        .unwrap_or(false),
                    _ => false,
                };
            if !allowed {
                return Err(denied());
            }
            if let Some(stamp) = stamp {
                if !crate::agents::stamp_in(tx, by, stamp)? {
                    // A resend: done if it is the credential that number
                    // set; another under the same number is refused.
                    let kept: Option<String> = tx
                        .prepare_cached("SELECT hash FROM agent_credentials WHERE tag = ?1")?
                        .query_row([tag], |r| r.get(0))
                        .optional()?;
                    return match kept {
                        Some(kept) if kept == hash => Ok(()),
                        _ => Err(Error::Superseded {
                            agent: by.to_string(),
                        }),
                    };
                }
            }
            insert_unit_credential(tx, name, tag, hash)
        });
        if r.is_ok() {
            self.credentials_changed();
        }
        r
    }

    /// The credential hash stored for `tag`, if its entity still exists.
    pub fn agent_credential(&self, tag: &str) -> Result<Option<String>> {
        Ok(self.agent_credential_record(tag)?.map(|c| c.hash))
    }

    /// The credential stored for `tag` and whether a wrong secret was
    /// presented for it since it was set, in one read.
    pub fn agent_credential_record(&self, tag: &str) -> Result<Option<CredentialRecord>> {
        self.read(|c| {
            Ok(
                c.prepare_cached("SELECT hash, refused_at FROM agent_credentials WHERE tag = ?1")?
                    .query_row([tag], |r| {
                        Ok(CredentialRecord {
                            hash: r.get(0)?,
                            refused_at: r.get(1)?,
                        })
                    })
                    .optional()?,
            )
        })
    }

    /// Notes that a secret other than `tag`'s current one was presented
    /// for it at `now` (unix seconds), unless one already was since the
    /// credential was set: `status` shows the first refusal ("since").
    /// One row per existing credential at most, so whoever presents wrong
    /// secrets cannot make the store grow; the API server also notes a tag
    /// at most once a minute, so they cannot make it write in proportion.
    pub fn note_credential_refused(&self, tag: &str, now: i64) -> Result<()> {
        self.write(|tx| {
            tx.prepare_cached(
                "UPDATE agent_credentials SET refused_at = ?2 WHERE tag = ?1 AND refused_at IS NULL",
            )?
            .execute((tag, now))?;
            Ok(())
        })
    }

    /// Clears what [`Store::note_credential_refused`] noted: the agent now
    /// logs in with its current credential.
    pub fn clear_credential_refused(&self, tag: &str) -> Result<()> {
        self.write(|tx| {
            tx.prepare_cached(
                "UPDATE agent_credentials SET refused_at = NULL WHERE tag = ?1 AND refused_at IS NOT NULL",
            )?
            .execute([tag])?;
            Ok(())
        })
    }
}

/// The presence lapse of the environment: `agent-presence-lapse`
/// (seconds) or [`PRESENCE_LAPSE`].
pub(crate) fn presence_lapse(c: &crate::sql::Connection) -> Result<i64> {
    let v: Option<String> = c
        .prepare_cached("SELECT value FROM environment_config WHERE key = 'agent-presence-lapse'")?
        .query_row([], |r| r.get(0))
        .optional()?;
    Ok(v.and_then(|v| v.parse().ok()).unwrap_or(PRESENCE_LAPSE))
}

/// How long an agent that runs over the API may go unseen before `status`
/// shows it `down` (Juju: about a minute; `agent-presence-lapse` sets
/// another). The API server notes the agents
/// holding live connections every [`PRESENCE_EVERY`] seconds, and closes a
/// connection whose agent stops answering its keepalive pings, so a frozen
/// or dead agent shows `down` within about a minute and a half.
pub const PRESENCE_LAPSE: i64 = 60;
/// How often the API server notes who it sees (seconds).
pub const PRESENCE_EVERY: i64 = 15;

/// How many agents one presence transaction notes.
const PRESENCE_BATCH: usize = 1000;

impl Store {
    /// Notes that the agents of `tags` were seen at `now` (unix seconds),
    /// in transactions of at most [`PRESENCE_BATCH`] rows. Tags without a
    /// credential are ignored.
    pub fn note_agents_seen(&self, tags: &[String], now: i64) -> Result<()> {
        for chunk in tags.chunks(PRESENCE_BATCH) {
            self.write(|tx| {
                let mut stmt =
                    tx.prepare_cached("UPDATE agent_credentials SET seen_at = ?2 WHERE tag = ?1")?;
                for tag in chunk {
                    stmt.execute((tag, now))?;
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    /// When the agent of `tag` was last seen (unix seconds).
    pub fn agent_seen_at(&self, tag: &str) -> Result<Option<i64>> {
        self.read(|c| {
            Ok(
                c.prepare_cached("SELECT seen_at FROM agent_credentials WHERE tag = ?1")?
                    .query_row([tag], |r| r.get(0))
                    .optional()?
                    .flatten(),
            )
        })
    }
}

/// An agent's stored credential ([`Store::agent_credential_record`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredentialRecord {
    /// The hash of its secret.
    pub hash: String,
    /// When a wrong secret was first presented for it (unix seconds).
    pub refused_at: Option<i64>,
}

/// The batch a token is live for, if any.
fn live_batch(c: &crate::sql::Connection, token_hash: &str, now: i64) -> Result<Option<String>> {
    Ok(
        c.prepare_cached("SELECT batch FROM enrollments WHERE token_hash = ?1 AND expires > ?2")?
            .query_row((token_hash, now), |r| r.get(0))
            .optional()?,
    )
}

/// Why an enrollment was refused (said alike to everyone: an unknown, an
/// expired and a used token look the same to an outsider).
pub const ENROLLMENT_REFUSED: &str =
    "enrollment refused: the token is unknown, expired or already used by this instance, or the instance is not one of its batch";

impl Store {
    /// Records a batch's enrollment token (its hash), valid until
    /// `expires` (unix seconds). Expired ones are dropped meanwhile.
    pub fn add_enrollment(
        &self,
        token_hash: &str,
        batch: &str,
        expires: i64,
        now: i64,
    ) -> Result<()> {
        self.write(|tx| {
            tx.prepare_cached("DELETE FROM enrollments WHERE expires <= ?1")?
                .execute([now])?;
            // A token replaced takes its instances' enrollments with it
            // (`enrolled` cascades).
            tx.prepare_cached("DELETE FROM enrollments WHERE token_hash = ?1")?
                .execute([token_hash])?;
            tx.prepare_cached(
                "INSERT INTO enrollments (token_hash, batch, expires) VALUES (?1, ?2, ?3)",
            )?
            .execute((token_hash, batch, expires))?;
            Ok(())
        })
    }

    /// The machine whose start used `nonce`, if any.
    pub fn machine_by_nonce(&self, nonce: &str) -> Result<Option<i64>> {
        self.read(|c| {
            Ok(
                c.prepare_cached("SELECT id FROM machines WHERE nonce = ?1")?
                    .query_row([nonce], |r| r.get(0))
                    .optional()?,
            )
        })
    }

    /// The batch a live token was made for.
    pub fn enrollment_batch(&self, token_hash: &str, now: i64) -> Result<Option<String>> {
        self.read(|c| live_batch(c, token_hash, now))
    }

    /// Instance `instance_id` enrolls as machine `machine` with `token_hash`:
    /// in one transaction, the token must be live, unused by this instance,
    /// and the machine Alive and started in the token's batch (its nonce
    /// `<batch>/<index>`); then the machine's credential is `secret_hash`.
    pub fn enroll_machine(
        &self,
        token_hash: &str,
        instance_id: &str,
        machine: i64,
        tag: &str,
        secret_hash: &str,
        now: i64,
    ) -> Result<()> {
        let refused = || Error::Relation(ENROLLMENT_REFUSED.to_string());
        let r = self.write(|tx| {
            let batch = live_batch(tx, token_hash, now)?.ok_or_else(refused)?;
            let nonce: Option<Option<String>> = tx
                .prepare_cached("SELECT nonce FROM machines WHERE id = ?1 AND life = 0")?
                .query_row([machine], |r| r.get(0))
                .optional()?;
            let in_batch = nonce
                .flatten()
                // A launch batch's machine (`<batch>/<index>`), or a launch
                // of one (its nonce is the "batch").
                .map(|n| n == batch || n.rsplit_once('/').is_some_and(|(b, _)| b == batch))
                .unwrap_or(false);
            if !in_batch {
                return Err(refused());
            }
            let fresh = tx
                .prepare_cached(
                    "INSERT INTO enrolled (token_hash, instance_id) VALUES (?1, ?2)
                     ON CONFLICT DO NOTHING",
                )?
                .execute((token_hash, instance_id))?;
            if fresh == 0 {
                return Err(refused());
            }
            tx.prepare_cached(
                "INSERT INTO agent_credentials (tag, machine_id, unit, hash)
                 VALUES (?1, ?2, NULL, ?3)
                 ON CONFLICT (tag) DO UPDATE SET machine_id = excluded.machine_id,
                   unit = excluded.unit, hash = excluded.hash, refused_at = NULL, seen_at = NULL",
            )?
            .execute((tag, machine, secret_hash))?;
            Ok(())
        });
        if r.is_ok() {
            self.credentials_changed();
        }
        r
    }
}

fn insert_unit_credential(
    tx: &crate::sql::Connection,
    unit: &str,
    tag: &str,
    hash: &str,
) -> Result<()> {
    tx.prepare_cached(
        "INSERT INTO agent_credentials (tag, machine_id, unit, hash)
         VALUES (?1, NULL, ?2, ?3)
         ON CONFLICT (tag) DO UPDATE SET machine_id = excluded.machine_id,
           unit = excluded.unit, hash = excluded.hash, refused_at = NULL, seen_at = NULL",
    )?
    .execute((tag, unit, hash))?;
    Ok(())
}
