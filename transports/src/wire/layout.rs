//! How the bytes of a buffer that are sent lie in it: all of it (`Contiguous`), or rows at
//! a pitch (`Strided2D`), or such planes at a pitch of rows (`Strided3D`), as CUDA's 2D and
//! 3D copies describe them, or a list of `(offset, length)` blocks at any places
//! (`Blocks`, a paged KV cache's pages). What moves is the rows (or blocks), packed one after
//! the other; the receiver gets them packed and learns the layout from the offer.
//!
//! A layout is checked against its buffer before anything moves ([`Layout::check`]): a pitch
//! smaller than a row, a shape past the buffer's end, a zero dimension, an empty block, more
//! than [`MAX_BLOCKS`] blocks or a size that overflows is an error naming the cause.
//!
//! Blocks may overlap where they are read (a source read twice is harmless: the packed bytes
//! hold those bytes twice), but not where they are written: [`Layout::check_destination`]
//! refuses a block list whose blocks overlap, before a scatter writes anything.

pub use shape::{Block, Layout};

/// The type, apart: the code rkyv derives for its struct variants (the archived twin and
/// the resolver) has fields without docs.
#[allow(missing_docs)]
mod shape {
    use std::sync::Arc;

    use rkyv::{Archive, Deserialize, Serialize};

    /// One block of a [`Layout::Blocks`]: `len` bytes from `offset` in the buffer.
    #[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
    #[rkyv(derive(Debug, PartialEq, Eq))]
    pub struct Block {
        /// Where the block starts in the buffer.
        pub offset: u64,
        /// Its bytes (at least one).
        pub len: u64,
    }

    /// Where the sent bytes of a buffer lie. Cheap to clone (a block list is shared).
    #[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Hash, Default)]
    #[rkyv(derive(Debug, PartialEq, Eq))]
    pub enum Layout {
        /// The whole buffer.
        #[default]
        Contiguous,
        /// `rows` rows of `row_bytes` each; row `r` starts at `r * pitch`.
        Strided2D {
            /// Rows sent.
            rows: u64,
            /// Bytes sent of each row.
            row_bytes: u64,
            /// Bytes from the start of one row to the next (at least `row_bytes`).
            pitch: u64,
        },
        /// `depth` planes of `rows` rows of `row_bytes` each; row `r` of plane `d` starts at
        /// `(d * plane_rows + r) * pitch` (CUDA's 3D copy: a plane is `plane_rows` rows of the
        /// pitch, of which the first `rows` are sent).
        Strided3D {
            /// Planes sent.
            depth: u64,
            /// Rows sent of each plane.
            rows: u64,
            /// Bytes sent of each row.
            row_bytes: u64,
            /// Bytes from the start of one row to the next (at least `row_bytes`).
            pitch: u64,
            /// Rows from the start of one plane to the next (at least `rows`).
            plane_rows: u64,
        },
        /// Blocks of the buffer, in the order they are packed: block `i` lands right after
        /// block `i - 1`. One to [`super::MAX_BLOCKS`] blocks, none empty; they may overlap
        /// and come in any order (see [`super::Layout::check_destination`] for receiving into
        /// them). Build one with [`super::Layout::blocks`].
        Blocks(Arc<[Block]>),
    }
}

/// A box of a layout's rows: `planes` planes of `rows` rows of `width` bytes, the first
/// at `src` in the buffer, rows `pitch` apart and planes `plane_pitch` apart; packed, they
/// are the bytes at `packed` (from the start of the range asked for). One 3D copy, a 2D
/// copy when `planes` is 1, a plain copy when `rows` is 1 too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowBox {
    /// Offset of the first byte in the buffer.
    pub src: u64,
    /// Offset of the first byte in the packed range.
    pub packed: u64,
    /// Bytes of each row.
    pub width: u64,
    /// Rows of each plane.
    pub rows: u64,
    /// Planes.
    pub planes: u64,
    /// Bytes from one row to the next.
    pub pitch: u64,
    /// Bytes from one plane to the next.
    pub plane_pitch: u64,
}

impl RowBox {
    /// `len` bytes in one run.
    fn run(src: u64, packed: u64, len: u64, pitch: u64) -> Self {
        Self {
            src,
            packed,
            width: len,
            rows: 1,
            planes: 1,
            pitch: pitch.max(len),
            plane_pitch: pitch.max(len),
        }
    }

