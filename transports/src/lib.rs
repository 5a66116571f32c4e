//! ferry-transports: memory, the wire format, control links and the transports.
//!
//! This crate owns bytes and sockets: buffers and their leases ([`memory`]), the frame
//! format and messages ([`wire`]), authenticated control links ([`link`]) and the
//! transports that move payloads ([`tcp`]). It makes no decisions about which transfer runs
//! when; that is `ferry-actors`' job.
//!
//! Only [`cuda`] may use `unsafe` (it opts in with `#[allow(unsafe_code)]`); everything else
//! is denied it.
#![deny(unsafe_code)]
pub mod cuda;
pub mod ipc;
pub mod link;
pub mod memory;
pub mod staged;
pub mod tcp;
pub mod transport;
pub mod wire;
