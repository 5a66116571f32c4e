//! Two workers in one process, each with its own context (as two processes would have),
//! driven from the test thread: addresses, endpoints, memory maps, rkeys, 64 MiB puts and
//! gets checked byte for byte, tagged messages, cancellation, wakeup.

mod common;

use std::time::Instant;

use common::{DEADLINE, first_difference, loopback_context, loopback_context_over, mbps, pattern};
use ucx_sys::testing::ucx_test;
use ucx_sys::{Endpoint, Features, MemoryHandle, Ucx, UcxError, Worker};

const LEN: usize = 64 << 20;

struct Pair {
    a: Worker,
    b: Worker,
    a_to_b: Endpoint,
    b_to_a: Endpoint,
}

fn pair(ucx: &Ucx, extra: Option<Features>) -> Pair {
    pair_over(ucx, extra, &common::test_tls())
}

fn pair_over(ucx: &Ucx, extra: Option<Features>, tls: &str) -> Pair {
    let a = loopback_context_over(ucx, extra, tls)
        .worker()
        .expect("worker a");
    let b = loopback_context_over(ucx, extra, tls)
        .worker()
        .expect("worker b");
    let a_to_b = a
        .connect(&b.address().expect("b's address"))
        .expect("a -> b");
    let b_to_a = b
        .connect(&a.address().expect("a's address"))
        .expect("b -> a");
    Pair {
        a,
        b,
        a_to_b,
        b_to_a,
    }
}

#[test]
fn puts_and_gets_64_mib_byte_exact() {
    let Some(ucx) = ucx_test("puts_and_gets_64_mib_byte_exact") else {
        return;
    };
    let p = pair(&ucx, None);

    // b's memory, registered, with a pattern the get must bring back.
    let memory = MemoryHandle::allocate(p.b.context(), LEN).expect("mem_map 64 MiB");
    assert!(memory.len() >= LEN);
    let initial = pattern(1, LEN);
    // SAFETY: no request or peer touches the memory yet: its rkey is not packed.
    unsafe { memory.write(0, &initial) }.expect("fill");
    let packed = memory.pack_rkey().expect("rkey_pack");
    println!("packed rkey: {} bytes", packed.as_bytes().len());
    let rkey = p.a_to_b.unpack_rkey(&packed).expect("rkey_unpack");

    // get: a reads b's memory.
    let start = Instant::now();
    let mut get = p
        .a_to_b
        .get(vec![0u8; LEN], memory.address(), &rkey)
        .expect("get_nbx");
    let moved = get
        .wait_progressing(DEADLINE, || {
            p.b.progress();
        })
        .expect("the get completes");
    let get_time = start.elapsed();
    assert_eq!(moved.bytes, LEN);
    let got = get.into_buffer().expect("complete");
    assert_eq!(
        first_difference(&got, &initial),
        None,
        "get brought other bytes"
    );

    // put: a writes a new pattern into b's memory, then flushes so it is visible there.
    let next = pattern(2, LEN);
    let start = Instant::now();
    let mut put = p
        .a_to_b
        .put(next, memory.address(), &rkey)
        .expect("put_nbx");
    put.wait_progressing(DEADLINE, || {
        p.b.progress();
    })
    .expect("the put completes");
    let mut flush = p.a_to_b.flush().expect("ep_flush_nbx");
    flush
        .wait_progressing(DEADLINE, || {
            p.b.progress();
        })
        .expect("the flush completes");
    let put_time = start.elapsed();
    let next = put.into_buffer().expect("complete");
    let mut landed = vec![0u8; LEN];
    // SAFETY: the put completed and was flushed; nothing else writes b's memory.
    unsafe { memory.read(0, &mut landed) }.expect("read back");
    assert_eq!(
        first_difference(&landed, &next),
        None,
        "put landed other bytes"
    );

    // A put into the middle, from a mapped region of a's own registered memory.
    let source = MemoryHandle::allocate(p.a.context(), 4096).expect("a's memory");
    // SAFETY: nothing else uses `source` yet.
    unsafe { source.write(0, &[0xAB; 4096]) }.expect("fill");
    let region = source.region(1024, 1024).expect("inside");
    let mut put = p
        .a_to_b
        .put(region, memory.address() + 4096, &rkey)
        .expect("put from a region");
    put.wait_progressing(DEADLINE, || {
        p.b.progress();
    })
    .expect("completes");
    p.a_to_b
        .flush()
        .expect("flush")
        .wait_progressing(DEADLINE, || {
            p.b.progress();
        })
        .expect("flushed");
    let mut window = [0u8; 1026];
    // SAFETY: flushed; nothing writes b's memory now.
    unsafe { memory.read(4095, &mut window) }.expect("read");
    assert_eq!(window[0], next[4095]);
    assert!(window[1..1025].iter().all(|&b| b == 0xAB));
    assert_eq!(window[1025], next[4096 + 1024]);

    println!(
        "one process, UCX {} TLS={}: get 64 MiB {:.1} ms ({:.0} MB/s), put+flush 64 MiB {:.1} ms ({:.0} MB/s)",
        ucx.version(),
        common::test_tls(),
        get_time.as_secs_f64() * 1e3,
        mbps(LEN, get_time),
        put_time.as_secs_f64() * 1e3,
        mbps(LEN, put_time),
    );
}

