//! Registered regions and one-sided block transfers: this node reads scattered blocks of
//! the far node's region into other places of a region of its own, and writes scattered
//! blocks of its own into other places of the far node's, with a notification that comes
//! after the data; a region registered read-only refuses writes; a key of a region
//! unregistered is refused, read or write, never served.

use ferry::echo::{TAG_REGISTER, TAG_REGISTER_READ_ONLY, TAG_UNREGISTER, decode_key};
use ferry::{Access, Error, Layout, OneSided, Places, RefusalReason, RegionKey};

use super::{Baseline, crc, filled, pattern};
use crate::combos::Combo;
use crate::pair::{Pair, Role, Tweaks};

/// A notification's tag (the echo sends it back, so this node sees it arrived).
const TAG_NOTE: u64 = 77;

/// `count` pages of `page` bytes at scattered places of a region of `slots` pages, out of
/// order; and their places written elsewhere: reversed, shifted by `shift` bytes.
fn scattered(page: u64, count: u64, slots: u64, shift: u64) -> Layout {
    Layout::blocks((0..count).map(|i| ((i * 7919 % slots) * page + shift, page)))
}

/// Asks the far node to register `bytes` (sent in this node's source memory, landing in
/// the far node's) with `tag`'s access; its key.
async fn far_region(pair: &Pair, tag: u64, bytes: &[u8]) -> RegionKey {
    let sent = filled(&pair.node, pair.combo.src_kind(), bytes).await;
    drop(pair.node.send(&pair.peer, tag, sent).await.expect("send"));
    let key = pair.recv(Some(tag)).await.buffer.to_vec().expect("key");
    decode_key(&key).expect("a 24-byte key")
}

/// The far node's region `key`, unregistered: its bytes.
async fn far_bytes(pair: &Pair, key: RegionKey) -> Vec<u8> {
    // In the source memory: the pair's rules route nothing else.
    let ask = filled(&pair.node, pair.combo.src_kind(), &key.to_bytes()).await;
    drop(
        pair.node
            .send(&pair.peer, TAG_UNREGISTER, ask)
            .await
            .expect("send"),
    );
    pair.recv(Some(TAG_UNREGISTER))
        .await
        .buffer
        .to_vec()
        .expect("the region's bytes")
}

/// The bytes of `bytes` that `layout` names, packed.
fn gathered(layout: &Layout, bytes: &[u8]) -> Vec<u8> {
    let len = layout.check(bytes.len() as u64).expect("fits");
    let mut out = vec![0; len as usize];
    layout.gather(bytes, 0, &mut out).expect("gather");
    out
}

/// `bytes` with the packed bytes `packed` put where `layout` says.
fn scatter(bytes: &[u8], layout: &Layout, packed: &[u8]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    layout.scatter(packed, 0, &mut out).expect("scatter");
    out
}

fn assert_same(combo: &Combo, what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{combo}: {what}: length");
    assert!(
        got == want,
        "{combo}: {what}: other bytes (crc {:08x}, want {:08x}; first difference at {:?})",
        crc(got),
        crc(want),
        got.iter().zip(want).position(|(a, b)| a != b)
    );
}

fn assert_refused(
    combo: &Combo,
    what: &str,
    got: Result<impl std::fmt::Debug, Error>,
    want: RefusalReason,
) {
    match got {
        Err(Error::Refused { reason, .. }) if reason == want => {}
        other => panic!("{combo}: {what}: want a refusal ({want}), got {other:?}"),
    }
}

