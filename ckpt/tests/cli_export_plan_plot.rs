//! The subcommands that write files or plan reads (export, import, plan, plot) on real
//! stores: each case runs on a local directory and on a real S3-compatible server, through the
//! library functions (for exact figures) and through the real `ckpt` binary (for exit codes,
//! text and `--json` output). The other subcommands are in `cli.rs`.

mod common;

use std::collections::HashSet;

use ckpt::cli::diff::{DiffArgs, diff};
use ckpt::cli::export::{ExportArgs, export};
use ckpt::cli::import::{ImportArgs, import};
use ckpt::cli::plan::{PlanArgs, plan};
use ckpt::cli::plot::{PlotArgs, plot};
use ckpt::cli::{CkptRef, Ui};
use ckpt_store::logs::{EVENTS, LogWriter, METRICS};
use ckpt_store::placement::place_rank;
use ckpt_store::{DedupIndex, SafetensorsView, StepReader};
use common::{Env, global, local, s3, save_step, specs, tmp, two_steps_and_a_pending_one};
use serde_json::Value;

macro_rules! on_both {
    ($($case:ident),* $(,)?) => {
        mod on_local { $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $case() { super::$case(super::local()).await } )* }
        mod on_s3 { $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $case() { ckpt_store::require!(ckpt_store::testing::Need::S3Server, concat!(stringify!($case), " on S3")); super::$case(super::s3()).await } )* }
    };
}

on_both!(
    export_matches_the_view_and_import_round_trips,
    plan_computes_each_new_ranks_reads,
    plot_draws_png_and_svg,
);

fn q() -> Ui {
    Ui::quiet()
}

