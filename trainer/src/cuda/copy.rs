//! Copy planning and issue: the contiguous runs of a sub-box, cut to a window, as 1-D and
//! 2-D copies (`cuMemcpy2D`) between strided device memory and a dense buffer.

use std::ffi::c_void;

use cudarc::driver::{DriverError, sys};

/// One copy between strided device memory and a dense buffer: `height` rows of `width` bytes,
/// rows `dev_pitch` apart at `dev` in the tensor, back to back at `dense` in the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Op {
    pub(super) dev: usize,
    pub(super) dense: usize,
    pub(super) width: usize,
    pub(super) height: usize,
    pub(super) dev_pitch: usize,
}

/// The largest pitch `cuMemcpy2D` takes on every device.
const MAX_PITCH: usize = (1 << 31) - 1;
/// Rows per 2-D copy at most (a conservative bound; longer runs take several copies).
const MAX_HEIGHT: usize = 65535;

/// The copies for bytes `offset .. offset + len` of a region given as `runs` (`(offset in
/// tensor, offset in region, length)`, in region order, tiling the region): partial runs at
/// both ends, whole runs of equal width and constant stride merged into 2-D copies.
pub(super) fn plan_window(runs: &[(usize, usize, usize)], offset: usize, len: usize) -> Vec<Op> {
    let end = offset + len;
    let mut ops: Vec<Op> = Vec::new();
    let first = runs.partition_point(|r| r.1 + r.2 <= offset);
    for &(dev, at, rlen) in &runs[first..] {
        if at >= end {
            break;
        }
        let a = offset.max(at);
        let b = end.min(at + rlen);
        if a >= b {
            continue;
        }
        let piece = Op {
            dev: dev + (a - at),
            dense: a - offset,
            width: b - a,
            height: 1,
            dev_pitch: b - a,
        };
        if let Some(last) = ops.last_mut()
            && extend(last, &piece)
        {
            continue;
        }
        ops.push(piece);
    }
    ops
}

fn extend(last: &mut Op, p: &Op) -> bool {
    if p.width != last.width || p.dense != last.dense + last.width * last.height {
        return false;
    }
    if last.height == 1 {
        let Some(pitch) = p.dev.checked_sub(last.dev) else {
            return false;
        };
        if pitch < last.width || pitch > MAX_PITCH {
            return false;
        }
        if pitch == last.width {
            // Contiguous on both sides: one wider row.
            last.width += p.width;
            last.dev_pitch = last.width;
            return true;
        }
        last.dev_pitch = pitch;
        last.height = 2;
        true
    } else if p.dev == last.dev + last.dev_pitch * last.height && last.height < MAX_HEIGHT {
        last.height += 1;
        true
    } else {
        false
    }
}

/// Where the dense side of a copy is.
#[derive(Clone, Copy)]
pub(super) enum Dense {
    Host(*mut u8),
    Device(sys::CUdeviceptr),
}

/// Enqueue `op` between device memory at `dev` (strided side) and `dense`, on `stream`:
/// device to dense when `to_dense`, else dense to device. The context must be current.
///
/// # Safety
/// Both sides must be valid for the op's extent until the stream has run the copy.
pub(super) unsafe fn enqueue(
    op: &Op,
    dev: sys::CUdeviceptr,
    dense: Dense,
    to_dense: bool,
    stream: sys::CUstream,
) -> std::result::Result<(), DriverError> {
    let d = dev + op.dev as u64;
    if op.height == 1 {
        // SAFETY: the caller guarantees both ranges.
        unsafe {
            return match (dense, to_dense) {
                (Dense::Host(h), true) => {
                    sys::cuMemcpyDtoHAsync_v2(h.add(op.dense) as *mut c_void, d, op.width, stream)
                }
                (Dense::Host(h), false) => {
                    sys::cuMemcpyHtoDAsync_v2(d, h.add(op.dense) as *const c_void, op.width, stream)
                }
                (Dense::Device(x), true) => {
                    sys::cuMemcpyDtoDAsync_v2(x + op.dense as u64, d, op.width, stream)
                }
                (Dense::Device(x), false) => {
                    sys::cuMemcpyDtoDAsync_v2(d, x + op.dense as u64, op.width, stream)
                }
            }
            .result();
        }
    }
    use sys::CUmemorytype as M;
    let (dense_type, dense_host, dense_dev) = match dense {
        // SAFETY: within the caller's buffer.
        Dense::Host(h) => (M::CU_MEMORYTYPE_HOST, unsafe { h.add(op.dense) }, 0),
        Dense::Device(x) => (
            M::CU_MEMORYTYPE_DEVICE,
            std::ptr::null_mut(),
            x + op.dense as u64,
        ),
    };
    let (strided_type, strided_dev) = (M::CU_MEMORYTYPE_DEVICE, d);
    let p = if to_dense {
        sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: strided_type,
            srcHost: std::ptr::null(),
            srcDevice: strided_dev,
            srcArray: std::ptr::null_mut(),
            srcPitch: op.dev_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: dense_type,
            dstHost: dense_host as *mut c_void,
            dstDevice: dense_dev,
            dstArray: std::ptr::null_mut(),
            dstPitch: op.width,
            WidthInBytes: op.width,
            Height: op.height,
        }
    } else {
        sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: dense_type,
            srcHost: dense_host as *const c_void,
            srcDevice: dense_dev,
            srcArray: std::ptr::null_mut(),
            srcPitch: op.width,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: strided_type,
            dstHost: std::ptr::null_mut(),
            dstDevice: strided_dev,
            dstArray: std::ptr::null_mut(),
            dstPitch: op.dev_pitch,
            WidthInBytes: op.width,
            Height: op.height,
        }
    };
    // SAFETY: the descriptor is complete; the caller guarantees both ranges.
    unsafe { sys::cuMemcpy2DAsync_v2(&p, stream) }.result()
}

