//! The replica agent's frame decoder (`ckpt_recovery::peer::read_frame` and `read_chunk_body`,
//! what an agent runs on every authenticated connection) fed arbitrary bytes and mutated valid
//! frame streams: a clear error or the frames that were sent, never a panic, and never an
//! allocation larger than the bytes read justify (a counting allocator watches every
//! allocation the decoder makes). `PROPTEST_CASES` sets the number of cases (3000 by default).

use bytes::Bytes;
use ckpt_recovery::peer::{
    Frame, MAX_CHUNK, Membership, begin_frame, chunk_head, end_frame, held_frame, read_chunk_body,
    read_frame,
};
use ckpt_store::testing::{BiggestAlloc, biggest_alloc, proptest_cases};
use ckpt_store::{ChunkId, ErrorKind};
use proptest::prelude::*;

#[global_allocator]
static ALLOC: BiggestAlloc = BiggestAlloc;

// ---------------------------------------------------------------------------------------
// Decoding a stream as an agent does.

/// A decoded frame with its chunk's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Got {
    Frame(Frame),
    Chunk(u32, Bytes),
}

/// The output of a future that reads a byte slice (it never waits).
fn now<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("reading a byte slice waited"),
    }
}

/// Decode `input` frame by frame as the agent's connection loop does (an `E` frame may list as
/// many ids as its snapshot had chunks); the largest allocation the decoder made.
fn decode(input: &[u8]) -> (ckpt_store::Result<Vec<Got>>, usize) {
    let mut r = input;
    let mut out = Vec::new();
    let mut chunks = 0usize;
    let mut largest = 0usize;
    let res = loop {
        let (f, n) = biggest_alloc(|| now(read_frame(&mut r, chunks)));
        largest = largest.max(n);
        let f = match f {
            Ok(Some(f)) => f,
            Ok(None) => break Ok(out),
            Err(e) => break Err(e),
        };
        match f {
            Frame::Begin { .. } | Frame::End { .. } | Frame::Abandon => chunks = 0,
            Frame::Held { .. } => {}
            Frame::Chunk { seq, len } => {
                let (b, n) = biggest_alloc(|| now(read_chunk_body(&mut r, len)));
                largest = largest.max(n);
                match b {
                    Ok(b) => {
                        assert_eq!(b.len() as u64, len, "a chunk of the length its header says");
                        out.push(Got::Chunk(seq, b));
                        chunks += 1;
                        continue;
                    }
                    Err(e) => break Err(e),
                }
            }
            _ => {}
        }
        out.push(Got::Frame(f));
    };
    (res, largest)
}

/// What the decoder may allocate for `input`: a first chunk buffer step (4 KiB), then at most
/// four times the bytes that arrived (buffers double as they fill; an id list's first
/// reservation is bounded by the chunks its snapshot carried).
fn allowed(input: &[u8]) -> usize {
    4096 + 4 * input.len()
}

fn check(input: &[u8]) -> ckpt_store::Result<Vec<Got>> {
    let (res, largest) = decode(input);
    assert!(
        largest <= allowed(input),
        "the decoder allocated {largest} bytes for {} bytes of input",
        input.len()
    );
    if let Err(e) = &res {
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert!(!e.to_string().is_empty());
    }
    res
}

// ---------------------------------------------------------------------------------------
// Valid streams and their mutations.

/// A frame a client sends, with a chunk's bytes.
#[derive(Debug, Clone)]
enum Send {
    Snapshot {
        node: u32,
        rank: u32,
        generation: u64,
        step: u64,
        chunks: Vec<Vec<u8>>,
        /// Ids of chunks named unchanged (a `K` frame before the end, when any).
        held: Vec<[u8; 32]>,
        end: bool,
    },
    Get([u8; 32]),
    Holdings,
    Local,
}

fn send() -> impl Strategy<Value = Send> {
    prop_oneof![
        3 => (
            any::<u32>(),
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
            prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 0..6),
            prop::collection::vec(any::<[u8; 32]>(), 0..4),
            prop::bool::weighted(0.8),
        )
            .prop_map(|(node, rank, generation, step, chunks, held, end)| Send::Snapshot {
                node,
                rank,
                generation,
                step,
                chunks,
                held,
                end,
            }),
        1 => any::<[u8; 32]>().prop_map(Send::Get),
        1 => Just(Send::Holdings),
        1 => Just(Send::Local),
    ]
}

/// The bytes of `sends` and the frames an agent must decode from them.
fn encode(sends: &[Send]) -> (Vec<u8>, Vec<Got>) {
    let mut bytes = Vec::new();
    let mut want = Vec::new();
    for s in sends {
        match s {
            Send::Snapshot {
                node,
                rank,
                generation,
                step,
                chunks,
                held,
                end,
            } => {
                bytes.extend_from_slice(&begin_frame(*node, *rank, *generation, *step));
                want.push(Got::Frame(Frame::Begin {
                    node: *node,
                    rank: *rank,
                    generation: *generation,
                    step: *step,
                }));
                for (i, c) in chunks.iter().enumerate() {
                    bytes.extend_from_slice(&chunk_head(i as u32, c.len()));
                    bytes.extend_from_slice(c);
                    want.push(Got::Chunk(i as u32, Bytes::from(c.clone())));
                }
                if !held.is_empty() {
                    let ids: Vec<ChunkId> =
                        held.iter().map(|h| ChunkId(ckpt_store::Hash(*h))).collect();
                    bytes.extend_from_slice(&held_frame(&ids));
                    want.push(Got::Frame(Frame::Held { ids }));
                }
                if *end {
                    let ids: Vec<ChunkId> = chunks.iter().map(|c| ChunkId::of(c)).collect();
                    bytes.extend_from_slice(&end_frame(&ids));
                    want.push(Got::Frame(Frame::End { ids }));
                } else {
                    bytes.push(b'A');
                    want.push(Got::Frame(Frame::Abandon));
                }
            }
            Send::Get(id) => {
                bytes.push(b'G');
                bytes.extend_from_slice(id);
                want.push(Got::Frame(Frame::Get(ChunkId(ckpt_store::Hash(*id)))));
            }
            Send::Holdings => {
                bytes.push(b'S');
                want.push(Got::Frame(Frame::Holdings));
            }
            Send::Local => {
                bytes.push(b'L');
                want.push(Got::Frame(Frame::Local));
            }
        }
    }
    (bytes, want)
}

