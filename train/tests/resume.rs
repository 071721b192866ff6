//! Blobs and incremental saves through the reference workload: a resumed run continues the
//! loss curve of an uninterrupted one step for step (data position and RNG restored), and
//! frozen layers are not written again.

mod common;
use common::*;

fn losses(path: &std::path::Path) -> Vec<(u64, f64)> {
    metrics(path)
        .into_iter()
        .filter(|v| v["kind"] == "step")
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

#[test]
fn resumed_loss_curve_continues_step_for_step() {
    let dir = tempfile::tempdir().unwrap();
    let (m1, m2) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    let a = dir.path().join("a");
    train(
        &a,
        "run",
        &[
            "--layout",
            "dp=2",
            "--steps",
            "12",
            "--ckpt-every",
            "3",
            "--metrics-out",
            m1.to_str().unwrap(),
        ],
    );
    let b = dir.path().join("b");
    train(
        &b,
        "run",
        &[
            "--layout",
            "dp=2",
            "--steps",
            "7",
            "--ckpt-every",
            "3",
            "--metrics-out",
            m2.to_str().unwrap(),
        ],
    );
    // Resume from step 7 (the final checkpoint) under another layout.
    train(
        &b,
        "run",
        &[
            "--layout",
            "tp=2,pp=2",
            "--steps",
            "12",
            "--ckpt-every",
            "3",
            "--resume",
            "--metrics-out",
            m2.to_str().unwrap(),
        ],
    );
    let la = losses(&m1);
    let lb = losses(&m2);
    assert_eq!(la.len(), 12);
    assert_eq!(lb.len(), 12, "{lb:?}");
    assert_eq!(
        la, lb,
        "the resumed run's loss differs from the uninterrupted one"
    );
    assert!(la[11].1 < la[0].1);
}

#[test]
fn frozen_layers_are_not_written_again() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m.jsonl");
    let frozen = 0.5;
    train(
        dir.path(),
        "ft",
        &[
            "--layers",
            "8",
            "--frozen",
            "0.5",
            "--steps",
            "4",
            "--ckpt-every",
            "2",
            "--metrics-out",
            m.to_str().unwrap(),
        ],
    );
    let ck: Vec<serde_json::Value> = metrics(&m)
        .into_iter()
        .filter(|v| v["kind"] == "checkpoint")
        .collect();
    assert_eq!(ck.len(), 2);
    // The second save skips every chunk of the frozen layers (their weights and moments did
    // not change) and writes the rest: the skipped share of the state is the frozen share of
    // the parameters (embeddings and output are never frozen).
    let bytes = ck[1]["bytes"].as_f64().unwrap();
    let skipped = ck[1]["bytes_skipped"].as_f64().unwrap();
    let model = ckpt_trainer::workload::ModelConfig::for_params(60_000, 8);
    let frozen_layers = (frozen * 8.0f64).round() as u32;
    let total: u64 = model
        .params()
        .iter()
        .map(|p| p.shape.iter().product::<u64>())
        .sum();
    let frozen_params: u64 = model
        .params()
        .iter()
        .filter(|p| p.layer.is_some_and(|l| l < frozen_layers))
        .map(|p| p.shape.iter().product::<u64>())
        .sum();
    let expect = frozen_params as f64 / total as f64;
    let share = skipped / bytes;
    assert!(
        (share - expect).abs() < 0.03,
        "second checkpoint skipped {share:.3} of its bytes, expected about {expect:.3}"
    );
    let written = ck[1]["bytes_written"].as_f64().unwrap();
    assert!(
        written / bytes <= 1.0 - expect + 0.05,
        "wrote {written} of {bytes} bytes"
    );
    assert!(ck[1]["bytes_skipped"].as_u64().unwrap() > 0);
}

/// A flipped bit in the newest step's commit record (or in one of its rank manifests): the
/// resumed run refuses to restore it, naming the step, instead of training on wrong state.
#[test]
fn resume_refuses_a_damaged_commit_record_or_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s");
    let args = ["--layout", "dp=2", "--steps", "6", "--ckpt-every", "3"];
    train(&store, "run", &args);
    let step_dir = store.join("runs/run/steps/00000000000000000006");
    for (file, at) in [
        ("COMMIT", 100usize),
        ("COMMIT", 0),
        ("rank-000001.manifest", 200),
    ] {
        // Manifests live under `ranks/<2 hex>/` since format 4: find the file by name.
        let path = find_file(&step_dir, file).unwrap_or_else(|| panic!("no {file} in the step"));
        let orig = std::fs::read(&path).unwrap();
        let mut bad = orig.clone();
        let at = at.min(bad.len() - 1);
        bad[at] ^= 0x02;
        std::fs::write(&path, &bad).unwrap();
        let out = cmd(
            &store,
            "run",
            &[
                "--layout",
                "dp=2",
                "--steps",
                "9",
                "--ckpt-every",
                "3",
                "--resume",
            ],
        )
        .output()
        .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{file} byte {at}: resumed from a damaged step:\n{err}"
        );
        assert!(
            err.contains("step 6 of run run") || err.contains("steps/00000000000000000006/"),
            "{file} byte {at}: the error does not name the step:\n{err}"
        );
        std::fs::write(&path, &orig).unwrap();
    }
    train(
        &store,
        "run",
        &[
            "--layout",
            "dp=2",
            "--steps",
            "9",
            "--ckpt-every",
            "3",
            "--resume",
        ],
    );
}

/// The file named `name` in `dir` or below it.
fn find_file(dir: &std::path::Path, name: &str) -> Option<std::path::PathBuf> {
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        if p.is_dir() {
            if let Some(f) = find_file(&p, name) {
                return Some(f);
            }
        } else if e.file_name() == name {
            return Some(p);
        }
    }
    None
}
