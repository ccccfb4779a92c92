//! The shared secret and the challenge–response that proves it at connect.
//!
//! A unit started with a secret serves a connection only after both ends
//! proved they know it, before any other request (and before the slab's
//! fd is handed over):
//!
//! ```text
//!  client                                      unit
//!    │── Auth { client_nonce } ─────────────────▶│  fresh 32 random bytes
//!    │◀─ Challenge { unit_nonce, unit_proof } ───│  fresh 32 random bytes;
//!    │   the client checks unit_proof            │  unit_proof = HMAC(secret, "unit" ‖ v ‖ Nc ‖ Nu)
//!    │── Prove { client_proof } ────────────────▶│  client_proof = HMAC(secret, "client" ‖ v ‖ Nc ‖ Nu)
//!    │── Hello { … } ───────────────────────────▶│  served only after a right proof
//! ```
//!
//! Every proof is an HMAC-SHA-256 under the secret over a label naming who
//! proves (so a proof reflected back to its sender fails), the protocol
//! version, and both nonces (so a proof recorded on one connection fails on
//! any other: the unit draws a fresh nonce per connection, the client too).
//! Proofs are checked in constant time (`hmac`'s `verify_slice`).
//!
//! What it does not do: encrypt, or protect the connection's later frames.
//! Someone who can rewrite packets on the path can take over a connection
//! after its handshake; across untrusted networks, run stowage inside a
//! VPN (WireGuard) and keep the secret for authentication.

use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::PROTOCOL_VERSION;

/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof (an HMAC-SHA-256 tag).
pub const PROOF_LEN: usize = 32;
/// A nonce: 32 random bytes, fresh for every connection.
pub type Nonce = [u8; NONCE_LEN];
/// A proof of the secret.
pub type Proof = [u8; PROOF_LEN];

/// The environment variable that holds a shared secret.
pub const SECRET_ENV: &str = "STOWAGE_SECRET";

/// Label of the unit's proof.
const UNIT_LABEL: &[u8] = b"stowage unit proof";
/// Label of the client's proof.
const CLIENT_LABEL: &[u8] = b"stowage client proof";

/// Why a secret could not be had. Messages name where the secret was
/// looked for, never its bytes.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(
        "the shared secret {what} is {len} bytes; it needs at least {} (e.g. `head -c 32 /dev/urandom | base64`)",
        Secret::MIN_LEN
    )]
    TooShort { what: String, len: usize },
    #[error("the shared secret {what} is over {} bytes", Secret::MAX_LEN)]
    TooLong { what: String },
    #[error("reading the secret file {path}: {err}")]
    Read { path: String, err: std::io::Error },
    #[error(
        "the secret file {path} may be read or written by other users (mode {mode:03o}); make it owner-only: chmod 600 {path}"
    )]
    Exposed { path: String, mode: u32 },
    #[error("the shared secret {what} is not hex digits")]
    NotHex { what: String },
}

/// A shared secret: bytes every unit and client of a deployment know.
///
/// It never prints: `Debug` and `Display` show `Secret(<redacted>)`. Its
/// bytes are overwritten when it is dropped (best effort).
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        self.0.iter_mut().for_each(|b| *b = 0);
        std::hint::black_box(&self.0);
    }
}

impl Secret {
    /// Fewest bytes of a secret.
    pub const MIN_LEN: usize = 16;
    /// Most bytes of a secret.
    pub const MAX_LEN: usize = 4096;

    /// A secret of these bytes: at least [`Secret::MIN_LEN`] of them.
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Secret, SecretError> {
        Self::checked(bytes.into(), "given")
    }

    fn checked(bytes: Vec<u8>, what: &str) -> Result<Secret, SecretError> {
        let s = Secret(bytes);
        if s.0.len() < Self::MIN_LEN {
            return Err(SecretError::TooShort {
                what: what.to_owned(),
                len: s.0.len(),
            });
        }
        if s.0.len() > Self::MAX_LEN {
            return Err(SecretError::TooLong {
                what: what.to_owned(),
            });
        }
        Ok(s)
    }

