//! Bad input, tried as a new user would: each is a clear error that changes
//! nothing. And what users write as Juju users do (escaped spaces in
//! constraints, constraints merged with the environment's).

use crate::Jujube;

fn bootstrapped() -> Jujube {
    let j = Jujube::new();
    j.run(&["bootstrap", "test", "--provider", "dummy"]).ok();
    j
}

#[test]
fn counts_above_the_maximum_are_refused_without_allocating() {
    let j = bootstrapped();
    j.run(&["deploy", &j.charm("wordpress"), "-n", "0"]).ok();
    // Before the limit this aborted the process (a 2.4 TB allocation).
    j.refused(
        &["add-unit", "wordpress", "-n", "99999999999"],
        1,
        "cannot add 99999999999 units at once: at most 100000 per command; add them in several commands",
    );
    j.refused(
        &["add-machine", "-n", "100001"],
        1,
        "cannot add 100001 machines at once: at most 100000 per command; add them in several commands",
    );
    j.refused(
        &["deploy", &j.charm("mysql"), "-n", "18446744073709551615"],
        1,
        "cannot add 18446744073709551615 units at once: at most 100000 per command; add them in several commands",
    );
    j.refused(&["add-machine", "-n", "0"], 2, "`-n` must be at least 1");
    // Beyond what a number can hold: a usage error.
    let before = j.settled();
    let r = j.run(&["add-unit", "wordpress", "-n", "999999999999999999999999"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.starts_with("error: "), "{}", r.stderr);
    assert_eq!(before, j.snapshot());
}

#[test]
fn unknown_series_are_refused_unless_the_environment_adds_them() {
    let j = bootstrapped();
    let unknown = "unknown series `nosuch`: jujube knows Ubuntu's series from `precise` (12.04) to `resolute` (26.04), e.g. `jammy` or `noble`; to use another, add it to the environment's `extra-series` config (`jujube set-environment extra-series=nosuch`, or `--config extra-series=nosuch` when bootstrapping)";
    j.refused(&["add-machine", "--series", "nosuch"], 1, unknown);
    j.refused(
        &["deploy", &j.charm("mysql"), "--series", "nosuch"],
        1,
        "charm `mysql` does not support series `nosuch` (it supports `jammy`, `noble`); use `--series` with one of those",
    );
    // A charm that names no series runs on any series jujube knows.
    let dir = tempfile::tempdir().unwrap();
    let anyseries = dir.path().join("anyseries");
    std::fs::create_dir_all(&anyseries).unwrap();
    std::fs::write(
        anyseries.join("metadata.yaml"),
        "name: anyseries\nsummary: x\n",
    )
    .unwrap();
    let anyseries = anyseries.to_str().unwrap();
    j.refused(&["deploy", anyseries, "--series", "nosuch"], 1, unknown);
    j.run(&["deploy", anyseries, "--series", "focal", "-n", "0"])
        .ok();
    let r = j.run(&["bootstrap", "other", "--default-series", "nosuch"]);
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr, format!("error: {unknown}\n"));
    assert!(!j.home.path().join("environments/other").exists());
    j.run(&["set-environment", "extra-series=nosuch"]).ok();
    j.run(&["add-machine", "--series", "nosuch"]).ok();
    assert_eq!(j.status()["machines"]["1"]["series"], "nosuch");
    j.run(&["deploy", anyseries, "svc", "--series", "nosuch", "-n", "0"])
        .ok();
    j.run(&[
        "bootstrap",
        "other",
        "--default-series",
        "nosuch",
        "--config",
        "extra-series=nosuch",
    ])
    .ok();
    assert_eq!(j.status()["environment"]["default-series"], "nosuch");
}

