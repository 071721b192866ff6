//! Byte planes: an element's bytes split into separate planes and joined back (or XORed into
//! a base, for deltas), by block kernels the compiler vectorizes.

/// Split `data` (elements of `elem` bytes, little-endian) into byte planes. With `rotate`,
/// each element is first rotated left by one bit, which moves the sign bit of a float to the
/// lowest plane and its whole exponent into the highest one (bf16 and fp32: exactly the
/// exponent byte), where it compresses best.
pub fn split_planes(data: &[u8], elem: usize, rotate: bool) -> Vec<Vec<u8>> {
    let n = data.len() / elem;
    let mut planes: Vec<Vec<u8>> = (0..elem).map(|_| vec![0u8; n]).collect();
    let mut refs: Vec<&mut [u8]> = planes.iter_mut().map(Vec::as_mut_slice).collect();
    match (elem, rotate) {
        (2, true) => split_words::<u16, 1>(data, &mut refs),
        (2, false) => split_words::<u16, 0>(data, &mut refs),
        (4, true) => split_words::<u32, 1>(data, &mut refs),
        (4, false) => split_words::<u32, 0>(data, &mut refs),
        (8, true) => split_words::<u64, 1>(data, &mut refs),
        (8, false) => split_words::<u64, 0>(data, &mut refs),
        _ => {
            for (i, c) in data.chunks_exact(elem).enumerate() {
                for (k, byte) in c.iter().enumerate() {
                    refs[k][i] = *byte;
                }
            }
        }
    }
    planes
}

/// Interleave byte planes back into `out` (the inverse of [`split_planes`]).
pub fn join_planes(planes: &[&[u8]], out: &mut [u8], rotated: bool) {
    join_planes_as::<false>(planes, out, rotated);
}

/// [`join_planes`] XORed into `out` instead of stored: applies a delta's planes to its base
/// in one pass.
pub(super) fn xor_planes_into(planes: &[&[u8]], out: &mut [u8], rotated: bool) {
    join_planes_as::<true>(planes, out, rotated);
}

fn join_planes_as<const XOR: bool>(planes: &[&[u8]], out: &mut [u8], rotated: bool) {
    let elem = planes.len();
    // The 16-element blocks of bf16 and fp32 by SSE2 kernels (every x86-64 CPU has SSE2),
    // the tail by the portable ones.
    #[cfg(target_arch = "x86_64")]
    if matches!(elem, 2 | 4) {
        let done = x86::join::<XOR>(planes, out, rotated);
        let tails: [&[u8]; 4] =
            std::array::from_fn(|k| planes.get(k).map_or(&[][..], |p| &p[done..]));
        return join_portable::<XOR>(&tails[..elem], &mut out[done * elem..], rotated);
    }
    join_portable::<XOR>(planes, out, rotated);
}

/// [`join_planes_as`] by the portable block kernels.
fn join_portable<const XOR: bool>(planes: &[&[u8]], out: &mut [u8], rotated: bool) {
    let elem = planes.len();
    match (elem, rotated) {
        (2, true) => join_words::<u16, 1, XOR>(planes, out),
        (2, false) => join_words::<u16, 0, XOR>(planes, out),
        (4, true) => join_words::<u32, 1, XOR>(planes, out),
        (4, false) => join_words::<u32, 0, XOR>(planes, out),
        (8, true) => join_words::<u64, 1, XOR>(planes, out),
        (8, false) => join_words::<u64, 0, XOR>(planes, out),
        _ => {
            for (i, c) in out.chunks_exact_mut(elem).enumerate() {
                for (k, byte) in c.iter_mut().enumerate() {
                    *byte = if XOR {
                        *byte ^ planes[k][i]
                    } else {
                        planes[k][i]
                    };
                }
            }
        }
    }
}

/// Elements a plane kernel moves per block: a fixed-size block lets the compiler drop the
/// bounds checks and vectorize (8 GB/s for fp32 on this machine's CPU, 0.6-2.8 GB/s for the
/// element-at-a-time loop it replaces, which was a restore's bottleneck).
const PLANE_BLOCK: usize = 64;

