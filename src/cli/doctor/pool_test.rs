//! The two-process pool export/import test of `ferry doctor`: what the ipc transport does
//! with each GPU's memory, done once with a few KiB.
//!
//! This process makes an exportable pool on each GPU that declares it can export one,
//! writes a pattern into a buffer of it, and hands the pool's file descriptor (SCM_RIGHTS)
//! and the buffer's 64-byte pointer export to a second process, `ferry doctor
//! --pool-import-child SOCKET` (hidden). That one imports the pool and the buffer, reads the
//! buffer back and says whether its checksum matched. One GPU at a time, each answered
//! before the next is sent; the child imports nothing after its answer, so this process
//! frees its buffer only once the import is gone.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry_transports::cuda::{
    CudaProbe, Device, ExportablePool, POINTER_EXPORT_LEN, Stream, copy_from_host, copy_to_host,
};
use ferry_transports::link::fdpass;

/// Bytes of the test buffer.
const LEN: usize = 64 << 10;
/// How long the whole test may take (the child opens a context on every GPU).
const LIMIT: Duration = Duration::from_secs(30);
/// The message for one GPU: pointer export, length (u64 LE), CRC-32C (u32 LE), ordinal
/// (u32 LE), then the GPU's UUID.
const HEADER: usize = POINTER_EXPORT_LEN + 8 + 4 + 4;

/// The outcome of the test on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolTest {
    /// The GPU's ordinal in this process.
    pub ordinal: i32,
    /// `Ok` when the second process read back what was written; why not otherwise.
    pub outcome: Result<(), String>,
}

/// Runs the test on every GPU of `probe` that declares exportable pools (VMM, memory pools
/// and POSIX-fd handles); none without a working driver. Starts `exe` (this program) as the
/// importer. Does not fail: each GPU's outcome says what went wrong.
pub fn run(probe: &CudaProbe, exe: &Path) -> Vec<PoolTest> {
    let CudaProbe::Ready(driver) = probe else {
        return Vec::new();
    };
    let ordinals: Vec<i32> = driver
        .devices
        .iter()
        .filter(|d| d.memory_pools && d.pool_posix_fd && d.posix_fd_handles && d.vmm)
        .map(|d| d.ordinal)
        .collect();
    if ordinals.is_empty() {
        return Vec::new();
    }
    match Importer::start(exe) {
        Ok(mut importer) => {
            let tests = ordinals
                .iter()
                .map(|&ordinal| PoolTest {
                    ordinal,
                    outcome: importer.test(ordinal),
                })
                .collect();
            importer.finish();
            tests
        }
        Err(e) => ordinals
            .iter()
            .map(|&ordinal| PoolTest {
                ordinal,
                outcome: Err(e.clone()),
            })
            .collect(),
    }
}

/// The second process and the socket to it.
struct Importer {
    child: Child,
    socket: UnixStream,
    replies: BufReader<UnixStream>,
    deadline: Instant,
    _dir: tempfile::TempDir,
}

