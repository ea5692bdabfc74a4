//! What the provisioner keeps in state for the user and for the next
//! controller: the provider's status, stray first-seen times.

use super::*;

/// Passes of `p` until the model stops moving (in virtual time).
async fn settle_with(w: &World, p: &Provisioner) {
    for _ in 0..50 {
        let before = (
            w.store.head_revision().unwrap(),
            w.cloud.all_instances().unwrap().len(),
        );
        let _ = p.reconcile().await;
        p.idle().await;
        let after = (
            w.store.head_revision().unwrap(),
            w.cloud.all_instances().unwrap().len(),
        );
        if before == after {
            return;
        }
    }
    panic!("provisioning did not settle");
}

#[tokio::test(start_paused = true)]
async fn stray_grace_periods_survive_a_controller_restart() {
    let w = world(&[("harvest-grace", "120s"), ("harvest-interval", "10s")]);
    // One clock for both controllers: tokio's paused time is their wall time.
    let clock = Clock::system();
    let first = Provisioner::with_clock(w.store.clone(), w.cloud.clone(), clock).unwrap();
    settle_with(&w, &first).await;
    let stray = w.cloud.start_raw(w.tags(Some(UUID), "77")).unwrap();
    tokio::time::advance(Duration::from_secs(11)).await;
    settle_with(&w, &first).await;
    let seen = w.store.strays().unwrap()[0].first_seen;
    drop(first);
    // 90 s later a new controller takes over; 30 s after that the stray
    // has been seen for 120 s.
    tokio::time::advance(Duration::from_secs(90)).await;
    let second = Provisioner::with_clock(w.store.clone(), w.cloud.clone(), clock).unwrap();
    settle_with(&w, &second).await;
    assert_eq!(w.store.strays().unwrap()[0].first_seen, seen);
    assert!(w.instance_ids().contains(&stray));
    tokio::time::advance(Duration::from_secs(31)).await;
    settle_with(&w, &second).await;
    assert!(
        !w.instance_ids().contains(&stray),
        "the grace period restarted with the controller"
    );
}

#[tokio::test(start_paused = true)]
async fn a_provider_that_cannot_be_reached_is_shown_until_it_answers() {
    let w = world(&[("dummy-unreachable", "true")]);
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    assert!(w.p.reconcile().await.is_err());
    let st = w
        .store
        .provider_status()
        .unwrap()
        .expect("a provider status");
    assert_eq!(
        st.message,
        "listing zones: transient provider error: the dummy cloud cannot be reached (`dummy-unreachable`)"
    );
    assert_eq!(
        w.store.status().unwrap().environment.provider_status,
        Some(st.clone())
    );
    // Still failing: the first failure's time is kept.
    tokio::time::advance(Duration::from_secs(5)).await;
    assert!(w.p.reconcile().await.is_err());
    assert_eq!(w.store.provider_status().unwrap(), Some(st));
    assert_eq!(w.store.machine(id).unwrap().status, machine_status::PENDING);
    w.set(&[("dummy-unreachable", "false")]);
    w.settle().await;
    assert_eq!(w.store.provider_status().unwrap(), None);
    assert!(w.store.machine(id).unwrap().instance_id.is_some());
}

#[tokio::test(start_paused = true)]
async fn instance_status_says_running_then_gone() {
    let w = world(&[("harvest-interval", "1s")]);
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    w.settle().await;
    let view = |w: &World| {
        w.store
            .status()
            .unwrap()
            .machines
            .get(&id.to_string())
            .unwrap()
            .instance_status
            .clone()
    };
    assert_eq!(view(&w).as_deref(), Some("running"));
    let inst = w.store.machine(id).unwrap().instance_id.unwrap();
    w.cloud.stop_raw(&[inst]).unwrap();
    for _ in 0..2 {
        tokio::time::advance(Duration::from_secs(2)).await;
        w.settle().await;
    }
    assert_eq!(view(&w).as_deref(), Some("gone"));
    w.store.resolve_machine(id, None).unwrap();
    assert_eq!(view(&w), None, "resolved forgets the gone instance");
    w.settle().await;
    assert_eq!(view(&w).as_deref(), Some("running"));
}
