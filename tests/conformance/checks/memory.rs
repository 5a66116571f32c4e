//! Where received bytes land when their tier is full.

use std::time::{Duration, Instant};

use super::{Baseline, filled, pattern};
use crate::combos::{Combo, kind};
use crate::pair::{Pair, Role, Tweaks, budget_key, spill_tier};

/// Bytes of the landing tier's budget here.
const TIER: &str = "8 MiB";
const LEN: usize = (1 << 20) + 3;

/// This node's landing tier (the destination memory) is full: the echoes of three buffers
/// land in the spill tier, byte-exact; once room is made, each is promoted back into the
/// landing tier, byte for byte.
pub async fn full_tier_spills_and_promotes_back(combo: Combo, _first: bool) {
    let spill = spill_tier(combo.dst);
    let tweaks = Tweaks {
        memory: vec![
            format!("{} = \"{TIER}\"", budget_key(combo.dst)),
            format!("spill = [\"{}\"]", spill.as_str()),
        ],
        ..Tweaks::default()
    };
    let pair = Pair::start(&combo, Role::Echo, &tweaks).await;
    pair.warm_up().await;
    let baseline = Baseline::take(&pair.node, &combo).await;
    let node = &pair.node;
    let wants: Vec<Vec<u8>> = (0..3).map(|i| pattern(LEN, 200 + i)).collect();
    let mut buffers = Vec::new();
    for want in &wants {
        buffers.push(filled(node, combo.src_kind(), want).await);
    }
    // What is left of the landing tier, taken: no echo finds room there.
    let free = node.memory(combo.dst_kind()).await.expect("stats").free() as usize;
    let filler = node
        .alloc(combo.dst_kind(), free)
        .await
        .unwrap_or_else(|e| panic!("{combo}: fill the landing tier: {e}"));
    let mut sent = Vec::new();
    for (i, b) in buffers.into_iter().enumerate() {
        sent.push(
            node.send(&pair.peer, i as u64, b)
                .await
                .unwrap_or_else(|e| panic!("{combo}: send {i}: {e}")),
        );
    }
    let mut got = Vec::new();
    for (i, want) in wants.iter().enumerate() {
        let r = pair.recv(Some(i as u64)).await;
        assert_eq!(
            r.buffer.kind(),
            kind(spill),
            "{combo}: echo {i} with the landing tier full"
        );
        assert!(
            r.buffer.to_vec().expect("read") == *want,
            "{combo}: spilled echo {i} differs"
        );
        got.push(r.buffer);
    }
    // Room again: each comes back into the landing tier.
    drop(filler);
    drop(sent);
    for (i, b) in got.into_iter().enumerate() {
        let promoted = b
            .promote(combo.dst_kind(), Instant::now() + Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("{combo}: promote echo {i}: {e}"));
        assert_eq!(promoted.kind(), combo.dst_kind(), "{combo}: promoted {i}");
        assert!(
            promoted.to_vec().expect("read") == wants[i],
            "{combo}: promotion changed echo {i}"
        );
    }
    baseline.assert_back(node, &combo).await;
}
