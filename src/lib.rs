//! ferry moves buffers — GPU memory first, host memory today — between processes on one
//! host and between hosts, with a deadline on every transfer, backpressure instead of
//! out-of-memory errors, and a clear answer about which path a transfer took and why.
//!
//! This crate is the public API. A node is started from a [`Config`]; it then sends and
//! receives [`Buffer`]s by peer name and tag. It works from any async runtime: the actors
//! run on the node's own threads.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use ferry::{Config, MemoryKind, Node};
//! let config = Config::from_toml_str(r#"
//!     [node]
//!     name = "a"
//!     listen = ["127.0.0.1:7070"]
//!     [[peers]]
//!     name = "b"
//!     address = "127.0.0.1:7071"
//!     [security]
//!     secret_file = "/etc/ferry/secret"
//! "#)?;
//! let node = Node::start(config).await?;
//! let mut buffer = node.alloc(MemoryKind::Host, 4096).await?;
//! buffer.as_mut_slice().expect("not shared yet").fill(7);
//! let buffer = node.send("b", 1, buffer).await?;      // resolves once b holds every byte
//! let got = node.recv(Some("b"), Some(2)).await?;      // b's reply under tag 2
//! assert_eq!(got.peer, "b");
//! node.shutdown().await;
//! # drop(buffer); Ok(()) }
//! ```
#![forbid(unsafe_code)]

pub use ferry_actors::allocator::{DomainStats, KeptStats};
pub use ferry_actors::core::budget::BudgetStats;
pub use ferry_actors::core::route::Explanation;
pub use ferry_actors::fetch::{Fetch, FetchStats, Fetched};
pub use ferry_actors::inbox::Received;
pub use ferry_actors::node::{Access, Node, OneSided, Places};
pub use ferry_actors::publish::PublicationStats;
pub use ferry_actors::{Error, ErrorKind, NoMemoryCause, RefusalReason, SendError};
pub use ferry_config::{Config, ConfigError, Direction, LoadOptions, MemoryClass, TransportName};
/// The CUDA layer: devices, streams, pools and copies (GPU information for tests and tools).
pub use ferry_transports::cuda;
pub use ferry_transports::memory::MemoryError;
pub use ferry_transports::memory::{Buffer, MemoryKind};
pub use ferry_transports::region::RegionKey;
pub use ferry_transports::wire::{Block, Layout, LayoutError, MAX_BLOCKS};

#[doc(hidden)]
pub mod testing;

/// The small protocol of `ferry serve --role echo`, which demos and tests use to exercise a
/// node in another process.
///
/// An echo node sends every buffer back to its sender under the same tag, except its
/// control tags: [`echo::TAG_EXPOSE`] (payload: the length as 8 little-endian bytes) makes
/// it expose a zeroed region of that length and answer with the region's key
/// ([`echo::encode_key`]); [`echo::TAG_WITHDRAW`] (payload: a key) makes it withdraw that
/// region and send its contents back under the same tag; [`echo::TAG_PUBLISH`] makes it
/// publish the buffer it received and answer with the key (UTF-8 bytes), and
/// [`echo::TAG_UNPUBLISH`] (payload: such a key) makes it unpublish that buffer and send it
/// back under the same tag; [`echo::TAG_REGISTER`] (or [`echo::TAG_REGISTER_READ_ONLY`])
/// makes it register the buffer it received as a region and answer with the key, and
/// [`echo::TAG_UNREGISTER`] (payload: such a key) makes it unregister the region and send
/// its buffer back ([`echo::handle_publishing`]).
pub mod echo {
    use std::sync::atomic::{AtomicU64, Ordering};

    use crate::{Error, MemoryKind, Node, Received, RegionKey};

