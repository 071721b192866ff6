//! The same-machine path: an agent keeps the chunks it holds in shared-memory segments
//! (`memfd`), and a rank on the agent's own machine maps them read-only, so a restore copies
//! each chunk once, straight out of the agent's memory, instead of through a socket (a copy
//! out of the agent, one into the socket's buffers, one out of them).
//!
//! How a client finds out it shares the machine: the agent answers `L` on its TCP port (after
//! the handshake) with the name of an abstract Unix socket. Only a process on the same machine
//! (and network namespace) can connect to it; anyone else falls back to the socket path.
//! There, after the same handshake, `X` asks for the export: read-only descriptors of the
//! segments (`SCM_RIGHTS`) and where each held chunk lies in them. The read engine hashes
//! every byte on its way into the destination, as for any chunk source, so a mapping can make
//! a restore faster, never wrong.
//!
//! An agent writes each byte of a segment once, while the chunk arrives and before the chunk
//! is listed anywhere, and never again: a segment is only appended to (one per arriving
//! snapshot at a time), sealed against shrinking (a mapped page cannot vanish under a client),
//! and freed when no snapshot, forward or client mapping uses it any more.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use ckpt_store::{ChunkId, Hash, Result};
use tokio::io::{AsyncRead, AsyncReadExt};
use tracing::debug;

use super::auth::{Role, client_handshake_blocking};
use super::wire::{MAX_CHUNK, read_chunk_body};
use super::{PeerSecret, net, proto};

/// Bytes a new segment is sized for (a larger chunk gets a segment of its own size). Only the
/// pages written take memory.
const SEGMENT: usize = 256 << 20;
/// Where each chunk starts in a segment is a multiple of this (whole cache lines).
const ALIGN: usize = 64;
/// Segments whose descriptors travel in one message.
const FDS_PER_MSG: usize = 32;
/// The most segments and chunks an export may list (far above what an agent holds).
const MAX_SEGMENTS: u32 = 1 << 16;
const MAX_CHUNKS: u32 = 1 << 24;
/// The bytes that carry a batch of descriptors.
const FDS_TAG: u8 = b'F';

/// Whether clients map a same-machine agent's memory (on unless [`set_mapping`] turned it off).
static MAPPING: AtomicBool = AtomicBool::new(true);

/// Turn the same-machine mapping on or off for this process's new chunk sources (on by
/// default): off, every chunk goes through the agent's socket, as across machines. For
/// benchmarks that measure both paths in one process.
pub fn set_mapping(on: bool) {
    MAPPING.store(on, Ordering::Relaxed);
}

/// Whether new chunk sources map a same-machine agent's memory.
pub(super) fn mapping() -> bool {
    MAPPING.load(Ordering::Relaxed)
}

