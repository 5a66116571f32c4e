use super::*;
use proptest::prelude::*;

fn strided(rows: u64, row_bytes: u64, pitch: u64) -> Layout {
    Layout::Strided2D {
        rows,
        row_bytes,
        pitch,
    }
}

#[test]
fn invalid_layouts_say_why() {
    assert_eq!(
        strided(4, 16, 8).check(1 << 20),
        Err(LayoutError::PitchTooSmall {
            pitch: 8,
            row_bytes: 16
        })
    );
    // 3 rows of 16 at a pitch of 32: the last byte is 80.
    assert_eq!(strided(3, 16, 32).check(80), Ok(48));
    assert_eq!(
        strided(3, 16, 32).check(79),
        Err(LayoutError::PastTheEnd { end: 80, len: 79 })
    );
    assert_eq!(strided(0, 16, 32).check(80), Err(LayoutError::Zero("rows")));
    assert_eq!(
        strided(u64::MAX, 2, 1 << 30).check(u64::MAX),
        Err(LayoutError::Overflow)
    );
    let cube = Layout::Strided3D {
        depth: 2,
        rows: 4,
        row_bytes: 8,
        pitch: 16,
        plane_rows: 3,
    };
    assert_eq!(
        cube.check(1 << 20),
        Err(LayoutError::PlaneTooSmall {
            plane_rows: 3,
            rows: 4
        })
    );
    let text = strided(4, 16, 8)
        .check(64)
        .expect_err("too small")
        .to_string();
    assert!(text.contains("pitch (8 bytes) is smaller than a row (16 bytes)"));
}

#[test]
fn a_cube_packs_its_rows_in_order() {
    // 2 planes of 2 rows of 2 bytes, pitch 4, 3 rows per plane.
    let cube = Layout::Strided3D {
        depth: 2,
        rows: 2,
        row_bytes: 2,
        pitch: 4,
        plane_rows: 3,
    };
    let src: Vec<u8> = (0..24).collect();
    assert_eq!(cube.check(24), Ok(8));
    let mut out = [0u8; 8];
    cube.gather(&src, 0, &mut out).expect("fits");
    assert_eq!(out, [0, 1, 4, 5, 12, 13, 16, 17]);
    // The whole cube is one 3D copy; from its third byte, a row's end, the rest of the
    // plane, then the second plane.
    let whole = cube.boxes(24, 0, 8).expect("fits");
    assert_eq!(whole.len(), 1);
    assert_eq!(
        (whole[0].planes, whole[0].rows, whole[0].plane_pitch),
        (2, 2, 12)
    );
    let rest = cube.boxes(24, 3, 5).expect("fits");
    let shape: Vec<(u64, u64, u64, u64)> = rest
        .iter()
        .map(|b| (b.src, b.width, b.rows, b.planes))
        .collect();
    assert_eq!(shape, [(5, 1, 1, 1), (12, 2, 2, 1)]);
    assert!(!cube.is_contiguous());
    assert!(strided(8, 4, 4).is_contiguous());
    // One row per plane, planes apart: not contiguous.
    let apart = Layout::Strided3D {
        depth: 2,
        rows: 1,
        row_bytes: 4,
        pitch: 8,
        plane_rows: 1,
    };
    assert!(!apart.is_contiguous());
    // A plane stride that overflows is refused up front, as is a pitch past the copies.
    let huge = Layout::Strided3D {
        depth: 1,
        rows: 2,
        row_bytes: 4,
        pitch: 8,
        plane_rows: 1 << 62,
    };
    assert_eq!(huge.check(16), Err(LayoutError::Overflow));
    assert_eq!(
        strided(2, 1, 1 << 40).check(u64::MAX),
        Err(LayoutError::PitchTooLarge { pitch: 1 << 40 })
    );
}

