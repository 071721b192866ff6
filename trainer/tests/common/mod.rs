//! Helpers shared by the trainer's integration tests.

use ckpt_store::{StepReader, Store};
use ckpt_trainer::runtime;

/// The bytes of tensor `name` of committed `step` of `run`, read through a `StepReader`;
/// panics naming the step and tensor when it cannot be read.
pub fn read(store: &Store, run: &str, step: u64, name: &str) -> Vec<u8> {
    runtime().block_on(async {
        StepReader::open(store, run, step)
            .await
            .unwrap_or_else(|e| panic!("step {step} of {run}: {e}"))
            .read_tensor(name)
            .await
            .unwrap_or_else(|e| panic!("step {step} tensor {name}: {e}"))
    })
}
