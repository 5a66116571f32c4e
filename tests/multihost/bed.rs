//! The test bed: network namespaces as hosts on one machine, joined by a bridge.
//!
//! ```text
//!   hub namespace (the test's driver node, its proxy)     host namespaces (ferry serve)
//!   br0 198.18.0.254/24 ── p0 ═══ veth ═══ eth0 198.18.0.1   (host 0)
//!                       ── p1 ═══ veth ═══ eth0 198.18.0.2   (host 1)
//!                       ── p2 ═══ veth ═══ eth0 198.18.0.3   (host 2)
//!                       ── ...
//! ```
//!
//! Every interface is made inside the bed's own namespaces (never in the machine's), so beds
//! of parallel tests all use 198.18.0.0/24 without clashing; namespace names carry the test
//! process's id and a counter. Dropping the bed deletes its namespaces, which deletes their
//! links; a bed also deletes the namespaces left by a test process that no longer runs.

use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::common::{Scratch, Served, ferry_bin};

/// Namespaces of this test suite start with this, then the test process id and `x`.
const PREFIX: &str = "fmh";
/// The hub's address on the bridge, where the driver node and the proxy live.
pub const HUB_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 254);
/// The port every `ferry serve` of the bed listens on (each host has its own ports).
pub const NODE_PORT: u16 = 7070;
/// The port of every `ferry serve`'s metrics endpoint.
pub const METRICS_PORT: u16 = 9464;

/// Setting this to `1` makes a machine that cannot build the bed fail the tests instead of
/// skipping them (CI sets it).
const REQUIRE: &str = "FERRY_NETNS_TESTS";

/// One "host": a network namespace with one address on the bed's bridge.
pub struct Host {
    /// The namespace's name.
    pub ns: String,
    /// Its address.
    pub addr: Ipv4Addr,
    /// The bridge port (in the hub) that leads to it.
    port: String,
}

impl Host {
    /// `IP:port` of the `ferry serve` listening on `port` here.
    pub fn endpoint(&self, port: u16) -> String {
        format!("{}:{port}", self.addr)
    }
}

/// A bed of namespaces, removed when dropped (panics included).
pub struct Bed {
    /// Unique per bed: names the namespaces and seeds the host identities.
    pub tag: String,
    /// The hub namespace: the bridge, the driver and the proxy.
    pub hub: String,
    /// The hosts, in order: addresses 198.18.0.1, .2, ...
    pub hosts: Vec<Host>,
    /// Secret and configuration files.
    pub scratch: Scratch,
    /// Every namespace made so far, deleted on drop.
    made: Vec<String>,
    /// `setpriv`, to give served processes a parent-death signal, where it exists.
    setpriv: bool,
}

