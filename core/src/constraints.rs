//! Hardware constraints: what a machine must offer to host a unit.
//!
//! Constraints are written as space-separated `key=value` words. A key given
//! with an empty value (`mem=`) is *set to nothing*: on a service it hides the
//! environment's value for that key when the two are collapsed into a unit's
//! constraints (see [`Constraints::with_fallbacks`]).
//!
//! A value may hold spaces, written as Juju writes them: a backslash before
//! the space (`zones=Availability\ zone\ 1`, `instance-type=with\ spaces`).
//! Any other backslash is an ordinary character, but a value may not end
//! with one (it would escape the space after it).
//!
//! The canonical form lists keys in alphabetical order, sizes in the largest
//! binary unit that represents them exactly (`2G`, `1536M`), lists joined by
//! commas, and spaces escaped; parsing the canonical form gives back an equal
//! value.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// A constraint key. Declared in alphabetical order so that the derived
/// `Ord` is the canonical display order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Key {
    AllocatePublicIp,
    Arch,
    Container,
    Cores,
    CpuPower,
    InstanceType,
    Mem,
    RootDisk,
    Tags,
    VirtType,
    Zones,
}

pub const KEYS: [Key; 11] = [
    Key::AllocatePublicIp,
    Key::Arch,
    Key::Container,
    Key::Cores,
    Key::CpuPower,
    Key::InstanceType,
    Key::Mem,
    Key::RootDisk,
    Key::Tags,
    Key::VirtType,
    Key::Zones,
];

pub(crate) const KEYS_LIST: &str = "`allocate-public-ip`, `arch`, `container`, `cores`, \
`cpu-power`, `instance-type`, `mem`, `root-disk`, `tags`, `virt-type` and `zones`";

/// Architectures jujube knows how to ask providers for.
pub const ARCHES: [&str; 7] = [
    "amd64", "arm64", "armhf", "i386", "ppc64el", "riscv64", "s390x",
];
/// Container types a machine may be asked to be.
pub const CONTAINERS: [&str; 3] = ["kvm", "lxd", "none"];

impl Key {
    pub fn as_str(self) -> &'static str {
        match self {
            Key::AllocatePublicIp => "allocate-public-ip",
            Key::Arch => "arch",
            Key::Container => "container",
            Key::Cores => "cores",
            Key::CpuPower => "cpu-power",
            Key::InstanceType => "instance-type",
            Key::Mem => "mem",
            Key::RootDisk => "root-disk",
            Key::Tags => "tags",
            Key::VirtType => "virt-type",
            Key::Zones => "zones",
        }
    }
}

impl FromStr for Key {
    type Err = Error;
    fn from_str(s: &str) -> Result<Key> {
        KEYS.into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| Error::UnknownConstraint { key: s.to_string() })
    }
}

/// A constraint's value, typed by its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `arch`, `container`, `instance-type`, `virt-type`.
    Text(String),
    /// `cores`, `cpu-power`.
    Count(u64),
    /// `mem`, `root-disk`, in MiB.
    MiB(u64),
    /// `tags`, `zones`.
    List(Vec<String>),
    /// `allocate-public-ip`.
    Bool(bool),
}

/// The most text a set of constraints may be given in (`--constraints`,
/// `set-constraints`): room for long `tags` and `zones` lists.
pub const MAX_CONSTRAINTS_BYTES: usize = 4096;

/// A set of constraints. Each key is absent, set to a value, or set to
/// nothing (`None`, written `key=`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Constraints {
    entries: BTreeMap<Key, Option<Value>>,
}

const MIB_UNITS: [(char, u64); 4] = [
    ('P', 1024 * 1024 * 1024),
    ('T', 1024 * 1024),
    ('G', 1024),
    ('M', 1),
];