fn last() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// A shared-memory segment, mapped read-write in the agent.
pub(super) struct Segment {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is memory the segment owns until it is dropped; each region of it is
// written by one arriving chunk only ([`Arena::read_chunk`]) and read after that.
unsafe impl Send for Segment {}
// SAFETY: as above; shared references only read regions whose writing has finished.
unsafe impl Sync for Segment {}

impl Segment {
    fn new(len: usize) -> std::io::Result<Segment> {
        // SAFETY: plain system calls on a descriptor this function owns; the mapping's result
        // is checked before it is used.
        unsafe {
            let raw = libc::memfd_create(
                c"ckpt-replica".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            );
            if raw < 0 {
                return Err(last());
            }
            let fd = OwnedFd::from_raw_fd(raw);
            if libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) != 0 {
                return Err(last());
            }
            // A client's mapping must never lose its pages (a read past a shrunk end is
            // SIGBUS); nobody adds other seals either.
            if libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            ) != 0
            {
                return Err(last());
            }
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            );
            if p == libc::MAP_FAILED {
                return Err(last());
            }
            let ptr = NonNull::new(p.cast()).ok_or_else(last)?;
            Ok(Segment { fd, ptr, len })
        }
    }

    /// A read-only descriptor of the segment for a client: reopened through `/proc`, it can
    /// only be mapped for reading.
    fn read_only(&self) -> std::io::Result<OwnedFd> {
        let path = std::ffi::CString::new(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
            .map_err(std::io::Error::other)?;
        // SAFETY: a plain open(2) of a NUL-terminated path; the result is checked.
        let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(last());
        }
        // SAFETY: `raw` is a descriptor just opened and owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(raw) })
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; nothing borrows it any more (every
        // borrower holds an `Arc` to the segment).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Where a held chunk lies: its segment and offset.
pub(super) type Place = (Arc<Segment>, usize);

/// A chunk's bytes inside a segment: the owner of its `Bytes`.
struct InSegment(Arc<Segment>, usize, usize);

impl AsRef<[u8]> for InSegment {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the region was written whole before this owner was made and is never
        // written again; the `Arc` keeps the mapping alive.
        unsafe { std::slice::from_raw_parts(self.0.ptr.as_ptr().add(self.1), self.2) }
    }
}

/// The segments one arriving snapshot is written into, appended to and never rewritten.
#[derive(Default)]
pub(super) struct Arena {
    cur: Option<Arc<Segment>>,
    used: usize,
    /// Shared memory could not be made here: chunks go to the heap (served by socket only).
    heap: bool,
}

impl Arena {
    /// Read a chunk's `len` bytes from `r` into shared memory: the chunk and where it lies
    /// (`None` where shared memory is not to be had: then it is on the heap). Memory is taken
    /// only by the pages the stream fills, so a length the stream does not back costs nothing.
    pub(super) async fn read_chunk<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        len: u64,
    ) -> Result<(Bytes, Option<Place>)> {
        if len > MAX_CHUNK {
            return Err(proto(format!("a chunk of {len} bytes")));
        }
        let Some((seg, off)) = self.slot(len as usize) else {
            return read_chunk_body(r, len).await.map(|b| (b, None));
        };
        let len = len as usize;
        // SAFETY: `slot` handed [off, off + len) of the segment to this call alone, and
        // `seg` keeps the mapping alive while `buf` lives.
        let buf = unsafe { std::slice::from_raw_parts_mut(seg.ptr.as_ptr().add(off), len) };
        r.read_exact(buf).await.map_err(|err| {
            if err.kind() == std::io::ErrorKind::UnexpectedEof {
                proto(format!("a chunk of {len} bytes cut short"))
            } else {
                net("reading a chunk", "agent connection", err)
            }
        })?;
        let b = Bytes::from_owner(InSegment(seg.clone(), off, len));
        Ok((b, Some((seg, off))))
    }

    fn slot(&mut self, len: usize) -> Option<Place> {
        if self.heap {
            return None;
        }
        let fits = self.cur.as_ref().is_some_and(|s| s.len - self.used >= len);
        if !fits {
            match Segment::new(SEGMENT.max(len)) {
                Ok(s) => {
                    self.cur = Some(Arc::new(s));
                    self.used = 0;
                }
                Err(e) => {
                    debug!("no shared memory for replica chunks ({e}): they stay on the heap");
                    self.heap = true;
                    return None;
                }
            }
        }
        let seg = self.cur.clone()?;
        let off = self.used;
        self.used = (off + len).next_multiple_of(ALIGN).min(seg.len);
        Some((seg, off))
    }
}

/// One chunk of an export.
pub(super) struct Listed {
    pub(super) id: ChunkId,
    pub(super) place: Place,
    pub(super) len: usize,
}

