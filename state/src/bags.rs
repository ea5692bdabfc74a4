//! The databags a service's leader writes: an application's settings in a
//! relation (Juju 2.7+'s application databag: `relation-get --app`,
//! `relation-set --app`) and its leader settings (`leader-get`,
//! `leader-set`).
//!
//! Who may read and write them is decided here, in the transaction:
//! - a service's leader writes its own application's bag in a relation its
//!   service is in, and its leader settings; another unit is refused;
//! - every unit of the other side reads an application's bag (the remote
//!   application's data), every unit of a peer relation reads its own
//!   application's; in a relation with another service, a unit reads its own
//!   application's bag only while it leads (Juju's rule: only the leader
//!   sees what it writes there);
//! - every unit of the service reads the leader settings.
//!
//! An application's bag is a row of `relation_settings` whose `unit` is the
//! service's name (see migration 18): it goes with the relation. A change
//! wakes both services' units (a unit's relation hooks run `-changed` for the
//! remote application's data); a change to leader settings wakes the
//! service's units (`leader-settings-changed` on the others).

use crate::agents::leader_in;
use crate::db::{Store, Tx};
use crate::feed::ChangeKind;
use crate::model::Relation;
use crate::model::{get_service, get_unit};
use crate::sql::OptionalExtension;
use crate::{Error, Result};
use std::collections::BTreeMap;

/// Which bag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bag {
    /// `service`'s application settings in relation `relation`.
    App { relation: i64, service: String },
    /// The unit's service's leader settings.
    Leader,
}

impl std::fmt::Display for Bag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bag::App { relation, service } => write!(
                f,
                "the application settings of `{service}` in relation `{relation}`"
            ),
            Bag::Leader => f.write_str("the leader settings"),
        }
    }
}

type Settings = BTreeMap<String, String>;

fn parse(raw: String) -> Result<Settings> {
    serde_json::from_str(&raw).map_err(|_| Error::Corrupt {
        what: "application settings",
        value: raw,
    })
}

/// Checks that `unit` may read (`write`: write) `bag`; returns where it is:
/// the relation's id and the service whose bag it is.
fn check(c: &crate::sql::Connection, unit: &str, bag: &Bag, write: bool) -> Result<(i64, String)> {
    let u = get_unit(c, unit)?;
    let denied = |why: &str| {
        Err(Error::Unauthorized {
            caller: format!("the agent of unit `{unit}`"),
            action: format!("{} {bag}: {why}", if write { "write" } else { "read" }),
        })
    };
    match bag {
        Bag::Leader => {
            if write && !leader_in(c, &u.service, unit)? {
                return Err(Error::Relation(format!(
                    "cannot write leadership settings: unit `{unit}` is not the leader of service `{}` (`is-leader` tells)",
                    u.service
                )));
            }
            Ok((0, u.service))
        }
        Bag::App { relation, service } => {
            let rel = crate::model::find_relation(c, *relation)?
                .filter(|r| r.endpoint_of(&u.service).is_some());
            let Some(rel) = rel else {
                return denied("its service is not in that relation");
            };
            if !rel.endpoints.iter().any(|e| e.service == *service) {
                return denied("that service is not in the relation");
            }
            let own = *service == u.service;
            let peer = rel.endpoints.len() == 1;
            if write {
                if !own {
                    return denied("a unit writes only its own application's settings");
                }
                if !leader_in(c, &u.service, unit)? {
                    return Err(Error::Relation(format!(
                        "cannot write the application settings of `{service}` in relation `{relation}`: unit `{unit}` is not the leader (`is-leader` tells)"
                    )));
                }
            } else if own && !peer && !leader_in(c, &u.service, unit)? {
                return denied("only the leader reads its own application's settings");
            }
            Ok((*relation, service.clone()))
        }
    }
}

fn read_bag(
    c: &crate::sql::Connection,
    relation: i64,
    service: &str,
    bag: &Bag,
) -> Result<Settings> {
    let raw: Option<String> = match bag {
        Bag::Leader => c
            .prepare_cached("SELECT leader_settings FROM services WHERE name = ?1")?
            .query_row([service], |r| r.get(0))
            .optional()?,
        Bag::App { .. } => c
            .prepare_cached(
                "SELECT settings FROM relation_settings WHERE relation_id = ?1 AND unit = ?2",
            )?
            .query_row((relation, service), |r| r.get(0))
            .optional()?,
    };
    raw.map(parse).transpose().map(Option::unwrap_or_default)
}

impl Store {
    /// `bag` as `unit` may read it (empty when never written).
    pub fn bag_seen_by(&self, unit: &str, bag: &Bag) -> Result<Settings> {
        self.read(|c| {
            let (relation, service) = check(c, unit, bag, false)?;
            read_bag(c, relation, &service, bag)
        })
    }
}

/// The remote application's bag in `rel` as a unit of `service` sees it
/// (its own application's in a peer relation); `None` when `service` is not
/// in the relation.
pub(crate) fn counterpart_bag_in(
    c: &crate::sql::Connection,
    rel: &Relation,
    service: &str,
) -> Result<Option<(String, Settings)>> {
    if rel.endpoint_of(service).is_none() {
        return Ok(None);
    }
    let Some(other) = rel.counterpart_of(service).map(|e| e.service.clone()) else {
        return Ok(None);
    };
    let bag = Bag::App {
        relation: rel.id,
        service: other.clone(),
    };
    let settings = read_bag(c, rel.id, &other, &bag)?;
    Ok(Some((other, settings)))
}

/// Applies `changes` (`None` deletes a key) to `bag` for `unit`, under the
/// same bounds as a unit's relation settings.
pub(crate) fn update_bag_in(
    tx: &mut Tx<'_>,
    unit: &str,
    bag: &Bag,
    changes: &[(String, Option<String>)],
) -> Result<()> {
    let (relation, service) = check(tx, unit, bag, true)?;
    let settings = read_bag(tx, relation, &service, bag)?;
    let text =
        crate::relations::apply_settings(settings, changes, &bag.to_string(), "they may hold")?;
    match bag {
        Bag::Leader => {
            get_service(tx, &service)?;
            tx.prepare_cached(
                "UPDATE services SET leader_settings = ?1,
                   leader_settings_version = leader_settings_version + 1 WHERE name = ?2",
            )?
            .execute((&text, &service))?;
            tx.changed(ChangeKind::Service, &service)
        }
        Bag::App { .. } => {
            tx.prepare_cached(
                "INSERT INTO relation_settings (relation_id, unit, settings) VALUES (?1, ?2, ?3)
                 ON CONFLICT (relation_id, unit) DO UPDATE
                 SET settings = excluded.settings, version = relation_settings.version + 1",
            )?
            .execute((relation, &service, &text))?;
            tx.changed(ChangeKind::Settings, format!("{relation}#{service}"))
        }
    }
}
