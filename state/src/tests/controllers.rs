//! Controller machines (`enable-ha`) and the controllers' records of
//! themselves, as `status` shows them.

use super::env;
use crate::controllers::MAX_CONTROLLERS;
use crate::leases::SINGLETONS;
use crate::{ChangeKind, Error, Store};
use jujube_core::Life;
use std::time::Duration;

fn now_ms() -> i64 {
    jujube_core::time::unix_now() * 1000
}

fn machine_ids(st: &Store) -> Vec<i64> {
    st.machines().unwrap().iter().map(|m| m.id).collect()
}

#[test]
fn enable_ha_adds_controller_machines_up_to_an_odd_count_in_one_go() {
    let e = env();
    let before = e.st.status().unwrap();
    // Even, none, or too many: refused, and nothing changes.
    for n in [0, 2, 4, MAX_CONTROLLERS + 2] {
        match e.st.enable_ha(n) {
            Err(Error::BadController(m)) => assert!(m.contains("must be odd"), "{m}"),
            r => panic!("{n}: {r:?}"),
        }
    }
    assert_eq!(e.st.status().unwrap(), before);

    assert_eq!(e.st.enable_ha(3).unwrap(), vec![1, 2]);
    let ms = e.st.machines().unwrap();
    assert_eq!(ms.len(), 3);
    for m in &ms {
        assert!(m.manages_environ() && !m.hosts_units(), "{m:?}");
        assert_eq!(m.life, Life::Alive);
        assert_eq!(m.series, before.environment.default_series);
    }
    // Asking again for as many adds none; fewer is refused.
    assert_eq!(e.st.enable_ha(3).unwrap(), Vec::<i64>::new());
    match e.st.enable_ha(1) {
        Err(Error::BadController(m)) => assert!(m.contains("has 3 controllers"), "{m}"),
        r => panic!("{r:?}"),
    }
    assert_eq!(machine_ids(&e.st), vec![0, 1, 2]);
    // A controller machine is never destroyed by hand.
    assert!(matches!(
        e.st.destroy_machines(&[2]),
        Err(Error::ManagesEnvironment(2))
    ));
    // Status lists them, none yet run.
    let st = e.st.status().unwrap();
    let states: Vec<(&str, &str)> = st
        .controllers
        .iter()
        .map(|c| (c.machine.as_str(), c.state.as_str()))
        .collect();
    assert_eq!(
        states,
        [("0", "pending"), ("1", "pending"), ("2", "pending")]
    );
}

#[test]
fn enable_ha_needs_an_admin() {
    let e = env();
    e.st.create_admin("pw-for-the-test").unwrap();
    let admin = e.st.as_user(jujube_wire::client::ADMIN);
    admin
        .add_user("bob", jujube_wire::client::Access::Write, "h")
        .unwrap();
    assert!(matches!(
        e.st.as_user("bob").enable_ha(3),
        Err(Error::Forbidden { .. })
    ));
    assert_eq!(machine_ids(&e.st), vec![0]);
    assert_eq!(admin.enable_ha(3).unwrap(), vec![1, 2]);
}

#[test]
fn controllers_record_where_they_serve_and_status_tells_who_is_up_and_runs_the_singletons() {
    let e = env();
    e.st.enable_ha(3).unwrap();
    let now = now_ms();
    let addrs = |m: i64| {
        vec![
            format!("unix:/tmp/api-{m}.socket"),
            format!("127.0.0.1:{}", 17070 + m),
        ]
    };
    e.st.controller_seen(0, "machine-0/h", &addrs(0), now)
        .unwrap();
    e.st.controller_seen(1, "machine-1/h", &addrs(1), now)
        .unwrap();
    // Machine 2's controller ran long ago.
    e.st.controller_seen(2, "machine-2/h", &addrs(2), now - 3_600_000)
        .unwrap();
    e.st.claim_lease(SINGLETONS, "machine-1/h", now, Duration::from_secs(15))
        .unwrap();
    let st = e.st.status().unwrap();
    let got: Vec<(&str, &str, bool)> = st
        .controllers
        .iter()
        .map(|c| (c.machine.as_str(), c.state.as_str(), c.runs_singletons))
        .collect();
    assert_eq!(
        got,
        [("0", "up", false), ("1", "up", true), ("2", "down", false)]
    );
    assert_eq!(st.controllers[1].addresses, addrs(1));
    assert_eq!(st.machines.0[1].1.agent_status, "started");
    assert_eq!(st.machines.0[2].1.agent_status, "down");

    // Where agents and clients fail over: the asker's own first.
    let mut want = addrs(2);
    want.extend(addrs(0));
    want.extend(addrs(1));
    assert_eq!(e.st.controller_addresses(2).unwrap(), want);

    // A record is refused for what is not a controller machine, and past
    // its bounds; nothing is written.
    let before = e.st.controllers().unwrap();
    e.st.add_machines(1, None, None).unwrap();
    for (m, holder, a) in [
        (3, "machine-3/h", addrs(3)),
        (99, "machine-99/h", addrs(0)),
        (0, "machine-0/h", vec!["x".repeat(257)]),
        (0, "machine-0/h", vec!["a\nb".into()]),
        (0, "machine-0/h", (0..9).map(|i| format!("h:{i}")).collect()),
        (0, "", addrs(0)),
    ] {
        assert!(
            e.st.controller_seen(m, holder, &a, now).is_err(),
            "{m} {a:?}"
        );
    }
    assert_eq!(e.st.controllers().unwrap(), before);
}

