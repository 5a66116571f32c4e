//! Publish and fetch between nodes on loopback, where a flight fails or waits: every caller
//! of a failed flight gets its error, a caller that goes away cancels no other, unpublish
//! waits for a fetch being served, a key published for other peers is refused, and an
//! exporter killed mid-flight fails every caller at once. (Fetches over every transport,
//! 16 callers crossing the link once: `conformance/checks/fetch.rs`.)

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Scratch, Served, eventually, patterned};
use ferry::echo::TAG_PUBLISH;
use ferry::{Error, ErrorKind, Fetch, MemoryKind, Node, RefusalReason};

/// An exporter node and a fetcher node of this process, linked over TCP; `fetcher_extra`
/// goes into the fetcher's configuration.
async fn pair(scratch: &Scratch, fetcher_extra: &str) -> (Arc<Node>, Arc<Node>) {
    let exporter = Node::start(scratch.config("exporter", &[], ""))
        .await
        .expect("exporter starts");
    let address = exporter.tcp_addrs()[0].clone();
    let fetcher = Node::start(scratch.config("fetcher", &[("exporter", &address)], fetcher_extra))
        .await
        .expect("fetcher starts");
    fetcher.connect("exporter").await.expect("connect");
    (Arc::new(exporter), Arc::new(fetcher))
}

