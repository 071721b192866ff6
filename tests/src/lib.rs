//! Cross-crate scenarios with real processes, stores and mounts.
