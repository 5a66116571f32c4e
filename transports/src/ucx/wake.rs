//! The progress thread's sleep: an eventfd that callers signal when they queue work, and a
//! `poll` on it together with UCX's worker event descriptor.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// An eventfd (non-blocking, close-on-exec): [`Wake::signal`] makes it readable until the
/// progress thread [`Wake::drain`]s it.
#[derive(Debug)]
pub(crate) struct Wake {
    fd: OwnedFd,
}

impl Wake {
    /// A new, unsignalled eventfd.
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: `eventfd` takes no pointers; it returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened by `eventfd` and is owned by nothing else.
        Ok(Self {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Makes the descriptor readable. Never blocks; a failure (the counter saturated, which
    /// means it is readable already) is ignored.
    pub(crate) fn signal(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local to a descriptor this value owns.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Resets the descriptor to unreadable. Never blocks.
    pub(crate) fn drain(&self) {
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local from a descriptor this value
        // owns; non-blocking, so an unsignalled eventfd returns EAGAIN at once.
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), count.as_mut_ptr().cast(), count.len()) };
    }
}

impl AsFd for Wake {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Sleeps until one of `fds` is readable or `timeout` passes (`None`: no limit). An
/// interrupted sleep returns early, as a spurious wake-up.
///
/// # Errors
///
/// `poll`'s error other than `EINTR`.
pub(crate) fn sleep_until_readable(
    fds: &[BorrowedFd<'_>],
    timeout: Option<Duration>,
) -> io::Result<()> {
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let timeout_ms = match timeout {
        // Rounded up, so a sleep never ends before the deadline it waits for.
        Some(t) => i32::try_from(t.as_micros().div_ceil(1000)).unwrap_or(i32::MAX),
        None => -1,
    };
    // SAFETY: `polled` is a live array of `polled.len()` pollfd structs, each naming a
    // descriptor borrowed for the duration of this call.
    let n = unsafe {
        libc::poll(
            polled.as_mut_ptr(),
            polled.len() as libc::nfds_t,
            timeout_ms,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_signal_wakes_the_sleeper_until_drained() {
        let wake = Wake::new().expect("eventfd");
        let start = Instant::now();
        sleep_until_readable(&[wake.as_fd()], Some(Duration::from_millis(20))).expect("poll");
        assert!(start.elapsed() >= Duration::from_millis(20));
        wake.signal();
        wake.signal();
        let start = Instant::now();
        sleep_until_readable(&[wake.as_fd()], Some(Duration::from_secs(10))).expect("poll");
        assert!(start.elapsed() < Duration::from_secs(5));
        wake.drain();
        let start = Instant::now();
        sleep_until_readable(&[wake.as_fd()], Some(Duration::from_millis(10))).expect("poll");
        assert!(start.elapsed() >= Duration::from_millis(10));
    }
}
