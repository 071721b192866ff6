//! Interop with the reference implementation: tensors that Python's `safetensors` (numpy)
//! writes import and export byte-identically, and what `ckpt export` writes loads in Python
//! with equal values, for every dtype both support (numpy has no bf16 or fp8; those are
//! checked against the Rust reference parser in tests/cli.rs).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{Env, local, s3, tmp};

macro_rules! on_both {
    ($($case:ident),* $(,)?) => {
        mod on_local { use ckpt_store::{require, testing::Need}; $( #[test] fn $case() { require!(Need::Python, stringify!($case)); super::$case(super::local()) } )* }
        mod on_s3 { use ckpt_store::{require, testing::Need}; $( #[test] fn $case() { require!(Need::Python, stringify!($case)); require!(Need::S3Server, concat!(stringify!($case), " on S3")); super::$case(super::s3()) } )* }
    };
}

on_both!(python_files_round_trip_through_ckpt);

/// The Python with safetensors and numpy (each test checks `Need::Python` first).
fn python() -> PathBuf {
    ckpt_store::testing::find_python().expect("checked by the test")
}

fn py(args: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop_python.py");
    let out = Command::new(python())
        .arg(script)
        .args(args)
        .output()
        .expect("running python");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && stdout.starts_with("OK"),
        "python {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn python_files_round_trip_through_ckpt(env: Env) {
    let dir = tmp();
    let d = dir.path();
    py(&["gen", s(d)]);
    let reference = d.join("ref.safetensors");

    let j = env
        .ckpt(&[
            "import",
            s(&reference),
            "--run",
            "py",
            "--step",
            "1",
            "--json",
        ])
        .code(0)
        .json();
    assert_eq!(j["tensors"], 18);
    let out = d.join("out");
    env.ckpt(&["export", "py@1", "--out", s(&out)]).code(0);

    // Byte-identical tensors, checked with the Rust reference parser.
    let a = std::fs::read(&reference).unwrap();
    let b = std::fs::read(out.join("model.safetensors")).unwrap();
    let (sa, sb) = (
        safetensors::SafeTensors::deserialize(&a).unwrap(),
        safetensors::SafeTensors::deserialize(&b).unwrap(),
    );
    assert_eq!(sa.len(), sb.len());
    for (name, ta) in sa.tensors() {
        let tb = sb.tensor(&name).unwrap();
        assert_eq!(ta.dtype(), tb.dtype(), "{name}");
        assert_eq!(ta.shape(), tb.shape(), "{name}");
        assert!(ta.data() == tb.data(), "{name}: bytes differ");
    }
    // ... and Python reads them back equal.
    py(&["check", s(&reference), s(&out.join("model.safetensors"))]);

    // Converted to f32: Python sees the values numpy's astype gives.
    let out32 = d.join("out32");
    env.ckpt(&["export", "py@1", "--out", s(&out32), "--dtype", "f32"])
        .code(0);
    py(&[
        "check",
        s(&reference),
        s(&out32.join("model.safetensors")),
        "--as",
        "float32",
    ]);

    // Sharded the Hugging Face way: Python loads every shard the index names.
    let shards = d.join("shards");
    let j = env
        .ckpt(&[
            "export",
            "py@1",
            "--out",
            s(&shards),
            "--max-shard-size",
            "16KiB",
            "--json",
        ])
        .code(0)
        .json();
    assert!(j["files"].as_array().unwrap().len() >= 3);
    py(&[
        "check-index",
        s(&reference),
        s(&shards.join("model.safetensors.index.json")),
    ]);

    // Python's own sharded files and index import to the same tensors, which the store
    // already holds.
    let j = env
        .ckpt(&[
            "import",
            s(&d.join("py.safetensors.index.json")),
            "--run",
            "py",
            "--step",
            "2",
            "--json",
        ])
        .code(0)
        .json();
    assert_eq!(j["files"].as_array().unwrap().len(), 2);
    assert_eq!(j["bytes_skipped"], j["logical_bytes"], "{j}");
    let out2 = d.join("out2");
    env.ckpt(&["export", "py@2", "--out", s(&out2)]).code(0);
    py(&["check", s(&reference), s(&out2.join("model.safetensors"))]);
    env.ckpt(&["diff", "py@1", "py@2"]).code(0);
    let j = env.ckpt(&["diff", "py@1", "py@2", "--json"]).code(0).json();
    assert_eq!(j["changed"].as_array().unwrap().len(), 0);
    assert_eq!(j["unchanged"], 18);
}