/// An element as an integer word of 2, 4 or 8 bytes, for the byte-plane kernels.
trait Word:
    Copy
    + Default
    + std::ops::BitOr<Output = Self>
    + std::ops::BitXor<Output = Self>
    + std::ops::Shl<u32, Output = Self>
    + std::ops::Shr<u32, Output = Self>
{
    const BYTES: usize;
    fn from_byte(b: u8) -> Self;
    fn low_byte(self) -> u8;
    fn rotate_right(self, r: u32) -> Self;
    fn rotate_left(self, r: u32) -> Self;
    fn store(self, out: &mut [u8]);
    fn load(b: &[u8]) -> Self;
}

macro_rules! plane_word {
    ($($t:ty),*) => {$(
        impl Word for $t {
            const BYTES: usize = std::mem::size_of::<$t>();
            #[inline(always)]
            fn from_byte(b: u8) -> Self {
                <$t>::from(b)
            }
            #[inline(always)]
            fn low_byte(self) -> u8 {
                self as u8
            }
            #[inline(always)]
            fn rotate_right(self, r: u32) -> Self {
                <$t>::rotate_right(self, r)
            }
            #[inline(always)]
            fn rotate_left(self, r: u32) -> Self {
                <$t>::rotate_left(self, r)
            }
            #[inline(always)]
            fn store(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            #[inline(always)]
            fn load(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("one element"))
            }
        }
    )*};
}
plane_word!(u16, u32, u64);

/// [`join_planes`] for elements of `W::BYTES` bytes rotated by `R` bits; with `XOR`, XORed
/// into `out`.
fn join_words<W: Word, const R: u32, const XOR: bool>(planes: &[&[u8]], out: &mut [u8]) {
    let e = W::BYTES;
    let n = out.len() / e;
    let blocks = n / PLANE_BLOCK;
    for k in 0..blocks {
        let at = k * PLANE_BLOCK;
        let mut words = [W::default(); PLANE_BLOCK];
        for (s, plane) in planes.iter().enumerate() {
            let bytes: &[u8; PLANE_BLOCK] =
                plane[at..at + PLANE_BLOCK].try_into().expect("a block");
            for (w, b) in words.iter_mut().zip(bytes) {
                *w = *w | (W::from_byte(*b) << (8 * s as u32));
            }
        }
        let dst = &mut out[at * e..(at + PLANE_BLOCK) * e];
        for (o, w) in dst.chunks_exact_mut(e).zip(words) {
            put_word::<W, R, XOR>(w, o);
        }
    }
    for i in blocks * PLANE_BLOCK..n {
        let mut w = W::default();
        for (s, plane) in planes.iter().enumerate() {
            w = w | (W::from_byte(plane[i]) << (8 * s as u32));
        }
        put_word::<W, R, XOR>(w, &mut out[i * e..(i + 1) * e]);
    }
}

#[inline(always)]
fn put_word<W: Word, const R: u32, const XOR: bool>(w: W, o: &mut [u8]) {
    let w = w.rotate_right(R);
    if XOR {
        (W::load(o) ^ w).store(o);
    } else {
        w.store(o);
    }
}

/// [`split_planes`] for elements of `W::BYTES` bytes rotated by `R` bits.
fn split_words<W: Word, const R: u32>(data: &[u8], planes: &mut [&mut [u8]]) {
    let e = W::BYTES;
    let n = data.len() / e;
    let blocks = n / PLANE_BLOCK;
    for k in 0..blocks {
        let at = k * PLANE_BLOCK;
        let mut words = [W::default(); PLANE_BLOCK];
        let src = &data[at * e..(at + PLANE_BLOCK) * e];
        for (w, c) in words.iter_mut().zip(src.chunks_exact(e)) {
            *w = W::load(c).rotate_left(R);
        }
        for (s, plane) in planes.iter_mut().enumerate() {
            let bytes: &mut [u8; PLANE_BLOCK] = (&mut plane[at..at + PLANE_BLOCK])
                .try_into()
                .expect("a block");
            for (b, w) in bytes.iter_mut().zip(words) {
                *b = (w >> (8 * s as u32)).low_byte();
            }
        }
    }
    for i in blocks * PLANE_BLOCK..n {
        let w = W::load(&data[i * e..(i + 1) * e]).rotate_left(R);
        for (s, plane) in planes.iter_mut().enumerate() {
            plane[i] = (w >> (8 * s as u32)).low_byte();
        }
    }
}

