//! Checkpoints as directories and files through FUSE.
