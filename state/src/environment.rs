//! The environment: one per database.

use crate::db::Store;
use crate::feed::ChangeKind;
use crate::machines::insert_machine;
use crate::model::{constraints, Environment, JOB_MANAGE_ENVIRON};
use crate::sql::{Connection, OptionalExtension};
use crate::{Entity, Error, Result};
use jujube_core::{series, Constraints};
use std::collections::BTreeMap;

/// What `bootstrap` asks for.
#[derive(Debug, Clone)]
pub struct EnvironmentSpec {
    pub name: String,
    pub uuid: String,
    pub provider: String,
    pub default_series: String,
    pub constraints: Constraints,
    pub config: BTreeMap<String, String>,
}

pub(crate) fn get_environment(c: &Connection) -> Result<Environment> {
    let row: Option<(String, String, String, String, String)> = c
        .prepare_cached(
            "SELECT name, uuid, provider, default_series, constraints FROM environment WHERE id = 1",
        )?
        .query_row([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
        .optional()?;
    let (name, uuid, provider, default_series, cons) =
        row.ok_or_else(|| Error::not_found(Entity::Environment, "(uninitialised)"))?;
    Ok(Environment {
        name,
        uuid,
        provider,
        default_series,
        constraints: constraints(cons)?,
    })
}

/// Checks that `s` is a series jujube knows, or one the environment adds in
/// its `extra-series` config (read in the caller's transaction).
pub(crate) fn check_series(c: &Connection, s: &str) -> Result<()> {
    let extra: Option<String> = c
        .prepare_cached("SELECT value FROM environment_config WHERE key = ?1")?
        .query_row([series::EXTRA_SERIES_KEY], |r| r.get(0))
        .optional()?;
    let extra = series::parse_extra(extra.as_deref().unwrap_or(""))?;
    Ok(series::check_known(s, &extra)?)
}

/// Checks a config value the store itself reads.
/// Settings chosen at bootstrap that no command changes: where the state
/// itself lives, and where its password is read from.
pub const BOOTSTRAP_ONLY: &[&str] = &["state-url", "state-password-file"];

/// The most bytes an environment config key may hold.
pub const MAX_CONFIG_KEY_BYTES: usize = 256;
/// The most bytes an environment config value may hold (room for keys and
/// certificates).
pub const MAX_CONFIG_VALUE_BYTES: usize = 64 << 10;
/// The most keys an environment's config may hold: every controller job
/// and `get-environment` reads them all.
pub const MAX_CONFIG_KEYS: usize = 256;

fn validate_config_value(key: &str, value: &str) -> Result<()> {
    if value.len() > MAX_CONFIG_VALUE_BYTES {
        return Err(crate::Error::BadConfig(format!(
            "the value of `{key}` is {} bytes, more than {MAX_CONFIG_VALUE_BYTES}; shorten it",
            value.len()
        )));
    }
    if key == series::EXTRA_SERIES_KEY {
        series::parse_extra(value)?;
    }
    if key == UPDATE_STATUS_KEY && update_status_interval(value).is_none() {
        return Err(crate::Error::BadConfig(format!(
            "`{UPDATE_STATUS_KEY}={value}` is not a duration from 1s to 60m; e.g. `jujube set-environment {UPDATE_STATUS_KEY}=5m` (the default)"
        )));
    }
    Ok(())
}

/// How often started units run `update-status` (Juju's model setting of
/// that name; unset: the agents' default, 5 minutes). The store reads it
/// into each unit's context.
pub const UPDATE_STATUS_KEY: &str = "update-status-hook-interval";

/// An `update-status-hook-interval` value: from 1 s (Juju's least is a
/// minute; shorter serves tests and impatient users and costs only hooks)
/// to Juju's most, an hour.
pub fn update_status_interval(value: &str) -> Option<std::time::Duration> {
    jujube_core::duration::parse(value).filter(|d| {
        (std::time::Duration::from_secs(1)..=std::time::Duration::from_secs(3600)).contains(d)
    })
}

fn validate_config_key(key: &str) -> Result<()> {
    if key.len() > MAX_CONFIG_KEY_BYTES {
        return Err(crate::Error::BadConfig(format!(
            "a config key of {} bytes is more than {MAX_CONFIG_KEY_BYTES}; shorten it",
            key.len()
        )));
    }
    let ok = key.starts_with(|c: char| c.is_ascii_lowercase())
        && key
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(jujube_core::Error::InvalidName {
            kind: "config",
            name: key.to_string(),
            why: "config keys are lowercase words joined by `-`, e.g. `harvest-mode`",
        }
        .into())
    }
}

impl Store {
    /// Creates the environment and its controller machine 0 (job
    /// `manage-environ`, the environment's series and constraints), in one
    /// transaction.
    pub fn initialize(&self, spec: &EnvironmentSpec) -> Result<Environment> {
        jujube_core::names::validate_environment(&spec.name)?;
        if spec.config.len() > MAX_CONFIG_KEYS {
            return Err(crate::Error::BadConfig(format!(
                "the environment's config would hold {} keys, more than {MAX_CONFIG_KEYS}; give fewer",
                spec.config.len()
            )));
        }
        for (key, value) in &spec.config {
            validate_config_key(key)?;
            validate_config_value(key, value)?;
        }
        let extra = spec
            .config
            .get(series::EXTRA_SERIES_KEY)
            .map(|v| series::parse_extra(v))
            .transpose()?
            .unwrap_or_default();
        series::check_known(&spec.default_series, &extra)?;
        self.write(|tx| {
            if let Ok(env) = get_environment(tx) {
                return Err(Error::AlreadyExists {
                    kind: Entity::Environment,
                    id: env.name,
                });
            }
            tx.execute(
                "INSERT INTO environment (id, name, uuid, provider, default_series, constraints)
                 VALUES (1, ?1, ?2, ?3, ?4, ?5)",
                (
                    &spec.name,
                    &spec.uuid,
                    &spec.provider,
                    &spec.default_series,
                    spec.constraints.to_string(),
                ),
            )?;
            for (k, v) in &spec.config {
                tx.execute(
                    "INSERT INTO environment_config (key, value) VALUES (?1, ?2)",
                    (k, v),
                )?;
            }
            tx.changed(ChangeKind::Environment, &spec.name)?;
            insert_machine(
                tx,
                &spec.default_series,
                &[JOB_MANAGE_ENVIRON],
                &spec.constraints,
            )?;
            get_environment(tx)
        })
    }

    pub fn environment(&self) -> Result<Environment> {
        self.read(get_environment)
    }

    /// Replaces the environment's constraints. Existing units and machines
    /// keep what they captured when they were created.
    pub fn set_environment_constraints(&self, cons: &Constraints) -> Result<()> {
        self.write(|tx| {
            let env = get_environment(tx)?;
            tx.execute(
                "UPDATE environment SET constraints = ?1 WHERE id = 1",
                [cons.to_string()],
            )?;
            tx.changed(ChangeKind::Environment, &env.name)
        })
    }

    pub fn environment_config(&self) -> Result<BTreeMap<String, String>> {
        self.read(config_of)
    }

    /// Sets config keys; an empty value removes the key.
    pub fn set_environment_config(&self, kvs: &[(String, String)]) -> Result<()> {
        for (k, v) in kvs {
            validate_config_key(k)?;
            if BOOTSTRAP_ONLY.contains(&k.as_str()) {
                return Err(Error::FixedAtBootstrap(k.clone()));
            }
            validate_config_value(k, v)?;
        }
        self.write(|tx| {
            let env = get_environment(tx)?;
            for (k, v) in kvs {
                if v.is_empty() {
                    tx.execute("DELETE FROM environment_config WHERE key = ?1", [k])?;
                } else {
                    tx.execute(
                        "INSERT INTO environment_config (key, value) VALUES (?1, ?2)
                         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                        (k, v),
                    )?;
                }
            }
            let keys: i64 = tx.query_row("SELECT count(*) FROM environment_config", [], |r| {
                r.get(0)
            })?;
            if keys as usize > MAX_CONFIG_KEYS {
                return Err(crate::Error::BadConfig(format!(
                    "the environment's config would hold {keys} keys, more than {MAX_CONFIG_KEYS}; unset some first (`jujube set-environment KEY=`)"
                )));
            }
            tx.changed(ChangeKind::Environment, &env.name)
        })
    }
}

pub(crate) fn config_of(c: &Connection) -> Result<BTreeMap<String, String>> {
    let mut stmt = c.prepare_cached("SELECT key, value FROM environment_config ORDER BY key")?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(rows.collect::<crate::sql::Result<_>>()?)
}
