//! The dummy cloud: the embedded default provider and a fault injector.
//!
//! Its instances persist in an append-only log (`dummy-cloud.jsonl`) in the
//! environment's data directory, so the CLI, the controller and a restarted
//! controller all see one cloud. Every change takes an exclusive `flock` on a
//! lock file, replays what other processes appended, decides, and appends one
//! line; a process killed mid-way leaves at most a partial last line, which
//! is ignored. Without a directory it lives in memory only (benchmarks).
//!
//! Behaviour is set by environment config keys (all optional):
//!
//! | key | meaning | default |
//! |---|---|---|
//! | `dummy-start-latency` | time each start takes (`200ms`) | `0` |
//! | `dummy-zones` | zones, comma-separated | `zone-a,zone-b,zone-c` |
//! | `dummy-full-zones` | zones that answer with capacity errors | none |
//! | `dummy-fail-machines` | machine ids whose starts fail | none |
//! | `dummy-fail-class` | how they fail: `transient`, `capacity`, `quota`, `invalid-spec`, `credentials` | `invalid-spec` |
//! | `dummy-failure-rate` | random failures per class, `transient:0.2,capacity:0.05` | none |
//! | `dummy-lost-response-rate` | share of starts that succeed but report a transient failure | `0` |
//! | `dummy-throttling` | `ec2`: charge every call as EC2 does, with AWS's documented buckets ([`crate::bucket::ec2_limits`]); `none` | `none` |
//! | `dummy-instance-bucket` | RunInstances' resource bucket (instances), `BURST/PER_SECOND` | unlimited, or EC2's |
//! | `dummy-request-bucket` | RunInstances' request bucket, `BURST/PER_SECOND` | unlimited, or EC2's |
//! | `dummy-listing-delay` | how long starts and stops take to show in listings | `0` |
//! | `dummy-max-instances` | quota of live instances | unlimited |
//! | `dummy-seed` | seed for the random failures | `1` |
//! | `dummy-agents` | machine agents `in-process` or as `process`es through the API (read by the controller) | `in-process` |
//! | `dummy-unreachable` | `true`: every API call fails as if the cloud could not be reached | `false` |
//!
//! Starts are charged as the EC2 provider makes them: per launch (a launch
//! batch, `<batch>/<index>` nonces, or a plain nonce alone) one
//! DescribeInstances (the look-up before launching), one RunInstances
//! request and one resource token per instance (all or nothing, as EC2's
//! MinCount = MaxCount launch), and for a batch one CreateTags per machine,
//! paced in the background as the EC2 provider paces them. Stops cost a
//! DescribeInstances and a TerminateInstances (plus one resource token per
//! instance), listings a DescribeInstances. [`DummyProvider::api_stats`]
//! counts the calls and the throttling errors.
//!
//! The catalogue offers `d1.*` (amd64) and `d1a.*` (arm64) types from 1 core
//! / 1G to 64 cores / 256G; constraints no type satisfies are an
//! [`Error::InvalidSpec`].

use crate::bucket::{ec2_limits, LaunchPacer, TokenBucket};
use crate::{launch_batch, Error, ErrorClass, Instance, Provider, Result, StartSpec};
use async_trait::async_trait;
use jujube_core::constraints::Key;
use jujube_core::Constraints;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::time::{Duration, Instant};
use tracing::warn;

pub const LOG_FILE: &str = "dummy-cloud.jsonl";
const LOCK_FILE: &str = "dummy-cloud.lock";

/// (name suffix, cores, mem GiB, root disk GiB)
const SIZES: [(&str, u64, u64, u64); 8] = [
    ("nano", 1, 1, 8),
    ("small", 1, 2, 16),
    ("medium", 2, 4, 32),
    ("large", 4, 16, 64),
    ("xlarge", 8, 32, 128),
    ("2xlarge", 16, 64, 256),
    ("4xlarge", 32, 128, 512),
    ("8xlarge", 64, 256, 1024),
];
const ARCHES: [(&str, &str); 2] = [("amd64", "d1"), ("arm64", "d1a")];

