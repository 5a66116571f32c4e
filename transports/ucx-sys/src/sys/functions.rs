//! The function table: every UCP entry point ferry uses, as C function pointers looked up
//! with `dlsym` when the library is loaded. Signatures are those of UCX 1.13's
//! `ucp/api/ucp.h` (and `ucs/type/status.h` for `ucs_status_string`).

use std::ffi::{c_char, c_int, c_uint, c_void};

use super::types::*;

macro_rules! function_table {
    (
        required { $($name:ident : fn($($arg:ident : $ty:ty),*) $(-> $ret:ty)?;)* }
        optional { $($oname:ident : fn($($oarg:ident : $oty:ty),*) $(-> $oret:ty)?;)* }
    ) => {
        /// The UCP entry points, resolved from one loaded `libucp`. Required ones are
        /// plain function pointers; optional ones (absent from some builds, or used only
        /// for reports) are `Option`s.
        ///
        /// The pointers are valid for as long as the library stays loaded, which in this
        /// crate is the life of the process: [`super::Library`] never unloads it.
        #[derive(Clone, Copy)]
        #[allow(missing_docs)] // each field is the C function of the same name
        pub struct Functions {
            $(pub $name: unsafe extern "C" fn($($arg: $ty),*) $(-> $ret)?,)*
            $(pub $oname: Option<unsafe extern "C" fn($($oarg: $oty),*) $(-> $oret)?>,)*
        }

        impl Functions {
            /// Names of the required entry points, in table order.
            pub const REQUIRED: &'static [&'static str] = &[$(stringify!($name)),*];

            /// Looks every entry point up in `lib`.
            ///
            /// # Errors
            ///
            /// The name of the first required symbol that is missing, with `dlerror`'s text.
            ///
            /// # Safety
            ///
            /// `lib` must be a UCX `libucp` whose exported symbols of these names have the
            /// signatures declared here (those of UCX 1.13 and later, which keep them).
            pub unsafe fn load(
                lib: &libloading::Library,
            ) -> Result<Self, (&'static str, libloading::Error)> {
                Ok(Self {
                    $($name: {
                        // SAFETY: the caller promises that the symbol, if present, has the
                        // declared C signature; the pointer is copied out of the `Symbol`
                        // and stays valid because the library is never unloaded.
                        let sym = unsafe {
                            lib.get::<unsafe extern "C" fn($($ty),*) $(-> $ret)?>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                        }
                        .map_err(|e| (stringify!($name), e))?;
                        *sym
                    },)*
                    $($oname: {
                        // SAFETY: as above.
                        unsafe {
                            lib.get::<unsafe extern "C" fn($($oty),*) $(-> $oret)?>(
                                concat!(stringify!($oname), "\0").as_bytes(),
                            )
                        }
                        .ok()
                        .map(|sym| *sym)
                    },)*
                })
            }
        }

        impl std::fmt::Debug for Functions {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct("Functions")
                    $(.field(stringify!($name), &(self.$name as *const c_void)))*
                    $(.field(stringify!($oname), &self.$oname.map(|p| p as *const c_void)))*
                    .finish()
            }
        }
    };
}

