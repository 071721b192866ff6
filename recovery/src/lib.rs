//! The recovery coordinator: detect failures, decide, reshard, resume.
