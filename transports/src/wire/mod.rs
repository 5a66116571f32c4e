//! The wire: rkyv messages and the frames that carry them.
pub mod frame;
pub mod message;
pub use frame::*;
pub use message::*;