    /// The packed bytes of the box.
    pub fn len(&self) -> u64 {
        self.width * self.rows * self.planes
    }

    /// True when the box holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each row as `(offset in the buffer, offset in the packed range, bytes)`, for a copy
    /// that moves rows one by one (host memory).
    pub fn rows(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        (0..self.planes).flat_map(move |p| {
            (0..self.rows).map(move |r| {
                (
                    self.src + p * self.plane_pitch + r * self.pitch,
                    self.packed + (p * self.rows + r) * self.width,
                    self.width,
                )
            })
        })
    }
}

/// The largest pitch a strided layout may have: what one 2D/3D copy takes
/// (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`, 2^31 - 1 bytes on current GPUs).
pub const MAX_PITCH: u64 = (1 << 31) - 1;

/// The most blocks one [`Layout::Blocks`] may have (65,536: 1 MiB of blocks in the offer).
/// A receiver refuses an offer with more before it reserves anything, so a peer cannot make
/// it walk an unbounded list; the offer must also fit the receiver's `limits.max_frame`.
pub const MAX_BLOCKS: usize = 1 << 16;

/// Why a layout does not fit its buffer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// A dimension is zero.
    #[error("{0} is zero")]
    Zero(&'static str),
    /// The pitch is smaller than a row.
    #[error("the pitch ({pitch} bytes) is smaller than a row ({row_bytes} bytes)")]
    PitchTooSmall {
        /// The pitch.
        pitch: u64,
        /// The row.
        row_bytes: u64,
    },
    /// The pitch is past what the copy engine takes.
    #[error("the pitch ({pitch} bytes) is larger than a copy takes ({MAX_PITCH} bytes)")]
    PitchTooLarge {
        /// The pitch.
        pitch: u64,
    },
    /// A plane holds fewer rows than are sent of it.
    #[error("a plane of {plane_rows} rows cannot hold the {rows} rows sent of it")]
    PlaneTooSmall {
        /// Rows per plane.
        plane_rows: u64,
        /// Rows sent per plane.
        rows: u64,
    },
    /// The last byte lies past the buffer's end.
    #[error("the layout reaches byte {end} of a buffer of {len} bytes")]
    PastTheEnd {
        /// One past the layout's last byte.
        end: u64,
        /// The buffer's length.
        len: u64,
    },
    /// A size does not fit 64 bits.
    #[error("the layout's size overflows")]
    Overflow,
    /// A block of a block list has no bytes.
    #[error("block {index} is empty")]
    EmptyBlock {
        /// Its place in the list.
        index: usize,
    },
    /// A block list is longer than [`MAX_BLOCKS`].
    #[error("{count} blocks, more than the {MAX_BLOCKS} a layout may have")]
    TooManyBlocks {
        /// Blocks in the list.
        count: usize,
    },
    /// A block ends past the buffer's end.
    #[error("block {index} reaches byte {end} of a buffer of {len} bytes")]
    BlockPastTheEnd {
        /// Its place in the list.
        index: usize,
        /// One past its last byte.
        end: u64,
        /// The buffer's length.
        len: u64,
    },
    /// Two blocks of a list that is written into share bytes (each would be written twice).
    #[error(
        "blocks {first} and {second} overlap (from byte {at}): a destination's blocks must not"
    )]
    Overlap {
        /// The one that starts first (its place in the list).
        first: usize,
        /// The one that starts inside it.
        second: usize,
        /// Where the second starts.
        at: u64,
    },
}

/// A strided layout's numbers, a 2D one as the 3D one of a single plane.
#[derive(Debug, Clone, Copy)]
struct Dims {
    depth: u64,
    rows: u64,
    row_bytes: u64,
    pitch: u64,
    plane_rows: u64,
}

impl Layout {
    /// A [`Layout::Blocks`] of `(offset, len)` pairs, in packed order (not checked: see
    /// [`Self::check`]).
    pub fn blocks(blocks: impl IntoIterator<Item = (u64, u64)>) -> Self {
        Layout::Blocks(
            blocks
                .into_iter()
                .map(|(offset, len)| Block { offset, len })
                .collect(),
        )
    }

    /// The blocks of a [`Layout::Blocks`], else `None`.
    pub fn block_list(&self) -> Option<&[Block]> {
        match self {
            Layout::Blocks(blocks) => Some(blocks),
            _ => None,
        }
    }

