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

/// The kernels that join planes: the best this CPU has is used; tests run each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kernel {
    /// Blocks the compiler vectorizes, any element size (on x86-64 only for the tails, and
    /// in tests).
    #[cfg_attr(all(target_arch = "x86_64", not(test)), allow(dead_code))]
    Portable,
    /// 16 bf16 or fp32 elements at a time (every x86-64 CPU).
    #[cfg(target_arch = "x86_64")]
    Sse2,
    /// 32 bf16 or fp32 elements at a time, where the CPU has AVX2.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Kernel {
    /// The kernels this CPU can run, the best last.
    #[cfg(test)]
    pub(super) fn available() -> Vec<Kernel> {
        #[cfg(target_arch = "x86_64")]
        {
            let mut k = vec![Kernel::Portable, Kernel::Sse2];
            if std::arch::is_x86_feature_detected!("avx2") {
                k.push(Kernel::Avx2);
            }
            k
        }
        #[cfg(not(target_arch = "x86_64"))]
        vec![Kernel::Portable]
    }

    /// The best kernel this CPU can run (the feature test is cached by `std`).
    fn best() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                return Kernel::Avx2;
            }
            Kernel::Sse2
        }
        #[cfg(not(target_arch = "x86_64"))]
        Kernel::Portable
    }
}

fn join_planes_as<const XOR: bool>(planes: &[&[u8]], out: &mut [u8], rotated: bool) {
    join_planes_by::<XOR>(Kernel::best(), planes, out, rotated);
}

/// [`join_planes_as`] by `kernel`: its whole blocks of bf16 and fp32 elements, the tail (and
/// any other element size) by the portable kernels.
pub(super) fn join_planes_by<const XOR: bool>(
    kernel: Kernel,
    planes: &[&[u8]],
    out: &mut [u8],
    rotated: bool,
) {
    let elem = planes.len();
    let done = match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Sse2 if matches!(elem, 2 | 4) => x86::join::<XOR>(planes, out, rotated),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 if matches!(elem, 2 | 4) => {
            assert!(
                std::arch::is_x86_feature_detected!("avx2"),
                "the AVX2 kernel on a CPU without AVX2"
            );
            // SAFETY: the CPU has AVX2 (checked above).
            unsafe { x86::join_avx2::<XOR>(planes, out, rotated) }
        }
        _ => 0,
    };
    if done == 0 {
        return join_portable::<XOR>(planes, out, rotated);
    }
    let tails: [&[u8]; 4] = std::array::from_fn(|k| planes.get(k).map_or(&[][..], |p| &p[done..]));
    join_portable::<XOR>(&tails[..elem], &mut out[done * elem..], rotated);
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

