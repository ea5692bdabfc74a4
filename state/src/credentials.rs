//! Agents' credentials: the hash of each agent's secret, never the secret.
//!
//! The API server checks a presented secret against [`Store::agent_credential`];
//! the store knows nothing of how secrets are made or hashed. A credential
//! belongs to a machine or a unit and is deleted with it (a foreign key with
//! `ON DELETE CASCADE`), so it stops working when its entity is removed.

use crate::db::Store;
use crate::{Entity, Error, Result};
use rusqlite::OptionalExtension;

impl Store {
    /// Sets (or replaces) machine `id`'s credential hash under `tag`.
    pub fn set_machine_credential(&self, id: i64, tag: &str, hash: &str) -> Result<()> {
        self.write(|tx| {
            let exists: bool = tx
                .prepare_cached("SELECT EXISTS (SELECT 1 FROM machines WHERE id = ?1)")?
                .query_row([id], |r| r.get(0))?;
            if !exists {
                return Err(Error::not_found(Entity::Machine, id));
            }
            tx.prepare_cached(
                "INSERT OR REPLACE INTO agent_credentials (tag, machine_id, unit, hash)
                 VALUES (?1, ?2, NULL, ?3)",
            )?
            .execute((tag, id, hash))?;
            Ok(())
        })
    }

    /// Sets (or replaces) unit `name`'s credential hash under `tag`.
    pub fn set_unit_credential(&self, name: &str, tag: &str, hash: &str) -> Result<()> {
        self.write(|tx| {
            let exists: bool = tx
                .prepare_cached("SELECT EXISTS (SELECT 1 FROM units WHERE name = ?1)")?
                .query_row([name], |r| r.get(0))?;
            if !exists {
                return Err(Error::not_found(Entity::Unit, name));
            }
            tx.prepare_cached(
                "INSERT OR REPLACE INTO agent_credentials (tag, machine_id, unit, hash)
                 VALUES (?1, NULL, ?2, ?3)",
            )?
            .execute((tag, name, hash))?;
            Ok(())
        })
    }

    /// The credential hash stored for `tag`, if its entity still exists.
    pub fn agent_credential(&self, tag: &str) -> Result<Option<String>> {
        self.read(|c| {
            Ok(
                c.prepare_cached("SELECT hash FROM agent_credentials WHERE tag = ?1")?
                    .query_row([tag], |r| r.get(0))
                    .optional()?,
            )
        })
    }
}
