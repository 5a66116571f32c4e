//! The two-process pool trial: this process allocates in an exportable pool on GPU 0 and
//! passes the pool's descriptor and one buffer's pointer export to a second `ferry doctor`
//! over a Unix socket; that process imports both and reads the bytes back. It is the same
//! path the ipc transport takes, so when it works here, same-host ipc can work.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferry_transports::cuda::pattern::{device_checksum, fill_pattern};
use ferry_transports::cuda::{Device, ExportablePool, Stream};
use ferry_transports::link::fdpass;

use super::facts::PoolTrial;

/// Bytes of the trial buffer: odd, so a length mix-up shows.
const LEN: usize = (1 << 20) + 3;
/// How long the trial may take before it is called failed.
const LIMIT: Duration = Duration::from_secs(30);

/// Runs the trial.
pub fn trial() -> PoolTrial {
    match exporter() {
        Ok((pool_import_ms, first_pointer_ms)) => PoolTrial::Works {
            pool_import_ms,
            first_pointer_ms,
        },
        Err(e) => PoolTrial::Failed(format!("{e:#}")),
    }
}

fn exporter() -> anyhow::Result<(f64, f64)> {
    let device = Device::open(0).context("open GPU 0")?;
    let pool = ExportablePool::new(&device).context("create an exportable pool")?;
    let stream = Stream::new(&device).context("create a stream")?;
    let mut buffer = pool.alloc(LEN, &stream).context("allocate from the pool")?;
    // fill_pattern synchronises: the bytes are written before the other process looks.
    let want = fill_pattern(&mut buffer, 7, &stream).context("write the buffer")?;
    let export = buffer
        .export_pointer()
        .context("export the buffer's pointer")?;

    let dir = tempfile::tempdir().context("scratch directory")?;
    let path = dir.path().join("pool.sock");
    let listener = UnixListener::bind(&path).context("bind the trial socket")?;
    listener.set_nonblocking(true)?;
    let exe = std::env::current_exe().context("find the ferry binary")?;
    let mut child = Command::new(exe)
        .arg("doctor")
        .arg("--pool-child")
        .arg(&path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("start the importing process")?;
    let deadline = Instant::now() + LIMIT;
    let sock = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Some(status) = child.try_wait()? {
                    bail!("the importing process exited before connecting ({status})");
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    bail!("the importing process never connected");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e).context("accept"),
        }
    };
    let mut sock = sock;
    sock.set_nonblocking(false)?;
    sock.set_read_timeout(Some(LIMIT))?;
    let fd = pool
        .export_fd()
        .context("export the pool as a file descriptor")?;
    let mut payload = export.to_vec();
    payload.extend_from_slice(&(LEN as u64).to_le_bytes());
    fdpass::send_fd(&sock, fd.as_fd(), &payload).context("pass the pool's descriptor")?;
    let mut reply = String::new();
    sock.read_to_string(&mut reply)
        .context("the importer's answer")?;
    let _ = child.wait();
    let words: Vec<&str> = reply.split_whitespace().collect();
    match words.as_slice() {
        ["ok", sum, pool_ms, pointer_ms] => {
            let sum: u32 = sum.parse().context("the importer's checksum")?;
            if sum != want {
                bail!("the other process read different bytes (checksum {sum:#x}, want {want:#x})");
            }
            Ok((pool_ms.parse()?, pointer_ms.parse()?))
        }
        _ => bail!("the importing process: {}", reply.trim()),
    }
}

/// The importing side, run as `ferry doctor --pool-child SOCKET`.
pub fn importer(path: &Path) -> ExitCode {
    let Ok(mut sock) = UnixStream::connect(path) else {
        return ExitCode::FAILURE;
    };
    let answer = match import(&sock) {
        Ok((sum, pool_ms, pointer_ms)) => format!("ok {sum} {pool_ms:.3} {pointer_ms:.3}\n"),
        Err(e) => format!("error {e:#}\n"),
    };
    let _ = sock.write_all(answer.as_bytes());
    ExitCode::SUCCESS
}

fn import(sock: &UnixStream) -> anyhow::Result<(u32, f64, f64)> {
    sock.set_read_timeout(Some(LIMIT))?;
    let mut payload = [0u8; 72];
    let (fd, n) = fdpass::recv_fd(sock, &mut payload).context("receive the pool's descriptor")?;
    if n != payload.len() {
        bail!("got {n} bytes with the descriptor, want 72");
    }
    let export: [u8; 64] = payload[..64].try_into()?;
    let len = usize::try_from(u64::from_le_bytes(payload[64..].try_into()?))?;
    let device = Device::open(0).context("open GPU 0")?;
    let stream = Stream::new(&device).context("create a stream")?;
    let t = Instant::now();
    let pool = ExportablePool::import_fd(&device, fd).context("import the pool")?;
    let pool_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let buffer = pool
        .import_pointer(&export, len)
        .context("import the pointer")?;
    let pointer_ms = t.elapsed().as_secs_f64() * 1e3;
    let sum = device_checksum(&buffer, &stream).context("read the imported buffer")?;
    Ok((sum, pool_ms, pointer_ms))
}
