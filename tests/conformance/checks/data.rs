//! What arrives: every size byte for byte, every layout, in order.

use std::time::Duration;

use ferry::{Error, Layout, MemoryKind};
use ferry_config::{Locality, TransportName};

use super::{Baseline, assert_echo, assert_forward_legs, filled, pattern};
use crate::combos::Combo;
use crate::pair::{CHUNK, Pair, Role, Tweaks};

/// Sizes every combination sends (around a chunk's size too); `LARGE` once per transport.
const SIZES: [usize; 8] = [0, 1, 7, 4096, CHUNK - 1, CHUNK, CHUNK + 1, (1 << 20) + 3];
const LARGE: usize = 64 << 20;

/// Buffers of every size go to the echo and come back byte-exact, over the transport, into
/// the destination memory; the sender's buffer comes back unchanged; every chunk of a staged
/// transfer to a same-host peer goes through the shared ring, and none to a remote one.
pub async fn sizes_arrive_byte_exact(combo: Combo, first: bool) {
    let pair = Pair::start(&combo, Role::Echo, &Tweaks::default()).await;
    pair.assert_routed_as_declared().await;
    pair.warm_up().await;
    let baseline = Baseline::take(&pair.node, &combo).await;
    let ring_before = pair.far_ring_chunks();
    let sizes: Vec<usize> = SIZES
        .iter()
        .copied()
        .chain(first.then_some(LARGE))
        .collect();
    // Sizes whose send failed: every size is tried, the failures listed at the end.
    let mut failed = Vec::new();
    for (i, &len) in sizes.iter().enumerate() {
        let tag = i as u64;
        let want = pattern(len, tag + 1);
        let buffer = filled(&pair.node, combo.src_kind(), &want).await;
        let back = match pair.node.send(&pair.peer, tag, buffer).await {
            Ok(back) => back,
            Err(e) => {
                failed.push(format!("{len} bytes: {e}"));
                continue;
            }
        };
        assert_eq!(
            back.kind(),
            combo.src_kind(),
            "{combo}: the sender's buffer"
        );
        assert!(
            back.to_vec().expect("read") == want,
            "{combo}: the sender's buffer of {len} bytes changed"
        );
        drop(back);
        let got = pair.recv(Some(tag)).await;
        assert_echo(&combo, &got, &want, &format!("{len} bytes"));
    }
    assert!(failed.is_empty(), "{combo}: sends failed: {failed:?}");
    assert_forward_legs(&pair);
    // Which path staged took (the far process counts the chunks it took from a ring).
    if let (Some(before), Some(after)) = (ring_before, pair.far_ring_chunks()) {
        let ring =
            combo.transport() == TransportName::Staged && combo.locality == Locality::SameHost;
        if ring {
            let chunks: usize = sizes.iter().map(|len| len.div_ceil(CHUNK).max(1)).sum();
            assert_eq!(
                after - before,
                chunks as f64,
                "{combo}: chunks the far node took from the shared ring"
            );
        } else {
            assert_eq!(after, before, "{combo}: chunks went through a shared ring");
        }
    }
    baseline.assert_back(&pair.node, &combo).await;
}

/// The layouts every combination sends, each with the length of the buffer that holds it;
/// with `large`, also 16384 rows of 4 KiB at an 8 KiB pitch (64 MiB of 128).
fn layouts(large: bool) -> Vec<(Layout, usize)> {
    let mut all = vec![
        (Layout::Contiguous, 100_003),
        // Rows that touch: the buffer's first bytes, not the whole buffer.
        (
            Layout::Strided2D {
                rows: 1,
                row_bytes: 3,
                pitch: 3,
            },
            5,
        ),
        (
            Layout::Strided2D {
                rows: 333,
                row_bytes: 1001,
                pitch: 1536,
            },
            332 * 1536 + 1001 + 9,
        ),
        (
            Layout::Strided3D {
                depth: 5,
                rows: 17,
                row_bytes: 300,
                pitch: 512,
                plane_rows: 20,
            },
            (4 * 20 + 16) * 512 + 300,
        ),
    ];
    all.extend(crate::common::strided_layouts());
    if large {
        all.push((
            Layout::Strided2D {
                rows: 16384,
                row_bytes: 4096,
                pitch: 8192,
            },
            16383 * 8192 + 4096,
        ));
    }
    all
}

