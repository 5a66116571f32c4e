//! The wire: rkyv messages and the frames that carry them.
pub mod frame;
pub mod layout;
pub mod message;
pub use frame::*;
pub use layout::{Block, Layout, LayoutError, MAX_BLOCKS, MAX_PITCH, RowBox};
pub use message::*;
