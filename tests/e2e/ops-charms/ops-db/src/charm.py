#!/usr/bin/env python3
"""ops-db: a jujube test fixture written with the `ops` framework (3.x).

Laid out as charmcraft's classic "charm" plugin packs a charm: `dispatch`
runs this file with `PYTHONPATH=lib:venv`; `venv/` (ops and its
dependencies, from `scripts/ops-setup`) is copied in by the test.

What it does:
- install: unit status maintenance "installing", workload version "1.2.3".
- config-changed, start: unit status active "ready <database option>".
- leader-elected: app status active "leading" (as leader) and, if the peer
  relation `cluster` exists, its app databag {"leader": <unit>}.
- cluster-relation-created/joined/changed: the leader writes the peer app
  databag {"leader": <unit>}; every unit records what it reads there.
- db-relation-joined/changed: unit databag {"host": <bind address of the
  `db` binding (network-get)>, "unit": <unit>}; the leader also writes the
  app databag {"database": <database option>, "password-hash": "x"}.
- action backup: event.log("backing up"), results {"path":
  "/backups/<target>", "compressed": <compress>, "detail": {"level":
  <level>}} (ops flattens that to `detail.level`).
- action fail-me: event.fail("asked to fail").

Report format (all files in the charm directory, i.e. the cwd):
- `events.log`: one line per event this charm saw, appended as the event is
  handled, before anything else is done for it:
      <event> <unit> leader=<true|false>[ relation=<name>:<id>
          remote-unit=<unit|-> remote-app=<app|->]
  <event> is Juju's hook name (`install`, `leader-elected`,
  `db-relation-changed`) or `<action>-action` (`backup-action`). The
  relation fields are there for relation events only.
- `report-<event>.json`: one JSON object per event kind, rewritten
  (atomically) each time that event is handled; always has "event",
  "unit", "leader" (bool), plus what the handler saw:
    install, config-changed, start: "config" (config-get's object),
        "status" [name, message] set.
    leader-elected: "app_status" [name, message] (leader only), "cluster"
        (see below, or null without the peer relation).
    db-relation-joined, db-relation-changed: "relation_id" (int),
        "remote_unit", "remote_app" (names or null), "remote_app_data"
        (object or null), "remote_units" {unit: object} (every remote unit's
        databag), "local_unit_data", "local_app_data" (leader only; else
        null).
    cluster-relation-*: "cluster": {"relation_id", "app_data" (the peer app
        databag as read), "units" {peer unit: databag}}.
    backup-action: "params" (action-get's object), "results" (as given to
        set_results, unflattened).
    fail-me-action: "params", "failed" (the message).
A failing expectation raises, so the hook fails.
"""

import json
import logging
import os
import pathlib

import ops

logger = logging.getLogger(__name__)

# Events recorded in events.log: all but the framework's per-hook ones.
_UNRECORDED = {"collect_app_status", "collect_unit_status", "collect_metrics"}


def event_name(event: ops.EventBase) -> str:
    return event.handle.kind.replace("_", "-")


