//! Decoders of what people and other processes hand the CLI and the supervisor, fuzzed:
//! safetensors import headers and files, `model.safetensors.index.json`, `RUN@STEP`, layout
//! strings, store URLs, sizes and durations, heartbeat datagrams and recovery/metrics log
//! lines. Each gets arbitrary input and structure-aware mutations of valid input, and must
//! return a clear error (naming what is wrong and where) or a correct value: never a panic,
//! never an allocation larger than the input justifies (measured with a counting allocator).
//!
//! Cases per test: `PROPTEST_CASES`, else a few thousand (CI); `scripts/fuzz.sh` runs 100,000.

use std::collections::BTreeMap;
use std::path::Path;

use ckpt::cli::import::{parse_header, read_file_header, read_index};
use ckpt::cli::shared::parse::{CkptRef, StepSel, duration, size};
use ckpt::recovery::driver::LossBoard;
use ckpt::recovery::heartbeat::Beat;
use ckpt_store::testing::fuzz::{apply, mutation};
use ckpt_store::testing::{BiggestAlloc, biggest_alloc, det_bytes, proptest_cases};
use ckpt_store::{DType, ErrorKind, Layout, Store, StoreUrl};
use futures::StreamExt as _;
use proptest::prelude::*;
use serde_json::{Value, json};

#[global_allocator]
static ALLOC: BiggestAlloc = BiggestAlloc;

/// The most one decoder call may allocate at once for an input of `len` bytes: a small
/// constant, plus a bounded factor of the input (JSON values are larger than their text).
fn justified(len: usize) -> usize {
    (64 << 10) + 64 * len
}

fn config(default: u32) -> ProptestConfig {
    ProptestConfig {
        cases: proptest_cases(default),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

// ----- safetensors import ------------------------------------------------------------------

const DTYPES: [&str; 6] = ["F32", "BF16", "F16", "I64", "U8", "F64"];

/// A valid safetensors header (as JSON) and its data length: tensors laid out back to back.
fn valid_header() -> impl Strategy<Value = (Value, u64)> {
    prop::collection::vec(
        (
            prop::sample::select(DTYPES.to_vec()),
            prop::collection::vec(0..5u64, 0..3),
        ),
        0..5,
    )
    .prop_map(|ts| {
        let mut obj = serde_json::Map::new();
        obj.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut at = 0u64;
        for (i, (dt, shape)) in ts.into_iter().enumerate() {
            let size = DType::from_safetensors_name(dt).unwrap().size() as u64;
            let n = shape.iter().product::<u64>() * size;
            obj.insert(
                format!("layers.{i}.w"),
                json!({"dtype": dt, "shape": shape, "data_offsets": [at, at + n]}),
            );
            at += n;
        }
        (Value::Object(obj), at)
    })
}

/// Values a hostile header puts where numbers, strings or arrays belong.
fn hostile_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u64>().prop_map(|v| json!(v)),
        Just(json!(u64::MAX)),
        Just(json!(-1)),
        Just(json!(1e300)),
        Just(json!(0.5)),
        Just(json!(null)),
        Just(json!("F32")),
        Just(json!("X9")),
        Just(json!([])),
        Just(json!([0, u64::MAX])),
        Just(json!([u64::MAX, 0])),
        Just(json!([1u64 << 32, 1u64 << 32, 1u64 << 32])),
        Just(json!({})),
        "[ -~]{0,12}".prop_map(|s| json!(s)),
    ]
}