/// The catalogue's instance type for constraints: the smallest that
/// satisfies them, as hardware constraints.
pub fn choose_type(cons: &Constraints) -> Result<Constraints> {
    let arch = cons.arch().unwrap_or("amd64");
    let family = ARCHES
        .iter()
        .find(|(a, _)| *a == arch)
        .map(|(_, f)| *f)
        .ok_or_else(|| {
            Error::InvalidSpec(format!(
                "the dummy cloud has no `{arch}` instances (it has amd64 and arm64)"
            ))
        })?;
    if let Some(c) = cons.container() {
        if c != "none" {
            return Err(Error::InvalidSpec(format!(
                "the dummy cloud cannot start `container={c}` machines"
            )));
        }
    }
    for (size, cores, mem_g, disk_g) in SIZES {
        let name = format!("{family}.{size}");
        let ok = cons.cores().is_none_or(|c| c <= cores)
            && cons.cpu_power().is_none_or(|p| p <= cores * 100)
            && cons.mem().is_none_or(|m| m <= mem_g * 1024)
            && cons.root_disk().is_none_or(|d| d <= disk_g * 1024)
            && cons.instance_type().is_none_or(|t| t == name);
        if ok {
            let mut hw = Constraints::new();
            hw.set(
                Key::Arch,
                Some(jujube_core::constraints::Value::Text(arch.to_string())),
            );
            hw.set(
                Key::Cores,
                Some(jujube_core::constraints::Value::Count(cores)),
            );
            hw.set(
                Key::CpuPower,
                Some(jujube_core::constraints::Value::Count(cores * 100)),
            );
            hw.set(
                Key::Mem,
                Some(jujube_core::constraints::Value::MiB(mem_g * 1024)),
            );
            hw.set(
                Key::RootDisk,
                Some(jujube_core::constraints::Value::MiB(disk_g * 1024)),
            );
            hw.set(
                Key::InstanceType,
                Some(jujube_core::constraints::Value::Text(name)),
            );
            return Ok(hw);
        }
    }
    Err(Error::InvalidSpec(format!(
        "no dummy instance type satisfies `{cons}` (the largest is 64 cores, 256G memory, 1T root disk)"
    )))
}

#[derive(Debug, Clone)]
struct Config {
    latency: Duration,
    zones: Vec<String>,
    full_zones: Vec<String>,
    fail_machines: Vec<String>,
    fail_class: ErrorClass,
    failure_rates: Vec<(ErrorClass, f64)>,
    lost_response_rate: f64,
    ec2_throttling: bool,
    instance_bucket: Option<String>,
    request_bucket: Option<String>,
    listing_delay: Duration,
    max_instances: Option<usize>,
    seed: u64,
    unreachable: bool,
}

fn list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn rate(key: &str, v: &str) -> Result<f64> {
    v.parse::<f64>()
        .ok()
        .filter(|r| (0.0..=1.0).contains(r))
        .ok_or_else(|| Error::Config(format!("`{key}={v}`: use a number between 0 and 1")))
}

