//! Two nodes set up for one combination: the node under test in this process, and a far
//! node (a `ferry serve` child process, or a second node of this process for the
//! same-process locality) that echoes or never receives. Both route every transfer over the
//! combination's transport and direction by a `[[transport.rules]]` rule.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry::{Layout, MemoryClass, MemoryKind, Node, Received};
use ferry_config::{Locality, TransportName};

use crate::combos::Combo;
use crate::common::{Scratch, Served, metric};

/// What the far node does with what it receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Sends every buffer back, under its tag, in the order it came.
    Echo,
    /// Never receives: what lands stays in its inbox, holding its memory.
    Victim,
}

/// A check's additions to the two configurations.
#[derive(Debug, Clone, Default)]
pub struct Tweaks {
    /// Lines of this node's `[memory]`.
    pub memory: Vec<String>,
    /// Lines of the far node's `[memory]`.
    pub far_memory: Vec<String>,
    /// Lines of both nodes' `[limits]`.
    pub limits: Vec<String>,
}

/// What the in-process far node saw arrive (the forward leg, which a child process cannot
/// report).
#[derive(Debug, Clone)]
pub struct Seen {
    pub tag: u64,
    pub layout: Layout,
    pub transport: &'static str,
    pub kind: MemoryKind,
    pub len: usize,
}

enum Far {
    Process {
        served: Served,
        metrics: String,
    },
    InProcess {
        /// Kept alive for the pair's life.
        node: Arc<Node>,
        seen: Arc<Mutex<Vec<Seen>>>,
        echo: Option<tokio::task::JoinHandle<()>>,
    },
}

pub struct Pair {
    pub node: Arc<Node>,
    /// The far node's name.
    pub peer: String,
    pub combo: Combo,
    far: Far,
    _scratch: Scratch,
}

/// Node names are unique in this process: a node's pool socket is named after it.
pub fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Bytes per chunk of the tcp and staged transports, so that a megabyte crosses in many.
pub const CHUNK: usize = 64 << 10;

/// The tag of [`Pair::warm_up`].
const WARM_UP: u64 = 1 << 40;

/// How long a receive of an echo may take before the check fails.
pub const ECHO_LIMIT: Duration = Duration::from_secs(30);

impl Pair {
    /// Starts both nodes and connects them.
    pub async fn start(combo: &Combo, role: Role, tweaks: &Tweaks) -> Pair {
        let scratch = Scratch::new();
        let id = next_id();
        // A secret of the pair's own: a dial to a port that a node of another check took
        // over after its owner was killed is refused, never taken for the peer.
        crate::common::write_secret(
            &scratch.secret,
            &format!("conformance pair {id} of process {}", std::process::id()),
        );
        let (me, peer) = (format!("t{id}"), format!("p{id}"));
        let dir = scratch.path().join("sockets");
        std::fs::create_dir_all(&dir).expect("socket dir");
        let unix = |name: &str| format!("unix:{}/{name}.sock", dir.display());
        let far_text = |peers: &[(&str, &str)], telemetry: bool| {
            side_toml(
                &scratch,
                &peer,
                peers,
                combo,
                Side::Far,
                tweaks,
                &dir,
                telemetry,
            )
        };
        let (far, address) = match combo.locality {
            // Two nodes of this process, over TCP on loopback.
            Locality::SameProcess => {
                let config =
                    ferry::Config::from_toml_str(&far_text(&[], false)).expect("far node's config");
                let node = Arc::new(Node::start(config).await.expect("far node starts"));
                let address = node.tcp_addrs()[0].clone();
                let seen = Arc::new(Mutex::new(Vec::new()));
                let echo = (role == Role::Echo)
                    .then(|| tokio::spawn(echo(Arc::clone(&node), Arc::clone(&seen))));
                (Far::InProcess { node, seen, echo }, address)
            }
            // A child process, over Unix sockets, as same-host peers are configured.
            Locality::SameHost => {
                let path = scratch.write("far.toml", &far_text(&[(&me, &unix(&me))], true));
                let served = Served::start(&path, role_name(role));
                let metrics = served.metrics_addr();
                (Far::Process { served, metrics }, unix(&peer))
            }
            // A child process over TCP on loopback, configured as to another host. (It is
            // on this host all the same: its hello says so, and rules see it as same-host.)
            Locality::Remote => {
                let path = scratch.write("far.toml", &far_text(&[], true));
                let served = Served::start(&path, role_name(role));
                let metrics = served.metrics_addr();
                let address = served.addr.clone();
                (Far::Process { served, metrics }, address)
            }
        };
        let text = side_toml(
            &scratch,
            &me,
            &[(&peer, &address)],
            combo,
            Side::Near,
            tweaks,
            &dir,
            false,
        );
        let config = ferry::Config::from_toml_str(&text).expect("this node's config");
        let node = Arc::new(Node::start(config).await.expect("this node starts"));
        node.connect(&peer).await.expect("the nodes connect");
        Pair {
            node,
            peer,
            combo: combo.clone(),
            far,
            _scratch: scratch,
        }
    }

