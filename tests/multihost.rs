//! Many hosts on one machine: network namespaces joined by a bridge, each running real
//! `ferry serve` processes, and faults between them (a partition, a host whose processes
//! die, a slow or lossy path).
//!
//! **Design.** Each test builds its own bed (`multihost/bed.rs`): a hub namespace holding a
//! bridge (198.18.0.254/24) and up to four host namespaces (198.18.0.1, .2, ...), each
//! joined to the bridge by a veth pair. The `ferry serve` processes run inside the hosts
//! (`ip netns exec HOST ferry serve --config ... --role echo|forward=PEER|none`). The test
//! itself drives: its body runs on a thread that entered the hub namespace (`setns`), so the
//! `ferry::Node` it starts there, and the proxy of `multihost/proxy.rs`, have their sockets
//! on the hub's bridge address, another host as far as the nodes can tell. That keeps the
//! driver in the test process (its API, its errors and its timings, checked directly)
//! without a helper binary, and leaves the machine's own namespace untouched: every link is
//! made inside the bed's namespaces, which are deleted when the bed is dropped (panics too).
//!
//! Every node of a bed has its own `node.host_id`; without one they would all read the
//! machine's `/etc/machine-id`, which namespaces share, and call each other same-host.
//! `same_host_id_in_two_namespaces_is_same_host` gives two hosts the same one on purpose.
//!
//! Faults: a partition takes a host's bridge port down (the kernel has no `netem`, and no
//! `iptables` is installed: link down drops every packet silently, as a pulled cable does);
//! a host's processes are killed with SIGKILL; the proxy adds latency, caps bandwidth,
//! refuses connections and cuts them with a FIN or a RST mid-transfer.
//!
//! Discovery by DNS (`peers_found_by_dns_join_and_leave`, four hosts) resolves names for
//! real: each host's `/etc/hosts` is a file of the bed (`/etc/netns/NS/hosts`, which `ip
//! netns exec` bind-mounts over `/etc/hosts` for the process it starts), read by glibc's
//! `getaddrinfo` as any lookup is; one name with several lines is a name with several A
//! records. No DNS server runs: what is not tested is DNS itself (TTLs, a server that does
//! not answer), which ferry leaves to the system resolver.
//!
//! A machine where namespaces cannot be made (not root, no `ip`) skips these tests, saying
//! why; with `FERRY_NETNS_TESTS=1` (CI) it fails them instead.

#[path = "multihost/bed.rs"]
mod bed;
mod common;
#[path = "multihost/proxy.rs"]
mod proxy;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bed::{Bed, HUB_ADDR, NODE_PORT};
use common::{eventually, http_get};
use ferry::{Config, ErrorKind, MemoryClass, MemoryKind, Node};
use ferry_config::Locality;
use proxy::{Cut, Proxy, Shape};

/// Limits every node of a bed runs with: short, so that faults show within the tests' time.
const LIMITS: &str =
    "[limits]\nstall_timeout = \"1s\"\nconnect_timeout = \"1s\"\nhandshake_timeout = \"2s\"\n";
/// What a transfer may overrun its deadline by, on a busy 2-core machine.
const SLACK: Duration = Duration::from_millis(750);

/// The driver node's configuration: named `driver`, on the hub's address, with `peers`.
fn driver_config(bed: &Bed, peers: &[(&str, String)], extra: &str) -> Config {
    let mut text = format!(
        "[node]\nname = \"driver\"\nlisten = [\"{HUB_ADDR}:{NODE_PORT}\"]\nhost_id = \"{}-hub\"\n\n\
         [security]\nsecret_file = \"{}\"\n\n{LIMITS}{extra}\n",
        bed.tag,
        bed.scratch.secret.display()
    );
    for (peer, address) in peers {
        text.push_str(&format!(
            "[[peers]]\nname = \"{peer}\"\naddress = \"{address}\"\n\n"
        ));
    }
    Config::from_toml_str(&text).expect("valid driver config")
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// A host buffer of `len` bytes whose contents derive from `seed` (eight bytes per
/// xorshift step: a 64 MiB one takes a moment even in a debug build).
async fn pattern(node: &Node, len: usize, seed: u64) -> ferry::Buffer {
    let mut buffer = node.alloc(MemoryKind::Host, len).await.expect("alloc");
    let bytes = buffer.as_mut_slice().expect("fresh buffer");
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in bytes.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    buffer
}

/// Sends `len` patterned bytes to `to` under `tag` by `deadline`, then waits (until the
/// same deadline) for them to come back from `from` and checks every byte.
async fn round_trip(
    node: &Node,
    to: &str,
    from: &str,
    tag: u64,
    len: usize,
    deadline: Instant,
) -> Result<&'static str, String> {
    let buffer = pattern(node, len, tag).await;
    let sent = node
        .send_by(to, tag, buffer, deadline)
        .await
        .map_err(|e| format!("send {len} B to {to}: {e}"))?;
    let want = sent.to_vec().expect("host buffer");
    drop(sent);
    let wait = deadline.saturating_duration_since(Instant::now());
    let got = tokio::time::timeout(wait, node.recv(Some(from), Some(tag)))
        .await
        .map_err(|_| format!("{len} B to {to}: nothing back from {from} by the deadline"))?
        .map_err(|e| format!("recv from {from}: {e}"))?;
    let bytes = got.buffer.to_vec().expect("host buffer");
    assert_eq!(bytes.len(), len, "tag {tag}: length changed on the way");
    assert!(bytes == want, "tag {tag}: {len} B came back changed");
    Ok(got.transport.as_str())
}