impl Config {
    fn parse(cfg: &BTreeMap<String, String>) -> Result<Config> {
        let mut c = Config {
            latency: Duration::ZERO,
            zones: list("zone-a,zone-b,zone-c"),
            full_zones: vec![],
            fail_machines: vec![],
            fail_class: ErrorClass::InvalidSpec,
            failure_rates: vec![],
            lost_response_rate: 0.0,
            ec2_throttling: false,
            instance_bucket: None,
            request_bucket: None,
            listing_delay: Duration::ZERO,
            max_instances: None,
            seed: 1,
            unreachable: false,
        };
        let dur = |k: &str, v: &str| {
            jujube_core::duration::parse(v).ok_or_else(|| {
                Error::Config(format!("`{k}={v}`: use a duration such as `200ms` or `2s`"))
            })
        };
        let bucket = |k: &str, v: &str| {
            TokenBucket::parse(v).map(|_| v.to_string()).ok_or_else(|| {
                Error::Config(format!("`{k}={v}`: use BURST/PER_SECOND, e.g. `1000/2`"))
            })
        };
        for (k, v) in cfg {
            match k.as_str() {
                "dummy-start-latency" => c.latency = dur(k, v)?,
                "dummy-zones" => {
                    c.zones = list(v);
                    if c.zones.is_empty() {
                        return Err(Error::Config(
                            "`dummy-zones` needs at least one zone".into(),
                        ));
                    }
                }
                "dummy-full-zones" => c.full_zones = list(v),
                "dummy-fail-machines" => c.fail_machines = list(v),
                "dummy-fail-class" => {
                    c.fail_class = ErrorClass::parse(v).ok_or_else(|| {
                        Error::Config(format!(
                        "`{k}={v}`: use transient, capacity, quota, invalid-spec or credentials"
                    ))
                    })?
                }
                "dummy-failure-rate" => {
                    for item in list(v) {
                        let (class, r) = item.split_once(':').ok_or_else(|| {
                            Error::Config(format!(
                                "`{k}={v}`: use CLASS:RATE pairs, e.g. `transient:0.1`"
                            ))
                        })?;
                        let class = ErrorClass::parse(class).ok_or_else(|| {
                            Error::Config(format!("`{k}`: unknown error class `{class}`"))
                        })?;
                        c.failure_rates.push((class, rate(k, r)?));
                    }
                }
                "dummy-lost-response-rate" => c.lost_response_rate = rate(k, v)?,
                "dummy-throttling" => {
                    c.ec2_throttling = match v.as_str() {
                        "ec2" => true,
                        "none" => false,
                        _ => return Err(Error::Config(format!("`{k}={v}`: use `ec2` or `none`"))),
                    }
                }
                "dummy-instance-bucket" => c.instance_bucket = Some(bucket(k, v)?),
                "dummy-request-bucket" => c.request_bucket = Some(bucket(k, v)?),
                "dummy-listing-delay" => c.listing_delay = dur(k, v)?,
                "dummy-max-instances" => {
                    c.max_instances = Some(
                        v.parse()
                            .map_err(|_| Error::Config(format!("`{k}={v}`: use a whole number")))?,
                    )
                }
                "dummy-unreachable" => {
                    c.unreachable = match v.as_str() {
                        "true" => true,
                        "false" => false,
                        _ => {
                            return Err(Error::Config(format!("`{k}={v}`: use `true` or `false`")))
                        }
                    }
                }
                "dummy-seed" => {
                    c.seed = v
                        .parse()
                        .map_err(|_| Error::Config(format!("`{k}={v}`: use a whole number")))?
                }
                // Read by the controller, not the cloud: how the agents of
                // the dummy's machines run (`in-process` or `process`).
                "dummy-agents" => {}
                k if k.starts_with("dummy-") => {
                    return Err(Error::Config(format!(
                        "unknown dummy provider key `{k}`; README.md lists the keys"
                    )))
                }
                _ => {}
            }
        }
        Ok(c)
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum LogEntry {
    Start(Instance),
    Stop(String),
}

/// An instance as the dummy keeps it: 100,000 of them live in the
/// controller's process. Its id is the map's key (shared with the nonce
/// index); zone and hardware, alike for many instances, are shared too.
#[derive(Debug, Clone)]
struct Entry {
    zone: Option<Arc<str>>,
    hardware: Arc<str>,
    tags: crate::Tags,
    /// When listings start (or stop) showing it: the eventual consistency.
    listed_from: Instant,
    listed_until: Option<Instant>,
}

impl Entry {
    fn instance(&self, id: &str) -> Instance {
        Instance {
            id: id.to_string(),
            zone: self.zone.clone(),
            hardware: self.hardware.clone(),
            tags: self.tags.clone(),
        }
    }

    /// Stopped: it leaves listings at `listed_until`.
    fn stopped(&self) -> bool {
        self.listed_until.is_some()
    }

    fn owned_by(&self, env_uuid: &str) -> bool {
        self.tags.get(crate::TAG_ENV_UUID) == Some(env_uuid)
    }
}

struct State {
    cfg: Config,
    instances: BTreeMap<Arc<str>, Entry>,
    /// Instances by the nonce they were started with, by the nonce's hash
    /// (the instance's tags hold the nonce itself: a copy of each was a
    /// fifth of what the dummy keeps per instance); a nonce whose hash is
    /// taken by another is kept in `nonce_collisions`.
    by_nonce: HashMap<u64, Arc<str>>,
    nonce_collisions: HashMap<Box<str>, Arc<str>>,
    /// Zones and hardware descriptions, one copy each.
    interned: HashSet<Arc<str>>,
    log_offset: u64,
    partial: Vec<u8>,
    buckets: Buckets,
    /// In EC2 mode, the EC2 provider's client-side launch pacing.
    pacer: Option<std::sync::Arc<LaunchPacer>>,
    stats: ApiStats,
    rng: u64,
}

/// The dummy's API buckets, one per EC2 API it stands for (`None`:
/// unlimited).
#[derive(Debug, Default)]
struct Buckets {
    run: Option<TokenBucket>,
    run_resource: Option<TokenBucket>,
    describe: Option<TokenBucket>,
    create_tags: Option<TokenBucket>,
    terminate: Option<TokenBucket>,
    terminate_resource: Option<TokenBucket>,
}

impl Buckets {
    fn of(cfg: &Config) -> Buckets {
        let ec2 =
            |(burst, rate): (u32, f64)| cfg.ec2_throttling.then(|| TokenBucket::new(burst, rate));
        Buckets {
            run: cfg
                .request_bucket
                .as_deref()
                .and_then(TokenBucket::parse)
                .or_else(|| ec2(ec2_limits::RUN_INSTANCES)),
            run_resource: cfg
                .instance_bucket
                .as_deref()
                .and_then(TokenBucket::parse)
                .or_else(|| ec2(ec2_limits::RUN_INSTANCES_RESOURCE)),
            describe: ec2(ec2_limits::DESCRIBE_INSTANCES),
            create_tags: ec2(ec2_limits::CREATE_TAGS),
            terminate: ec2(ec2_limits::TERMINATE_INSTANCES),
            terminate_resource: ec2(ec2_limits::TERMINATE_INSTANCES_RESOURCE),
        }
    }
}

/// Takes `n` tokens from an optional bucket; `false` when it is throttled.
fn charge(bucket: &mut Option<TokenBucket>, n: u32) -> bool {
    bucket.as_mut().is_none_or(|b| b.try_take(n))
}

/// The calls the dummy was charged for, as EC2 API calls, and the
/// throttling errors it answered.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ApiStats {
    pub run_instances: u64,
    pub describe_instances: u64,
    pub create_tags: u64,
    pub terminate_instances: u64,
    /// `RequestLimitExceeded` answers, of every API.
    pub throttled: u64,
    /// When the last per-machine CreateTags will have been made, paced as
    /// the EC2 provider paces them.
    pub tags_done_at: Option<Instant>,
}

fn throttled(api: &str) -> Error {
    Error::Transient(format!("RequestLimitExceeded: {api} request rate exceeded"))
}

impl State {
    fn apply(&mut self, e: LogEntry, now: Instant, delay: Duration) {
        match e {
            LogEntry::Start(inst) => {
                let id: Arc<str> = inst.id.into();
                if let Some(n) = inst.tags.get(crate::TAG_NONCE) {
                    match self.by_nonce.entry(nonce_hash(n)) {
                        std::collections::hash_map::Entry::Vacant(v) => {
                            v.insert(id.clone());
                        }
                        std::collections::hash_map::Entry::Occupied(mut o) => {
                            let same = self
                                .instances
                                .get(o.get())
                                .is_none_or(|e| e.tags.get(crate::TAG_NONCE) == Some(n));
                            if same {
                                o.insert(id.clone());
                            } else {
                                self.nonce_collisions.insert(n.into(), id.clone());
                            }
                        }
                    }
                }
                let zone = inst.zone.as_deref().map(|z| self.intern(z));
                let hardware = self.intern(&inst.hardware);
                self.instances.insert(
                    id,
                    Entry {
                        zone,
                        hardware,
                        tags: inst.tags,
                        listed_from: now + delay,
                        listed_until: None,
                    },
                );
            }
            LogEntry::Stop(id) => {
                if let Some(e) = self.instances.get_mut(id.as_str()) {
                    if !e.stopped() {
                        e.listed_until = Some(now + delay);
                    }
                }
            }
        }
    }