fn parse_mib(key: Key, raw: &str) -> Result<u64> {
    let invalid = |why: &str| Error::InvalidConstraint {
        key: key.as_str().to_string(),
        value: raw.to_string(),
        why: why.to_string(),
    };
    let (number, mult) = match raw.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let mult = MIB_UNITS
                .iter()
                .find(|(u, _)| *u == c.to_ascii_uppercase())
                .map(|(_, m)| *m)
                .ok_or_else(|| invalid("use a size such as `512M`, `2G`, `1.5T` or `1P`"))?;
            (&raw[..raw.len() - 1], mult)
        }
        _ => (raw, 1),
    };
    if number.is_empty() || !number.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(invalid("use a size such as `512M`, `2G`, `1.5T` or `1P`"));
    }
    let n: f64 = number
        .parse()
        .map_err(|_| invalid("use a size such as `512M`, `2G`, `1.5T` or `1P`"))?;
    let mib = (n * mult as f64).ceil();
    if !mib.is_finite() || mib > (u64::MAX / 2) as f64 {
        return Err(invalid("the size is too large"));
    }
    Ok(mib as u64)
}

fn display_mib(mib: u64) -> String {
    for (unit, mult) in MIB_UNITS {
        if mib != 0 && mib.is_multiple_of(mult) {
            return format!("{}{}", mib / mult, unit);
        }
    }
    "0M".to_string()
}

fn parse_value(key: Key, raw: &str) -> Result<Value> {
    let invalid = |why: String| Error::InvalidConstraint {
        key: key.as_str().to_string(),
        value: raw.to_string(),
        why,
    };
    Ok(match key {
        Key::Mem | Key::RootDisk => Value::MiB(parse_mib(key, raw)?),
        Key::Cores | Key::CpuPower => Value::Count(
            raw.parse()
                .map_err(|_| invalid("use a whole number such as `2`".to_string()))?,
        ),
        Key::Arch => {
            if !ARCHES.contains(&raw) {
                return Err(invalid(format!(
                    "known architectures are {}",
                    ARCHES.join(", ")
                )));
            }
            Value::Text(raw.to_string())
        }
        Key::Container => {
            if !CONTAINERS.contains(&raw) {
                return Err(invalid(format!(
                    "known containers are {}",
                    CONTAINERS.join(", ")
                )));
            }
            Value::Text(raw.to_string())
        }
        Key::InstanceType | Key::VirtType => Value::Text(raw.to_string()),
        Key::AllocatePublicIp => match raw {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ => return Err(invalid("use `true` or `false`".to_string())),
        },
        Key::Tags | Key::Zones => {
            let items: Vec<String> = raw.split(',').map(str::to_string).collect();
            if items.iter().any(String::is_empty) {
                return Err(invalid(
                    "use a comma-separated list without empty items".to_string(),
                ));
            }
            Value::List(items)
        }
    })
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Text(s) => f.write_str(s),
            Value::Count(n) => write!(f, "{n}"),
            Value::MiB(n) => f.write_str(&display_mib(*n)),
            Value::List(items) => f.write_str(&items.join(",")),
            Value::Bool(b) => write!(f, "{b}"),
        }
    }
}