    /// `None` for [`Layout::Contiguous`] and [`Layout::Blocks`].
    fn dims(&self) -> Option<Dims> {
        match *self {
            Layout::Contiguous | Layout::Blocks(_) => None,
            Layout::Strided2D {
                rows,
                row_bytes,
                pitch,
            } => Some(Dims {
                depth: 1,
                rows,
                row_bytes,
                pitch,
                plane_rows: rows,
            }),
            Layout::Strided3D {
                depth,
                rows,
                row_bytes,
                pitch,
                plane_rows,
            } => Some(Dims {
                depth,
                rows,
                row_bytes,
                pitch,
                plane_rows,
            }),
        }
    }

    /// Checks that the layout fits a buffer of `len` bytes, and returns the number of bytes
    /// it sends (its packed length).
    ///
    /// # Errors
    /// What is wrong with it, as a [`LayoutError`].
    pub fn check(&self, len: u64) -> Result<u64, LayoutError> {
        if let Layout::Blocks(blocks) = self {
            return check_blocks(blocks, len).map(|(packed, _)| packed);
        }
        let Some(d) = self.dims() else {
            return Ok(len);
        };
        if d.depth == 0 {
            return Err(LayoutError::Zero("depth"));
        }
        if d.rows == 0 {
            return Err(LayoutError::Zero("rows"));
        }
        if d.row_bytes == 0 {
            return Err(LayoutError::Zero("row_bytes"));
        }
        if d.pitch < d.row_bytes {
            return Err(LayoutError::PitchTooSmall {
                pitch: d.pitch,
                row_bytes: d.row_bytes,
            });
        }
        if d.plane_rows < d.rows {
            return Err(LayoutError::PlaneTooSmall {
                plane_rows: d.plane_rows,
                rows: d.rows,
            });
        }
        if d.pitch > MAX_PITCH {
            return Err(LayoutError::PitchTooLarge { pitch: d.pitch });
        }
        // Every offset the copies compute (a whole plane's stride included) fits 64 bits.
        mul(mul(d.depth, d.plane_rows)?, d.pitch)?;
        let end = d.end()?;
        if end > len {
            return Err(LayoutError::PastTheEnd { end, len });
        }
        mul(mul(d.depth, d.rows)?, d.row_bytes)
    }

    /// [`Self::check`], and for a layout that is written into (the destination of a
    /// scatter), also that no two of its blocks overlap: a block list whose blocks share a
    /// byte is refused as [`LayoutError::Overlap`] (strided layouts never overlap). Returns
    /// the packed length.
    ///
    /// # Errors
    /// What is wrong with it, as a [`LayoutError`].
    pub fn check_destination(&self, len: u64) -> Result<u64, LayoutError> {
        let packed = self.check(len)?;
        if let Layout::Blocks(blocks) = self {
            let mut order: Vec<usize> = (0..blocks.len()).collect();
            order.sort_unstable_by_key(|&i| (blocks[i].offset, i));
            for pair in order.windows(2) {
                let (a, b) = (&blocks[pair[0]], &blocks[pair[1]]);
                // Checked: no block's end overflows.
                if b.offset < a.offset + a.len {
                    return Err(LayoutError::Overlap {
                        first: pair[0],
                        second: pair[1],
                        at: b.offset,
                    });
                }
            }
        }
        Ok(packed)
    }

    /// One past the last byte a strided layout or a block list touches (`None` for
    /// [`Layout::Contiguous`], which is the whole buffer, whatever its length).
    ///
    /// # Errors
    /// A malformed layout, as [`Self::check`] names it.
    pub fn extent(&self) -> Result<Option<u64>, LayoutError> {
        if let Layout::Blocks(blocks) = self {
            // One walk: checked, and the furthest end.
            return check_blocks(blocks, u64::MAX).map(|(_, end)| Some(end));
        }
        self.check(u64::MAX)?;
        self.dims().map(|d| d.end()).transpose()
    }

    /// True for [`Layout::Contiguous`], or a strided layout whose rows touch, or a block list
    /// whose blocks follow each other from the buffer's start (nothing to gather: the sent
    /// bytes are the buffer's first ones, its extent is its packed length). False for a
    /// malformed layout.
    pub fn is_contiguous(&self) -> bool {
        if let Layout::Blocks(blocks) = self {
            let mut at = 0u64;
            return self.check(u64::MAX).is_ok()
                && blocks.iter().all(|b| {
                    let follows = b.offset == at;
                    at = b.offset + b.len;
                    follows
                });
        }
        match (self.dims(), self.check(u64::MAX)) {
            (None, _) => true,
            (Some(d), Ok(packed)) => d.end().is_ok_and(|end| end == packed),
            (Some(_), Err(_)) => false,
        }
    }

