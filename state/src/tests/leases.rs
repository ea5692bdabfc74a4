//! Controller leases and their fencing tokens: two controllers are two
//! stores opened on one database file, as two processes would.

use super::env;
use crate::leases::{Claim, Fence, LeaseNow, SINGLETONS};
use crate::{Durability, Error, Store};
use std::time::Duration;

const TTL: Duration = Duration::from_secs(15);

fn held(c: Claim) -> Fence {
    match c {
        Claim::Held(f) => f,
        Claim::Taken { holder, .. } => panic!("held by `{holder}`"),
    }
}

#[test]
fn one_controller_holds_the_lease_until_it_expires_then_another_takes_it_under_a_new_token() {
    let e = env();
    // The second controller: another handle on the same file.
    let other = Store::open_at(e.st.location(), Durability::Relaxed).unwrap();
    let a = held(e.st.claim_lease(SINGLETONS, "a", 1_000, TTL).unwrap());
    assert_eq!((a.token, a.expires_ms), (1, 16_000));

    // Not before its expiry, by the other's clock.
    assert_eq!(
        other.claim_lease(SINGLETONS, "b", 15_999, TTL).unwrap(),
        Claim::Taken {
            holder: "a".into(),
            expires_ms: 16_000
        }
    );
    // Its holder renews it under the same token; an expiry never goes back.
    let renewed = held(e.st.claim_lease(SINGLETONS, "a", 10_000, TTL).unwrap());
    assert_eq!((renewed.token, renewed.expires_ms), (1, 25_000));
    let early = held(e.st.claim_lease(SINGLETONS, "a", 5_000, TTL).unwrap());
    assert_eq!((early.token, early.expires_ms), (1, 25_000));

    // Expired: the other takes it, and the token goes up.
    let b = held(other.claim_lease(SINGLETONS, "b", 25_000, TTL).unwrap());
    assert_eq!((b.holder.as_str(), b.token), ("b", 2));
    assert_eq!(
        e.st.lease(SINGLETONS).unwrap().map(|l| (l.holder, l.token)),
        Some(("b".to_string(), 2))
    );
    // The first one, back from a pause, cannot renew it.
    assert!(matches!(
        e.st.claim_lease(SINGLETONS, "a", 26_000, TTL).unwrap(),
        Claim::Taken { .. }
    ));
}

#[test]
fn a_stale_holders_writes_are_refused_and_change_nothing() {
    let e = env();
    let other = Store::open_at(e.st.location(), Durability::Relaxed).unwrap();
    let a = held(e.st.claim_lease(SINGLETONS, "a", 0, TTL).unwrap());
    let a_store = e.st.fenced(a.clone());
    assert_eq!(a_store.fence(), Some(&a));
    // While it holds the lease, its writes go through.
    assert_eq!(a_store.add_machines(1, None, None).unwrap(), vec![1]);

    let b = held(other.claim_lease(SINGLETONS, "b", 20_000, TTL).unwrap());
    let err = e.refused(|_| a_store.add_machines(1, None, None));
    assert!(
        matches!(&err, Error::LeaseLost { lease, token: 1 } if lease == SINGLETONS),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "this controller no longer holds lease `singletons` (its token 1 was replaced): another controller runs its jobs now; nothing was written"
    );
    // Reads are not fenced; the new holder writes.
    assert_eq!(a_store.machines().unwrap().len(), 2);
    assert_eq!(
        other.fenced(b).add_machines(1, None, None).unwrap(),
        vec![2]
    );
}

#[test]
fn the_same_holder_taking_its_expired_lease_again_gets_a_new_token() {
    let e = env();
    let first = held(e.st.claim_lease(SINGLETONS, "a", 0, TTL).unwrap());
    // Paused past its expiry, nobody else came: it takes the lease anew,
    // and what it started under the old token is fenced off.
    let again = held(e.st.claim_lease(SINGLETONS, "a", 15_000, TTL).unwrap());
    assert_eq!((first.token, again.token), (1, 2));
    let err = e.refused(|_| e.st.fenced(first).add_machines(1, None, None));
    assert!(matches!(err, Error::LeaseLost { .. }), "{err}");
    e.st.fenced(again).add_machines(1, None, None).unwrap();
}

