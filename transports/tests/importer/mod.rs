//! The second process of a cross-process GPU test: the test binary run again for one test,
//! as its importer, connected back to the parent over a Unix socket.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Set in the importer's environment: the role, and where it connects.
const ROLE: &str = "FERRY_GPU_TEST_IMPORTER";
const SOCKET: &str = "FERRY_GPU_TEST_SOCKET";

/// In the importer: the socket to connect to. `None` in the parent.
pub fn socket() -> Option<String> {
    std::env::var(ROLE)
        .is_ok()
        .then(|| std::env::var(SOCKET).expect("the socket path"))
}

/// The importer of test `test`, connecting to a listener at `path`; killed if the test
/// ends before it does.
pub struct Importer(Child);

impl Importer {
    /// Runs this binary again for `test` alone, as its importer.
    pub fn spawn(test: &str, path: &Path) -> Importer {
        let child = Command::new(std::env::current_exe().expect("current exe"))
            .args(["--exact", test, "--nocapture"])
            .env(ROLE, "1")
            .env(SOCKET, path)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn the importer");
        Importer(child)
    }

    /// The importer's connection, or a panic naming why it never came (it exited, or a
    /// minute passed).
    pub fn accept(&mut self, listener: &UnixListener) -> UnixStream {
        listener.set_nonblocking(true).expect("nonblocking");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match listener.accept() {
                Ok((sock, _)) => {
                    sock.set_nonblocking(false).expect("blocking");
                    return sock;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Some(status) = self.0.try_wait().expect("the importer's status") {
                        panic!("the importer exited before connecting: {status}");
                    }
                    assert!(Instant::now() < deadline, "the importer never connected");
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("accept: {e}"),
            }
        }
    }

    /// Waits for the importer to end.
    pub fn wait(&mut self) -> ExitStatus {
        self.0.wait().expect("wait for the importer")
    }
}

impl Drop for Importer {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            drop(self.0.kill());
            drop(self.0.wait());
        }
    }
}
