//! Delta chunks through the save pipeline (issue 16): a `Checkpointer`'s next save stores the
//! float chunks that changed as deltas on its committed base step, chains stay within
//! `delta_chain`, every step restores bit for bit, also after retention dropped the steps that
//! hold the bases.

use std::sync::Arc;
use std::time::Duration;

use ckpt_store::testing::{det_bytes, local_store, tiny_config};
use ckpt_store::{DType, GcOptions, Layout, NdBox, StepReader, Store, StoreConfig, VerifyScope};
use ckpt_trainer::{
    Checkpointer, CheckpointerConfig, HostTensor, SaveState, SaveTensor, restore_targets, runtime,
};

mod common;
use common::read;

/// fp32 values after `step` small updates (every element moves, in its low mantissa bits).
fn drifting_f32(step: u64, n: usize) -> Vec<u8> {
    let r = det_bytes(17, n * 8);
    let d = det_bytes(18, n * 8);
    (0..n)
        .flat_map(|i| {
            let u = u64::from_le_bytes(r[i * 8..i * 8 + 8].try_into().unwrap());
            let v = u64::from_le_bytes(d[i * 8..i * 8 + 8].try_into().unwrap());
            let x = ((u >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 0.04;
            let drift = ((v >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 2e-4;
            ((x * (1.0 + drift * step as f64)) as f32).to_le_bytes()
        })
        .collect()
}

fn chains(store: &Store, run: &str, step: u64) -> Vec<(usize, Option<u64>)> {
    runtime().block_on(async {
        let r = StepReader::open(store, run, step).await.unwrap();
        let m = r.manifest(0).await.unwrap();
        m.tensors[0]
            .chunks
            .iter()
            .map(|c| (c.bases.len(), c.base_step))
            .collect()
    })
}

#[test]
fn saves_store_deltas_on_their_committed_base_and_restore_bit_exact() {
    const K: usize = 2;
    let (store, _d) = local_store(StoreConfig {
        adaptive_codec: false,
        delta_chain: K,
        ..tiny_config()
    });
    let run = "delta";
    let n = 16 * 1024;
    let w = HostTensor::from_vec(drifting_f32(1, n));
    let state = || SaveState {
        tensors: vec![SaveTensor {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![n as u64],
            bbox: NdBox::full(&[n as u64]),
            placement: None,
            source: Some(Arc::new(w.clone())),
            replica_of: None,
        }],
        blobs: vec![],
    };
    let ck = Checkpointer::new(
        store.clone(),
        CheckpointerConfig::new(run, 0, Layout::SINGLE),
    )
    .unwrap();
    let timeout = Duration::from_secs(30);
    let mut want = Vec::new();
    for step in 1..=5u64 {
        let bytes = drifting_f32(step, n);
        w.write().copy_from_slice(&bytes);
        ck.save(step, state())
            .unwrap()
            .wait_committed(timeout)
            .unwrap();
        want.push(bytes);
    }
    let all: Vec<Vec<(usize, Option<u64>)>> = (1..=5).map(|s| chains(&store, run, s)).collect();
    assert!(all[0].iter().all(|c| c.0 == 0), "{all:?}");
    assert!(
        all[1].iter().filter(|c| *c == &(1, Some(1))).count() * 4 >= all[1].len() * 3,
        "step 2's chunks are deltas on step 1: {all:?}"
    );
    assert!(
        all.iter().flatten().all(|c| c.0 <= K),
        "chains within {K}: {all:?}"
    );
    assert!(
        all.iter().flatten().any(|c| c.0 == K),
        "a chain reaches {K}: {all:?}"
    );
    for (s, b) in want.iter().enumerate() {
        assert_eq!(&read(&store, run, s as u64 + 1, "w"), b, "step {}", s + 1);
    }
    // A restore decodes each chain straight into the tensor's memory.
    for step in [2, 5] {
        let reader = runtime()
            .block_on(StepReader::open(&store, run, step))
            .unwrap();
        let (sink, target) = common::Counted::whole_f32("w", n);
        let st = runtime()
            .block_on(restore_targets(&reader, &[target], 1 << 20))
            .unwrap();
        assert!(
            *sink.host.read() == want[step as usize - 1],
            "step {step} restored bit-exact"
        );
        assert_eq!(
            sink.in_place.load(std::sync::atomic::Ordering::SeqCst) as u64,
            st.chunks,
            "step {step}: every chunk decoded in place: {st:?}"
        );
    }
    // Retention keeps step 5 only; its bases (steps 3 and 4) stay.
    let g = runtime()
        .block_on(store.gc().run(
            &GcOptions {
                keep_last: Some(1),
                grace: Duration::ZERO,
                ..Default::default()
            },
            ckpt_store::clock::system_now() + chrono::Duration::seconds(1),
        ))
        .unwrap();
    assert_eq!(g.steps_kept, vec![(run.to_string(), 5)], "{g:?}");
    assert!(g.bytes_kept_as_bases > 0, "{g:?}");
    assert_eq!(read(&store, run, 5, "w"), want[4]);
    let v = runtime()
        .block_on(store.verify(&VerifyScope::Store, None))
        .unwrap();
    assert!(v.is_clean(), "{v:?}");
    // The next save builds on step 5 and restores.
    let bytes = drifting_f32(6, n);
    w.write().copy_from_slice(&bytes);
    ck.save(6, state())
        .unwrap()
        .wait_committed(timeout)
        .unwrap();
    assert!(chains(&store, run, 6).iter().all(|c| c.0 <= K));
    assert_eq!(read(&store, run, 6, "w"), bytes);
}
