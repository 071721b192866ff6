use super::delta::ESTIMATE_WINDOW;
use super::*;

/// `n` draws of N(0, 0.02) as f32: weights.
fn normals(n: usize, seed: u64) -> Vec<f32> {
    // Box-Muller over a splitmix stream.
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u1, u2) = (next().max(1e-300), next());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos() * 0.02) as f32
        })
        .collect()
}

fn normal_bf16(n: usize, seed: u64) -> Vec<u8> {
    normals(n, seed)
        .iter()
        .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

fn normal_f32(n: usize, seed: u64) -> Vec<u8> {
    normals(n, seed)
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect()
}

fn round_trip(data: &[u8], elem: usize, policy: CodecPolicy) -> Codec {
    let b = Bytes::copy_from_slice(data);
    let enc = encode(&b, elem, policy);
    let obj = enc.to_bytes();
    let id = ChunkId::of(data);
    let back = decode(&obj, &id, data.len() as u64, &"test").unwrap();
    assert_eq!(back, data);
    enc.codec
}

#[test]
fn every_codec_round_trips() {
    let w = normal_bf16(50_000, 1);
    assert_eq!(round_trip(&w, 2, CodecPolicy::FAST), Codec::Planes);
    assert_eq!(round_trip(&w, 2, CodecPolicy::Raw), Codec::Raw);
    let zeros = vec![0u8; 100_000];
    assert_eq!(round_trip(&zeros, 1, CodecPolicy::FAST), Codec::Zstd);
    assert_eq!(round_trip(&zeros, 4, CodecPolicy::MAX), Codec::Planes);
    assert_eq!(round_trip(&[], 1, CodecPolicy::FAST), Codec::Raw);
    assert_eq!(round_trip(&[7u8; 3], 2, CodecPolicy::FAST), Codec::Raw);
    // A length that is not a multiple of the element size cannot use planes.
    assert_eq!(
        round_trip(&zeros[..99_999], 2, CodecPolicy::FAST),
        Codec::Zstd
    );
    for elem in [4, 8] {
        let d: Vec<u8> = (0..80_000u32)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect();
        round_trip(&d[..d.len() / elem * elem], elem, CodecPolicy::FAST);
    }
}

#[test]
fn incompressible_data_is_stored_raw() {
    let mut s = 12345u64;
    let d: Vec<u8> = (0..200_000)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    assert_eq!(round_trip(&d, 1, CodecPolicy::MAX), Codec::Raw);
    assert_eq!(round_trip(&d, 4, CodecPolicy::MAX), Codec::Raw);
}

#[test]
fn bf16_weights_compress_with_planes() {
    let w = normal_bf16(1 << 20, 7);
    let enc = encode(&Bytes::from(w.clone()), 2, CodecPolicy::FAST);
    let ratio = enc.len() as f64 / w.len() as f64;
    assert_eq!(enc.codec, Codec::Planes);
    assert!(ratio < 0.75, "bf16 byte planes ratio {ratio}");
}

#[test]
fn damage_is_named() {
    let w = normal_bf16(10_000, 3);
    let id = ChunkId::of(&w);
    let obj = encode(&Bytes::from(w.clone()), 2, CodecPolicy::FAST).to_bytes();
    let n = w.len() as u64;

    // Flipped byte in the payload: zstd error or hash mismatch, never silent.
    let mut bad = obj.to_vec();
    let last = bad.len() - 1;
    bad[last] ^= 0x40;
    let e = decode(&bad, &id, n, &"chunk X").unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Corrupt);
    assert!(e.to_string().starts_with("chunk X:"), "{e}");

    // Truncated.
    let e = decode(&obj[..obj.len() / 2], &id, n, &"chunk X").unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Corrupt, "{e}");
    let e = decode(&obj[..5], &id, n, &"chunk X").unwrap_err();
    assert!(e.to_string().contains("too short"), "{e}");

    // Garbage.
    let e = decode(b"this is not a chunk at all", &id, n, &"chunk X").unwrap_err();
    assert!(e.to_string().contains("bad magic"), "{e}");

    // A header claiming a terabyte is refused before allocating.
    let mut tb = obj.to_vec();
    tb[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let e = decode_verify(&tb, &id, &"chunk X").unwrap_err();
    assert!(e.to_string().contains("claims 1099511627776 bytes"), "{e}");

    // Length disagreeing with the manifest.
    let e = decode(&obj, &id, n + 1, &"chunk X").unwrap_err();
    assert!(e.to_string().contains("manifest expects"), "{e}");

    // Raw chunk with a flipped byte: caught by the hash.
    let raw = encode(&Bytes::from(w.clone()), 2, CodecPolicy::Raw).to_bytes();
    let mut bad = raw.to_vec();
    bad[100] ^= 1;
    let e = decode(&bad, &id, n, &"chunk X").unwrap_err();
    assert!(e.to_string().contains("content hash"), "{e}");
    // The same through `decode_bytes`, which hands a raw chunk out without a copy.
    let got = decode_bytes(raw.clone(), &id, n, &"chunk X").unwrap();
    assert!(got == w && got.as_ptr() == raw[HEADER_LEN..].as_ptr());
    let e = decode_bytes(Bytes::from(bad), &id, n, &"chunk X").unwrap_err();
    assert!(e.to_string().contains("content hash"), "{e}");
    let e = decode_bytes(raw.slice(..raw.len() - 1), &id, n, &"chunk X").unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");
    assert!(decode_bytes(obj.clone(), &id, n, &"chunk X").unwrap() == w);
}