    /// Asserts that this node routes the combination's transfer as declared: its transport
    /// (nothing else is allowed) and its direction.
    pub async fn assert_routed_as_declared(&self) {
        let e = self
            .node
            .explain(&self.peer, 1 << 20, self.combo.src, self.combo.dst)
            .await
            .expect("explain");
        let chosen = e.chosen.as_ref().map(|r| (r.transport, r.direction));
        assert_eq!(
            chosen,
            Some((self.combo.transport(), self.combo.direction)),
            "{}: {e}",
            self.combo
        );
    }

    /// The next buffer from the far node with `tag` (any tag for `None`); fails the check
    /// after [`ECHO_LIMIT`].
    pub async fn recv(&self, tag: Option<u64>) -> Received {
        tokio::time::timeout(ECHO_LIMIT, self.node.recv(Some(&self.peer), tag))
            .await
            .unwrap_or_else(|_| panic!("{}: no echo of tag {tag:?} in time", self.combo))
            .expect("recv")
    }

    /// Sends one byte to the echo and takes it back: the transport's setup with the peer
    /// (rings, imported pools, the lane) is done, and what it keeps for the link's life is
    /// held, before a check takes its baseline.
    pub async fn warm_up(&self) {
        let mut one = self
            .node
            .alloc(self.combo.src_kind(), 1)
            .await
            .expect("alloc");
        one.write(0, &[0x5A]).expect("write");
        let one = self
            .node
            .send(&self.peer, WARM_UP, one)
            .await
            .unwrap_or_else(|e| panic!("{}: warm-up send: {e}", self.combo));
        let echo = self.recv(Some(WARM_UP)).await;
        // The echo came back over the transport under test (its rule names it first), where
        // that transport can read the echo's memory (what landed here); else over tcp.
        if self.combo.caps.sources.contains(&self.combo.dst) {
            assert_eq!(
                echo.transport.as_str(),
                self.combo.name(),
                "{}: the echo came back over another transport",
                self.combo
            );
        }
        release(&self.node, vec![one, echo.buffer]).await;
        if let Far::InProcess { seen, .. } = &self.far {
            seen.lock().expect("seen").clear();
        }
    }

    /// What the far node received, when it runs in this process.
    pub fn seen(&self) -> Option<Vec<Seen>> {
        match &self.far {
            Far::InProcess { seen, .. } => Some(seen.lock().expect("seen").clone()),
            Far::Process { .. } => None,
        }
    }

    /// SIGKILLs the far process and reaps it; `false` for a far node of this process, which
    /// cannot be killed.
    pub fn kill(&mut self) -> bool {
        match &mut self.far {
            Far::Process { served, .. } => {
                served.child.kill().expect("SIGKILL");
                let _ = served.child.wait();
                true
            }
            Far::InProcess { .. } => false,
        }
    }

    /// Fetches the far node served with the bytes of `key` (its publication's count in this
    /// process, its `ferry_fetches_served_total` as a process: every key it served).
    pub fn far_fetches_served(&self, key: &str) -> u64 {
        match &self.far {
            Far::Process { metrics, .. } => {
                metric(metrics, "ferry_fetches_served_total").unwrap_or(0.0) as u64
            }
            Far::InProcess { node, .. } => node.publication(key).map_or(0, |p| p.served),
        }
    }

    /// Staged chunks the far process took from a shared ring (its metric); `None` for a
    /// far node of this process.
    pub fn far_ring_chunks(&self) -> Option<f64> {
        match &self.far {
            Far::Process { metrics, .. } => {
                Some(metric(metrics, "ferry_staged_ring_chunks_total").unwrap_or(0.0))
            }
            Far::InProcess { .. } => None,
        }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        if let Far::InProcess {
            echo: Some(echo), ..
        } = &self.far
        {
            echo.abort();
        }
    }
}

/// Drops `buffers` and waits until their memory is back in its budgets (a release reaches
/// the allocator a moment after the drop). Nothing else may be under way.
async fn release(node: &Node, buffers: Vec<ferry::Buffer>) {
    let mut held: Vec<(MemoryKind, u64)> = Vec::new();
    for b in &buffers {
        match held.iter_mut().find(|(k, _)| *k == b.kind()) {
            Some((_, len)) => *len += b.len() as u64,
            None => held.push((b.kind(), b.len() as u64)),
        }
    }
    let granted = async |kind| node.memory(kind).await.expect("stats").budget.granted;
    let mut before = Vec::new();
    for &(kind, len) in &held {
        before.push((kind, granted(kind).await, len));
    }
    drop(buffers);
    let back = crate::common::eventually(Duration::from_secs(2), async || {
        for &(kind, then, len) in &before {
            if granted(kind).await + len > then {
                return false;
            }
        }
        true
    })
    .await;
    assert!(
        back,
        "dropped buffers' memory did not come back: {before:?}"
    );
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Echo => "echo",
        Role::Victim => "none",
    }
}

