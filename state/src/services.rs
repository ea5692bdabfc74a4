//! Services: deploy, add-unit, destroy, constraints and settings.

use crate::db::{Store, Tx};
use crate::environment::{check_series, get_environment};
use crate::feed::ChangeKind;
use crate::model::{
    find_service, finish_service, get_charm, get_charm_options, get_service, service_row, Charm,
    Service, SERVICE_COLS, SERVICE_COLUMNS,
};
use crate::relations::{destroy_relation_in, relations_of, DestroyedBy};
use crate::sql::OptionalExtension;
use crate::units::{
    check_placement, insert_principal, insert_principals, remove_service_in, Next, NEXT_SQL,
};
use crate::{require_alive, Entity, Error, Result};
use jujube_core::charm::{canonical_key, CharmConfig, ConfigOption, SettingValue};
use jujube_core::{names, series, Constraints, Life};

/// Units are added in transactions of at most this many, so that no
/// transaction grows with the size of a request (each unit writes about
/// seven rows: unit, machine, sequence and feed entries).
pub const UNIT_BATCH: usize = 128;

/// The most a charm's archive may hold (the charm's files are at most
/// [`jujube_wire::facade::MAX_CHARM_BYTES`]; their paths and headers add a
/// little).
pub const MAX_CHARM_ARCHIVE: usize = 2 * jujube_wire::facade::MAX_CHARM_BYTES;

impl Store {
    /// Keeps the archive of the charm whose directory a controller keeps
    /// at `path` (an upload, as the controller kept it), so that another
    /// controller without that directory restores it from here
    /// ([`Store::charm_archive`]). Refused beyond [`MAX_CHARM_ARCHIVE`].
    pub fn keep_charm_archive(&self, path: &str, archive: &[u8]) -> Result<()> {
        if archive.len() > MAX_CHARM_ARCHIVE {
            return Err(Error::BadCharm(format!(
                "the charm makes an archive of {} bytes, over the {MAX_CHARM_ARCHIVE} bytes the state keeps; make the charm smaller",
                archive.len()
            )));
        }
        self.write(|tx| {
            tx.prepare_cached(
                "INSERT INTO charm_archives (path, archive) VALUES (?1, ?2)
                 ON CONFLICT (path) DO UPDATE SET archive = excluded.archive",
            )?
            .execute(crate::sql::params![path, archive])?;
            Ok(())
        })
    }

    /// The archive of the charm kept at `path`, if the state keeps one.
    pub fn charm_archive(&self, path: &str) -> Result<Option<Vec<u8>>> {
        self.read_unchecked(|c| {
            Ok(
                c.prepare_cached("SELECT archive FROM charm_archives WHERE path = ?1")?
                    .query_row([path], |r| r.get(0))
                    .optional()?,
            )
        })
    }

    /// Where charms are kept whose archive the state does not keep (uploaded
    /// by a version before archives), at most `limit` of them.
    pub fn charms_without_archive(&self, limit: usize) -> Result<Vec<String>> {
        self.read_unchecked(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT DISTINCT path FROM charms
                 WHERE path <> '' AND path NOT IN (SELECT path FROM charm_archives)
                 ORDER BY path LIMIT ?1",
            )?;
            let paths = stmt
                .query_map([limit as i64], |r| r.get(0))?
                .collect::<crate::sql::Result<Vec<String>>>()?;
            Ok(paths)
        })
    }

    /// Forgets the archive kept for `path` (an upload no charm uses).
    pub fn forget_charm_archive(&self, path: &str) -> Result<()> {
        self.write(|tx| {
            tx.prepare_cached("DELETE FROM charm_archives WHERE path = ?1")?
                .execute([path])?;
            Ok(())
        })
    }

    /// Whether a charm of the store is kept at `path` (the controller's,
    /// deciding whether an upload is in use).
    pub fn charm_kept_at(&self, path: &str) -> Result<bool> {
        self.read_unchecked(|c| {
            Ok(
                c.prepare_cached("SELECT EXISTS (SELECT 1 FROM charms WHERE path = ?1)")?
                    .query_row([path], |r| r.get(0))?,
            )
        })
    }
}

