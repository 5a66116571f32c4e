//! The authentication that opens every control link: mutual HMAC-SHA256 challenge-response
//! over a shared secret.
//!
//! Each side sends, at once and without waiting for the other:
//!
//! ```text
//! preamble  b"FERRYAUT" | version u16 LE | role u8 (0 dialer, 1 acceptor) | nonce [u8; 32]
//! ```
//!
//! then, once it has the peer's preamble,
//!
//! ```text
//! proof     HMAC-SHA256(secret, b"ferry-auth-v1" | own role | own nonce | peer nonce)
//! ```
//!
//! and checks the peer's proof in constant time. The role in the MAC, and the refusal of a
//! peer that claims our own role, stop a proof from being reflected back to its author.
//! Fresh nonces on both sides stop replays.
//!
//! What this does not do: it proves that both ends know the secret, nothing more. Frames
//! after it are neither encrypted nor integrity-protected against an active attacker (the
//! CRC only catches damage), and a man in the middle can relay a whole handshake between two
//! honest nodes. Run links on a trusted network, or inside a tunnel that provides those.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::LinkError;
use super::admission::Stage;
use crate::wire::PROTOCOL_VERSION;

/// Shared key material that both ends of a link must hold.
///
/// `Debug` never prints the bytes.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// A secret made of these bytes. Empty bytes are the same as [`Secret::insecure`].
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }

    /// No secret: the handshake still runs, with an empty HMAC key, so anyone who speaks the
    /// protocol is let in. A node that has a real secret refuses a node without one.
    pub fn insecure() -> Self {
        Self(Vec::new())
    }

    /// True for [`Secret::insecure`] (an empty key).
    pub fn is_insecure(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_insecure() {
            f.write_str("Secret(insecure)")
        } else {
            f.write_str("Secret(<redacted>)")
        }
    }
}

/// Which end of the connection we are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Role {
    Dialer = 0,
    Acceptor = 1,
}

const PREAMBLE_MAGIC: [u8; 8] = *b"FERRYAUT";
const NONCE_LEN: usize = 32;
/// Bytes of a preamble.
pub(crate) const PREAMBLE_LEN: usize = 8 + 2 + 1 + NONCE_LEN;
const PROOF_LEN: usize = 32;
const MAC_LABEL: &[u8] = b"ferry-auth-v1";

type HmacSha256 = Hmac<Sha256>;

fn preamble(role: Role, nonce: &[u8; NONCE_LEN]) -> [u8; PREAMBLE_LEN] {
    let mut out = [0u8; PREAMBLE_LEN];
    out[..8].copy_from_slice(&PREAMBLE_MAGIC);
    out[8..10].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out[10] = role as u8;
    out[11..].copy_from_slice(nonce);
    out
}

/// The MAC over one side's proof. `role` and `first` belong to the side that proves.
fn proof_mac(
    secret: &Secret,
    role: u8,
    first: &[u8; NONCE_LEN],
    second: &[u8; NONCE_LEN],
    peer: &str,
) -> Result<HmacSha256, LinkError> {
    // HMAC takes keys of any length, so this cannot fail; still no unwrap.
    let mut mac = HmacSha256::new_from_slice(&secret.0).map_err(|e| LinkError::AuthFailed {
        peer: peer.to_owned(),
        detail: format!("unusable key: {e}"),
    })?;
    mac.update(MAC_LABEL);
    mac.update(&[role]);
    mac.update(first);
    mac.update(second);
    Ok(mac)
}

fn auth_failed(peer: &str, detail: impl Into<String>) -> LinkError {
    LinkError::AuthFailed {
        peer: peer.to_owned(),
        detail: detail.into(),
    }
}

/// A read error during the handshake: an early end is the peer's doing (it hung up on us),
/// anything else is the transport's.
fn handshake_read_error(peer: &str, e: std::io::Error, what: &str) -> LinkError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        auth_failed(peer, format!("connection closed before its {what}"))
    } else {
        LinkError::from(e)
    }
}