async fn export_matches_the_view_and_import_round_trips(env: Env) {
    two_steps_and_a_pending_one(&env).await;
    let dir = tmp();
    let out1 = dir.path().join("one");
    let rep = export(
        &env.store,
        &ExportArgs::new(CkptRef::at("train", 20), &out1),
        &q(),
    )
    .await
    .unwrap();
    assert_eq!(rep.files.len(), 1);
    assert!(rep.index.is_none());
    let file = std::fs::read(out1.join("model.safetensors")).unwrap();
    // Byte-identical to the view the FUSE mount serves.
    let reader = StepReader::open(&env.store, "train", 20).await.unwrap();
    let view = SafetensorsView::new(reader.commit(), None).unwrap();
    let mut want = vec![0u8; view.len() as usize];
    view.read_at(&reader, 0, &mut want).await.unwrap();
    assert!(
        file == want,
        "export differs from the SafetensorsView bytes"
    );
    let st = safetensors::SafeTensors::deserialize(&file).unwrap();
    for s in specs(true) {
        let t = st.tensor(&s.name).unwrap();
        assert_eq!(t.data(), &global(&s, 20)[..], "{}", s.name);
        assert_eq!(
            t.shape(),
            s.shape.iter().map(|&d| d as usize).collect::<Vec<_>>()
        );
    }
    assert_eq!(
        common::files_below(&out1),
        ["model.safetensors"],
        "no temporary file is left"
    );

    // Sharded, Hugging Face style.
    let out2 = dir.path().join("sharded");
    let mut args = ExportArgs::new(CkptRef::at("train", 20), &out2);
    args.max_shard_size = Some(10 << 10);
    let sharded = export(&env.store, &args, &q()).await.unwrap();
    assert!(sharded.files.len() >= 3, "{:?}", sharded.files);
    let index: Value =
        serde_json::from_slice(&std::fs::read(out2.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let total: u64 = specs(true).iter().map(|s| global(s, 20).len() as u64).sum();
    assert_eq!(index["metadata"]["total_size"], total);
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), specs(true).len());
    let mut seen = HashSet::new();
    for f in &sharded.files {
        assert!(f.bytes <= (10 << 10) + 4096 || f.tensors == 1, "{f:?}");
        let b = std::fs::read(out2.join(&f.file)).unwrap();
        for (name, t) in safetensors::SafeTensors::deserialize(&b).unwrap().tensors() {
            assert_eq!(map[&name], f.file.as_str());
            let s = specs(true).into_iter().find(|s| s.name == name).unwrap();
            assert_eq!(t.data(), &global(&s, 20)[..]);
            seen.insert(name);
        }
    }
    assert_eq!(seen.len(), specs(true).len());

    // --dtype bf16: floats convert (round to nearest even), integers keep their dtype.
    let out3 = dir.path().join("bf16");
    let mut args = ExportArgs::new(CkptRef::at("train", 20), &out3);
    args.dtype = Some(ckpt::cli::shared::values::FloatDType::Bf16);
    args.exclude = vec!["optim.exp_avg.*".into()];
    export(&env.store, &args, &q()).await.unwrap();
    let b = std::fs::read(out3.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&b).unwrap();
    assert!(
        st.tensor("optim.exp_avg.qkv").is_err(),
        "--exclude left it out"
    );
    let qkv = st.tensor("layers.0.attn.qkv.weight").unwrap();
    assert_eq!(qkv.dtype(), safetensors::Dtype::BF16);
    let want: Vec<u8> = global(&specs(true)[1], 20)
        .chunks(4)
        .flat_map(|c| half::bf16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes())
        .collect();
    assert_eq!(qkv.data(), &want[..]);
    assert_eq!(
        st.tensor("optim.step").unwrap().dtype(),
        safetensors::Dtype::I64
    );

    // Exporting again into the same place needs --force.
    let r = env
        .ckpt(&["export", "train@20", "--out", out1.to_str().unwrap()])
        .code(1);
    assert!(r.err.contains("--force"), "{}", r.err);
    let r = env
        .ckpt(&[
            "export",
            "train@20",
            "--out",
            out1.to_str().unwrap(),
            "--force",
            "--json",
        ])
        .code(0);
    assert_eq!(r.json()["files"][0]["file"], "model.safetensors");
    assert!(std::fs::read(out1.join("model.safetensors")).unwrap() == file);

    // Import: a fine-tuning run starts from the exported file.
    let args = ImportArgs {
        files: vec![out1.join("model.safetensors")],
        run: "ft".into(),
        step: 0,
    };
    let rep = import(&env.store, &args, &q()).await.unwrap();
    assert_eq!(rep.tensors, specs(true).len());
    let ft = StepReader::open(&env.store, "ft", 0).await.unwrap();
    assert_eq!(ft.commit().layout, ckpt_store::Layout::SINGLE);
    for s in specs(true) {
        assert_eq!(
            ft.read_tensor(&s.name).await.unwrap(),
            global(&s, 20),
            "{}",
            s.name
        );
    }
    // Importing the same bytes again costs nothing: every chunk is already stored.
    let rep2 = import(
        &env.store,
        &ImportArgs {
            step: 1,
            ..args.clone()
        },
        &q(),
    )
    .await
    .unwrap();
    assert_eq!(rep2.chunks_skipped, rep2.chunks, "{rep2:?}");
    assert_eq!(rep2.bytes_written, 0);
    assert!(rep2.dedup_chunks_known > 0);
    // The index json of the sharded export imports the same tensors, and writes no chunk.
    let rep3 = import(
        &env.store,
        &ImportArgs {
            files: vec![out2.join("model.safetensors.index.json")],
            run: "ft".into(),
            step: 2,
        },
        &q(),
    )
    .await
    .unwrap();
    assert_eq!(rep3.tensors, specs(true).len());
    assert_eq!(rep3.files.len(), sharded.files.len());
    assert_eq!(
        rep3.bytes_skipped, rep3.logical_bytes,
        "same tensors, same chunks: only the metadata blob (other file names) is new"
    );
    // The binary (which opens the store with its default 4 MiB chunks).
    let r = env
        .ckpt(&[
            "import",
            out2.join("model.safetensors.index.json").to_str().unwrap(),
            "--run",
            "ft",
            "--step",
            "3",
            "--json",
        ])
        .code(0);
    let j = r.json();
    for key in [
        "run",
        "step",
        "files",
        "tensors",
        "logical_bytes",
        "chunks",
        "chunks_skipped",
        "bytes_written",
    ] {
        assert!(j.get(key).is_some(), "import --json has {key}");
    }
    assert_eq!(j["tensors"], specs(true).len());
    // The step exists: refused, and nothing changes.
    let r = env
        .ckpt(&[
            "import",
            out1.join("model.safetensors").to_str().unwrap(),
            "--run",
            "ft",
            "--step",
            "2",
        ])
        .code(1);
    assert!(
        r.err.contains("step 2 of run ft already exists"),
        "{}",
        r.err
    );
    // Values survive across layouts: the sharded original and the single-rank import.
    let d = diff(
        &env.store,
        &DiffArgs {
            a: CkptRef::at("train", 20),
            b: CkptRef::at("ft", 2),
            quick: false,
        },
        &q(),
    )
    .await
    .unwrap();
    assert!(
        d.changed.is_empty() && d.added.is_empty() && d.removed.is_empty(),
        "{d:?}"
    );
    assert_eq!(d.totals.bytes_differ, 0);
    assert!(
        d.totals.bytes_read > 0,
        "different layouts are compared by reading"
    );
    let dq = diff(
        &env.store,
        &DiffArgs {
            a: CkptRef::at("train", 20),
            b: CkptRef::at("ft", 2),
            quick: true,
        },
        &q(),
    )
    .await
    .unwrap();
    assert!(!dq.changed.is_empty());
    assert!(
        dq.changed
            .iter()
            .all(|c| c.what == "unknown" && c.bytes_differ.is_none())
    );
    assert_eq!(dq.totals.bytes_read, 0);
}

