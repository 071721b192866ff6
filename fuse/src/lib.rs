//! `ckpt-fuse`: every committed checkpoint of a store as directories and read-only files.
//!
//! ```text
//! <mount>/<run>/latest -> <step>                 the newest committed step
//! <mount>/<run>/<step>/COMMIT.json               the commit record, pretty JSON, plus fs_names
//! <mount>/<run>/<step>/model.safetensors         every tensor consolidated, one safetensors file
//! <mount>/<run>/<step>/tensors/<name>            one tensor's consolidated row-major bytes
//! <mount>/<run>/<step>/ranks/<r>/<name>          the boxes rank r holds of a tensor, as saved
//! <mount>/<run>/<step>/blobs/<r>/<name>          a blob saved by rank r
//! ```
//!
//! - Only committed steps appear, as decimal numbers; sizes are exact; `mtime` is the commit
//!   time. `latest` follows new commits (runs and steps are listed again after a second).
//! - `model.safetensors` has the header of [`ckpt_store::SafetensorsView`] and the tensors'
//!   bytes at its offsets: the same bytes `ckpt export` writes. Any byte range of any file
//!   fetches only the chunks under it.
//! - `ranks/<r>/<name>` is the row-major bytes of every box rank `r` holds of the tensor, back
//!   to back in the order of its manifest: one box for a tensor-parallel split or a replica
//!   (a data-parallel copy another rank wrote, read from that rank's chunks), the boxes of its
//!   flat range for a ZeRO partition (so the file is the rank's flat slice).
//! - Blobs are per rank, so they live in `blobs/<r>/`, next to `ranks/<r>/`.
//! - Names from manifests are made safe ([`names`]): `/`, `%` and control characters are
//!   percent-encoded, `.`/`..` are escaped, long names are cut with a hash, collisions get
//!   `~2`, `~3`; `COMMIT.json` lists every renamed entry under `fs_names`.
//! - Decoded chunks are cached up to [`MountOptions::cache_bytes`] ([`ckpt_store::cache`], the one chunk cache); sequential
//!   readers get chunks fetched ahead; any number of processes may read at once.
//! - A damaged chunk is `EIO` for the reads that touch it (logged with the run, step, tensor
//!   or blob, and object key); everything else stays readable.
//!
//! The filesystem logic is [`CkptFs`], plain async methods tested without a kernel; the
//! `fuser` adapter is a thin layer over it. [`mount_blocking`] is what `ckpt mount` calls;
//! [`spawn_mount`] mounts in the background and returns a handle.
//!
//! ```no_run
//! let store = ckpt_store::open("/data/ckpt")?;
//! let opts = ckpt_fuse::MountOptions {
//!     mountpoint: "/mnt/ckpt".into(),
//!     cache_bytes: 1 << 30,
//!     allow_other: false,
//! };
//! let mount = ckpt_fuse::spawn_mount(store, &opts)?;
//! let header = std::fs::read(mount.mountpoint().join("demo/latest/COMMIT.json"));
//! drop(mount); // unmounts
//! # Ok::<(), ckpt_store::Error>(())
//! ```

#![warn(missing_docs)]

pub mod fs;
pub mod fuse;
mod mount;
pub mod names;
mod step;

use std::path::PathBuf;

pub use ckpt_store::cache::{CacheStats, ChunkCache};
pub use fs::{Attr, CkptFs, DirEntry, FsError, FsOptions, Kind, ROOT_INO};
pub use mount::{MountHandle, find_fusermount3, mounted_at, spawn_mount};

/// What `ckpt mount` asks for.
#[derive(Debug, Clone)]
pub struct MountOptions {
    /// Where to mount.
    pub mountpoint: PathBuf,
    /// Bytes of decoded chunks to cache.
    pub cache_bytes: u64,
    /// Let users other than the mounting one read.
    pub allow_other: bool,
}

/// Mount `store` at `opts.mountpoint` read-only and serve until unmounted or until SIGINT or
/// SIGTERM, then unmount cleanly (lazily when a process still uses the mount: it goes away
/// when the last one lets go; a second signal stops serving at once).
///
/// Fails before mounting, saying what to do, when the mountpoint is missing, not an empty
/// directory, already a mount point (or a dead one left by a killed mount), or when FUSE is
/// unavailable (no `/dev/fuse`, no permission, no `fusermount3`).
pub fn mount_blocking(store: ckpt_store::Store, opts: &MountOptions) -> ckpt_store::Result<()> {
    spawn_mount(store, opts)?.serve_until_signal()
}