/// Byte `k` of element `i` of `data` after rotating the element left by `r` bits: what
/// plane `k` holds at `i`, computed one element at a time.
fn plane_byte(data: &[u8], elem: usize, r: u32, i: usize, k: usize) -> u8 {
    let mut v = [0u8; 8];
    v[..elem].copy_from_slice(&data[i * elem..(i + 1) * elem]);
    let w = u64::from_le_bytes(v);
    let bits = 8 * elem as u32;
    let mask = if bits == 64 {
        u64::MAX
    } else {
        (1 << bits) - 1
    };
    let rot = if r == 0 {
        w
    } else {
        ((w << r) | (w >> (bits - r))) & mask
    };
    (rot >> (8 * k)) as u8
}

#[test]
fn plane_kernels_match_the_element_at_a_time_definition() {
    // Lengths around the kernels' block: whole blocks, a tail, a tail alone.
    for elem in [2usize, 4, 8] {
        for n in [0, 1, 63, 64, 65, 64 * 3 + 5, 1000] {
            let d: Vec<u8> = (0..n * elem)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
                .collect();
            for rotate in [false, true] {
                let planes = split_planes(&d, elem, rotate);
                for (k, p) in planes.iter().enumerate() {
                    assert_eq!(p.len(), n);
                    for (i, b) in p.iter().enumerate() {
                        let want = plane_byte(&d, elem, u32::from(rotate), i, k);
                        assert_eq!(
                            *b, want,
                            "elem {elem} n {n} rotate {rotate} plane {k} at {i}"
                        );
                    }
                }
                let refs: Vec<&[u8]> = planes.iter().map(Vec::as_slice).collect();
                let mut out = vec![0xa5u8; d.len()];
                join_planes(&refs, &mut out, rotate);
                assert!(out == d, "elem {elem} n {n} rotate {rotate}: join");
            }
        }
    }
}

#[test]
fn planes_split_and_join_are_inverse() {
    for elem in [2usize, 4, 8] {
        let d: Vec<u8> = (0..(elem * 37)).map(|i| (i * 7) as u8).collect();
        for rotate in [false, true] {
            let planes = split_planes(&d, elem, rotate);
            if !rotate {
                assert_eq!(planes[1][0], d[1]);
            }
            let refs: Vec<&[u8]> = planes.iter().map(Vec::as_slice).collect();
            let mut out = vec![0u8; d.len()];
            join_planes(&refs, &mut out, rotate);
            assert_eq!(out, d);
        }
        // Rotated bf16/f32: the top plane is the exponent.
        if elem == 4 {
            let x = (-1.5f32).to_le_bytes();
            let p = split_planes(&x, 4, true);
            assert_eq!(p[3][0], ((-1.5f32).to_bits() >> 23) as u8);
        }
    }
}