/// Splits constraint text into words at whitespace, except that a backslash
/// followed by a space stands for a space inside the word (Juju's escape).
fn split_words(s: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' && chars.peek() == Some(&' ') {
            chars.next();
            word.push(' ');
        } else if c.is_whitespace() {
            if !word.is_empty() {
                words.push(std::mem::take(&mut word));
            }
        } else {
            word.push(c);
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

impl Constraints {
    pub fn new() -> Constraints {
        Constraints::default()
    }

    /// Parses space-separated `key=value` words (`\ ` is a space inside a
    /// value). An empty string is the empty set. Each key may appear once.
    pub fn parse(s: &str) -> Result<Constraints> {
        Constraints::parse_words([s])
    }

    /// [`Constraints::parse`] without [`MAX_CONSTRAINTS_BYTES`], for text
    /// jujube wrote itself: a machine's constraints are its service's
    /// merged with the environment's, each within the bound, and may pass
    /// it together.
    pub fn parse_stored(s: &str) -> Result<Constraints> {
        Constraints::parse_all([s], false)
    }

    /// Parses words already split, as a command line gives them; each word
    /// may itself hold several space-separated constraints. At most
    /// [`MAX_CONSTRAINTS_BYTES`] in all: constraints are copied into every
    /// machine and unit they apply to.
    pub fn parse_words<'a>(words: impl IntoIterator<Item = &'a str>) -> Result<Constraints> {
        Constraints::parse_all(words, true)
    }

    fn parse_all<'a>(
        words: impl IntoIterator<Item = &'a str>,
        bounded: bool,
    ) -> Result<Constraints> {
        let words: Vec<&str> = words.into_iter().collect();
        let len = words
            .iter()
            .map(|w| w.len() + 1)
            .sum::<usize>()
            .saturating_sub(1);
        if bounded && len > MAX_CONSTRAINTS_BYTES {
            return Err(Error::ConstraintsTooLong {
                len,
                max: MAX_CONSTRAINTS_BYTES,
            });
        }
        let mut entries = BTreeMap::new();
        for word in words.into_iter().flat_map(split_words) {
            let (k, v) = word
                .split_once('=')
                .filter(|(k, _)| !k.is_empty())
                .ok_or_else(|| Error::MalformedConstraint(word.to_string()))?;
            let key: Key = k.parse()?;
            if v.ends_with('\\') {
                return Err(Error::InvalidConstraint {
                    key: k.to_string(),
                    value: v.to_string(),
                    why: "a value cannot end with `\\` (a backslash escapes the space after it)"
                        .to_string(),
                });
            }
            let value = if v.is_empty() {
                None
            } else {
                Some(parse_value(key, v)?)
            };
            if entries.insert(key, value).is_some() {
                return Err(Error::DuplicateConstraint { key: k.to_string() });
            }
        }
        Ok(Constraints { entries })
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The value of `key`: `None` when absent or set to nothing.
    pub fn get(&self, key: Key) -> Option<&Value> {
        self.entries.get(&key).and_then(Option::as_ref)
    }

    /// True when `key` is present, even if set to nothing.
    pub fn has(&self, key: Key) -> bool {
        self.entries.contains_key(&key)
    }

    pub fn set(&mut self, key: Key, value: Option<Value>) {
        self.entries.insert(key, value);
    }

    pub fn keys(&self) -> impl Iterator<Item = Key> + '_ {
        self.entries.keys().copied()
    }

    fn mib(&self, key: Key) -> Option<u64> {
        match self.get(key) {
            Some(Value::MiB(n)) => Some(*n),
            _ => None,
        }
    }
    fn count(&self, key: Key) -> Option<u64> {
        match self.get(key) {
            Some(Value::Count(n)) => Some(*n),
            _ => None,
        }
    }
    fn text(&self, key: Key) -> Option<&str> {
        match self.get(key) {
            Some(Value::Text(s)) => Some(s),
            _ => None,
        }
    }
    fn list(&self, key: Key) -> &[String] {
        match self.get(key) {
            Some(Value::List(v)) => v,
            _ => &[],
        }
    }

    pub fn mem(&self) -> Option<u64> {
        self.mib(Key::Mem)
    }
    pub fn root_disk(&self) -> Option<u64> {
        self.mib(Key::RootDisk)
    }
    pub fn cores(&self) -> Option<u64> {
        self.count(Key::Cores)
    }
    pub fn cpu_power(&self) -> Option<u64> {
        self.count(Key::CpuPower)
    }
    pub fn arch(&self) -> Option<&str> {
        self.text(Key::Arch)
    }
    pub fn instance_type(&self) -> Option<&str> {
        self.text(Key::InstanceType)
    }
    pub fn container(&self) -> Option<&str> {
        self.text(Key::Container)
    }
    pub fn virt_type(&self) -> Option<&str> {
        self.text(Key::VirtType)
    }
    pub fn tags(&self) -> &[String] {
        self.list(Key::Tags)
    }
    pub fn zones(&self) -> &[String] {
        self.list(Key::Zones)
    }
    pub fn allocate_public_ip(&self) -> Option<bool> {
        match self.get(Key::AllocatePublicIp) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        }
    }

    /// Collapses `self` (a service's constraints) over `fallbacks` (the
    /// environment's): every key the service mentions wins, even when it is
    /// set to nothing; every other key comes from the environment. The result
    /// holds only real values, because it is what a unit and its machine
    /// keep: "set to nothing" has done its job once the fallback is hidden.
    pub fn with_fallbacks(&self, fallbacks: &Constraints) -> Constraints {
        let mut entries = fallbacks.entries.clone();
        for (k, v) in &self.entries {
            entries.insert(*k, v.clone());
        }
        entries.retain(|_, v| v.is_some());
        Constraints { entries }
    }
}

