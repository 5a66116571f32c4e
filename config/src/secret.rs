//! Reading the shared secret named by `security.secret_file`.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use crate::error::ConfigError;
use crate::schema::Config;

/// Shortest accepted secret, in bytes.
const MIN_SECRET: usize = 16;
/// Longest accepted secret file, in bytes: a larger one is not a secret someone wrote (and a
/// device such as `/dev/zero` would never end).
const MAX_SECRET: u64 = 64 << 10;
/// Permission bits that let the file's group or others read or write it.
const GROUP_OR_OTHERS: u32 = 0o066;

impl Config {
    /// Reads the shared secret from `security.secret_file`, without its trailing newline.
    /// Returns `Ok(None)` when no secret file is set (then `security.danger_insecure` must be
    /// set, which [`Config::validate`] checks).
    ///
    /// The file is opened once (a symbolic link is followed: the target's mode counts), its
    /// mode is read from the open file, and the secret is read from the same handle, so the
    /// file that was checked is the file that is read.
    ///
    /// Blocks on file I/O. A relative path is relative to the process's working directory.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Secret`], naming the path and the layer that set
    /// `security.secret_file` (see [`Config::origin_of`]), if the file cannot be read; if
    /// its group or others may read or write it (mode `0644`, say), or another user owns
    /// it, unless `security.danger_secret_file_any_mode` is set (these two errors name
    /// where that key's value came from too); or if it is empty, holds fewer than 16
    /// bytes, or more than 64 KiB.
    pub fn read_secret(&self) -> Result<Option<Vec<u8>>, ConfigError> {
        let Some(path) = &self.security.secret_file else {
            return Ok(None);
        };
        let secret_file = self.origin_of("security.secret_file");
        let error = |detail: String, source, others| ConfigError::Secret {
            origin: secret_file.origin.clone(),
            line: secret_file.line,
            path: path.clone(),
            detail,
            source,
            others,
        };
        let refuse = |detail: String| error(detail, None, Vec::new());
        let cannot_read =
            |e: std::io::Error| error(format!("cannot read: {e}"), Some(e), Vec::new());
        // Who may read the file is the opt-out's say too: name where it was left off.
        let refuse_access = |detail: String| {
            let opt_out = ["security.danger_secret_file_any_mode"];
            error(detail, None, self.provenance.others(&secret_file, opt_out))
        };
        // Only a regular file: opening a FIFO would block, a device would read for ever.
        if !std::fs::metadata(path).map_err(cannot_read)?.is_file() {
            return Err(refuse("not a regular file".into()));
        }
        let file = File::open(path).map_err(cannot_read)?;
        let meta = file.metadata().map_err(cannot_read)?;
        if !meta.is_file() {
            return Err(refuse("not a regular file".into()));
        }
        let mode = meta.permissions().mode();
        if !self.security.danger_secret_file_any_mode {
            if mode & GROUP_OR_OTHERS != 0 {
                return Err(refuse_access(mode_problem(mode, path)));
            }
            // Owned by us or by root, as SSH asks of a key: a file another user owns is
            // theirs to read and to change.
            let me = std::fs::metadata("/proc/self").map(|m| m.uid()).ok();
            if meta.uid() != 0 && me.is_some_and(|me| me != meta.uid()) {
                return Err(refuse_access(format!(
                    "it is owned by user {}, not by this process's user or root; run chown on it \
                     (or, for a test setup, set security.danger_secret_file_any_mode = true)",
                    meta.uid()
                )));
            }
        }
        let mut secret = Vec::new();
        file.take(MAX_SECRET + 1)
            .read_to_end(&mut secret)
            .map_err(cannot_read)?;
        if secret.len() as u64 > MAX_SECRET {
            return Err(refuse(
                "the file is larger than 64 KiB; is this the right file?".into(),
            ));
        }
        while matches!(secret.last(), Some(b'\n' | b'\r')) {
            secret.pop();
        }
        if secret.is_empty() {
            return Err(refuse("the file is empty".into()));
        }
        if secret.len() < MIN_SECRET {
            return Err(refuse(format!(
                "the secret is {} bytes; use at least {MIN_SECRET} (32 random bytes is a good choice)",
                secret.len()
            )));
        }
        Ok(Some(secret))
    }
}