/// The agent's side of `X`: send the segments of `chunks` (read-only descriptors) and where
/// each chunk lies, over a blocking socket.
pub(super) fn send_export(s: &mut UnixStream, chunks: &[Listed]) -> std::io::Result<()> {
    let mut segs: Vec<&Arc<Segment>> = Vec::new();
    let mut index: HashMap<*const Segment, u32> = HashMap::new();
    for c in chunks {
        index.entry(Arc::as_ptr(&c.place.0)).or_insert_with(|| {
            segs.push(&c.place.0);
            (segs.len() - 1) as u32
        });
    }
    let mut head = Vec::with_capacity(8);
    head.extend_from_slice(&(segs.len() as u32).to_le_bytes());
    head.extend_from_slice(&(chunks.len() as u32).to_le_bytes());
    s.write_all(&head)?;
    for batch in segs.chunks(FDS_PER_MSG) {
        let fds = batch
            .iter()
            .map(|g| g.read_only())
            .collect::<std::io::Result<Vec<_>>>()?;
        let mut lens = Vec::with_capacity(4 + 8 * batch.len());
        lens.extend_from_slice(&(batch.len() as u32).to_le_bytes());
        for g in batch {
            lens.extend_from_slice(&(g.len as u64).to_le_bytes());
        }
        s.write_all(&lens)?;
        send_fds(s, &fds)?;
    }
    let mut body = Vec::with_capacity(52 * chunks.len());
    for c in chunks {
        body.extend_from_slice(&c.id.0.0);
        body.extend_from_slice(&index[&Arc::as_ptr(&c.place.0)].to_le_bytes());
        body.extend_from_slice(&(c.place.1 as u64).to_le_bytes());
        body.extend_from_slice(&(c.len as u64).to_le_bytes());
    }
    s.write_all(&body)?;
    s.flush()
}

/// Send `fds` with one byte, [`FDS_TAG`].
fn send_fds(s: &UnixStream, fds: &[OwnedFd]) -> std::io::Result<()> {
    let raw: Vec<libc::c_int> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let bytes = std::mem::size_of_val(raw.as_slice());
    // SAFETY: `CMSG_SPACE` only computes a size.
    let space = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
    // A u64 buffer keeps the control message aligned.
    let mut ctl = vec![0u64; space.div_ceil(8)];
    let mut tag = [FDS_TAG];
    let mut iov = libc::iovec {
        iov_base: tag.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: `msg` points at `iov` and `ctl`, both alive for the call; the control message is
    // written inside `ctl`, which `CMSG_SPACE` sized for `raw`.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = ctl.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(bytes as u32) as _;
        std::ptr::copy_nonoverlapping(raw.as_ptr(), libc::CMSG_DATA(c).cast(), raw.len());
        loop {
            let n = libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL);
            if n == 1 {
                return Ok(());
            }
            let e = last();
            if n < 0 && e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(if n < 0 {
                e
            } else {
                std::io::ErrorKind::WriteZero.into()
            });
        }
    }
}

/// Receive exactly `k` descriptors sent by [`send_fds`].
fn recv_fds(s: &UnixStream, k: usize) -> std::io::Result<Vec<OwnedFd>> {
    let bytes = k * std::mem::size_of::<libc::c_int>();
    // SAFETY: `CMSG_SPACE` only computes a size.
    let space = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
    let mut ctl = vec![0u64; space.div_ceil(8)];
    let mut tag = [0u8];
    let mut iov = libc::iovec {
        iov_base: tag.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut fds = Vec::with_capacity(k);
    // SAFETY: `msg` points at `iov` and `ctl`, alive for the call; the kernel writes at most
    // `msg_controllen` bytes of control messages, which are walked with the CMSG macros within
    // the length it reports; each descriptor received is owned at once (closed on any error).
    let (n, flags) = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = ctl.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let n = loop {
            let n = libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
            if n < 0 && last().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            break n;
        };
        if n < 0 {
            return Err(last());
        }
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                let got = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<libc::c_int>();
                for i in 0..got {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
        (n, msg.msg_flags)
    };
    let bad = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    if n != 1 || tag[0] != FDS_TAG {
        return Err(bad(format!(
            "the agent's segment descriptors were not where the export said (got {n} bytes)"
        )));
    }
    if flags & libc::MSG_CTRUNC != 0 || fds.len() != k {
        return Err(bad(format!(
            "the agent sent {} segment descriptors where it announced {k}",
            fds.len()
        )));
    }
    Ok(fds)
}

/// A segment mapped read-only in a client.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a read-only mapping owned by this value until it is dropped.
unsafe impl Send for Mapping {}
// SAFETY: as above; it is only read.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn of(fd: &OwnedFd, len: usize) -> std::io::Result<Mapping> {
        // SAFETY: fstat into a zeroed struct, then a read-only shared mapping of at most the
        // file's size, once its seal against shrinking is seen; results are checked.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
                return Err(last());
            }
            // Sealed against shrinking, or a page could vanish under the mapping (SIGBUS).
            let seals = libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS);
            if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "a segment that is not sealed against shrinking",
                ));
            }
            if (st.st_size as u64) < len as u64 || len == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("a segment of {} bytes announced as {len}", st.st_size),
                ));
            }
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            );
            if p == libc::MAP_FAILED {
                return Err(last());
            }
            let ptr = NonNull::new(p.cast()).ok_or_else(last)?;
            Ok(Mapping { ptr, len })
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `of`, unmapped once; every borrower holds an `Arc`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A chunk's bytes inside a client's mapping: the owner of its `Bytes`.
struct InMapping(Arc<Mapping>, usize, usize);