async fn granted(node: &Node) -> u64 {
    node.memory(MemoryKind::Host)
        .await
        .expect("stats")
        .budget
        .granted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_flight_fails_every_caller() {
    let scratch = Scratch::new();
    // The fetcher cannot hold 4 MiB: the exporter's send of it is refused.
    let (exporter, fetcher) = pair(&scratch, "[memory]\nhost = \"1 MiB\"\n").await;
    let before = granted(&fetcher).await;
    exporter
        .publish("big", patterned(&exporter, 4 << 20, 1).await)
        .expect("publish");
    let fetches = (0..16).map(|_| fetcher.fetch("exporter", "big", Fetch::default()));
    let results = futures::future::join_all(fetches).await;
    let errors: Vec<String> = results
        .into_iter()
        .map(|r| r.expect_err("too large for the fetcher").to_string())
        .collect();
    assert!(
        errors.iter().all(|e| e == &errors[0]),
        "every caller gets the flight's error: {errors:?}"
    );
    assert!(errors[0].contains("too large"), "{}", errors[0]);
    // Usually one flight that 15 joined; a caller seated only after a failed flight landed
    // (this thread preempted on a loaded machine) starts, and fails, a flight of its own.
    let stats = fetcher.fetch_stats();
    assert_eq!(stats.flights + stats.joined, 16, "{stats:?}");
    assert!(stats.flights >= 1 && stats.bytes_saved == 0, "{stats:?}");
    let published = exporter.publication("big").expect("still published");
    assert_eq!((published.served, published.reading), (0, 0));
    assert_eq!(
        granted(&fetcher).await,
        before,
        "nothing held at the fetcher"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_goes_away_cancels_no_other() {
    let scratch = Scratch::new();
    let (exporter, fetcher) = pair(&scratch, "").await;
    let want = patterned(&exporter, 8 << 20, 2)
        .await
        .to_vec()
        .expect("read");
    exporter
        .publish("k", patterned(&exporter, 8 << 20, 2).await)
        .expect("publish");
    let mut callers: Vec<_> = (0..4)
        .map(|_| Box::pin(fetcher.fetch("exporter", "k", Fetch::default())))
        .collect();
    // Each polled once: the first started the flight, the others joined it.
    for caller in &mut callers {
        assert!(futures::poll!(caller.as_mut()).is_pending());
    }
    // The one that started it goes away.
    drop(callers.remove(0));
    for (i, caller) in callers.into_iter().enumerate() {
        let got = caller.await.unwrap_or_else(|e| panic!("caller {i}: {e}"));
        assert!(got.joined);
        assert!(got.buffer.to_vec().expect("read") == want, "caller {i}");
    }
    assert_eq!(fetcher.fetch_stats().flights, 1);
    let served = exporter.publication("k").expect("published");
    assert_eq!(served.served, 1, "served once");
    assert_eq!(served.bytes_served, 8 << 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublish_waits_for_a_fetch_being_served() {
    let scratch = Scratch::new();
    let (exporter, fetcher) = pair(&scratch, "[memory]\nhost = \"8 MiB\"\n").await;
    exporter
        .publish("k", patterned(&exporter, 4 << 20, 3).await)
        .expect("publish");
    // The fetcher's whole budget is taken: the answer waits for memory there.
    let hog = fetcher
        .alloc(MemoryKind::Host, 8 << 20)
        .await
        .expect("take the budget");
    let fetch = tokio::spawn({
        let fetcher = Arc::clone(&fetcher);
        async move { fetcher.fetch("exporter", "k", Fetch::default()).await }
    });
    let reading = eventually(Duration::from_secs(5), async || {
        exporter.publication("k").is_some_and(|p| p.reading == 1)
    })
    .await;
    assert!(reading, "the exporter serves the fetch");
    let unpublish = tokio::spawn({
        let exporter = Arc::clone(&exporter);
        async move { exporter.unpublish("k").await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !unpublish.is_finished(),
        "unpublish returned while a peer reads the buffer"
    );
    assert!(
        exporter.publication("k").is_none(),
        "no new fetch finds the key meanwhile"
    );
    drop(hog);
    let got = fetch.await.expect("joined").expect("the fetch ends well");
    let back = unpublish.await.expect("joined").expect("unpublished");
    assert!(back.is_exclusive(), "nobody else holds the buffer");
    assert!(got.buffer.to_vec().expect("read") == back.to_vec().expect("read"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_published_for_other_peers_is_refused() {
    let scratch = Scratch::new();
    let (exporter, fetcher) = pair(&scratch, "").await;
    exporter
        .publish_for("k", patterned(&exporter, 100, 4).await, &["someone-else"])
        .expect("publish");
    let e = fetcher
        .fetch("exporter", "k", Fetch::default())
        .await
        .expect_err("not for us");
    assert!(
        matches!(
            e,
            Error::Refused {
                reason: RefusalReason::NotAllowed,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("not for fetcher"), "{e}");
    assert_eq!(exporter.publication("k").map(|p| p.refused), Some(1));
    // Published twice under one key: refused, the buffer comes back.
    let again = exporter
        .publish("k", patterned(&exporter, 7, 5).await)
        .expect_err("published already");
    assert_eq!(again.buffer.map(|b| b.len()), Some(7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exporter_killed_mid_flight_fails_every_caller() {
    let scratch = Scratch::new();
    let far = scratch.write("echo.toml", &scratch.toml("echo", &[], ""));
    let mut echo = Served::start(&far, "echo");
    let fetcher = Node::start(scratch.config(
        "fetcher",
        &[("echo", &echo.addr)],
        "[memory]\nhost = \"8 MiB\"\n",
    ))
    .await
    .expect("fetcher starts");
    // The echo publishes what it is sent, and says the key.
    drop(
        fetcher
            .send("echo", TAG_PUBLISH, patterned(&fetcher, 4 << 20, 6).await)
            .await
            .expect("send"),
    );
    let answer = fetcher
        .recv(Some("echo"), Some(TAG_PUBLISH))
        .await
        .expect("key");
    let key = String::from_utf8(answer.buffer.to_vec().expect("read")).expect("UTF-8");
    drop(answer);
    // The fetcher's whole budget is taken: the flight waits for memory, then the exporter
    // dies.
    let hog = fetcher
        .alloc(MemoryKind::Host, 8 << 20)
        .await
        .expect("take the budget");
    let fetches = (0..8).map(|_| fetcher.fetch("echo", &key, Fetch::default()));
    let all = futures::future::join_all(fetches);
    let kill = async {
        // Mid-flight: the exporter is serving the fetch (its offer has reached the fetcher,
        // whose reservation for it waits on the budget the hog holds), and nothing ended.
        let serving = eventually(Duration::from_secs(10), async || {
            fetcher
                .memory(MemoryKind::Host)
                .await
                .is_ok_and(|m| m.budget.waiting == 1)
        })
        .await;
        let stats = fetcher.fetch_stats();
        echo.child.kill().expect("SIGKILL");
        (serving, stats, Instant::now())
    };
    let (results, (serving, stats, killed)) = futures::join!(all, kill);
    assert!(serving, "the exporter never served the fetch");
    assert_eq!(
        (stats.flights, stats.joined),
        (1, 7),
        "one flight, every caller on it, when the exporter died"
    );
    let waited = killed.elapsed();
    for r in results {
        let e = r.expect_err("the exporter died");
        assert_eq!(e.kind(), ErrorKind::PeerLost, "{e}");
    }
    assert!(
        waited < Duration::from_secs(3),
        "the callers waited {waited:?} after the exporter died"
    );
    drop(hog);
    let _ = echo.child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_left_alone_takes_the_landing_without_a_copy() {
    let scratch = Scratch::new();
    // Room for the landing, not for a copy of it.
    let (exporter, fetcher) = pair(&scratch, "[memory]\nhost = \"8 MiB\"\n").await;
    let want = patterned(&exporter, 6 << 20, 7)
        .await
        .to_vec()
        .expect("read");
    exporter
        .publish("k", patterned(&exporter, 6 << 20, 7).await)
        .expect("publish");
    let short = Instant::now() + Duration::from_millis(1);
    let mut first = Box::pin(fetcher.fetch(
        "exporter",
        "k",
        Fetch {
            deadline: Some(short),
            ..Fetch::default()
        },
    ));
    let mut second = Box::pin(fetcher.fetch("exporter", "k", Fetch::default()));
    assert!(futures::poll!(first.as_mut()).is_pending());
    assert!(futures::poll!(second.as_mut()).is_pending());
    // The first caller's deadline passes long before the flight lands; the flight goes on
    // for the one that joined, which is left alone with the landing.
    let e = first.await.expect_err("its deadline passed");
    assert!(matches!(e, Error::DeadlineExceeded), "{e}");
    let got = second.await.expect("the joiner lands");
    assert!(got.joined);
    assert!(got.buffer.is_exclusive());
    assert!(got.buffer.to_vec().expect("read") == want);
    assert_eq!(fetcher.fetch_stats().flights, 1);
}
