//! Block lists: scattered blocks of a pool arrive packed in their order, byte-exact; they are
//! received into places of the receiver's own; lists that do not fit are refused before
//! anything moves; and a proptest of lists (counts, sizes, orders, blocks read twice).

use ferry::{Error, Layout, LayoutError, MAX_BLOCKS, MemoryError, MemoryKind};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use super::{Baseline, assert_echo, assert_forward_legs, filled, pattern};
use crate::combos::Combo;
use crate::pair::{CHUNK, Pair, Role, Tweaks};

/// A pool of `slots` pages of `page` bytes, `count` of them at places spread over it, in an
/// order that is not the pool's: a paged KV cache's blocks.
fn pages(page: u64, count: u64, slots: u64) -> (Layout, usize) {
    // Slot `i * 7919 mod slots` for i in 0..count: distinct (7919 is prime and slots is not
    // a multiple of it), scattered, out of order.
    let list = (0..count).map(|i| ((i * 7919 % slots) * page, page));
    (Layout::blocks(list), (slots * page) as usize)
}

/// The block lists every combination sends, each with the length of the buffer that holds
/// it; with `large`, 1,000 blocks of 16 KiB from a 64 MiB pool (issue 19's case).
fn block_lists(large: bool) -> Vec<(Layout, usize)> {
    let chunk = CHUNK as u64;
    let mut all = vec![
        // One byte at the very end, and the buffer's first byte.
        (Layout::blocks([(99, 1), (0, 1)]), 100),
        pages(4096, 64, 257),
        // Sizes around a chunk, so that blocks start and end inside chunks and one spans
        // several.
        (
            Layout::blocks([
                (3 * chunk, chunk + 1),
                (1, chunk - 1),
                (chunk, 7),
                (5 * chunk, 2 * chunk + 3),
            ]),
            (7 * chunk + 100) as usize,
        ),
        // Blocks that follow each other from the start: the buffer's first bytes.
        (Layout::blocks([(0, 1000), (1000, 24)]), 4096),
        // Blocks read twice (they overlap at the sender: harmless).
        (Layout::blocks([(0, 5000), (4000, 5000), (0, 100)]), 9000),
        // Many small blocks, more than a chunk of them.
        (
            Layout::blocks((0..5000).map(|i| ((4999 - i) * 16 + i % 8, 8))),
            80_000,
        ),
    ];
    if large {
        all.push(pages(16 << 10, 1000, 4096));
    }
    all
}

/// Places in a buffer of the receiver's own for the packed bytes of `layout`: blocks of the
/// same lengths, in reverse order, a gap of 3 bytes before each. Returns them and the
/// buffer's length.
fn places_for(layout: &Layout) -> (Layout, usize) {
    let lens: Vec<u64> = layout
        .block_list()
        .expect("a block list")
        .iter()
        .map(|b| b.len)
        .collect();
    let mut at = 0;
    let mut places = vec![(0, 0); lens.len()];
    for (i, &len) in lens.iter().enumerate().rev() {
        at += 3;
        places[i] = (at, len);
        at += len;
    }
    (Layout::blocks(places), at as usize + 5)
}

