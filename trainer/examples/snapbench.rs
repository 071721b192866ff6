use ckpt_store::{DType, Layout, NdBox};
use ckpt_trainer::{Checkpointer, CheckpointerConfig, HostTensor, SaveState, SaveTensor};
use std::sync::Arc;
use std::time::{Duration, Instant};
fn main() {
    let n: usize = 512 << 20;
    let store = ckpt_store::open("/work/bench-out/snapbench").unwrap();
    let tensors: Vec<HostTensor> = (0..8)
        .map(|i| HostTensor::from_vec(vec![i as u8; n / 8]))
        .collect();
    let mut cfg = CheckpointerConfig::new("s", 0, Layout::SINGLE);
    cfg.staging_bytes = n + (64 << 20);
    cfg.prefault = std::env::var_os("PREFAULT").is_some();
    cfg.copy_threads = 2;
    let ck = Checkpointer::new(store, cfg).unwrap();
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    for _ in 0..2 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        println!("memcpy {:.3}", t.elapsed().as_secs_f64());
    }
    for step in 1..=4 {
        let st = SaveState {
            tensors: tensors
                .iter()
                .enumerate()
                .map(|(i, t)| SaveTensor {
                    name: format!("t{i}"),
                    dtype: DType::U8,
                    shape: vec![(n / 8) as u64],
                    bbox: NdBox::full(&[(n / 8) as u64]),
                    placement: None,
                    source: Some(Arc::new(t.clone())),
                    replica_of: None,
                })
                .collect(),
            blobs: vec![],
        };
        let t = Instant::now();
        let h = ck.save(step, st).unwrap();
        let call = t.elapsed().as_secs_f64();
        h.wait_snapshot().unwrap();
        let snap = t.elapsed().as_secs_f64();
        h.wait_committed(Duration::from_secs(60)).unwrap();
        println!(
            "step {step}: call {call:.3} snapshot {snap:.3} committed {:.3} pool {:?}",
            t.elapsed().as_secs_f64(),
            ck.staging()
        );
    }
}