    /// Ask the echo node to expose a region.
    pub const TAG_EXPOSE: u64 = u64::MAX - 1;
    /// Ask the echo node to withdraw a region and return its contents.
    pub const TAG_WITHDRAW: u64 = u64::MAX - 2;
    /// Ask the echo node to publish the buffer sent; it answers with the key.
    pub const TAG_PUBLISH: u64 = u64::MAX - 3;
    /// Ask the echo node to unpublish a key (the payload) and send its buffer back.
    pub const TAG_UNPUBLISH: u64 = u64::MAX - 4;
    /// Ask the echo node to register the buffer sent as a region its peers may write
    /// ([`crate::Access::ReadWrite`]); it answers with the key ([`encode_key`]).
    pub const TAG_REGISTER: u64 = u64::MAX - 5;
    /// As [`TAG_REGISTER`], read-only.
    pub const TAG_REGISTER_READ_ONLY: u64 = u64::MAX - 6;
    /// Ask the echo node to unregister a region (the payload: its key) and send its
    /// buffer back under the same tag.
    pub const TAG_UNREGISTER: u64 = u64::MAX - 7;

    /// Handles [`TAG_PUBLISH`] and [`TAG_UNPUBLISH`] as an echo node does; gives any other
    /// buffer back.
    ///
    /// # Errors
    /// The node's, publishing, unpublishing or answering; [`Error::Usage`] for a key that
    /// is not UTF-8.
    pub async fn handle_publishing(node: &Node, got: Received) -> Result<Option<Received>, Error> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        match got.tag {
            TAG_PUBLISH => {
                let key = format!("{}/{}", got.peer, NEXT.fetch_add(1, Ordering::Relaxed));
                node.publish(key.clone(), got.buffer).map_err(|e| e.error)?;
                let mut reply = node.alloc(MemoryKind::Host, key.len()).await?;
                reply
                    .write(0, key.as_bytes())
                    .map_err(|e| Error::Usage(e.to_string()))?;
                node.send(&got.peer, TAG_PUBLISH, reply)
                    .await
                    .map_err(|e| e.error)?;
                Ok(None)
            }
            TAG_REGISTER | TAG_REGISTER_READ_ONLY => {
                let access = if got.tag == TAG_REGISTER {
                    crate::Access::ReadWrite
                } else {
                    crate::Access::ReadOnly
                };
                let key = node.register(got.buffer, access).map_err(|e| e.error)?;
                let mut reply = node.alloc(MemoryKind::Host, 24).await?;
                reply
                    .write(0, &key.to_bytes())
                    .map_err(|e| Error::Usage(e.to_string()))?;
                node.send(&got.peer, got.tag, reply)
                    .await
                    .map_err(|e| e.error)?;
                Ok(None)
            }
            TAG_UNREGISTER => {
                let bytes = got
                    .buffer
                    .to_vec()
                    .map_err(|e| Error::Usage(e.to_string()))?;
                let key = decode_key(&bytes)
                    .ok_or_else(|| Error::Usage("an unregister request is not a key".into()))?;
                let buffer = node.unregister(key).await?;
                node.send(&got.peer, TAG_UNREGISTER, buffer)
                    .await
                    .map_err(|e| e.error)?;
                Ok(None)
            }
            TAG_UNPUBLISH => {
                let bytes = got
                    .buffer
                    .to_vec()
                    .map_err(|e| Error::Usage(e.to_string()))?;
                let key = String::from_utf8(bytes)
                    .map_err(|_| Error::Usage("an unpublish request's key is not UTF-8".into()))?;
                let buffer = node.unpublish(&key).await?;
                node.send(&got.peer, TAG_UNPUBLISH, buffer)
                    .await
                    .map_err(|e| e.error)?;
                Ok(None)
            }
            _ => Ok(Some(got)),
        }
    }

    /// A region key as 24 bytes.
    pub fn encode_key(key: RegionKey) -> [u8; 24] {
        key.to_bytes()
    }

    /// A region key from 24 bytes; `None` if `bytes` is not 24 bytes long.
    pub fn decode_key(bytes: &[u8]) -> Option<RegionKey> {
        RegionKey::from_bytes(bytes)
    }
}
