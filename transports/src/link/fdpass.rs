//! Passing a file descriptor to a same-host peer over a Unix socket (SCM_RIGHTS): how an
//! exportable memory pool's handle reaches the peer once. The only `unsafe` of the link
//! layer is here (DESIGN.md allows it for fd passing).
#![allow(unsafe_code)]

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

/// Sends `fd` and the bytes of `payload` (at least one byte, at most a few KiB) in one
/// message on the Unix socket `stream` (a std or tokio `UnixStream`). Blocks like a write
/// on a blocking socket; on a non-blocking one it fails with `WouldBlock` when the socket
/// buffer is full.
///
/// # Errors
/// The socket's error, or [`io::ErrorKind::InvalidInput`] for an empty payload.
pub fn send_fd(stream: &impl AsFd, fd: BorrowedFd<'_>, payload: &[u8]) -> io::Result<()> {
    if payload.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a descriptor travels with at least one byte",
        ));
    }
    let fds = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    let iov = [IoSlice::new(payload)];
    let sent = sendmsg::<()>(
        stream.as_fd().as_raw_fd(),
        &iov,
        &cmsg,
        MsgFlags::empty(),
        None,
    )
    .map_err(io::Error::from)?;
    if sent != payload.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("sent {sent} of {} bytes with the descriptor", payload.len()),
        ));
    }
    Ok(())
}

/// Receives one descriptor and up to `payload.len()` bytes sent with it; returns the
/// descriptor and how many bytes arrived. Extra descriptors a hostile peer sends are closed.
///
/// # Errors
/// The socket's error, or [`io::ErrorKind::InvalidData`] when no descriptor came.
pub fn recv_fd(stream: &impl AsFd, payload: &mut [u8]) -> io::Result<(OwnedFd, usize)> {
    let (fd, bytes) = recv_maybe_fd(stream, payload)?;
    let fd = fd
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "the peer sent no descriptor"))?;
    Ok((fd, bytes))
}

/// Like [`recv_fd`], for a message that may come without a descriptor (an error reply).
/// Returns `(None, 0)` at the end of the stream.
///
/// # Errors
/// The socket's error (`WouldBlock` on a non-blocking socket with nothing to read).
pub fn recv_maybe_fd(
    stream: &impl AsFd,
    payload: &mut [u8],
) -> io::Result<(Option<OwnedFd>, usize)> {
    let mut iov = [IoSliceMut::new(payload)];
    let mut space = nix::cmsg_space!([RawFd; 4]);
    let msg = recvmsg::<()>(
        stream.as_fd().as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    let bytes = msg.bytes;
    let mut received = None;
    for cmsg in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            for fd in fds {
                // SAFETY: SCM_RIGHTS just installed this descriptor in our table for this
                // call; nothing else in the process knows it, so the OwnedFd is its only
                // owner. Extra ones are dropped (closed) right here.
                let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                received.get_or_insert(owned);
            }
        }
    }
    Ok((received, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_file_descriptor_crosses_a_socket_pair() {
        let (a, b) = UnixStream::pair().expect("pair");
        let mut file = tempfile::tempfile().expect("file");
        file.write_all(b"through the socket").expect("write");
        send_fd(&a, file.as_fd(), b"P!").expect("send");
        let mut buf = [0u8; 8];
        let (fd, n) = recv_fd(&b, &mut buf).expect("recv");
        assert_eq!(&buf[..n], b"P!");
        let mut received = std::fs::File::from(fd);
        received.rewind().expect("rewind");
        let mut text = String::new();
        received.read_to_string(&mut text).expect("read");
        assert_eq!(text, "through the socket");
    }

    #[test]
    fn no_descriptor_is_an_error() {
        let (mut a, b) = UnixStream::pair().expect("pair");
        a.write_all(b"x").expect("write");
        let mut buf = [0u8; 1];
        let err = recv_fd(&b, &mut buf).expect_err("nothing came");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