async fn plan_computes_each_new_ranks_reads(env: Env) {
    two_steps_and_a_pending_one(&env).await;
    let all: u64 = specs(true).iter().map(|s| global(s, 20).len() as u64).sum();
    // One rank reads everything, every fetched byte is used.
    let p = plan(
        &env.store,
        &PlanArgs {
            ckpt: CkptRef::at("train", 20),
            layout: "dp=1".into(),
            zero: None,
            rank: None,
        },
        &q(),
    )
    .await
    .unwrap();
    assert_eq!(p.world, 1);
    assert_eq!(p.ranks[0].bytes_needed, all);
    assert_eq!(p.ranks[0].raw_bytes, all);
    assert_eq!(p.totals.read_amplification, 1.0);
    assert!(p.unplaced.is_empty());

    // dp=4 with ZeRO-1: every rank's needs match the placement rules.
    let new: ckpt_store::Layout = "dp=4,tp=1,pp=1,zero=1".parse().unwrap();
    let p = plan(
        &env.store,
        &PlanArgs {
            ckpt: CkptRef::at("train", 20),
            layout: "dp=4".into(),
            zero: Some(1),
            rank: Some(3),
        },
        &q(),
    )
    .await
    .unwrap();
    assert_eq!(p.to_layout, "dp=4,tp=1,pp=1,zero=1");
    let sp = specs(true);
    for r in 0..4 {
        let want: u64 = place_rank(&new, r, &sp)
            .unwrap()
            .iter()
            .map(|x| x.bbox.numel() * sp[x.spec].dtype.size() as u64)
            .sum();
        assert_eq!(p.ranks[r as usize].bytes_needed, want, "rank {r}");
        assert!(p.ranks[r as usize].raw_bytes >= want);
        assert!(p.ranks[r as usize].objects > 0);
    }
    // The recovery driver's plan (what the recovery log records for a generation) reads the
    // same bytes per rank as `ckpt plan`, ZeRO partitions included.
    let driver = ckpt_recovery::restore_plan(&env.store, "train", 20, &new)
        .await
        .unwrap();
    assert_eq!(driver.len(), 4);
    for (d, c) in driver.iter().zip(&p.ranks) {
        assert_eq!(
            (d.rank, d.bytes_needed),
            (c.rank, c.bytes_needed),
            "rank {}",
            c.rank
        );
    }
    let reader = StepReader::open(&env.store, "train", 20).await.unwrap();
    for read in &p.ranks[3].reads {
        let plan = reader.plan(&read.tensor, &read.bbox).await.unwrap();
        assert_eq!(plan.chunks.len(), read.chunks.len());
    }

    let j = env
        .ckpt(&["plan", "train@20", "--layout", "dp=1,tp=2", "--json"])
        .code(0)
        .json();
    for key in [
        "run",
        "step",
        "from_layout",
        "to_layout",
        "world",
        "unplaced",
        "ranks",
        "totals",
    ] {
        assert!(j.get(key).is_some(), "plan --json has {key}");
    }
    let rank0 = &j["ranks"][0];
    for key in [
        "rank",
        "dp",
        "tp",
        "pp",
        "bytes_needed",
        "chunks",
        "raw_bytes",
        "stored_bytes",
        "objects",
        "reads",
    ] {
        assert!(rank0.get(key).is_some(), "plan ranks have {key}");
    }
    let c = &rank0["reads"][0]["chunks"][0];
    assert!(
        c["object"].as_str().unwrap().contains("chunks/")
            || c["object"].as_str().unwrap().contains("packs/")
    );
    let r = env
        .ckpt(&["plan", "train@20", "--layout", "dp=1,tp=2", "--rank", "1"])
        .code(0);
    assert!(
        r.out.contains("rank 1 reads:") && r.out.contains("chunk "),
        "{}",
        r.out
    );
    // An impossible layout names the tensor; a malformed one is a usage error.
    let r = env.ckpt(&["plan", "train@20", "--layout", "tp=3"]).code(2);
    assert!(r.err.contains("does not divide by tp=3"), "{}", r.err);
    env.ckpt(&["plan", "train@20", "--layout", "xp=2"]).code(2);
    env.ckpt(&["plan", "train@20", "--layout", "dp=2", "--rank", "9"])
        .code(2);

    // An imported step has no placement: every rank reads everything, and the output says so.
    let dir = tmp();
    export(
        &env.store,
        &ExportArgs::new(CkptRef::at("train", 20), dir.path()),
        &q(),
    )
    .await
    .unwrap();
    import(
        &env.store,
        &ImportArgs {
            files: vec![dir.path().join("model.safetensors")],
            run: "ft".into(),
            step: 1,
        },
        &q(),
    )
    .await
    .unwrap();
    let r = env.ckpt(&["plan", "ft@1", "--layout", "dp=2"]).code(0);
    assert!(r.out.contains("no recorded placement"), "{}", r.out);
    let j = env
        .ckpt(&["plan", "ft", "--layout", "dp=2", "--json"])
        .code(0)
        .json();
    assert_eq!(j["unplaced"].as_array().unwrap().len(), specs(true).len());
    assert_eq!(j["ranks"][1]["bytes_needed"], all);
}

