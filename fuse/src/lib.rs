//! `ckpt-fuse`: every committed checkpoint of a store as directories and files.
//!
//! Work in progress: the filesystem model and the `fuser` adapter are being built; until then
//! [`mount_blocking`] refuses with an error saying so.

use std::path::PathBuf;

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
/// SIGTERM, then unmount cleanly.
pub fn mount_blocking(_store: ckpt_store::Store, opts: &MountOptions) -> ckpt_store::Result<()> {
    Err(ckpt_store::Error::internal(format!(
        "cannot mount at {}: the FUSE view is not built yet",
        opts.mountpoint.display()
    )))
}
