//! Large reads: from the page cache when it holds the whole range (asked of `mincore`), else
//! from the disk with `O_DIRECT`, into a pooled aligned buffer.

use std::fs::File;
use std::io::ErrorKind as IoKind;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path as FsPath;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use object_store::GetRange;

use super::buf::{ALIGN, PooledRead, read_buf, round_up};
use super::{IO_PIECE, ReadCounts, open_direct};

/// Read `range` of the object at `path`: from the page cache when it holds all of it, else
/// from the disk (with `O_DIRECT` when on, unless the read is `buffered`: other processes
/// will read the same bytes, and the page cache lets the disk serve them once).
pub(super) fn read_range(
    path: &FsPath,
    range: Option<GetRange>,
    (direct, buffered): (&AtomicBool, bool),
    reads: &ReadCounts,
) -> std::io::Result<(Bytes, Range<u64>, std::fs::Metadata)> {
    // A plain descriptor first: the page cache may hold the range (read or written buffered by
    // someone else: a copy, another reader on this node), and then a read from it is a memory
    // copy where an O_DIRECT read would go to the disk again.
    let file = open_direct(path, false, &AtomicBool::new(false))?;
    let meta = file.metadata()?;
    let size = meta.len();
    let r = bounded(range, size)?;
    let start = r.start as usize & !(ALIGN - 1);
    let end = round_up(r.end as usize, ALIGN);
    let mut buf = read_buf(end - start);
    let want = (r.end as usize) - start;
    if read_cached(&file, &mut buf.full_mut()[..want], start as u64)? {
        reads.cached.fetch_add(1, Ordering::Relaxed);
    } else {
        let file = if direct.load(Ordering::Relaxed) && !buffered {
            open_direct(path, false, direct)?
        } else {
            file
        };
        read_full(&file, buf.full_mut(), want, start, path)?;
        reads.disk.fetch_add(1, Ordering::Relaxed);
    }
    buf.set_len(want);
    let bytes = Bytes::from_owner(PooledRead(Some(buf))).slice(r.start as usize - start..);
    Ok((bytes, r, meta))
}

/// The bytes of `range` in an object of `size` bytes.
fn bounded(range: Option<GetRange>, size: u64) -> std::io::Result<Range<u64>> {
    Ok(match range {
        None => 0..size,
        Some(GetRange::Bounded(r)) => {
            if r.start > r.end || r.start > size {
                return Err(std::io::Error::new(
                    IoKind::InvalidInput,
                    format!("range {r:?} is outside an object of {size} bytes"),
                ));
            }
            r.start..r.end.min(size)
        }
        Some(GetRange::Offset(o)) => {
            if o > size {
                return Err(std::io::Error::new(
                    IoKind::InvalidInput,
                    format!("offset {o} is past an object of {size} bytes"),
                ));
            }
            o..size
        }
        Some(GetRange::Suffix(n)) => size.saturating_sub(n)..size,
    })
}

/// Fill `dst` from `file` at `at` if the page cache holds all of it. `false`: some of it is
/// not cached. Residency is asked of `mincore(2)` over a mapping of the range, which reads
/// nothing (a `preadv2` with `RWF_NOWAIT` says EAGAIN but starts the readahead of what it did
/// not find, so the disk would read the range twice); a page evicted between the question and
/// the read makes that read go to the disk, still correct.
fn read_cached(file: &File, dst: &mut [u8], at: u64) -> std::io::Result<bool> {
    if dst.is_empty() || !resident(file, at, dst.len()) {
        return Ok(false);
    }
    let mut got = 0usize;
    while got < dst.len() {
        let piece = (dst.len() - got).min(IO_PIECE);
        let n = file.read_at(&mut dst[got..got + piece], at + got as u64)?;
        if n == 0 {
            // The object shrank: let the disk read report it.
            return Ok(false);
        }
        got += n;
    }
    Ok(true)
}

/// Whether every page of `len` bytes of `file` from `at` (page-aligned) is in the page cache.
fn resident(file: &File, at: u64, len: usize) -> bool {
    use std::os::fd::AsRawFd;
    let page = ALIGN;
    let pages = len.div_ceil(page);
    // SAFETY: a private read-only mapping of the file's range, never dereferenced (mincore
    // only asks the kernel about its pages) and unmapped before returning; `at` is aligned.
    unsafe {
        let map = libc::mmap(
            std::ptr::null_mut(),
            pages * page,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            at as libc::off_t,
        );
        if map == libc::MAP_FAILED {
            return false;
        }
        let mut vec = vec![0u8; pages];
        let ok = libc::mincore(map, pages * page, vec.as_mut_ptr()) == 0;
        libc::munmap(map, pages * page);
        ok && vec.iter().all(|v| v & 1 == 1)
    }
}

/// Read `want` bytes of `file` from `start` into `full` (aligned, for `O_DIRECT`).
fn read_full(
    file: &File,
    full: &mut [u8],
    want: usize,
    start: usize,
    path: &FsPath,
) -> std::io::Result<()> {
    let mut got = 0usize;
    while got < want {
        let piece = (full.len() - got).min(IO_PIECE);
        let n = file.read_at(&mut full[got..got + piece], (start + got) as u64)?;
        if n == 0 {
            return Err(std::io::Error::new(
                IoKind::UnexpectedEof,
                format!("{} shrank while being read", path.display()),
            ));
        }
        got += n;
    }
    Ok(())
}