impl fmt::Display for Constraints {
    /// The canonical form: sorted keys, canonical values with their spaces
    /// escaped (`\ `), single spaces between words. It parses back to an
    /// equal value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (k, v) in &self.entries {
            if !first {
                f.write_str(" ")?;
            }
            first = false;
            write!(f, "{}=", k.as_str())?;
            if let Some(v) = v {
                f.write_str(&v.to_string().replace(' ', "\\ "))?;
            }
        }
        Ok(())
    }
}

impl FromStr for Constraints {
    type Err = Error;
    fn from_str(s: &str) -> Result<Constraints> {
        Constraints::parse(s)
    }
}

impl Serialize for Constraints {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Constraints {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Constraints::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(s: &str) -> Constraints {
        Constraints::parse(s).unwrap()
    }

    #[test]
    fn sizes_take_mib_base_suffixes() {
        assert_eq!(c("mem=512").mem(), Some(512));
        assert_eq!(c("mem=512M").mem(), Some(512));
        assert_eq!(c("mem=2G").mem(), Some(2048));
        assert_eq!(c("mem=1.5G").mem(), Some(1536));
        assert_eq!(c("root-disk=1T").root_disk(), Some(1024 * 1024));
        assert_eq!(c("root-disk=2P").root_disk(), Some(2 * 1024 * 1024 * 1024));
        assert_eq!(c("mem=4g").mem(), Some(4096));
        for bad in ["mem=2X", "mem=G", "mem=-1G", "mem=1e3G", "mem=abc"] {
            assert!(
                matches!(
                    Constraints::parse(bad),
                    Err(Error::InvalidConstraint { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn canonical_display_sorts_keys_and_normalises_values() {
        let v = c("zones=a,b mem=2048M cores=4 arch=amd64 root-disk=1536 tags=x");
        assert_eq!(
            v.to_string(),
            "arch=amd64 cores=4 mem=2G root-disk=1536M tags=x zones=a,b"
        );
        assert_eq!(c(&v.to_string()), v);
        assert_eq!(c("mem= cores=2").to_string(), "cores=2 mem=");
        assert_eq!(c("").to_string(), "");
    }

    #[test]
    fn every_key_round_trips() {
        let all = "allocate-public-ip=true arch=arm64 container=lxd cores=8 cpu-power=400 \
                   instance-type=m5.large mem=16G root-disk=64G tags=a,b virt-type=kvm zones=z1";
        assert_eq!(c(all).to_string(), all);
        assert_eq!(c(all).keys().count(), KEYS.len());
    }

    #[test]
    fn bad_words_are_rejected_with_the_key_named() {
        assert_eq!(
            Constraints::parse("mem=2G foo=1"),
            Err(Error::UnknownConstraint { key: "foo".into() })
        );
        assert_eq!(
            Constraints::parse("mem=2G mem=3G"),
            Err(Error::DuplicateConstraint { key: "mem".into() })
        );
        assert_eq!(
            Constraints::parse("mem"),
            Err(Error::MalformedConstraint("mem".into()))
        );
        assert_eq!(
            Constraints::parse("=2G"),
            Err(Error::MalformedConstraint("=2G".into()))
        );
        assert!(Constraints::parse("arch=sparc").is_err());
        assert!(Constraints::parse("cores=two").is_err());
        assert!(Constraints::parse("allocate-public-ip=yes").is_err());
        assert!(Constraints::parse("tags=a,,b").is_err());
        // Bounded at the parse, words counted with a space between them.
        let tags = |n: usize| format!("tags={}", "t".repeat(n - 5));
        assert!(Constraints::parse(&tags(MAX_CONSTRAINTS_BYTES)).is_ok());
        assert_eq!(
            Constraints::parse(&tags(MAX_CONSTRAINTS_BYTES + 1))
                .unwrap_err()
                .to_string(),
            "constraints of 4097 bytes are more than 4096; shorten them"
        );
        // What jujube wrote itself (merged constraints) reads back whole.
        let long = format!("{} zones=z", tags(MAX_CONSTRAINTS_BYTES));
        assert_eq!(Constraints::parse_stored(&long).unwrap().to_string(), long);
        let half = "t".repeat(MAX_CONSTRAINTS_BYTES / 2 - 4);
        assert!(Constraints::parse_words([
            format!("tags={half}").as_str(),
            &format!("zones={half}")
        ])
        .is_err());
        assert_eq!(
            Constraints::parse("foo=1").unwrap_err().to_string(),
            "unknown constraint `foo`: valid constraints are `allocate-public-ip`, `arch`, \
             `container`, `cores`, `cpu-power`, `instance-type`, `mem`, `root-disk`, `tags`, \
             `virt-type` and `zones`"
        );
    }

    #[test]
    fn values_with_spaces_use_jujus_backslash_escape_and_read_back_unchanged() {
        let v = c(r"zones=Availability\ zone\ 1,zone\ 2 instance-type=with\ spaces mem=2G");
        assert_eq!(v.zones(), ["Availability zone 1", "zone 2"]);
        assert_eq!(v.instance_type(), Some("with spaces"));
        assert_eq!(v.mem(), Some(2048));
        let shown = v.to_string();
        assert_eq!(
            shown,
            r"instance-type=with\ spaces mem=2G zones=Availability\ zone\ 1,zone\ 2"
        );
        assert_eq!(c(&shown), v);
        // As a command line gives them: one word per argument.
        assert_eq!(
            Constraints::parse_words([
                r"zones=Availability\ zone\ 1,zone\ 2",
                r"instance-type=with\ spaces mem=2G"
            ])
            .unwrap(),
            v
        );
        // Any other backslash is an ordinary character.
        assert_eq!(c(r"instance-type=a\b").instance_type(), Some(r"a\b"));
        assert_eq!(c(r"tags=a\\ b").tags(), [r"a\ b"]);
        assert_eq!(c(&c(r"tags=a\\ b").to_string()), c(r"tags=a\\ b"));
        // ... but a value cannot end with one: it would swallow the space
        // that separates it from the next constraint.
        assert!(matches!(
            Constraints::parse(r"tags=a\"),
            Err(Error::InvalidConstraint { key, .. }) if key == "tags"
        ));
        // A fragment without `=` says how to write spaces.
        assert_eq!(
            Constraints::parse("zones=Availability zone")
                .unwrap_err()
                .to_string(),
            r"malformed constraint `zone`: write constraints as key=value, e.g. `mem=4G`; a space inside a value is written `\ `, e.g. `zones=Availability\ zone\ 1`"
        );
    }

    proptest::proptest! {
        /// Whatever parses, its canonical form parses back to an equal value.
        #[test]
        fn the_canonical_form_reads_back_unchanged(
            words in proptest::collection::vec(
                (proptest::sample::select(KEYS.to_vec()), "[a-c1-2 ,.=\\\\]{0,8}"),
                0..5,
            )
        ) {
            let text = words
                .iter()
                .map(|(k, v)| format!("{}={v}", k.as_str()))
                .collect::<Vec<_>>()
                .join(" ");
            if let Ok(parsed) = Constraints::parse(&text) {
                let shown = parsed.to_string();
                proptest::prop_assert_eq!(Constraints::parse(&shown), Ok(parsed), "{} -> {}", text, shown);
            }
        }
    }

    #[test]
    fn service_wins_per_key_and_empty_clears_the_environment() {
        let env = c("mem=4G cores=2 arch=amd64");
        let svc = c("mem=8G arch=");
        let unit = svc.with_fallbacks(&env);
        assert_eq!(unit.to_string(), "cores=2 mem=8G");
        assert_eq!(c("").with_fallbacks(&env), env);
        assert_eq!(svc.with_fallbacks(&c("")).to_string(), "mem=8G");
    }
}
