//! Publish and fetch: the far node publishes what it is sent; this node fetches it, 16
//! callers at once (one flight: the far node serves the bytes once), a block list of it, a
//! key that is not published; then the far node unpublishes it and sends it back whole.

use ferry::echo::{TAG_PUBLISH, TAG_UNPUBLISH};
use ferry::{Buffer, Error, Fetch, Layout, MemoryKind, Node, RefusalReason};

use std::time::Duration;

use super::{Baseline, crc, filled, pattern};
use crate::combos::Combo;
use crate::common::eventually;
use crate::pair::{Pair, Role, Tweaks, budget_key};

/// Callers of one key at once.
const CALLERS: usize = 16;

/// Holds what is left of `kind`'s budget at `node` until dropped: a flight's landing waits
/// for memory meanwhile, so every caller takes its seat before the flight can land, however
/// slowly this thread runs.
async fn hold_the_rest(node: &Node, kind: MemoryKind) -> Buffer {
    let budget = node.memory(kind).await.expect("stats").budget;
    let rest = budget.capacity - budget.granted;
    node.alloc(kind, rest as usize)
        .await
        .unwrap_or_else(|e| panic!("hold the {rest} bytes left of {kind}: {e}"))
}

/// The far node publishes a buffer; 16 concurrent fetches of it get its bytes, byte-exact,
/// in the destination memory, over the transport (or tcp where the echo takes tcp), and
/// cross the link once (the far node served it once; 15 joined); a fetch of a block list of
/// it gets the blocks packed; a fetch of a key not published is refused naming it; after
/// unpublish, the buffer comes back unchanged and the key is gone.
pub async fn fetches_cross_once(combo: Combo, first: bool) {
    // A budget small enough to hold all of (room for the landing and 15 copies).
    let tweaks = Tweaks {
        memory: vec![format!("{} = \"128 MiB\"", budget_key(combo.dst))],
        ..Tweaks::default()
    };
    let pair = Pair::start(&combo, Role::Echo, &tweaks).await;
    pair.warm_up().await;
    let baseline = Baseline::take(&pair.node, &combo).await;
    let node = &pair.node;
    let len = if first {
        (4 << 20) + 17
    } else {
        (64 << 10) + 3
    };
    let whole = pattern(len, 190);
    let sent = filled(node, combo.src_kind(), &whole).await;
    drop(
        node.send(&pair.peer, TAG_PUBLISH, sent)
            .await
            .expect("send"),
    );
    let key = pair
        .recv(Some(TAG_PUBLISH))
        .await
        .buffer
        .to_vec()
        .expect("key");
    let key = String::from_utf8(key).expect("a UTF-8 key");

    let served = pair.far_fetches_served(&key);
    let before = node.fetch_stats();
    let hold = hold_the_rest(node, combo.dst_kind()).await;
    let fetches = (0..CALLERS).map(|_| node.fetch(&pair.peer, &key, Fetch::default()));
    // Every caller is seated at the first poll, then the memory is let go.
    let (got, ()) = futures::join!(futures::future::join_all(fetches), async { drop(hold) });
    let over = if combo.echo_returns_over_it() {
        combo.name()
    } else {
        "tcp"
    };
    let mut joined = 0;
    for (i, fetched) in got.into_iter().enumerate() {
        let fetched = fetched.unwrap_or_else(|e| panic!("{combo}: fetch {i}: {e}"));
        joined += usize::from(fetched.joined);
        assert_eq!(
            fetched.transport.as_str(),
            over,
            "{combo}: fetch {i} came over"
        );
        assert_eq!(
            fetched.buffer.kind(),
            combo.dst_kind(),
            "{combo}: fetch {i}"
        );
        let bytes = fetched.buffer.to_vec().expect("read");
        assert!(
            bytes == whole,
            "{combo}: fetch {i}: other bytes (crc {:08x}, want {:08x})",
            crc(&bytes),
            crc(&whole)
        );
        assert!(
            fetched.buffer.is_exclusive(),
            "{combo}: fetch {i} is not the caller's own"
        );
    }
    assert_eq!(
        joined,
        CALLERS - 1,
        "{combo}: fetches that joined the flight"
    );
    let stats = node.fetch_stats();
    assert_eq!(stats.flights - before.flights, 1, "{combo}: flights");
    assert_eq!(
        stats.bytes_saved - before.bytes_saved,
        ((CALLERS - 1) * len) as u64,
        "{combo}: bytes saved"
    );
    // The exporter counts a fetch served when the fetcher's `Done` reached it, a moment
    // after the fetcher delivered.
    eventually(Duration::from_secs(2), async || {
        pair.far_fetches_served(&key) > served
    })
    .await;
    assert_eq!(
        pair.far_fetches_served(&key) - served,
        1,
        "{combo}: fetches the far node served with the bytes"
    );

    // A block list of it: the blocks arrive packed.
    let blocks = Layout::blocks([(len as u64 - 5, 5), (0, 100), (1000, 4096), (50, 10)]);
    let mut want = vec![0u8; blocks.check(len as u64).expect("fits") as usize];
    blocks.gather(&whole, 0, &mut want).expect("gather");
    let fetch = Fetch {
        layout: blocks.clone(),
        ..Fetch::default()
    };
    let part = node
        .fetch(&pair.peer, &key, fetch)
        .await
        .unwrap_or_else(|e| panic!("{combo}: fetch blocks: {e}"));
    assert!(
        part.buffer.to_vec().expect("read") == want,
        "{combo}: the blocks fetched"
    );
    drop(part);

    // Shared: one read-only handle, nobody writes it.
    let shared = Fetch {
        shared: true,
        ..Fetch::default()
    };
    let hold = hold_the_rest(node, combo.dst_kind()).await;
    let (a, b, ()) = futures::join!(
        node.fetch(&pair.peer, &key, shared.clone()),
        node.fetch(&pair.peer, &key, shared),
        async { drop(hold) }
    );
    let (mut a, b) = (a.expect("shared fetch"), b.expect("shared fetch"));
    assert!(b.joined, "{combo}: the second shared fetch joined");
    assert!(
        a.buffer.write(0, b"x").is_err(),
        "{combo}: a shared handle was writable while another was held"
    );
    drop((a, b));

    // Into host memory, whatever the landing.
    let into_host = Fetch {
        into: Some(MemoryKind::Host),
        ..Fetch::default()
    };
    let host = node
        .fetch(&pair.peer, &key, into_host)
        .await
        .unwrap_or_else(|e| panic!("{combo}: fetch into host: {e}"));
    assert_eq!(host.buffer.kind(), MemoryKind::Host);
    assert!(host.buffer.to_vec().expect("read") == whole, "{combo}");
    drop(host);

    // A key not published, and a layout that does not fit: refused, naming why.
    let e = node
        .fetch(&pair.peer, "no such key", Fetch::default())
        .await
        .expect_err("unknown key");
    assert!(
        matches!(
            e,
            Error::Refused {
                reason: RefusalReason::UnknownKey,
                ..
            }
        ),
        "{combo}: {e}"
    );
    assert!(e.to_string().contains("no such key"), "{combo}: {e}");
    let past = Fetch {
        layout: Layout::blocks([(len as u64, 1)]),
        ..Fetch::default()
    };
    let e = node
        .fetch(&pair.peer, &key, past)
        .await
        .expect_err("a layout past the end");
    assert!(matches!(e, Error::Usage(_)), "{combo}: {e}");
    assert!(e.to_string().contains("does not fit"), "{combo}: {e}");

    // Unpublished: the far node has it back, unchanged, and the key is gone. (The request
    // goes in the source memory: the combination's transport may move no other.)
    let asked = filled(node, combo.src_kind(), key.as_bytes()).await;
    drop(
        node.send(&pair.peer, TAG_UNPUBLISH, asked)
            .await
            .expect("send"),
    );
    let back = pair.recv(Some(TAG_UNPUBLISH)).await;
    assert!(
        back.buffer.to_vec().expect("read") == whole,
        "{combo}: the unpublished buffer changed"
    );
    drop(back);
    let e = node
        .fetch(&pair.peer, &key, Fetch::default())
        .await
        .expect_err("unpublished");
    assert!(
        matches!(
            e,
            Error::Refused {
                reason: RefusalReason::UnknownKey,
                ..
            }
        ),
        "{combo}: {e}"
    );
    baseline.assert_back(node, &combo).await;
}