pub async fn regions_read_and_write_block_lists(combo: Combo, first: bool) {
    let pair = Pair::start(&combo, Role::Echo, &Tweaks::default()).await;
    pair.warm_up().await;
    let baseline = Baseline::take(&pair.node, &combo).await;
    let node = &pair.node;
    // 1,000 pages of 16 KiB out of a 64 MiB region (a KV cache) once per transport; else
    // 64 pages of 4 KiB out of 1 MiB.
    let (page, count, slots) = if first {
        (16 << 10, 1000, 4096)
    } else {
        (4 << 10, 64, 256)
    };
    let len = (page * slots) as usize;
    let far_then = pattern(len, 301);
    let far = far_region(&pair, TAG_REGISTER, &far_then).await;
    assert_eq!(far.len, len as u64, "{combo}: the far region's length");

    // Read: scattered pages there into other places here.
    let here_then = pattern(len, 302);
    let mine = filled(node, combo.src_kind(), &here_then).await;
    let local = node.register(mine, Access::ReadWrite).expect("register");
    let from = scattered(page, count, slots, 0);
    let into = scattered(page, count, slots - 1, 3);
    let read = node
        .read(
            &pair.peer,
            Places {
                region: far,
                layout: from.clone(),
            },
            Places {
                region: local,
                layout: into.clone(),
            },
            OneSided::default(),
        )
        .await;
    let transport = read.unwrap_or_else(|e| panic!("{combo}: read: {e}"));
    let over = if combo.echo_returns_over_it() {
        combo.name()
    } else {
        "tcp"
    };
    assert_eq!(transport.as_str(), over, "{combo}: the read came over");
    let mine = node.unregister(local).await.expect("unregister");
    let want = scatter(&here_then, &into, &gathered(&from, &far_then));
    assert_same(
        &combo,
        "the region read into",
        &mine.to_vec().expect("bytes"),
        &want,
    );
    // Its key is stale now.
    let stale = node.read(
        &pair.peer,
        Places::whole(far),
        Places::whole(local),
        OneSided::default(),
    );
    assert!(
        matches!(stale.await, Err(Error::Usage(_))),
        "{combo}: a read into a region unregistered here must fail before anything moves"
    );

    // Write: other scattered pages here into places there, then a notification.
    let ours = pattern(len, 303);
    let mut mine = mine;
    mine.write(0, &ours).expect("fill");
    let local = node.register(mine, Access::ReadOnly).expect("register");
    let from = scattered(page, count / 2, slots, 1);
    let into = scattered(page, count / 2, slots - 3, 0);
    let note = b"pages written".to_vec();
    let written = node
        .write(
            &pair.peer,
            Places {
                region: local,
                layout: from.clone(),
            },
            Places {
                region: far,
                layout: into.clone(),
            },
            OneSided {
                notify: Some((TAG_NOTE, note.clone())),
                ..OneSided::default()
            },
        )
        .await;
    written.unwrap_or_else(|e| panic!("{combo}: write: {e}"));
    let echoed = pair.recv(Some(TAG_NOTE)).await.buffer;
    assert_eq!(
        echoed.to_vec().expect("note"),
        note,
        "{combo}: the notification"
    );
    drop(echoed);
    let far_now = far_bytes(&pair, far).await;
    let want = scatter(&far_then, &into, &gathered(&from, &ours));
    assert_same(&combo, "the far region written", &far_now, &want);

    // The far key is stale now, read or write.
    let stale = node
        .read(
            &pair.peer,
            Places::blocks(far, [(0, 16)]),
            Places::blocks(local, [(0, 16)]),
            OneSided::default(),
        )
        .await;
    assert_refused(
        &combo,
        "a read of a region unregistered",
        stale,
        RefusalReason::StaleKey,
    );
    let stale = node
        .write(
            &pair.peer,
            Places::blocks(local, [(0, 16)]),
            Places::blocks(far, [(0, 16)]),
            OneSided::default(),
        )
        .await;
    assert_refused(
        &combo,
        "a write into a region unregistered",
        stale,
        RefusalReason::StaleKey,
    );

    // A region registered read-only there: read, never written.
    let small = pattern(4096, 304);
    let fixed = far_region(&pair, TAG_REGISTER_READ_ONLY, &small).await;
    let refused = node
        .write(
            &pair.peer,
            Places::blocks(local, [(0, 64)]),
            Places::blocks(fixed, [(64, 64)]),
            OneSided::default(),
        )
        .await;
    assert_refused(
        &combo,
        "a write into a read-only region",
        refused,
        RefusalReason::ReadOnly,
    );
    assert_same(
        &combo,
        "the read-only region",
        &far_bytes(&pair, fixed).await,
        &small,
    );

    // Places that do not match are refused here, before anything moves.
    let mismatch = node
        .write(
            &pair.peer,
            Places::blocks(local, [(0, 64)]),
            Places::blocks(far, [(0, 65)]),
            OneSided::default(),
        )
        .await;
    assert!(
        matches!(mismatch, Err(Error::Usage(_))),
        "{combo}: {mismatch:?}"
    );
    let back = node.unregister(local).await.expect("unregister");
    assert_same(
        &combo,
        "the region written from",
        &back.to_vec().expect("bytes"),
        &ours,
    );
    drop(back);
    baseline.assert_back(node, &combo).await;
}

/// Bytes of the far region in the failure check: its node's budget (6 MiB) keeps room for
/// no write's landing of [`WRITE`] bytes.
const HELD: usize = 5 << 20;
/// Bytes of a write in the failure check.
const WRITE: u64 = 2 << 20;
/// How long the failure check's write may take.
const DEADLINE: std::time::Duration = std::time::Duration::from_millis(300);