/// The sum of the samples of metric `name` whose labels include `label` (`key="value"`).
fn metric_sum(addr: &str, name: &str, label: &str) -> f64 {
    let (_, text) = http_get(addr, "/metrics").expect("metrics endpoint answers");
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Host memory a served node holds, from its metrics.
fn granted(metrics: &str) -> f64 {
    metric_sum(metrics, "ferry_memory_granted_bytes", "domain=\"host\"")
}

/// Waits (5 s at most) until the driver and every served node at `metrics` hold no host
/// memory: nothing a test did keeps memory after it.
async fn memory_back_to_baseline(node: &Node, metrics: &[String]) {
    // Buffers delivered but never taken (echoes of transfers the test gave up on) first.
    while let Ok(Ok(got)) =
        tokio::time::timeout(Duration::from_millis(100), node.recv(None, None)).await
    {
        drop(got);
    }
    let driver_ok = eventually(Duration::from_secs(5), async || {
        node.host_memory().await.is_ok_and(|m| m.granted == 0)
    })
    .await;
    assert!(
        driver_ok,
        "the driver still holds memory: {:?}",
        node.host_memory().await
    );
    for addr in metrics {
        let addr = addr.clone();
        let back = eventually(Duration::from_secs(5), async || {
            let a = addr.clone();
            tokio::task::spawn_blocking(move || granted(&a) == 0.0)
                .await
                .unwrap_or(false)
        })
        .await;
        assert!(back, "the node at {addr} still holds {} B", granted(&addr));
    }
}

/// Every transfer in `ends` ended with one of `kinds` (an `Ok` counts when `ok_allowed`),
/// no later than `by`.
fn assert_ended(
    what: &str,
    ends: &[(Result<(), ErrorKind>, Instant)],
    kinds: &[ErrorKind],
    ok_allowed: bool,
    by: Instant,
) {
    for (i, (result, at)) in ends.iter().enumerate() {
        match result {
            Ok(()) => assert!(ok_allowed, "{what}: transfer {i} succeeded"),
            Err(kind) => assert!(
                kinds.contains(kind),
                "{what}: transfer {i} ended with {kind:?}, want one of {kinds:?}"
            ),
        }
        assert!(
            *at <= by,
            "{what}: transfer {i} ended {:?} past its bound",
            at.duration_since(by)
        );
    }
}

/// Byte-exact transfers around a ring of three hosts (driver → a → b → c → driver, each
/// hop between two namespaces), sizes 1 B to 64 MiB; every hop is remote by the host
/// identities: the driver's route, `ferry explain` run inside a host, and the transfer
/// metrics of every served node say so. No node holds memory afterwards.
#[test]
fn transfers_between_hosts_are_byte_exact_and_remote() {
    let Some(bed) = Bed::new(3) else { return };
    let at = |i: usize| bed.hosts[i].endpoint(NODE_PORT);
    let hub = format!("{HUB_ADDR}:{NODE_PORT}");
    let names = ["a", "b", "c"];
    let next = [("b", at(1)), ("c", at(2)), ("driver", hub.clone())];
    let served: Vec<_> = (0..3)
        .map(|i| {
            let config = bed.serve_config(
                i,
                names[i],
                NODE_PORT,
                &bed.host_id(i),
                &[(next[i].0, next[i].1.clone())],
                LIMITS,
            );
            bed.serve(i, &config, &format!("forward={}", next[i].0))
        })
        .collect();
    let metrics: Vec<String> = served.iter().map(|s| s.metrics_addr()).collect();

    bed.in_hub(|| {
        runtime().block_on(async {
            let node = Node::start(driver_config(&bed, &[("a", at(0))], ""))
                .await
                .expect("driver starts");
            let sizes = [1usize, 4097, (1 << 20) + 3, 16 << 20, 64 << 20];
            let deadline = Instant::now() + Duration::from_secs(30);
            let trips = sizes
                .iter()
                .enumerate()
                .map(|(i, &len)| round_trip(&node, "a", "c", i as u64, len, deadline));
            for (result, len) in futures::future::join_all(trips)
                .await
                .into_iter()
                .zip(sizes)
            {
                let transport = result.unwrap_or_else(|e| panic!("{len} B around the ring: {e}"));
                assert_eq!(transport, "tcp", "{len} B came back over {transport}");
            }
            let route = node
                .explain("a", 1 << 20, MemoryClass::Host, None)
                .await
                .expect("explain");
            assert_eq!(route.query.locality, Locality::Remote, "{route}");
            assert_eq!(
                route.chosen.as_ref().map(|r| r.transport.as_str()),
                Some("tcp"),
                "{route}"
            );
            let total: usize = sizes.iter().sum();
            for (addr, name) in metrics.iter().zip(names) {
                let (a, n) = (addr.clone(), name);
                let (remote, same) = tokio::task::spawn_blocking(move || {
                    (
                        metric_sum(&a, "ferry_transfer_bytes_total", "peer_class=\"remote\""),
                        metric_sum(&a, "ferry_transfer_bytes_total", "peer_class=\"same_host\""),
                    )
                })
                .await
                .expect("metrics");
                assert!(
                    remote >= total as f64,
                    "{n} counted {remote} B to remote peers, sent {total}"
                );
                assert_eq!(same, 0.0, "{n} counted bytes to a same-host peer");
            }
            memory_back_to_baseline(&node, &metrics).await;
            node.shutdown().await;
        });
    });

    // `ferry explain`, run inside host a with a's identity, dials b in its namespace.
    let explain_cfg = bed.serve_config(0, "a-explain", 7071, &bed.host_id(0), &[("b", at(1))], "");
    let report = bed.explain(0, &explain_cfg, "b");
    assert_eq!(report["locality"], "remote", "{report:#}");
    assert_eq!(report["setup"]["connected"], true, "{report:#}");
    assert_eq!(report["chosen"]["transport"], "tcp", "{report:#}");
    drop(served);
}

/// Two hosts configured with one `host_id` are same-host to each other, though they are
/// different namespaces (they do share the machine: its `/dev/shm`, its Unix sockets, its
/// GPUs, so a same-host path between them works). Bytes between them still cross intact,
/// and a node with an identity of its own sees both as remote. Their abstract sockets are
/// not shared: shm's setup finds that b cannot map a's pool, and host memory falls back to
/// tcp.
#[test]
fn same_host_id_in_two_namespaces_is_same_host() {
    let Some(bed) = Bed::new(2) else { return };
    let at = |i: usize| bed.hosts[i].endpoint(NODE_PORT);
    let hub = format!("{HUB_ADDR}:{NODE_PORT}");
    let shared = format!("{}-shared", bed.tag);
    let a_cfg = bed.serve_config(0, "a", NODE_PORT, &shared, &[("b", at(1))], LIMITS);
    let b_cfg = bed.serve_config(1, "b", NODE_PORT, &shared, &[("driver", hub)], LIMITS);
    let a = bed.serve(0, &a_cfg, "forward=b");
    let b = bed.serve(1, &b_cfg, "forward=driver");
    let metrics = [a.metrics_addr(), b.metrics_addr()];

    bed.in_hub(|| {
        runtime().block_on(async {
            let node = Node::start(driver_config(&bed, &[("a", at(0))], ""))
                .await
                .expect("driver starts");
            let deadline = Instant::now() + Duration::from_secs(20);
            let sum = |addr: &str, class: &str| {
                metric_sum(
                    addr,
                    "ferry_transfer_bytes_total",
                    &format!("peer_class=\"{class}\""),
                )
            };
            let counts = || {
                let m = metrics.clone();
                tokio::task::spawn_blocking(move || {
                    [
                        sum(&m[0], "same_host"),
                        sum(&m[0], "remote"),
                        sum(&m[1], "remote"),
                    ]
                })
            };
            // The first transfer opens the links; a's first send to b is counted before
            // b's hello arrives, by b's address (not loopback: remote). Count after it.
            // A sender counts its bytes when the receiver's answer reaches it, which can be
            // after the driver holds the echo: wait until both senders counted them.
            round_trip(&node, "a", "b", 1, 1000, deadline)
                .await
                .unwrap_or_else(|e| panic!("a → b → driver: {e}"));
            let counted = eventually(Duration::from_secs(5), async || {
                counts()
                    .await
                    .is_ok_and(|[same, remote, b]| same + remote >= 1000.0 && b >= 1000.0)
            })
            .await;
            assert!(
                counted,
                "the first transfer is never counted: {:?}",
                counts().await
            );
            let before = counts().await.expect("metrics");
            for (tag, len) in [(2u64, 1000usize), (3, 3 << 20), (4, 16 << 20)] {
                round_trip(&node, "a", "b", tag, len, deadline)
                    .await
                    .unwrap_or_else(|e| panic!("a → b → driver: {e}"));
            }
            let route = node
                .explain("a", 1 << 20, MemoryClass::Host, None)
                .await
                .expect("explain");
            assert_eq!(route.query.locality, Locality::Remote, "{route}");
            let total = (1000 + (3 << 20) + (16 << 20)) as f64;
            eventually(Duration::from_secs(5), async || {
                counts()
                    .await
                    .is_ok_and(|now| now[0] - before[0] >= total && now[2] - before[2] >= total)
            })
            .await;
            let after = counts().await.expect("metrics");
            let [a_same, a_remote, b_remote] = [0, 1, 2].map(|i| after[i] - before[i]);
            assert_eq!(a_same, total, "a's bytes to same-host b");
            assert_eq!(a_remote, 0.0, "a called b remote");
            assert_eq!(b_remote, total, "b's bytes to the remote driver");
            // Same host, but not the same network namespace: b cannot reach a's fd-sharing
            // socket (abstract Unix sockets are per namespace), so it cannot map a's shm
            // pool. The setup says so and a's host sends fall back to tcp.
            let (bad, failover) = tokio::task::spawn_blocking({
                let a = metrics[0].clone();
                move || {
                    let bad = metric_sum(&a, "ferry_shm_setup_total", "outcome=\"bad\"");
                    let failover = metric_sum(&a, "ferry_failover_total", "from=\"shm\"");
                    (bad, failover)
                }
            })
            .await
            .expect("metrics");
            assert_eq!(
                bad, 1.0,
                "a's shm setup with b must fail once, then be remembered"
            );
            // Every send but the first (before b's hello, shm is assumed missing: tcp).
            assert!(
                failover >= 3.0,
                "a's sends to b did not fall back from shm: {failover}"
            );
            memory_back_to_baseline(&node, &metrics).await;
            node.shutdown().await;
        });
    });

    // Both answers from `ferry explain` inside host a: with the shared identity, b is
    // same-host; with one of its own, remote.
    let same_cfg = bed.serve_config(0, "a-same", 7071, &shared, &[("b", at(1))], "");
    let report = bed.explain(0, &same_cfg, "b");
    assert_eq!(report["locality"], "same-host", "{report:#}");
    let other_cfg = bed.serve_config(0, "a-other", 7072, &bed.host_id(0), &[("b", at(1))], "");
    let report = bed.explain(0, &other_cfg, "b");
    assert_eq!(report["locality"], "remote", "{report:#}");
    drop((a, b));
}

/// A partition (host b's link down) under transfers streaming to b, and more made after
/// it: every one of them ends by its deadline, with `PeerLost` (the stalled link ends after
/// `limits.stall_timeout`) or `DeadlineExceeded`, while host a is served as before; once
/// the link is back, new transfers to b succeed, and no node holds memory for what was lost.
#[test]
fn partition_ends_transfers_by_their_deadline_and_heals() {
    let Some(bed) = Bed::new(2) else { return };
    let at = |i: usize| bed.hosts[i].endpoint(NODE_PORT);
    let served: Vec<_> = ["a", "b"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let cfg = bed.serve_config(i, name, NODE_PORT, &bed.host_id(i), &[], LIMITS);
            bed.serve(i, &cfg, "echo")
        })
        .collect();
    let metrics: Vec<String> = served.iter().map(|s| s.metrics_addr()).collect();

    bed.in_hub(|| {
        runtime().block_on(async {
            let node = Node::start(driver_config(&bed, &[("a", at(0)), ("b", at(1))], ""))
                .await
                .expect("driver starts");
            let soon = || Instant::now() + Duration::from_secs(10);
            for peer in ["a", "b"] {
                round_trip(&node, peer, peer, 1, 1 << 20, soon())
                    .await
                    .unwrap_or_else(|e| panic!("before the partition: {e}"));
            }

            let node = &node;
            let mut streaming = Vec::new();
            for i in 0..4u64 {
                streaming.push((100 + i, pattern(node, 32 << 20, i).await));
            }
            let mut later = Vec::new();
            for (i, len) in [4096usize, 1 << 20, 8 << 20, 16 << 20, 64 << 20]
                .into_iter()
                .enumerate()
            {
                later.push((110 + i as u64, pattern(node, len, i as u64).await));
            }
            let send = |tag: u64, buffer: ferry::Buffer, deadline: Instant| async move {
                let result = node.send_by("b", tag, buffer, deadline).await;
                (result.map(drop).map_err(|e| e.kind()), Instant::now())
            };
            // Four 32 MiB transfers stream to b; the link goes down once the first is
            // through, under the others.
            let first_by = Instant::now() + Duration::from_secs(3);
            let mut streams: Vec<_> = streaming
                .into_iter()
                .map(|(tag, buffer)| {
                    Box::pin(futures::future::maybe_done(send(tag, buffer, first_by)))
                })
                .collect();
            for s in &mut streams {
                let _ = futures::poll!(s.as_mut());
            }
            streams[0].as_mut().await;
            bed.partition(1);
            // More transfers to b, made after the link went down.
            let then_by = Instant::now() + Duration::from_millis(1500);
            let after = later
                .into_iter()
                .map(|(tag, buffer)| send(tag, buffer, then_by));
            let to_a = async {
                for tag in 200..205u64 {
                    round_trip(node, "a", "a", tag, 4 << 20, soon())
                        .await
                        .unwrap_or_else(|e| panic!("a during b's partition: {e}"));
                }
            };
            let (ends, ()) = futures::future::join(
                futures::future::join(
                    futures::future::join_all(streams.iter_mut().map(|s| s.as_mut())),
                    futures::future::join_all(after),
                ),
                to_a,
            )
            .await;
            let streamed: Vec<_> = streams
                .iter_mut()
                .map(|s| s.as_mut().take_output().expect("ended"))
                .collect();
            let (_, after) = ends;
            let report = |ends: &[(Result<(), ErrorKind>, Instant)], deadline: Instant| {
                ends.iter()
                    .map(|(r, t)| {
                        let to_deadline = t.checked_duration_since(deadline).map_or_else(
                            || format!("-{:?}", deadline.duration_since(*t)),
                            |late| format!("+{late:?}"),
                        );
                        format!("{r:?} {to_deadline}")
                    })
                    .collect::<Vec<_>>()
            };
            eprintln!(
                "to b, relative to their deadlines: streaming {:?}; made after the partition {:?}",
                report(&streamed, first_by),
                report(&after, then_by)
            );
            assert_eq!(
                streamed[0].0,
                Ok(()),
                "the first 32 MiB, before the partition"
            );
            assert_ended(
                "streaming when b was cut off",
                &streamed[1..],
                &[ErrorKind::PeerLost, ErrorKind::DeadlineExceeded],
                true,
                first_by + SLACK,
            );
            assert!(
                streamed[1..].iter().any(|(r, _)| r.is_err()),
                "the partition caught no transfer streaming"
            );
            assert_ended(
                "made after b was cut off",
                &after,
                &[ErrorKind::PeerLost, ErrorKind::DeadlineExceeded],
                false,
                then_by + SLACK,
            );

            bed.heal(1);
            let healed = Instant::now();
            let mut last = String::new();
            let mut back = false;
            while healed.elapsed() < Duration::from_secs(15) {
                let deadline = Instant::now() + Duration::from_secs(3);
                match round_trip(node, "b", "b", 300, 1 << 20, deadline).await {
                    Ok(_) => {
                        back = true;
                        break;
                    }
                    Err(e) => last = e,
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert!(back, "b never came back after the partition healed: {last}");
            eprintln!(
                "b served again {:?} after the link came back",
                healed.elapsed()
            );
            for tag in 301..305u64 {
                round_trip(node, "b", "b", tag, 4 << 20, soon())
                    .await
                    .unwrap_or_else(|e| panic!("after healing: {e}"));
            }
            memory_back_to_baseline(node, &metrics).await;
        });
    });
    drop(served);
}

/// Every process of host c killed (two nodes there): every transfer to them, in flight or
/// waiting for memory there, fails with `PeerLost` within 2 s (their deadlines are 30 s
/// away), new ones fail as fast, host a does not notice, and the driver's memory comes back.
#[test]
fn killing_every_process_of_a_host_fails_its_transfers_within_2s() {
    let Some(bed) = Bed::new(2) else { return };
    let at = |i: usize, port: u16| bed.hosts[i].endpoint(port);
    let a_cfg = bed.serve_config(0, "a", NODE_PORT, &bed.host_id(0), &[], LIMITS);
    let a = bed.serve(0, &a_cfg, "echo");
    // c1 keeps what it receives and may hold 8 MiB: from the third 3 MiB transfer on, the
    // sender waits for c1's memory. c2 echoes.
    let c1_cfg = bed.serve_config(
        1,
        "c1",
        NODE_PORT,
        &bed.host_id(1),
        &[],
        &format!("{LIMITS}\n[memory]\nhost = \"8MiB\"\n"),
    );
    let c2_cfg = bed.serve_config(1, "c2", NODE_PORT + 1, &bed.host_id(1), &[], LIMITS);
    let mut c1 = bed.serve(1, &c1_cfg, "none");
    let mut c2 = bed.serve(1, &c2_cfg, "echo");
    assert_eq!(bed.pids(1).len(), 2, "host c runs c1 and c2");
    let a_metrics = a.metrics_addr();

    bed.in_hub(|| {
        runtime().block_on(async {
            let peers = [
                ("a", at(0, NODE_PORT)),
                ("c1", at(1, NODE_PORT)),
                ("c2", at(1, NODE_PORT + 1)),
            ];
            let node = Node::start(driver_config(&bed, &peers, ""))
                .await
                .expect("driver starts");
            let node = &node;
            let far = Instant::now() + Duration::from_secs(30);
            round_trip(node, "c2", "c2", 1, 1 << 20, far)
                .await
                .expect("c2 echoes");
            for tag in 0..2u64 {
                let buffer = pattern(node, 3 << 20, tag).await;
                drop(
                    node.send_by("c1", tag, buffer, far)
                        .await
                        .expect("fits at c1"),
                );
            }
            let send = |peer: &'static str, tag: u64, buffer: ferry::Buffer| async move {
                let result = node.send_by(peer, tag, buffer, far).await;
                (result.map(drop).map_err(|e| e.kind()), Instant::now())
            };
            let mut buffers = Vec::new();
            for tag in 2..6u64 {
                buffers.push(("c1", tag, pattern(node, 3 << 20, tag).await));
            }
            for tag in 10..14u64 {
                buffers.push(("c2", tag, pattern(node, 16 << 20, tag).await));
            }
            let mut pending: Vec<_> = buffers
                .into_iter()
                .map(|(peer, tag, buffer)| {
                    Box::pin(futures::future::maybe_done(send(peer, tag, buffer)))
                })
                .collect();
            // c1's four are submitted, and stuck: c1 has no room for them.
            for p in &mut pending[..4] {
                let _ = futures::poll!(p.as_mut());
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            for p in &mut pending[..4] {
                let _ = futures::poll!(p.as_mut());
                assert!(
                    p.as_mut().output_mut().is_none(),
                    "a transfer c1 has no room for ended"
                );
            }
            // c2's four are submitted just before the kill: some are still moving.
            for p in &mut pending[4..] {
                let _ = futures::poll!(p.as_mut());
            }

            c1.child.kill().expect("kill c1");
            c2.child.kill().expect("kill c2");
            let killed = Instant::now();
            let _ = (c1.child.wait(), c2.child.wait());
            assert!(
                bed.pids(1).is_empty(),
                "host c still runs {:?}",
                bed.pids(1)
            );

            futures::future::join_all(pending.iter_mut().map(|p| p.as_mut())).await;
            let ends: Vec<_> = pending
                .iter_mut()
                .map(|p| p.as_mut().take_output().expect("ended"))
                .collect();
            // c1's were waiting: they fail. c2's may have completed before the kill.
            assert_ended(
                "waiting at killed c1",
                &ends[..4],
                &[ErrorKind::PeerLost],
                false,
                killed + Duration::from_secs(2),
            );
            assert_ended(
                "to killed c2",
                &ends[4..],
                &[ErrorKind::PeerLost],
                true,
                killed + Duration::from_secs(2),
            );
            eprintln!(
                "transfers to host c ended {:?} after the kill",
                ends.iter()
                    .map(|(r, t)| (*r, t.duration_since(killed)))
                    .collect::<Vec<_>>()
            );

            // New transfers fail as fast: nothing listens there any more.
            let buffer = pattern(node, 1 << 20, 20).await;
            let started = Instant::now();
            let (result, ended) = send("c2", 20, buffer).await;
            assert!(result.is_err(), "a send to killed c2 succeeded");
            assert!(
                ended.duration_since(started) <= Duration::from_secs(2),
                "a new send to killed c2 took {:?}",
                ended.duration_since(started)
            );
            round_trip(
                node,
                "a",
                "a",
                30,
                4 << 20,
                Instant::now() + Duration::from_secs(10),
            )
            .await
            .expect("host a is served as before");
            memory_back_to_baseline(node, std::slice::from_ref(&a_metrics)).await;
        });
    });
    drop(a);
}

/// A slow and then lossy path through the test's proxy between the driver and host a:
/// transfers over 25 ms of latency and 24 MiB/s complete byte-exact, one whose deadline is
/// shorter than the path needs ends by it; connections reset or closed mid-transfer, and
/// refused, fail their transfers cleanly and quickly; whatever comes back is byte-exact;
/// once the path is clean again transfers succeed, and neither end holds memory.
#[test]
fn slow_or_lossy_path_completes_or_fails_cleanly() {
    let Some(bed) = Bed::new(1) else { return };
    let a_cfg = bed.serve_config(0, "a", NODE_PORT, &bed.host_id(0), &[], LIMITS);
    let a = bed.serve(0, &a_cfg, "echo");
    let a_metrics = a.metrics_addr();
    let upstream: SocketAddr = bed.hosts[0]
        .endpoint(NODE_PORT)
        .parse()
        .expect("a's address");

    bed.in_hub(|| {
        runtime().block_on(async {
            let proxy = Proxy::start(SocketAddr::from((HUB_ADDR, 0)), upstream).await;
            let node = Node::start(driver_config(&bed, &[("a", proxy.addr.to_string())], ""))
                .await
                .expect("driver starts");
            let node = &node;
            let soon = || Instant::now() + Duration::from_secs(10);

            // Slow: complete, byte-exact.
            proxy.shape(Shape {
                latency: Duration::from_millis(25),
                rate: Some(24 << 20),
                refuse: false,
            });
            for (tag, len) in [(1u64, 64 << 10), (2, 1 << 20), (3, 4 << 20)] {
                let started = Instant::now();
                round_trip(node, "a", "a", tag, len, soon())
                    .await
                    .unwrap_or_else(|e| panic!("slow path: {e}"));
                assert!(
                    started.elapsed() >= Duration::from_millis(50),
                    "no latency added"
                );
            }
            // Too slow for its deadline: ends by it, and the path stays usable.
            let deadline = Instant::now() + Duration::from_millis(300);
            let buffer = pattern(node, 16 << 20, 4).await;
            let err = node
                .send_by("a", 4, buffer, deadline)
                .await
                .expect_err("16 MiB at 24 MiB/s in 300 ms");
            assert!(
                matches!(
                    err.kind(),
                    ErrorKind::DeadlineExceeded | ErrorKind::PeerLost
                ),
                "{err}"
            );
            assert!(Instant::now() <= deadline + SLACK, "ended late: {err}");
            drop(err);
            round_trip(node, "a", "a", 5, 1 << 20, soon())
                .await
                .unwrap_or_else(|e| panic!("after a deadline on the slow path: {e}"));

            // Lossy: connections cut mid-transfer, with a RST and with a FIN.
            for (round, how) in [Cut::Reset, Cut::Close].into_iter().enumerate() {
                let base = 100 * (round as u64 + 1);
                let before = proxy.upstream_bytes();
                let far = Instant::now() + Duration::from_secs(20);
                let sends = (0..4u64).map(|i| async move {
                    let buffer = pattern(node, 8 << 20, base + i).await;
                    let result = node.send_by("a", base + i, buffer, far).await;
                    (result.map(drop).map_err(|e| e.kind()), Instant::now())
                });
                let cut = async {
                    let moving = eventually(Duration::from_secs(10), async || {
                        proxy.upstream_bytes() >= before + (2 << 20)
                    })
                    .await;
                    assert!(moving, "nothing crossed the proxy");
                    proxy.cut(how);
                    Instant::now()
                };
                let (ends, cut_at) =
                    futures::future::join(futures::future::join_all(sends), cut).await;
                assert_ended(
                    &format!("{how:?} mid-transfer"),
                    &ends,
                    &[ErrorKind::PeerLost],
                    true,
                    cut_at + Duration::from_secs(2),
                );
                assert!(
                    ends.iter().any(|(r, _)| r.is_err()),
                    "{how:?}: the cut hit no transfer"
                );
                // The echoes of what a got whole may come back: if so, byte-exact.
                for (i, (result, _)) in ends.iter().enumerate() {
                    if result.is_ok() {
                        let tag = base + i as u64;
                        if let Ok(Ok(got)) = tokio::time::timeout(
                            Duration::from_secs(2),
                            node.recv(Some("a"), Some(tag)),
                        )
                        .await
                        {
                            let want = pattern(node, 8 << 20, tag).await;
                            assert!(
                                got.buffer.to_vec().expect("host") == want.to_vec().expect("host"),
                                "{how:?}: tag {tag} came back changed"
                            );
                        }
                    }
                }
            }

            // Refused: every connection closed at once; a send ends by its deadline.
            proxy.shape(Shape {
                refuse: true,
                ..Shape::default()
            });
            proxy.cut(Cut::Close);
            let deadline = Instant::now() + Duration::from_millis(1500);
            let buffer = pattern(node, 1 << 20, 400).await;
            let err = node
                .send_by("a", 400, buffer, deadline)
                .await
                .expect_err("no connection gets through");
            assert!(Instant::now() <= deadline + SLACK, "ended late: {err}");
            drop(err);

            // Clean again: transfers succeed.
            proxy.shape(Shape::default());
            let mut back = false;
            let mut last = String::new();
            let healed = Instant::now();
            while healed.elapsed() < Duration::from_secs(10) {
                match round_trip(
                    node,
                    "a",
                    "a",
                    500,
                    1 << 20,
                    Instant::now() + Duration::from_secs(3),
                )
                .await
                {
                    Ok(_) => {
                        back = true;
                        break;
                    }
                    Err(e) => last = e,
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert!(back, "a never came back once the path was clean: {last}");
            for tag in 501..504u64 {
                round_trip(node, "a", "a", tag, 4 << 20, soon())
                    .await
                    .unwrap_or_else(|e| panic!("clean path: {e}"));
            }
            assert!(proxy.accepted() >= 3, "the cuts made the driver dial again");
            memory_back_to_baseline(node, std::slice::from_ref(&a_metrics)).await;
        });
    });
    drop(a);
}

/// With `transport.ucx.enabled = "on"` (UCX over tcp: the bed has no RDMA device) on hosts
/// a and b, the hop between them takes ucx (the default rules put it first for remote
/// peers), and the bytes arrive intact: driver → a (tcp) → b (ucx) → driver (tcp). The
/// driver serves no ucx: its thread entered the hub's network namespace but still sees the
/// machine's `/sys/class/net`, where UCX looks for interfaces (`ip netns exec` remounts it
/// for the served nodes). Skipped where UCX is not viable.
#[test]
fn ucx_carries_transfers_between_hosts() {
    let Some(bed) = Bed::new(2) else { return };
    if let ferry_transports::transport::Viability::NotViable(why) =
        ferry_transports::ucx::viability()
    {
        eprintln!("skipped: UCX is not viable here: {why}");
        return;
    }
    let ucx = format!("{LIMITS}[transport.ucx]\nenabled = \"on\"\ntls = \"tcp\"\n");
    let at = |i: usize| bed.hosts[i].endpoint(NODE_PORT);
    let hub = format!("{HUB_ADDR}:{NODE_PORT}");
    let a_cfg = bed.serve_config(0, "a", NODE_PORT, &bed.host_id(0), &[("b", at(1))], &ucx);
    let b_cfg = bed.serve_config(1, "b", NODE_PORT, &bed.host_id(1), &[("driver", hub)], &ucx);
    let a = bed.serve(0, &a_cfg, "forward=b");
    let b = bed.serve(1, &b_cfg, "forward=driver");
    let metrics = [a.metrics_addr(), b.metrics_addr()];
    bed.in_hub(|| {
        runtime().block_on(async {
            let node = Node::start(driver_config(&bed, &[("a", at(0)), ("b", at(1))], ""))
                .await
                .expect("driver starts");
            // b learns from the driver's hello that the driver does not serve ucx before
            // it forwards anything there (a send routed before the hello would offer ucx
            // and be refused).
            node.connect("b").await.expect("connect to b");
            let deadline = Instant::now() + Duration::from_secs(20);
            // One round trip first: a's first forward to b is routed before b's hello
            // reaches a, and takes the rule's next transport (tcp) then.
            round_trip(&node, "a", "b", 99, 64, deadline)
                .await
                .unwrap_or_else(|e| panic!("a → b warm-up: {e}"));
            let m = metrics[0].clone();
            let before = tokio::task::spawn_blocking(move || {
                metric_sum(&m, "ferry_transfer_bytes_total", "transport=\"ucx\"")
            })
            .await
            .expect("metrics");
            let sizes = [4097usize, 1 << 20, 16 << 20];
            for (tag, len) in sizes.iter().enumerate() {
                round_trip(&node, "a", "b", tag as u64, *len, deadline)
                    .await
                    .unwrap_or_else(|e| panic!("a → b over ucx: {e}"));
            }
            let m = metrics[0].clone();
            let over_ucx = tokio::task::spawn_blocking(move || {
                metric_sum(&m, "ferry_transfer_bytes_total", "transport=\"ucx\"")
            })
            .await
            .expect("metrics");
            assert_eq!(
                over_ucx - before,
                sizes.iter().sum::<usize>() as f64,
                "a's bytes over ucx"
            );
            memory_back_to_baseline(&node, &metrics).await;
            node.shutdown().await;
        });
    });
    drop((a, b));
}

/// A Prometheus sample of the served node at `addr` (series as rendered, labels included),
/// read off the test's runtime threads.
async fn sample(addr: &str, series: &str) -> Option<f64> {
    let (addr, series) = (addr.to_string(), series.to_string());
    tokio::task::spawn_blocking(move || common::metric(&addr, &series))
        .await
        .expect("metrics thread")
}

/// Waits (`limit` at most) until sample `series` of every node at `addrs` is `want`.
async fn wait_for_sample(addrs: &[String], series: &str, want: f64, limit: Duration) {
    for addr in addrs {
        let reached = eventually(limit, async || sample(addr, series).await == Some(want)).await;
        assert!(
            reached,
            "{series} at {addr} is {:?}, want {want}",
            sample(addr, series).await
        );
    }
}

/// Peer discovery by DNS, with real name resolution: each host's `/etc/hosts` (bind-mounted
/// by `ip netns exec` from `/etc/netns/NS/hosts`, read by glibc's `getaddrinfo` like any
/// lookup) gives the name `ferry-peers.bed.test` several A records, and every `ferry serve`
/// is configured with that name and a port only, no `[[peers]]`. Hosts a, b and c find each
/// other and the driver (the hub's address is a record too; each also finds itself, and
/// skips it), and bytes cross a ring a → b → c → driver intact. A fourth host d, whose own
/// file names only itself and the driver, is added to the others' files: they dial it after
/// their next lookup, and a ring through d works. Taken out of the files, d keeps its live
/// links (DNS lags); once its serve is killed they end, sends to it fail, and nobody dials
/// it again.
#[test]
fn peers_found_by_dns_join_and_leave() {
    const NAME: &str = "ferry-peers.bed.test";
    let Some(bed) = Bed::new(4) else { return };
    let addrs: Vec<_> = bed.hosts.iter().map(|h| h.addr).collect();
    let hosts_file = |records: &[std::net::Ipv4Addr]| -> String {
        records.iter().map(|a| format!("{a} {NAME}\n")).collect()
    };
    let abc_hub = [addrs[0], addrs[1], addrs[2], HUB_ADDR];
    let abcd_hub = [addrs[0], addrs[1], addrs[2], addrs[3], HUB_ADDR];
    for i in 0..3 {
        bed.write_hosts(i, &hosts_file(&abc_hub));
    }
    bed.write_hosts(3, &hosts_file(&[addrs[3], HUB_ADDR]));
    let discovery = format!(
        "{LIMITS}\n[discovery]\nmode = \"dns\"\ndns = [{{ name = \"{NAME}\", port = {NODE_PORT} }}]\ninterval = \"1s\"\n"
    );
    let names = ["a", "b", "c", "d"];
    let config =
        |i: usize| bed.serve_config(i, names[i], NODE_PORT, &bed.host_id(i), &[], &discovery);
    let roles = ["forward=b", "forward=c", "forward=driver"];
    let served: Vec<_> = (0..3).map(|i| bed.serve(i, &config(i), roles[i])).collect();
    let metrics: Vec<String> = served.iter().map(|s| s.metrics_addr()).collect();
    let limit = Duration::from_secs(20);

    bed.in_hub(|| {
        runtime().block_on(async {
            let node = Node::start(driver_config(&bed, &[], ""))
                .await
                .expect("driver starts");
            // Each of a, b, c: the other two and the driver (its own address skipped).
            wait_for_sample(&metrics, "ferry_peers_connected", 3.0, limit).await;
            wait_for_sample(&metrics, "ferry_discovery_addresses", 4.0, limit).await;
            let mut peers = node.connected_peers().await.expect("peers");
            peers.sort();
            assert_eq!(peers, ["a", "b", "c"], "they dialled the driver");
            let deadline = Instant::now() + Duration::from_secs(30);
            let sizes = [1usize, 4097, (1 << 20) + 3, 16 << 20];
            for (tag, &len) in sizes.iter().enumerate() {
                round_trip(&node, "a", "c", tag as u64, len, deadline)
                    .await
                    .unwrap_or_else(|e| panic!("{len} B around a → b → c: {e}"));
            }

            // d joins: it dials the driver (its file names no one else) ...
            let d = bed.serve(3, &config(3), "forward=a");
            let d_metrics = [d.metrics_addr()];
            wait_for_sample(&d_metrics, "ferry_peers_connected", 1.0, limit).await;
            // ... and a, b, c dial d once their next lookup gives its address.
            for i in 0..3 {
                bed.write_hosts(i, &hosts_file(&abcd_hub));
            }
            wait_for_sample(&d_metrics, "ferry_peers_connected", 4.0, limit).await;
            wait_for_sample(&metrics, "ferry_peers_connected", 4.0, limit).await;
            let deadline = Instant::now() + Duration::from_secs(20);
            // d forwards to a over the link a dialled: d knows a from nowhere else.
            round_trip(&node, "d", "c", 10, 3 << 20, deadline)
                .await
                .unwrap_or_else(|e| panic!("around d → a → b → c: {e}"));

            // d leaves DNS: its live links stay ...
            for i in 0..3 {
                bed.write_hosts(i, &hosts_file(&abc_hub));
            }
            wait_for_sample(&metrics, "ferry_discovery_addresses", 4.0, limit).await;
            assert_eq!(
                sample(&d_metrics[0], "ferry_peers_connected").await,
                Some(4.0),
                "d's links were cut when it left DNS"
            );
            let deadline = Instant::now() + Duration::from_secs(20);
            round_trip(&node, "d", "c", 11, 1 << 20, deadline)
                .await
                .unwrap_or_else(|e| panic!("through d after it left DNS: {e}"));

            // ... until its serve dies: then its links end, and no one dials it again.
            let dial_failures = |m: Vec<String>| async move {
                let mut counts = Vec::new();
                for addr in &m {
                    counts.push(sample(addr, "ferry_dial_failures_total").await);
                }
                counts
            };
            let failures_before = dial_failures(metrics.clone()).await;
            drop(d);
            wait_for_sample(&metrics, "ferry_peers_connected", 3.0, limit).await;
            let gone = eventually(limit, async || {
                !node
                    .connected_peers()
                    .await
                    .is_ok_and(|p| p.iter().any(|n| n == "d"))
            })
            .await;
            assert!(gone, "the driver still has a link to d");
            let buffer = pattern(&node, 1000, 12).await;
            let started = Instant::now();
            let err = node
                .send_by("d", 12, buffer, Instant::now() + Duration::from_secs(10))
                .await
                .expect_err("d is gone");
            assert!(
                matches!(err.kind(), ErrorKind::PeerLost | ErrorKind::PeerUnreachable),
                "{err}"
            );
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "{err} took {:?}",
                started.elapsed()
            );
            drop(err);
            // Three more rounds of lookups at each of a, b, c: not one dial of d.
            let lookups = "ferry_discovery_lookups_total{outcome=\"ok\"}";
            for addr in &metrics {
                let before = sample(addr, lookups).await.unwrap_or(0.0);
                let more = eventually(Duration::from_secs(10), async || {
                    sample(addr, lookups)
                        .await
                        .is_some_and(|n| n >= before + 3.0)
                })
                .await;
                assert!(more, "{addr} stopped looking up {NAME}");
            }
            assert_eq!(
                dial_failures(metrics.clone()).await,
                failures_before,
                "a node dialled d after it left DNS and died"
            );
            assert_eq!(
                sample(&metrics[0], "ferry_peers_connected").await,
                Some(3.0)
            );
            // The rest carry on.
            let deadline = Instant::now() + Duration::from_secs(20);
            round_trip(&node, "a", "c", 13, 1 << 20, deadline)
                .await
                .unwrap_or_else(|e| panic!("around a → b → c after d left: {e}"));
            memory_back_to_baseline(&node, &metrics).await;
            node.shutdown().await;
        });
    });

    // `ferry explain` inside host a, with the same discovery and a name of its own, finds b
    // by DNS and dials only it.
    let explain_cfg = bed.serve_config(0, "a-explain", 7071, &bed.host_id(0), &[], &discovery);
    let report = bed.explain(0, &explain_cfg, "b");
    assert_eq!(report["setup"]["connected"], true, "{report:#}");
    assert_eq!(report["locality"], "remote", "{report:#}");
    drop(served);
}
