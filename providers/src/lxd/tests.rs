//! The LXD provider's logic that needs no daemon: config, names, sizes,
//! ownership and constraint checks. Its behaviour against a real daemon is
//! tested end to end (`tests/e2e/lxd.rs`).

use super::*;

const UUID: &str = "0a1b2c3d-2222-4333-8444-555555555555";

fn cfg(kvs: &[(&str, &str)]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn host() -> Host {
    Host {
        server_name: "node1".into(),
        arches: vec!["amd64".into(), "i386".into()],
        cpus: 4,
        mem_mib: 8192,
    }
}

#[test]
fn series_map_to_image_aliases_per_series_then_one_for_all_then_ubuntu() {
    let c = Config::parse(&BTreeMap::new()).unwrap();
    assert_eq!(c.alias_for("jammy"), "ubuntu/jammy");
    let c = Config::parse(&cfg(&[("image-alias", "jujube-test")])).unwrap();
    assert_eq!(c.alias_for("noble"), "jujube-test");
    let c = Config::parse(&cfg(&[
        ("image-alias", "fallback"),
        ("image-aliases", "jammy:ubuntu/22.04, noble:ubuntu/24.04"),
    ]))
    .unwrap();
    assert_eq!(c.alias_for("jammy"), "ubuntu/22.04");
    assert_eq!(c.alias_for("noble"), "ubuntu/24.04");
    assert_eq!(c.alias_for("focal"), "fallback");
}

#[test]
fn bad_config_is_refused_with_the_key_named() {
    for (kvs, want) in [
        (
            vec![("image-aliases", "jammy")],
            "`image-aliases` item `jammy`",
        ),
        (
            vec![("image-aliases", "Bad Series:x")],
            "`image-aliases` item",
        ),
        (
            vec![("lxd-sockt", "/x")],
            "unknown LXD config key `lxd-sockt`",
        ),
        (
            vec![("lxd-url", "https://h:8443")],
            "`lxd-url` needs `lxd-client-cert`",
        ),
        (vec![("lxd-client-cert", "/c")], "only used with `lxd-url`"),
        (
            vec![
                ("lxd-url", "https://h"),
                ("lxd-socket", "/s"),
                ("lxd-client-cert", "/c"),
                ("lxd-client-key", "/k"),
                ("lxd-server-cert", "/s"),
            ],
            "not both",
        ),
    ] {
        let e = validate_config(&cfg(&kvs)).unwrap_err();
        assert!(e.to_string().contains(want), "{kvs:?}: {e}");
        assert_eq!(e.class(), crate::ErrorClass::InvalidSpec);
    }
    validate_config(&cfg(&[
        ("lxd-socket", "/run/lxd.socket"),
        ("lxd-profiles", "default,extra"),
        ("lxd-storage-pool", "fast"),
    ]))
    .unwrap();
}

#[test]
fn containers_are_named_after_the_environment_and_machine() {
    let p = LxdProvider::new(UUID, &BTreeMap::new()).unwrap();
    assert_eq!(p.container_name("7"), "jujube-0a1b2c3d-7");
    assert_eq!(p.container_name("0/lxd/1"), "jujube-0a1b2c3d-0-lxd-1");
    assert!(p.ours_by_name("jujube-0a1b2c3d-7"));
    for other in [
        "jujube-0a1b2c3e-7",
        "jujube-0a1b2c3d-",
        "web-1",
        "jujube-0a1b2c3d-7/../x",
        "jujube-0a1b2c3d-7?recursion=1",
    ] {
        assert!(!p.ours_by_name(other), "{other}");
    }
}

#[test]
fn ownership_needs_both_the_name_prefix_and_the_full_uuid() {
    let p = LxdProvider::new(UUID, &BTreeMap::new()).unwrap();
    let c = |name: &str, uuid: Option<&str>| {
        let mut v = json!({"name": name, "config": {}});
        if let Some(u) = uuid {
            v["config"][CFG_UUID] = json!(u);
        }
        v
    };
    assert!(p.owned(&c("jujube-0a1b2c3d-1", Some(UUID))));
    // Look-alike name, no UUID.
    assert!(!p.owned(&c("jujube-0a1b2c3d-1", None)));
    // Right UUID, foreign name.
    assert!(!p.owned(&c("web-1", Some(UUID))));
    // Same short prefix, another environment's UUID.
    assert!(!p.owned(&c(
        "jujube-0a1b2c3d-1",
        Some("0a1b2c3d-9999-4333-8444-555555555555")
    )));
    // A prefix of the UUID is not the UUID.
    assert!(!p.owned(&c("jujube-0a1b2c3d-1", Some("0a1b2c3d"))));
}

#[test]
fn lxd_sizes_are_read_in_mib() {
    for (s, mib) in [
        ("512MiB", Some(512)),
        ("1GiB", Some(1024)),
        ("2GB", Some(1907)),
        ("1073741824", Some(1024)),
        ("4GB ", Some(3814)),
        ("lots", None),
        ("5XB", None),
    ] {
        assert_eq!(parse_size_mib(s), mib, "{s}");
    }
}

#[test]
fn constraints_are_checked_against_the_host_and_unsupported_keys_are_named() {
    let p = LxdProvider::new(UUID, &BTreeMap::new()).unwrap();
    let check = |s: &str| p.check_constraints(&Constraints::parse(s).unwrap(), &host());
    for ok in [
        "",
        "cores=4 mem=8G",
        "arch=amd64 root-disk=20G",
        "zones=node1",
        "container=none",
    ] {
        check(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
    for (bad, want) in [
        ("cores=5", "has 4 CPUs"),
        ("mem=9G", "has 8192M of memory"),
        ("arch=arm64", "runs amd64, i386"),
        ("zones=elsewhere", "the only zone is `node1`"),
        ("instance-type=m5.large tags=x", "`instance-type`, `tags`"),
        ("cpu-power=100", "`cpu-power`"),
        ("virt-type=kvm", "`virt-type`"),
    ] {
        let e = check(bad).unwrap_err();
        assert_eq!(e.class(), crate::ErrorClass::InvalidSpec, "{bad}");
        assert!(e.to_string().contains(want), "{bad}: {e}");
    }
}

#[test]
fn instances_report_tags_hardware_and_zone() {
    let p = LxdProvider::new(UUID, &BTreeMap::new()).unwrap();
    let v = json!({
        "name": "jujube-0a1b2c3d-3",
        "architecture": "x86_64",
        "location": "none",
        "config": {
            CFG_UUID: UUID, CFG_MACHINE: "3", CFG_NONCE: "n-3",
            "limits.cpu": "2", "limits.memory": "512MiB"
        },
        "devices": {"root": {"type": "disk", "path": "/", "pool": "default", "size": "10240MiB"}}
    });
    let i = p.instance(&v, &host());
    assert_eq!(i.id, "jujube-0a1b2c3d-3");
    assert_eq!(i.zone.as_deref(), Some("node1"));
    assert!(i.owned_by(UUID));
    assert_eq!(i.machine_id(), Some("3"));
    assert_eq!(i.nonce(), Some("n-3"));
    assert_eq!(&*i.hardware, "arch=amd64 cores=2 mem=512M root-disk=10G");
    // Without limits, the container may use the whole host.
    let v = json!({"name": "jujube-0a1b2c3d-4", "architecture": "x86_64", "config": {}});
    assert_eq!(
        &*p.instance(&v, &host()).hardware,
        "arch=amd64 cores=4 mem=8G"
    );
}

/// A start that fails on a proxy device's taken port is transient however
/// LXD words it (the wording depends on which of its processes noticed);
/// other failures keep their class.
#[test]
fn a_proxy_device_failing_at_start_is_transient() {
    let failed = |code, message: &str| {
        super::start_error(
            "c",
            super::client::ApiError {
                code,
                message: message.into(),
            },
        )
        .class()
    };
    for m in [
        "Error occurred when starting proxy device: Error: Failed to listen on 127.0.0.1:5000: listen tcp 127.0.0.1:5000: bind: address already in use",
        "Error occurred when starting proxy device: Error: Failed to receive fd from listener process: Failed to receive file descriptor via abstract unix socket",
    ] {
        assert_eq!(failed(400, m), crate::ErrorClass::Transient, "{m}");
    }
    assert_eq!(
        failed(400, "Invalid devices: bad"),
        crate::ErrorClass::InvalidSpec
    );
    assert_eq!(failed(500, "boom"), crate::ErrorClass::Transient);
}
