//! Agents' write stamps (`agents::Stamp`): a write an agent sent before a
//! later one (held up in a controller cut off from the database while the
//! agent went on through another) is refused, changing nothing, however
//! late it reaches the store; a write sent again after a lost answer is
//! applied once.

use super::{env, WORDPRESS};
use crate::{AgentOp, Caller, Error, Stamp};

fn status(unit: &str, status: &str) -> AgentOp {
    AgentOp::SetUnitStatus {
        unit: unit.into(),
        status: status.into(),
        info: String::new(),
    }
}

fn stamped(st: &crate::Store, by: &Caller, stamp: Stamp, op: AgentOp) -> crate::Result<()> {
    st.apply_stamped(&[(by.clone(), Some(stamp), op)])?
        .remove(0)
}

/// A unit whose agent took its first incarnation: its name, the agent,
/// and the stamp of its write numbered `seq`.
fn started_unit(e: &super::Env) -> (String, Caller, impl Fn(i64) -> Stamp) {
    let unit = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    let by = Caller::Unit(unit.clone());
    let incarnation = e.st.start_agent(&by).unwrap();
    (unit, by, move |seq| Stamp { incarnation, seq })
}

#[test]
fn an_agents_write_sent_before_its_later_one_is_refused_however_late_it_arrives() {
    let e = env();
    let (unit, by, at) = started_unit(&e);
    stamped(&e.st, &by, at(2), status(&unit, "started")).unwrap();
    // Write 1 was held up; it arrives after write 2.
    let err = e.refused(|st| stamped(st, &by, at(1), status(&unit, "error")));
    assert!(matches!(err, Error::Superseded { .. }), "{err:?}");
    assert!(
        !err.is_unavailable(),
        "another controller would not answer otherwise: {err}"
    );
    assert_eq!(e.st.unit(&unit).unwrap().status, "started");
    // Write 2 sent again (its answer was lost): answered as done, and
    // applied once.
    let before = e.digest();
    stamped(&e.st, &by, at(2), status(&unit, "started")).unwrap();
    assert_eq!(e.digest(), before, "a resend was applied again");
    // Numbers may skip (calls that write elsewhere take one too).
    stamped(&e.st, &by, at(7), status(&unit, "dying")).unwrap();
    assert_eq!(e.st.unit(&unit).unwrap().status, "dying");
}

#[test]
fn an_agent_that_starts_again_refuses_its_previous_incarnations_writes() {
    let e = env();
    let unit = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    let (by, machine) = (Caller::Unit(unit.clone()), Caller::Machine(1));
    let first = e.st.start_agent(&by).unwrap();
    stamped(
        &e.st,
        &by,
        Stamp {
            incarnation: first,
            seq: 1,
        },
        status(&unit, "started"),
    )
    .unwrap();
    let second = e.st.start_agent(&by).unwrap();
    assert!(second > first);
    let err = e.refused(|st| {
        stamped(
            st,
            &by,
            Stamp {
                incarnation: first,
                seq: 2,
            },
            status(&unit, "error"),
        )
    });
    assert!(matches!(err, Error::Superseded { .. }), "{err:?}");
    // The new incarnation numbers from 1 again.
    stamped(
        &e.st,
        &by,
        Stamp {
            incarnation: second,
            seq: 1,
        },
        status(&unit, "error"),
    )
    .unwrap();
    assert_eq!(e.st.unit(&unit).unwrap().status, "error");
    // A machine agent's stamp lives in its machine's row.
    let inc = e.st.start_agent(&machine).unwrap();
    let op = |s: &str| AgentOp::SetMachineAgentStatus {
        machine: 1,
        status: s.into(),
        info: String::new(),
    };
    stamped(
        &e.st,
        &machine,
        Stamp {
            incarnation: inc,
            seq: 2,
        },
        op("started"),
    )
    .unwrap();
    let err = e.refused(|st| {
        stamped(
            st,
            &machine,
            Stamp {
                incarnation: inc,
                seq: 1,
            },
            op("error"),
        )
    });
    assert!(matches!(err, Error::Superseded { .. }), "{err:?}");
    // Unstamped writes (the agents a controller runs under its lease,
    // which the lease fences) are applied as before.
    e.st.apply_batch(&[(by.clone(), status(&unit, "started"))])
        .unwrap()
        .remove(0)
        .unwrap();
    assert_eq!(e.st.unit(&unit).unwrap().status, "started");
    // Only agents take incarnations, and only their own rows'.
    assert!(e.st.start_agent(&Caller::Controller).is_err());
    let err =
        e.st.start_agent(&Caller::Unit("wordpress/9".into()))
            .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err:?}");
}

/// A refused op's stamp is not recorded: the agent's resend of it (or its
/// next write) is checked afresh.
#[test]
fn a_refused_stamped_write_records_nothing() {
    let e = env();
    let (unit, by, at) = started_unit(&e);
    let err = e.refused(|st| stamped(st, &by, at(1), status(&unit, "sleeping")));
    assert!(matches!(err, Error::InvalidStatus(_)), "{err:?}");
    stamped(&e.st, &by, at(1), status(&unit, "started")).unwrap();
    assert_eq!(e.st.unit(&unit).unwrap().status, "started");
}

/// A deployer's unit credential is one of its writes in order: one sent
/// before a later write of the deployer's is refused and keeps nothing.
#[test]
fn a_unit_credential_sent_before_its_deployers_later_write_is_refused() {
    let e = env();
    let unit = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    let machine = e.st.unit(&unit).unwrap().machine_id.unwrap();
    let by = Caller::Machine(machine);
    let incarnation = e.st.start_agent(&by).unwrap();
    let at = |seq| Stamp { incarnation, seq };
    let tag = format!("unit-{}", unit.replace('/', "-"));
    let set = |st: &crate::Store, by: &Caller, seq, hash: &str| {
        st.set_unit_credential_as(by, Some(&at(seq)), &unit, &tag, hash)
    };
    set(&e.st, &by, 2, "newer").unwrap();
    let err = e.refused(|st| set(st, &by, 1, "older"));
    assert!(matches!(err, Error::Superseded { .. }), "{err:?}");
    assert_eq!(
        e.st.agent_credential(&tag).unwrap().as_deref(),
        Some("newer")
    );
    // Sent again: done, not written again; another credential under the
    // same number is refused.
    let before = e.digest();
    set(&e.st, &by, 2, "newer").unwrap();
    assert_eq!(e.digest(), before);
    let err = e.refused(|st| set(st, &by, 2, "other"));
    assert!(matches!(err, Error::Superseded { .. }), "{err:?}");
    // Another machine's agent is refused, whatever its stamp.
    let other = Caller::Machine(machine + 100);
    assert!(matches!(
        e.refused(|st| set(st, &other, 3, "theirs")),
        Error::Unauthorized { .. }
    ));
    set(&e.st, &by, 3, "next").unwrap();
    assert_eq!(
        e.st.agent_credential(&tag).unwrap().as_deref(),
        Some("next")
    );
}