/// The far node's echo, as `ferry serve --role echo` does it: each send is polled once
/// before the next receive, so buffers go back in the order they came.
async fn echo(node: Arc<Node>, seen: Arc<Mutex<Vec<Seen>>>) {
    while let Ok(got) = node.recv(None, None).await {
        seen.lock().expect("seen").push(Seen {
            tag: got.tag,
            layout: got.layout.clone(),
            transport: got.transport.as_str(),
            kind: got.buffer.kind(),
            len: got.buffer.len(),
        });
        let node = Arc::clone(&node);
        let mut send = Box::pin(async move {
            if let Ok(Some(got)) = ferry::echo::handle_publishing(&node, got).await {
                let _ = node.send(&got.peer, got.tag, got.buffer).await;
            }
        });
        if futures::poll!(send.as_mut()).is_pending() {
            tokio::spawn(send);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// The node under test: routes over the transport only.
    Near,
    /// The far node: the transport, then tcp for buffers the transport cannot read.
    Far,
}

/// The configuration of a node under test for `combo`: everything over the transport.
pub fn node_toml(
    scratch: &Scratch,
    name: &str,
    peers: &[(&str, &str)],
    combo: &Combo,
    tweaks: &Tweaks,
    socket_dir: &Path,
) -> String {
    side_toml(
        scratch,
        name,
        peers,
        combo,
        Side::Near,
        tweaks,
        socket_dir,
        false,
    )
}

/// A node's configuration for `combo`.
#[allow(clippy::too_many_arguments)]
fn side_toml(
    scratch: &Scratch,
    name: &str,
    peers: &[(&str, &str)],
    combo: &Combo,
    side: Side,
    tweaks: &Tweaks,
    socket_dir: &Path,
    telemetry: bool,
) -> String {
    let mut memory = vec![
        format!("receive_into = \"{}\"", combo.dst.as_str()),
        "export_lease_timeout = \"1s\"".to_string(),
    ];
    memory.extend(match side {
        Side::Near => tweaks.memory.iter().cloned(),
        Side::Far => tweaks.far_memory.iter().cloned(),
    });
    let mut extra = format!("[memory]\n{}\n\n", memory.join("\n"));
    if combo.touches_device() {
        extra.push_str("[gpu]\ndevices = [0]\n\n");
    }
    extra.push_str(&format!("[limits]\n{}\n\n", tweaks.limits.join("\n")));
    if telemetry {
        extra.push_str("[telemetry]\nmetrics_listen = \"127.0.0.1:0\"\n\n");
    }
    // Small chunks, so that a megabyte crosses in many; staged shares a ring with a
    // same-host peer and sends over the link to a remote one.
    let shared = combo.locality != Locality::Remote;
    extra.push_str(&format!(
        "[transport.tcp]\nchunk_size = \"{CHUNK} B\"\n\n\
         [transport.staged]\nchunk = \"{CHUNK} B\"\nslots = 3\nshared_memory = {shared}\n\n"
    ));
    // A transport that serves only where asked (ucx: "auto" by default, RDMA machines only;
    // shm: off by default) is turned on as its kind says.
    let settings =
        ferry_transports::registry::kind(combo.transport()).map_or(&[][..], |k| k.turned_on());
    for (key, value) in settings {
        if let Some((section, key)) = key.rsplit_once('.') {
            extra.push_str(&format!("[{section}]\n{key} = {value}\n\n"));
        }
    }
    let mut transports = vec![format!("\"{}\"", combo.name())];
    if side == Side::Far && combo.transport() != TransportName::Tcp {
        transports.push("\"tcp\"".into());
    }
    extra.push_str(&format!(
        "[[transport.rules]]\nname = \"conformance\"\ntransports = [{}]\ndirection = \"{}\"\n",
        transports.join(", "),
        combo.direction.as_str()
    ));
    scratch.toml(name, peers, &extra).replacen(
        "[node]\n",
        &format!("[node]\nsocket_dir = \"{}\"\n", socket_dir.display()),
        1,
    )
}

/// Where a buffer's bytes land when the tier they were meant for is full: the other host
/// tier for host memory, pinned memory for GPU memory.
pub fn spill_tier(dst: MemoryClass) -> MemoryClass {
    match dst {
        MemoryClass::Host | MemoryClass::Device => MemoryClass::Pinned,
        MemoryClass::Pinned => MemoryClass::Host,
    }
}

/// The budget key of `[memory]` for a tier.
pub fn budget_key(class: MemoryClass) -> &'static str {
    match class {
        MemoryClass::Host => "host",
        MemoryClass::Pinned => "pinned",
        MemoryClass::Device => "device",
    }
}