#[allow(
    clippy::disallowed_methods,
    reason = "a test reads its knobs and tools from the environment"
)]
async fn plot_draws_png_and_svg(env: Env) {
    two_steps_and_a_pending_one(&env).await;
    let t0 = 1_767_000_000_000i64;
    let mut m = LogWriter::new(&env.store, "train", METRICS, "rank-0").unwrap();
    let mut m1 = LogWriter::new(&env.store, "train", METRICS, "rank-1").unwrap();
    for step in 1..=300u64 {
        let t = if step <= 180 {
            t0 + step as i64 * 1000
        } else {
            t0 + 60_000 + step as i64 * 1000
        };
        let loss =
            4.0 * (-(step as f64) / 120.0).exp() + 1.2 + 0.05 * ((step * 13 % 7) as f64 / 7.0);
        for (w, rank) in [(&mut m, 0), (&mut m1, 1)] {
            w.append(&serde_json::json!({"kind":"step","step":if step <= 180 { step } else { step - 30 },"loss":loss,"grad_norm":1.0 + 3.0 / step as f64,"step_time_s":1.0,"rank":rank,"t_ms":t}))
                .unwrap();
        }
        if step % 50 == 0 {
            m.append(&serde_json::json!({"kind":"checkpoint","step":step,"bytes":1u64<<30,"stall_s":0.2,"persist_s":3.0,"commit_s":0.1,"bytes_written":1u64<<28,"bytes_skipped":0,"t_ms":t + 300}))
                .unwrap();
        }
    }
    m.flush().await.unwrap();
    m1.flush().await.unwrap();
    let mut e = LogWriter::new(&env.store, "train", EVENTS, "supervisor").unwrap();
    e.append(
        &serde_json::json!({"kind":"failure","rank":3,"node":1,"how":"signal","t_ms":t0 + 181_000}),
    )
    .unwrap();
    e.append(&serde_json::json!({"kind":"recovery","generation":1,"layout":"dp=1,tp=2,pp=1","step":150,"steps_lost":30,"t_ms":t0 + 239_000})).unwrap();
    e.append(&serde_json::json!({"kind":"spike","step":260,"loss":3.5,"action":"rollback","t_ms":t0 + 330_000})).unwrap();
    e.append(&serde_json::json!({"kind":"rollback","from_step":260,"to_step":250,"reason":"loss spike","t_ms":t0 + 331_000})).unwrap();
    e.flush().await.unwrap();

    let dir = tmp();
    let png = dir.path().join("loss.png");
    let r = plot(&env.store, &PlotArgs::new("train", &png), &q())
        .await
        .unwrap();
    assert_eq!(r.points, 300, "one rank's loss per step");
    assert_eq!(
        (
            r.checkpoints,
            r.failures,
            r.recoveries,
            r.rollbacks,
            r.spikes
        ),
        (6, 1, 1, 1, 1)
    );
    let b = std::fs::read(&png).unwrap();
    assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(u32::from_be_bytes(b[16..20].try_into().unwrap()), 1200);
    assert_eq!(u32::from_be_bytes(b[20..24].try_into().unwrap()), 720);
    let svg = dir.path().join("loss.svg");
    plot(&env.store, &PlotArgs::new("train", &svg), &q())
        .await
        .unwrap();
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<?xml") && s.trim_end().ends_with("</svg>"));
    for want in [
        "run train",
        "✕ rank 3 signal",
        "recovered dp=1,tp=2,pp=1 @150 (−30 steps)",
        "rollback 260→250",
        "checkpoint",
        "grad norm",
        "<polyline",
    ] {
        assert!(s.contains(want), "the SVG shows {want:?}");
    }
    // Keep a copy for people to look at.
    if let Ok(d) = std::env::var("CKPT_PLOT_SAMPLE_DIR") {
        let _ = std::fs::copy(&png, std::path::Path::new(&d).join("plot-sample.png"));
        let _ = std::fs::copy(&svg, std::path::Path::new(&d).join("plot-sample.svg"));
    }

    let out = dir.path().join("cli.png");
    let j = env
        .ckpt(&["plot", "train", "--out", out.to_str().unwrap(), "--json"])
        .code(0)
        .json();
    assert_eq!(j["format"], "png");
    assert!(out.exists());
    env.ckpt(&[
        "plot",
        "train",
        "--out",
        dir.path().join("x.jpg").to_str().unwrap(),
    ])
    .code(2);
    let r = env
        .ckpt(&["plot", "nosuch", "--out", out.to_str().unwrap()])
        .code(1);
    assert!(r.err.contains("no run named nosuch"), "{}", r.err);
    save_step(&env.store, "quiet", 1, false, &DedupIndex::new()).await;
    let r = env
        .ckpt(&["plot", "quiet", "--out", out.to_str().unwrap()])
        .code(1);
    assert!(
        r.err.contains("nothing to plot") && r.err.contains("no metrics log"),
        "{}",
        r.err
    );
}
