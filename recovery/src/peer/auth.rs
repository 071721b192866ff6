//! The job's secret and the handshake that proves it both ways.

use std::sync::atomic::{AtomicU64, Ordering};

use ckpt_store::{Error, ErrorKind, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{CONNECT_TIMEOUT, HANDSHAKE_TIMEOUT, SECRET_ENV, net, proto};

/// Protocol version sent in the agent's challenge.
const VERSION: u8 = 1;

/// The job's shared secret: 32 random bytes. Its `Debug` never shows it; it is handed on only
/// through [`SECRET_ENV`] and never written to the store or a log.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerSecret([u8; 32]);

impl std::fmt::Debug for PeerSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerSecret(..)")
    }
}

/// In hex (an etcd coordinator hands the secret to the other agents in the job's plan).
impl serde::Serialize for PeerSecret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> serde::Deserialize<'de> for PeerSecret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        PeerSecret::from_hex(&s).map_err(serde::de::Error::custom)
    }
}

impl PeerSecret {
    /// 32 bytes from the kernel's random source.
    pub fn generate() -> Result<PeerSecret> {
        use std::io::Read;
        let mut b = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut b))
            .map_err(|e| Error::io("reading random bytes from", &"/dev/urandom", e))?;
        Ok(PeerSecret(b))
    }

    /// A secret of these bytes (tests, and secrets kept elsewhere).
    pub fn from_bytes(b: [u8; 32]) -> PeerSecret {
        PeerSecret(b)
    }

    /// Parse 64 hex digits (the error never repeats the text: it may be a secret).
    pub fn from_hex(s: &str) -> Result<PeerSecret> {
        let s = s.trim();
        let bad = || {
            Error::invalid(format!(
                "{SECRET_ENV} must be 64 hex digits (32 bytes), got {} characters that are not",
                s.len()
            ))
        };
        if s.len() != 64 {
            return Err(bad());
        }
        let mut b = [0u8; 32];
        for (i, pair) in s.as_bytes().chunks_exact(2).enumerate() {
            let hex = std::str::from_utf8(pair).map_err(|_| bad())?;
            b[i] = u8::from_str_radix(hex, 16).map_err(|_| bad())?;
        }
        Ok(PeerSecret(b))
    }

    /// The hex form, for [`SECRET_ENV`].
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn mac(&self, ctx: &[u8], parts: &[&[u8]]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(ctx);
        for p in parts {
            h.update(p);
        }
        h.finalize()
    }
}

/// Who connects to an agent: a rank (hands its own node's snapshots, reads chunks) or another
/// agent (hands the copy of the node it keeps copies for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A rank, or any reader.
    Rank,
    /// A peer agent forwarding its node's snapshots.
    Agent,
}

impl Role {
    fn byte(self) -> u8 {
        match self {
            Role::Rank => b'R',
            Role::Agent => b'P',
        }
    }
}

const CLIENT_CTX: &[u8] = b"ckpt peer v1 client";
const AGENT_CTX: &[u8] = b"ckpt peer v1 agent";

/// The agent's challenge: `H`, the version, a nonce of 32 bytes.
fn challenge(nonce: &[u8; 32]) -> [u8; 34] {
    let mut m = [0u8; 34];
    m[0] = b'H';
    m[1] = VERSION;
    m[2..].copy_from_slice(nonce);
    m
}

/// A client's answer to `challenge`: role u8, its own nonce, the keyed hash of both.
fn answer(secret: &PeerSecret, role: Role, ch: &[u8; 34], mine: &[u8; 32]) -> Result<[u8; 65]> {
    if ch[0] != b'H' || ch[1] != VERSION {
        return Err(proto(format!(
            "the agent's greeting is {:#04x} version {}, not a ckpt replica agent of version {VERSION}",
            ch[0], ch[1]
        )));
    }
    let mac = secret.mac(CLIENT_CTX, &[&[role.byte()], &ch[2..], mine]);
    let mut m = [0u8; 65];
    m[0] = role.byte();
    m[1..33].copy_from_slice(mine);
    m[33..].copy_from_slice(mac.as_bytes());
    Ok(m)
}

/// The agent's proof (`K` and a keyed hash of both nonces), checked by the client.
fn agent_proof(secret: &PeerSecret, ch: &[u8; 34], client_nonce: &[u8]) -> [u8; 33] {
    let mut m = [0u8; 33];
    m[0] = b'K';
    m[1..].copy_from_slice(secret.mac(AGENT_CTX, &[&ch[2..], client_nonce]).as_bytes());
    m
}