    /// The instance last started with `nonce`.
    fn by_nonce(&self, nonce: &str) -> Option<(&Arc<str>, &Entry)> {
        let found = |id: &Arc<str>| {
            self.instances
                .get_key_value(id)
                .filter(|(_, e)| e.tags.get(crate::TAG_NONCE) == Some(nonce))
        };
        self.by_nonce
            .get(&nonce_hash(nonce))
            .and_then(found)
            .or_else(|| self.nonce_collisions.get(nonce).and_then(found))
    }

    fn intern(&mut self, s: &str) -> Arc<str> {
        if let Some(i) = self.interned.get(s) {
            return i.clone();
        }
        let i: Arc<str> = s.into();
        self.interned.insert(i.clone());
        i
    }

    /// xorshift64*: deterministic per seed, good enough for fault injection.
    fn random(&mut self) -> f64 {
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn live(&self) -> usize {
        self.instances.values().filter(|e| !e.stopped()).count()
    }
}

pub struct DummyProvider {
    env_name: String,
    env_uuid: String,
    dir: Option<PathBuf>,
    state: Mutex<State>,
}

fn storage(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Storage {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

impl DummyProvider {
    /// A dummy cloud persisted in `dir` (the environment's data directory).
    pub fn open(
        dir: impl Into<PathBuf>,
        env_name: &str,
        env_uuid: &str,
        config: &BTreeMap<String, String>,
    ) -> Result<DummyProvider> {
        let p = DummyProvider::build(Some(dir.into()), env_name, env_uuid, config)?;
        p.with_log(|_| Ok(((), vec![])))?;
        Ok(p)
    }

    /// A dummy instance's disk is the machine's directory under the
    /// environment's `agents/`: its agent's `agent.conf` goes there (mode
    /// 0600, renamed into place), where `dummy-agents=process` runs `jujube
    /// agent` on it. Nothing to do for a cloud in memory.
    fn install_agent(&self, machine: &str, agent: &crate::AgentInstall) -> std::io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        let dir = dir.join("agents").join(format!("machine-{machine}"));
        std::fs::create_dir_all(&dir)?;
        let tmp = dir.join("agent.conf.tmp");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&agent.conf)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join("agent.conf"))
    }