/// A change to a header's structure: replace a field of a tensor, add or drop a tensor, rename.
#[derive(Debug, Clone)]
enum Edit {
    Field(usize, &'static str, Value),
    Remove(usize),
    Rename(usize, String),
    Copy(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    let field = prop::sample::select(vec!["dtype", "shape", "data_offsets", "extra"]);
    prop_oneof![
        4 => (any::<usize>(), field, hostile_value()).prop_map(|(i, f, v)| Edit::Field(i, f, v)),
        1 => any::<usize>().prop_map(Edit::Remove),
        1 => (any::<usize>(), prop_oneof![
            Just("".to_string()), Just("../x".to_string()), Just("a\u{1b}[2J".to_string()),
            Just("__metadata__".to_string()), "[a-z./]{1,8}"
        ]).prop_map(|(i, n)| Edit::Rename(i, n)),
        1 => any::<usize>().prop_map(Edit::Copy),
    ]
}

fn edit_header(h: &mut Value, e: &Edit) {
    let Value::Object(m) = h else { return };
    let keys: Vec<String> = m.keys().cloned().collect();
    if keys.is_empty() {
        return;
    }
    match e {
        Edit::Field(i, f, v) => {
            if let Some(Value::Object(t)) = m.get_mut(&keys[i % keys.len()]) {
                t.insert((*f).to_string(), v.clone());
            }
        }
        Edit::Remove(i) => {
            m.remove(&keys[i % keys.len()]);
        }
        Edit::Rename(i, n) => {
            if let Some(v) = m.remove(&keys[i % keys.len()]) {
                m.insert(n.clone(), v);
            }
        }
        Edit::Copy(i) => {
            if let Some(v) = m.get(&keys[i % keys.len()]).cloned() {
                m.insert(format!("copy.{i}"), v);
            }
        }
    }
}

/// What an accepted header must satisfy: every tensor inside the data, its bytes matching its
/// shape, no two overlapping, and every name a valid one.
fn check_tensors(tensors: &[ckpt::cli::import::StTensor], data_len: u64) {
    let mut spans: Vec<(u64, u64)> = Vec::new();
    for t in tensors {
        assert!(
            t.begin <= t.end && t.end <= data_len,
            "{t:?} outside {data_len}"
        );
        let n: u64 = t.shape.iter().product::<u64>() * t.dtype.size() as u64;
        assert_eq!(n, t.end - t.begin, "{t:?}");
        assert!(!t.name.chars().any(char::is_control), "{t:?}");
        if t.end > t.begin {
            spans.push((t.begin, t.end));
        }
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "overlap {w:?}");
    }
}

/// A safetensors file: length, header text, data.
fn st_file(header: &[u8], data_len: u64, seed: u64) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header);
    v.extend_from_slice(&det_bytes(seed, data_len as usize));
    v
}

proptest! {
    #![proptest_config(config(3000))]

    /// `parse_header` on arbitrary bytes, on bytes of mutated valid headers, and on valid
    /// headers with hostile fields: an error naming the file, or tensors that fit the data.
    #[test]
    fn import_header_fuzz(
        (header, data_len) in valid_header(),
        edits in prop::collection::vec(edit(), 0..3),
        muts in prop::collection::vec(mutation(), 0..3),
        raw in prop::collection::vec(any::<u8>(), 0..300),
        pick in 0..3u8,
        len_delta in prop_oneof![Just(0i64), -8..8i64, Just(i64::MAX)],
    ) {
        let mut h = header.clone();
        for e in &edits {
            edit_header(&mut h, e);
        }
        let mut text = match pick {
            0 => raw,
            _ => serde_json::to_vec(&h).unwrap(),
        };
        if pick == 2 {
            apply(&mut text, &muts);
        }
        let data_len = data_len.saturating_add_signed(len_delta);
        let path = Path::new("/models/hostile.safetensors");
        let (r, biggest) = biggest_alloc(|| parse_header(path, &text, data_len));
        prop_assert!(biggest <= justified(text.len()), "allocated {biggest} for {} bytes", text.len());
        match r {
            Ok((tensors, _meta)) => {
                check_tensors(&tensors, data_len);
                if edits.is_empty() && pick == 1 && len_delta == 0 {
                    prop_assert_eq!(tensors.len(), header.as_object().unwrap().len() - 1);
                }
            }
            Err(e) => prop_assert!(
                e.message().contains("/models/hostile.safetensors: "),
                "the error must name the file: {}", e
            ),
        }
    }

    /// `read_file_header` on real files: valid ones, mutated ones (header length, header
    /// bytes, truncation) and arbitrary bytes.
    #[test]
    fn import_file_fuzz(
        (header, data_len) in valid_header(),
        muts in prop::collection::vec(mutation(), 0..3),
        raw in prop::collection::vec(any::<u8>(), 0..200),
        use_raw in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let mut file = if use_raw {
            raw
        } else {
            st_file(&serde_json::to_vec(&header).unwrap(), data_len, seed)
        };
        apply(&mut file, &muts);
        std::fs::write(&path, &file).unwrap();
        let (r, biggest) = biggest_alloc(|| read_file_header(&path));
        prop_assert!(biggest <= justified(file.len()), "allocated {biggest} for {} bytes", file.len());
        match r {
            Ok(st) => {
                prop_assert!(st.data_start <= file.len() as u64);
                check_tensors(&st.tensors, file.len() as u64 - st.data_start);
                if muts.is_empty() && !use_raw {
                    prop_assert_eq!(st.tensors.len(), header.as_object().unwrap().len() - 1);
                    prop_assert_eq!(st.metadata, BTreeMap::from([("format".to_string(), "pt".to_string())]));
                }
            }
            Err(e) => {
                let shown = path.display().to_string();
                prop_assert!(e.message().contains(&shown), "the error must name the file: {}", e);
            }
        }
    }
}

