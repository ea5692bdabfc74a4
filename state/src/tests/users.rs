//! Users and their access, checked inside the store's transactions.

use super::*;
use crate::users::{password_matches, secret_hash, ADMIN};
use crate::Error;
use jujube_wire::client::Access;

fn with_admin() -> Env {
    let env = env_with("");
    env.st.create_admin("s3cret-admin").unwrap();
    env
}

fn deploy_mysql(st: &Store) -> crate::Result<Vec<String>> {
    st.deploy(&DeployArgs {
        service: "mysql".into(),
        charm: charm(MYSQL),
        series: "jammy".into(),
        constraints: Default::default(),
        units: 1,
        to: None,
        settings: vec![],
    })
}

#[test]
fn a_password_is_kept_as_an_argon2id_hash_that_only_it_matches() {
    let env = with_admin();
    let login = env.st.login(ADMIN).unwrap().unwrap();
    let hash = login.password_hash.unwrap();
    // 7 MiB, five passes (the memory each login's check holds).
    assert!(hash.starts_with("$argon2id$v=19$m=7168,t=5,p=1$"), "{hash}");
    assert!(!hash.contains("s3cret-admin"));
    assert!(password_matches("s3cret-admin", &hash));
    assert!(!password_matches("s3cret-admiN", &hash));
    assert!(!password_matches("", &hash));
    assert_eq!(login.access, Access::Admin);
    assert!(env.st.login("nobody").unwrap().is_none());
}

/// A hash made with other parameters (the crate's default, 19 MiB and two
/// passes, as earlier versions made them) verifies with its own.
#[test]
fn a_hash_made_with_other_parameters_still_verifies() {
    use argon2::password_hash::{PasswordHasher, SaltString};
    let salt = SaltString::encode_b64(b"sixteen byte slt").unwrap();
    let old = argon2::Argon2::default()
        .hash_password(b"an older password", &salt)
        .unwrap()
        .to_string();
    assert!(old.contains("$m=19456,t=2,p=1$"), "{old}");
    assert!(password_matches("an older password", &old));
    assert!(!password_matches("an older passwore", &old));
}

#[test]
fn a_read_user_reads_and_is_refused_every_write_which_changes_nothing() {
    let env = with_admin();
    let admin = env.st.as_user(ADMIN);
    admin
        .add_user("bob", Access::Read, &secret_hash("k"))
        .unwrap();
    let bob = env.st.as_user("bob");
    let before = env.st.status().unwrap();
    assert_eq!(bob.status().unwrap(), before);
    match deploy_mysql(&bob) {
        Err(Error::Forbidden { user, has, needs }) => {
            assert_eq!(
                (user.as_str(), has, needs),
                ("bob", Access::Read, Access::Write)
            )
        }
        other => panic!("{other:?}"),
    }
    let msg = deploy_mysql(&bob).unwrap_err().to_string();
    assert_eq!(msg, "user `bob` has `read` access to this environment and this needs `write`; an admin can grant it with `jujube grant bob write`");
    assert_eq!(env.st.status().unwrap(), before);
    // Managing users is an admin's.
    assert!(matches!(
        bob.add_user("eve", Access::Admin, "h"),
        Err(Error::Forbidden {
            needs: Access::Admin,
            ..
        })
    ));
    // A grant holds from the next transaction on, a revoke too.
    admin.change_access("bob", Access::Write, true).unwrap();
    deploy_mysql(&bob).unwrap();
    // A command on a unit needs admin.
    assert!(matches!(
        bob.queue_run("mysql/0", &["true".into()], 10),
        Err(Error::Forbidden {
            needs: Access::Admin,
            ..
        })
    ));
    assert_eq!(
        admin.change_access("bob", Access::Read, false).unwrap(),
        Access::None
    );
    assert!(matches!(
        bob.status(),
        Err(Error::Forbidden {
            has: Access::None,
            needs: Access::Read,
            ..
        })
    ));
    // A user removed or never made is refused too.
    assert!(matches!(
        env.st.as_user("carol").status(),
        Err(Error::NoSuchUser(_))
    ));
}

#[test]
fn grant_never_lowers_revoke_never_raises_and_the_last_admin_stays_admin() {
    let env = with_admin();
    let admin = env.st.as_user(ADMIN);
    admin.add_user("bob", Access::Write, "h").unwrap();
    assert_eq!(
        admin.change_access("bob", Access::Read, true).unwrap(),
        Access::Write
    );
    assert_eq!(
        admin.change_access("bob", Access::Admin, false).unwrap(),
        Access::Write
    );
    assert_eq!(
        admin.change_access("bob", Access::Write, false).unwrap(),
        Access::Read
    );
    assert!(matches!(
        admin.change_access(ADMIN, Access::Admin, false),
        Err(Error::LastAdmin(_))
    ));
    admin.change_access("bob", Access::Admin, true).unwrap();
    // With another admin, admin may step down; bob is then the last.
    admin.change_access(ADMIN, Access::Write, false).unwrap();
    assert!(matches!(
        env.st
            .as_user("bob")
            .change_access("bob", Access::Write, false),
        Err(Error::LastAdmin(_))
    ));
    assert!(matches!(
        admin.add_user("carol", Access::Read, "h"),
        Err(Error::Forbidden { .. })
    ));
}