/// Agents learn where the controllers serve from the change feed: one entry
/// when a controller's addresses change, none for the beat that only says
/// it still runs (every few seconds, from every controller).
#[test]
fn a_controller_moving_its_addresses_is_a_change_its_beat_is_not() {
    let e = env();
    e.st.enable_ha(3).unwrap();
    let now = now_ms();
    let told = |since: u64| -> Vec<(ChangeKind, String)> {
        e.st.changes_since(since, 100)
            .unwrap()
            .changes
            .into_iter()
            .map(|c| (c.kind, c.id))
            .collect()
    };
    let head = e.st.head_revision().unwrap();
    e.st.controller_seen(1, "machine-1/h", &["127.0.0.1:17071".into()], now)
        .unwrap();
    assert_eq!(told(head), [(ChangeKind::Controllers, String::new())]);
    let head = e.st.head_revision().unwrap();
    e.st.controller_seen(1, "machine-1/h", &["127.0.0.1:17071".into()], now + 3_000)
        .unwrap();
    assert_eq!(told(head), []);
    e.st.controller_seen(1, "machine-1/h", &["127.0.0.1:17171".into()], now + 6_000)
        .unwrap();
    assert_eq!(told(head), [(ChangeKind::Controllers, String::new())]);
    assert_eq!(e.st.controller_addresses(0).unwrap(), ["127.0.0.1:17171"]);
}

/// An uploaded charm's archive is kept in the state for every controller,
/// under its directory's path: replaced by a later keep of that path,
/// refused beyond its bound (changing nothing), and forgotten.
#[test]
fn a_charms_archive_is_kept_for_every_controller_within_its_bound() {
    use crate::services::MAX_CHARM_ARCHIVE;
    let e = env();
    let path = "/var/lib/jujube/home/environments/e/charms/ab12";
    assert_eq!(e.st.charm_archive(path).unwrap(), None);
    e.st.keep_charm_archive(path, b"JCH1 first").unwrap();
    e.st.keep_charm_archive(path, b"JCH1 second").unwrap();
    assert_eq!(
        e.st.charm_archive(path).unwrap().as_deref(),
        Some(&b"JCH1 second"[..])
    );
    let big = vec![7u8; MAX_CHARM_ARCHIVE + 1];
    match e.st.keep_charm_archive(path, &big) {
        Err(Error::BadCharm(m)) => assert!(m.contains("make the charm smaller"), "{m}"),
        r => panic!("{r:?}"),
    }
    assert_eq!(
        e.st.charm_archive(path).unwrap().as_deref(),
        Some(&b"JCH1 second"[..])
    );
    let at_bound = vec![7u8; MAX_CHARM_ARCHIVE];
    e.st.keep_charm_archive("/other", &at_bound).unwrap();
    assert_eq!(
        e.st.charm_archive("/other").unwrap().map(|a| a.len()),
        Some(MAX_CHARM_ARCHIVE)
    );
    e.st.forget_charm_archive(path).unwrap();
    assert_eq!(e.st.charm_archive(path).unwrap(), None);
    assert!(e.st.charm_archive("/other").unwrap().is_some());

    // The charms kept without an archive (uploaded before archives).
    let mut args = super::deploy_args(super::MYSQL, "mysql", 0);
    args.charm.path = path.into();
    e.st.deploy(&args).unwrap();
    let mut args = super::deploy_args(super::WORDPRESS, "wordpress", 0);
    args.charm.path = "/other".into();
    e.st.deploy(&args).unwrap();
    assert_eq!(
        e.st.charms_without_archive(10).unwrap(),
        vec![path.to_string()]
    );
    e.st.keep_charm_archive(path, b"JCH1").unwrap();
    assert!(e.st.charms_without_archive(10).unwrap().is_empty());
}