/// A write the far node has no memory to land ends at its deadline (`DeadlineExceeded`);
/// killed with a write waiting, the far node fails it as `PeerLost` within 2 s, and a read
/// or write asked for after the kill fails too (`PeerLost` or `PeerUnreachable`); this
/// node's memory comes back. (A far node of this process cannot be killed: the deadline
/// only.)
pub async fn one_sided_deadline_then_killed_peer(combo: Combo, _first: bool) {
    use std::time::{Duration, Instant};
    let tweaks = Tweaks {
        far_memory: vec![format!(
            "{} = \"6 MiB\"",
            crate::pair::budget_key(combo.dst)
        )],
        ..Tweaks::default()
    };
    let mut pair = Pair::start(&combo, Role::Echo, &tweaks).await;
    pair.warm_up().await;
    let baseline = Baseline::take(&pair.node, &combo).await;
    let killable = pair.seen().is_none();
    let node = std::sync::Arc::clone(&pair.node);
    let far = far_region(&pair, TAG_REGISTER, &pattern(HELD, 401)).await;
    let bytes = pattern(WRITE as usize, 402);
    let mine = filled(&node, combo.src_kind(), &bytes).await;
    let local = node.register(mine, Access::ReadOnly).expect("register");
    let write = |deadline: Option<Instant>| {
        let node = std::sync::Arc::clone(&node);
        let peer = pair.peer.clone();
        async move {
            node.write(
                &peer,
                Places::blocks(local, [(0, WRITE)]),
                Places::blocks(far, [(HELD as u64 - WRITE, WRITE)]),
                OneSided {
                    deadline,
                    ..OneSided::default()
                },
            )
            .await
        }
    };
    let started = Instant::now();
    let late = write(Some(started + DEADLINE)).await;
    let took = started.elapsed();
    assert!(
        matches!(late, Err(Error::DeadlineExceeded)),
        "{combo}: a write the peer has no memory for: {late:?}"
    );
    assert!(
        took >= DEADLINE - Duration::from_millis(20) && took < Duration::from_secs(2),
        "{combo}: a deadline of {DEADLINE:?} ended the write after {took:?}"
    );
    if killable {
        // Polled once: handed to the peer's transfer actor, its transfer begun (it then
        // waits at the far node for memory).
        let mut waiting = Box::pin(write(None));
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        assert!(pair.kill());
        let killed = Instant::now();
        let ended = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .unwrap_or_else(|_| panic!("{combo}: a write waiting on a killed peer did not end"));
        assert!(
            matches!(ended, Err(Error::PeerLost { .. })),
            "{combo}: a write waiting on a killed peer: {ended:?}"
        );
        let after = killed.elapsed();
        assert!(
            after < Duration::from_secs(2),
            "{combo}: it failed {after:?} after the kill"
        );
        let read = node
            .read(
                &pair.peer,
                Places::blocks(far, [(0, 64)]),
                Places::blocks(local, [(0, 64)]),
                OneSided::default(),
            )
            .await;
        assert!(
            matches!(
                read,
                Err(Error::PeerLost { .. } | Error::PeerUnreachable { .. })
            ),
            "{combo}: a read after the kill: {read:?}"
        );
    }
    let back = node.unregister(local).await.expect("unregister");
    drop(back);
    baseline.assert_back(&node, &combo).await;
}

/// Writes into a region whose bytes add up to several times the far node's share for this
/// node (`limits.peer_inbound_bytes`, 2 MiB here) all land: a placed write's bytes are
/// taken at once, not held against the share (they were, and the fifth write waited for
/// ever).
pub async fn writes_add_up_past_the_inbound_share(combo: Combo, _first: bool) {
    let tweaks = Tweaks {
        limits: vec!["peer_inbound_bytes = \"2 MiB\"".to_string()],
        ..Tweaks::default()
    };
    let pair = Pair::start(&combo, Role::Echo, &tweaks).await;
    pair.warm_up().await;
    let baseline = Baseline::take(&pair.node, &combo).await;
    let node = &pair.node;
    let len = 512 << 10;
    let far = far_region(&pair, TAG_REGISTER, &pattern(len, 501)).await;
    let bytes = pattern(len, 502);
    let mine = filled(node, combo.src_kind(), &bytes).await;
    let local = node.register(mine, Access::ReadOnly).expect("register");
    for i in 0..16 {
        let written = tokio::time::timeout(
            std::time::Duration::from_secs(20),
            node.write(
                &pair.peer,
                Places::whole(local),
                Places::whole(far),
                OneSided::default(),
            ),
        )
        .await
        .unwrap_or_else(|_| panic!("{combo}: write {i} of 512 KiB did not end"));
        written.unwrap_or_else(|e| panic!("{combo}: write {i}: {e}"));
    }
    assert_same(
        &combo,
        "the far region written",
        &far_bytes(&pair, far).await,
        &bytes,
    );
    drop(node.unregister(local).await.expect("unregister"));
    baseline.assert_back(node, &combo).await;
}