/// How far `received`, the first bytes from a peer that should be a dialer, go into its
/// preamble: nothing, part of one, or a whole well-formed one (our magic, our version, the
/// dialer's role). Bytes past the preamble are not looked at.
pub(crate) fn dialer_preamble_stage(received: &[u8]) -> Stage {
    match received.get(..PREAMBLE_LEN) {
        _ if received.is_empty() => Stage::Idle,
        Some(preamble) if check_preamble(preamble, Role::Acceptor, "").is_ok() => Stage::Preamble,
        _ => Stage::Partial,
    }
}

/// Checks a peer's whole preamble as seen by `role`; returns the role it claims and its
/// nonce.
fn check_preamble(
    theirs: &[u8],
    role: Role,
    peer: &str,
) -> Result<(u8, [u8; NONCE_LEN]), LinkError> {
    if theirs.len() != PREAMBLE_LEN || theirs[..8] != PREAMBLE_MAGIC {
        return Err(auth_failed(peer, "not a ferry peer (bad preamble)"));
    }
    let their_version = u16::from_le_bytes([theirs[8], theirs[9]]);
    if their_version != PROTOCOL_VERSION {
        return Err(LinkError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: their_version,
        });
    }
    let their_role = theirs[10];
    let expected_role = match role {
        Role::Dialer => Role::Acceptor,
        Role::Acceptor => Role::Dialer,
    } as u8;
    if their_role != expected_role {
        return Err(auth_failed(
            peer,
            format!("peer claims role {their_role}, expected {expected_role} (reflection?)"),
        ));
    }
    let mut their_nonce = [0u8; NONCE_LEN];
    their_nonce.copy_from_slice(&theirs[11..]);
    Ok((their_role, their_nonce))
}

/// Runs the challenge-response as `role`. Returns `Ok(())` once the peer has proven that it
/// holds `secret`; reads exactly the handshake's bytes and nothing more (the caller may pass
/// a buffered reader; any bytes buffered beyond the handshake stay in it). Calls
/// `on_preamble` once the peer's whole preamble has arrived and is well-formed, before
/// answering it.
///
/// Fails with [`LinkError::AuthFailed`] (not a ferry peer, same role as ours, wrong secret,
/// hung up), [`LinkError::VersionMismatch`] or [`LinkError::Io`]. Not cancel-safe; the
/// caller puts it under its handshake timeout and drops the connection on any error.
pub(crate) async fn authenticate<R, W>(
    reader: &mut R,
    writer: &mut W,
    role: Role,
    secret: &Secret,
    peer: &str,
    on_preamble: impl FnOnce(),
) -> Result<(), LinkError>
where
    R: AsyncRead + Unpin + ?Sized,
    W: AsyncWrite + Unpin + ?Sized,
{
    let own_nonce: [u8; NONCE_LEN] = rand::random();
    writer.write_all(&preamble(role, &own_nonce)).await?;
    writer.flush().await?;

    let mut theirs = [0u8; PREAMBLE_LEN];
    reader
        .read_exact(&mut theirs)
        .await
        .map_err(|e| handshake_read_error(peer, e, "preamble"))?;
    let (their_role, their_nonce) = check_preamble(&theirs, role, peer)?;
    if their_nonce == own_nonce {
        return Err(auth_failed(peer, "peer echoed our nonce"));
    }
    on_preamble();

    let own_proof = proof_mac(secret, role as u8, &own_nonce, &their_nonce, peer)?
        .finalize()
        .into_bytes();
    writer.write_all(&own_proof).await?;
    writer.flush().await?;

    let mut their_proof = [0u8; PROOF_LEN];
    reader
        .read_exact(&mut their_proof)
        .await
        .map_err(|e| handshake_read_error(peer, e, "proof"))?;
    proof_mac(secret, their_role, &their_nonce, &own_nonce, peer)?
        .verify_slice(&their_proof)
        .map_err(|_| auth_failed(peer, "wrong secret (the peer's proof does not verify)"))
}