#[cfg(test)]
#[cfg(test)]
mod tests {
    use ckpt_store::NdBox;

    use super::*;

    /// Apply ops as the driver would: strided tensor bytes -> dense window.
    fn gather(ops: &[Op], tensor: &[u8], out: &mut [u8]) {
        for op in ops {
            for r in 0..op.height {
                let s = op.dev + r * op.dev_pitch;
                let d = op.dense + r * op.width;
                out[d..d + op.width].copy_from_slice(&tensor[s..s + op.width]);
            }
        }
    }

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    #[test]
    fn windows_of_sub_boxes_become_few_copies_with_the_right_bytes() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        for case in 0..300 {
            let nd = 1 + (rng(&mut seed) % 3) as usize;
            let shape: Vec<u64> = (0..nd).map(|_| 1 + rng(&mut seed) % 9).collect();
            let held = NdBox::full(&shape);
            let mut off = Vec::new();
            let mut len = Vec::new();
            for &s in &shape {
                let o = rng(&mut seed) % s;
                let l = 1 + rng(&mut seed) % (s - o);
                off.push(o);
                len.push(l);
            }
            let sub = NdBox::new(off, len).unwrap();
            let elem = [1usize, 2, 4][(rng(&mut seed) % 3) as usize];
            let tensor: Vec<u8> = (0..held.numel() as usize * elem)
                .map(|i| (i * 31 + case) as u8)
                .collect();
            let mut runs = Vec::new();
            ckpt_store::model::copy_runs(&held, &sub, &sub, elem, |s, d, l| {
                runs.push((s as usize, d as usize, l as usize))
            });
            let total = sub.numel() as usize * elem;
            let mut want = vec![0u8; total];
            for &(s, d, l) in &runs {
                want[d..d + l].copy_from_slice(&tensor[s..s + l]);
            }
            // Whole, and random windows.
            for _ in 0..5 {
                let a = (rng(&mut seed) as usize) % total;
                let b = a + 1 + (rng(&mut seed) as usize) % (total - a);
                let ops = plan_window(&runs, a, b - a);
                let mut got = vec![0u8; b - a];
                gather(&ops, &tensor, &mut got);
                assert_eq!(got, want[a..b], "case {case} window {a}..{b} ops {ops:?}");
                let covered: usize = ops.iter().map(|o| o.width * o.height).sum();
                assert_eq!(covered, b - a, "ops cover the window exactly once");
                assert!(ops.iter().all(|o| o.dev_pitch >= o.width));
            }
            let ops = plan_window(&runs, 0, total);
            assert!(ops.len() <= 3 * sub.numel().max(1) as usize);
        }
    }

    #[test]
    fn a_column_block_is_one_2d_copy() {
        // [1000, 64] f32, columns 16..48: 1000 rows of 128 bytes, 256 bytes apart.
        let held = NdBox::full(&[1000, 64]);
        let sub = NdBox::new(vec![0, 16], vec![1000, 32]).unwrap();
        let mut runs = Vec::new();
        ckpt_store::model::copy_runs(&held, &sub, &sub, 4, |s, d, l| {
            runs.push((s as usize, d as usize, l as usize))
        });
        assert_eq!(runs.len(), 1000);
        let ops = plan_window(&runs, 0, 1000 * 128);
        assert_eq!(
            ops,
            vec![Op {
                dev: 64,
                dense: 0,
                width: 128,
                height: 1000,
                dev_pitch: 256
            }]
        );
        // A window cutting rows: head, body, tail.
        let ops = plan_window(&runs, 100, 128 * 10);
        assert_eq!(ops.len(), 3, "{ops:?}");
        assert_eq!(ops[1].height, 9);
    }
}