// ----- model.safetensors.index.json --------------------------------------------------------

fn file_name() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => "model-0000[1-3]-of-00003\\.safetensors".prop_map(|s| json!(s)),
        1 => prop::sample::select(vec![
            "", ".", "..", "../secret.safetensors", "/etc/passwd", "a/b.safetensors",
            "a\\b", "x\u{0}y", "x\ny", "\u{1b}[31mred",
        ]).prop_map(|s| json!(s)),
        1 => hostile_value(),
    ]
}

proptest! {
    #![proptest_config(config(3000))]

    /// `read_index`: valid and hostile weight maps, mutated bytes, arbitrary bytes. Accepted
    /// files are plain names beside the index, each listed once with its tensors.
    #[test]
    fn import_index_fuzz(
        entries in prop::collection::vec(("[a-z.0-9]{1,10}", file_name()), 0..6),
        extra in prop_oneof![Just(None), hostile_value().prop_map(Some)],
        muts in prop::collection::vec(mutation(), 0..3),
        raw in prop::collection::vec(any::<u8>(), 0..200),
        pick in 0..3u8,
    ) {
        let mut map = serde_json::Map::new();
        for (t, f) in &entries {
            map.insert(t.clone(), f.clone());
        }
        let mut doc = json!({"metadata": {"total_size": 12}, "weight_map": map});
        let replaced = extra.is_some();
        if let Some(v) = extra {
            doc["weight_map"] = v;
        }
        let mut text = match pick {
            0 => raw,
            _ => serde_json::to_vec_pretty(&doc).unwrap(),
        };
        if pick == 2 {
            apply(&mut text, &muts);
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors.index.json");
        std::fs::write(&path, &text).unwrap();
        let (r, biggest) = biggest_alloc(|| read_index(&path));
        prop_assert!(biggest <= justified(text.len()), "allocated {biggest} for {} bytes", text.len());
        match r {
            Ok(files) => {
                let mut seen = std::collections::HashSet::new();
                for (f, tensors) in &files {
                    prop_assert_eq!(f.parent(), Some(dir.path()), "{:?} is not beside the index", f);
                    let name = f.file_name().unwrap().to_str().unwrap();
                    prop_assert!(!name.is_empty() && name != ".." && !name.contains(['/', '\\', '\0']));
                    prop_assert!(!name.chars().any(char::is_control), "{:?}", name);
                    prop_assert!(seen.insert(f.clone()), "{:?} listed twice", f);
                    prop_assert!(!tensors.is_empty());
                }
                if pick == 1 && !replaced && entries.iter().all(|(_, f)| f.as_str().is_some_and(|s| s.starts_with("model-"))) {
                    let n: usize = files.iter().map(|(_, t)| t.len()).sum();
                    prop_assert_eq!(n, map.len());
                }
            }
            Err(e) => {
                let shown = path.display().to_string();
                prop_assert!(e.message().contains(&shown), "the error must name the index: {}", e);
            }
        }
    }
}

// ----- what people type ----------------------------------------------------------------------

fn typed(parts: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        2 => any::<String>(),
        2 => "[ -~]{0,24}",
        4 => prop::collection::vec(
            prop_oneof![
                prop::sample::select(parts.to_vec()).prop_map(String::from),
                any::<u64>().prop_map(|v| v.to_string()),
                any::<u32>().prop_map(|v| v.to_string()),
                Just("18446744073709551616".to_string()),
                Just("9".repeat(400)),
                Just("-1".to_string()),
                Just("1e400".to_string()),
                Just(".".to_string()),
                Just(" ".to_string()),
                "[a-z0-9_-]{0,6}",
                Just("\u{0}".to_string()),
                Just("é".to_string()),
            ],
            0..8,
        ).prop_map(|v| v.concat()),
    ]
}