fn check_proof(secret: &PeerSecret, ch: &[u8; 34], mine: &[u8; 32], got: &[u8; 33]) -> Result<()> {
    let want = agent_proof(secret, ch, mine);
    let ok = got[0] == b'K' && hash32(&want[1..]) == hash32(&got[1..]);
    if ok {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::InvalidInput,
            "the replica agent did not prove the job's secret (another job's agent, or not an agent)",
        ))
    }
}

fn hash32(b: &[u8]) -> blake3::Hash {
    blake3::Hash::from_bytes(<[u8; 32]>::try_from(b).expect("32 bytes"))
}

fn nonce() -> [u8; 32] {
    // A fresh random nonce; /dev/urandom does not fail on Linux, and a fallback that is
    // unique per process and call still never repeats a challenge.
    match PeerSecret::generate() {
        Ok(s) => s.0,
        Err(_) => {
            static N: AtomicU64 = AtomicU64::new(0);
            let t = ckpt_store::clock::system_now()
                .timestamp_nanos_opt()
                .unwrap_or_default();
            let n = N.fetch_add(1, Ordering::Relaxed);
            *blake3::hash(format!("{t} {} {n}", std::process::id()).as_bytes()).as_bytes()
        }
    }
}

/// The client side of the handshake over a tokio stream.
async fn client_handshake<S>(s: &mut S, secret: &PeerSecret, role: Role) -> Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let e = |e| net("authenticating to", "the replica agent", e);
    let mut ch = [0u8; 34];
    s.read_exact(&mut ch).await.map_err(e)?;
    let mine = nonce();
    s.write_all(&answer(secret, role, &ch, &mine)?)
        .await
        .map_err(e)?;
    s.flush().await.map_err(e)?;
    let mut got = [0u8; 33];
    s.read_exact(&mut got)
        .await
        .map_err(|err| proof_unread(err, e))?;
    check_proof(secret, &ch, &mine, &got)
}

/// Why the agent's proof could not be read: a connection the agent closed after our answer
/// means it refused the secret; anything else is `net`'s error.
fn proof_unread(err: std::io::Error, net: impl FnOnce(std::io::Error) -> Error) -> Error {
    if err.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::new(
            ErrorKind::InvalidInput,
            "the replica agent refused this client: CKPT_PEER_SECRET is not the job's",
        )
    } else {
        net(err)
    }
}

/// The same over a blocking socket (the upload thread).
pub(super) fn client_handshake_blocking<S: std::io::Read + std::io::Write>(
    s: &mut S,
    secret: &PeerSecret,
    role: Role,
) -> Result<()> {
    let e = |e| net("authenticating to", "the replica agent", e);
    let mut ch = [0u8; 34];
    s.read_exact(&mut ch).map_err(e)?;
    let mine = nonce();
    s.write_all(&answer(secret, role, &ch, &mine)?).map_err(e)?;
    let mut got = [0u8; 33];
    s.read_exact(&mut got).map_err(|err| proof_unread(err, e))?;
    check_proof(secret, &ch, &mine, &got)
}

/// The agent side: challenge, check the answer; the client's role, or why it was refused.
pub(super) async fn accept_handshake<S>(s: &mut S, secret: Option<&PeerSecret>) -> Result<Role>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let Some(secret) = secret else {
        return Err(Error::invalid(
            "this agent has no job secret yet: it serves nobody",
        ));
    };
    let e = |e| net("authenticating", "a replica agent client", e);
    let ch = challenge(&nonce());
    s.write_all(&ch).await.map_err(e)?;
    let mut got = [0u8; 65];
    s.read_exact(&mut got).await.map_err(e)?;
    let role = match got[0] {
        b'R' => Role::Rank,
        b'P' => Role::Agent,
        other => return Err(proto(format!("unknown client role {other:#04x}"))),
    };
    let want = secret.mac(CLIENT_CTX, &[&got[..1], &ch[2..], &got[1..33]]);
    // blake3::Hash compares in constant time.
    if want != hash32(&got[33..]) {
        return Err(Error::invalid("the client does not know the job's secret"));
    }
    s.write_all(&agent_proof(secret, &ch, &got[1..33]))
        .await
        .map_err(e)?;
    Ok(role)
}

/// Connect to the agent at `addr` and prove the secret.
pub(super) async fn connect(addr: &str, secret: &PeerSecret, role: Role) -> Result<TcpStream> {
    let mut s = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| {
            net(
                "connecting to the agent",
                addr,
                std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
            )
        })?
        .map_err(|e| net("connecting to the agent", addr, e))?;
    let _ = s.set_nodelay(true);
    tokio::time::timeout(HANDSHAKE_TIMEOUT, client_handshake(&mut s, secret, role))
        .await
        .map_err(|_| {
            Error::internal(format!("the agent at {addr} did not authenticate in time"))
        })??;
    Ok(s)
}