#[test]
fn tagged_messages_arrive_whole_and_a_short_buffer_is_truncated() {
    let Some(ucx) = ucx_test("tagged_messages_arrive_whole_and_a_short_buffer_is_truncated") else {
        return;
    };
    let p = pair(&ucx, None);

    // A small message, received before it is sent, and a large one (rendezvous).
    for (len, tag) in [(13usize, 7u64), (8 << 20, 0x1_0000_0042)] {
        let mut recv =
            p.b.tag_recv(vec![0u8; len], tag, u64::MAX)
                .expect("tag_recv_nbx");
        let message = pattern(tag, len);
        let mut send = p
            .a_to_b
            .tag_send(message.clone(), tag)
            .expect("tag_send_nbx");
        let got = recv
            .wait_progressing(DEADLINE, || {
                p.a.progress();
            })
            .expect("the receive completes");
        assert_eq!(got.bytes, len);
        assert_eq!(got.tag, Some(tag));
        send.wait_progressing(DEADLINE, || {
            p.b.progress();
        })
        .expect("the send completes");
        assert_eq!(recv.into_buffer().expect("complete"), message);
    }

    // b answers a on the reverse endpoint, matched by a mask on the low bits.
    let mut recv =
        p.a.tag_recv(vec![0u8; 64], 0x55, 0xFF)
            .expect("tag_recv_nbx");
    let mut send = p.b_to_a.tag_send(b"pong".to_vec(), 0xAB_55).expect("send");
    let got = recv
        .wait_progressing(DEADLINE, || {
            p.b.progress();
        })
        .expect("received");
    assert_eq!((got.bytes, got.tag), (4, Some(0xAB_55)));
    send.wait(DEADLINE).expect("sent");
    assert_eq!(&recv.into_buffer().expect("complete")[..4], b"pong");

    // A message longer than the buffer fails the receive with UCS_ERR_MESSAGE_TRUNCATED.
    let mut recv = p.b.tag_recv(vec![0u8; 8], 9, u64::MAX).expect("recv");
    let mut send = p.a_to_b.tag_send(vec![1u8; 100], 9).expect("send");
    let e = recv
        .wait_progressing(DEADLINE, || {
            p.a.progress();
        })
        .expect_err("truncated");
    assert_eq!(
        e.status().map(|s| s.code()),
        Some(ucx_sys::sys::UCS_ERR_MESSAGE_TRUNCATED),
        "{e}"
    );
    let _ = send.wait_progressing(DEADLINE, || {
        p.b.progress();
    });
}

#[test]
fn a_cancelled_receive_gives_its_buffer_back() {
    let Some(ucx) = ucx_test("a_cancelled_receive_gives_its_buffer_back") else {
        return;
    };
    let p = pair(&ucx, None);
    let mut recv = p.b.tag_recv(vec![5u8; 32], 1234, u64::MAX).expect("recv");
    assert!(recv.poll().is_none(), "nothing was sent");
    recv.cancel();
    let e = recv.wait(DEADLINE).expect_err("cancelled");
    assert!(e.is_canceled(), "{e}");
    assert_eq!(recv.into_buffer().expect("complete"), vec![5u8; 32]);
    // A pending request that is dropped is cancelled and finished by its drop.
    drop(p.b.tag_recv(vec![0u8; 32], 99, u64::MAX).expect("recv"));
}

#[test]
fn a_remote_key_works_only_on_its_endpoint_and_ranges_are_checked() {
    let Some(ucx) = ucx_test("a_remote_key_works_only_on_its_endpoint_and_ranges_are_checked")
    else {
        return;
    };
    let p = pair(&ucx, None);
    let memory = MemoryHandle::allocate(p.b.context(), 4096).expect("map");
    let rkey = p
        .a_to_b
        .unpack_rkey(&memory.pack_rkey().expect("pack"))
        .expect("unpack");
    let refused = p
        .b_to_a
        .put(vec![1u8; 8], memory.address(), &rkey)
        .expect_err("wrong endpoint");
    assert!(
        matches!(refused.error, UcxError::Misuse(_)),
        "{}",
        refused.error
    );
    assert_eq!(refused.buffer, vec![1u8; 8], "the buffer comes back");
    assert!(matches!(memory.region(4000, 100), Err(UcxError::Misuse(_))));
    assert!(matches!(
        memory.region(usize::MAX, 2),
        Err(UcxError::Misuse(_))
    ));
    assert!(matches!(
        MemoryHandle::allocate(p.b.context(), 0),
        Err(UcxError::Misuse(_))
    ));
    // An endpoint whose remote key is alive cannot be closed in order; without it, it can.
    drop(rkey);
    let Pair {
        a,
        b,
        a_to_b,
        b_to_a,
    } = p;
    let mut close = a_to_b.close().expect("close in flush mode");
    close
        .wait_progressing(DEADLINE, || {
            b.progress();
        })
        .expect("closed");
    drop(b_to_a);
    drop(a);
}