class OpsDbCharm(ops.CharmBase):
    def __init__(self, framework: ops.Framework):
        super().__init__(framework)
        self.dir = pathlib.Path(self.charm_dir)
        # First, so each event is in events.log before its handler runs.
        for kind, bound in self.on.events().items():
            if kind not in _UNRECORDED:
                framework.observe(bound, self._record_event)
        framework.observe(self.on.install, self._on_install)
        framework.observe(self.on.config_changed, self._on_ready)
        framework.observe(self.on.start, self._on_ready)
        framework.observe(self.on.leader_elected, self._on_leader_elected)
        framework.observe(self.on.db_relation_joined, self._on_db_relation)
        framework.observe(self.on.db_relation_changed, self._on_db_relation)
        framework.observe(self.on.cluster_relation_created, self._on_cluster)
        framework.observe(self.on.cluster_relation_joined, self._on_cluster)
        framework.observe(self.on.cluster_relation_changed, self._on_cluster)
        framework.observe(self.on.backup_action, self._on_backup)
        framework.observe(self.on.fail_me_action, self._on_fail_me)

    # -- reports -------------------------------------------------------

    def _record_event(self, event: ops.EventBase) -> None:
        line = f"{event_name(event)} {self.unit.name} leader={str(self.unit.is_leader()).lower()}"
        if isinstance(event, ops.RelationEvent):
            rel = event.relation
            line += (
                f" relation={rel.name}:{rel.id}"
                f" remote-unit={event.unit.name if event.unit else '-'}"
                f" remote-app={event.app.name if event.app else '-'}"
            )
        with open(self.dir / "events.log", "a") as f:
            f.write(line + "\n")

    def _report(self, event: ops.EventBase, **data) -> None:
        name = event_name(event)
        out = {"event": name, "unit": self.unit.name, "leader": self.unit.is_leader()}
        out.update(data)
        path = self.dir / f"report-{name}.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)

    # -- lifecycle -----------------------------------------------------

    def _on_install(self, event: ops.InstallEvent) -> None:
        self.unit.status = ops.MaintenanceStatus("installing")
        self.unit.set_workload_version("1.2.3")
        self._report(event, config=dict(self.config), status=["maintenance", "installing"])

    def _on_ready(self, event: ops.EventBase) -> None:
        message = f"ready {self.config['database']}"
        self.unit.status = ops.ActiveStatus(message)
        self._report(event, config=dict(self.config), status=["active", message])

    def _on_leader_elected(self, event: ops.LeaderElectedEvent) -> None:
        app_status = None
        if self.unit.is_leader():
            self.app.status = ops.ActiveStatus("leading")
            app_status = ["active", "leading"]
        cluster = self.model.get_relation("cluster")
        self._report(
            event,
            app_status=app_status,
            cluster=self._sync_cluster(cluster) if cluster else None,
        )

    # -- peer relation -------------------------------------------------

    def _sync_cluster(self, rel: ops.Relation) -> dict:
        """As leader, writes {"leader": me} to the peer app databag; returns
        what this unit reads in the peer databags."""
        if self.unit.is_leader():
            rel.data[self.app].update({"leader": self.unit.name})
        return {
            "relation_id": rel.id,
            "app_data": dict(rel.data[self.app]),
            "units": {u.name: dict(rel.data[u]) for u in sorted(rel.units, key=lambda u: u.name)},
        }

    def _on_cluster(self, event: ops.RelationEvent) -> None:
        self._report(event, cluster=self._sync_cluster(event.relation))

    # -- db ------------------------------------------------------------

    def _on_db_relation(self, event: ops.RelationEvent) -> None:
        rel = event.relation
        mine = {"unit": self.unit.name}
        binding = self.model.get_binding("db")
        address = binding.network.bind_address if binding else None
        if address is not None:
            mine["host"] = str(address)
        rel.data[self.unit].update(mine)
        leader = self.unit.is_leader()
        if leader:
            rel.data[self.app].update(
                {"database": str(self.config["database"]), "password-hash": "x"}
            )
        self._report(
            event,
            relation_id=rel.id,
            remote_unit=event.unit.name if event.unit else None,
            remote_app=event.app.name if event.app else None,
            remote_app_data=dict(rel.data[rel.app]) if rel.app else None,
            remote_units={u.name: dict(rel.data[u]) for u in sorted(rel.units, key=lambda u: u.name)},
            local_unit_data=dict(rel.data[self.unit]),
            local_app_data=dict(rel.data[self.app]) if leader else None,
        )

    # -- actions -------------------------------------------------------

    def _on_backup(self, event: ops.ActionEvent) -> None:
        params = dict(event.params)
        target = params["target"]
        event.log("backing up")
        results = {
            "path": "/backups/" + target,
            "compressed": params["compress"],
            "detail": {"level": params["level"]},
        }
        event.set_results(results)
        self._report(event, params=params, results=results)

    def _on_fail_me(self, event: ops.ActionEvent) -> None:
        event.fail("asked to fail")
        self._report(event, params=dict(event.params), failed="asked to fail")


if __name__ == "__main__":  # pragma: nocover
    ops.main(OpsDbCharm)