    /// The secret in the file at `path`, less its trailing line break(s).
    /// The file must be owner-only: one that other users may read or
    /// write (any group or other permission bit) is refused, as ssh refuses
    /// such a private key.
    pub fn from_file(path: &Path) -> Result<Secret, SecretError> {
        use std::io::Read;
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display().to_string();
        let err = |err| SecretError::Read {
            path: shown.clone(),
            err,
        };
        let f = std::fs::File::open(path).map_err(err)?;
        let mode = f.metadata().map_err(err)?.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(SecretError::Exposed {
                path: shown,
                mode: mode & 0o777,
            });
        }
        let mut bytes = Vec::new();
        f.take(Self::MAX_LEN as u64 + 3)
            .read_to_end(&mut bytes)
            .map_err(err)?;
        trim_line_breaks(&mut bytes);
        Self::checked(bytes, &format!("in {shown}"))
    }

    /// The secret in the environment variable `STOWAGE_SECRET` (less its
    /// trailing line breaks); `None` when it is not set. Set but too short
    /// (empty included) is an error, never "no secret".
    pub fn from_env() -> Result<Option<Secret>, SecretError> {
        use std::os::unix::ffi::OsStringExt;
        let Some(v) = std::env::var_os(SECRET_ENV) else {
            return Ok(None);
        };
        let mut bytes = v.into_vec();
        trim_line_breaks(&mut bytes);
        Self::checked(bytes, &format!("in ${SECRET_ENV}")).map(Some)
    }

    /// The secret's bytes, to hand it on (e.g. into an owner-only file
    /// for a child process). Never log or print them.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }

    /// A fresh secret for one data plane: 32 random bytes from the OS,
    /// written as 64 lowercase hex digits (so it survives a file, an
    /// environment variable and a trailing line break as it is).
    pub fn generate() -> std::io::Result<Secret> {
        let mut raw = [0u8; 32];
        getrandom::fill(&mut raw).map_err(|e| std::io::Error::other(e.to_string()))?;
        let s = Secret(hex(&raw).into_bytes());
        raw.iter_mut().for_each(|b| *b = 0);
        Ok(s)
    }

    /// The secret's bytes as lowercase hex digits (how a directory carries
    /// it: any bytes, in JSON). Never log or print them.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// A secret written by [`Secret::to_hex`].
    pub fn from_hex(text: &str, what: &str) -> Result<Secret, SecretError> {
        let t = text.as_bytes();
        let bad = || SecretError::NotHex {
            what: what.to_owned(),
        };
        if !t.len().is_multiple_of(2) {
            return Err(bad());
        }
        let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        let bytes = t
            .chunks(2)
            .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
            .collect::<Option<Vec<u8>>>()
            .ok_or_else(bad)?;
        Self::checked(bytes, what)
    }

    fn mac(&self, label: &[u8], client_nonce: &Nonce, unit_nonce: &Nonce) -> Hmac<Sha256> {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        m.update(label);
        m.update(&[0]);
        m.update(&PROTOCOL_VERSION.to_le_bytes());
        m.update(client_nonce);
        m.update(unit_nonce);
        m
    }

    /// The unit's proof for a connection with these nonces.
    pub fn unit_proof(&self, client_nonce: &Nonce, unit_nonce: &Nonce) -> Proof {
        self.mac(UNIT_LABEL, client_nonce, unit_nonce)
            .finalize()
            .into_bytes()
            .into()
    }

    /// The client's proof for a connection with these nonces.
    pub fn client_proof(&self, client_nonce: &Nonce, unit_nonce: &Nonce) -> Proof {
        self.mac(CLIENT_LABEL, client_nonce, unit_nonce)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is the unit's proof for these nonces (constant time).
    pub fn verify_unit_proof(
        &self,
        client_nonce: &Nonce,
        unit_nonce: &Nonce,
        proof: &[u8],
    ) -> bool {
        self.mac(UNIT_LABEL, client_nonce, unit_nonce)
            .verify_slice(proof)
            .is_ok()
    }

    /// Whether `proof` is the client's proof for these nonces (constant
    /// time).
    pub fn verify_client_proof(
        &self,
        client_nonce: &Nonce,
        unit_nonce: &Nonce,
        proof: &[u8],
    ) -> bool {
        self.mac(CLIENT_LABEL, client_nonce, unit_nonce)
            .verify_slice(proof)
            .is_ok()
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

fn trim_line_breaks(bytes: &mut Vec<u8>) {
    while matches!(bytes.last(), Some(b'\n' | b'\r')) {
        bytes.pop();
    }
}

/// A fresh random nonce from the OS.
pub fn fresh_nonce() -> std::io::Result<Nonce> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_secrets_are_fresh_hex_and_round_trip() {
        let a = Secret::generate().unwrap();
        let b = Secret::generate().unwrap();
        assert_eq!(a.expose().len(), 64);
        assert!(a.expose().iter().all(u8::is_ascii_hexdigit));
        assert_ne!(a.expose(), b.expose());
        let back = Secret::from_hex(&a.to_hex(), "t").unwrap();
        assert_eq!(back.expose(), a.expose());
        let odd = Secret::from_bytes(vec![
            0u8, 0xff, b'\n', 7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
        ])
        .unwrap();
        assert_eq!(
            Secret::from_hex(&odd.to_hex(), "t").unwrap().expose(),
            odd.expose()
        );
        assert!(Secret::from_hex("zz", "t").is_err());
        assert!(Secret::from_hex("abc", "t").is_err());
    }

    fn secret(s: &str) -> Secret {
        Secret::from_bytes(s.as_bytes()).unwrap()
    }

    #[test]
    fn short_secrets_are_refused_and_none_prints() {
        assert!(matches!(
            Secret::from_bytes(*b""),
            Err(SecretError::TooShort { len: 0, .. })
        ));
        let e = Secret::from_bytes(*b"fifteen bytes!!").unwrap_err();
        assert!(e.to_string().contains("at least 16"), "{e}");
        assert!(!e.to_string().contains("fifteen"), "{e}");
        let s = secret("correct horse battery staple");
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        assert_eq!(s.to_string(), "Secret(<redacted>)");
        assert_eq!(format!("{:?}", Some(s)), "Some(Secret(<redacted>))");
    }

    #[test]
    fn secret_files_must_be_owner_only_and_lose_their_line_break() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("secret");
        std::fs::write(&p, "0123456789abcdef-xyz\r\n\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = Secret::from_file(&p).unwrap_err();
        assert!(matches!(e, SecretError::Exposed { mode: 0o640, .. }), "{e}");
        assert!(e.to_string().contains("chmod 600"), "{e}");
        assert!(!e.to_string().contains("0123456789"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let s = Secret::from_file(&p).unwrap();
        let n = [7u8; 32];
        assert_eq!(
            s.client_proof(&n, &n),
            secret("0123456789abcdef-xyz").client_proof(&n, &n)
        );
        std::fs::write(&p, "short\n").unwrap();
        assert!(matches!(
            Secret::from_file(&p),
            Err(SecretError::TooShort { len: 5, .. })
        ));
        assert!(matches!(
            Secret::from_file(&dir.path().join("missing")),
            Err(SecretError::Read { .. })
        ));
    }

    #[test]
    fn proofs_bind_the_secret_the_nonces_and_the_direction() {
        let s = secret("the right secret, 32 bytes long!");
        let wrong = secret("the wrong secret, 32 bytes long!");
        let (c, u) = ([1u8; 32], [2u8; 32]);
        let cp = s.client_proof(&c, &u);
        let up = s.unit_proof(&c, &u);
        assert!(s.verify_client_proof(&c, &u, &cp));
        assert!(s.verify_unit_proof(&c, &u, &up));
        // Another secret.
        assert!(!wrong.verify_client_proof(&c, &u, &cp));
        assert!(!s.verify_client_proof(&c, &u, &wrong.client_proof(&c, &u)));
        // Reflected: the unit's proof is no client proof, and back.
        assert_ne!(cp, up);
        assert!(!s.verify_client_proof(&c, &u, &up));
        assert!(!s.verify_unit_proof(&c, &u, &cp));
        // Replayed on a connection with another nonce on either side.
        assert!(!s.verify_client_proof(&c, &[3u8; 32], &cp));
        assert!(!s.verify_unit_proof(&[3u8; 32], &u, &up));
        // Nonces swapped.
        assert!(!s.verify_client_proof(&u, &c, &cp));
        // Truncated or empty proofs.
        assert!(!s.verify_client_proof(&c, &u, &cp[..16]));
        assert!(!s.verify_client_proof(&c, &u, &[]));
    }

    #[test]
    fn nonces_are_fresh() {
        let a = fresh_nonce().unwrap();
        let b = fresh_nonce().unwrap();
        assert_ne!(a, b);
    }

    proptest::proptest! {
        #[test]
        fn only_the_right_proof_passes(
            key in proptest::collection::vec(proptest::num::u8::ANY, 16..64),
            other in proptest::collection::vec(proptest::num::u8::ANY, 16..64),
            c in proptest::array::uniform32(proptest::num::u8::ANY),
            u in proptest::array::uniform32(proptest::num::u8::ANY),
            u2 in proptest::array::uniform32(proptest::num::u8::ANY),
            flip in 0usize..256,
        ) {
            let s = Secret::from_bytes(key.clone()).unwrap();
            let cp = s.client_proof(&c, &u);
            proptest::prop_assert!(s.verify_client_proof(&c, &u, &cp));
            // Any changed bit fails.
            let mut bad = cp;
            bad[flip / 8] ^= 1 << (flip % 8);
            proptest::prop_assert!(!s.verify_client_proof(&c, &u, &bad));
            // Another secret, another unit nonce, the reflected proof: fail.
            if other != key {
                let o = Secret::from_bytes(other).unwrap();
                proptest::prop_assert!(!o.verify_client_proof(&c, &u, &cp));
            }
            if u2 != u {
                proptest::prop_assert!(!s.verify_client_proof(&c, &u2, &cp));
            }
            proptest::prop_assert!(!s.verify_client_proof(&c, &u, &s.unit_proof(&c, &u)));
        }
    }
}