/// Every layout crosses packed, byte-exact (the far node of this process also sees the
/// layout it was sent with), and is received into a layout in the destination memory (and,
/// on a GPU, from rows in host memory); one buffer sent again as a shorter, the whole and a
/// longer layout; a layout that does not fit is refused before anything moves, naming why,
/// with the buffer back.
pub async fn every_layout_arrives_packed(combo: Combo, first: bool) {
    let pair = Pair::start(&combo, Role::Echo, &Tweaks::default()).await;
    pair.warm_up().await;
    let baseline = Baseline::take(&pair.node, &combo).await;
    let node = &pair.node;
    let sent = layouts(first);
    for (i, (layout, len)) in sent.iter().enumerate() {
        let len = *len;
        let tag = i as u64;
        let whole = pattern(len, 40 + tag);
        let packed = layout.check(len as u64).expect("fits") as usize;
        let mut want = vec![0u8; packed];
        layout.gather(&whole, 0, &mut want).expect("gather");
        let buffer = filled(node, combo.src_kind(), &whole).await;
        let back = node
            .send_layout(&pair.peer, tag, buffer, layout.clone())
            .await
            .unwrap_or_else(|e| panic!("{combo}: send {layout:?}: {e}"));
        assert!(
            back.to_vec().expect("read") == whole,
            "{combo}: {layout:?}: the sender's buffer changed"
        );
        drop(back);
        let got = pair.recv(Some(tag)).await;
        assert_echo(&combo, &got, &want, &format!("{layout:?}"));
        // Received into a layout: rows in place, the gaps untouched.
        let mut expected = vec![0xAB; len];
        layout.scatter(&want, 0, &mut expected).expect("scatter");
        let mut sources = vec![got.buffer];
        if combo.dst_kind() != MemoryKind::Host {
            sources.push(filled(node, MemoryKind::Host, &want).await);
        }
        for from in &sources {
            let mut target = filled(node, combo.dst_kind(), &vec![0xAB; len]).await;
            target.scatter_from(from, layout).unwrap_or_else(|e| {
                panic!("{combo}: {layout:?}: scatter from {}: {e}", from.kind())
            });
            assert!(
                target.to_vec().expect("read") == expected,
                "{combo}: {layout:?}: not received into the layout in {} from {} rows",
                target.kind(),
                from.kind()
            );
        }
    }
    if let Some(seen) = pair.seen() {
        let layouts: Vec<Layout> = seen.iter().map(|s| s.layout.clone()).collect();
        let want: Vec<Layout> = sent.iter().map(|(l, _)| l.clone()).collect();
        assert_eq!(layouts, want, "{combo}: the layouts the far node was told");
        for (s, (layout, len)) in seen.iter().zip(&sent) {
            let packed = layout.check(*len as u64).expect("fits") as usize;
            assert_eq!(s.len, packed, "{combo}: {layout:?} arrived as");
        }
    }
    assert_forward_legs(&pair);

    // One buffer sent again and again: a short layout, the whole buffer, a longer layout
    // (a pull keeps the buffer mapped between them; a longer read remaps it).
    let len = 1 << 20;
    let whole = pattern(len, 77);
    let mut buffer = filled(node, combo.src_kind(), &whole).await;
    let shapes = [
        Layout::Strided2D {
            rows: 2,
            row_bytes: 4,
            pitch: 8,
        },
        Layout::Contiguous,
        Layout::Strided2D {
            rows: 100,
            row_bytes: 1000,
            pitch: 10000,
        },
    ];
    for (k, layout) in shapes.into_iter().enumerate() {
        let tag = 50 + k as u64;
        let packed = layout.check(len as u64).expect("fits") as usize;
        let mut want = vec![0u8; packed];
        layout.gather(&whole, 0, &mut want).expect("gather");
        buffer = node
            .send_layout(&pair.peer, tag, buffer, layout.clone())
            .await
            .unwrap_or_else(|e| panic!("{combo}: again as {layout:?}: {e}"));
        let got = pair.recv(Some(tag)).await;
        assert_echo(
            &combo,
            &got,
            &want,
            &format!("the same buffer again as {layout:?}"),
        );
    }
    drop(buffer);

    // Refused before anything moves, naming the cause; the buffer comes back.
    let refusals = [
        (
            Layout::Strided2D {
                rows: 4,
                row_bytes: 1024,
                pitch: 512,
            },
            "pitch (512 bytes) is smaller than a row",
        ),
        (
            Layout::Strided2D {
                rows: 4,
                row_bytes: 1024,
                pitch: 1100,
            },
            "reaches byte 4324 of a buffer of 4096",
        ),
    ];
    for (k, (layout, why)) in refusals.into_iter().enumerate() {
        let buffer = filled(node, combo.src_kind(), &pattern(4096, 60 + k as u64)).await;
        let err = node
            .send_layout(&pair.peer, 60 + k as u64, buffer, layout)
            .await
            .expect_err("a layout that does not fit");
        assert!(matches!(err.error, Error::Usage(_)), "{combo}: {err}");
        assert!(err.to_string().contains(why), "{combo}: {err}");
        assert_eq!(
            err.buffer.map(|b| b.len()),
            Some(4096),
            "{combo}: buffer back"
        );
    }
    // Nothing of them reached the peer: the next echo is the next good send's.
    let buffer = filled(node, combo.src_kind(), &pattern(10, 70)).await;
    drop(node.send(&pair.peer, 70, buffer).await.expect("send"));
    assert_eq!(
        pair.recv(None).await.tag,
        70,
        "{combo}: a refused layout was sent"
    );
    baseline.assert_back(node, &combo).await;
}

