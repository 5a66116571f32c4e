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
pub(crate) mod tests;