    /// A dummy cloud in memory only.
    pub fn in_memory(
        env_name: &str,
        env_uuid: &str,
        config: &BTreeMap<String, String>,
    ) -> Result<DummyProvider> {
        DummyProvider::build(None, env_name, env_uuid, config)
    }

    fn build(
        dir: Option<PathBuf>,
        env_name: &str,
        env_uuid: &str,
        config: &BTreeMap<String, String>,
    ) -> Result<DummyProvider> {
        let cfg = Config::parse(config)?;
        let state = State {
            buckets: Buckets::of(&cfg),
            pacer: cfg
                .ec2_throttling
                .then(|| std::sync::Arc::new(LaunchPacer::ec2())),
            stats: ApiStats::default(),
            rng: cfg.seed.max(1),
            cfg,
            instances: BTreeMap::new(),
            by_nonce: HashMap::new(),
            nonce_collisions: HashMap::new(),
            interned: HashSet::new(),
            log_offset: 0,
            partial: Vec::new(),
        };
        Ok(DummyProvider {
            env_name: env_name.to_string(),
            env_uuid: env_uuid.to_string(),
            dir,
            state: Mutex::new(state),
        })
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` with the cloud up to date; whatever log entries `f` returns
    /// are appended (under the file lock, when persistent) and applied.
    fn with_log<T>(&self, f: impl FnOnce(&mut State) -> Result<(T, Vec<LogEntry>)>) -> Result<T> {
        let mut st = self.lock_state();
        let now = Instant::now();
        let Some(dir) = &self.dir else {
            let (v, entries) = f(&mut st)?;
            let delay = st.cfg.listing_delay;
            for e in entries {
                st.apply(e, now, delay);
            }
            return Ok(v);
        };
        std::fs::create_dir_all(dir).map_err(|e| storage(dir, e))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| storage(&lock_path, e))?;
        lock.lock().map_err(|e| storage(&lock_path, e))?;
        let log_path = dir.join(LOG_FILE);
        let mut log = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| storage(&log_path, e))?;
        // Replay what other processes appended since we last looked. Their
        // entries are visible at once: the delay models our own API's lag.
        log.seek(SeekFrom::Start(st.log_offset))
            .map_err(|e| storage(&log_path, e))?;
        let mut buf = Vec::new();
        log.read_to_end(&mut buf)
            .map_err(|e| storage(&log_path, e))?;
        st.log_offset += buf.len() as u64;
        let mut pending = std::mem::take(&mut st.partial);
        pending.extend_from_slice(&buf);
        let complete = pending
            .iter()
            .rposition(|b| *b == b'\n')
            .map_or(0, |i| i + 1);
        st.partial = pending[complete..].to_vec();
        for line in pending[..complete]
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
        {
            if let Ok(e) = serde_json::from_slice::<LogEntry>(line) {
                st.apply(e, now, Duration::ZERO);
            }
        }
        let result = f(&mut st);
        let out = match result {
            Ok((v, entries)) => {
                if !entries.is_empty() {
                    // A partial line left by a killed process must not swallow ours.
                    let mut text = if st.partial.is_empty() {
                        String::new()
                    } else {
                        "\n".to_string()
                    };
                    st.partial.clear();
                    for e in &entries {
                        text.push_str(&serde_json::to_string(e).expect("log entry serialises"));
                        text.push('\n');
                    }
                    log.write_all(text.as_bytes())
                        .map_err(|e| storage(&log_path, e))?;
                    st.log_offset += text.len() as u64;
                    let delay = st.cfg.listing_delay;
                    for e in entries {
                        st.apply(e, now, delay);
                    }
                }
                Ok(v)
            }
            Err(e) => Err(e),
        };
        let _ = lock.unlock();
        out
    }

    fn new_instance(
        &self,
        spec_tags: BTreeMap<String, String>,
        zone: Option<String>,
        hardware: String,
    ) -> Instance {
        Instance {
            id: format!("i-{}", &uuid::Uuid::new_v4().simple().to_string()[..17]),
            zone: zone.map(Into::into),
            hardware: hardware.into(),
            tags: spec_tags.into(),
        }
    }

    /// Starts an instance with arbitrary tags, as someone working behind
    /// jujube's back would. Returns its id.
    pub fn start_raw(&self, tags: BTreeMap<String, String>) -> Result<String> {
        let hw = choose_type(&Constraints::new())?.to_string();
        let inst = self.new_instance(tags, Some("zone-a".to_string()), hw);
        let id = inst.id.clone();
        self.with_log(|_| Ok(((), vec![LogEntry::Start(inst)])))?;
        Ok(id)
    }

    /// Stops instances whoever owns them, as someone working behind
    /// jujube's back would. Refuses ids of no live instance, stopping none.
    pub fn stop_raw(&self, ids: &[String]) -> Result<()> {
        self.with_log(|st| {
            let unknown: Vec<String> = ids
                .iter()
                .filter(|id| st.instances.get(id.as_str()).is_none_or(|e| e.stopped()))
                .map(|id| format!("`{id}`"))
                .collect();
            if !unknown.is_empty() {
                return Err(Error::NotFound(format!(
                    "no live instance {} in the dummy cloud; `jujube dummy-cloud list` shows them",
                    unknown.join(", ")
                )));
            }
            Ok((
                (),
                ids.iter().map(|id| LogEntry::Stop(id.clone())).collect(),
            ))
        })
    }

    /// The injected "cannot be reached" failure, if configured.
    fn unreachable(&self) -> Result<()> {
        if self.lock_state().cfg.unreachable {
            return Err(Error::Transient(
                "the dummy cloud cannot be reached (`dummy-unreachable`)".into(),
            ));
        }
        Ok(())
    }

    /// The API calls charged so far and the throttling errors answered.
    pub fn api_stats(&self) -> ApiStats {
        self.lock_state().stats.clone()
    }

    /// Every live instance in the cloud, whoever owns it (for operators and
    /// tests; [`Provider::instances`] lists only this environment's).
    pub fn all_instances(&self) -> Result<Vec<Instance>> {
        self.with_log(|st| {
            Ok((
                st.instances
                    .iter()
                    .filter(|(_, e)| !e.stopped())
                    .map(|(id, e)| e.instance(id))
                    .collect(),
                vec![],
            ))
        })
    }

    fn injected(st: &mut State, spec: &StartSpec, zone: &str) -> Option<Error> {
        if st.cfg.fail_machines.contains(&spec.machine_id) {
            return Some(error_of(
                st.cfg.fail_class,
                &format!(
                    "machine {} is configured to fail (`dummy-fail-machines`)",
                    spec.machine_id
                ),
                zone,
            ));
        }
        if st.cfg.full_zones.iter().any(|z| z == zone) {
            return Some(error_of(
                ErrorClass::Capacity,
                "InsufficientInstanceCapacity",
                zone,
            ));
        }
        if let Some(max) = st.cfg.max_instances {
            if st.live() >= max {
                return Some(Error::Quota(format!(
                    "the dummy cloud allows {max} instances (`dummy-max-instances`)"
                )));
            }
        }
        let rates = st.cfg.failure_rates.clone();
        for (class, r) in rates {
            if st.random() < r {
                return Some(error_of(
                    class,
                    "injected failure (`dummy-failure-rate`)",
                    zone,
                ));
            }
        }
        None
    }
}

impl DummyProvider {
    /// One launch as the EC2 provider makes it: the look-up, the client-side
    /// pacing (in EC2 mode), then one request for what was not found.
    async fn start_group(
        &self,
        batch: bool,
        specs: &[&StartSpec],
    ) -> Result<Vec<Result<Instance>>> {
        let count = self.with_log(|st| {
            st.stats.describe_instances += 1;
            if !charge(&mut st.buckets.describe, 1) {
                st.stats.throttled += 1;
                return Err(throttled("DescribeInstances"));
            }
            Ok((launch_count(st, batch, specs), vec![]))
        })?;
        let pacer = self.lock_state().pacer.clone();
        if let (Some(p), true) = (pacer, count > 0) {
            p.pace(count).await;
        }
        self.with_log(|st| Ok(self.launch(st, batch, specs)))
    }

    /// RunInstances for one machine with no look-up and no pacing, as a
    /// client that relies on retries alone would call it (the Juju-style
    /// baseline of the provisioning benchmark).
    pub async fn run_instance(&self, spec: &StartSpec) -> Result<Instance> {
        let latency = self.lock_state().cfg.latency;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        self.with_log(|st| {
            let (mut out, log) = self.launch(st, false, &[spec]);
            Ok((out.pop().expect("one result"), log))
        })?
    }

    /// One RunInstances for the members not found (see [`launch_count`]).
    /// Returns the results and the log entries to append.
    fn launch(
        &self,
        st: &mut State,
        batch: bool,
        specs: &[&StartSpec],
    ) -> (Vec<Result<Instance>>, Vec<LogEntry>) {
        // Idempotency first: a known nonce gets its instance back.
        let existing: Vec<Option<Instance>> = specs
            .iter()
            .map(|s| {
                st.by_nonce(&s.nonce)
                    .filter(|(_, e)| !e.stopped())
                    .map(|(id, e)| e.instance(id))
            })
            .collect();
        let count = launch_count(st, batch, specs);
        if count > 0 {
            st.stats.run_instances += 1;
            if !charge(&mut st.buckets.run, 1) || !charge(&mut st.buckets.run_resource, count) {
                st.stats.throttled += 1;
                let e = throttled("RunInstances");
                return (
                    existing
                        .into_iter()
                        .map(|x| x.ok_or_else(|| e.clone()))
                        .collect(),
                    vec![],
                );
            }
        }
        let mut out = Vec::with_capacity(specs.len());
        let mut log = Vec::new();
        let mut started: HashMap<&str, Instance> = HashMap::new();
        for (spec, found) in specs.iter().zip(existing) {
            if let Some(i) = found {
                out.push(Ok(i));
                continue;
            }
            if let Some(i) = started.get(spec.nonce.as_str()) {
                out.push(Ok(i.clone()));
                continue;
            }
            let zone = spec.zone.clone().unwrap_or_else(|| st.cfg.zones[0].clone());
            if !st.cfg.zones.contains(&zone) {
                out.push(Err(Error::InvalidSpec(format!(
                    "unknown zone `{zone}`; zones are {}",
                    st.cfg.zones.join(", ")
                ))));
                continue;
            }
            let hw = match choose_type(&spec.constraints) {
                Ok(hw) => hw,
                Err(e) => {
                    out.push(Err(e));
                    continue;
                }
            };
            if let Some(e) = DummyProvider::injected(st, spec, &zone) {
                out.push(Err(e));
                continue;
            }
            let inst = self.new_instance(
                spec.tags(&self.env_name, &self.env_uuid),
                Some(zone),
                hw.to_string(),
            );
            let lost = st.random() < st.cfg.lost_response_rate;
            started.insert(spec.nonce.as_str(), inst.clone());
            log.push(LogEntry::Start(inst.clone()));
            out.push(if lost {
                Err(Error::Transient(
                    "lost response: the request timed out".into(),
                ))
            } else {
                Ok(inst)
            });
        }
        if batch && !started.is_empty() {
            // The per-machine tags: one CreateTags each, paced in the
            // background at the bucket's rate, as the EC2 provider does.
            let n = started.len() as u32;
            st.stats.create_tags += n as u64;
            let done = Instant::now()
                + st.buckets
                    .create_tags
                    .as_mut()
                    .map_or(Duration::ZERO, |b| b.reserve(n));
            st.stats.tags_done_at = Some(st.stats.tags_done_at.map_or(done, |t| t.max(done)));
        }
        (out, log)
    }
}

fn nonce_hash(nonce: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    nonce.hash(&mut h);
    h.finish()
}

/// How many instances the launch of `specs` asks for: none when all exist;
/// as EC2, a batch launches its size (up to its highest launch index) in one
/// request, all or nothing.
fn launch_count(st: &State, batch: bool, specs: &[&StartSpec]) -> u32 {
    let missing = specs
        .iter()
        .filter(|s| st.by_nonce(&s.nonce).is_none_or(|(_, e)| e.stopped()))
        .count();
    if batch && missing == specs.len() {
        specs
            .iter()
            .filter_map(|s| launch_batch(&s.nonce))
            .map(|(_, k)| k + 1)
            .max()
            .unwrap_or(1)
    } else {
        missing as u32
    }
}

fn error_of(class: ErrorClass, msg: &str, zone: &str) -> Error {
    match class {
        ErrorClass::Transient => Error::Transient(msg.to_string()),
        ErrorClass::Capacity => Error::Capacity {
            zone: zone.to_string(),
            message: msg.to_string(),
        },
        ErrorClass::Quota => Error::Quota(msg.to_string()),
        ErrorClass::InvalidSpec => Error::InvalidSpec(msg.to_string()),
        ErrorClass::Credentials => Error::Credentials(msg.to_string()),
        ErrorClass::NotFound => Error::NotFound(msg.to_string()),
    }
}

#[async_trait]
impl Provider for DummyProvider {
    fn kind(&self) -> &'static str {
        "dummy"
    }

    async fn start_instance(&self, spec: &StartSpec) -> Result<Instance> {
        self.start_instances(std::slice::from_ref(spec))
            .await
            .pop()
            .expect("one result per spec")
    }

    /// One launch per launch batch (or plain nonce), charged as the EC2
    /// provider's calls are (see the module docs).
    async fn start_instances(&self, specs: &[StartSpec]) -> Vec<Result<Instance>> {
        if let Err(e) = self.unreachable() {
            return specs.iter().map(|_| Err(e.clone())).collect();
        }
        let latency = self.lock_state().cfg.latency;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        let mut groups: Vec<(Option<&str>, Vec<usize>)> = Vec::new();
        for (i, s) in specs.iter().enumerate() {
            match launch_batch(&s.nonce) {
                Some((b, _)) => match groups.iter_mut().find(|(id, _)| *id == Some(b)) {
                    Some((_, members)) => members.push(i),
                    None => groups.push((Some(b), vec![i])),
                },
                None => groups.push((None, vec![i])),
            }
        }
        let mut out: Vec<Option<Result<Instance>>> = specs.iter().map(|_| None).collect();
        for (batch, members) in groups {
            let group: Vec<&StartSpec> = members.iter().map(|&i| &specs[i]).collect();
            let results = match self.start_group(batch.is_some(), &group).await {
                Ok(v) => v,
                Err(e) => group.iter().map(|_| Err(e.clone())).collect(),
            };
            for (i, r) in members.into_iter().zip(results) {
                out[i] = Some(r);
            }
        }
        for (spec, r) in specs.iter().zip(&out) {
            if let (Some(Ok(_)), Some(agent)) = (r, &spec.agent) {
                if let Err(e) = self.install_agent(&spec.machine_id, agent) {
                    warn!(machine = %spec.machine_id, error = %e, "cannot install the machine's agent");
                }
            }
        }
        out.into_iter()
            .map(|r| r.expect("every spec has a result"))
            .collect()
    }

    async fn stop_instances(&self, ids: &[String]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        self.unreachable()?;
        let uuid = self.env_uuid.clone();
        self.with_log(|st| {
            // The ownership look-up, then the termination.
            st.stats.describe_instances += 1;
            st.stats.terminate_instances += 1;
            if !charge(&mut st.buckets.describe, 1) {
                st.stats.throttled += 1;
                return Err(throttled("DescribeInstances"));
            }
            if !charge(&mut st.buckets.terminate, 1)
                || !charge(&mut st.buckets.terminate_resource, ids.len() as u32)
            {
                st.stats.throttled += 1;
                return Err(throttled("TerminateInstances"));
            }
            let log = ids
                .iter()
                .filter(|id| {
                    st.instances
                        .get(id.as_str())
                        .is_some_and(|e| !e.stopped() && e.owned_by(&uuid))
                })
                .map(|id| LogEntry::Stop(id.clone()))
                .collect();
            Ok(((), log))
        })
    }

    async fn instances(&self) -> Result<Vec<Instance>> {
        self.unreachable()?;
        let uuid = self.env_uuid.clone();
        self.with_log(|st| {
            st.stats.describe_instances += 1;
            if !charge(&mut st.buckets.describe, 1) {
                st.stats.throttled += 1;
                return Err(throttled("DescribeInstances"));
            }
            let now = Instant::now();
            let shown = |e: &Entry| {
                e.owned_by(&uuid) && e.listed_from <= now && e.listed_until.is_none_or(|u| now < u)
            };
            // Counted first: a growing vector of 100,000 held its old and
            // new buffers at once, twice the listing.
            let mut listed = Vec::with_capacity(st.instances.values().filter(|e| shown(e)).count());
            listed.extend(
                st.instances
                    .iter()
                    .filter(|(_, e)| shown(e))
                    .map(|(id, e)| e.instance(id)),
            );
            Ok((listed, vec![]))
        })
    }

    async fn instances_by_id(&self, ids: &[String]) -> Result<Vec<Instance>> {
        self.unreachable()?;
        let uuid = self.env_uuid.clone();
        self.with_log(|st| {
            Ok((
                ids.iter()
                    .filter_map(|id| st.instances.get_key_value(id.as_str()))
                    .filter(|(_, e)| !e.stopped() && e.owned_by(&uuid))
                    .map(|(id, e)| e.instance(id))
                    .collect(),
                vec![],
            ))
        })
    }

    async fn zones(&self) -> Result<Vec<String>> {
        self.unreachable()?;
        Ok(self.lock_state().cfg.zones.clone())
    }

    async fn validate_constraints(&self, cons: &Constraints) -> Result<()> {
        choose_type(cons).map(|_| ())
    }

    async fn update_config(&self, config: &BTreeMap<String, String>) -> Result<()> {
        let cfg = Config::parse(config)?;
        let mut st = self.lock_state();
        if (
            &cfg.instance_bucket,
            &cfg.request_bucket,
            cfg.ec2_throttling,
        ) != (
            &st.cfg.instance_bucket,
            &st.cfg.request_bucket,
            st.cfg.ec2_throttling,
        ) {
            st.buckets = Buckets::of(&cfg);
            st.pacer = cfg
                .ec2_throttling
                .then(|| std::sync::Arc::new(LaunchPacer::ec2()));
        }
        if cfg.seed != st.cfg.seed {
            st.rng = cfg.seed.max(1);
        }
        st.cfg = cfg;
        Ok(())
    }
}

/// Checks dummy config keys without building a provider.
pub fn validate_config(config: &BTreeMap<String, String>) -> Result<()> {
    Config::parse(config).map(|_| ())
}
