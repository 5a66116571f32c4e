//! Reading the shared secret named by `security.secret_file`.

use crate::error::ConfigError;
use crate::schema::Config;

/// Shortest accepted secret, in bytes.
const MIN_SECRET: usize = 16;

impl Config {
    /// Reads the shared secret from `security.secret_file`, without its trailing newline.
    /// Returns `Ok(None)` when no secret file is set (then `security.danger_insecure` must be
    /// set, which [`Config::validate`] checks).
    ///
    /// Blocks on file I/O. A relative path is relative to the process's working directory.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Secret`], naming the path, if the file cannot be read, is empty, or
    /// holds fewer than 16 bytes.
    pub fn read_secret(&self) -> Result<Option<Vec<u8>>, ConfigError> {
        let Some(path) = &self.security.secret_file else {
            return Ok(None);
        };
        let mut secret = std::fs::read(path).map_err(|e| ConfigError::Secret {
            path: path.clone(),
            detail: format!("cannot read: {e}"),
            source: Some(e),
        })?;
        while matches!(secret.last(), Some(b'\n' | b'\r')) {
            secret.pop();
        }
        let problem = if secret.is_empty() {
            "the file is empty".to_string()
        } else if secret.len() < MIN_SECRET {
            format!(
                "the secret is {} bytes; use at least {MIN_SECRET} (32 random bytes is a good choice)",
                secret.len()
            )
        } else {
            return Ok(Some(secret));
        };
        Err(ConfigError::Secret {
            path: path.clone(),
            detail: problem,
            source: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_secret(path: &std::path::Path) -> Config {
        let mut config = Config::default();
        config.security.secret_file = Some(path.to_path_buf());
        config
    }

    #[test]
    fn reads_and_trims() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("secret");
        std::fs::write(&path, "0123456789abcdef\n")?;
        assert_eq!(
            with_secret(&path).read_secret()?,
            Some(b"0123456789abcdef".to_vec())
        );
        assert_eq!(Config::default().read_secret()?, None);
        Ok(())
    }

    #[test]
    fn refuses_missing_empty_and_short() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("secret");
        let missing = with_secret(&path).read_secret().expect_err("missing");
        assert!(
            missing.to_string().contains(&path.display().to_string()),
            "{missing}"
        );
        std::fs::write(&path, "\n")?;
        let empty = with_secret(&path).read_secret().expect_err("empty");
        assert!(empty.to_string().contains("empty"), "{empty}");
        std::fs::write(&path, "short")?;
        let short = with_secret(&path).read_secret().expect_err("short");
        assert!(short.to_string().contains("5 bytes"), "{short}");
        Ok(())
    }
}