/// `acc ^= p`, byte by byte (the same length).
pub(super) fn xor_into(acc: &mut [u8], p: &[u8]) {
    for (a, b) in acc.iter_mut().zip(p) {
        *a ^= b;
    }
}

/// SSE2 kernels joining byte planes (every x86-64 CPU has SSE2): 16 elements at a time, the
/// planes' bytes interleaved by unpack instructions, about twice the portable kernels' speed
/// (5.9 against 3.0-3.3 GB/s joining fp32 planes into memory not in the cache, on this
/// machine's CPU).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm_or_si128, _mm_slli_epi16, _mm_slli_epi32, _mm_srli_epi16,
        _mm_srli_epi32, _mm_storeu_si128, _mm_unpackhi_epi8, _mm_unpackhi_epi16, _mm_unpacklo_epi8,
        _mm_unpacklo_epi16, _mm_xor_si128,
    };

    /// Join (with `XOR`, XOR into `out`) the whole 16-element blocks of 2- or 4-byte elements'
    /// planes into `out`; the number of elements done.
    pub(super) fn join<const XOR: bool>(planes: &[&[u8]], out: &mut [u8], rotated: bool) -> usize {
        let elem = planes.len();
        assert!(matches!(elem, 2 | 4), "2- or 4-byte elements");
        let n = out.len() / elem;
        assert!(
            planes.iter().all(|p| p.len() >= n),
            "planes of the output's elements"
        );
        let blocks = n / 16;
        for k in 0..blocks {
            let at = k * 16;
            // SAFETY: every plane holds `n` bytes or more and `at + 16 <= n`; the output holds
            // `n * elem` bytes and this block writes `(at .. at + 16) * elem` of them. Unaligned
            // loads and stores.
            unsafe {
                let load = |p: &[u8]| _mm_loadu_si128(p.as_ptr().add(at).cast::<__m128i>());
                let o = out.as_mut_ptr().add(at * elem).cast::<__m128i>();
                let words = if elem == 2 {
                    let (a, b) = (load(planes[0]), load(planes[1]));
                    let w = [_mm_unpacklo_epi8(a, b), _mm_unpackhi_epi8(a, b)];
                    [w[0], w[1], w[0], w[1]]
                } else {
                    let (a, b) = (load(planes[0]), load(planes[1]));
                    let (c, d) = (load(planes[2]), load(planes[3]));
                    let (ab_lo, ab_hi) = (_mm_unpacklo_epi8(a, b), _mm_unpackhi_epi8(a, b));
                    let (cd_lo, cd_hi) = (_mm_unpacklo_epi8(c, d), _mm_unpackhi_epi8(c, d));
                    [
                        _mm_unpacklo_epi16(ab_lo, cd_lo),
                        _mm_unpackhi_epi16(ab_lo, cd_lo),
                        _mm_unpacklo_epi16(ab_hi, cd_hi),
                        _mm_unpackhi_epi16(ab_hi, cd_hi),
                    ]
                };
                for (j, w) in words.into_iter().take(elem).enumerate() {
                    // The split rotated each element left by one bit: rotate it back.
                    let w = match (rotated, elem) {
                        (false, _) => w,
                        (true, 2) => _mm_or_si128(_mm_srli_epi16::<1>(w), _mm_slli_epi16::<15>(w)),
                        (true, _) => _mm_or_si128(_mm_srli_epi32::<1>(w), _mm_slli_epi32::<31>(w)),
                    };
                    let w = if XOR {
                        _mm_xor_si128(_mm_loadu_si128(o.add(j)), w)
                    } else {
                        w
                    };
                    _mm_storeu_si128(o.add(j), w);
                }
            }
        }
        blocks * 16
    }
}