impl AsRef<[u8]> for InMapping {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the range was checked against the mapping's length when the export was
        // read; the agent wrote it before listing it and never writes it again (and the
        // reader hashes what it copies, so even a misbehaving agent cannot make a restore
        // wrong); the `Arc` keeps the mapping alive.
        unsafe { std::slice::from_raw_parts(self.0.ptr.as_ptr().add(self.1), self.2) }
    }
}

/// What a client mapped of a same-machine agent: the chunks it held at the export.
pub(super) struct LocalView {
    chunks: HashMap<ChunkId, (Arc<Mapping>, usize, usize)>,
}

impl LocalView {
    /// The chunk `id` of `len` bytes, without a copy.
    pub(super) fn get(&self, id: &ChunkId, len: usize) -> Option<Bytes> {
        let (m, off, l) = self.chunks.get(id)?;
        (*l == len).then(|| Bytes::from_owner(InMapping(m.clone(), *off, *l)))
    }

    /// Chunks it lists.
    pub(super) fn len(&self) -> usize {
        self.chunks.len()
    }
}

/// Map what the agent whose local socket is `name` holds: `Ok(None)` where that socket cannot
/// be reached (the agent is on another machine); an error where it can, but the export fails.
pub(super) fn import(
    name: &str,
    secret: &PeerSecret,
    timeout: Duration,
) -> Result<Option<LocalView>> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| net("naming the agent's local socket", name, e))?;
    let mut s = match UnixStream::connect_addr(&addr) {
        Ok(s) => s,
        Err(e) => {
            debug!(
                socket = name,
                "the replica agent is not on this machine: {e}"
            );
            return Ok(None);
        }
    };
    let e = |err| net("mapping the memory of", "the replica agent", err);
    s.set_read_timeout(Some(timeout)).map_err(e)?;
    s.set_write_timeout(Some(timeout)).map_err(e)?;
    client_handshake_blocking(&mut s, secret, Role::Rank)?;
    s.write_all(b"X").map_err(e)?;
    read_export(&mut s).map(Some).map_err(e)
}