/// Sends of mixed sizes made at once arrive in the order they were first polled, there and
/// back, byte-exact.
pub async fn order_per_peer_holds_under_mixed_sizes(combo: Combo, _first: bool) {
    order_holds(combo, None).await;
}

/// As [`order_per_peer_holds_under_mixed_sizes`], under backpressure: a peer queue of 4 at
/// both nodes, so that most sends wait for one before them to end.
pub async fn order_holds_under_backpressure(combo: Combo, _first: bool) {
    order_holds(combo, Some(4)).await;
}

async fn order_holds(combo: Combo, peer_queue: Option<usize>) {
    let tweaks = Tweaks {
        limits: peer_queue
            .map(|n| format!("peer_queue = {n}"))
            .into_iter()
            .collect(),
        ..Tweaks::default()
    };
    let pair = Pair::start(&combo, Role::Echo, &tweaks).await;
    pair.warm_up().await;
    let baseline = Baseline::take(&pair.node, &combo).await;
    let node = &pair.node;
    let sizes = [8usize, 1, 300_000, 4099, (1 << 20) + 3, 100, 0, 8];
    let count = sizes.len() * 3;
    let mut buffers = Vec::new();
    let mut wants = Vec::new();
    for i in 0..count {
        let want = pattern(sizes[i % sizes.len()], 100 + i as u64);
        buffers.push(filled(node, combo.src_kind(), &want).await);
        wants.push(want);
    }
    // The order is that of the sends' first polls: each is polled once as it is made.
    let mut sends = Vec::new();
    for (i, b) in buffers.into_iter().enumerate() {
        let mut send = Box::pin(futures::future::maybe_done(
            node.send(&pair.peer, i as u64, b),
        ));
        let _ = futures::poll!(send.as_mut());
        sends.push(send);
    }
    // Every echo, until one does not come for 5 s.
    let receive = async {
        let mut got = Vec::new();
        while got.len() < count {
            match tokio::time::timeout(Duration::from_secs(5), node.recv(Some(&pair.peer), None))
                .await
            {
                Ok(r) => got.push(r.expect("recv")),
                Err(_) => break,
            }
        }
        got
    };
    let ((), got) = futures::future::join(
        async {
            futures::future::join_all(sends.iter_mut().map(|s| s.as_mut())).await;
        },
        receive,
    )
    .await;
    let failed: Vec<String> = sends
        .iter_mut()
        .enumerate()
        .filter_map(|(i, s)| match s.as_mut().take_output() {
            Some(Ok(_)) => None,
            Some(Err(e)) => Some(format!("send {i}: {e}")),
            None => Some(format!("send {i}: not ended")),
        })
        .collect();
    assert!(failed.is_empty(), "{combo}: {failed:?}");
    let tags: Vec<u64> = got.iter().map(|r| r.tag).collect();
    let want_tags: Vec<u64> = (0..count as u64).collect();
    assert_eq!(tags, want_tags, "{combo}: the order the echoes came in");
    for (i, r) in got.iter().enumerate() {
        assert_echo(&combo, r, &wants[i], &format!("transfer {i}"));
    }
    if let Some(seen) = pair.seen() {
        let tags: Vec<u64> = seen.iter().map(|s| s.tag).collect();
        assert_eq!(
            tags, want_tags,
            "{combo}: the order the far node received in"
        );
    }
    assert_forward_legs(&pair);
    drop(got);
    drop(sends);
    baseline.assert_back(node, &combo).await;
}
