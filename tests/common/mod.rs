//! Helpers for tests that run real `ferry` processes on loopback.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use ferry::{Config, MemoryKind, Node};

/// A scratch directory with a shared secret in it.
pub struct Scratch {
    pub dir: tempfile::TempDir,
    pub secret: PathBuf,
}

impl Scratch {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("scratch dir");
        let secret = dir.path().join("secret");
        write_secret(&secret, "correct horse battery staple 42");
        Self { dir, secret }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A second secret, for a node that must not get in.
    pub fn other_secret(&self) -> PathBuf {
        let path = self.dir.path().join("other-secret");
        write_secret(&path, "an entirely different secret 99");
        path
    }

    /// The TOML of a node named `name` listening on an ephemeral loopback port.
    pub fn toml(&self, name: &str, peers: &[(&str, &str)], extra: &str) -> String {
        self.toml_with_secret(name, peers, extra, &self.secret)
    }

    pub fn toml_with_secret(
        &self,
        name: &str,
        peers: &[(&str, &str)],
        extra: &str,
        secret: &Path,
    ) -> String {
        let mut text = format!(
            "[node]\nname = \"{name}\"\nlisten = [\"127.0.0.1:0\"]\n\n\
             [security]\nsecret_file = \"{}\"\n\n{extra}\n",
            secret.display()
        );
        for (peer, address) in peers {
            text.push_str(&format!(
                "[[peers]]\nname = \"{peer}\"\naddress = \"{address}\"\n\n"
            ));
        }
        text
    }

    pub fn config(&self, name: &str, peers: &[(&str, &str)], extra: &str) -> Config {
        Config::from_toml_str(&self.toml(name, peers, extra)).expect("valid test config")
    }

    pub fn write(&self, file: &str, text: &str) -> PathBuf {
        let path = self.dir.path().join(file);
        std::fs::write(&path, text).expect("write config");
        path
    }
}

/// Writes a secret file that only its owner may read (mode 0600 when it is created), as
/// `Config::read_secret` demands.
pub fn write_secret(path: &Path, text: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut file| file.write_all(text.as_bytes()))
        .expect("write a secret file");
}

/// A `ferry serve` child process, killed when dropped.
pub struct Served {
    pub child: Child,
    /// The TCP address it listens on.
    pub addr: String,
    /// Its ready line, as printed.
    pub ready: String,
}

impl Served {
    /// Starts `ferry serve --config FILE --role ROLE` and waits (10 s at most) for its ready
    /// line.
    pub fn start(config: &Path, role: &str) -> Self {
        let mut command = Command::new(ferry_bin());
        command
            .args(["serve", "--config"])
            .arg(config)
            .args(["--role", role]);
        Self::spawn(command)
    }

    /// Runs `command`, a `ferry serve` command line (perhaps behind a wrapper such as `ip
    /// netns exec`), with warnings logged, and waits (10 s at most) for its ready line.
    pub fn spawn(mut command: Command) -> Self {
        let mut child = command
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn ferry serve");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("ferry serve printed no ready line within 10 s");
        let addr = line
            .split("tcp ")
            .nth(1)
            .and_then(|rest| rest.split([',', '\n']).next())
            .unwrap_or_else(|| panic!("no tcp address in ready line {line:?}"))
            .trim()
            .to_string();
        Self {
            child,
            addr,
            ready: line,
        }
    }

    /// The metrics address of a node configured with `telemetry.metrics_listen`, from its
    /// ready line (`..., metrics http://ADDR/metrics`).
    pub fn metrics_addr(&self) -> String {
        self.ready
            .split("metrics http://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|| panic!("no metrics address in ready line {:?}", self.ready))
    }

    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.child.id() as i32)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A buffer of `len` bytes whose contents derive from `seed`.
pub async fn patterned(node: &Node, len: usize, seed: u64) -> ferry::Buffer {
    let mut buffer = node.alloc(MemoryKind::Host, len).await.expect("alloc");
    let bytes = buffer.as_mut_slice().expect("fresh buffer");
    let mut x = seed | 1;
    for b in bytes.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    buffer
}

/// Sends `buffers` to `peer` in their order (each send polled once as it is made: its place
/// in the peer's order), buffer `i` under tag `tag(i)`, while `receive` runs beside them;
/// every send must succeed, and all of it end within `limit`. Gives what `receive` gave.
pub async fn send_in_order_while<T>(
    node: &Node,
    peer: &str,
    (buffers, tag): (Vec<ferry::Buffer>, impl Fn(usize) -> u64),
    limit: Duration,
    receive: impl std::future::Future<Output = T>,
) -> T {
    let mut sends = Vec::new();
    for (i, b) in buffers.into_iter().enumerate() {
        let mut send = Box::pin(futures::future::maybe_done(node.send(peer, tag(i), b)));
        let _ = futures::poll!(send.as_mut());
        sends.push(send);
    }
    let (_, received) = tokio::time::timeout(
        limit,
        futures::future::join(
            futures::future::join_all(sends.iter_mut().map(|s| s.as_mut())),
            receive,
        ),
    )
    .await
    .expect("every send and receive ended in time");
    for s in &mut sends {
        drop(s.as_mut().take_output().expect("done").expect("send"));
    }
    received
}

/// Waits until `check` holds, polling every 10 ms, for `limit` at most.
pub async fn eventually(limit: Duration, mut check: impl AsyncFnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Raises this process's soft limit on open files to `want` (the hard limit at most) and
/// returns the soft limit now in force, for a test that holds many sockets open.
pub fn raise_fd_limit(want: u64) -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    if soft >= want {
        return soft;
    }
    let raised = want.min(hard);
    match setrlimit(Resource::RLIMIT_NOFILE, raised, hard) {
        Ok(()) => raised,
        Err(_) => soft,
    }
}

/// The ferry binary: `FERRY_BIN`, else the one cargo built, else (a test bundle carried to a
/// GPU machine, where cargo's path does not exist) `bin/ferry` beside the bundle's `tests/`.
pub fn ferry_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("FERRY_BIN") {
        return path.into();
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_ferry"));
    if built.exists() {
        return built;
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("bin").join("ferry")))
        .filter(|p| p.exists())
        .unwrap_or(built)
}