/// The block kernels (SSE2 on x86-64 for 2- and 4-byte elements, the portable ones for the
/// rest and every tail) join and XOR exactly what an element-at-a-time reference does, at
/// lengths around every block size.
#[test]
fn plane_kernels_match_a_reference_at_every_length() {
    let reference = |planes: &[Vec<u8>], rotated: bool, i: usize| -> u64 {
        let elem = planes.len();
        let w = (0..elem).fold(0u64, |w, k| w | (planes[k][i] as u64) << (8 * k));
        match rotated {
            false => w,
            true => (w >> 1) | ((w & 1) << (8 * elem - 1)),
        }
    };
    for elem in [2usize, 4, 8] {
        for n in [0usize, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1000, 4099] {
            let planes: Vec<Vec<u8>> = (0..elem)
                .map(|k| (0..n).map(|i| (i * 31 + k * 101 + i / 7) as u8).collect())
                .collect();
            let refs: Vec<&[u8]> = planes.iter().map(Vec::as_slice).collect();
            // Every kernel this CPU has (portable, SSE2, AVX2), then the one `join_planes`
            // picks.
            let kernels = planes::Kernel::available().into_iter().map(Some);
            for (kernel, rotated) in kernels.chain([None]).flat_map(|k| [(k, false), (k, true)]) {
                let mut out = vec![0xEEu8; n * elem];
                let base: Vec<u8> = (0..n * elem).map(|i| (i * 13) as u8).collect();
                let mut xored = base.clone();
                match kernel {
                    Some(k) => {
                        planes::join_planes_by::<false>(k, &refs, &mut out, rotated);
                        planes::join_planes_by::<true>(k, &refs, &mut xored, rotated);
                    }
                    None => {
                        join_planes(&refs, &mut out, rotated);
                        planes::xor_planes_into(&refs, &mut xored, rotated);
                    }
                }
                for i in 0..n {
                    let want = reference(&planes, rotated, i).to_le_bytes();
                    let at = i * elem..(i + 1) * elem;
                    assert_eq!(
                        out[at.clone()],
                        want[..elem],
                        "join ({kernel:?}): {elem} bytes, {n}, {i}"
                    );
                    let x: Vec<u8> = base[at.clone()]
                        .iter()
                        .zip(&want)
                        .map(|(b, w)| b ^ w)
                        .collect();
                    assert_eq!(xored[at], x[..], "xor ({kernel:?}): {elem} bytes, {n}, {i}");
                }
            }
        }
    }
}

#[test]
fn deltas_round_trip_and_check_their_base() {
    // bf16 weights and the same after a small update of every element.
    let a = normal_bf16(50_000, 11);
    let b: Vec<u8> = a
        .chunks_exact(2)
        .enumerate()
        .flat_map(|(i, c)| {
            let v = u16::from_le_bytes([c[0], c[1]]);
            let v = if i % 3 == 0 { v ^ 1 } else { v };
            v.to_le_bytes()
        })
        .collect();
    let (ia, ib) = (ChunkId::of(&a), ChunkId::of(&b));
    let d = encode_delta(&b, &a, &ia, 2, 1);
    assert_eq!(d.codec, Codec::Delta);
    let plain = encode(&Bytes::from(b.clone()), 2, CodecPolicy::FAST);
    assert!(d.len() * 4 < plain.len(), "{} vs {}", d.len(), plain.len());
    let obj = d.to_bytes();
    assert_eq!(obj[4], CHUNK_FORMAT_DELTA);
    assert_eq!(delta_base(&obj, &"d").unwrap(), Some(ia));
    let n = b.len() as u64;
    assert_eq!(decode_delta(&obj, &ib, n, &ia, &a, &"d").unwrap(), b);
    assert_eq!(check_delta_structure(&obj, &"d").unwrap(), n);
    // Without its base a delta does not decode; with the wrong one the hash says so.
    let e = decode(&obj, &ib, n, &"d").unwrap_err();
    assert!(e.to_string().contains("without its base"), "{e}");
    let e = decode_delta(&obj, &ib, n, &ib, &b, &"d").unwrap_err();
    assert!(e.to_string().contains("names base"), "{e}");
    let mut other = a.clone();
    other[7] ^= 0x10;
    let e = decode_delta(&obj, &ib, n, &ia, &other, &"d").unwrap_err();
    assert!(e.to_string().contains("content hash"), "{e}");
    // A delta header in a format 1 object, or a format 2 object of another codec: damaged.
    let mut bad = obj.to_vec();
    bad[4] = CHUNK_FORMAT;
    assert!(parse_header(&bad, &"d").is_err());
    let mut bad = plain.to_bytes().to_vec();
    bad[4] = CHUNK_FORMAT_DELTA;
    assert!(parse_header(&bad, &"d").is_err());
    // Truncated.
    assert!(decode_delta(&obj[..40], &ib, n, &ia, &a, &"d").is_err());
    assert!(delta_base(&obj[..20], &"d").is_err());
}

