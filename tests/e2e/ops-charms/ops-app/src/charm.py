#!/usr/bin/env python3
"""ops-app: a jujube test fixture written with the `ops` framework (3.x).

Laid out as charmcraft's classic "charm" plugin packs a charm: `dispatch`
runs this file with `PYTHONPATH=lib:venv`; `venv/` (ops and its
dependencies, from `scripts/ops-setup`) is copied in by the test.

What it does:
- install: unit status waiting "waiting for db"; the leader sets the
  application's status active "serving"; looks its secret up by label.
- db-relation-changed: reads the remote app's databag (event.app) and the
  remote unit's (event.unit, when the event has one); unit status active
  "db ready: <database>" when the app databag has `database`, else waiting
  "waiting for db"; writes its unit databag {"wants": <wants option>}; the
  leader also writes the app databag {"client": "ops-app"}.
- db-relation-broken: unit status blocked "no db".

Report format (all files in the charm directory, i.e. the cwd):
- `events.log`: one line per event this charm saw, appended as the event is
  handled, before anything else is done for it:
      <event> <unit> leader=<true|false>[ relation=<name>:<id>
          remote-unit=<unit|-> remote-app=<app|->]
  <event> is Juju's hook name (`install`, `db-relation-changed`). The
  relation fields are there for relation events only.
- `report-<event>.json`: one JSON object per event kind, rewritten
  (atomically) each time that event is handled; always has "event",
  "unit", "leader" (bool), plus:
    install: "config", "status" [name, message], "secret" ("not found" when
        ops raised SecretNotFoundError for the label `ops-app-password`).
    db-relation-changed: "relation_id" (int), "remote_unit", "remote_app"
        (names or null), "remote_app_data" (object or null), "remote_unit_data"
        (event.unit's databag, or null when the event has no unit),
        "remote_units" {unit: databag} (every remote unit), "local_unit_data",
        "local_app_data" (leader only; else null), "status" [name, message],
        "app_status" [name, message] (leader only, as ops reads it back; the
        leader sets it active "serving" at install; else null).
    db-relation-broken: "relation_id", "remote_app", "status".
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


class OpsAppCharm(ops.CharmBase):
    def __init__(self, framework: ops.Framework):
        super().__init__(framework)
        self.dir = pathlib.Path(self.charm_dir)
        # First, so each event is in events.log before its handler runs.
        for kind, bound in self.on.events().items():
            if kind not in _UNRECORDED:
                framework.observe(bound, self._record_event)
        framework.observe(self.on.install, self._on_install)
        framework.observe(self.on.db_relation_changed, self._on_db_changed)
        framework.observe(self.on.db_relation_broken, self._on_db_broken)

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

    # -- handlers ------------------------------------------------------

    def _on_install(self, event: ops.InstallEvent) -> None:
        self.unit.status = ops.WaitingStatus("waiting for db")
        if self.unit.is_leader():
            self.app.status = ops.ActiveStatus("serving")
        try:
            self.model.get_secret(label="ops-app-password")
            secret = "found"
        except ops.SecretNotFoundError:
            secret = "not found"
        self._report(
            event,
            config=dict(self.config),
            status=["waiting", "waiting for db"],
            secret=secret,
        )

    def _on_db_changed(self, event: ops.RelationChangedEvent) -> None:
        rel = event.relation
        remote_app_data = dict(rel.data[event.app]) if event.app else None
        remote_unit_data = dict(rel.data[event.unit]) if event.unit else None
        database = (remote_app_data or {}).get("database")
        if database:
            status = ["active", f"db ready: {database}"]
            self.unit.status = ops.ActiveStatus(status[1])
        else:
            status = ["waiting", "waiting for db"]
            self.unit.status = ops.WaitingStatus(status[1])
        rel.data[self.unit].update({"wants": str(self.config["wants"])})
        leader = self.unit.is_leader()
        app_status = None
        if leader:
            rel.data[self.app].update({"client": self.app.name})
            # Set at install; read here by a new process, so ops asks
            # `status-get --application` (it caches what it set).
            app_status = [self.app.status.name, self.app.status.message]
        self._report(
            event,
            relation_id=rel.id,
            remote_unit=event.unit.name if event.unit else None,
            remote_app=event.app.name if event.app else None,
            remote_app_data=remote_app_data,
            remote_unit_data=remote_unit_data,
            remote_units={u.name: dict(rel.data[u]) for u in sorted(rel.units, key=lambda u: u.name)},
            local_unit_data=dict(rel.data[self.unit]),
            local_app_data=dict(rel.data[self.app]) if leader else None,
            status=status,
            app_status=app_status,
        )

    def _on_db_broken(self, event: ops.RelationBrokenEvent) -> None:
        self.unit.status = ops.BlockedStatus("no db")
        self._report(
            event,
            relation_id=event.relation.id,
            remote_app=event.app.name if event.app else None,
            status=["blocked", "no db"],
        )


if __name__ == "__main__":  # pragma: nocover
    ops.main(OpsAppCharm)