/// Why a secret file of `mode` is refused, and the command that fixes it.
fn mode_problem(mode: u32, path: &Path) -> String {
    let what = match (mode & 0o044 != 0, mode & 0o022 != 0) {
        (true, true) => "read and change",
        (true, false) => "read",
        _ => "change",
    };
    format!(
        "mode {:04o} lets group or others {what} it; run chmod 600 {} (or, for a test setup, set security.danger_secret_file_any_mode = true)",
        mode & 0o7777,
        path.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn with_secret(path: &Path) -> Config {
        let mut config = Config::default();
        config.security.secret_file = Some(path.to_path_buf());
        config
    }

    /// Writes `text` to `path` and gives it `mode`, whatever the umask.
    fn write_secret(path: &Path, text: &str, mode: u32) -> std::io::Result<()> {
        std::fs::write(path, text)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
    }

    #[test]
    fn reads_and_trims() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("secret");
        write_secret(&path, "0123456789abcdef\n", 0o600)?;
        assert_eq!(
            with_secret(&path).read_secret()?,
            Some(b"0123456789abcdef".to_vec())
        );
        assert_eq!(Config::default().read_secret()?, None);
        Ok(())
    }

    #[test]
    fn refuses_missing_empty_short_and_huge() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("secret");
        let missing = with_secret(&path).read_secret().expect_err("missing");
        assert!(
            missing.to_string().contains(&path.display().to_string()),
            "{missing}"
        );
        write_secret(&path, "\n", 0o600)?;
        let empty = with_secret(&path).read_secret().expect_err("empty");
        assert!(empty.to_string().contains("empty"), "{empty}");
        write_secret(&path, "short", 0o600)?;
        let short = with_secret(&path).read_secret().expect_err("short");
        assert!(short.to_string().contains("5 bytes"), "{short}");
        assert!(short.to_string().contains("at least 16"), "{short}");
        write_secret(&path, &"x".repeat(64 << 10), 0o600)?;
        assert!(with_secret(&path).read_secret()?.is_some());
        write_secret(&path, &"x".repeat((64 << 10) + 1), 0o600)?;
        let huge = with_secret(&path).read_secret().expect_err("huge");
        assert!(huge.to_string().contains("64 KiB"), "{huge}");
        Ok(())
    }

    #[test]
    fn refuses_a_file_group_or_others_can_read_or_write() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("secret");
        for (mode, what) in [
            (0o644, "read it"),
            (0o640, "read it"),
            (0o604, "read it"),
            (0o620, "change it"),
            (0o666, "read and change it"),
        ] {
            write_secret(&path, "0123456789abcdef", mode)?;
            let err = with_secret(&path).read_secret().expect_err("open mode");
            let message = err.to_string();
            assert_eq!(err.key(), Some("security.secret_file"), "{message}");
            for part in [
                format!("secret file {}: ", path.display()),
                format!("mode {mode:04o} lets group or others {what};"),
                format!("chmod 600 {}", path.display()),
                "danger_secret_file_any_mode".to_string(),
            ] {
                assert!(
                    message.contains(&part),
                    "{mode:o}: no {part:?} in {message}"
                );
            }
        }
        // Only read and write bits count: execute bits reveal nothing.
        for mode in [0o600, 0o400, 0o700, 0o610, 0o601] {
            write_secret(&path, "0123456789abcdef", mode)?;
            assert!(with_secret(&path).read_secret()?.is_some(), "{mode:o}");
        }
        Ok(())
    }

    #[test]
    fn the_danger_flag_accepts_any_mode_but_not_a_short_secret() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("secret");
        write_secret(&path, "0123456789abcdef", 0o644)?;
        let mut config = with_secret(&path);
        config.security.danger_secret_file_any_mode = true;
        assert_eq!(config.read_secret()?, Some(b"0123456789abcdef".to_vec()));
        write_secret(&path, "short", 0o644)?;
        let short = config.read_secret().expect_err("short");
        assert!(short.to_string().contains("5 bytes"), "{short}");
        Ok(())
    }

    #[test]
    fn a_symlink_is_followed_and_its_targets_mode_counts() -> TestResult {
        let dir = tempfile::tempdir()?;
        let target = dir.path().join("target");
        let link = dir.path().join("link");
        write_secret(&target, "0123456789abcdef", 0o600)?;
        // A symbolic link's own mode is always 0777 on Linux.
        std::os::unix::fs::symlink(&target, &link)?;
        assert!(with_secret(&link).read_secret()?.is_some());
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644))?;
        let err = with_secret(&link).read_secret().expect_err("open target");
        assert!(err.to_string().contains("mode 0644"), "{err}");
        Ok(())
    }

    #[test]
    fn refuses_what_is_not_a_regular_file() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status()?;
        assert!(made.success(), "mkfifo failed");
        // Refused at once, without opening it (which would block).
        let err = with_secret(&fifo).read_secret().expect_err("a fifo");
        assert!(err.to_string().contains("not a regular file"), "{err}");
        let err = with_secret(dir.path())
            .read_secret()
            .expect_err("a directory");
        assert!(err.to_string().contains("not a regular file"), "{err}");
        Ok(())
    }

    #[test]
    fn refuses_a_file_another_user_owns() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("secret");
        write_secret(&path, "0123456789abcdef", 0o600)?;
        // Only root may give a file away; elsewhere there is nothing to test.
        if std::os::unix::fs::chown(&path, Some(54_321), None).is_err() {
            println!("skipped: cannot chown here (not root)");
            return Ok(());
        }
        let err = with_secret(&path)
            .read_secret()
            .expect_err("another user's file");
        assert!(err.to_string().contains("owned by user 54321"), "{err}");
        Ok(())
    }
}