#[test]
fn a_chain_decodes_in_one_pass_and_a_damaged_level_is_named() {
    // Three saves of the same bf16 region: a plain base and two deltas on it.
    let a = normal_bf16(60_000, 5);
    let step = |d: &[u8], every: usize| -> Vec<u8> {
        d.chunks_exact(2)
            .enumerate()
            .flat_map(|(i, c)| {
                let v = u16::from_le_bytes([c[0], c[1]]);
                let v = if i % every == 0 { v ^ 3 } else { v };
                v.to_le_bytes()
            })
            .collect()
    };
    let b = step(&a, 3);
    let c = step(&b, 5);
    let (ia, ib, ic) = (ChunkId::of(&a), ChunkId::of(&b), ChunkId::of(&c));
    let pa = encode(&Bytes::from(a.clone()), 2, CodecPolicy::FAST).to_bytes();
    assert_eq!(
        pa[5],
        Codec::Planes.tag(),
        "the base is stored as byte planes"
    );
    let db = encode_delta(&b, &a, &ia, 2, 1).to_bytes();
    let dc = encode_delta(&c, &b, &ib, 2, 1).to_bytes();
    let names: Vec<String> = ["top", "middle", "base"].map(String::from).to_vec();
    let ids = [ic, ib, ia];
    let n = c.len() as u64;
    let got = decode_chain(&[&dc, &db, &pa], &ids, n, &names).unwrap();
    assert!(got == c, "the chain decodes to the newest bytes");
    // One level of two.
    let got = decode_chain(&[&db, &pa], &[ib, ia], n, &names[1..]).unwrap();
    assert!(got == b);
    // A base stored raw (the governor's choice on a fast disk): its bytes take the planes.
    let ra = encode(&Bytes::from(a.clone()), 2, CodecPolicy::Raw).to_bytes();
    let got = decode_chain(&[&dc, &db, &ra], &ids, n, &names).unwrap();
    assert!(got == c, "on a raw base");
    // A plain chunk alone is a chain of one.
    assert!(decode_chain(&[&pa], &[ia], n, &names[2..]).unwrap() == a);
    // A flipped byte in any level: the error names that level.
    for (level, obj) in [(0, &dc), (1, &db), (2, &pa)] {
        let mut bad = obj.to_vec();
        let at = bad.len() - 7;
        bad[at] ^= 0x10;
        let mut objs: Vec<&[u8]> = vec![&dc, &db, &pa];
        objs[level] = &bad;
        let e = decode_chain(&objs, &ids, n, &names).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Corrupt, "{e}");
        assert!(
            e.to_string().starts_with(&names[level]),
            "level {level}: {e}"
        );
    }
    // A level left out: the delta names another base than the chain.
    let e = decode_chain(&[&dc, &pa], &[ic, ia], n, &names[1..]).unwrap_err();
    assert!(e.to_string().contains("names base"), "{e}");
    assert!(e.to_string().starts_with("middle"), "{e}");
}

#[test]
fn the_sampled_estimate_picks_what_the_whole_chunk_shows() {
    // 4 MiB of bf16 weights; `small` changes a third of the elements in the lowest bit
    // (a delta pays), `large` replaces every element (a delta costs more than plain).
    let a = normal_bf16(2 << 20, 21);
    let small: Vec<u8> = a
        .chunks_exact(2)
        .enumerate()
        .flat_map(|(i, c)| {
            let v = u16::from_le_bytes([c[0], c[1]]);
            (if i % 3 == 0 { v ^ 1 } else { v }).to_le_bytes()
        })
        .collect();
    let large = normal_bf16(2 << 20, 22);
    let ia = ChunkId::of(&a);
    for (b, pays) in [(&small, true), (&large, false)] {
        let est = estimate_delta(b, &a, 2, 1);
        assert_eq!(est.sampled, 4 * ESTIMATE_WINDOW, "a sample, not the chunk");
        assert_eq!(est.pays(), pays, "{est:?}");
        let whole = encode_delta(b, &a, &ia, 2, 1).len();
        let plain = encode(&Bytes::from(b.clone()), 2, CodecPolicy::FAST).len();
        assert_eq!(
            whole * 10 <= plain * DELTA_MARGIN_TENTHS,
            pays,
            "{whole} vs {plain}"
        );
        // The estimate's ratios are those of the whole chunk, within a few hundredths.
        let (er, wr) = (
            est.delta as f64 / est.plain as f64,
            whole as f64 / plain as f64,
        );
        assert!(
            (er - wr).abs() < 0.05,
            "estimated {er:.3}, whole chunk {wr:.3}"
        );
    }
    // A chunk smaller than the windows is estimated whole.
    let est = estimate_delta(&small[..1000], &a[..1000], 2, 1);
    assert_eq!(est.sampled, 1000);
}

