//! The CUDA layer: today only [`probe`], which says whether this machine has a working
//! CUDA driver and what its GPUs can do. Devices, streams, exportable pools and IPC arrive
//! with the ipc transport.
//!
//! The driver is loaded at run time (cudarc's dynamic loading), so the build needs no CUDA.
//! cudarc panics when the library is missing on its first call, so every entry point here
//! checks that the library loads before calling into cudarc.
//!
//! This is one of the few modules allowed to use `unsafe` (FFI into the driver); each block
//! says why it is sound.
#![allow(unsafe_code)]

mod probe;

pub use probe::{CudaDevice, CudaDriver, CudaProbe, probe};