fn read_u32(s: &mut UnixStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(s: &mut UnixStream) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// The client's side of `X`, every figure checked before it is used.
fn read_export(s: &mut UnixStream) -> std::io::Result<LocalView> {
    let bad = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    let nsegs = read_u32(s)?;
    let nchunks = read_u32(s)?;
    if nsegs > MAX_SEGMENTS || nchunks > MAX_CHUNKS {
        return Err(bad(format!(
            "an export of {nsegs} segments and {nchunks} chunks"
        )));
    }
    let mut maps: Vec<Arc<Mapping>> = Vec::with_capacity(nsegs as usize);
    while maps.len() < nsegs as usize {
        let k = read_u32(s)? as usize;
        if k == 0 || k > FDS_PER_MSG || k > nsegs as usize - maps.len() {
            return Err(bad(format!("a batch of {k} segment descriptors")));
        }
        let lens = (0..k)
            .map(|_| read_u64(s))
            .collect::<std::io::Result<Vec<_>>>()?;
        let fds = recv_fds(s, k)?;
        for (fd, len) in fds.iter().zip(lens) {
            let len = usize::try_from(len).map_err(|_| bad(format!("a segment of {len} bytes")))?;
            maps.push(Arc::new(Mapping::of(fd, len)?));
        }
    }
    let mut chunks = HashMap::with_capacity((nchunks as usize).min(1 << 16));
    let mut rec = [0u8; 52];
    for _ in 0..nchunks {
        s.read_exact(&mut rec)?;
        let mut id = [0u8; 32];
        id.copy_from_slice(&rec[..32]);
        let seg = u32::from_le_bytes(rec[32..36].try_into().expect("4 bytes")) as usize;
        let off = u64::from_le_bytes(rec[36..44].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(rec[44..52].try_into().expect("8 bytes"));
        let m = maps
            .get(seg)
            .ok_or_else(|| bad(format!("a chunk in segment {seg} of {nsegs}")))?;
        if len > MAX_CHUNK || off.checked_add(len).is_none_or(|end| end > m.len as u64) {
            return Err(bad(format!(
                "a chunk of {len} bytes at {off} in a segment of {}",
                m.len
            )));
        }
        chunks.insert(ChunkId(Hash(id)), (m.clone(), off as usize, len as usize));
    }
    Ok(LocalView { chunks })
}

/// A name for an agent's local socket no other agent has.
pub(super) fn socket_name() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let r = PeerSecret::generate()
        .map(|s| s.to_hex()[..32].to_string())
        .unwrap_or_default();
    format!(
        "ckpt-replica-agent-{}-{}-{r}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An export of `seg` (announced as `announced` bytes, its descriptor sent `fds` times)
    /// listing one chunk of `len` bytes at `off`, as a misbehaving agent might send it.
    fn export(seg: &Segment, announced: u64, fds: usize, off: u64, len: u64) -> UnixStream {
        let (mut agent, client) = UnixStream::pair().unwrap();
        let mut b = Vec::new();
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&announced.to_le_bytes());
        agent.write_all(&b).unwrap();
        let sent: Vec<OwnedFd> = (0..fds).map(|_| seg.read_only().unwrap()).collect();
        send_fds(&agent, &sent).unwrap();
        let mut c = Vec::new();
        c.extend_from_slice(&[9u8; 32]);
        c.extend_from_slice(&0u32.to_le_bytes());
        c.extend_from_slice(&off.to_le_bytes());
        c.extend_from_slice(&len.to_le_bytes());
        agent.write_all(&c).unwrap();
        client
    }

    #[test]
    fn an_export_is_mapped_only_as_announced_and_sealed() {
        let seg = Segment::new(1 << 20).unwrap();
        // SAFETY: the test owns the segment and writes it before anything maps it.
        unsafe { std::ptr::write_bytes(seg.ptr.as_ptr(), 7, 4096) };
        let v = read_export(&mut export(&seg, 1 << 20, 1, 0, 4096)).unwrap();
        let got = v.get(&ChunkId(Hash([9; 32])), 4096).unwrap();
        assert!(got.iter().all(|&b| b == 7));
        assert!(
            v.get(&ChunkId(Hash([9; 32])), 4095).is_none(),
            "length checked"
        );

        let refused = |mut s: UnixStream, why: &str| {
            let e = read_export(&mut s).err().expect("refused").to_string();
            assert!(e.contains(why), "{e}");
        };
        // A chunk past the segment's end, a segment larger than its file, a missing or an
        // extra descriptor.
        refused(
            export(&seg, 1 << 20, 1, (1 << 20) - 10, 11),
            "in a segment of",
        );
        refused(export(&seg, 2 << 20, 1, 0, 10), "announced as");
        refused(
            export(&seg, 1 << 20, 0, 0, 10),
            "sent 0 segment descriptors where it announced 1",
        );
        refused(
            export(&seg, 1 << 20, 2, 0, 10),
            "sent 2 segment descriptors where it announced 1",
        );
        // A segment its agent could shrink under the mapping.
        // SAFETY: plain system calls on descriptors this test owns.
        let unsealed = unsafe {
            let raw = libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC);
            assert!(raw >= 0);
            let fd = OwnedFd::from_raw_fd(raw);
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), 1 << 20), 0);
            fd
        };
        let (mut agent, mut client) = UnixStream::pair().unwrap();
        let mut b = Vec::new();
        for v in [1u32, 1, 1] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&(1u64 << 20).to_le_bytes());
        agent.write_all(&b).unwrap();
        send_fds(&agent, &[unsealed]).unwrap();
        let e = read_export(&mut client).err().expect("refused").to_string();
        assert!(e.contains("not sealed against shrinking"), "{e}");
    }
}