#[test]
fn a_registration_secret_works_once_and_only_its_own() {
    let env = with_admin();
    let admin = env.st.as_user(ADMIN);
    admin
        .add_user("bob", Access::Read, &secret_hash("the-secret"))
        .unwrap();
    assert!(env
        .st
        .login("bob")
        .unwrap()
        .unwrap()
        .password_hash
        .is_none());
    assert!(matches!(
        env.st.register_user("bob", "not-it", "pw"),
        Err(Error::RegistrationRefused)
    ));
    assert!(matches!(
        env.st.register_user("nobody", "the-secret", "pw"),
        Err(Error::RegistrationRefused)
    ));
    assert!(matches!(
        env.st.register_user("bob", "the-secret", ""),
        Err(Error::BadPassword(_))
    ));
    env.st
        .register_user("bob", "the-secret", "bobs-pw")
        .unwrap();
    let hash = env.st.login("bob").unwrap().unwrap().password_hash.unwrap();
    assert!(password_matches("bobs-pw", &hash));
    assert!(matches!(
        env.st.register_user("bob", "the-secret", "other"),
        Err(Error::RegistrationRefused)
    ));
    // bob changes its own password; bob may not change admin's.
    let bob = env.st.as_user("bob");
    bob.set_user_password("bob", "new-pw").unwrap();
    let hash = env.st.login("bob").unwrap().unwrap().password_hash.unwrap();
    assert!(password_matches("new-pw", &hash));
    assert!(matches!(
        bob.set_user_password(ADMIN, "x"),
        Err(Error::Forbidden { .. })
    ));
    // Users: an admin sees all, bob himself only.
    let all: Vec<String> = admin.users().unwrap().into_iter().map(|u| u.name).collect();
    assert_eq!(all, ["admin", "bob"]);
    let mine = bob.users().unwrap();
    assert_eq!(mine.len(), 1);
    assert_eq!((mine[0].name.as_str(), mine[0].registered), ("bob", true));
    assert_eq!(mine[0].created_by.as_deref(), Some("admin"));
    assert!(matches!(
        admin.add_user("bob", Access::Read, "h"),
        Err(Error::UserExists(_))
    ));
    assert!(matches!(
        admin.add_user("-bad", Access::Read, "h"),
        Err(Error::Model(_))
    ));
}

#[test]
fn a_password_set_before_registration_ends_the_registration_string() {
    let env = with_admin();
    let admin = env.st.as_user(ADMIN);
    admin
        .add_user("bob", Access::Read, &secret_hash("leaked"))
        .unwrap();
    admin.set_user_password("bob", "chosen by admin").unwrap();
    assert!(matches!(
        env.st.register_user("bob", "leaked", "mine now"),
        Err(Error::RegistrationRefused)
    ));
    let hash = env.st.login("bob").unwrap().unwrap().password_hash.unwrap();
    assert!(password_matches("chosen by admin", &hash));
    // A control character is no part of a password.
    assert!(matches!(
        admin.set_user_password("bob", "a\u{7}b"),
        Err(Error::BadPassword(_))
    ));
}

#[test]
fn a_commands_output_is_for_admins_alone() {
    let env = with_admin();
    let admin = env.st.as_user(ADMIN);
    deploy_mysql(&admin).unwrap();
    admin.add_user("bob", Access::Write, "h").unwrap();
    let id = admin.queue_run("mysql/0", &["true".into()], 10).unwrap();
    let bob = env.st.as_user("bob");
    assert!(matches!(
        bob.run_result(id),
        Err(Error::Forbidden {
            needs: Access::Admin,
            ..
        })
    ));
    assert!(matches!(
        bob.forget_run(id),
        Err(Error::Forbidden {
            needs: Access::Admin,
            ..
        })
    ));
    assert_eq!(admin.run_result(id).unwrap(), None);
    admin.forget_run(id).unwrap();
}

/// An environment keeps a bounded number of users (`users` lists them
/// all): one more is refused, changing nothing.
#[test]
fn an_environment_keeps_a_bounded_number_of_users() {
    use crate::users::MAX_USERS;
    let e = with_admin();
    let admin = e.st.as_user(ADMIN);
    for i in 1..MAX_USERS {
        admin
            .add_user(&format!("user{i}"), Access::Read, &secret_hash("s"))
            .unwrap();
    }
    assert_eq!(admin.users().unwrap().len(), MAX_USERS);
    let err = e.refused(|s| {
        s.as_user(ADMIN)
            .add_user("onemore", Access::Read, &secret_hash("s"))
    });
    assert_eq!(
        err.to_string(),
        format!("cannot add user `onemore`: the environment has {MAX_USERS} users, the most it keeps; give an existing user the access instead (`jujube grant`)")
    );
}