/// `GET path` at `addr` (one HTTP/1.1 request, 5 s at most): the status code and the body,
/// or `None` when nothing answered.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: ferry\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

/// The value of the sample `series` (name and labels as rendered) at a node's Prometheus
/// endpoint, if it answers and has it.
pub fn metric(addr: &str, series: &str) -> Option<f64> {
    let (_, answer) = http_get(addr, "/metrics")?;
    answer.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// Sends `len` patterned bytes (seeded by `tag`) to `peer` as `layout`, checks that the
/// sender's buffer came back whole and unchanged, and returns the packed rows the peer
/// should receive.
pub async fn send_layout_checked(
    node: &Node,
    peer: &str,
    tag: u64,
    layout: ferry::Layout,
    len: usize,
) -> Vec<u8> {
    let buffer = patterned(node, len, tag).await;
    let whole = buffer.to_vec().expect("host");
    let packed = layout.check(len as u64).expect("fits") as usize;
    let mut want = vec![0u8; packed];
    layout.gather(&whole, 0, &mut want).expect("gather");
    let back = node
        .send_layout(peer, tag, buffer, layout.clone())
        .await
        .unwrap_or_else(|e| panic!("send {layout:?}: {e}"));
    assert_eq!(
        back.to_vec().expect("host"),
        whole,
        "the sender's buffer changed"
    );
    want
}

/// Strided layouts every transport's tests send, each with the length of a buffer that holds
/// it: 300 rows of 1000 bytes at a pitch of 1536 with 77 bytes after the last row; 3 planes
/// of 40 rows of 700 bytes, pitch 1024, 50 rows per plane; 100 rows that touch, with 17
/// bytes after them.
pub fn strided_layouts() -> Vec<(ferry::Layout, usize)> {
    use ferry::Layout;
    vec![
        (
            Layout::Strided2D {
                rows: 300,
                row_bytes: 1000,
                pitch: 1536,
            },
            299 * 1536 + 1000 + 77,
        ),
        (
            Layout::Strided3D {
                depth: 3,
                rows: 40,
                row_bytes: 700,
                pitch: 1024,
                plane_rows: 50,
            },
            (2 * 50 + 39) * 1024 + 700,
        ),
        (
            Layout::Strided2D {
                rows: 100,
                row_bytes: 1000,
                pitch: 1000,
            },
            100_000 + 17,
        ),
    ]
}

/// An authenticated link to `node` at `target` that introduces itself as `name` and
/// announces `transports`, driven by hand (to play a hostile or broken peer). Waits until
/// the node has taken it.
pub async fn hand_driven_link(
    secret: &Path,
    node: &Node,
    target: ferry_transports::link::Endpoint,
    name: &str,
    transports: Vec<ferry::TransportName>,
) -> ferry_transports::link::Link {
    let hello = ferry_transports::link::local_hello(name, transports, 4 << 20);
    hand_driven_link_with(secret, node, target, hello).await
}

/// [`hand_driven_link`] greeting the node with `hello` (its name is the peer's).
pub async fn hand_driven_link_with(
    secret: &Path,
    node: &Node,
    target: ferry_transports::link::Endpoint,
    hello: ferry_transports::wire::Hello,
) -> ferry_transports::link::Link {
    use ferry_transports::link::{self, LinkCounters, LinkOptions, Secret};
    let name = hello.node.clone();
    let secret = Secret::new(std::fs::read(secret).expect("secret"));
    let opts = LinkOptions {
        max_frame: 4 << 20,
        handshake_timeout: Duration::from_secs(5),
        stall_timeout: Duration::from_secs(30),
        counters: std::sync::Arc::new(LinkCounters::new()),
    };
    let link = link::dial(&target, &secret, hello, &opts)
        .await
        .expect("the hand-driven peer holds the secret");
    let taken = eventually(Duration::from_secs(5), async || {
        node.connected_peers()
            .await
            .is_ok_and(|p| p.contains(&name))
    })
    .await;
    assert!(taken, "the node never took {name}'s link");
    link
}

/// The next message from the node on a hand-driven link that is not a ping, a pong or a
/// welcome, within `limit`; `None` when the link ended first (closed, failed, or the node
/// said goodbye). A ping is answered, as every node answers it: a node that waits on this
/// peer hears it while it reads. Panics when nothing came in time.
pub async fn next_message(
    link: &mut ferry_transports::link::Link,
    limit: Duration,
) -> Option<ferry_transports::wire::Message> {
    use ferry_transports::wire::Message;
    // One limit for all of it: a node that waits on this peer pings it every third of its
    // stall timeout, and each ping must not start the wait again.
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let frame = tokio::time::timeout_at(deadline, link.reader.next())
            .await
            .unwrap_or_else(|_| panic!("nothing from the node within {limit:?}"));
        match frame {
            Ok(Some(frame)) => match frame.to_owned_message() {
                Ok(Message::Ping(nonce)) => {
                    let _ = link.writer.send(&Message::Pong(nonce)).await;
                    continue;
                }
                Ok(Message::Pong(_) | Message::Welcome) => continue,
                Ok(Message::Goodbye) => return None,
                Ok(m) => return Some(m),
                Err(e) => panic!("the node sent a bad frame: {e}"),
            },
            Ok(None) | Err(_) => return None,
        }
    }
}