impl Bed {
    /// A bed with `hosts` hosts, or `None` (after saying why) where namespaces cannot be made
    /// and `FERRY_NETNS_TESTS=1` is not set.
    pub fn new(hosts: usize) -> Option<Self> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        if let Err(why) = can_make_namespaces() {
            if std::env::var(REQUIRE).is_ok_and(|v| v == "1") {
                panic!("{REQUIRE}=1 but the namespace test bed cannot be made: {why}");
            }
            eprintln!("skipped: the namespace test bed cannot be made here: {why}");
            return None;
        }
        remove_leftovers();
        let tag = format!(
            "{PREFIX}{}x{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut bed = Self {
            hub: format!("{tag}-hub"),
            tag,
            hosts: Vec::new(),
            scratch: Scratch::new(),
            made: Vec::new(),
            setpriv: Command::new("setpriv")
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success()),
        };
        let hub = bed.hub.clone();
        bed.add_namespace(&hub);
        ip(&["-n", &hub, "link", "set", "lo", "up"]);
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"]);
        ip(&[
            "-n",
            &hub,
            "addr",
            "add",
            &format!("{HUB_ADDR}/24"),
            "dev",
            "br0",
        ]);
        ip(&["-n", &hub, "link", "set", "br0", "up"]);
        for i in 0..hosts {
            let ns = format!("{}-h{i}", bed.tag);
            let port = format!("p{i}");
            let addr = Ipv4Addr::new(198, 18, 0, 1 + i as u8);
            bed.add_namespace(&ns);
            ip(&[
                "-n", &hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
                &ns,
            ]);
            ip(&["-n", &hub, "link", "set", &port, "master", "br0", "up"]);
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            bed.hosts.push(Host { ns, addr, port });
        }
        Some(bed)
    }

    fn add_namespace(&mut self, name: &str) {
        ip(&["netns", "add", name]);
        self.made.push(name.to_string());
    }

    /// The host identity of host `i` (distinct per host and per bed).
    pub fn host_id(&self, i: usize) -> String {
        format!("{}-host{i}", self.tag)
    }

    /// Cuts host `i` off: its bridge port goes down, so nothing reaches it or leaves it,
    /// and neither end is told (no reset, no error: packets vanish).
    pub fn partition(&self, i: usize) {
        ip(&["-n", &self.hub, "link", "set", &self.hosts[i].port, "down"]);
    }

    /// Undoes [`Self::partition`].
    pub fn heal(&self, i: usize) {
        ip(&["-n", &self.hub, "link", "set", &self.hosts[i].port, "up"]);
    }

    /// Writes host `i`'s `/etc/hosts`: `ip netns exec` bind-mounts `/etc/netns/NS/hosts`
    /// over `/etc/hosts` for the command it starts, but only if that file exists when the
    /// command starts, so write it before [`Self::serve`]. Later writes rewrite the same file
    /// in place (the same inode, which the mount shows), so a running process's next lookup
    /// reads them: the system resolver (glibc's `getaddrinfo`, "files" first in
    /// nsswitch.conf) reads `/etc/hosts` anew on every lookup, and gives every line that
    /// names a host, like several A records of one DNS name. The directory is removed with
    /// the bed.
    pub fn write_hosts(&self, i: usize, text: &str) {
        let dir = netns_etc(&self.hosts[i].ns);
        std::fs::create_dir_all(&dir).expect("create /etc/netns/NS");
        std::fs::write(dir.join("hosts"), text).expect("write /etc/netns/NS/hosts");
    }

    /// The process ids in host `i`'s namespace.
    pub fn pids(&self, i: usize) -> Vec<u32> {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.hosts[i].ns])
            .output()
            .expect("run ip netns pids");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// The configuration of a `ferry serve` named `name` on host `i`, listening on `port`
    /// (metrics on `port + 2394`, so that 7070 gives 9464), with host identity `host_id`,
    /// the given peers, and `extra` TOML after the `[node]` table. Written to a file.
    pub fn serve_config(
        &self,
        i: usize,
        name: &str,
        port: u16,
        host_id: &str,
        peers: &[(&str, String)],
        extra: &str,
    ) -> PathBuf {
        let host = &self.hosts[i];
        let mut text = format!(
            "[node]\nname = \"{name}\"\nlisten = [\"{}\"]\nhost_id = \"{host_id}\"\n\n\
             [security]\nsecret_file = \"{}\"\n\n\
             [telemetry]\nmetrics_listen = \"{}\"\n\n{extra}\n",
            host.endpoint(port),
            self.scratch.secret.display(),
            host.endpoint(port + (METRICS_PORT - NODE_PORT)),
        );
        for (peer, address) in peers {
            let _ = write!(
                text,
                "[[peers]]\nname = \"{peer}\"\naddress = \"{address}\"\n\n"
            );
        }
        self.scratch.write(&format!("{name}.toml"), &text)
    }

    /// Starts `ferry serve --config CONFIG --role ROLE` inside host `i`'s namespace (`ip
    /// netns exec`) and waits for its ready line. The process is killed when the result is
    /// dropped, and (through `setpriv --pdeathsig`, where it exists) when this test process
    /// dies, so a killed test run leaves no node behind.
    pub fn serve(&self, i: usize, config: &Path, role: &str) -> Served {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.hosts[i].ns]);
        if self.setpriv {
            command.args(["setpriv", "--pdeathsig", "KILL"]);
        }
        command
            .arg(ferry_bin())
            .args(["serve", "--config"])
            .arg(config)
            .args(["--role", role]);
        Served::spawn(command)
    }

    /// Runs `ferry explain --config CONFIG --peer PEER --bytes 1M --memory host --json`
    /// inside host `i`'s namespace and returns its JSON report.
    pub fn explain(&self, i: usize, config: &Path, peer: &str) -> serde_json::Value {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.hosts[i].ns])
            .arg(ferry_bin())
            .args(["explain", "--config"])
            .arg(config)
            .args([
                "--peer", peer, "--bytes", "1M", "--memory", "host", "--json",
            ])
            .env("RUST_LOG", "warn");
        let out = command.output().expect("run ferry explain");
        assert!(
            out.status.success(),
            "ferry explain failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("ferry explain prints JSON")
    }

    /// Runs `body` on a thread of its own inside the hub namespace (the test's thread stays
    /// where it was), and returns what it returns; a panic in it is this call's panic.
    /// Threads `body` starts (a tokio runtime's, a node's) are in the hub too, and so are
    /// the sockets they make.
    pub fn in_hub<T: Send>(&self, body: impl FnOnce() -> T + Send) -> T {
        let path = format!("/run/netns/{}", self.hub);
        std::thread::scope(|scope| {
            let thread = std::thread::Builder::new()
                .name("hub".into())
                .spawn_scoped(scope, move || {
                    let ns = std::fs::File::open(&path).expect("open the hub namespace");
                    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                        .expect("enter the hub namespace");
                    body()
                })
                .expect("start the hub thread");
            match thread.join() {
                Ok(value) => value,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        for name in self.made.iter().rev() {
            let _ = Command::new("ip")
                .args(["netns", "del", name])
                .stderr(Stdio::null())
                .status();
            let _ = std::fs::remove_dir_all(netns_etc(name));
        }
    }
}

/// `/etc/netns/NAME`: files `ip netns exec NAME` bind-mounts over `/etc` (see
/// [`Bed::write_hosts`]).
fn netns_etc(name: &str) -> PathBuf {
    Path::new("/etc/netns").join(name)
}

/// Whether this process may make namespaces: root, and `ip` at hand that can. Tried once
/// per test process.
fn can_make_namespaces() -> Result<(), String> {
    static ANSWER: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    ANSWER.get_or_init(try_a_namespace).clone()
}

fn try_a_namespace() -> Result<(), String> {
    if !rustix::process::geteuid().is_root() {
        return Err("not root (network namespaces need CAP_SYS_ADMIN)".into());
    }
    let probe = format!("{PREFIX}{}probe", std::process::id());
    let made = Command::new("ip")
        .args(["netns", "add", &probe])
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if !made.status.success() {
        return Err(format!(
            "ip netns add failed: {}",
            String::from_utf8_lossy(&made.stderr).trim()
        ));
    }
    let _ = Command::new("ip").args(["netns", "del", &probe]).status();
    Ok(())
}

/// Deletes the namespaces of this suite whose test process is gone (a run that was killed).
fn remove_leftovers() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split(['x', 'p']).next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip")
                .args(["netns", "del", name])
                .stderr(Stdio::null())
                .status();
            let _ = std::fs::remove_dir_all(netns_etc(name));
        }
    }
}

/// Runs `ip ARGS`, panicking with its error output if it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .stderr(Stdio::piped())
        .output()
        .expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}