/// What `deploy` asks for.
#[derive(Debug, Clone)]
pub struct DeployArgs {
    pub service: String,
    pub charm: Charm,
    /// Series for the service; the caller resolves `--series`, the charm URL
    /// and the environment default into one.
    pub series: String,
    pub constraints: Constraints,
    pub units: usize,
    pub to: Option<i64>,
    pub settings: Vec<(String, String)>,
}

/// One option of a service's charm config, with the service's value.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    pub key: String,
    pub option: ConfigOption,
    /// The value the user set, if any (otherwise the default applies).
    pub value: Option<SettingValue>,
}

/// Stores a charm under its URL. If a different charm is already stored
/// under that URL (a local charm edited without bumping its revision), the
/// revision is bumped until it names either this exact charm or nothing.
fn store_charm(tx: &mut Tx<'_>, charm: &Charm) -> Result<String> {
    let meta = serde_json::to_string(&charm.meta).expect("charm metadata serialises");
    let config = serde_json::to_string(&charm.config).expect("charm config serialises");
    let actions = serde_json::to_string(&charm.actions).expect("charm actions serialise");
    let (base, mut rev) = match charm.url.rsplit_once('-') {
        Some((b, r)) if r.chars().all(|c| c.is_ascii_digit()) && !r.is_empty() => {
            (b.to_string(), r.parse::<u64>().unwrap_or(0))
        }
        _ => (charm.url.clone(), 0),
    };
    loop {
        let url = format!("{base}-{rev}");
        let existing: Option<(String, String, String)> = tx
            .query_row(
                "SELECT meta, config, actions FROM charms WHERE url = ?1",
                [&url],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()?;
        match existing {
            None => {
                tx.execute(
                    "INSERT INTO charms (url, meta, config, path, actions) VALUES (?1, ?2, ?3, ?4, ?5)",
                    (&url, &meta, &config, &charm.path, &actions),
                )?;
                return Ok(url);
            }
            Some((m, c, a)) if m == meta && c == config && a == actions => return Ok(url),
            Some(_) => rev += 1,
        }
    }
}

/// The longest value of one service setting (`jujube set`, `deploy
/// --config`): every unit's agent reads the whole configuration.
pub const MAX_SERVICE_SETTING_BYTES: usize = 256 << 10;

/// The most a service's settings hold in all, keys and values: the whole
/// configuration is what every unit's agent reads, and what `get` answers.
pub const MAX_SERVICE_SETTINGS_BYTES: usize = 1 << 20;

/// `kvs` checked against the options of the charm named `charm`.
fn validate_settings(
    charm: &str,
    config: &CharmConfig,
    kvs: &[(String, String)],
) -> Result<Vec<(String, Option<String>)>> {
    kvs.iter()
        .map(|(k, v)| {
            if v.len() > MAX_SERVICE_SETTING_BYTES {
                return Err(Error::Relation(format!(
                    "the value of setting `{k}` is {} bytes, more than the {MAX_SERVICE_SETTING_BYTES} a setting may hold; nothing was changed: pass large data another way (a file, a URL)",
                    v.len()
                )));
            }
            if v.is_empty() {
                // `key=` resets the option to its default; the key must still
                // be one the charm knows.
                config
                    .validate(charm, k, "")
                    .or_else(|e| match e {
                        jujube_core::Error::UnknownSetting { .. } => Err(e),
                        _ => Ok(SettingValue::String(String::new())),
                    })?;
                Ok((k.clone(), None))
            } else {
                let value = config.validate(charm, k, v)?;
                Ok((
                    k.clone(),
                    Some(serde_json::to_string(&value).expect("setting serialises")),
                ))
            }
        })
        .collect()
}

fn write_settings(
    tx: &mut Tx<'_>,
    service: &str,
    settings: &[(String, Option<String>)],
) -> Result<()> {
    for (k, v) in settings {
        match v {
            Some(v) => tx
                .prepare_cached(
                    "INSERT INTO service_settings (service, key, value) VALUES (?1, ?2, ?3)
                     ON CONFLICT (service, key) DO UPDATE SET value = excluded.value",
                )?
                .execute((service, k, v))?,
            None => tx
                .prepare_cached("DELETE FROM service_settings WHERE service = ?1 AND key = ?2")?
                .execute((service, k))?,
        };
    }
    if !settings.is_empty() {
        // Checked in the transaction that wrote them: a refusal rolls the
        // writes back with it.
        let total: i64 = tx
            .prepare_cached(
                "SELECT coalesce(sum(octet_length(key) + octet_length(value)), 0) FROM service_settings
                 WHERE service = ?1",
            )?
            .query_row([service], |r| r.get(0))?;
        if total as usize > MAX_SERVICE_SETTINGS_BYTES {
            return Err(Error::Relation(format!(
                "the settings of service `{service}` would hold {total} bytes, more than the {MAX_SERVICE_SETTINGS_BYTES} a service's settings may hold in all; nothing was changed: reset some (`jujube set {service} KEY=`) or pass large data another way (a file, a URL)"
            )));
        }
    }
    Ok(())
}

/// Adds up to `n` principal units of an Alive, principal service in the
/// current transaction.
fn add_units_in(tx: &mut Tx<'_>, service: &str, n: usize, to: Option<i64>) -> Result<Vec<String>> {
    // The service's unit count raised, and the service read with what its
    // new units and machines start from: a check below that refuses rolls
    // the count back with the rest.
    let row = |r: &crate::sql::Row<'_>| Ok((service_row(r)?, Next::from_row(r, SERVICE_COLUMNS)?));
    // The statements' texts made once per process: an add-unit only
    // looks them up.
    static TEXTS: std::sync::LazyLock<[String; 2]> = std::sync::LazyLock::new(|| {
        [
            format!("UPDATE services SET unit_count = unit_count + ?2 WHERE name = ?1 RETURNING {SERVICE_COLS}, {NEXT_SQL}"),
            format!("SELECT {SERVICE_COLS}, {NEXT_SQL} FROM services WHERE name = ?1"),
        ]
    });
    let found = if tx.engine() == crate::sql::Engine::Postgres {
        // In one statement: one round trip, where an add-unit is two in all.
        tx.prepare_cached(&TEXTS[0])?
            .query_row((service, n as i64), row)
            .optional()?
    } else {
        // In two: SQLite keeps a statement's `RETURNING` rows in an
        // ephemeral B-tree, made for each call (a page cache, a zeroed
        // page), which cost an add-unit more than the read.
        let updated = tx
            .prepare_cached("UPDATE services SET unit_count = unit_count + ?2 WHERE name = ?1")?
            .execute((service, n as i64))?;
        if updated == 0 {
            None
        } else {
            tx.prepare_cached(&TEXTS[1])?
                .query_row([service], row)
                .optional()?
        }
    };
    let (svc, next) = found.ok_or_else(|| Error::not_found(Entity::Service, service))?;
    let svc = finish_service(svc)?;
    require_alive(Entity::Service, &svc.name, svc.life, "get new units")?;
    if svc.subordinate {
        return Err(Error::Subordinate {
            service: svc.name,
            hint: "it gets a unit for each principal unit it is related to; add units to a principal service instead",
        });
    }
    if let Some(m) = to {
        check_placement(tx, &svc, m, n)?;
    }
    let names_ = match (to, std::num::NonZeroUsize::new(n)) {
        (_, None) => Vec::new(),
        (None, Some(n)) => insert_principals(tx, &svc, n, next)?,
        (Some(_), Some(_)) => {
            let env = get_environment(tx)?;
            (0..n)
                .map(|_| insert_principal(tx, &svc, &env.constraints, to))
                .collect::<Result<_>>()?
        }
    };
    tx.changed(ChangeKind::Service, &svc.name)?;
    Ok(names_)
}

impl Store {
    pub fn service(&self, name: &str) -> Result<Service> {
        self.read(|c| get_service(c, name))
    }

    pub fn services(&self) -> Result<Vec<Service>> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(&format!(
                "SELECT {SERVICE_COLS} FROM services ORDER BY name"
            ))?;
            let rows = stmt.query_map([], service_row)?;
            rows.map(|r| finish_service(r?)).collect()
        })
    }

    pub fn charm(&self, url: &str) -> Result<Charm> {
        self.read(|c| get_charm(c, url))
    }

    /// `upgrade-charm`: the service runs `charm` from now on, under a
    /// revision above its current one (returned). Its unit agents see the
    /// new charm, lay its files over their charm directories and run
    /// `upgrade-charm`, then `config-changed`. Refused, changing nothing,
    /// unless the service is Alive and the new charm has the same name, is
    /// a subordinate exactly when the old one is, still has every endpoint
    /// the service's relations use (same role and interface), and still
    /// knows every setting the user set.
    ///
    /// `force` (`--force`): units held by a failed hook upgrade too, laying
    /// the new charm down and retrying the failed hook from it.
    pub fn upgrade_charm(&self, service: &str, charm: &Charm, force: bool) -> Result<String> {
        names::validate_service(service)?;
        charm.meta.validate()?;
        self.write(|tx| {
            let svc = get_service(tx, service)?;
            require_alive(Entity::Service, &svc.name, svc.life, "upgrade its charm")?;
            let old = get_charm(tx, &svc.charm_url)?;
            let refuse = |why: String| {
                Err(Error::Relation(format!(
                    "cannot upgrade service `{service}` to charm `{}`: {why}",
                    charm.meta.name
                )))
            };
            if charm.meta.name != old.meta.name {
                return refuse(format!(
                    "it runs charm `{}`, and a service keeps its charm's name; deploy the other charm as a service of its own",
                    old.meta.name
                ));
            }
            if charm.meta.subordinate != old.meta.subordinate {
                return refuse("a charm cannot change between subordinate and principal".into());
            }
            if !charm.meta.series.is_empty() && !charm.meta.series.contains(&svc.series) {
                return refuse(format!(
                    "it does not support the service's series `{}`",
                    svc.series
                ));
            }
            let offered = charm.meta.endpoints(service);
            for rel in relations_of(tx, service)? {
                for ep in rel.endpoints.iter().filter(|e| e.service == service) {
                    let kept = offered.iter().any(|o| {
                        o.relation == ep.relation && o.role == ep.role && o.interface == ep.interface
                    });
                    if !kept {
                        return refuse(format!(
                            "relation `{}` uses its endpoint `{}` ({} of `{}`), which the new charm lacks; remove the relation first",
                            rel.key, ep.relation, ep.role.as_str(), ep.interface
                        ));
                    }
                }
            }
            let set: Vec<String> = tx
                .prepare_cached("SELECT key FROM service_settings WHERE service = ?1 ORDER BY key")?
                .query_map([service], |r| r.get(0))?
                .collect::<crate::sql::Result<_>>()?;
            for key in set {
                if !charm.config.options.contains_key(&key) {
                    return refuse(format!(
                        "the service's setting `{key}` is not an option of the new charm; reset it first with `jujube set {service} {key}=`"
                    ));
                }
            }
            // A revision above the current one, whatever the directory's
            // revision file says: the agents upgrade on any change of URL.
            let (base, current) = old.url.rsplit_once('-').map_or((old.url.as_str(), 0), |(b, r)| {
                (b, r.parse::<u64>().unwrap_or(0))
            });
            let last = || {
                refuse(format!(
                    "the charm is at revision {current}, past which no revision can be counted; deploy it as a new service with a smaller revision in its `revision` file"
                ))
            };
            let Some(mut rev) = current.checked_add(1) else {
                return last();
            };
            if let Some(r) = charm
                .url
                .rsplit_once('-')
                .and_then(|(_, r)| r.parse::<u64>().ok())
            {
                rev = rev.max(r);
            }
            let url = loop {
                let url = format!("{base}-{rev}");
                let taken: bool = tx
                    .prepare_cached("SELECT EXISTS (SELECT 1 FROM charms WHERE url = ?1)")?
                    .query_row([&url], |r| r.get(0))?;
                if !taken {
                    break url;
                }
                let Some(next) = rev.checked_add(1) else {
                    return last();
                };
                rev = next;
            };
            tx.execute(
                "INSERT INTO charms (url, meta, config, path) VALUES (?1, ?2, ?3, ?4)",
                (
                    &url,
                    serde_json::to_string(&charm.meta).expect("charm metadata serialises"),
                    serde_json::to_string(&charm.config).expect("charm config serialises"),
                    &charm.path,
                ),
            )?;
            tx.prepare_cached("UPDATE services SET charm_url = ?1, force_charm = ?2 WHERE name = ?3")?
                .execute((&url, force, service))?;
            tx.changed(ChangeKind::Service, service)?;
            Ok(url)
        })
    }

    /// `deploy`: creates a service with its peer relations and its first
    /// units. Everything is checked before anything is written (the series
    /// must be one jujube knows, or the environment's `extra-series` adds;
    /// at most [`crate::MAX_PER_COMMAND`] units), and the service with its
    /// first batch of units is one transaction, so a refused deploy changes
    /// nothing. Further units follow in batches of [`UNIT_BATCH`]; a failure
    /// among them is [`Error::Incomplete`]. Returns the new units' names.
    pub fn deploy(&self, args: &DeployArgs) -> Result<Vec<String>> {
        names::validate_service(&args.service)?;
        crate::check_count("units", args.units)?;
        series::validate(&args.series)?;
        let meta = &args.charm.meta;
        // Parsing validated it already; a charm built in code is checked too.
        meta.validate()?;
        if !meta.series.is_empty() && !meta.series.contains(&args.series) {
            return Err(Error::UnsupportedSeries {
                charm: meta.name.clone(),
                series: args.series.clone(),
                supported: meta
                    .series
                    .iter()
                    .map(|s| format!("`{s}`"))
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        if meta.subordinate {
            let hint = if args.units > 0 || args.to.is_some() {
                Some("it gets a unit for each principal unit it is related to; deploy it without `-n` or `--to` and relate it to a principal")
            } else if !args.constraints.is_empty() {
                Some("subordinate services cannot have constraints; they run on their principal's machine")
            } else {
                None
            };
            if let Some(hint) = hint {
                return Err(Error::Subordinate {
                    service: args.service.clone(),
                    hint,
                });
            }
        }
        let settings =
            validate_settings(&args.charm.meta.name, &args.charm.config, &args.settings)?;
        let first = args.units.min(UNIT_BATCH);
        let units = self.write(|tx| {
            if let Some(existing) = find_service(tx, &args.service)? {
                return Err(if existing.life == Life::Alive {
                    Error::AlreadyExists {
                        kind: Entity::Service,
                        id: existing.name,
                    }
                } else {
                    Error::BeingDestroyed {
                        kind: Entity::Service,
                        id: existing.name,
                    }
                });
            }
            check_series(tx, &args.series)?;
            let url = store_charm(tx, &args.charm)?;
            // Names are reused once a service is removed; its incarnation
            // never is, so work queued for this service can tell it apart
            // from a later one of the same name.
            let incarnation = tx.next_in_sequence("service")?;
            tx.execute(
                "INSERT INTO services (name, charm_url, series, subordinate, constraints, incarnation)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                (
                    &args.service,
                    &url,
                    &args.series,
                    meta.subordinate,
                    args.constraints.to_string(),
                    incarnation,
                ),
            )?;
            write_settings(tx, &args.service, &settings)?;
            tx.changed(ChangeKind::Service, &args.service)?;
            // Peer relations exist for as long as the service does.
            for ep in meta.endpoints(&args.service) {
                if ep.role == jujube_core::charm::Role::Peer {
                    let mut eps = vec![ep];
                    let key = canonical_key(&mut eps);
                    crate::relations::insert_relation(tx, &key, &eps)?;
                }
            }
            if first > 0 {
                add_units_in(tx, &args.service, first, args.to)
            } else {
                Ok(Vec::new())
            }
        })?;
        crate::in_batches("units", args.units, UNIT_BATCH, units, |n| {
            self.write(|tx| add_units_in(tx, &args.service, n, args.to))
        })
    }

    /// `add-unit`: adds `n` principal units, each on a new machine that
    /// copies its constraints, or all on machine `to`. Each unit captures the
    /// environment and service constraints as they are at its creation.
    ///
    /// More than [`crate::MAX_PER_COMMAND`] is refused before anything is
    /// written. Units are added in transactions of [`UNIT_BATCH`]; a failure
    /// after some batches is [`Error::Incomplete`].
    pub fn add_units(&self, service: &str, n: usize, to: Option<i64>) -> Result<Vec<String>> {
        crate::check_count("units", n)?;
        crate::in_batches("units", n, UNIT_BATCH, Vec::new(), |k| {
            self.write(|tx| add_units_in(tx, service, k, to))
        })
    }

    /// `destroy-service`, as one transaction:
    ///
    /// - not Alive: a no-op;
    /// - each Alive relation of the service is destroyed without touching
    ///   this service's relation count (removed at once if no unit is in its
    ///   scope, else set Dying); removals are counted;
    /// - if units remain, or some relations survive, the service becomes
    ///   Dying with its relation count reduced by the removals, and a cleanup
    ///   is queued that destroys its units in batches (no transaction grows
    ///   with the number of units); the cleanup names this incarnation of
    ///   the service, so it never touches a later service of the same name;
    /// - otherwise the service is removed at once.
    pub fn destroy_service(&self, name: &str) -> Result<()> {
        self.write(|tx| {
            let svc = get_service(tx, name)?;
            if svc.life != Life::Alive {
                return Ok(());
            }
            let mut removed = 0;
            for rel in relations_of(tx, name)? {
                if rel.life != Life::Alive {
                    continue;
                }
                if destroy_relation_in(tx, &rel, DestroyedBy::Service(name))? {
                    removed += 1;
                }
            }
            if svc.unit_count > 0 || removed < svc.relation_count {
                tx.execute(
                    "UPDATE services SET life = ?1, relation_count = relation_count - ?2 WHERE name = ?3",
                    (Life::Dying.code(), removed, name),
                )?;
                tx.changed(ChangeKind::Service, name)?;
                if svc.unit_count > 0 {
                    let incarnation: i64 = tx.query_row(
                        "SELECT incarnation FROM services WHERE name = ?1",
                        [name],
                        |r| r.get(0),
                    )?;
                    let target = incarnation.to_string();
                    tx.execute(
                        "INSERT INTO cleanups (kind, target) VALUES (?1, ?2)",
                        (crate::cleanups::SERVICE_UNITS, &target),
                    )?;
                    tx.changed(ChangeKind::Cleanup, &target)?;
                }
                Ok(())
            } else {
                remove_service_in(tx, name)
            }
        })
    }

    /// Sets a service's constraints, used by units added from now on.
    pub fn set_service_constraints(&self, name: &str, cons: &Constraints) -> Result<()> {
        self.write(|tx| {
            let svc = get_service(tx, name)?;
            if svc.subordinate {
                return Err(Error::Subordinate {
                    service: svc.name,
                    hint: "subordinate services cannot have constraints; they run on their principal's machine",
                });
            }
            require_alive(Entity::Service, &svc.name, svc.life, "change its constraints")?;
            tx.execute(
                "UPDATE services SET constraints = ?1 WHERE name = ?2",
                (cons.to_string(), name),
            )?;
            tx.changed(ChangeKind::Service, name)
        })
    }

    /// `set SVC K=V...`: validates every value against the charm's config
    /// first; `K=` resets an option to its default. All or nothing.
    pub fn set_service_settings(&self, name: &str, kvs: &[(String, String)]) -> Result<()> {
        self.write(|tx| {
            let svc = get_service(tx, name)?;
            require_alive(Entity::Service, &svc.name, svc.life, "change its settings")?;
            let (charm, config) = get_charm_options(tx, &svc.charm_url)?;
            let settings = validate_settings(&charm, &config, kvs)?;
            write_settings(tx, name, &settings)?;
            tx.changed(ChangeKind::Service, name)
        })
    }

    /// Every option of the service's charm with the service's value.
    pub fn service_settings(&self, name: &str) -> Result<Vec<Setting>> {
        self.read(|c| {
            let svc = get_service(c, name)?;
            let (_, config) = get_charm_options(c, &svc.charm_url)?;
            let mut out = Vec::new();
            for (key, option) in config.options {
                let raw: Option<String> = c
                    .prepare_cached(
                        "SELECT value FROM service_settings WHERE service = ?1 AND key = ?2",
                    )?
                    .query_row((name, &key), |r| r.get(0))
                    .optional()?;
                let value = raw
                    .map(|v| {
                        serde_json::from_str(&v).map_err(|_| Error::Corrupt {
                            what: "service setting",
                            value: v,
                        })
                    })
                    .transpose()?;
                out.push(Setting { key, option, value });
            }
            Ok(out)
        })
    }
}
