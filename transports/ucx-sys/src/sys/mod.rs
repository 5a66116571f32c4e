//! Layer 1: the raw C API. `#[repr(C)]` types and constants written from the UCX 1.13
//! headers ([`types`]), the table of entry points looked up at run time ([`Functions`]),
//! and the loaded library ([`Library`]). Nothing here checks anything beyond loading;
//! [`crate::result`] wraps each call.

#![allow(non_camel_case_types)]

mod functions;
mod library;
pub mod types;

pub use functions::Functions;
pub use library::{LIBRARY_ENV, Library, MIN_VERSION, SYSTEM_LIBRARY};
pub use types::*;
