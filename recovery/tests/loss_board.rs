//! The driver's per-step figures from heartbeat payloads: exact totals of the sums a workload
//! declares, whatever order the ranks' beats arrive in, written as typed `step` records.

use std::collections::BTreeMap;

use ckpt_recovery::driver::LossBoard;
use ckpt_recovery::heartbeat::{Beat, Figure, Workload};
use ckpt_recovery::records::{Curve, Metric, read_records};
use ckpt_store::Store;

const SCALE: f64 = (1u64 << 40) as f64;

/// A payload in the shape of the reference workload's, under names the driver never sees
/// anywhere else.
fn payload(err: u128, grad: u128, count: u64) -> Workload {
    Workload {
        sums: BTreeMap::from([
            ("err".to_string(), err.to_string()),
            ("grad".to_string(), grad.to_string()),
            ("count".to_string(), count.to_string()),
        ]),
        figures: vec![
            Figure {
                curve: Curve::Loss,
                sum: "err".into(),
                per: Some("count".into()),
                scale: SCALE,
                sqrt: false,
            },
            Figure {
                curve: Curve::GradNorm,
                sum: "grad".into(),
                per: None,
                scale: SCALE,
                sqrt: true,
            },
        ],
    }
}

async fn steps(store: &Store) -> Vec<(u64, Option<u64>, Option<f64>, Option<f64>)> {
    read_records::<Metric>(store, "r")
        .await
        .unwrap()
        .into_iter()
        .filter_map(|m| match m.record {
            Metric::Step(s) => Some((s.step, s.generation, s.loss, s.grad_norm)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn totals_are_exact_and_do_not_depend_on_the_order_of_the_beats() {
    // Sums near 2^100: an f64 sum of the parts would round differently by order.
    let parts = [
        payload((1 << 100) + 3, (1 << 90) + 1, 7),
        payload(5, 1, 9),
        payload((1 << 99) + 11, 13, 0),
    ];
    let sse: u128 = (1 << 100) + 3 + 5 + (1 << 99) + 11;
    let gsq: u128 = (1 << 90) + 1 + 1 + 13;
    let want_loss = sse as f64 / SCALE / 16f64;
    let want_grad = (gsq as f64 / SCALE).sqrt();
    let mut seen = Vec::new();
    for order in [[0, 1, 2], [2, 0, 1], [1, 2, 0]] {
        let store = Store::memory();
        let mut board = LossBoard::new(&store, "r", "supervisor").unwrap();
        for i in order {
            // Through the wire format, as a rank sends it.
            let beat = Beat {
                generation: 4,
                rank: i as u32,
                step: 12,
                workload: Some(parts[i].clone()),
                starting: false,
            };
            let b: Beat = serde_json::from_slice(&serde_json::to_vec(&beat).unwrap()).unwrap();
            board
                .add(b.generation, b.step, b.workload.as_ref().unwrap(), 3)
                .await
                .unwrap();
        }
        board.flush().await;
        let s = steps(&store).await;
        assert_eq!(
            s.len(),
            1,
            "one record once all three ranks reported: {s:?}"
        );
        let (step, g, loss, grad) = s[0];
        assert_eq!((step, g), (12, Some(4)));
        assert_eq!(loss.unwrap().to_bits(), want_loss.to_bits());
        assert_eq!(grad.unwrap().to_bits(), want_grad.to_bits());
        seen.push(s[0]);
    }
    assert!(seen.windows(2).all(|w| w[0] == w[1]));
}

#[tokio::test]
async fn a_bad_payload_counts_its_rank_and_adds_nothing() {
    let store = Store::memory();
    let mut board = LossBoard::new(&store, "r", "supervisor").unwrap();
    let mut bad = payload(1, 1, 1);
    bad.sums.insert("err".into(), "-5".into());
    let mut huge = payload(1, 1, 1);
    for i in 0..40 {
        huge.sums.insert(format!("x{i}"), "1".into());
    }
    board
        .add(0, 1, &payload(8 << 40, 4 << 40, 2), 3)
        .await
        .unwrap();
    board.add(0, 1, &bad, 3).await.unwrap();
    board.add(0, 1, &huge, 3).await.unwrap();
    board.flush().await;
    let s = steps(&store).await;
    assert_eq!(s, vec![(1, Some(0), Some(4.0), Some(2.0))]);
}
