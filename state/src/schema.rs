//! Embedded migrations. Each entry moves the schema from version `i` to
//! `i + 1` (SQLite's `user_version`); they run in one transaction at open.
//! Never edit a released migration: append a new one.

pub(crate) const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE environment (
    id             INTEGER PRIMARY KEY CHECK (id = 1),
    name           TEXT NOT NULL,
    uuid           TEXT NOT NULL,
    provider       TEXT NOT NULL,
    default_series TEXT NOT NULL,
    constraints    TEXT NOT NULL DEFAULT ''
);
CREATE TABLE environment_config (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;

-- Identifiers that must never be reused (machine ids, unit numbers per
-- service name) come from here, not from max(id)+1.
CREATE TABLE sequences (
    name TEXT PRIMARY KEY,
    next INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE machines (
    id             INTEGER PRIMARY KEY,
    life           INTEGER NOT NULL DEFAULT 0 CHECK (life IN (0, 1, 2)),
    series         TEXT NOT NULL,
    jobs           TEXT NOT NULL,
    manage_environ INTEGER NOT NULL DEFAULT 0,
    constraints    TEXT NOT NULL DEFAULT '',
    instance_id    TEXT UNIQUE,
    nonce          TEXT,
    status         TEXT NOT NULL DEFAULT 'pending',
    status_info    TEXT NOT NULL DEFAULT '',
    zone           TEXT,
    hardware       TEXT
);

CREATE TABLE charms (
    url    TEXT PRIMARY KEY,
    meta   TEXT NOT NULL,
    config TEXT NOT NULL,
    path   TEXT NOT NULL DEFAULT ''
) WITHOUT ROWID;

CREATE TABLE services (
    name           TEXT PRIMARY KEY,
    charm_url      TEXT NOT NULL REFERENCES charms (url),
    series         TEXT NOT NULL,
    subordinate    INTEGER NOT NULL,
    constraints    TEXT NOT NULL DEFAULT '',
    life           INTEGER NOT NULL DEFAULT 0 CHECK (life IN (0, 1, 2)),
    unit_count     INTEGER NOT NULL DEFAULT 0 CHECK (unit_count >= 0),
    relation_count INTEGER NOT NULL DEFAULT 0 CHECK (relation_count >= 0)
);
CREATE TABLE service_settings (
    service TEXT NOT NULL REFERENCES services (name),
    key     TEXT NOT NULL,
    value   TEXT NOT NULL,
    PRIMARY KEY (service, key)
) WITHOUT ROWID;

CREATE TABLE units (
    name        TEXT PRIMARY KEY,
    service     TEXT NOT NULL REFERENCES services (name),
    number      INTEGER NOT NULL,
    series      TEXT NOT NULL,
    principal   TEXT REFERENCES units (name),
    machine_id  INTEGER REFERENCES machines (id),
    constraints TEXT NOT NULL DEFAULT '',
    life        INTEGER NOT NULL DEFAULT 0 CHECK (life IN (0, 1, 2)),
    status      TEXT NOT NULL DEFAULT 'pending',
    status_info TEXT NOT NULL DEFAULT '',
    CHECK (principal IS NULL OR machine_id IS NULL)
);
CREATE INDEX units_service ON units (service, number);
CREATE INDEX units_machine ON units (machine_id);
CREATE INDEX units_principal ON units (principal);

CREATE TABLE relations (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    key        TEXT NOT NULL UNIQUE,
    interface  TEXT NOT NULL,
    scope      TEXT NOT NULL CHECK (scope IN ('global', 'container')),
    life       INTEGER NOT NULL DEFAULT 0 CHECK (life IN (0, 1, 2)),
    unit_count INTEGER NOT NULL DEFAULT 0 CHECK (unit_count >= 0)
);
CREATE TABLE relation_endpoints (
    relation_id   INTEGER NOT NULL REFERENCES relations (id),
    service       TEXT NOT NULL REFERENCES services (name),
    relation_name TEXT NOT NULL,
    role          TEXT NOT NULL CHECK (role IN ('provider', 'requirer', 'peer')),
    interface     TEXT NOT NULL,
    scope         TEXT NOT NULL,
    PRIMARY KEY (relation_id, service, relation_name)
) WITHOUT ROWID;
CREATE INDEX relation_endpoints_service ON relation_endpoints (service);

-- A unit in a relation's scope. `container` is the principal unit's name for
-- container-scoped relations (units only see others in the same container),
-- and '' for global ones.
CREATE TABLE relation_scopes (
    relation_id INTEGER NOT NULL REFERENCES relations (id),
    unit        TEXT NOT NULL REFERENCES units (name),
    container   TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (relation_id, unit)
) WITHOUT ROWID;
CREATE INDEX relation_scopes_unit ON relation_scopes (unit);

-- Settings outlive both the scope and the unit (other units may still read a
-- departed unit's settings); they go with the relation, via a cleanup. Hence
-- no foreign keys here.
CREATE TABLE relation_settings (
    relation_id INTEGER NOT NULL,
    unit        TEXT NOT NULL,
    settings    TEXT NOT NULL DEFAULT '{}',
    version     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (relation_id, unit)
) WITHOUT ROWID;

CREATE TABLE cleanups (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    kind   TEXT NOT NULL,
    target TEXT NOT NULL,
    cursor INTEGER NOT NULL DEFAULT -1
);

CREATE TABLE changes (
    revision INTEGER PRIMARY KEY AUTOINCREMENT,
    kind     TEXT NOT NULL,
    id       TEXT NOT NULL
);
"#,
    // 2: what the provisioner sees of stray instances, for `jujube strays`
    // and `status`: instances tagged as this environment's that no machine
    // owns, when they were first seen and when they will be reaped (NULL:
    // never, under the harvest mode).
    r#"
CREATE TABLE strays (
    instance_id TEXT PRIMARY KEY,
    machine_tag TEXT NOT NULL,
    class       TEXT NOT NULL,
    first_seen  INTEGER NOT NULL,
    reap_at     INTEGER
) WITHOUT ROWID;
"#,
    // 3 (provisioner): what the provisioner learns of the cloud outside a
    // start. `machines.instance_status`: `running` once an instance is
    // recorded, `gone` when the instance poller finds that the cloud no
    // longer has it (the machine is then in `error`, its message naming the
    // instance). `provider_status`: one row while the provider cannot be
    // reached (listing zones or instances fails), saying why and since when
    // (unix seconds); no row while it answers.
    r#"
ALTER TABLE machines ADD COLUMN instance_status TEXT;
CREATE TABLE provider_status (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    message TEXT NOT NULL,
    since   INTEGER NOT NULL
);
"#,
    // 4 (state-rules): every service gets an incarnation id that is never
    // reused (from the `service` sequence), and `service-units` cleanups name
    // the incarnation they were queued for instead of the service name: a
    // name may be taken by a new service once the old one is removed, and a
    // cleanup queued for the old one must never touch the new one.
    //
    // Rows queued by older versions name a service. Only `destroy-service`
    // queues them and a destroyed service never comes back to life, so a row
    // whose name belongs to a service that is not Alive was queued for that
    // very service and is re-keyed to it; any other row is stale (its service
    // was removed, and the name is free or belongs to a live service) and is
    // dropped.
    r#"
ALTER TABLE services ADD COLUMN incarnation INTEGER;
UPDATE services SET incarnation = (SELECT count(*) FROM services s WHERE s.rowid <= services.rowid);
CREATE UNIQUE INDEX services_incarnation ON services (incarnation);
INSERT INTO sequences (name, next) VALUES ('service', (SELECT count(*) FROM services) + 1);

DELETE FROM cleanups WHERE kind = 'service-units'
    AND NOT EXISTS (SELECT 1 FROM services s WHERE s.name = cleanups.target AND s.life != 0);
UPDATE cleanups SET target = (SELECT s.incarnation FROM services s WHERE s.name = cleanups.target)
    WHERE kind = 'service-units';
"#,
    // 5 (agents): an explicit "an agent has started for this unit" marker (the
    // "destroy a pending unit at once" shortcut keys on it, no longer on the
    // status string; a unit whose status an agent already set has had one),
    // and the machine agent's own status beside the provisioning status.
    r#"
ALTER TABLE units ADD COLUMN agent_started INTEGER NOT NULL DEFAULT 0;
UPDATE units SET agent_started = 1 WHERE status != 'pending';
ALTER TABLE machines ADD COLUMN agent_status TEXT NOT NULL DEFAULT 'pending';
ALTER TABLE machines ADD COLUMN agent_status_info TEXT NOT NULL DEFAULT '';
"#,
    // 6 (agent API): each agent's credential, as a hash of its secret only.
    // The row goes with its machine or unit (ON DELETE CASCADE), so a
    // removed entity's credential stops working in the same transaction;
    // machine ids and unit names are never reused.
    r#"
CREATE TABLE agent_credentials (
    tag        TEXT PRIMARY KEY,
    machine_id INTEGER REFERENCES machines (id) ON DELETE CASCADE,
    unit       TEXT REFERENCES units (name) ON DELETE CASCADE,
    hash       TEXT NOT NULL,
    CHECK ((machine_id IS NULL) <> (unit IS NULL))
) WITHOUT ROWID;
CREATE INDEX agent_credentials_machine ON agent_credentials (machine_id);
CREATE INDEX agent_credentials_unit ON agent_credentials (unit);
"#,
    // 7 (hooks): `jujube resolved UNIT [--retry]` on a unit whose hook
    // failed: `retry-hooks` (run the failed hook again) or `no-hooks` (count
    // it as done and go on), as Juju names them; cleared by the unit's agent
    // once it has acted on it. `ports`: what the unit's hooks opened with
    // `open-port` (`80/tcp 443/tcp`, sorted), shown by `status`.
    r#"
ALTER TABLE units ADD COLUMN resolved TEXT;
ALTER TABLE units ADD COLUMN ports TEXT NOT NULL DEFAULT '';
"#,
    // 8 (run): `jujube run UNIT -- CMD...` — a command the unit's agent runs
    // in a hook context, serialised with its hooks (the spec's wished-for
    // `juju-run`). Queued by the user, taken and answered by the unit's own
    // agent; the row goes with its unit. `argv` is a JSON array; `code`,
    // `stdout` and `stderr` are NULL until the agent answers.
    r#"
CREATE TABLE runs (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    unit      TEXT NOT NULL REFERENCES units (name) ON DELETE CASCADE,
    argv      TEXT NOT NULL,
    timeout   INTEGER NOT NULL,
    code      INTEGER,
    stdout    TEXT,
    stderr    TEXT
);
CREATE INDEX runs_unit ON runs (unit, id);
"#,
    // 9 (provisioner): the machines a provisioning pass may have to act on —
    // not Alive, or without an instance — found without reading every
    // machine: with 100,000 provisioned machines and agents committing
    // thousands of times a second, a pass per commit must not be a scan.
    r#"
CREATE INDEX machines_actionable ON machines (id) WHERE life != 0 OR instance_id IS NULL;
"#,
    // 10 (enrollment): instances of a launch batch share their user data, so
    // it holds no machine's secret but a one-time enrollment token for the
    // batch (stored as a hash, with its expiry, unix seconds). An instance
    // trades it, with its instance id, for its machine's credential, once:
    // `enrolled` remembers which instances have.
    r#"
CREATE TABLE enrollments (
    token_hash TEXT PRIMARY KEY,
    batch      TEXT NOT NULL,
    expires    INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE enrolled (
    token_hash  TEXT NOT NULL REFERENCES enrollments (token_hash) ON DELETE CASCADE,
    instance_id TEXT NOT NULL,
    PRIMARY KEY (token_hash, instance_id)
) WITHOUT ROWID;
"#,
    // 11 (forced upgrades): `upgrade-charm --force` set the service's
    // current charm: a unit held by a failed hook lays it down too, and
    // retries the hook from it (charms-in-action.txt's forced upgrades).
    r#"
ALTER TABLE services ADD COLUMN force_charm INTEGER NOT NULL DEFAULT 0;
"#,
    // 12 (run): when a `jujube run` was queued (unix seconds; 0 for one
    // queued before), so that its timeout counts the time it waited behind
    // a running hook.
    r#"
ALTER TABLE runs ADD COLUMN queued INTEGER NOT NULL DEFAULT 0;
"#,
    // 13 (refused agents): when the API server first refused a secret
    // presented for this credential (unix seconds) since it was set, so
    // that `status` shows an agent left behind by a newer start attempt or
    // enrollment; cleared when the current credential logs in. Replacing
    // the credential clears it too.
    r#"
ALTER TABLE agent_credentials ADD COLUMN refused_at INTEGER;
"#,
    // 14 (write path): only subordinates have a principal, so the index
    // on it holds only theirs: a principal unit's insert no longer writes
    // a page of NULLs (`principal = ?` still finds it).
    r#"
DROP INDEX units_principal;
CREATE INDEX units_principal ON units (principal) WHERE principal IS NOT NULL;
"#,
    // 15 (presence): when the API server last saw the agent holding a
    // live connection (unix seconds; see `Store::note_agents_seen`).
    r#"
ALTER TABLE agent_credentials ADD COLUMN seen_at INTEGER;
"#,
    // 16 (today's charms): the workload status a unit's charm sets with
    // `status-set` (Juju's `unknown` until it does), its service's (set by
    // the leader), and which unit leads its service.
    r#"
ALTER TABLE units ADD COLUMN workload_status TEXT NOT NULL DEFAULT 'unknown';
ALTER TABLE units ADD COLUMN workload_message TEXT NOT NULL DEFAULT '';
ALTER TABLE services ADD COLUMN workload_status TEXT NOT NULL DEFAULT 'unknown';
ALTER TABLE services ADD COLUMN workload_message TEXT NOT NULL DEFAULT '';
ALTER TABLE services ADD COLUMN leader TEXT;
"#,
    // 17 (today's charms): the workload's version, as the charm tells it
    // (`application-version-set`), shown as the service's `version`.
    r#"
ALTER TABLE services ADD COLUMN workload_version TEXT NOT NULL DEFAULT '';
"#,
    // 18 (today's charms): the leader's settings (`leader-set`, a JSON
    // object) and their version, which wakes the other units
    // (`leader-settings-changed`); a charm's actions (`actions.yaml` as
    // JSON); and actions queued as runs: a run with an `action` name runs
    // that action with `params` (a JSON object) and answers `results` (a
    // JSON object: the results, whether it failed and why, its log).
    // An application's settings in a relation (`relation-set --app`) are
    // rows of `relation_settings` whose `unit` is the service's name (a
    // unit's name always has a `/`): they go with the relation as unit
    // settings do.
    r#"
ALTER TABLE services ADD COLUMN leader_settings TEXT NOT NULL DEFAULT '{}';
ALTER TABLE services ADD COLUMN leader_settings_version INTEGER NOT NULL DEFAULT 0;
ALTER TABLE charms ADD COLUMN actions TEXT NOT NULL DEFAULT '{}';
ALTER TABLE runs ADD COLUMN action TEXT;
ALTER TABLE runs ADD COLUMN params TEXT;
ALTER TABLE runs ADD COLUMN results TEXT;
"#,
    // 19 (write path): the change feed without AUTOINCREMENT, which wrote
    // `sqlite_sequence` — one more page — in every transaction. A revision
    // is the largest one plus one; it never goes back because pruning keeps
    // the newest change (`Store::prune_changes`). An empty feed keeps its
    // high-water mark as one row.
    r#"
CREATE TABLE changes_new (
    revision INTEGER PRIMARY KEY,
    kind     TEXT NOT NULL,
    id       TEXT NOT NULL
);
INSERT INTO changes_new (revision, kind, id) SELECT revision, kind, id FROM changes;
INSERT INTO changes_new (revision, kind, id)
    SELECT seq, 'environment', '' FROM sqlite_sequence
    WHERE name = 'changes' AND seq > 0 AND NOT EXISTS (SELECT 1 FROM changes_new);
DROP TABLE changes;
ALTER TABLE changes_new RENAME TO changes;
"#,
    // 20 (write path): `machines.instance_id` unique through a partial
    // index: a new machine, with no instance yet, writes no entry (the
    // UNIQUE column's index held every NULL: one more page per machine).
    // A table rebuild (`migrate` turns foreign keys off around it and
    // checks them before committing).
    r#"
CREATE TABLE machines_new (
    id                INTEGER PRIMARY KEY,
    life              INTEGER NOT NULL DEFAULT 0 CHECK (life IN (0, 1, 2)),
    series            TEXT NOT NULL,
    jobs              TEXT NOT NULL,
    manage_environ    INTEGER NOT NULL DEFAULT 0,
    constraints       TEXT NOT NULL DEFAULT '',
    instance_id       TEXT,
    nonce             TEXT,
    status            TEXT NOT NULL DEFAULT 'pending',
    status_info       TEXT NOT NULL DEFAULT '',
    zone              TEXT,
    hardware          TEXT,
    instance_status   TEXT,
    agent_status      TEXT NOT NULL DEFAULT 'pending',
    agent_status_info TEXT NOT NULL DEFAULT ''
);
INSERT INTO machines_new (id, life, series, jobs, manage_environ, constraints, instance_id, nonce,
                          status, status_info, zone, hardware, instance_status, agent_status,
                          agent_status_info)
    SELECT id, life, series, jobs, manage_environ, constraints, instance_id, nonce, status,
           status_info, zone, hardware, instance_status, agent_status, agent_status_info
    FROM machines;
DROP TABLE machines;
ALTER TABLE machines_new RENAME TO machines;
CREATE INDEX machines_actionable ON machines (id) WHERE life != 0 OR instance_id IS NULL;
CREATE UNIQUE INDEX machines_instance ON machines (instance_id) WHERE instance_id IS NOT NULL;
"#,
    // 21 (write path): units keyed by name alone (WITHOUT ROWID): the
    // table was a rowid table with an index on its TEXT primary key, two
    // B-trees — two pages — for what one holds.
    r#"
CREATE TABLE units_new (
    name             TEXT PRIMARY KEY,
    service          TEXT NOT NULL REFERENCES services (name),
    number           INTEGER NOT NULL,
    series           TEXT NOT NULL,
    principal        TEXT REFERENCES units (name),
    machine_id       INTEGER REFERENCES machines (id),
    constraints      TEXT NOT NULL DEFAULT '',
    life             INTEGER NOT NULL DEFAULT 0 CHECK (life IN (0, 1, 2)),
    status           TEXT NOT NULL DEFAULT 'pending',
    status_info      TEXT NOT NULL DEFAULT '',
    agent_started    INTEGER NOT NULL DEFAULT 0,
    resolved         TEXT,
    ports            TEXT NOT NULL DEFAULT '',
    workload_status  TEXT NOT NULL DEFAULT 'unknown',
    workload_message TEXT NOT NULL DEFAULT '',
    CHECK (principal IS NULL OR machine_id IS NULL)
) WITHOUT ROWID;
INSERT INTO units_new (name, service, number, series, principal, machine_id, constraints, life,
                       status, status_info, agent_started, resolved, ports, workload_status,
                       workload_message)
    SELECT name, service, number, series, principal, machine_id, constraints, life, status,
           status_info, agent_started, resolved, ports, workload_status, workload_message
    FROM units;
DROP TABLE units;
ALTER TABLE units_new RENAME TO units;
CREATE INDEX units_service ON units (service, number);
CREATE INDEX units_machine ON units (machine_id);
CREATE INDEX units_principal ON units (principal) WHERE principal IS NOT NULL;
"#,
    // 22 (users): who may use the environment through the API. `access`
    // 0 none, 1 read, 2 write, 3 admin; `password_hash` an argon2id PHC
    // string, NULL until the user registers; `registration_hash` the
    // SHA-256 of `add-user`'s one-time secret, NULL once used. Neither
    // secret is ever stored itself.
    r#"
CREATE TABLE users (
    name              TEXT PRIMARY KEY,
    access            INTEGER NOT NULL CHECK (access IN (0, 1, 2, 3)),
    password_hash     TEXT,
    registration_hash TEXT,
    created_by        TEXT,
    created_at        INTEGER NOT NULL
) WITHOUT ROWID;
"#,
    // 23 (write path): a new machine's id and a new unit's number are
    // read, not written: the next one is one above the largest in use, or
    // above the largest ever removed, which these triggers keep in
    // `sequences` as rows go. Adding a unit or a machine so writes no
    // sequence row (one page fewer in each); removals, which write many
    // pages anyway, write it. Ids and numbers are still never reused (unit
    // numbers per service name, across the service's removal).
    r#"
CREATE TRIGGER machines_high_water AFTER DELETE ON machines BEGIN
    INSERT INTO sequences (name, next) VALUES ('machine', OLD.id + 1)
    ON CONFLICT (name) DO UPDATE SET next = max(next, excluded.next);
END;
CREATE TRIGGER units_high_water AFTER DELETE ON units BEGIN
    INSERT INTO sequences (name, next) VALUES ('unit:' || OLD.service, OLD.number + 1)
    ON CONFLICT (name) DO UPDATE SET next = max(next, excluded.next);
END;
"#,
    // 24 (several controllers): who runs the singleton jobs, with the
    // fencing token a holder's writes carry (see `crate::leases`).
    // `expires`: unix milliseconds.
    r#"
CREATE TABLE controller_leases (
    name    TEXT PRIMARY KEY,
    holder  TEXT NOT NULL,
    token   INTEGER NOT NULL CHECK (token > 0),
    expires INTEGER NOT NULL
) WITHOUT ROWID;
"#,
    // 25 (several controllers): each controller machine's running
    // controller, where it serves the API and when it last said so (unix
    // milliseconds); see `crate::controllers`.
    r#"
CREATE TABLE controllers (
    machine_id INTEGER PRIMARY KEY CHECK (machine_id >= 0),
    holder     TEXT NOT NULL,
    addresses  TEXT NOT NULL,
    seen       INTEGER NOT NULL
);
"#,
    // 26 (several controllers): commits notified to other controllers;
    // PostgreSQL only (on SQLite other processes' commits are polled).
    "SELECT 1;",
    // 27 (several controllers): each agent's write stamp, the incarnation
    // it took at its start and the sequence number of its last write
    // applied (see `crate::agents::Stamp`); in the agent's own row, which
    // most of its writes change anyway.
    r#"
ALTER TABLE units ADD COLUMN agent_incarnation INTEGER NOT NULL DEFAULT 0;
ALTER TABLE units ADD COLUMN agent_seq INTEGER NOT NULL DEFAULT 0;
ALTER TABLE machines ADD COLUMN agent_incarnation INTEGER NOT NULL DEFAULT 0;
ALTER TABLE machines ADD COLUMN agent_seq INTEGER NOT NULL DEFAULT 0;
"#,
    // 28 (several controllers): each uploaded charm's archive, keyed by
    // the path its directory is kept at on a controller's disk, so that
    // another controller without that directory restores it (see
    // `Store::keep_charm_archive`).
    r#"
CREATE TABLE charm_archives (
    path    TEXT PRIMARY KEY,
    archive BLOB NOT NULL
) WITHOUT ROWID;
"#,
    // 29: whether a unit's status was reported by an agent that still
    // runs: a host of in-process agents (the controller's) clears it
    // for every unit as it starts, and a unit's next report sets it again
    // (see `Store::agents_restarting`).
    r#"
ALTER TABLE units ADD COLUMN status_current INTEGER NOT NULL DEFAULT 1;
CREATE INDEX units_status_stale ON units (service, number) WHERE NOT status_current;
"#,
    // 30 (write path): the checks of a column against a list as
    // comparisons. SQLite codes `x IN (a, b, c)` of three or more
    // constants as a lookup in an ephemeral B-tree, built afresh for every
    // row checked: an add-unit built two (its unit's `life`, its
    // machine's), with a page cache each, a fifth of its instructions.
    // The constraints are the same, so every row satisfies them and only
    // the tables' text changes, SQLite's documented way for a change that
    // leaves the file's content as it is; `RESET` reloads this
    // connection's schema, and a table made and dropped moves the schema's
    // version, so that every other connection reloads its own.
    r#"
PRAGMA writable_schema = ON;
UPDATE sqlite_schema SET sql = replace(replace(replace(replace(sql,
        'CHECK (life IN (0, 1, 2))',
        'CHECK (life = 0 OR life = 1 OR life = 2)'),
        'CHECK (role IN (''provider'', ''requirer'', ''peer''))',
        'CHECK (role = ''provider'' OR role = ''requirer'' OR role = ''peer'')'),
        'CHECK (access IN (0, 1, 2, 3))',
        'CHECK (access = 0 OR access = 1 OR access = 2 OR access = 3)'),
        'CHECK (scope IN (''global'', ''container''))',
        'CHECK (scope = ''global'' OR scope = ''container'')')
    WHERE type = 'table';
PRAGMA writable_schema = RESET;
CREATE TABLE schema_reloaded (x);
DROP TABLE schema_reloaded;
"#,
    // 31: machines in error found without reading every machine (`wait`
    // asks several times a second). A new machine is `pending`: an
    // add-unit writes no entry.
    r#"
CREATE INDEX machines_in_error ON machines (id) WHERE status = 'error';
"#,
    // 32: how many strays the view leaves out (it records the first
    // `MAX_STRAYS_RECORDED`; see `Store::set_strays`).
    r#"
CREATE TABLE strays_unlisted (
    id    INTEGER PRIMARY KEY CHECK (id = 1),
    count INTEGER NOT NULL
);
"#,
];

/// The PostgreSQL schema. PostgreSQL does not replay SQLite's history
/// (table rebuilds with foreign keys off, `rowid`, `sqlite_sequence`): its
/// first entry is SQLite's schema as of [`MIGRATIONS`]' 24th version,
/// written for PostgreSQL. Every migration appended to [`MIGRATIONS`] after
/// it gets its twin here, at the same index less [`PG_BASELINE`]; a test
/// compares the two schemas' tables and columns.
///
/// What the translation changes: `INTEGER` is `BIGINT` (the store reads
/// and binds 64-bit integers), the flags are `BOOLEAN` (rules test
/// them bare: `NOT u.agent_started`), `AUTOINCREMENT` is an identity
/// column (never reused, as there; PostgreSQL's may leave gaps after a
/// rolled-back transaction), and the high-water triggers are PL/pgSQL.
/// Tables come in the order their references need.
pub(crate) const PG_MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE environment (
    id             BIGINT PRIMARY KEY CHECK (id = 1),
    name           TEXT NOT NULL,
    uuid           TEXT NOT NULL,
    provider       TEXT NOT NULL,
    default_series TEXT NOT NULL,
    constraints    TEXT NOT NULL DEFAULT ''
);
CREATE TABLE environment_config (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE sequences (
    name TEXT PRIMARY KEY,
    next BIGINT NOT NULL
);
CREATE TABLE charms (
    url     TEXT PRIMARY KEY,
    meta    TEXT NOT NULL,
    config  TEXT NOT NULL,
    path    TEXT NOT NULL DEFAULT '',
    actions TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE services (
    name                    TEXT PRIMARY KEY,
    charm_url               TEXT NOT NULL REFERENCES charms (url),
    series                  TEXT NOT NULL,
    subordinate             BOOLEAN NOT NULL,
    constraints             TEXT NOT NULL DEFAULT '',
    life                    BIGINT NOT NULL DEFAULT 0 CHECK (life IN (0, 1, 2)),
    unit_count              BIGINT NOT NULL DEFAULT 0 CHECK (unit_count >= 0),
    relation_count          BIGINT NOT NULL DEFAULT 0 CHECK (relation_count >= 0),
    incarnation             BIGINT,
    force_charm             BOOLEAN NOT NULL DEFAULT FALSE,
    workload_status         TEXT NOT NULL DEFAULT 'unknown',
    workload_message        TEXT NOT NULL DEFAULT '',
    leader                  TEXT,
    workload_version        TEXT NOT NULL DEFAULT '',
    leader_settings         TEXT NOT NULL DEFAULT '{}',
    leader_settings_version BIGINT NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX services_incarnation ON services (incarnation);
CREATE TABLE service_settings (
    service TEXT NOT NULL REFERENCES services (name),
    key     TEXT NOT NULL,
    value   TEXT NOT NULL,
    PRIMARY KEY (service, key)
);
CREATE TABLE machines (
    id                BIGINT PRIMARY KEY,
    life              BIGINT NOT NULL DEFAULT 0 CHECK (life IN (0, 1, 2)),
    series            TEXT NOT NULL,
    jobs              TEXT NOT NULL,
    manage_environ    BOOLEAN NOT NULL DEFAULT FALSE,
    constraints       TEXT NOT NULL DEFAULT '',
    instance_id       TEXT,
    nonce             TEXT,
    status            TEXT NOT NULL DEFAULT 'pending',
    status_info       TEXT NOT NULL DEFAULT '',
    zone              TEXT,
    hardware          TEXT,
    instance_status   TEXT,
    agent_status      TEXT NOT NULL DEFAULT 'pending',
    agent_status_info TEXT NOT NULL DEFAULT ''
);
CREATE INDEX machines_actionable ON machines (id) WHERE life != 0 OR instance_id IS NULL;
CREATE UNIQUE INDEX machines_instance ON machines (instance_id) WHERE instance_id IS NOT NULL;
CREATE TABLE units (
    name             TEXT PRIMARY KEY,
    service          TEXT NOT NULL REFERENCES services (name),
    number           BIGINT NOT NULL,
    series           TEXT NOT NULL,
    principal        TEXT REFERENCES units (name),
    machine_id       BIGINT REFERENCES machines (id),
    constraints      TEXT NOT NULL DEFAULT '',
    life             BIGINT NOT NULL DEFAULT 0 CHECK (life IN (0, 1, 2)),
    status           TEXT NOT NULL DEFAULT 'pending',
    status_info      TEXT NOT NULL DEFAULT '',
    agent_started    BOOLEAN NOT NULL DEFAULT FALSE,
    resolved         TEXT,
    ports            TEXT NOT NULL DEFAULT '',
    workload_status  TEXT NOT NULL DEFAULT 'unknown',
    workload_message TEXT NOT NULL DEFAULT '',
    CHECK (principal IS NULL OR machine_id IS NULL)
);
CREATE INDEX units_service ON units (service, number);
CREATE INDEX units_machine ON units (machine_id);
CREATE INDEX units_principal ON units (principal) WHERE principal IS NOT NULL;
CREATE TABLE relations (
    id         BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    key        TEXT NOT NULL UNIQUE,
    interface  TEXT NOT NULL,
    scope      TEXT NOT NULL CHECK (scope IN ('global', 'container')),
    life       BIGINT NOT NULL DEFAULT 0 CHECK (life IN (0, 1, 2)),
    unit_count BIGINT NOT NULL DEFAULT 0 CHECK (unit_count >= 0)
);
CREATE TABLE relation_endpoints (
    relation_id   BIGINT NOT NULL REFERENCES relations (id),
    service       TEXT NOT NULL REFERENCES services (name),
    relation_name TEXT NOT NULL,
    role          TEXT NOT NULL CHECK (role IN ('provider', 'requirer', 'peer')),
    interface     TEXT NOT NULL,
    scope         TEXT NOT NULL,
    PRIMARY KEY (relation_id, service, relation_name)
);
CREATE INDEX relation_endpoints_service ON relation_endpoints (service);
CREATE TABLE relation_scopes (
    relation_id BIGINT NOT NULL REFERENCES relations (id),
    unit        TEXT NOT NULL REFERENCES units (name),
    container   TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (relation_id, unit)
);
CREATE INDEX relation_scopes_unit ON relation_scopes (unit);
CREATE TABLE relation_settings (
    relation_id BIGINT NOT NULL,
    unit        TEXT NOT NULL,
    settings    TEXT NOT NULL DEFAULT '{}',
    version     BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (relation_id, unit)
);
CREATE TABLE cleanups (
    id     BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    kind   TEXT NOT NULL,
    target TEXT NOT NULL,
    cursor BIGINT NOT NULL DEFAULT -1
);
CREATE TABLE strays (
    instance_id TEXT PRIMARY KEY,
    machine_tag TEXT NOT NULL,
    class       TEXT NOT NULL,
    first_seen  BIGINT NOT NULL,
    reap_at     BIGINT
);
CREATE TABLE provider_status (
    id      BIGINT PRIMARY KEY CHECK (id = 1),
    message TEXT NOT NULL,
    since   BIGINT NOT NULL
);
CREATE TABLE agent_credentials (
    tag        TEXT PRIMARY KEY,
    machine_id BIGINT REFERENCES machines (id) ON DELETE CASCADE,
    unit       TEXT REFERENCES units (name) ON DELETE CASCADE,
    hash       TEXT NOT NULL,
    refused_at BIGINT,
    seen_at    BIGINT,
    CHECK ((machine_id IS NULL) <> (unit IS NULL))
);
CREATE INDEX agent_credentials_machine ON agent_credentials (machine_id);
CREATE INDEX agent_credentials_unit ON agent_credentials (unit);
CREATE TABLE runs (
    id      BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    unit    TEXT NOT NULL REFERENCES units (name) ON DELETE CASCADE,
    argv    TEXT NOT NULL,
    timeout BIGINT NOT NULL,
    code    BIGINT,
    stdout  TEXT,
    stderr  TEXT,
    queued  BIGINT NOT NULL DEFAULT 0,
    action  TEXT,
    params  TEXT,
    results TEXT
);
CREATE INDEX runs_unit ON runs (unit, id);
CREATE TABLE enrollments (
    token_hash TEXT PRIMARY KEY,
    batch      TEXT NOT NULL,
    expires    BIGINT NOT NULL
);
CREATE TABLE enrolled (
    token_hash  TEXT NOT NULL REFERENCES enrollments (token_hash) ON DELETE CASCADE,
    instance_id TEXT NOT NULL,
    PRIMARY KEY (token_hash, instance_id)
);
CREATE TABLE changes (
    revision BIGINT PRIMARY KEY,
    kind     TEXT NOT NULL,
    id       TEXT NOT NULL
);
CREATE TABLE users (
    name              TEXT PRIMARY KEY,
    access            BIGINT NOT NULL CHECK (access IN (0, 1, 2, 3)),
    password_hash     TEXT,
    registration_hash TEXT,
    created_by        TEXT,
    created_at        BIGINT NOT NULL
);
CREATE FUNCTION machines_high_water() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO sequences (name, next) VALUES ('machine', OLD.id + 1)
    ON CONFLICT (name) DO UPDATE SET next = greatest(sequences.next, excluded.next);
    RETURN NULL;
END $$;
CREATE TRIGGER machines_high_water AFTER DELETE ON machines
    FOR EACH ROW EXECUTE FUNCTION machines_high_water();
CREATE FUNCTION units_high_water() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO sequences (name, next) VALUES ('unit:' || OLD.service, OLD.number + 1)
    ON CONFLICT (name) DO UPDATE SET next = greatest(sequences.next, excluded.next);
    RETURN NULL;
END $$;
CREATE TRIGGER units_high_water AFTER DELETE ON units
    FOR EACH ROW EXECUTE FUNCTION units_high_water();
CREATE TABLE controller_leases (
    name    TEXT PRIMARY KEY,
    holder  TEXT NOT NULL,
    token   BIGINT NOT NULL CHECK (token > 0),
    expires BIGINT NOT NULL
);
"#,
    // 25
    r#"
CREATE TABLE controllers (
    machine_id BIGINT PRIMARY KEY CHECK (machine_id >= 0),
    holder     TEXT NOT NULL,
    addresses  TEXT NOT NULL,
    seen       BIGINT NOT NULL
);
"#,
    // 26: every commit that wrote feed entries notifies `jujube_changes`
    // with its schema (see `pg::listen`); one notification per
    // transaction, whatever its number of entries.
    r#"
CREATE FUNCTION changes_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('jujube_changes', current_schema()::text);
    RETURN NULL;
END $$;
CREATE TRIGGER changes_notify AFTER INSERT ON changes
    FOR EACH STATEMENT EXECUTE FUNCTION changes_notify();
"#,
    // 27
    r#"
ALTER TABLE units ADD COLUMN agent_incarnation BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN agent_seq BIGINT NOT NULL DEFAULT 0;
ALTER TABLE machines ADD COLUMN agent_incarnation BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN agent_seq BIGINT NOT NULL DEFAULT 0;
"#,
    // 28: the notification leaves the transaction: the store sends it
    // after the COMMIT of a transaction that wrote feed entries (from its
    // listening session since: see `pg::listen`). A NOTIFY inside a
    // transaction takes the database's notify lock from before its commit
    // until after it, flush included, so the commits of every controller's
    // writers could not share a flush.
    r#"
DROP TRIGGER changes_notify ON changes;
DROP FUNCTION changes_notify();
"#,
    // 29
    r#"
CREATE TABLE charm_archives (
    path    TEXT PRIMARY KEY,
    archive BYTEA NOT NULL
);
"#,
    // 30
    r#"
ALTER TABLE units ADD COLUMN status_current BOOLEAN NOT NULL DEFAULT TRUE;
CREATE INDEX units_status_stale ON units (service, number) WHERE NOT status_current;
"#,
    // 32
    r#"
CREATE INDEX machines_in_error ON machines (id) WHERE status = 'error';
"#,
    // 33
    r#"
CREATE TABLE strays_unlisted (
    id    BIGINT PRIMARY KEY CHECK (id = 1),
    count BIGINT NOT NULL
);
"#,
];

/// Every table and function [`PG_MIGRATIONS`] creates, for
/// [`Store::erase`](crate::Store::erase): a database the state shares with
/// others loses nothing else. (A test checks the list against the schema.)
pub(crate) const PG_TABLES: &[&str] = &[
    "charm_archives",
    "environment",
    "environment_config",
    "sequences",
    "charms",
    "services",
    "service_settings",
    "machines",
    "units",
    "relations",
    "relation_endpoints",
    "relation_scopes",
    "relation_settings",
    "cleanups",
    "strays",
    "strays_unlisted",
    "provider_status",
    "agent_credentials",
    "runs",
    "enrollments",
    "enrolled",
    "changes",
    "users",
    "controller_leases",
    "controllers",
    "schema_version",
];
pub(crate) const PG_FUNCTIONS: &[&str] = &["machines_high_water", "units_high_water"];

/// The SQLite schema version [`PG_MIGRATIONS`]' first entry equals.
pub(crate) const PG_BASELINE: usize = 24;