#[test]
fn the_event_fd_wakes_when_a_message_arrives() {
    let Some(ucx) = ucx_test("the_event_fd_wakes_when_a_message_arrives") else {
        return;
    };
    // Over tcp: its sockets wake the event fd; UCX's shared-memory transports are polled
    // and do not (with TLS=posix,tcp,self the fd stays quiet).
    let p = pair_over(&ucx, Some(Features::WAKEUP), "tcp,self");
    let fd = p.b.event_fd().expect("ucp_worker_get_efd");
    let mut recv = p.b.tag_recv(vec![0u8; 16], 77, u64::MAX).expect("recv");
    // Progress until b can be armed (no events pending).
    while !p.b.arm().expect("ucp_worker_arm") {
        p.b.progress();
    }
    let mut send = p.a_to_b.tag_send(b"wake up".to_vec(), 77).expect("send");
    // Drive a until the message is out, then wait on b's fd alone.
    let started = Instant::now();
    let mut woke = false;
    while started.elapsed() < DEADLINE {
        p.a.progress();
        let mut pfd = [std::os::fd::AsRawFd::as_raw_fd(&fd)];
        if readable(&mut pfd) {
            woke = true;
            break;
        }
    }
    assert!(woke, "b's event fd never became readable");
    // The fd says something arrived, not that all of it did: a keeps progressing its side
    // (on a loaded machine the message may still be partly in a's queue).
    recv.wait_progressing(DEADLINE, || {
        p.a.progress();
    })
    .expect("received after the wake-up");
    send.wait_progressing(DEADLINE, || {
        p.b.progress();
    })
    .expect("sent");
    assert!(matches!(
        loopback_context(&ucx, None).worker().expect("worker").arm(),
        Err(UcxError::Misuse(_))
    ));
}

/// Whether the fd becomes readable within 1 ms (`poll(2)`, declared here because the
/// crate does not depend on libc).
fn readable(fds: &mut [std::os::fd::RawFd; 1]) -> bool {
    #[repr(C)]
    struct PollFd {
        fd: i32,
        events: i16,
        revents: i16,
    }
    unsafe extern "C" {
        fn poll(fds: *mut PollFd, nfds: u64, timeout: i32) -> i32;
    }
    let mut p = PollFd {
        fd: fds[0],
        events: 1, // POLLIN
        revents: 0,
    };
    // SAFETY: `p` is one live, initialised pollfd; `poll` writes only its `revents`.
    let n = unsafe { poll(&mut p, 1, 1) };
    n > 0 && p.revents & 1 != 0
}

/// `Endpoint::transports` names the lanes' transports: over tcp alone on `lo`, every lane
/// is `tcp` on `lo`, before and after the first get (which completes the wireup); a UCX
/// older than 1.14 cannot say, and says so instead of answering with nothing.
#[test]
fn an_endpoint_names_its_lanes_transports() {
    let Some(ucx) = ucx_test("an_endpoint_names_its_lanes_transports") else {
        return;
    };
    let p = pair_over(&ucx, None, "tcp");
    let before = p.a_to_b.transports();
    println!("UCX {}: before the first get: {before:?}", ucx.version());
    if ucx.version() < ucx_sys::result::EP_TRANSPORTS_SINCE {
        match before {
            Err(UcxError::NotInRelease { since, found, .. }) => {
                assert_eq!(since, ucx_sys::result::EP_TRANSPORTS_SINCE);
                assert_eq!(found, ucx.version());
            }
            other => panic!("UCX {} answered {other:?}", ucx.version()),
        }
        return;
    }
    let memory = MemoryHandle::allocate(p.b.context(), 4096).expect("mem_map");
    let rkey = p
        .a_to_b
        .unpack_rkey(&memory.pack_rkey().expect("rkey_pack"))
        .expect("rkey_unpack");
    let mut get = p
        .a_to_b
        .get(vec![0u8; 4096], memory.address(), &rkey)
        .expect("get_nbx");
    get.wait_progressing(DEADLINE, || {
        p.b.progress();
    })
    .expect("the get completes");
    let after = p.a_to_b.transports().expect("transports after the get");
    println!("after the first get: {after:?}");
    assert!(!after.is_empty(), "no lanes reported");
    for entry in after
        .iter()
        .chain(before.expect("transports before").iter())
    {
        assert_eq!(entry.transport, "tcp", "{entry:?}");
        assert_eq!(entry.device, "lo", "{entry:?}");
    }
}