#[test]
fn block_lists_are_checked_and_packed_in_their_order() {
    let src: Vec<u8> = (0..64).collect();
    // Out of order, apart: packed in list order.
    let list = Layout::blocks([(40, 3), (2, 4), (20, 1)]);
    assert_eq!(list.check(64), Ok(8));
    assert_eq!(list.extent(), Ok(Some(43)));
    assert!(!list.is_contiguous());
    let mut out = [0u8; 8];
    list.gather(&src, 0, &mut out).expect("fits");
    assert_eq!(out, [40, 41, 42, 2, 3, 4, 5, 20]);
    // A range that starts and ends inside blocks: one plain run per block touched.
    let runs: Vec<(u64, u64, u64)> = list
        .boxes(64, 1, 5)
        .expect("in range")
        .iter()
        .map(|b| (b.src, b.packed, b.len()))
        .collect();
    assert_eq!(runs, [(41, 0, 2), (2, 2, 3)]);
    // Blocks that follow each other from the start are the buffer's first bytes.
    assert!(Layout::blocks([(0, 4), (4, 10)]).is_contiguous());
    assert!(!Layout::blocks([(4, 10), (0, 4)]).is_contiguous());

    // Read twice: a source's blocks may overlap.
    let twice = Layout::blocks([(0, 4), (2, 4)]);
    assert_eq!(twice.check(8), Ok(8));
    let mut out = [0u8; 8];
    twice.gather(&src[..8], 0, &mut out).expect("fits");
    assert_eq!(out, [0, 1, 2, 3, 2, 3, 4, 5]);
    // Written twice: refused before a byte is written, naming both blocks.
    let mut dst = [0xAAu8; 8];
    assert_eq!(
        twice.scatter(&out, 0, &mut dst),
        Err(LayoutError::Overlap {
            first: 0,
            second: 1,
            at: 2
        })
    );
    assert_eq!(dst, [0xAA; 8]);
    assert_eq!(
        Layout::blocks([(6, 2), (0, 3), (2, 1)]).check_destination(8),
        Err(LayoutError::Overlap {
            first: 1,
            second: 2,
            at: 2
        })
    );
    assert_eq!(Layout::blocks([(3, 5), (0, 3)]).check_destination(8), Ok(8));

    // Every way a list can be wrong, named.
    assert_eq!(
        Layout::blocks([]).check(8),
        Err(LayoutError::Zero("the block count"))
    );
    assert_eq!(
        Layout::blocks([(0, 1), (4, 0)]).check(8),
        Err(LayoutError::EmptyBlock { index: 1 })
    );
    assert_eq!(
        Layout::blocks([(0, 1), (4, 5)]).check(8),
        Err(LayoutError::BlockPastTheEnd {
            index: 1,
            end: 9,
            len: 8
        })
    );
    assert_eq!(
        Layout::blocks([(u64::MAX, 2)]).check(u64::MAX),
        Err(LayoutError::Overflow)
    );
    assert_eq!(
        Layout::blocks([(0, u64::MAX), (0, 1)]).check(u64::MAX),
        Err(LayoutError::Overflow)
    );
    let many = Layout::blocks((0..=MAX_BLOCKS as u64).map(|i| (i, 1)));
    assert_eq!(
        many.check(u64::MAX),
        Err(LayoutError::TooManyBlocks {
            count: MAX_BLOCKS + 1
        })
    );
    let text = Layout::blocks([(0, 1), (4, 5)])
        .check(8)
        .expect_err("past the end")
        .to_string();
    assert_eq!(text, "block 1 reaches byte 9 of a buffer of 8 bytes");
}

/// Layouts of every kind with the length of a buffer they fit (some bytes spare).
pub(crate) fn layouts() -> impl Strategy<Value = (Layout, u64)> {
    let two = (1u64..20, 1u64..40, 0u64..20, 0u64..30).prop_map(|(rows, row, gap, tail)| {
        let pitch = row + gap;
        (strided(rows, row, pitch), (rows - 1) * pitch + row + tail)
    });
    let three = (1u64..5, 1u64..8, 1u64..20, 0u64..9, 0u64..3, 0u64..30).prop_map(
        |(depth, rows, row, gap, extra, tail)| {
            let pitch = row + gap;
            let plane_rows = rows + extra;
            let end = ((depth - 1) * plane_rows + rows - 1) * pitch + row;
            (
                Layout::Strided3D {
                    depth,
                    rows,
                    row_bytes: row,
                    pitch,
                    plane_rows,
                },
                end + tail,
            )
        },
    );
    let flat = (0u64..200).prop_map(|len| (Layout::Contiguous, len));
    prop_oneof![flat, two, three, blocks()]
}