    /// The sent rows (or blocks) as `(offset in the buffer, length)`, in packed order, for a
    /// buffer of `len` bytes; one run for a contiguous layout. Call [`Self::check`] first:
    /// the runs of a layout that does not fit are meaningless.
    pub fn runs(&self, len: u64) -> Box<dyn Iterator<Item = (u64, u64)> + '_> {
        if let Layout::Blocks(blocks) = self {
            return Box::new(blocks.iter().map(|b| (b.offset, b.len)));
        }
        let d = self.dims().unwrap_or(Dims {
            depth: 1,
            rows: 1,
            row_bytes: len,
            pitch: len,
            plane_rows: 1,
        });
        let plane = d.plane_rows.wrapping_mul(d.pitch);
        Box::new((0..d.depth).flat_map(move |p| {
            (0..d.rows).map(move |r| {
                (
                    p.wrapping_mul(plane).wrapping_add(r.wrapping_mul(d.pitch)),
                    d.row_bytes,
                )
            })
        }))
    }

    /// The packed bytes `[from, from + count)` of the layout in a buffer of `len` bytes, as
    /// boxes, in packed order. A strided layout's are at most five: a part of a row, the rest
    /// of a plane's rows, whole planes, the first rows of a plane, a part of a row; each is
    /// one 2D or 3D copy (the copy engine gathers its rows), never a copy per row. A block
    /// list's are one run per block in the range (the first and last maybe in part): plain
    /// copies, which a GPU takes as one batch where the driver can.
    ///
    /// # Errors
    /// The layout does not fit `len`, or the range is past its packed length.
    pub fn boxes(&self, len: u64, from: u64, count: u64) -> Result<Vec<RowBox>, LayoutError> {
        let to = self.range_end(len, from, count)?;
        if let Layout::Blocks(blocks) = self {
            return Ok(block_runs(blocks, from, to));
        }
        let Some(Dims {
            rows,
            row_bytes: width,
            pitch,
            plane_rows,
            ..
        }) = self.dims()
        else {
            return Ok(if count == 0 {
                Vec::new()
            } else {
                vec![RowBox::run(from, 0, count, 0)]
            });
        };
        // Row g of the packed order (over every plane) starts in the buffer here.
        let row_at = |g: u64| (g / rows * plane_rows + g % rows) * pitch;
        let mut out = Vec::new();
        let mut at = from;
        // A part of a row first, when the range starts inside one.
        if at % width != 0 && at < to {
            let n = (width - at % width).min(to - at);
            out.push(RowBox::run(
                row_at(at / width) + at % width,
                at - from,
                n,
                pitch,
            ));
            at += n;
        }
        let last_row = to / width;
        let mut g = at / width;
        // Whole rows: the rest of this plane, whole planes, the first rows of the last one.
        while g < last_row {
            let in_plane = g % rows;
            let (n_rows, planes) = if in_plane == 0 && last_row - g >= rows {
                (rows, (last_row - g) / rows)
            } else {
                ((rows - in_plane).min(last_row - g), 1)
            };
            out.push(RowBox {
                src: row_at(g),
                packed: g * width - from,
                width,
                rows: n_rows,
                planes,
                pitch,
                plane_pitch: plane_rows * pitch,
            });
            g += n_rows * planes;
        }
        at = at.max(last_row * width);
        // A part of the last row.
        if at < to {
            out.push(RowBox::run(row_at(at / width), at - from, to - at, pitch));
        }
        Ok(out)
    }

    /// Copies the packed bytes `[from, from + out.len())` of the layout out of `src` (the
    /// whole buffer) into `out`.
    ///
    /// # Errors
    /// The layout does not fit `src`, or the range is past its packed length.
    pub fn gather(&self, src: &[u8], from: u64, out: &mut [u8]) -> Result<(), LayoutError> {
        self.walk(src.len() as u64, from, out.len() as u64, |at, packed, n| {
            out[packed..packed + n].copy_from_slice(&src[at..at + n]);
        })
    }

    /// Copies `packed`, the packed bytes starting at `from`, into their places in `dst` (the
    /// whole buffer): the inverse of [`Self::gather`].
    ///
    /// # Errors
    /// As [`Self::gather`], and [`LayoutError::Overlap`] for a block list whose blocks
    /// overlap ([`Self::check_destination`]), before anything is written.
    pub fn scatter(&self, packed: &[u8], from: u64, dst: &mut [u8]) -> Result<(), LayoutError> {
        self.check_destination(dst.len() as u64)?;
        self.walk(dst.len() as u64, from, packed.len() as u64, |at, p, n| {
            dst[at..at + n].copy_from_slice(&packed[p..p + n]);
        })
    }

    /// The end of the packed range `[from, from + count)` of the layout in a buffer of `len`
    /// bytes, checked against both.
    fn range_end(&self, len: u64, from: u64, count: u64) -> Result<u64, LayoutError> {
        let packed = self.check(len)?;
        let to = from.checked_add(count).ok_or(LayoutError::Overflow)?;
        if to > packed {
            return Err(LayoutError::PastTheEnd {
                end: to,
                len: packed,
            });
        }
        Ok(to)
    }

    /// Calls `each(buffer offset, offset in the range, bytes)` for each row piece of the
    /// packed range `[from, from + count)`, in order (through [`Self::boxes`], so only the
    /// rows in the range are visited).
    fn walk(
        &self,
        len: u64,
        from: u64,
        count: u64,
        mut each: impl FnMut(usize, usize, usize),
    ) -> Result<(), LayoutError> {
        for b in self.boxes(len, from, count)? {
            for (at, packed, n) in b.rows() {
                // In range: `boxes` bounded every row by `len`, a slice length.
                each(at as usize, packed as usize, n as usize);
            }
        }
        Ok(())
    }
}