/// Every block list crosses packed in its order, byte-exact (the far node of this process
/// is told the list), and is received into places of the receiver's own in the destination
/// memory (and, on a GPU, from packed bytes in host memory); a list whose blocks overlap
/// (sent, as it may be) is refused as a destination before a byte is written; lists that
/// do not fit their buffer are refused before anything moves, naming why, with the buffer
/// back; then a proptest of lists over the same pair.
pub async fn block_lists_arrive_packed(combo: Combo, first: bool) {
    let pair = Pair::start(&combo, Role::Echo, &Tweaks::default()).await;
    pair.warm_up().await;
    let baseline = Baseline::take(&pair.node, &combo).await;
    let node = &pair.node;
    let sent = block_lists(first);
    for (i, (layout, len)) in sent.iter().enumerate() {
        let (tag, len) = (100 + i as u64, *len);
        let what = format!(
            "{} blocks in {len} bytes",
            layout.block_list().map_or(0, <[_]>::len)
        );
        let whole = pattern(len, 140 + tag);
        let packed = layout.check(len as u64).expect("fits") as usize;
        let mut want = vec![0u8; packed];
        layout.gather(&whole, 0, &mut want).expect("gather");
        let buffer = filled(node, combo.src_kind(), &whole).await;
        let back = node
            .send_layout(&pair.peer, tag, buffer, layout.clone())
            .await
            .unwrap_or_else(|e| panic!("{combo}: send {what}: {e}"));
        assert!(
            back.to_vec().expect("read") == whole,
            "{combo}: {what}: the sender's buffer changed"
        );
        drop(back);
        let got = pair.recv(Some(tag)).await;
        assert_echo(&combo, &got, &want, &what);

        // Received into places of our own: the packed bytes in reverse order, gaps kept.
        let (places, room) = places_for(layout);
        let mut expected = vec![0xAB; room];
        places.scatter(&want, 0, &mut expected).expect("scatter");
        let mut sources = vec![got.buffer];
        if combo.dst_kind() != MemoryKind::Host {
            sources.push(filled(node, MemoryKind::Host, &want).await);
        }
        for from in &sources {
            let mut target = filled(node, combo.dst_kind(), &vec![0xAB; room]).await;
            target
                .scatter_from(from, &places)
                .unwrap_or_else(|e| panic!("{combo}: {what}: scatter from {}: {e}", from.kind()));
            assert!(
                target.to_vec().expect("read") == expected,
                "{combo}: {what}: not received into its places in {} from {}",
                target.kind(),
                from.kind()
            );
            // The sender's own list, as places: refused when its blocks overlap.
            let mut target = filled(node, combo.dst_kind(), &vec![0xCD; len]).await;
            match (
                layout.check_destination(len as u64),
                target.scatter_from(from, layout),
            ) {
                (Ok(_), Ok(())) => {}
                (Err(why), Err(MemoryError::Layout(e))) => {
                    assert_eq!(e, why, "{combo}: {what}");
                    assert!(matches!(e, LayoutError::Overlap { .. }), "{combo}: {e}");
                    assert!(
                        target.to_vec().expect("read") == vec![0xCD; len],
                        "{combo}: {what}: a refused scatter wrote"
                    );
                }
                (want, got) => panic!("{combo}: {what}: scatter {got:?}, want {want:?}"),
            }
        }
    }
    if let Some(seen) = pair.seen() {
        let told: Vec<Layout> = seen.iter().map(|s| s.layout.clone()).collect();
        let want: Vec<Layout> = sent.iter().map(|(l, _)| l.clone()).collect();
        assert!(told == want, "{combo}: the far node was told other lists");
    }
    assert_forward_legs(&pair);

    // Refused before anything moves, naming the cause; the buffer comes back.
    let len = 4096;
    let refusals = [
        (
            Layout::blocks([(0, 10), (4090, 7)]),
            "block 1 reaches byte 4097 of a buffer of 4096",
        ),
        (Layout::blocks([(0, 10), (20, 0)]), "block 1 is empty"),
        (Layout::blocks([]), "the block count is zero"),
        (Layout::blocks([(u64::MAX - 1, 4)]), "overflows"),
        (
            Layout::blocks((0..=MAX_BLOCKS as u64).map(|i| (i % 4096, 1))),
            "65537 blocks, more than the 65536",
        ),
    ];
    for (k, (layout, why)) in refusals.into_iter().enumerate() {
        let tag = 160 + k as u64;
        let buffer = filled(node, combo.src_kind(), &pattern(len, tag)).await;
        let err = node
            .send_layout(&pair.peer, tag, buffer, layout)
            .await
            .expect_err("a list that does not fit");
        assert!(matches!(err.error, Error::Usage(_)), "{combo}: {err}");
        assert!(err.to_string().contains(why), "{combo}: {err}");
        assert_eq!(
            err.buffer.map(|b| b.len()),
            Some(len),
            "{combo}: buffer back"
        );
    }
    // Nothing of them reached the peer: the next echo is the next good send's.
    let buffer = filled(node, combo.src_kind(), &pattern(10, 170)).await;
    drop(node.send(&pair.peer, 170, buffer).await.expect("send"));
    assert_eq!(
        pair.recv(None).await.tag,
        170,
        "{combo}: a refused list was sent"
    );

    proptest_lists(&pair, first).await;
    baseline.assert_back(node, &combo).await;
}

/// Block lists with the length of a buffer that holds them: 1 to 48 blocks of 1 byte to
/// twice a chunk, apart or touching, in any order, some read twice.
fn lists() -> impl Strategy<Value = (Vec<(u64, u64)>, usize)> {
    let chunk = CHUNK as u64;
    let size = prop_oneof![1u64..64, 64u64..8192, chunk - 10..2 * chunk];
    (
        proptest::collection::vec((size, 0u64..3000), 1..48),
        proptest::collection::vec(any::<proptest::sample::Index>(), 0..3),
        0u64..100,
    )
        .prop_flat_map(|(sizes, twice, tail)| {
            let mut at = 0;
            let mut list = Vec::new();
            for (len, gap) in sizes {
                at += gap;
                list.push((at, len));
                at += len;
            }
            let again: Vec<(u64, u64)> = twice.iter().map(|i| *i.get(&list)).collect();
            list.extend(again);
            (Just(list).prop_shuffle(), Just((at + tail) as usize))
        })
}

/// The proptest: lists from [`lists`] (a dozen, two dozen on the first combination of a
/// transport) cross byte-exact, packed in their order. Runs the runner on this thread (it
/// is not async), each case driving the pair through the runtime's handle.
async fn proptest_lists(pair: &Pair, first: bool) {
    let combo = &pair.combo;
    let handle = tokio::runtime::Handle::current();
    let cases = if first { 24 } else { 12 };
    let tags = std::cell::Cell::new(1000);
    let outcome = tokio::task::block_in_place(|| {
        let mut runner = TestRunner::new(Config {
            cases,
            max_shrink_iters: 32,
            failure_persistence: None,
            ..Config::default()
        });
        runner.run(&lists(), |(list, len)| {
            let tag = tags.get() + 1;
            tags.set(tag);
            let layout = Layout::blocks(list);
            let whole = pattern(len, tag);
            let packed = layout.check(len as u64).expect("generated to fit") as usize;
            let mut want = vec![0u8; packed];
            layout.gather(&whole, 0, &mut want).expect("gather");
            let got = handle.block_on(async {
                let buffer = filled(&pair.node, combo.src_kind(), &whole).await;
                let sent = pair
                    .node
                    .send_layout(&pair.peer, tag, buffer, layout.clone())
                    .await;
                (sent.map_err(|e| e.to_string()), pair.recv(Some(tag)).await)
            });
            let (sent, got) = got;
            sent.map_err(TestCaseError::fail)?;
            let bytes = got.buffer.to_vec().expect("read the echo");
            prop_assert!(bytes == want, "{combo}: other bytes came back");
            Ok(())
        })
    });
    if let Err(e) = outcome {
        panic!("{combo}: block lists: {e}");
    }
}
