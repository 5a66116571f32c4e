//! ferry-transports: memory, the wire format, control links and the transports.
#![forbid(unsafe_code)]
pub mod wire;