function_table! {
    required {
        ucp_get_version: fn(major: *mut c_uint, minor: *mut c_uint, release: *mut c_uint);
        ucp_config_read: fn(env_prefix: *const c_char, filename: *const c_char, config_p: *mut ucp_config_h) -> ucs_status_t;
        ucp_config_release: fn(config: ucp_config_h);
        ucp_config_modify: fn(config: ucp_config_h, name: *const c_char, value: *const c_char) -> ucs_status_t;
        ucp_init_version: fn(api_major: c_uint, api_minor: c_uint, params: *const ucp_params_t, config: ucp_config_h, context_p: *mut ucp_context_h) -> ucs_status_t;
        ucp_cleanup: fn(context: ucp_context_h);
        ucp_worker_create: fn(context: ucp_context_h, params: *const ucp_worker_params_t, worker_p: *mut ucp_worker_h) -> ucs_status_t;
        ucp_worker_destroy: fn(worker: ucp_worker_h);
        ucp_worker_get_address: fn(worker: ucp_worker_h, address_p: *mut ucp_address_h, length_p: *mut usize) -> ucs_status_t;
        ucp_worker_release_address: fn(worker: ucp_worker_h, address: ucp_address_h);
        ucp_worker_progress: fn(worker: ucp_worker_h) -> c_uint;
        ucp_worker_get_efd: fn(worker: ucp_worker_h, fd: *mut c_int) -> ucs_status_t;
        ucp_worker_arm: fn(worker: ucp_worker_h) -> ucs_status_t;
        ucp_worker_flush_nbx: fn(worker: ucp_worker_h, param: *const ucp_request_param_t) -> ucs_status_ptr_t;
        ucp_ep_create: fn(worker: ucp_worker_h, params: *const ucp_ep_params_t, ep_p: *mut ucp_ep_h) -> ucs_status_t;
        ucp_ep_close_nbx: fn(ep: ucp_ep_h, param: *const ucp_request_param_t) -> ucs_status_ptr_t;
        ucp_ep_flush_nbx: fn(ep: ucp_ep_h, param: *const ucp_request_param_t) -> ucs_status_ptr_t;
        ucp_mem_map: fn(context: ucp_context_h, params: *const ucp_mem_map_params_t, memh_p: *mut ucp_mem_h) -> ucs_status_t;
        ucp_mem_unmap: fn(context: ucp_context_h, memh: ucp_mem_h) -> ucs_status_t;
        ucp_mem_query: fn(memh: ucp_mem_h, attr: *mut ucp_mem_attr_t) -> ucs_status_t;
        ucp_rkey_pack: fn(context: ucp_context_h, memh: ucp_mem_h, rkey_buffer_p: *mut *mut c_void, size_p: *mut usize) -> ucs_status_t;
        ucp_rkey_buffer_release: fn(rkey_buffer: *mut c_void);
        ucp_ep_rkey_unpack: fn(ep: ucp_ep_h, rkey_buffer: *const c_void, rkey_p: *mut ucp_rkey_h) -> ucs_status_t;
        ucp_rkey_destroy: fn(rkey: ucp_rkey_h);
        ucp_put_nbx: fn(ep: ucp_ep_h, buffer: *const c_void, count: usize, remote_addr: u64, rkey: ucp_rkey_h, param: *const ucp_request_param_t) -> ucs_status_ptr_t;
        ucp_get_nbx: fn(ep: ucp_ep_h, buffer: *mut c_void, count: usize, remote_addr: u64, rkey: ucp_rkey_h, param: *const ucp_request_param_t) -> ucs_status_ptr_t;
        ucp_tag_send_nbx: fn(ep: ucp_ep_h, buffer: *const c_void, count: usize, tag: ucp_tag_t, param: *const ucp_request_param_t) -> ucs_status_ptr_t;
        ucp_tag_recv_nbx: fn(worker: ucp_worker_h, buffer: *mut c_void, count: usize, tag: ucp_tag_t, tag_mask: ucp_tag_t, param: *const ucp_request_param_t) -> ucs_status_ptr_t;
        ucp_tag_recv_request_test: fn(request: *mut c_void, info: *mut ucp_tag_recv_info_t) -> ucs_status_t;
        ucp_request_check_status: fn(request: *mut c_void) -> ucs_status_t;
        ucp_request_cancel: fn(worker: ucp_worker_h, request: *mut c_void);
        ucp_request_free: fn(request: *mut c_void);
    }
    optional {
        ucp_context_query: fn(context: ucp_context_h, attr: *mut ucp_context_attr_t) -> ucs_status_t;
        ucp_ep_query: fn(ep: ucp_ep_h, attr: *mut ucp_ep_attr_t) -> ucs_status_t;
        ucp_get_version_string: fn() -> *const c_char;
        ucs_status_string: fn(status: ucs_status_t) -> *const c_char;
    }
}
