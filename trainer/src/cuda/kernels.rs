//! Small kernels (PTX, JIT-compiled by the driver: no toolkit needed): compare two buffers on
//! the device, and keep the GPU busy for a while (tests and benchmarks).

use std::ffi::{CString, c_void};
use std::sync::Arc;

use ckpt_store::Result;
use cudarc::driver::{CudaContext, result, sys};

use super::cu;

const KERNELS_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry ckpt_count_diff(
    .param .u64 p_a,
    .param .u64 p_b,
    .param .u64 p_n,
    .param .u64 p_out
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_a];
    ld.param.u64 %rd2, [p_b];
    ld.param.u64 %rd3, [p_n];
    ld.param.u64 %rd4, [p_out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    cvta.to.global.u64 %rd4, %rd4;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd5, %r1, %r2;
    cvt.u64.u32 %rd6, %r3;
    add.u64 %rd5, %rd5, %rd6;
    mul.wide.u32 %rd7, %r4, %r2;
    mov.u64 %rd8, 0;
$L_loop:
    setp.ge.u64 %p1, %rd5, %rd3;
    @%p1 bra $L_done;
    add.u64 %rd9, %rd1, %rd5;
    add.u64 %rd10, %rd2, %rd5;
    ld.global.u8 %r5, [%rd9];
    ld.global.u8 %r6, [%rd10];
    setp.ne.u32 %p2, %r5, %r6;
    @%p2 add.u64 %rd8, %rd8, 1;
    add.u64 %rd5, %rd5, %rd7;
    bra.uni $L_loop;
$L_done:
    setp.eq.u64 %p1, %rd8, 0;
    @%p1 bra $L_end;
    atom.global.add.u64 %rd11, [%rd4], %rd8;
$L_end:
    ret;
}

.visible .entry ckpt_spin(
    .param .u64 p_ns
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [p_ns];
    mov.u64 %rd2, %globaltimer;
$L_spin:
    mov.u64 %rd3, %globaltimer;
    sub.u64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra.uni $L_spin;
    ret;
}
"#;

pub(super) struct Kernels {
    pub(super) module: sys::CUmodule,
    pub(super) count_diff: sys::CUfunction,
    pub(super) spin: sys::CUfunction,
}

// SAFETY: module and function handles are plain driver handles, usable from any thread.
unsafe impl Send for Kernels {}
// SAFETY: as above; launching does not mutate the handles.
unsafe impl Sync for Kernels {}

impl Kernels {
    pub(super) fn load(ctx: &Arc<CudaContext>) -> Result<Kernels> {
        let src = CString::new(KERNELS_PTX).expect("no NUL in the PTX");
        cu("loading the ckpt kernels (PTX)", || {
            ctx.bind_to_thread()?;
            // SAFETY: a NUL-terminated PTX image; the module lives as long as the Gpu.
            unsafe {
                let module = result::module::load_data(src.as_ptr() as *const c_void)?;
                let count_diff =
                    result::module::get_function(module, CString::new("ckpt_count_diff").unwrap())?;
                let spin =
                    result::module::get_function(module, CString::new("ckpt_spin").unwrap())?;
                Ok(Kernels {
                    module,
                    count_diff,
                    spin,
                })
            }
        })
    }
}