proptest! {
    #![proptest_config(config(5000))]

    /// `RUN@STEP`, `RUN@latest`, `RUN`: what parses prints back to itself; errors quote the
    /// input and say what is wrong.
    #[test]
    fn ckpt_ref_fuzz(s in typed(&["@", "latest", "llama", "run-1", "@@", "/", ".."])) {
        let (r, biggest) = biggest_alloc(|| s.parse::<CkptRef>());
        prop_assert!(biggest <= justified(s.len()));
        match r {
            Ok(c) => {
                ckpt_store::validate_run(&c.run).unwrap();
                let back: CkptRef = c.to_string().parse().unwrap();
                prop_assert_eq!(&back, &c);
                match c.step {
                    StepSel::Step(n) => {
                        prop_assert!(s.starts_with(&format!("{}@", c.run)), "{:?}", s);
                        prop_assert_eq!(s[c.run.len() + 1..].parse::<u64>().ok(), Some(n));
                    }
                    StepSel::Latest => {
                        let latest = format!("{}@latest", c.run);
                        prop_assert!(s == c.run || s == latest, "{:?}", s);
                    }
                }
            }
            Err(e) => {
                let quoted = format!("{s:?}");
                prop_assert!(e.message().contains(&quoted), "{}", e);
            }
        }
    }

    /// Layout strings (`dp=2,tp=2,pp=1,zero=1`): what parses is valid (its world size fits)
    /// and prints back to itself.
    #[test]
    fn layout_fuzz(s in typed(&["dp=", "tp=", "pp=", "zero=", ",", "=", "dp", " "])) {
        let (r, biggest) = biggest_alloc(|| s.parse::<Layout>());
        prop_assert!(biggest <= justified(s.len()));
        match r {
            Ok(l) => {
                l.validate().unwrap();
                prop_assert!(l.world() >= 1);
                let last = l.world() - 1;
                prop_assert_eq!(l.rank(l.coords(last)), last);
                prop_assert_eq!(l.to_string().parse::<Layout>().unwrap(), l);
            }
            Err(e) => {
                prop_assert_eq!(e.kind(), ErrorKind::InvalidInput);
                prop_assert!(e.message().starts_with("layout"), "{}", e);
            }
        }
    }

    /// Store URLs: a path, `file://`, `s3://bucket/prefix`, ... (parsed, never opened).
    #[test]
    fn store_url_fuzz(s in typed(&["s3://", "gs://", "az://", "file://", "memory://", "/", "://", "bucket", "%00", "s3a://"])) {
        let (r, biggest) = biggest_alloc(|| StoreUrl::parse(&s));
        prop_assert!(biggest <= justified(s.len()));
        match r {
            Ok(StoreUrl::S3 { bucket, prefix } | StoreUrl::Gcs { bucket, prefix }) => {
                prop_assert!(!bucket.is_empty());
                prop_assert!(!prefix.starts_with('/') && !prefix.ends_with('/'));
            }
            Ok(_) => {}
            Err(e) => {
                prop_assert_eq!(e.kind(), ErrorKind::InvalidInput);
                prop_assert!(!e.message().is_empty());
            }
        }
    }

    /// Sizes (`2GiB`) and durations (`1h30m`): a value in range, or an error quoting the input.
    #[test]
    fn size_and_duration_fuzz(s in typed(&["KiB", "GB", "b", "ms", "s", "m", "h", "d", "1", "0", ".5", "mins"])) {
        let (r, biggest) = biggest_alloc(|| (size(&s), duration(&s)));
        prop_assert!(biggest <= justified(s.len()));
        let quoted = format!("{:?}", s);
        if let Err(e) = r.0 {
            prop_assert!(e.contains(&quoted), "{}", e);
        }
        if let Err(e) = r.1 {
            prop_assert!(e.contains(&quoted) || e.starts_with("empty duration"), "{}", e);
        }
    }
}

// ----- heartbeats and logs -------------------------------------------------------------------

