//! The wire: rkyv messages and the frames that carry them.
pub mod message;
pub use message::*;