/// Block lists that do not overlap, in any order, with the length of a buffer they fit
/// (some bytes spare).
pub(crate) fn blocks() -> impl Strategy<Value = (Layout, u64)> {
    (
        proptest::collection::vec((1u64..40, 0u64..20), 1..24),
        0u64..30,
    )
        .prop_flat_map(|(sizes, tail)| {
            let mut at = 0;
            let mut list = Vec::new();
            for (len, gap) in sizes {
                at += gap;
                list.push((at, len));
                at += len;
            }
            (Just(list).prop_shuffle(), Just(at + tail))
        })
        .prop_map(|(list, len)| (Layout::blocks(list), len))
}

proptest! {
    /// Gathered in pieces of any size, the packed bytes are the rows in order; scattered
    /// back, they land where they came from and nothing else changes.
    #[test]
    fn gather_and_scatter_in_pieces((layout, len) in layouts(), piece in 1usize..64) {
        let packed = layout.check(len).expect("generated to fit");
        let src: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let mut want = Vec::new();
        for (at, n) in layout.runs(len) {
            want.extend_from_slice(&src[at as usize..(at + n) as usize]);
        }
        prop_assert_eq!(want.len() as u64, packed);
        let mut got = vec![0u8; packed as usize];
        for (i, chunk) in got.chunks_mut(piece).enumerate() {
            layout.gather(&src, (i * piece) as u64, chunk).expect("in range");
        }
        prop_assert_eq!(&got, &want);
        // The boxes of each piece, copied row by row, give the same bytes, in at most
        // five copies per piece.
        for (i, chunk) in want.chunks(piece).enumerate() {
            let from = (i * piece) as u64;
            let boxes = layout.boxes(len, from, chunk.len() as u64).expect("in range");
            let most = match &layout {
                Layout::Blocks(b) => b.len(),
                _ => 5,
            };
            prop_assert!(boxes.len() <= most, "{} boxes", boxes.len());
            let mut out = vec![0u8; chunk.len()];
            for b in &boxes {
                for (at, p, n) in b.rows() {
                    out[p as usize..(p + n) as usize]
                        .copy_from_slice(&src[at as usize..(at + n) as usize]);
                }
            }
            prop_assert_eq!(&out[..], chunk);
        }
        let mut dst = vec![0xAAu8; len as usize];
        for (i, chunk) in got.chunks(piece).enumerate() {
            layout.scatter(chunk, (i * piece) as u64, &mut dst).expect("in range");
        }
        let mut expect = vec![0xAAu8; len as usize];
        for (at, n) in layout.runs(len) {
            let r = at as usize..(at + n) as usize;
            expect[r.clone()].copy_from_slice(&src[r]);
        }
        prop_assert_eq!(dst, expect);
        // Contiguous exactly when the packed bytes are the buffer's first ones.
        let first = want.as_slice() == &src[..packed as usize];
        prop_assert!(!layout.is_contiguous() || first, "{layout:?} said contiguous");
        // One byte short of its last row, the layout no longer fits.
        let end = layout.runs(len).map(|(at, n)| at + n).max().unwrap_or(0);
        // A block list's extent is its furthest block's end (found in the checking walk).
        if matches!(layout, Layout::Blocks(_)) {
            prop_assert_eq!(layout.extent(), Ok(Some(end)));
        }
        if end > 0 && layout != Layout::Contiguous {
            prop_assert!(layout.check(end - 1).is_err());
        }
    }
}