fn beat_json() -> impl Strategy<Value = Vec<u8>> {
    let num = prop_oneof![
        any::<u64>().prop_map(|v| v.to_string()),
        Just(u128::MAX.to_string()),
        Just("340282366920938463463374607431768211456".to_string()),
        Just("-5".to_string()),
        "[0-9]{0,45}",
        "[ -~]{0,8}",
    ];
    (
        any::<u64>(),
        0..4u32,
        0..3u64,
        num.clone(),
        num,
        prop_oneof![any::<u64>(), Just(u64::MAX), 0..10u64],
    )
        .prop_map(|(g, r, s, sse, gsq, n)| {
            serde_json::to_vec(&json!({"generation": g % 3, "rank": r, "step": s, "workload": {
                "sums": {"sse": sse, "gsq": gsq, "n": n.to_string()},
                "figures": [
                    {"curve": "loss", "sum": "sse", "per": "n", "scale": 1099511627776.0},
                    {"curve": "grad_norm", "sum": "gsq", "scale": 1099511627776.0, "sqrt": true},
                ],
            }}))
            .unwrap()
        })
}

proptest! {
    #![proptest_config(config(2000))]

    /// Heartbeat datagrams (any local process can send them to the supervisor's socket):
    /// decoded, then summed into the loss board exactly as the supervisor does. Hostile sums
    /// and counts never panic (overflow) and never stop the board.
    #[test]
    fn heartbeat_fuzz(
        beats in prop::collection::vec(prop_oneof![
            3 => beat_json(),
            1 => prop::collection::vec(any::<u8>(), 0..120),
        ], 1..12),
        muts in prop::collection::vec(mutation(), 0..2),
        world in 1..4u32,
    ) {
        let rt = runtime();
        let store = Store::memory();
        let mut board = LossBoard::new(&store, "hb", "supervisor").unwrap();
        for (i, mut datagram) in beats.into_iter().enumerate() {
            if i == 0 {
                apply(&mut datagram, &muts);
            }
            let (b, biggest) = biggest_alloc(|| serde_json::from_slice::<Beat>(&datagram));
            prop_assert!(biggest <= justified(datagram.len()));
            if let Ok(b) = b
                && let Some(w) = &b.workload
            {
                rt.block_on(board.add(b.generation, b.step, w, world)).unwrap();
            }
        }
        rt.block_on(board.flush());
        // Whatever was logged reads back.
        let recs = rt.block_on(ckpt_store::logs::read_log(&store, "hb", ckpt_store::logs::METRICS)).unwrap();
        for r in recs {
            prop_assert!(r["loss"].is_number() || r["loss"].is_null(), "{}", r);
        }
    }

    /// Log parts (the recovery log, metrics): arbitrary and mutated parts. Damaged lines are
    /// skipped, intact ones read back; nothing panics.
    #[test]
    fn recovery_log_fuzz(
        records in prop::collection::vec((any::<u64>(), any::<i64>(), "[ -~]{0,10}"), 1..6),
        muts in prop::collection::vec(mutation(), 0..3),
        raw in prop::collection::vec(any::<u8>(), 0..300),
        use_raw in any::<bool>(),
    ) {
        let rt = runtime();
        let store = Store::memory();
        let mut w = ckpt_store::logs::LogWriter::new(&store, "r", ckpt_store::logs::EVENTS, "supervisor").unwrap();
        for (step, t, what) in &records {
            w.append(&json!({"kind": "failure", "step": step, "t_ms": t, "detail": what})).unwrap();
        }
        rt.block_on(w.flush()).unwrap();
        // The one part the writer wrote (its name carries the writer's start time).
        let dir = store.keys().log_dir("r", ckpt_store::logs::EVENTS);
        let key = rt
            .block_on(store.object_store().list(Some(&dir)).next())
            .expect("a log part")
            .unwrap()
            .location;
        let orig = rt.block_on(store.objects().get_object(&key)).unwrap().to_vec();
        let mut part = if use_raw { raw } else { orig.clone() };
        apply(&mut part, &muts);
        rt.block_on(store.objects().put_object(&key, vec![part.clone().into()], ckpt_store::object_store::PutMode::Overwrite)).unwrap();
        let (got, biggest) = biggest_alloc(|| rt.block_on(ckpt_store::logs::read_log(&store, "r", ckpt_store::logs::EVENTS)));
        prop_assert!(biggest <= justified(part.len()));
        let got = got.unwrap();
        let lines = part.split(|&c| c == b'\n').filter(|l| !l.iter().all(u8::is_ascii_whitespace)).count();
        prop_assert!(got.len() <= lines);
        if part == orig {
            prop_assert_eq!(got.len(), records.len());
        }
    }
}