/// A change to a stream: flip bits, overwrite a little-endian field with a hostile value
/// (lengths and counts), insert a byte, or cut it.
#[derive(Debug, Clone)]
enum Mutation {
    Xor(usize, u8),
    Put32(usize, u32),
    Put64(usize, u64),
    Insert(usize, u8),
    Truncate(usize),
}

fn hostile_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0),
        Just(u64::MAX),
        Just(MAX_CHUNK),
        Just(MAX_CHUNK + 1),
        Just(u32::MAX as u64),
        0..1000u64,
        any::<u64>(),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 1..=255u8).prop_map(|(i, x)| Mutation::Xor(i, x)),
        2 => (any::<usize>(), prop_oneof![any::<u32>(), 0..2000u32, Just(u32::MAX)])
            .prop_map(|(i, v)| Mutation::Put32(i, v)),
        2 => (any::<usize>(), hostile_u64()).prop_map(|(i, v)| Mutation::Put64(i, v)),
        1 => (any::<usize>(), prop::sample::select(b"BCEAGSYNHK\0".to_vec()))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn apply(obj: &mut Vec<u8>, muts: &[Mutation]) {
    for m in muts {
        if obj.is_empty() {
            return;
        }
        let n = obj.len();
        let mut put = |i: usize, b: &[u8]| {
            let i = i % n;
            let k = b.len().min(n - i);
            obj[i..i + k].copy_from_slice(&b[..k]);
        };
        match *m {
            Mutation::Xor(i, x) => obj[i % n] ^= x,
            Mutation::Put32(i, v) => put(i, &v.to_le_bytes()),
            Mutation::Put64(i, v) => put(i, &v.to_le_bytes()),
            Mutation::Insert(i, b) => obj.insert(i % (n + 1), b),
            Mutation::Truncate(i) => obj.truncate(i % n),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: proptest_cases(3000), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_frame_decoder_takes_arbitrary_bytes(
        input in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..400),
            // Valid opcodes followed by anything: reach the length and count checks.
            (prop::sample::select(b"BCEAGS".to_vec()), prop::collection::vec(any::<u8>(), 0..400))
                .prop_map(|(op, mut rest)| { rest.insert(0, op); rest }),
        ],
    ) {
        let _ = check(&input);
    }

    #[test]
    fn the_frame_decoder_returns_what_was_sent_and_survives_mutations(
        sends in prop::collection::vec(send(), 0..6),
        muts in prop::collection::vec(mutation(), 1..4),
    ) {
        let (bytes, want) = encode(&sends);
        let got = check(&bytes).expect("a valid stream decodes");
        prop_assert_eq!(got, want);
        let mut bad = bytes.clone();
        apply(&mut bad, &muts);
        // Anything decoded from a mutated stream is a well-formed frame (lengths and counts
        // within their bounds); the rest is a clear error.
        if let Ok(frames) = check(&bad) {
            for f in frames {
                match f {
                    Got::Frame(Frame::Chunk { len, .. }) => prop_assert!(len <= MAX_CHUNK),
                    Got::Chunk(_, b) => prop_assert!(b.len() as u64 <= MAX_CHUNK),
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn an_end_frame_lists_no_more_ids_than_its_snapshot_had_chunks(
        chunks in 0..4usize,
        extra in 1..u32::MAX,
    ) {
        let mut bytes = begin_frame(0, 0, 1, 1);
        for i in 0..chunks {
            bytes.extend_from_slice(&chunk_head(i as u32, 1));
            bytes.push(i as u8);
        }
        let claimed = (chunks as u32).saturating_add(extra);
        bytes.push(b'E');
        bytes.extend_from_slice(&claimed.to_le_bytes());
        let e = check(&bytes).unwrap_err();
        prop_assert!(e.to_string().contains("chunk ids for a snapshot of"), "{}", e);
    }

    #[test]
    fn membership_lines_parse_or_fail_clearly(line in ".{0,120}", node in 0..4u32) {
        match Membership::parse_line(node, &line) {
            Ok(m) => prop_assert!(m.generation.is_some()),
            Err(e) => prop_assert!(e.to_string().contains("membership line"), "{}", e),
        }
    }
}

#[test]
fn a_huge_chunk_length_is_refused_before_any_allocation() {
    let mut bytes = begin_frame(0, 0, 1, 1);
    bytes.extend_from_slice(&chunk_head(0, 0)[..5]);
    bytes.extend_from_slice(&(MAX_CHUNK + 1).to_le_bytes());
    let e = check(&bytes).unwrap_err();
    assert!(e.to_string().contains("more than any chunk"), "{e}");
    // A length within bounds that the stream does not back: cut short, little allocated.
    let mut bytes = begin_frame(0, 0, 1, 1);
    bytes.extend_from_slice(&chunk_head(0, MAX_CHUNK as usize));
    bytes.extend_from_slice(&[7; 100]);
    let e = check(&bytes).unwrap_err();
    assert!(e.to_string().contains("cut short"), "{e}");
}