#[test]
fn a_released_lease_is_taken_at_once_and_a_stale_release_does_nothing() {
    let e = env();
    let a = held(e.st.claim_lease(SINGLETONS, "a", 0, TTL).unwrap());
    e.st.release_lease(&a).unwrap();
    let b = held(e.st.claim_lease(SINGLETONS, "b", 1, TTL).unwrap());
    assert_eq!(b.token, 2);
    // The old holder's release, late: b keeps it.
    e.st.release_lease(&a).unwrap();
    assert!(matches!(
        e.st.claim_lease(SINGLETONS, "c", 2, TTL).unwrap(),
        Claim::Taken { ref holder, .. } if holder == "b"
    ));
}

#[test]
fn bad_claims_are_refused_and_change_nothing() {
    let e = env();
    let long = "x".repeat(crate::leases::MAX_NAME + 1);
    for (lease, holder, ttl) in [
        ("", "a", TTL),
        (SINGLETONS, "", TTL),
        (long.as_str(), "a", TTL),
        (SINGLETONS, long.as_str(), TTL),
        (SINGLETONS, "a\n", TTL),
        (SINGLETONS, "a", Duration::from_millis(99)),
        (SINGLETONS, "a", Duration::from_secs(601)),
    ] {
        let err = e.refused(|s| s.claim_lease(lease, holder, 0, ttl));
        assert!(matches!(err, Error::BadLease(_)), "{err}");
        assert!(err.to_string().starts_with("invalid lease: "), "{err}");
    }
}

#[test]
fn a_restarted_holder_takes_its_own_lease_at_once_under_a_new_token() {
    let e = env();
    let before = held(e.st.claim_lease(SINGLETONS, "machine-0", 0, TTL).unwrap());
    // Its process killed, started again long before the expiry.
    let after = held(
        e.st.claim_lease_anew(SINGLETONS, "machine-0", 1_000, TTL)
            .unwrap(),
    );
    assert_eq!((before.token, after.token), (1, 2));
    let err = e.refused(|_| e.st.fenced(before).add_machines(1, None, None));
    assert!(matches!(err, Error::LeaseLost { .. }), "{err}");
    // Another holder's lease is not taken so.
    assert!(matches!(
        e.st.claim_lease_anew(SINGLETONS, "machine-1", 2_000, TTL)
            .unwrap(),
        Claim::Taken { .. }
    ));
}

/// Claims at the database's clock set and compare expiries on that one
/// clock: a controller whose own clock runs ahead (by an hour, here) would
/// have taken the lease at once claiming at its own time; at the
/// database's it waits for the holder's expiry like any other.
#[test]
fn claims_at_the_databases_clock_do_not_depend_on_the_controllers_clocks() {
    let e = env();
    let other = Store::open_at(e.st.location(), Durability::Relaxed).unwrap();
    let local = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };
    let ttl = TTL.as_millis() as i64;
    let before = local();
    let a = held(
        e.st.claim_lease(SINGLETONS, "a", LeaseNow::Database, TTL)
            .unwrap(),
    );
    let after = local();
    // The suite's database runs on this host, so its clock is this one.
    assert!(
        (before + ttl - 1_000..=after + ttl + 1_000).contains(&a.expires_ms),
        "{before} {} {after}",
        a.expires_ms
    );
    let ahead = a.expires_ms + 3_600_000;
    assert!(matches!(
        other.claim_lease(SINGLETONS, "b", LeaseNow::Database, TTL).unwrap(),
        Claim::Taken { holder, .. } if holder == "a"
    ));
    // What claiming at its own clock an hour ahead would have done.
    let b = held(other.claim_lease(SINGLETONS, "b", ahead, TTL).unwrap());
    assert_eq!(b.token, a.token + 1);
    // The holder renews at the database's clock and keeps its token.
    let again = held(
        other
            .claim_lease(SINGLETONS, "b", LeaseNow::Database, TTL)
            .unwrap(),
    );
    assert_eq!(again.token, b.token);
}