impl Importer {
    fn start(exe: &Path) -> Result<Importer, String> {
        let deadline = Instant::now() + LIMIT;
        let dir = tempfile::Builder::new()
            .prefix("ferry-doctor-")
            .tempdir()
            .map_err(|e| format!("cannot create a scratch directory: {e}"))?;
        let path = dir.path().join("pool.sock");
        let listener =
            UnixListener::bind(&path).map_err(|e| format!("cannot listen on {path:?}: {e}"))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("cannot listen: {e}"))?;
        let mut child = Command::new(exe)
            .arg("doctor")
            .arg("--pool-import-child")
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start the importing process: {e}"))?;
        let socket = loop {
            match listener.accept() {
                Ok((socket, _)) => break socket,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(stop(&mut child, format!("accepting the importer: {e}"))),
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("the importing process exited at start: {status}"));
            }
            if Instant::now() >= deadline {
                return Err(stop(
                    &mut child,
                    "the importing process did not connect".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let setup = socket
            .set_nonblocking(false)
            .and_then(|()| socket.try_clone());
        let replies = match setup {
            Ok(reader) => BufReader::new(reader),
            Err(e) => return Err(stop(&mut child, format!("the importer's socket: {e}"))),
        };
        Ok(Importer {
            child,
            socket,
            replies,
            deadline,
            _dir: dir,
        })
    }

    /// Exports a pool and a buffer of GPU `ordinal`, and waits for the importer's verdict.
    fn test(&mut self, ordinal: i32) -> Result<(), String> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("not tested: the test ran out of time".into());
        }
        let cuda = |e: ferry_transports::cuda::CudaError| e.to_string();
        let device = Device::open(ordinal as usize).map_err(cuda)?;
        let pool = ExportablePool::new(&device).map_err(cuda)?;
        let stream = Stream::new(&device).map_err(cuda)?;
        let mut buffer = pool.alloc(LEN, &stream).map_err(cuda)?;
        let pattern: Vec<u8> = (0..LEN)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3])
            .collect();
        copy_from_host(&mut buffer, 0, &pattern, &stream).map_err(cuda)?;
        let export = buffer.export_pointer().map_err(cuda)?;
        let fd = pool.export_fd().map_err(cuda)?;
        let mut message = Vec::with_capacity(HEADER + device.uuid().len());
        message.extend_from_slice(&export);
        message.extend_from_slice(&(LEN as u64).to_le_bytes());
        message.extend_from_slice(&crc32c::crc32c(&pattern).to_le_bytes());
        message.extend_from_slice(&(ordinal as u32).to_le_bytes());
        message.extend_from_slice(device.uuid().as_bytes());
        let io = |e: std::io::Error| format!("talking to the importing process: {e}");
        self.socket.set_write_timeout(Some(left)).map_err(io)?;
        fdpass::send_fd(&self.socket, fd.as_fd(), &message).map_err(io)?;
        drop(fd);
        self.socket.set_read_timeout(Some(left)).map_err(io)?;
        let mut reply = String::new();
        if let Err(e) = self.replies.read_line(&mut reply) {
            // It may still hold the import: stop it before the buffer is freed.
            let _ = self.child.kill();
            let _ = self.child.wait();
            return Err(io(e));
        }
        // The importer freed its import before answering: only now may the buffer go.
        drop(buffer);
        match reply.trim_end() {
            "ok" => Ok(()),
            "" => Err("the importing process stopped without an answer".into()),
            other => Err(other.strip_prefix("error: ").unwrap_or(other).to_string()),
        }
    }

    /// Closes the socket (the importer exits at its end) and reaps the importer.
    fn finish(self) {
        let Importer {
            mut child,
            socket,
            replies,
            deadline,
            _dir,
        } = self;
        drop(socket);
        drop(replies);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Kills the importer and returns `why`.
fn stop(child: &mut Child, why: String) -> String {
    let _ = child.kill();
    let _ = child.wait();
    why
}

/// The importing process (`ferry doctor --pool-import-child SOCKET`): answers each GPU's
/// message with `ok` or `error: ...` until the socket closes.
pub fn child(socket: &Path) -> anyhow::Result<()> {
    let socket = UnixStream::connect(socket)?;
    socket.set_read_timeout(Some(LIMIT))?;
    let mut out = socket.try_clone()?;
    loop {
        let mut message = [0u8; 512];
        let (fd, n) = fdpass::recv_maybe_fd(&socket, &mut message)?;
        let Some(fd) = fd else {
            return Ok(());
        };
        let reply = match import(fd, &message[..n]) {
            Ok(()) => "ok\n".to_string(),
            Err(e) => format!("error: {}\n", e.replace('\n', " ")),
        };
        out.write_all(reply.as_bytes())?;
    }
}

/// Imports the pool and the buffer one message describes and checks the buffer's bytes.
fn import(fd: std::os::fd::OwnedFd, message: &[u8]) -> Result<(), String> {
    if message.len() <= HEADER {
        return Err(format!("a message of {} bytes", message.len()));
    }
    let (header, uuid) = message.split_at(HEADER);
    let export: [u8; POINTER_EXPORT_LEN] = header[..POINTER_EXPORT_LEN]
        .try_into()
        .map_err(|_| "a short message".to_string())?;
    let word = |at: usize, n: usize| {
        let mut b = [0u8; 8];
        b[..n].copy_from_slice(&header[at..at + n]);
        u64::from_le_bytes(b)
    };
    let len = word(POINTER_EXPORT_LEN, 8) as usize;
    let crc = word(POINTER_EXPORT_LEN + 8, 4) as u32;
    let ordinal = word(POINTER_EXPORT_LEN + 12, 4) as usize;
    let uuid = String::from_utf8_lossy(uuid);
    // The same GPU under the same ordinal (same environment) unless CUDA_VISIBLE_DEVICES
    // says otherwise; by UUID then (which opens every GPU).
    let device = match Device::open(ordinal) {
        Ok(d) if d.uuid().eq_ignore_ascii_case(&uuid) => d,
        _ => Device::by_uuid(&uuid).map_err(|e| format!("the importing process: {e}"))?,
    };
    let device = &device;
    let cuda = |what: &str| {
        let what = what.to_string();
        move |e: ferry_transports::cuda::CudaError| format!("{what}: {e}")
    };
    let pool =
        ExportablePool::import_fd(device, fd, "doctor").map_err(cuda("importing the pool"))?;
    let buffer = pool
        .import_pointer(&export, len)
        .map_err(cuda("importing a buffer"))?;
    let stream = Stream::new(device).map_err(cuda("a stream"))?;
    let mut bytes = vec![0u8; len];
    copy_to_host(&mut bytes, &buffer, 0, &stream).map_err(cuda("reading the buffer back"))?;
    drop(buffer);
    if crc32c::crc32c(&bytes) != crc {
        return Err("the imported buffer reads other bytes than were written".into());
    }
    Ok(())
}