#[test]
fn constraint_values_with_escaped_spaces_read_back_unchanged() {
    let j = bootstrapped();
    // Zones are checked against the provider's: give the dummy a zone whose
    // name has spaces, as EC2-compatible clouds and OpenStack do.
    j.run(&["set-environment", "dummy-zones=Availability zone 1,zone-b"])
        .ok();
    j.run(&[
        "set-constraints",
        r"zones=Availability\ zone\ 1",
        r"instance-type=with\ spaces",
    ])
    .ok();
    let shown = j.run(&["get-constraints"]).ok().stdout;
    assert_eq!(
        shown,
        "instance-type=with\\ spaces zones=Availability\\ zone\\ 1\n"
    );
    // What get-constraints prints is what set-constraints reads.
    j.run(&["deploy", &j.charm("wordpress"), "-n", "0"]).ok();
    j.run(&[
        "set-constraints",
        "--service",
        "wordpress",
        shown.trim_end(),
    ])
    .ok();
    assert_eq!(
        j.run(&["get-constraints", "--service", "wordpress"])
            .ok()
            .stdout,
        shown
    );
    j.run(&["add-machine"]).ok();
    let st = j.status();
    assert_eq!(
        st["machines"]["1"]["constraints"],
        "instance-type=with\\ spaces zones=Availability\\ zone\\ 1"
    );
    j.refused(
        &["set-constraints", "instance-type=with spaces"],
        1,
        r"malformed constraint `spaces`: write constraints as key=value, e.g. `mem=4G`; a space inside a value is written `\ `, e.g. `zones=Availability\ zone\ 1`",
    );
}

#[test]
fn add_machine_constraints_fill_the_rest_from_the_environment() {
    let j = Jujube::new();
    j.run(&["bootstrap", "test", "--constraints", "mem=4G cores=2"])
        .ok();
    j.run(&["add-machine", "--constraints", "cores=8"]).ok();
    j.run(&["add-machine", "--constraints", "mem="]).ok();
    j.run(&["add-machine"]).ok();
    let st = j.status();
    assert_eq!(st["machines"]["1"]["constraints"], "cores=8 mem=4G");
    assert_eq!(st["machines"]["2"]["constraints"], "cores=2");
    assert_eq!(st["machines"]["3"]["constraints"], "cores=2 mem=4G");
    // Captured at creation.
    j.run(&["set-constraints", "mem=8G"]).ok();
    assert_eq!(j.status()["machines"]["1"]["constraints"], "cores=8 mem=4G");
}

fn broken_charm(dir: &std::path::Path, metadata: &str) -> std::path::PathBuf {
    let charm = dir.join("broken");
    std::fs::create_dir_all(&charm).unwrap();
    std::fs::write(charm.join("metadata.yaml"), metadata).unwrap();
    charm
}

#[test]
fn malformed_charm_metadata_is_refused_naming_the_file_and_the_line() {
    let j = bootstrapped();
    let dir = tempfile::tempdir().unwrap();
    let charm = broken_charm(
        dir.path(),
        "name: broken\nsummary: x\nprovides:\n\tdb: mysql\n",
    );
    let file = charm.join("metadata.yaml");
    let before = j.settled();
    let r = j.run(&["deploy", charm.to_str().unwrap()]);
    assert_eq!(r.code, 1);
    let prefix = format!("error: cannot parse `{}` at line 4: ", file.display());
    assert!(r.stderr.starts_with(&prefix), "{}", r.stderr);
    assert_eq!(before, j.snapshot());

    std::fs::write(&file, "name: broken\nsubordinate: maybe\n").unwrap();
    let r = j.run(&["deploy", charm.to_str().unwrap()]);
    assert_eq!(r.code, 1);
    let prefix = format!("error: cannot parse `{}` at line 2: ", file.display());
    assert!(r.stderr.starts_with(&prefix), "{}", r.stderr);
    assert_eq!(before, j.snapshot());

    std::fs::write(&file, "name: broken\n").unwrap();
    std::fs::write(
        charm.join("config.yaml"),
        "options:\n  port:\n    type: int\n    default: [80\n",
    )
    .unwrap();
    let r = j.run(&["deploy", charm.to_str().unwrap()]);
    assert_eq!(r.code, 1);
    let prefix = format!(
        "error: cannot parse `{}` at line ",
        charm.join("config.yaml").display()
    );
    assert!(r.stderr.starts_with(&prefix), "{}", r.stderr);
    assert_eq!(before, j.snapshot());
}