/// Every codec decodes straight into a destination, over several hash blocks and a tail of
/// fewer than a plane kernel's 64 elements, writing every byte (the destination starts as
/// garbage); a damaged object or a destination of the wrong length is refused by name.
#[test]
fn every_codec_decodes_into_a_destination_across_blocks() {
    // 3.05 blocks of fp32, and a tail of 3 elements past the last 64.
    let n = 200_003;
    let a = normal_f32(n, 7);
    // The next save: a third of the elements moved in their low mantissa bits.
    let b: Vec<u8> = a
        .chunks_exact(4)
        .enumerate()
        .flat_map(|(i, c)| {
            let v = u32::from_le_bytes(c.try_into().unwrap());
            (if i % 3 == 0 { v ^ 0x15 } else { v }).to_le_bytes()
        })
        .collect();
    let (ia, ib) = (ChunkId::of(&a), ChunkId::of(&b));
    let text: Vec<u8> = (0..a.len()).map(|i| b"checkpoint "[i % 11]).collect();
    let it = ChunkId::of(&text);
    let enc = |d: &[u8], elem, policy| encode(&Bytes::copy_from_slice(d), elem, policy).to_bytes();
    let (raw, planes) = (enc(&a, 4, CodecPolicy::Raw), enc(&a, 4, CodecPolicy::MAX));
    let zstd = enc(&text, 1, CodecPolicy::MAX);
    let bf16 = normal_bf16(n, 8);
    let ibf = ChunkId::of(&bf16);
    let pbf = enc(&bf16, 2, CodecPolicy::MAX);
    let delta = encode_delta(&b, &a, &ia, 4, 1).to_bytes();
    assert_eq!(
        [raw[5], planes[5], zstd[5], pbf[5], delta[5]],
        [
            Codec::Raw,
            Codec::Planes,
            Codec::Zstd,
            Codec::Planes,
            Codec::Delta
        ]
        .map(Codec::tag)
    );
    let names: Vec<String> = ["top", "base"].map(String::from).to_vec();
    // (what, the chain's objects, their ids, the plain bytes)
    type Case<'a> = (&'a str, Vec<&'a [u8]>, Vec<ChunkId>, &'a [u8]);
    let cases: Vec<Case<'_>> = vec![
        ("raw", vec![&raw], vec![ia], &a),
        ("fp32 planes", vec![&planes], vec![ia], &a),
        ("zstd", vec![&zstd], vec![it], &text),
        ("bf16 planes", vec![&pbf], vec![ibf], &bf16),
        ("a delta on planes", vec![&delta, &planes], vec![ib, ia], &b),
        ("a delta on raw", vec![&delta, &raw], vec![ib, ia], &b),
    ];
    for (what, objs, chain, want) in cases {
        let mut out = vec![0xA5u8; want.len()];
        decode_into(&objs, &chain, &names[..objs.len()], &mut out).unwrap();
        assert!(
            out == want,
            "{what}: decoded into the destination bit-exact"
        );
        // A flipped bit in the last block of any level's payload: refused, naming the level.
        for level in 0..objs.len() {
            let mut bad = objs[level].to_vec();
            let at = bad.len() - 9;
            bad[at] ^= 0x40;
            let mut damaged = objs.clone();
            damaged[level] = &bad;
            let e = decode_into(&damaged, &chain, &names[..objs.len()], &mut out).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::Corrupt, "{what}: {e}");
            assert!(
                e.to_string().starts_with(&names[level]),
                "{what}, level {level}: {e}"
            );
        }
        let mut short = vec![0u8; want.len() - 4];
        let e = decode_into(&objs, &chain, &names[..objs.len()], &mut short).unwrap_err();
        assert!(e.to_string().contains("bytes"), "{what}: {e}");
    }
}