fn mul(a: u64, b: u64) -> Result<u64, LayoutError> {
    a.checked_mul(b).ok_or(LayoutError::Overflow)
}

/// [`Layout::check`] of a block list against a buffer of `len` bytes: its packed length,
/// and one past the last byte a block touches.
fn check_blocks(blocks: &[Block], len: u64) -> Result<(u64, u64), LayoutError> {
    if blocks.is_empty() {
        return Err(LayoutError::Zero("the block count"));
    }
    if blocks.len() > MAX_BLOCKS {
        return Err(LayoutError::TooManyBlocks {
            count: blocks.len(),
        });
    }
    let mut packed = 0u64;
    let mut furthest = 0u64;
    for (index, b) in blocks.iter().enumerate() {
        if b.len == 0 {
            return Err(LayoutError::EmptyBlock { index });
        }
        let end = b.offset.checked_add(b.len).ok_or(LayoutError::Overflow)?;
        if end > len {
            return Err(LayoutError::BlockPastTheEnd { index, end, len });
        }
        packed = packed.checked_add(b.len).ok_or(LayoutError::Overflow)?;
        furthest = furthest.max(end);
    }
    Ok((packed, furthest))
}

/// The packed range `[from, to)` of a checked block list, as one run per block it touches.
fn block_runs(blocks: &[Block], from: u64, to: u64) -> Vec<RowBox> {
    // From the start (a whole list, as an ipc copy takes it): about one run per block.
    let mut out = if from == 0 {
        Vec::with_capacity(blocks.len())
    } else {
        Vec::new()
    };
    // Where the block starts in the packed bytes (checked: the total fits 64 bits).
    let mut start = 0u64;
    for b in blocks {
        let end = start + b.len;
        if start >= to {
            break;
        }
        if end > from {
            let (lo, hi) = (from.max(start), to.min(end));
            out.push(RowBox::run(b.offset + (lo - start), lo - from, hi - lo, 0));
        }
        start = end;
    }
    out
}

impl Dims {
    /// One past the last byte: `((depth - 1) * plane_rows + rows - 1) * pitch + row_bytes`
    /// (every dimension at least 1: checked first).
    fn end(&self) -> Result<u64, LayoutError> {
        let last_row = mul(self.depth - 1, self.plane_rows)?
            .checked_add(self.rows - 1)
            .ok_or(LayoutError::Overflow)?;
        mul(last_row, self.pitch)?
            .checked_add(self.row_bytes)
            .ok_or(LayoutError::Overflow)
    }
}

#[cfg(test)]
pub(crate) mod tests {
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
}