/// x86-64 kernels joining byte planes, the planes' bytes interleaved by unpack instructions:
/// SSE2 (every x86-64 CPU has it), 16 elements at a time, about twice the portable kernels'
/// speed (5.9 against 3.0-3.3 GB/s joining fp32 planes into memory not in the cache, on this
/// machine's CPU); AVX2 where the CPU has it, 32 at a time (4.3-6.1 against SSE2's 2.8-4.7
/// GB/s in the same runs, and 9 % less CPU for a restore of compressed planes).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm_or_si128, _mm_slli_epi16, _mm_slli_epi32, _mm_srli_epi16,
        _mm_srli_epi32, _mm_storeu_si128, _mm_unpackhi_epi8, _mm_unpackhi_epi16, _mm_unpacklo_epi8,
        _mm_unpacklo_epi16, _mm_xor_si128,
    };

    /// The element size of `planes` (2 or 4 bytes) and how many whole blocks of `width`
    /// elements `out` holds; every plane must hold at least `out`'s elements (what makes the
    /// kernels' unchecked loads and stores sound).
    fn whole_blocks(planes: &[&[u8]], out: &[u8], width: usize) -> (usize, usize) {
        let elem = planes.len();
        assert!(matches!(elem, 2 | 4), "2- or 4-byte elements");
        let n = out.len() / elem;
        assert!(
            planes.iter().all(|p| p.len() >= n),
            "planes of the output's elements"
        );
        (elem, n / width)
    }

    /// Join (with `XOR`, XOR into `out`) the whole 16-element blocks of 2- or 4-byte elements'
    /// planes into `out`; the number of elements done.
    pub(super) fn join<const XOR: bool>(planes: &[&[u8]], out: &mut [u8], rotated: bool) -> usize {
        let (elem, blocks) = whole_blocks(planes, out, 16);
        for k in 0..blocks {
            let at = k * 16;
            // SAFETY: `whole_blocks`: every plane holds `n` (the output's elements) bytes or more
            // and `at + 16 <= n`; the output holds `n * elem` bytes and this block writes
            // `(at .. at + 16) * elem` of them. Unaligned loads and stores.
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

    /// [`join`] 32 elements at a time with AVX2 (the unpacks work within each 128-bit lane:
    /// the lanes' halves are put in order by `permute2x128`); the number of elements done.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn join_avx2<const XOR: bool>(
        planes: &[&[u8]],
        out: &mut [u8],
        rotated: bool,
    ) -> usize {
        use std::arch::x86_64::{
            __m256i, _mm256_loadu_si256, _mm256_or_si256, _mm256_permute2x128_si256,
            _mm256_slli_epi16, _mm256_slli_epi32, _mm256_srli_epi16, _mm256_srli_epi32,
            _mm256_storeu_si256, _mm256_unpackhi_epi8, _mm256_unpackhi_epi16, _mm256_unpacklo_epi8,
            _mm256_unpacklo_epi16, _mm256_xor_si256,
        };
        let (elem, blocks) = whole_blocks(planes, out, 32);
        for k in 0..blocks {
            let at = k * 32;
            // SAFETY: `whole_blocks`: every plane holds `n` (the output's elements) bytes or more
            // and `at + 32 <= n`; the output holds `n * elem` bytes and this block writes
            // `(at .. at + 32) * elem` of them. Unaligned loads and stores.
            unsafe {
                let load = |p: &[u8]| _mm256_loadu_si256(p.as_ptr().add(at).cast::<__m256i>());
                let o = out.as_mut_ptr().add(at * elem).cast::<__m256i>();
                // Each unpack's lane 0 holds elements of the block's first 16, lane 1 of its
                // second 16.
                let words: [__m256i; 4] = if elem == 2 {
                    let (a, b) = (load(planes[0]), load(planes[1]));
                    let (lo, hi) = (_mm256_unpacklo_epi8(a, b), _mm256_unpackhi_epi8(a, b));
                    let w0 = _mm256_permute2x128_si256::<0x20>(lo, hi);
                    let w1 = _mm256_permute2x128_si256::<0x31>(lo, hi);
                    [w0, w1, w0, w1]
                } else {
                    let (a, b) = (load(planes[0]), load(planes[1]));
                    let (c, d) = (load(planes[2]), load(planes[3]));
                    let (ab_lo, ab_hi) = (_mm256_unpacklo_epi8(a, b), _mm256_unpackhi_epi8(a, b));
                    let (cd_lo, cd_hi) = (_mm256_unpacklo_epi8(c, d), _mm256_unpackhi_epi8(c, d));
                    // Lane 0: elements 0-3, 4-7, 8-11, 12-15; lane 1: 16-19, ... 28-31.
                    let q0 = _mm256_unpacklo_epi16(ab_lo, cd_lo);
                    let q1 = _mm256_unpackhi_epi16(ab_lo, cd_lo);
                    let q2 = _mm256_unpacklo_epi16(ab_hi, cd_hi);
                    let q3 = _mm256_unpackhi_epi16(ab_hi, cd_hi);
                    [
                        _mm256_permute2x128_si256::<0x20>(q0, q1),
                        _mm256_permute2x128_si256::<0x20>(q2, q3),
                        _mm256_permute2x128_si256::<0x31>(q0, q1),
                        _mm256_permute2x128_si256::<0x31>(q2, q3),
                    ]
                };
                for (j, w) in words.into_iter().take(elem).enumerate() {
                    // The split rotated each element left by one bit: rotate it back.
                    let w = match (rotated, elem) {
                        (false, _) => w,
                        (true, 2) => {
                            _mm256_or_si256(_mm256_srli_epi16::<1>(w), _mm256_slli_epi16::<15>(w))
                        }
                        (true, _) => {
                            _mm256_or_si256(_mm256_srli_epi32::<1>(w), _mm256_slli_epi32::<31>(w))
                        }
                    };
                    let w = if XOR {
                        _mm256_xor_si256(_mm256_loadu_si256(o.add(j)), w)
                    } else {
                        w
                    };
                    _mm256_storeu_si256(o.add(j), w);
                }
            }
        }
        blocks * 32
    }
}
